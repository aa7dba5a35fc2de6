"""Sessions and the iteration scheduler, with a fake model: no torch, milliseconds."""

from __future__ import annotations

import asyncio
import math
import os
import subprocess
import sys
import threading
import time

import pytest

from skippy.runtime.scheduler import (LATE_TOLERANCE, MIN_WAVE_SESSIONS, ONE_WAVE_PEER_WAIT_FORWARDS, PEER_WAIT_FORWARDS, IterationScheduler,
                                      SchedulerBusyError, _Cadence)
from skippy.runtime.session import LaneLimitError, SessionError, SessionTable


def test_bookkeeping_modules_do_not_import_torch():
    code = ("import sys, skippy.runtime, skippy.runtime.session, skippy.runtime.scheduler, "
            "skippy.runtime.step, skippy.telemetry; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_session_table_is_bounded_by_lane_count():
    table = SessionTable(2)
    table.open((1, 10), request_id=5)
    table.open((1, 11), request_id=6)
    with pytest.raises(LaneLimitError, match="at most 2"):
        table.open((2, 10), request_id=7)
    assert table.open((1, 10), request_id=5) is table.get((1, 10))  # same request: same session


def test_drop_lane_reclaims_only_that_lane():
    table = SessionTable(4)
    for key in [(1, 1), (1, 2), (2, 1)]:
        table.open(key, 0)
    dropped = table.drop_lane(1)
    assert sorted(s.key for s in dropped) == [(1, 1), (1, 2)]
    assert table.keys() == [(2, 1)]
    with pytest.raises(SessionError, match="no session"):
        table.get((1, 1))


def test_new_request_on_a_key_starts_a_fresh_session():
    table = SessionTable(1)
    first = table.open((1, 1), request_id=1)
    first.record_tokens(0, [5, 6, 7], 3)
    second = table.open((1, 1), request_id=2)
    assert second is not first and second.ledger == [] and first.cache is None


def test_ledger_follows_authoritative_positions():
    session = SessionTable(1).open((0, 0), 0)
    session.record_tokens(0, [1, 2, 3, 4], 4)
    session.record_tokens(2, [9], 1)          # a write at 2 cuts the tail first
    assert session.ledger == [1, 2, 9]
    session.record_tokens(3, [], 2)           # rows without token ids stay unknown
    assert session.ledger == [1, 2, 9, -1, -1] and session.history(5) == [1, 2, 9]
    with pytest.raises(SessionError, match="gap"):
        session.record_tokens(7, [1], 1)


def test_verify_window_discard_ranges():
    session = SessionTable(1).open((0, 0), 0)
    session.discard_windows(3, 5)
    assert [session.is_discarded(w) for w in (2, 3, 5, 6)] == [False, True, True, False]


class FakeModel:
    """run_batch that records batch sizes; 'boom' steps fail alone."""

    def __init__(self, delay_s: float = 0.02):
        self.delay_s = delay_s
        self.batches: list[list] = []
        self.threads: set[str] = set()

    def __call__(self, steps):
        self.threads.add(threading.current_thread().name)
        self.batches.append(list(steps))
        time.sleep(self.delay_s)
        return [ValueError("boom") if s == "boom" else f"done {s}" for s in steps]


async def _decode_loop(scheduler, key, steps, *, start_s=0.0, downstream_s=0.0):
    """`downstream_s`: the rest of the chain's time before this session's next step."""
    await asyncio.sleep(start_s)
    out = []
    for i in range(steps):
        timed = await scheduler.submit_iteration(f"{key}:{i}", key)
        out.append(timed.value)
        await asyncio.sleep(downstream_s)
    return out


def test_concurrent_decoders_share_one_forward():
    model = FakeModel()
    scheduler = IterationScheduler(model, batch_wait_s=0.01)

    async def main():
        return await asyncio.gather(*(_decode_loop(scheduler, k, 5) for k in ("a", "b", "c")))

    results = asyncio.run(main())
    scheduler.shutdown()
    assert results[0] == [f"done a:{i}" for i in range(5)]
    assert scheduler.stats.steps == 15
    assert scheduler.stats.batched_iterations >= 3 and scheduler.stats.max_batch_size == 3
    assert model.threads == {"skippy-runtime"}  # one worker owns the model


@pytest.mark.parametrize(("peer_wait_forwards", "last_submit_ago", "waits_s"), [
    (PEER_WAIT_FORWARDS, 0.095, 0.012),          # a straggler of this wave, due in 5 ms: waited for,
                                                 # late, up to the budget (a quarter forward + 2 ms)
    (PEER_WAIT_FORWARDS, 0.06, None),            # the other pipeline wave, a forward away: not
    (ONE_WAVE_PEER_WAIT_FORWARDS, 0.06, 0.04 + LATE_TOLERANCE * 0.1),  # stages sharing cores: one wave
], ids=["straggler", "other-wave", "one-wave"])
def test_which_peers_a_batch_waits_for(peer_wait_forwards, last_submit_ago, waits_s):
    """With 40 ms forwards and 100 ms cadences: a peer due back within a fraction of a
    forward is worth waiting for (its row costs less than a forward of its own), and a
    little past its time, since its arrivals jitter by a part of its period; a peer of the
    other wave is computing on the next stage meanwhile, unless the stages share the
    cores and the sessions are too few to split into waves: then they are one wave."""
    scheduler = IterationScheduler(FakeModel(delay_s=0), peer_wait_forwards=peer_wait_forwards)
    try:
        now = time.perf_counter()
        scheduler._forward_s = 0.04
        scheduler._cadences = {"peer": _Cadence(last_submit=now - last_submit_ago, period_s=0.1)}
        deadline, awaited = scheduler._peer_deadline(since=now)
        if waits_s is None:
            assert deadline is None and awaited == set()
        else:  # float64 sums of the same terms in another order: a few ulps of `now` apart
            assert awaited == {"peer"}  # its arrival, the last awaited, wakes the worker
            assert deadline == pytest.approx(now + waits_s, abs=4 * math.ulp(now + 1.0))
    finally:
        scheduler.shutdown()


class CoreShares:
    """share_cores that records what each forward was given, by its batch's size."""

    def __init__(self, model: FakeModel):
        self.model, self.shares = model, []

    def __call__(self, ways: int) -> None:
        self.shares.append((len(self.model.batches), ways))

    def of_batches(self) -> list[tuple[int, int]]:
        """(batch size, share) of every forward: a share is set just before its forward."""
        return [(len(self.model.batches[i]), ways) for i, ways in self.shares if i < len(self.model.batches)]


@pytest.mark.parametrize("sessions", [2 * MIN_WAVE_SESSIONS - 1, 8])
def test_stages_sharing_cores_split_enough_sessions_into_waves(sessions):
    """Two waves (stages sharing the cores): 8 sessions decode as two waves of 4, each
    forward on half the cores while the other wave is in flight; too few sessions for two
    waves of MIN_WAVE_SESSIONS stay one wave on every core. Prompts take every core."""
    model = FakeModel(delay_s=0.01)
    shares = CoreShares(model)
    scheduler = IterationScheduler(model, waves=2, share_cores=shares, batch_wait_s=0.005,
                                   peer_wait_forwards=ONE_WAVE_PEER_WAIT_FORWARDS)  # as LocalChain

    async def main():
        await asyncio.gather(*(scheduler.submit_prefill(f"p{k}", k, 4) for k in range(sessions)))
        # the other wave's steps come back a forward later, as from the next stage
        await asyncio.gather(*(_decode_loop(scheduler, k, 6, downstream_s=0.012) for k in range(sessions)))

    asyncio.run(main())
    scheduler.shutdown()
    forwards = shares.of_batches()
    assert forwards[0] == (sessions, 1)  # the prompts: one forward, every core
    decode = forwards[1:]
    if sessions < 2 * MIN_WAVE_SESSIONS:
        assert {size for size, _ in decode} == {sessions} and {ways for _, ways in decode} == {1}
    else:
        assert max(size for size, _ in decode) == 4 and sum(size for size, _ in decode) == 6 * 8
        assert sum(ways == 2 for _, ways in decode) >= len(decode) - 2  # all but a straggling tail
        assert all(ways == 2 for size, ways in decode if size == 4)


def test_a_local_chain_shares_the_cores_in_waves(gguf_path):
    from skippy.launch.local_chain import LocalChain

    chain, on_gpu = LocalChain(gguf_path, 2), LocalChain(gguf_path, 2, device="cuda:1")
    try:
        assert chain.threads == os.cpu_count()
        assert {c.decode_waves for c in chain.configs} == {2} and chain._stage0_options["decode_waves"] == 2
        assert {c.peer_wait_forwards for c in chain.configs} == {ONE_WAVE_PEER_WAIT_FORWARDS}
        # the device reaches every stage (it was "cpu" for the child stages whatever --device said)
        assert {c.device for c in chain.configs} == {"auto"} and chain.device == "auto"
        assert {c.device for c in on_gpu.configs} == {"cuda:1"} and on_gpu.device == "cuda:1"
    finally:
        chain._dir.cleanup()
        on_gpu._dir.cleanup()


def test_a_lone_session_never_waits():
    model = FakeModel(delay_s=0.005)
    scheduler = IterationScheduler(model, batch_wait_s=0.05)

    async def main():
        return await _decode_loop(scheduler, "solo", 10, downstream_s=0.01)

    asyncio.run(main())
    scheduler.shutdown()
    assert all(len(b) == 1 for b in model.batches)
    assert scheduler.stats.steps == 10


def test_a_failing_step_fails_alone_and_the_worker_survives():
    model = FakeModel(delay_s=0)
    scheduler = IterationScheduler(model)

    async def main():
        bad = scheduler.submit_iteration("boom", "x")
        good = scheduler.submit_iteration("ok", "y")
        with pytest.raises(ValueError, match="boom"):
            await bad
        assert (await good).value == "done ok"

        def explode():
            raise RuntimeError("op failed")

        with pytest.raises(RuntimeError, match="op failed"):
            await scheduler.submit_op(explode)
        assert (await scheduler.submit_op(lambda: 42)).value == 42

    asyncio.run(main())
    scheduler.shutdown()


def test_ops_and_iterations_alternate():
    order = []
    gate = threading.Event()
    scheduler = IterationScheduler(lambda steps: [order.append(("it", s)) or s for s in steps])

    async def main():
        blocker = scheduler.submit_op(gate.wait)  # hold the worker while we queue
        futures = [scheduler.submit_op(lambda i=i: order.append(("op", i))) for i in range(2)]
        futures += [scheduler.submit_iteration(i, i) for i in range(2)]
        gate.set()
        await asyncio.gather(blocker, *futures)

    asyncio.run(main())
    scheduler.shutdown()
    assert order[:2] == [("it", 0), ("it", 1)]      # iterations ran as one batch ...
    assert [kind for kind, _ in order[2:]] == ["op", "op"]  # ... before the remaining ops


def test_prompt_chunks_of_other_sessions_share_a_forward():
    """Chunks queued together run as one forward, in queue order; a session's next chunk
    (it needs the first one's KV) and an op between chunks each end the run."""
    batches = []
    gate, started = threading.Event(), threading.Event()
    scheduler = IterationScheduler(lambda steps: batches.append(list(steps)) or [f"done {s}" for s in steps])

    async def main():
        blocker = scheduler.submit_op(lambda: started.set() or gate.wait())
        started.wait(5)  # hold the worker while we queue
        chunks = [scheduler.submit_prefill(f"{key}{i}", key, 40) for key, i in [("a", 0), ("b", 0), ("c", 0), ("a", 1)]]
        op = scheduler.submit_op(lambda: batches.append(["op"]))
        chunks.append(scheduler.submit_prefill("d0", "d", 40))
        gate.set()
        await blocker
        return [(await c).value for c in chunks], [(await c).batch_size for c in chunks], await op

    values, sizes, _ = asyncio.run(main())
    scheduler.shutdown()
    assert batches == [["a0", "b0", "c0"], ["a1"], ["op"], ["d0"]]
    assert values == ["done a0", "done b0", "done c0", "done a1", "done d0"] and sizes == [3, 3, 3, 1, 1]
    assert scheduler.stats.prefill_forwards == 3 and scheduler.stats.prefill_chunks == 5


def test_first_chunks_of_sessions_opened_together_are_gathered(monkeypatch):
    """8 requests arriving together reach the worker a few ms apart: the first chunk waits
    (a bounded time) for those of the other sessions announced, while an op of one of
    them (its prefix restore, which its chunk comes after) runs ahead; an op of no one
    session ends the wait, and so does the window."""
    import skippy.runtime.scheduler as scheduler_module

    monkeypatch.setattr(scheduler_module, "PROMPT_GATHER_S", 0.5)  # wide: a loaded machine
    batches = []
    scheduler = IterationScheduler(lambda steps: batches.append(list(steps)) or steps)

    async def main():
        for key in "abc":
            scheduler.announce(key)
        first = scheduler.submit_prefill("a0", "a", 40)
        await asyncio.sleep(0.02)
        restore = scheduler.submit_op(lambda: batches.append(["restore b"]), "b")
        await asyncio.sleep(0.02)
        rest = [scheduler.submit_prefill(f"{key}0", key, 40) for key in "bc"]
        await asyncio.gather(first, restore, *rest)
        scheduler.announce("d")  # announced, never heard from: the window bounds the wait
        started = time.perf_counter()
        await scheduler.submit_prefill("e0", "e", 40)
        waited = time.perf_counter() - started
        scheduler.announce("f")
        started = time.perf_counter()
        lone = scheduler.submit_prefill("g0", "g", 40)
        await asyncio.sleep(0.01)
        await scheduler.submit_op(lambda: batches.append(["op of all"]))
        await lone
        return waited, time.perf_counter() - started

    waited, ended_by_op = asyncio.run(main())
    scheduler.shutdown()
    assert batches[:2] == [["restore b"], ["a0", "b0", "c0"]]
    assert batches[2:] == [["e0"], ["g0"], ["op of all"]]
    assert 0.4 < waited < 5 and ended_by_op < 0.4
    assert scheduler.stats.prefill_forwards == 3


def test_sessions_prefilled_together_take_their_first_steps_together():
    """After a prompt's last chunk the session decodes next: a peer's first step waits
    `batch_wait_s` for it (as for a peer with no cadence yet), so sessions prefilled in
    one forward also decode in one; a session that never prefilled is not waited for."""
    batches = []
    scheduler = IterationScheduler(lambda steps: batches.append(list(steps)) or steps, batch_wait_s=0.3)

    async def main():
        await asyncio.gather(*(scheduler.submit_prefill(f"{key}0", key, 40) for key in "ab"))
        first = scheduler.submit_iteration("a1", "a")
        await asyncio.sleep(0.03)  # b's first step comes a little later
        await asyncio.gather(first, scheduler.submit_iteration("b1", "b"))
        scheduler.forget("a"), scheduler.forget("b")
        await scheduler.submit_prefill("c0", "c", 40, last=False)  # a chunk of a longer prompt
        started = time.perf_counter()
        await scheduler.submit_iteration("d1", "d")
        return time.perf_counter() - started

    lone_s = asyncio.run(main())
    scheduler.shutdown()
    assert batches[1:3] == [["a1", "b1"], ["c0"]] and lone_s < 0.2


def test_prompt_chunks_share_a_forward_up_to_a_row_budget():
    from skippy.runtime.scheduler import MAX_PREFILL_ROWS

    batches = []
    gate, started = threading.Event(), threading.Event()
    scheduler = IterationScheduler(lambda steps: batches.append(list(steps)) or steps)

    async def main():
        blocker = scheduler.submit_op(lambda: started.set() or gate.wait())
        started.wait(5)
        rows = MAX_PREFILL_ROWS // 2
        chunks = [scheduler.submit_prefill(key, key, rows) for key in "abc"]
        gate.set()
        await asyncio.gather(blocker, *chunks)

    asyncio.run(main())
    scheduler.shutdown()
    assert batches == [["a", "b"], ["c"]]


def test_full_queue_is_refused():
    gate, started = threading.Event(), threading.Event()
    scheduler = IterationScheduler(lambda steps: steps, capacity=8)

    async def main():
        futures = [scheduler.submit_op(lambda: started.set() or gate.wait())]
        started.wait(5)  # the worker holds the first op; 8 more fill the queue
        futures += [scheduler.submit_op(lambda: None) for _ in range(8)]
        with pytest.raises(SchedulerBusyError, match="queue full"):
            scheduler.submit_op(lambda: None)
        gate.set()
        await asyncio.gather(*futures)

    asyncio.run(main())
    scheduler.shutdown()
