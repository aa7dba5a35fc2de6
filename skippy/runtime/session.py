"""Sessions on one stage: identity, token ledger, sampling settings, verify checkpoints.

Bookkeeping only: no torch (the runner creates and uses the KV cache and the sampler). A
session is keyed by (lane id, session id) (spec §3.1), so two connections never share one
even if they reuse a session id.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from ..protocol.sampling_config import SamplingConfig

SessionKey = tuple[int, int]  # (lane id, session id)

# What one session may hold that its peer's frames add to (docs/protocol.md §8.1). Stage 0
# keeps at most 64 windows in flight (speculation.MAX_PIPELINE_DEPTH) and retires each as it
# resolves, so twice that is never reached by a well-behaved peer.
MAX_OPEN_WINDOWS = 128
# A DiscardStaleWindows range matters only to windows already queued when it arrives (the
# read-ahead holds at most 128 messages): the session keeps its newest 128 ranges.
MAX_DISCARD_RANGES = 128


class SessionError(RuntimeError):
    """A session operation that cannot be carried out (unknown session, bad position...)."""


class LaneLimitError(SessionError):
    """Opening one more session would exceed the stage's lane_count (spec §3.1)."""


@dataclass(slots=True)
class VerifyCheckpoint:
    """A verify window run provisionally: the KV length to return to is `base`."""

    window_id: int
    base: int            # committed positions before the window (its pos_start)
    num_tokens: int      # rows the window wrote: [current, draft_1..draft_n]
    checkpoint_id: int   # the KV cache's checkpoint handle


@dataclass(slots=True)
class Session:
    key: SessionKey
    request_id: int
    dropped: bool = False
    cache: Any = None                   # KVCache, created by the runner on first use
    sampler: Any = None                 # RequestSampler, final stage only
    sampling: SamplingConfig | None = None
    prompt_token_count: int = 0
    cache_namespace: bytes | None = None   # prefix-cache namespace digest (None: the default)
    # ledger[i] is the token at position i (-1 when a frame carried no token ids). It
    # follows the KV cache: a write at position p first cuts it back to p, exactly like
    # the cache, so after auto-align or a trim it is still the session's true history.
    ledger: list[int] = field(default_factory=list)
    verify_windows: dict[int, VerifyCheckpoint] = field(default_factory=dict)
    discarded_windows: deque[tuple[int, int]] = field(  # [min, max] ranges, the newest
        default_factory=lambda: deque(maxlen=MAX_DISCARD_RANGES))
    is_new: bool = True  # not yet counted as opened (stage metrics)
    # prompt logprobs (final stage): the entries so far, and the last chunk's last row's logits,
    # (position, tensor), whose token comes with the next chunk
    prompt_logprobs: list = field(default_factory=list)
    pending_prompt_row: Any = None

    def check_active(self) -> None:
        if self.dropped:
            raise SessionError(f"session {self.key} was dropped")

    def record_tokens(self, start: int, tokens: list[int], num_rows: int) -> None:
        """Write the ids of rows [start, start + num_rows) into the ledger."""
        if start > len(self.ledger):
            raise SessionError(f"position {start} leaves a gap after {len(self.ledger)} tokens")
        del self.ledger[start:]
        self.ledger.extend(tokens[:num_rows])
        self.ledger.extend([-1] * (num_rows - len(tokens)))

    def history(self, end: int) -> list[int]:
        """Known token ids at positions [0, end), for the sampler's penalties."""
        return [t for t in self.ledger[:end] if t >= 0]

    def discard_windows(self, low: int, high: int) -> None:
        self.discarded_windows.append((low, high))

    def is_discarded(self, window_id: int) -> bool:
        return any(low <= window_id <= high for low, high in self.discarded_windows)

    def retire_windows(self, start: int, count: int) -> list[VerifyCheckpoint]:
        """Forget the checkpoints of windows based in [start, start + count)."""
        retired = [w for w in self.verify_windows.values() if start <= w.base < start + count]
        for window in retired:
            del self.verify_windows[window.window_id]
        return retired


class SessionTable:
    """The stage's live sessions, at most `max_sessions` (its lane_count) at a time."""

    def __init__(self, max_sessions: int) -> None:
        if max_sessions < 1:
            raise ValueError(f"Expected max_sessions >= 1, got {max_sessions}")
        self.max_sessions = max_sessions
        self._sessions: dict[SessionKey, Session] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, key: SessionKey) -> bool:
        return key in self._sessions

    def get(self, key: SessionKey) -> Session:
        session = self._sessions.get(key)
        if session is None:
            raise SessionError(f"no session {key}: it was never opened, or was stopped")
        return session

    def can_open(self, key: SessionKey) -> bool:
        return key in self._sessions or len(self._sessions) < self.max_sessions

    def open(self, key: SessionKey, request_id: int) -> Session:
        """The session for `key`, created on first use (spec §3.3 "Create")."""
        session = self._sessions.get(key)
        if session is not None and session.request_id == request_id:
            return session
        if session is not None:  # a new request on this lane and session id starts afresh
            self.drop(key)
        if not self.can_open(key):
            raise LaneLimitError(f"Expected at most {self.max_sessions} concurrent sessions "
                                 f"(lane_count), got one more; stop a session or raise lane_count")
        session = self._sessions[key] = Session(key, request_id)
        return session

    def drop(self, key: SessionKey) -> Session | None:
        session = self._sessions.pop(key, None)
        if session is not None:
            session.dropped = True
            session.cache = session.sampler = None  # frees the KV memory
            session.verify_windows.clear()
        return session

    def drop_lane(self, lane_id: int) -> list[Session]:
        """Drop every session of one lane (a connection that ended without Stop)."""
        return [self.drop(key) for key in [k for k in self._sessions if k[0] == lane_id]]

    def keys(self) -> list[SessionKey]:
        return list(self._sessions)
