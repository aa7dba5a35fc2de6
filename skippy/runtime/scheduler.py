"""The iteration scheduler (spec §6.1): one worker thread owns the model.

Everyone else submits commands and awaits asyncio futures:

* `submit_iteration(step)`: one decode or verify step of one session. Steps that
  are waiting together run as ONE batched forward (spec §6.5, "direct iterations").
* `submit_prefill(step)`: a prompt chunk, queued in order with the ops; chunks of other
  sessions queued right behind it run in the same forward (8 prompts arriving together
  cost one stage forward of their rows instead of eight). Sessions opened together
  (`announce`) have their first chunks gathered: the worker waits up to
  `PROMPT_GATHER_S` for the chunks of sessions announced but not yet heard from, since
  8 requests arriving together reach the worker a few ms apart, and a forward of the
  first alone puts it out of step with the rest for the whole decode (on 2 stages
  sharing 2 cores it also ran that session's decode steps beside the others' prefill).
  While it gathers, other sessions' ops run (their prefix-cache restores come before
  their chunks), and after a last chunk the session counts as a decoding peer due at once,
  so the first decode steps of sessions prefilled together also share one forward.
* `submit_op(fn, key)`: any other runtime work (trim, drop, configure...), run alone, in
  order with the ops and chunks of its session `key` (None: of no one session, or of all).

Each turn the worker takes one kind of work, alternating when both are waiting so
neither starves. A single stream never waits. When several sessions are decoding,
the worker learns each one's cadence (the time between its steps: this stage's
forward plus the round trip through the rest of the chain) and, before running a
batch, waits for the peers it expects back within a quarter of a forward's time
(stragglers of the same wave, whose predictions or activations arrive a few ms
apart), so they share one forward instead of queueing behind each other. A peer
with no cadence yet gets `batch_wait_s`.

It does not wait for the other wave of a pipelined chain: while this stage idles
for it, that wave is computing on the next stage, and pulling every session into
one wave leaves each stage idle while the other works. On CPU that measured 1.3x
slower at 4 sessions on 2 stages than two waves that keep both stages busy (with
MKL's small batches; the repacked weights make batches cheaper, but one wave still
idles each stage half the time).

Stages that share one machine's cores (`waves`, set by LocalChain to the number of
stages) split the decoding sessions into that many waves themselves, and a wave's
forward takes its share of the cores (`share_cores(waves)`) while another wave is in
flight: each stage then computes one wave on its own cores while the other stage
computes the other, and the Python between forwards (a stage's frames, the API's
work) runs beside the other stage's forward instead of leaving every core idle.
Each stage using every core in turn, as one wave, had two processes' Python in
series with the layers: 8 streams served on 2 stages, 2 cores (bench/serve_ab.py,
8 interleaved rounds) 246 -> 279 tok/s in aggregate with two waves of 4 at one
thread each; with every core in each stage's forward two waves only fought over
them (90-101 against 220-236 tok/s, measured before). Sessions split only when
every wave gets `MIN_WAVE_SESSIONS`: 4 streams as two waves of 2 measured 0.94x.
Prompts still take every core: prefill is compute-bound and rarely overlaps.

Decides only: no torch. `run_batch` (the runner) turns steps into tensors.
"""

from __future__ import annotations

import asyncio
import logging
import os
import select
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from .lending import NEED_MORE, Loan, Taken

T = TypeVar("T")
log = logging.getLogger("skippy.runtime")

RECENT_DECODER_S = 0.05   # with no cadence yet, a step this recent counts as decoding
PEER_WAIT_FORWARDS = 0.25  # wait for a peer due back within this many forwards' time
ONE_WAVE_PEER_WAIT_FORWARDS = 2.0  # stages sharing cores: sessions too few to split, one wave
MIN_WAVE_SESSIONS = 3    # stages sharing cores split the decoding sessions into waves of at least this
MAX_PEER_WAIT_S = 0.25    # never idle longer than this for a peer, however slow the forward
MAX_PREFILL_ROWS = 1024   # prompt rows of several sessions that may share one forward
PROMPT_GATHER_S = 0.01    # the longest wait for the first chunks of sessions opened together
ANNOUNCE_HORIZON_S = 2.0  # a session opened this long ago without a chunk is not waited for (at a
                          # stage below, the first chunk comes after the stages above computed it)
FIRST_STEP_HORIZON_S = 1.0  # a prefilled session not back with a step within this is not waited for
CADENCE_SMOOTHING = 0.3   # weight of the newest gap in a session's cadence
LATE_FACTOR = 2.0         # a session this many cadences overdue has stopped decoding
LATE_TOLERANCE = 0.25     # a peer due back is waited for until this part of its period past due
                          # (8 streams served on 2 stages: the API's work for the last token
                          # spreads the next steps' arrivals over 3-5 ms of a ~25 ms period)


class SchedulerBusyError(RuntimeError):
    """The bounded command queue is full ("generation queue full", spec §6.1)."""


class SchedulerClosedError(RuntimeError):
    pass


@dataclass(frozen=True, slots=True)
class Timed(Generic[T]):
    value: T
    wait_s: float      # queued before the worker took it: the runtime-lock wait (spec §3.5)
    run_s: float       # the worker's time on it (for a batch: the whole batch)
    batch_size: int = 1


@dataclass(slots=True)
class SchedulerStats:
    iterations: int = 0          # batched forwards run
    steps: int = 0               # steps inside them
    batched_iterations: int = 0  # forwards that carried more than one step
    max_batch_size: int = 0
    ops: int = 0
    loans: int = 0               # sockets lent to the worker (lending.py)
    lent_steps: int = 0          # steps fed from a lent socket
    prefill_forwards: int = 0    # forwards of prompt chunks
    prefill_chunks: int = 0      # chunks inside them
    batch_sizes: dict[int, int] = field(default_factory=dict)


@dataclass(slots=True)
class _Cadence:
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
class _Command:
    payload: Any                       # the step, or the callable of an op
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    submitted: float
    key: Hashable = None               # the session (None: an op of no one session)
    prefill_rows: int = 0              # > 0: a prompt chunk (the payload is its step)
    last_chunk: bool = False           # the prompt's last chunk: the session decodes next
    then: Callable[[Any], None] | None = None  # an iteration's: on the worker, with its result
    done: Callable[[Exception | None, Any], bool] | None = None  # a lent socket's step: settles here


class IterationScheduler:
    def __init__(self, run_batch: Callable[[list[Any]], list[Any]], *, capacity: int = 72,
                 batch_wait_s: float = 0.002, max_batch_steps: int = 32,
                 peer_wait_forwards: float = PEER_WAIT_FORWARDS, waves: int = 1,
                 share_cores: Callable[[int], None] | None = None,
                 on_batch: Callable[[int], None] | None = None, name: str = "skippy-runtime"):
        """`run_batch(steps)` returns one result per step: a value, or an Exception for that
        step alone. `on_batch(size)` is called after every iteration (telemetry counters).
        `waves`: how many waves the decoding sessions form (stages sharing cores: one per
        stage); `share_cores(n)`, called before each forward, gives the model 1 / n of the
        cores (1: all of them)."""
        self._run_batch = run_batch
        self._on_batch = on_batch
        self.capacity = max(8, capacity)
        self.batch_wait_s = batch_wait_s
        self.peer_wait_forwards = peer_wait_forwards
        self.max_batch_steps = max_batch_steps
        self.waves = waves
        self._share_cores = share_cores
        self.stats = SchedulerStats()
        self._cv = threading.Condition()
        self._iterations: deque[_Command] = deque()
        self._ops: deque[_Command] = deque()
        self._cadences: dict[Hashable, _Cadence] = {}
        self._forward_s: float | None = None   # smoothed run time of one batched forward
        self._awaited: set[Hashable] | None = None  # peers the worker waits for (None: not waiting)
        self._announced: dict[Hashable, float] = {}  # sessions opened, first chunk not yet submitted
        self._closed = False
        self._last_kind = "op"
        self._loan: Loan | None = None   # a socket lent to the worker (lending.py)
        self._polling = False            # the worker waits on the loan's socket: wake it by the pipe
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    @property
    def depth(self) -> int:
        """Commands waiting for the worker now (a gauge: read without the lock)."""
        return len(self._iterations) + len(self._ops)

    # -- submitting (event-loop side) -------------------------------------------------
    def submit_iteration(self, step: Any, key: Hashable,
                         then: Callable[[Any], None] | None = None) -> asyncio.Future:
        """`then(result)`, if given, runs on the worker the moment the step's forward ends
        (before the future settles) when the step succeeded: what must leave this process
        at once (stage/shared_writer.py) does not wait for the event loop to wake."""
        return self._submit(self._iterations, step, key, then=then)

    def submit_prefill(self, step: Any, key: Hashable, rows: int, *, last: bool = True) -> asyncio.Future:
        return self._submit(self._ops, step, key, max(1, rows), last)

    def submit_op(self, fn: Callable[[], T], key: Hashable = None) -> asyncio.Future:
        return self._submit(self._ops, fn, key)

    def announce(self, key: Hashable) -> None:
        """A session opened: its first prompt chunk is on its way (see PROMPT_GATHER_S)."""
        with self._cv:
            self._announced[key] = time.perf_counter()

    def _submit(self, queue: deque, payload: Any, key: Hashable, prefill_rows: int = 0,
                last_chunk: bool = False, then: Callable[[Any], None] | None = None) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        command = _Command(payload, loop.create_future(), loop, time.perf_counter(), key, prefill_rows,
                           last_chunk, then)
        with self._cv:
            if self._closed:
                raise SchedulerClosedError("the runtime is shut down")
            if len(self._iterations) + len(self._ops) >= self.capacity:
                raise SchedulerBusyError(f"generation queue full ({self.capacity} commands)")
            queue.append(command)
            if prefill_rows and self._announced.pop(key, None) is not None:
                self._cv.notify()  # the worker may be gathering first chunks
                return command.future
            if queue is self._iterations:
                self._announced.pop(key, None)  # decoding without a prompt of its own (a restore)
                if (cadence := self._cadences.get(key)) is None:
                    self._cadences[key] = _Cadence(command.submitted)
                else:
                    cadence.observe(command.submitted)
                awaited = self._awaited
                if awaited is not None and key in awaited:
                    awaited.discard(key)
                    if awaited:  # the worker waits for more of this wave: waking it now only
                        return command.future  # costs a GIL hand-off to the loop delivering them
            self._wake()
        return command.future

    def _wake(self) -> None:
        """Called with the lock held: wake the worker, waiting on the condition or on a loan."""
        self._cv.notify()
        if self._polling:
            os.write(self._wake_w, b"\0")

    # -- lending (lending.py) ---------------------------------------------------------
    def lend(self, fd: int, key: Hashable, feed: Callable[[bytearray], Taken | object | None]) -> asyncio.Future:
        """Lend the readable socket `fd` to the worker until it gives it back: the future's
        result is the bytes it read and did not take. One loan at a time."""
        loop = asyncio.get_running_loop()
        with self._cv:
            if self._closed:
                raise SchedulerClosedError("the runtime is shut down")
            if self._loan is not None:
                raise RuntimeError("the worker already holds a lent socket")
            self._loan = Loan(fd, key, feed, loop.create_future(), loop)
            self.stats.loans += 1
            self._cv.notify()
            return self._loan.future

    def recall(self, future: asyncio.Future) -> None:
        """End the loan whose future this is (the lender is closing): the worker gives it back."""
        with self._cv:
            loan = self._loan
            if loan is not None and loan.future is future:
                loan.recalled = True
                self._wake()

    def forget(self, key: Hashable) -> None:
        """The session ended: stop waiting for its steps."""
        with self._cv:
            self._cadences.pop(key, None)
            self._announced.pop(key, None)

    def shutdown(self) -> None:
        with self._cv:
            self._closed = True
            pending = list(self._iterations) + list(self._ops)
            self._iterations.clear()
            self._ops.clear()
            self._wake()
        for command in pending:
            _resolve(command, SchedulerClosedError("the runtime is shut down"), None)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=10)

    # -- the worker -----------------------------------------------------------------
    def _work(self) -> None:
        while True:
            with self._cv:
                while not (self._iterations or self._ops or self._closed or self._loan):
                    self._cv.wait()
                if self._closed:
                    self._end_loan()
                    os.close(self._wake_r)  # nothing writes once closed: _polling stays False
                    os.close(self._wake_w)
                    return
                loan = None
                if self._loan is not None and self._loan.recalled:
                    self._end_loan()
                    continue
                if not (self._iterations or self._ops):  # only a lent socket: wait on it
                    loan, self._polling = self._loan, True
                else:
                    if self._loan is not None and self._others_waiting(self._loan):
                        self._end_loan()  # other work came first: the lender reads on
                    run_iterations = bool(self._iterations) and (not self._ops or self._last_kind == "op")
                    if run_iterations:
                        self._wait_for_peers()
                        # split, a wave never holds every decoding session: another is in flight
                        waves, size = self._waves()
                        batch = [self._iterations.popleft() for _ in range(min(size, len(self._iterations)))]
                    else:
                        ahead = self._gather_prompts() if self._ops[0].prefill_rows else None
                        op = ahead or self._ops.popleft()
                        chunks = self._prefills_behind(op) if op.prefill_rows else []
            if loan is not None:
                self._serve_loan(loan)
                continue
            if run_iterations:
                self._last_kind = "iteration"
                self._run_iterations(batch, waves)
            elif op.prefill_rows:
                self._last_kind = "op"
                self._run_prefills([op, *chunks])
            else:
                self._last_kind = "op"
                self._run_op(op)

    def _serve_loan(self, loan: Loan) -> None:
        """Wait on the lent socket and run the steps fed from it, until anything else comes
        (work, a recall, the shutdown) or `feed` or `done` ends the loan; then give it back.
        A step of the loan's own session submitted the usual way is run with the loan kept."""
        buffer, keep = loan.buffer, False
        try:
            while True:
                try:
                    readable, _, _ = select.select([loan.fd, self._wake_r], [], [])
                except (OSError, ValueError):
                    return  # the socket was closed under the loan: the lender finds out
                if self._wake_r in readable:
                    try:
                        os.read(self._wake_r, 4096)
                    except BlockingIOError:
                        pass
                with self._cv:
                    if self._closed or loan.recalled or self._others_waiting(loan):
                        return
                    if self._iterations:  # a step of the loan's own session: run it, keep the loan
                        keep = True
                        return
                if loan.fd not in readable:
                    continue
                try:
                    data = os.read(loan.fd, 1 << 16)
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    return  # the lender's reader meets the same error and reports it
                if not data:
                    return  # EOF: the lender's reader sees it too
                buffer += data
                while buffer:
                    try:
                        taken = loan.feed(buffer)
                    except Exception:  # a bug in a feed must not take the worker down
                        log.exception("runtime worker: a lent socket's feed failed")
                        return
                    if taken is NEED_MORE:
                        break
                    if taken is None or not self._run_taken(taken, loan.key):
                        return
        finally:
            with self._cv:
                self._polling = False
                if self._loan is loan and not keep:
                    self._end_loan()

    def _others_waiting(self, loan: Loan) -> bool:
        """Called with the lock held: work waits that is not a step of the loan's session."""
        return bool(self._ops) or any(command.key != loan.key for command in self._iterations)

    def _end_loan(self) -> None:
        """Called with the lock held: give the lent socket back, if one is lent."""
        loan, self._loan = self._loan, None
        if loan is not None:
            loan.give_back()

    def _run_taken(self, taken: Taken, key: Hashable) -> bool:
        """One step fed from a lent socket, run as an iteration; `done` says whether to go on."""
        command = _Command(taken.step, None, None, time.perf_counter(), key, then=taken.then,
                           done=taken.done)
        with self._cv:
            if (cadence := self._cadences.get(key)) is None:
                self._cadences[key] = _Cadence(command.submitted)
            else:
                cadence.observe(command.submitted)
        self._last_kind = "iteration"
        self.stats.lent_steps += 1
        self._run_iterations([command], 1)  # a session decoding alone: every core
        return command.done is not None

    def _prefills_behind(self, first: _Command) -> list[_Command]:
        """Called with the lock held: the prompt chunks of other sessions queued right
        behind `first` (a session's next chunk needs this one's KV, so it waits)."""
        chunks, keys, rows = [], {first.key}, first.prefill_rows
        while self._ops and (nxt := self._ops[0]).prefill_rows and nxt.key not in keys:
            if rows + nxt.prefill_rows > MAX_PREFILL_ROWS:
                break
            chunks.append(self._ops.popleft())
            keys.add(nxt.key)
            rows += nxt.prefill_rows
        return chunks

    def _gather_prompts(self) -> _Command | None:
        """Called with the lock held, a prompt chunk first in line: wait (up to PROMPT_GATHER_S
        after it was queued) for the first chunks of the other sessions opened recently.
        Returns an op to run first (taken out of the queue): one of another session that
        has no chunk queued, since what it does (a prefix restore, say) may be what its
        prompt waits for; None to go on with the chunks. An op of no session ends the wait."""
        deadline = self._ops[0].submitted + PROMPT_GATHER_S
        while not self._closed:
            chunk_keys = {c.key for c in self._ops if c.prefill_rows}
            for command in self._ops:
                if not command.prefill_rows:
                    if command.key is None:
                        return None
                    if command.key not in chunk_keys:
                        self._ops.remove(command)
                        return command
            now = time.perf_counter()
            for key, opened in list(self._announced.items()):
                if now - opened > ANNOUNCE_HORIZON_S:
                    del self._announced[key]
            if not self._announced or now >= deadline:
                return None
            self._cv.wait(deadline - now)
        return None

    def _wait_for_peers(self) -> None:
        """Called with the lock held: wait for the decoding sessions due back soon."""
        since = time.perf_counter()
        while not self._closed and not self._ops:  # never hold other work back to wait
            deadline, self._awaited = self._peer_deadline(since)
            remaining = deadline - time.perf_counter() if deadline is not None else 0.0
            if remaining <= 0:
                self._awaited = None
                return
            self._cv.wait(remaining)
        self._awaited = None

    def _peer_deadline(self, since: float) -> tuple[float | None, set[Hashable]]:
        """The latest time worth waiting until for a missing peer (None: run now), and the
        peers worth that wait.

        A straggler due within a fraction of a forward is worth its wait: batched, its
        row adds less to this forward than a forward of its own would cost. A peer of
        the other pipeline wave is due about one forward away, beyond the budget. Waves
        this scheduler splits wait for their own stragglers only, whatever
        `peer_wait_forwards` says for one wave."""
        waiting = {c.key for c in self._iterations}
        waves, size = self._waves()
        if len(waiting) >= size:
            return None, set()
        now = time.perf_counter()
        forward_s = self._forward_s or 0.0
        forwards = self.peer_wait_forwards if waves == 1 else min(self.peer_wait_forwards, PEER_WAIT_FORWARDS)
        budget = min(MAX_PEER_WAIT_S, max(self.batch_wait_s, forwards * forward_s))
        latest = since + budget + self.batch_wait_s
        deadline, awaited = None, set()
        for key, cadence in list(self._cadences.items()):
            if cadence.is_stale(now):
                del self._cadences[key]
                continue
            if key in waiting:
                continue
            expected = cadence.expected_at()
            due = since + self.batch_wait_s if expected is None else expected + self.batch_wait_s
            if due <= latest:
                if expected is not None:  # a peer of this wave may run late by a part of its period
                    due = min(latest, max(due, expected + LATE_TOLERANCE * cadence.period_s))
                deadline = due if deadline is None else max(deadline, due)
                awaited.add(key)
        return deadline, awaited

    def _waves(self) -> tuple[int, int]:
        """Called with the lock held: the waves the decoding sessions (a cadence, or a step
        waiting) form now, and the most steps one forward takes."""
        if self.waves > 1:
            decoding = len(self._cadences.keys() | {c.key for c in self._iterations})
            if decoding >= self.waves * MIN_WAVE_SESSIONS:
                return self.waves, min(self.max_batch_steps, -(-decoding // self.waves))
        return 1, self.max_batch_steps

    def _run_iterations(self, batch: list[_Command], waves: int) -> None:
        if self._share_cores is not None:
            self._share_cores(waves)
        results, started, finished = self._forward(batch)
        for command, result in zip(batch, results):
            if command.then is not None and not isinstance(result, Exception):
                try:
                    command.then(result)
                except Exception:  # the step stands; its handler finds the frame unsent
                    log.exception("runtime worker: a step's hand-on failed")
        run_s = finished - started
        self._forward_s = run_s if self._forward_s is None else (
            (1 - CADENCE_SMOOTHING) * self._forward_s + CADENCE_SMOOTHING * run_s)
        size = len(batch)
        stats = self.stats
        stats.iterations += 1
        stats.steps += size
        stats.batched_iterations += size > 1
        stats.max_batch_size = max(stats.max_batch_size, size)
        stats.batch_sizes[size] = stats.batch_sizes.get(size, 0) + 1
        if self._on_batch is not None:
            self._on_batch(size)
        _settle(batch, results, started, finished)

    def _run_prefills(self, chunks: list[_Command]) -> None:
        if self._share_cores is not None:
            self._share_cores(1)
        results, started, finished = self._forward(chunks)
        self.stats.prefill_forwards += 1
        self.stats.prefill_chunks += len(chunks)
        with self._cv:  # each session prefilled to its end decodes next: a peer due at once
            for command in chunks:
                if command.last_chunk:
                    self._cadences[command.key] = _Cadence(finished, awaiting_first=True)
        _settle(chunks, results, started, finished)

    def _forward(self, commands: list[_Command]) -> tuple[list, float, float]:
        """(one result per command, start, end) of one forward over the commands' steps.
        A failure fails these steps only and the worker keeps serving (spec §6.1)."""
        started = time.perf_counter()
        try:
            results = self._run_batch([c.payload for c in commands])
        except Exception as error:
            log.exception("runtime worker: a forward of %d steps failed", len(commands))
            results = [error] * len(commands)
        return results, started, time.perf_counter()

    def _run_op(self, command: _Command) -> None:
        started = time.perf_counter()
        try:
            value, error = command.payload(), None
        except Exception as exc:
            value, error = None, exc
        self.stats.ops += 1
        _resolve(command, error, Timed(value, started - command.submitted,
                                       time.perf_counter() - started))


def _settle(commands: list[_Command], results: list, started: float, finished: float) -> None:
    """Hand each command of one forward its result, or its step's exception."""
    for command, result in zip(commands, results):
        timed = Timed(result, started - command.submitted, finished - started, len(commands))
        _resolve(command, result if isinstance(result, Exception) else None, timed)


def _resolve(command: _Command, error: Exception | None, timed: Timed | None) -> None:
    if command.done is not None:  # a lent socket's step: its lender learns at the give-back
        if not command.done(error, timed):
            command.done = None  # tells _run_taken to end the loan
        return

    def settle() -> None:
        if command.future.done():  # the awaiting task was cancelled
            return
        if error is not None:
            command.future.set_exception(error)
        else:
            command.future.set_result(timed)

    try:
        command.loop.call_soon_threadsafe(settle)
    except RuntimeError:  # the loop is closed: nobody is waiting any more
        pass
