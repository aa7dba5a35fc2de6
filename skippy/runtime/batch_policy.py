"""Which queued steps one forward runs, and how long to wait for more (spec §6.1, §6.5).

Decides only: no threads, no torch, no clock of its own (`now` is passed in), so every rule
is tested with made-up times.

* Decode and verify steps waiting together run as ONE forward. Each decoding session's
  cadence says when it is due back; the policy waits for peers due within a quarter of a
  forward, never for the other wave of a pipelined chain (one merged wave leaves each stage
  idle while the other works: 4 sessions on 2 stages, 1.3x slower). A lone session never waits.
* Stages sharing one machine's cores (`waves`) split the decoding sessions into that many
  waves, each on its share of the cores, so one stage's Python runs beside the other's
  layers (8 streams on 2 stages, 2 cores: 246 -> 279 tok/s).
* Prompt chunks of different sessions share a forward (up to MAX_PREFILL_ROWS rows); the
  first chunks of sessions opened together wait up to PROMPT_GATHER_S for each other, so
  they also decode in step. When prompts and decode steps both wait, forwards alternate.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

RECENT_DECODER_S = 0.05   # with no cadence yet, a step this recent counts as decoding
PEER_WAIT_FORWARDS = 0.25  # wait for a peer due back within this many forwards' time
ONE_WAVE_PEER_WAIT_FORWARDS = 2.0  # stages sharing cores: sessions too few to split, one wave
MIN_WAVE_SESSIONS = 3     # stages sharing cores split the decoding sessions into waves of at least this
MAX_PEER_WAIT_S = 0.25    # never idle longer than this for a peer, however slow the forward
MAX_PREFILL_ROWS = 1024   # prompt rows of several sessions that may share one forward
PROMPT_GATHER_S = 0.01    # the longest wait for the first chunks of sessions opened together
ANNOUNCE_HORIZON_S = 2.0  # a session opened this long ago without a chunk is not waited for (at a
                          # stage below, the first chunk comes after the stages above computed it)
FIRST_STEP_HORIZON_S = 1.0  # a prefilled session not back with a step within this is not waited for
CADENCE_SMOOTHING = 0.3   # weight of the newest gap in a session's cadence
LATE_FACTOR = 2.0         # a session this many cadences overdue has stopped decoding
LATE_TOLERANCE = 0.25     # a peer due back is waited for until this part of its period past due


@dataclass(frozen=True, slots=True)
class BatchSettings:
    batch_wait_s: float = 0.002      # the wait for a peer with no cadence yet
    peer_wait_forwards: float = PEER_WAIT_FORWARDS
    max_batch_steps: int = 32
    waves: int = 1                   # stages sharing this machine's cores: one wave each


@dataclass(slots=True)
class Queued:
    """A step waiting for a forward, as the policy sees it."""
    key: Hashable                    # its session
    rows: int
    is_prefill: bool
    submitted: float
    last_chunk: bool = False         # a prompt's last chunk: the session decodes next
    payload: Any = None              # what the engine runs (the policy never looks)


@dataclass(slots=True)
class Cadence:
    """When a decoding session last submitted a step, and its smoothed step period."""
    last_submit: float
    period_s: float | None = None
    awaiting_first: bool = False  # prefilled, no step yet: its first comes after the chain's prefill

    def observe(self, now: float) -> None:
        if self.awaiting_first:  # the gap since the prefill is no step period
            self.awaiting_first, self.last_submit = False, now
            return
        gap = now - self.last_submit
        self.period_s = gap if self.period_s is None else (
            (1 - CADENCE_SMOOTHING) * self.period_s + CADENCE_SMOOTHING * gap)
        self.last_submit = now

    def expected_at(self) -> float | None:
        return None if self.period_s is None else self.last_submit + self.period_s

    def is_stale(self, now: float) -> bool:
        if self.awaiting_first:
            horizon = FIRST_STEP_HORIZON_S
        elif self.period_s is None:
            horizon = RECENT_DECODER_S
        else:
            horizon = max(RECENT_DECODER_S, LATE_FACTOR * self.period_s)
        return now - self.last_submit > horizon


@dataclass(slots=True)
class Choice:
    """`batch`: what to run now (taken out of the queue), on 1 / `waves` of the cores; or None,
    and `wait_until`: when to ask again (None: when something new arrives)."""
    batch: list[Queued] | None = None
    waves: int = 1
    wait_until: float | None = None


@dataclass(slots=True)
class BatchPolicy:
    settings: BatchSettings = BatchSettings()
    cadences: dict[Hashable, Cadence] = field(default_factory=dict)
    forward_s: float | None = None       # smoothed run time of one decode forward
    announced: dict[Hashable, float] = field(default_factory=dict)  # opened, first chunk not yet queued
    last_was_prefill: bool = True        # forwards alternate when both kinds wait
    waiting_since: float | None = None   # when the head of the decode queue began waiting for peers

    # -- what the engine tells the policy ---------------------------------------------------
    def announce(self, key: Hashable, now: float) -> None:
        """A session opened: its first prompt chunk is on its way."""
        self.announced[key] = now

    def forget(self, key: Hashable) -> None:
        """The session ended: stop waiting for its steps."""
        self.cadences.pop(key, None)
        self.announced.pop(key, None)

    def queued(self, item: Queued) -> None:
        """A step joined the queue (the engine appends it)."""
        self.announced.pop(item.key, None)  # its first chunk is here, or it decodes without one (a restore)
        if item.is_prefill:
            return
        cadence = self.cadences.get(item.key)
        if cadence is None:
            self.cadences[item.key] = Cadence(item.submitted)
        else:
            cadence.observe(item.submitted)

    def ran(self, batch: list[Queued], run_s: float, finished: float) -> None:
        """A forward of `batch` took `run_s`, ending at `finished`."""
        if batch[0].is_prefill:  # each session prefilled to its end decodes next: a peer due at once
            for item in batch:
                if item.last_chunk:
                    self.cadences[item.key] = Cadence(finished, awaiting_first=True)
            return
        self.forward_s = run_s if self.forward_s is None else (
            (1 - CADENCE_SMOOTHING) * self.forward_s + CADENCE_SMOOTHING * run_s)

    # -- the decision -----------------------------------------------------------------------
    def choose(self, queue: list[Queued], now: float) -> Choice:
        """What to run now out of `queue` (in arrival order), or when to look again."""
        has_decode = any(not item.is_prefill for item in queue)
        has_prefill = any(item.is_prefill for item in queue)
        if not has_decode:
            self.waiting_since = None
        if has_decode and (not has_prefill or self.last_was_prefill):
            if not has_prefill:  # never hold a waiting prompt back to wait for peers
                since = self.waiting_since = self.waiting_since or now
                deadline = self.peer_deadline(queue, since, now)
                if deadline is not None and deadline > now:
                    return Choice(wait_until=deadline)
            self.waiting_since = None
            waves, size = self.waves(queue, now)
            self.last_was_prefill = False
            return Choice(self._decode_from(queue, size), waves)
        if not has_prefill:
            return Choice()
        first = next(item for item in queue if item.is_prefill)
        gather_until = self._gather_until(first, now)
        if gather_until is not None:
            return Choice(wait_until=gather_until)
        self.last_was_prefill = True
        return Choice(self._prefills_from(queue, first), 1)

    def peer_deadline(self, queue: list[Queued], since: float, now: float) -> float | None:
        """The latest time worth waiting until for a missing peer (None: run now). A straggler
        due within a fraction of a forward is worth it: batched, its row costs less than a
        forward of its own. Waves this policy splits wait for their own stragglers only."""
        settings = self.settings
        waiting = {item.key for item in queue if not item.is_prefill}
        waves, size = self.waves(queue, now)
        if len(waiting) >= size:
            return None
        forwards = settings.peer_wait_forwards if waves == 1 else min(settings.peer_wait_forwards,
                                                                       PEER_WAIT_FORWARDS)
        budget = min(MAX_PEER_WAIT_S, max(settings.batch_wait_s, forwards * (self.forward_s or 0.0)))
        latest = since + budget + settings.batch_wait_s
        deadline = None
        for key, cadence in list(self.cadences.items()):
            if cadence.is_stale(now):
                del self.cadences[key]
                continue
            if key in waiting:
                continue
            expected = cadence.expected_at()
            due = since + settings.batch_wait_s if expected is None else expected + settings.batch_wait_s
            if due <= latest:
                if expected is not None:  # a peer of this wave may run late by a part of its period
                    due = min(latest, max(due, expected + LATE_TOLERANCE * cadence.period_s))
                deadline = due if deadline is None else max(deadline, due)
        return deadline

    def waves(self, queue: list[Queued], now: float) -> tuple[int, int]:
        """The waves the decoding sessions (a cadence, or a step waiting) form now, and the
        most steps one forward takes."""
        settings = self.settings
        if settings.waves > 1:
            decoding = len(self.cadences.keys() | {item.key for item in queue if not item.is_prefill})
            if decoding >= settings.waves * MIN_WAVE_SESSIONS:
                return settings.waves, min(settings.max_batch_steps, -(-decoding // settings.waves))
        return 1, settings.max_batch_steps

    def _gather_until(self, first: Queued, now: float) -> float | None:
        """Until when the first prompt chunk in line waits for the first chunks of sessions
        opened recently and not yet heard from (None: run now)."""
        for key, opened in list(self.announced.items()):
            if now - opened > ANNOUNCE_HORIZON_S:
                del self.announced[key]
        deadline = first.submitted + PROMPT_GATHER_S
        return deadline if self.announced and now < deadline else None

    @staticmethod
    def _decode_from(queue: list[Queued], size: int) -> list[Queued]:
        """The first `size` decode steps in line, one a session: a session's next step (a
        pipelined verify window) needs this one's KV, so it waits for the next forward."""
        batch, keys = [], set()
        for item in queue:
            if not item.is_prefill and item.key not in keys:
                batch.append(item)
                keys.add(item.key)
                if len(batch) == size:
                    break
        return batch

    @staticmethod
    def _prefills_from(queue: list[Queued], first: Queued) -> list[Queued]:
        """`first` and the chunks of other sessions queued behind it, up to the row budget (a
        session's next chunk needs this one's KV, so it waits for the next forward)."""
        batch, keys, rows = [first], {first.key}, first.rows
        for item in queue:
            if item is first or not item.is_prefill:
                continue
            if item.key in keys or rows + item.rows > MAX_PREFILL_ROWS:
                break
            batch.append(item)
            keys.add(item.key)
            rows += item.rows
        return batch
