"""A stage's prefix cache wired to its sessions (spec §4.3, §4.4): restore into a session,
record from its prefill ledger, roll a restore back.

A request's namespace is the stage's base `CacheNamespace` plus the digest of its
`prompt_cache_key` (None: the shared default). Every method that touches a session or the
cache runs on the stage's engine thread (`PrefixCache` is not thread-safe, spec §3.5);
`stats()` may be read anywhere. Failures fail open (spec §4.6): the stage serves with cold
prefill and a logged reason.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from ..protocol.configs import KvCacheConfig
from .disk_cache import DiskCache
from .prefix_cache import PrefixCache, RecordResult
from .prefix_identity import CacheNamespace, cacheable_prefix_length, model_digest
from .session import Session

log = logging.getLogger("skippy.runtime")

NO_RECORD = RecordResult(0, 0)


class StagePrefixCache:
    def __init__(self, cache: PrefixCache, base: CacheNamespace, *, mode: str = "auto",
                 disk: DiskCache | None = None, config: KvCacheConfig | None = None):
        self.cache, self.base, self.mode, self.disk = cache, base, mode, disk
        self.config = config or KvCacheConfig(mode=mode)  # as asked for: budgets, disk tier
        self.rollbacks = 0          # restores dropped because a stage below missed
        self.restore_errors = 0     # counted by the callers, which treat them as misses
        self.record_errors = 0

    @classmethod
    def build(cls, config: KvCacheConfig, *, model_path: str, layer_start: int, layer_end: int,
              kv_dtype: Any, ctx_size: int, weights: str = "") -> StagePrefixCache | None:
        """The cache a stage's config asks for, or None (mode "disabled", or it fails open)."""
        if config.mode == "disabled":
            return None
        try:
            digest = model_digest(model_path)
        except (OSError, ValueError) as error:
            log.warning("prefix cache disabled: cannot digest the model at %s (%s)", model_path,
                        error)
            return None
        base = CacheNamespace(digest, layer_start, layer_end,
                              str(kv_dtype).removeprefix("torch."), ctx_size, weights=weights)
        disk = None
        try:
            disk = DiskCache.from_config(config)
        except OSError as error:
            log.warning("prefix cache: disk tier at %s unusable (%s); memory only",
                        config.disk_dir, error)
        return cls(PrefixCache.from_config(config, disk=disk, disk_policy=config.disk_policy),
                   base, mode=config.mode, disk=disk, config=config)

    @property
    def lookup_enabled(self) -> bool:
        return self.mode in ("auto", "lookup-record")

    @property
    def record_enabled(self) -> bool:
        return self.mode in ("auto", "record", "lookup-record")

    def namespace(self, digest: bytes | None) -> CacheNamespace:
        return self.base.with_namespace(None if digest is None else digest.hex())

    # -- the engine thread only -------------------------------------------------------------
    def restore(self, session: Session, tokens: list[int], *, longest: bool,
                new_cache: Callable[[], Any]) -> int:
        """Restore the longest cached prefix of `tokens` on the ladder (stage 0), or exactly
        `tokens` (the stages below), into the session: its KV and its ledger. Returns the
        restored length, 0 on a miss (the session is then untouched)."""
        session.check_active()
        if not self.lookup_enabled or not tokens:
            return 0
        ns = self.namespace(session.cache_namespace)
        lookup = self.cache.lookup_longest if longest else self.cache.lookup
        hit = lookup(ns, tokens, pin=True)
        if hit is None:
            return 0
        try:  # the pin keeps the entry from eviction while we copy it (spec §4.5)
            if session.cache is None:
                session.cache = new_cache()
            session.cache.restore(hit.snapshot)
            session.ledger[:] = tokens[:hit.num_tokens]   # seeds the ledger (spec §4.3)
            session.verify_windows.clear()
        except BaseException:
            self._reset(session)  # a half-copied restore must not stay behind
            raise
        finally:
            self.cache.unpin(hit.key)
        return hit.num_tokens

    def record(self, session: Session) -> RecordResult:
        """Record the session's prefill: the cacheable prefix of its prompt (the ledger up to
        prompt_token_count - 1, as far as the KV and known token ids reach)."""
        if not self.record_enabled or session.cache is None or session.prompt_token_count < 1:
            return NO_RECORD
        end = min(cacheable_prefix_length(session.prompt_token_count), session.cache.length,
                  len(session.ledger))
        tokens = session.ledger[:end]
        if -1 in tokens:   # a frame without token ids: only the known prefix is exact
            tokens = tokens[:tokens.index(-1)]
        if len(tokens) < self.cache.min_tokens:
            return NO_RECORD
        try:
            return self.cache.record(self.namespace(session.cache_namespace), tokens,
                                     session.cache.snapshot)
        except Exception as error:  # noqa: BLE001 - a failed record never fails the request
            self.record_errors += 1
            log.warning("prefix cache: record failed (%s: %s)", type(error).__name__, error)
            return NO_RECORD

    def rollback(self, session: Session) -> None:
        """Forget a restore: the session holds no positions again (its sampling stays)."""
        self.rollbacks += 1
        self._reset(session)

    @staticmethod
    def _reset(session: Session) -> None:
        if session.cache is not None:
            session.cache.truncate(0)
        session.ledger.clear()
        session.verify_windows.clear()

    def close(self) -> int:
        """At shutdown, with the engine stopped: write what memory holds to the disk tier
        (policy "evict": only evicted entries were written so far). Returns how many."""
        if self.disk is None or self.cache.disk_policy != "evict":
            return 0
        try:
            return self.cache.flush()
        except OSError as error:
            log.warning("prefix cache: flush to %s failed (%s)", self.disk.root, error)
            return 0

    # -- anywhere -------------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        """Counters and gauges for /metrics and telemetry (numbers only)."""
        out = dataclasses.asdict(self.cache.stats)   # memory: hits, misses, evictions...
        out["rollbacks"] = self.rollbacks
        out["restore_errors"] = self.restore_errors
        out["record_errors"] = self.record_errors
        if self.disk is not None:                     # the disk tier's own view
            out.update({f"disk_tier_{k}": v for k, v in dataclasses.asdict(self.disk.stats).items()})
        return out
