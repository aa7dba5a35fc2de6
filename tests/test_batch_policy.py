"""The batch policy: which queued steps one forward runs, and how long to wait for more.
Pure: made-up clocks, no threads, no torch."""

from __future__ import annotations

import math

import pytest

from skippy.runtime.batch_policy import (
    LATE_TOLERANCE, MAX_PREFILL_ROWS, MIN_WAVE_SESSIONS, ONE_WAVE_PEER_WAIT_FORWARDS, PEER_WAIT_FORWARDS,
    PROMPT_GATHER_S, BatchPolicy, BatchSettings, Cadence, Queued,
)


def decode(key, at: float) -> Queued:
    return Queued(key, 1, False, at, payload=f"{key}@{at}")


def prompt(key, at: float, rows: int = 40, last: bool = True) -> Queued:
    return Queued(key, rows, True, at, last, payload=f"{key} chunk")


def queue(policy: BatchPolicy, *items: Queued) -> list[Queued]:
    for item in items:
        policy.queued(item)
    return list(items)


def test_steps_waiting_together_share_one_forward():
    policy = BatchPolicy()
    waiting = queue(policy, decode("a", 1.0), decode("b", 1.0), decode("c", 1.0))
    choice = policy.choose(waiting, 1.0)
    assert [item.key for item in choice.batch] == ["a", "b", "c"] and choice.waves == 1


def test_a_lone_session_never_waits():
    policy = BatchPolicy(BatchSettings(batch_wait_s=0.05))
    for i in range(5):  # a steady stream of one session's steps, 10 ms apart
        now = 1.0 + 0.01 * i
        choice = policy.choose(queue(policy, decode("solo", now)), now)
        assert choice.batch is not None and len(choice.batch) == 1
        policy.ran(choice.batch, 0.005, now + 0.005)


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
    policy = BatchPolicy(BatchSettings(peer_wait_forwards=peer_wait_forwards))
    now = 10.0
    policy.forward_s = 0.04
    policy.cadences = {"peer": Cadence(last_submit=now - last_submit_ago, period_s=0.1)}
    waiting = [decode("me", now)]
    deadline = policy.peer_deadline(waiting, now, now)
    if waits_s is None:
        assert deadline is None and policy.choose(waiting, now).batch is not None
    else:
        assert deadline == pytest.approx(now + waits_s, abs=4 * math.ulp(now + 1.0))
        choice = policy.choose(waiting, now)
        assert choice.batch is None and choice.wait_until == deadline
        assert policy.choose(waiting, deadline).batch is not None  # past its deadline: runs alone


@pytest.mark.parametrize("sessions", [2 * MIN_WAVE_SESSIONS - 1, 8])
def test_stages_sharing_cores_split_enough_sessions_into_waves(sessions):
    """Two waves (stages sharing the cores): 8 sessions decode as two waves of 4, each forward
    on half the cores; too few sessions for two waves of MIN_WAVE_SESSIONS stay one wave."""
    policy = BatchPolicy(BatchSettings(waves=2, peer_wait_forwards=ONE_WAVE_PEER_WAIT_FORWARDS))
    waiting = queue(policy, *(decode(k, 1.0) for k in range(sessions)))
    choice = policy.choose(waiting, 1.0)
    if sessions < 2 * MIN_WAVE_SESSIONS:
        assert len(choice.batch) == sessions and choice.waves == 1
    else:
        assert len(choice.batch) == 4 and choice.waves == 2


def test_prompts_and_decode_steps_alternate():
    policy = BatchPolicy()
    waiting = queue(policy, prompt("p", 1.0), decode("a", 1.0), decode("b", 1.0))
    first = policy.choose(waiting, 1.0)
    assert [item.key for item in first.batch] == ["a", "b"]  # decode first, no peer wait with a prompt queued
    waiting = [item for item in waiting if item not in first.batch] + queue(policy, decode("a", 1.01))
    second = policy.choose(waiting, 1.01)
    assert [item.key for item in second.batch] == ["p"] and second.waves == 1  # then the prompt, every core


def test_prompt_chunks_of_other_sessions_share_a_forward_up_to_a_row_budget():
    """Chunks queued together run as one forward, in queue order; a session's next chunk
    (it needs the first one's KV) waits, and so does a chunk past the row budget."""
    policy = BatchPolicy()
    waiting = queue(policy, prompt("a", 1.0), prompt("b", 1.0), prompt("a", 1.0), prompt("c", 1.0))
    assert [item.key for item in policy.choose(waiting, 1.0).batch] == ["a", "b"]
    half = MAX_PREFILL_ROWS // 2
    big = queue(BatchPolicy(), *(prompt(k, 1.0, rows=half) for k in "xyz"))
    assert [item.key for item in BatchPolicy().choose(big, 1.0).batch] == ["x", "y"]


def test_first_chunks_of_sessions_opened_together_are_gathered():
    """8 requests arriving together reach the stage a few ms apart: the first chunk waits (a
    bounded time) for the first chunks of the other sessions announced."""
    policy = BatchPolicy()
    for key in "abc":
        policy.announce(key, 1.0)
    waiting = queue(policy, prompt("a", 1.0))
    choice = policy.choose(waiting, 1.001)
    assert choice.batch is None and choice.wait_until == pytest.approx(1.0 + PROMPT_GATHER_S)
    waiting += queue(policy, prompt("b", 1.003), prompt("c", 1.004))
    assert [item.key for item in policy.choose(waiting, 1.004).batch] == ["a", "b", "c"]
    policy.announce("d", 2.0)  # announced, never heard from: the window bounds the wait
    late = queue(policy, prompt("e", 2.0))
    assert policy.choose(late, 2.0).batch is None
    assert [item.key for item in policy.choose(late, 2.0 + PROMPT_GATHER_S).batch] == ["e"]


def test_sessions_prefilled_together_take_their_first_steps_together():
    """After a prompt's last chunk the session is a peer due at once: its first step is
    waited for `batch_wait_s`, so sessions prefilled in one forward decode in one too."""
    policy = BatchPolicy(BatchSettings(batch_wait_s=0.3))
    chunks = queue(policy, prompt("a", 1.0), prompt("b", 1.0))
    policy.ran(policy.choose(chunks, 1.0).batch, 0.05, 1.05)
    first = queue(policy, decode("a", 1.06))
    choice = policy.choose(first, 1.06)
    assert choice.batch is None  # b is due
    both = first + queue(policy, decode("b", 1.09))
    assert [item.key for item in policy.choose(both, 1.09).batch] == ["a", "b"]
    policy.forget("a"), policy.forget("b")
    lone = queue(policy, decode("d", 5.0))  # a session that never prefilled here: not waited for
    assert policy.choose(lone, 5.0).batch is not None


def test_a_session_has_one_step_in_a_forward():
    """Pipelined verify windows of one session wait in line: the next needs this one's KV."""
    policy = BatchPolicy()
    waiting = queue(policy, decode("a", 1.0), decode("a", 1.0), decode("b", 1.0))
    assert [item.payload for item in policy.choose(waiting, 1.0).batch] == ["a@1.0", "b@1.0"]
