"""A stage's exact prefix KV cache: LRU over snapshots, bounded by entries and bytes (spec §4.3–§4.5).

Bookkeeping only: a snapshot is opaque here (the cache reads its `nbytes`). An optional lower
tier (`DiskCache`) takes what memory evicts (or everything recorded) and is probed on a memory
miss. Eviction never touches a pinned entry (a session restoring it holds a pin). Not
thread-safe: the stage's engine thread only (spec §3.5); `stats` may be read anywhere.
"""

from __future__ import annotations

import dataclasses
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Literal, NamedTuple, Protocol, Sequence

from ..protocol.configs import KvCacheConfig
from .prefix_identity import CacheNamespace, candidate_lengths, prefix_keys, record_lengths


class LowerTier(Protocol):
    def __contains__(self, key: str) -> bool: ...
    def get(self, key: str) -> Any | None: ...
    def put(self, key: str, snapshot: Any) -> bool: ...


@dataclass(slots=True)
class PrefixCacheStats:
    hits: int = 0               # lookups that found a prefix (memory or disk)
    misses: int = 0
    disk_hits: int = 0          # hits served from the lower tier
    evictions: int = 0          # entries dropped from memory
    spilled: int = 0            # evicted or recorded entries written to the lower tier
    recorded_entries: int = 0
    recorded_bytes: int = 0
    skipped_records: int = 0    # too big for the budget, or no room beside pinned entries
    num_entries: int = 0        # gauges, filled in by PrefixCache.stats
    num_bytes: int = 0
    num_pinned: int = 0


class PrefixHit(NamedTuple):
    num_tokens: int
    snapshot: Any
    key: str


class RecordResult(NamedTuple):
    num_entries: int    # -> StageReplyStats.kv_recorded_pages
    num_bytes: int      # -> StageReplyStats.kv_recorded_bytes


@dataclass(slots=True)
class _Entry:
    snapshot: Any
    nbytes: int


class PrefixCache:
    def __init__(self, max_entries: int = 64, max_bytes: int = 0, min_tokens: int = 64, stride_tokens: int = 128,
                 record_limit: int = 4, disk: LowerTier | None = None,
                 disk_policy: Literal["evict", "record"] = "evict"):
        if disk_policy not in ("evict", "record"):
            raise ValueError(f"Expected disk_policy 'evict' or 'record', got {disk_policy!r}")
        self.max_entries, self.max_bytes = max_entries, max_bytes  # max_bytes 0 = no byte budget
        self.min_tokens, self.stride_tokens, self.record_limit = min_tokens, stride_tokens, record_limit
        self.disk, self.disk_policy = disk, disk_policy
        self.num_bytes = 0
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first
        self._pins: Counter[str] = Counter()
        self._stats = PrefixCacheStats()

    @classmethod
    def from_config(cls, config: KvCacheConfig, disk: LowerTier | None = None, **kwargs: Any) -> PrefixCache:
        """Bounds from the stage config; mode "disabled" stores nothing (the mode is the handler's to apply)."""
        max_entries = 0 if config.mode == "disabled" else config.max_entries
        return cls(max_entries, config.max_bytes, config.min_tokens, config.stride_tokens, disk=disk, **kwargs)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    @property
    def stats(self) -> PrefixCacheStats:
        return dataclasses.replace(self._stats, num_entries=len(self._entries), num_bytes=self.num_bytes,
                                   num_pinned=len(self._pins))

    def lookup_longest(self, ns: CacheNamespace, tokens: Sequence[int], *, token_start: int = 0,
                       pin: bool = False) -> PrefixHit | None:
        """The longest cached prefix of `tokens` on the candidate ladder. Stage 0 passes the
        cacheable prefix (prompt[:cacheable_prefix_length(len(prompt))])."""
        return self._probe(ns, tokens, candidate_lengths(len(tokens), self.stride_tokens, self.min_tokens),
                           token_start, pin)

    def lookup(self, ns: CacheNamespace, tokens: Sequence[int], *, token_start: int = 0,
               pin: bool = False) -> PrefixHit | None:
        """Exactly `tokens`, nothing shorter: downstream stages restore the length stage 0 chose."""
        return self._probe(ns, tokens, [len(tokens)] if tokens else [], token_start, pin)

    def _probe(self, ns, tokens, lengths, token_start, pin) -> PrefixHit | None:
        keys = prefix_keys(ns, tokens, lengths, token_start)
        for n in lengths:  # longest first
            key, entry = keys[n], self._entries.get(keys[n])
            if entry is not None:
                self._entries.move_to_end(key)
                snapshot = entry.snapshot
            elif self.disk is not None and key in self.disk and (snapshot := self.disk.get(key)) is not None:
                self._stats.disk_hits += 1
                self._insert(key, snapshot)  # promote; a snapshot too big for memory is still a hit
            else:
                continue
            self._stats.hits += 1
            if pin:
                self.pin(key)
            return PrefixHit(n, snapshot, key)
        self._stats.misses += 1
        return None

    def record(self, ns: CacheNamespace, tokens: Sequence[int], snapshot_fn: Callable[[int], Any], *,
               token_start: int = 0) -> RecordResult:
        """Store snapshot_fn(n) for each of record_lengths(...) not already cached, longest first."""
        lengths = record_lengths(len(tokens), self.stride_tokens, self.min_tokens, self.record_limit)
        num_entries = num_bytes = 0
        for n, key in sorted(prefix_keys(ns, tokens, lengths, token_start).items(), reverse=True):
            if key in self._entries:
                self._entries.move_to_end(key)
                continue
            snapshot = snapshot_fn(n)
            if not self._insert(key, snapshot):
                self._stats.skipped_records += 1
                continue
            if self.disk is not None and self.disk_policy == "record":
                self._spill(key, snapshot)
            num_entries, num_bytes = num_entries + 1, num_bytes + snapshot.nbytes
        self._stats.recorded_entries += num_entries
        self._stats.recorded_bytes += num_bytes
        return RecordResult(num_entries, num_bytes)

    def pin(self, key: str) -> None:
        self._pins[key] += 1

    def unpin(self, key: str) -> None:
        if self._pins[key] <= 0:
            raise KeyError(f"Expected a pinned prefix-cache entry, got unpinned key {key}")
        self._pins[key] -= 1
        if not self._pins[key]:
            del self._pins[key]

    def clear(self) -> int:
        """Drop every memory entry no session has pinned (counted as evictions, not written to
        the lower tier: an operator's "forget it", or a test's eviction); return how many."""
        victims = [key for key in self._entries if key not in self._pins]
        for key in victims:
            self.num_bytes -= self._entries.pop(key).nbytes
        self._stats.evictions += len(victims)
        return len(victims)

    def flush(self) -> int:
        """Write every memory entry the lower tier lacks (at shutdown); return how many."""
        if self.disk is None:
            return 0
        return sum(self._spill(key, entry.snapshot) for key, entry in list(self._entries.items()))

    def _insert(self, key: str, snapshot: Any) -> bool:
        nbytes = snapshot.nbytes
        victims, free_entries, free_bytes = [], self.max_entries - len(self._entries), self._free_bytes()
        for victim, entry in self._entries.items():  # plan first: evict nothing if it cannot fit
            if free_entries >= 1 and free_bytes >= nbytes:
                break
            if victim not in self._pins:
                victims.append(victim)
                free_entries, free_bytes = free_entries + 1, free_bytes + entry.nbytes
        if free_entries < 1 or free_bytes < nbytes:
            return False
        for victim in victims:
            entry = self._entries.pop(victim)
            self.num_bytes -= entry.nbytes
            self._stats.evictions += 1
            if self.disk is not None:
                self._spill(victim, entry.snapshot)
        self._entries[key] = _Entry(snapshot, nbytes)
        self.num_bytes += nbytes
        return True

    def _free_bytes(self) -> float:
        return self.max_bytes - self.num_bytes if self.max_bytes else float("inf")

    def _spill(self, key: str, snapshot: Any) -> bool:
        if key in self.disk or not self.disk.put(key, snapshot):
            return False
        self._stats.spilled += 1
        return True
