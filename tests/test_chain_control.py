"""The control semantics of the stage chain, one test each (spec §2.4, §2.6, §3.4, §5.3)."""

from __future__ import annotations

import asyncio
import logging

import numpy as np
import pytest

from chain_support import PROMPTS, reference_greedy, run, start_chain
from skippy.protocol import (
    MessageKind, ReplyKind, SamplingConfig, StageMessage, client_handshake, read_reply,
    write_message,
)
from skippy.runtime.batch_policy import BatchSettings
from skippy.runtime.stage_runtime import BATCHED_STEPS_COUNTER

PROMPT = PROMPTS[1]  # 40 tokens
P = len(PROMPT)


@pytest.fixture(scope="module")
def greedy(make_stage):
    """g[0..7]: the one-process greedy continuation of PROMPT."""
    return reference_greedy(make_stage(), PROMPT, 8)[0]


async def verify(session, tokens, window_id, *, pos_start=None):
    """One VerifyWindow and its predictions (the decoder sends and waits apart, to pipeline them)."""
    await session.submit_verify(tokens, window_id, pos_start=pos_start)
    return await session.wait_window(window_id)


def final_session(chain):
    (session,) = [chain.servers[-1].runtime.session(k) for k in chain.servers[-1].runtime.sessions.keys()]
    return session


def test_trim_then_decode_equals_a_fresh_run(make_stage, greedy):
    async def main():
        chain = await start_chain(make_stage, 3)
        try:
            async with chain.client.session(SamplingConfig(), P) as s:
                assert await s.prefill(PROMPT) == greedy[0]
                assert await s.decode(greedy[0]) == greedy[1]
                assert await s.decode(greedy[1]) == greedy[2]
                await s.trim(P)  # forget both decode steps on every stage
                assert final_session(chain).cache.length == P
                assert len(final_session(chain).ledger) == P
                assert [await s.decode(greedy[0]), await s.decode(greedy[1])] == greedy[1:3]
        finally:
            await chain.close()

    run(main())


def test_verify_window_rows_equal_sequential_decode(make_stage, greedy):
    async def main():
        chain = await start_chain(make_stage, 3)
        try:
            async with chain.client.session(SamplingConfig(), P) as s:
                await s.prefill(PROMPT)
                # drafts that are right: one target prediction per row, as sequential decode
                assert await verify(s, greedy[:4], window_id=7) == greedy[1:5]
                # a wrong draft: row 0 still predicts greedy[1]; pos_start rewinds every stage
                rows = await verify(s, [greedy[0], 17, 99], window_id=8, pos_start=P)
                assert rows[0] == greedy[1]
        finally:
            await chain.close()

    run(main())


def test_retire_then_decode(make_stage, greedy):
    async def main():
        chain = await start_chain(make_stage, 3)
        try:
            async with chain.client.session(SamplingConfig(), P) as s:
                await s.prefill(PROMPT)
                assert await verify(s, greedy[:4], window_id=3) == greedy[1:5]
                assert set(final_session(chain).verify_windows) == {3}
                await s.retire(P, 1)  # all drafts accepted: the window's checkpoint goes
                assert await s.decode(greedy[4], pos_start=P + 4) == greedy[5]
                assert final_session(chain).verify_windows == {}
                assert chain.servers[0].runtime.session(
                    chain.servers[0].runtime.sessions.keys()[0]).verify_windows == {}
        finally:
            await chain.close()

    run(main())


def test_a_session_that_is_ahead_is_auto_aligned_by_pos_start(make_stage, greedy):
    async def main():
        chain = await start_chain(make_stage, 3)
        try:
            async with chain.client.session(SamplingConfig(), P) as s:
                await s.prefill(PROMPT)
                for token in greedy[:3]:
                    await s.decode(token)  # every stage now holds P + 3 positions
                # rewind by position alone: no TrimSession message
                assert await s.decode(greedy[0], pos_start=P) == greedy[1]
                assert final_session(chain).cache.length == P + 1
            for server in chain.servers:
                assert server.telemetry.counters["skippy.stage.session_auto_align"] == 1
        finally:
            await chain.close()

    run(main())


def test_final_stage_skips_discarded_windows_middle_stages_run_them(make_stage, greedy):
    async def main():
        chain = await start_chain(make_stage, 3)
        try:
            async with chain.client.session(SamplingConfig(), P) as s:
                await s.prefill(PROMPT)
                await s.discard_windows(5, 5)
                await s.submit_verify(greedy[:2], window_id=5)       # stale: never answered
                assert await verify(s, greedy[:3], window_id=6, pos_start=P) == greedy[1:4]
                middle = chain.servers[0].runtime
                assert set(middle.session(middle.sessions.keys()[0]).verify_windows) == {5, 6}
                assert set(final_session(chain).verify_windows) == {6}
                assert s.slot.draws == 1 + 3  # the prompt's token and window 6's rows: 5 never answered
        finally:
            await chain.close()

    run(main())


def test_stop_ack_carries_merged_stats_from_every_stage(make_stage, greedy):
    async def main():
        chain = await start_chain(make_stage, 4, prefill_chunk=16)  # 40 = 16+16+8
        try:
            async with chain.client.session(SamplingConfig(), P) as s:
                assert await s.prefill(PROMPT) == greedy[0]
                await s.decode(greedy[0])
                total = await s.stop()
                ack = s.stop_ack_stats
        finally:
            await chain.close()
        # Stages 1 and 2 never send predictions: their stats ride on the Stop ACK.
        assert ack.prefill_compute_observation_count == 2 * 3
        assert ack.prefill_edge_observation_count == 2 * 2   # their async-forwarded chunks
        # The whole request: 4 stages x 3 chunks computed, 3 links x 2 async chunks.
        assert total.prefill_compute_observation_count == 4 * 3
        assert total.prefill_edge_observation_count == 3 * 2
        assert total.prefill_compute_token_count_at_slowest_rate == 16  # a tail never wins

    run(main())


async def _raw_client(endpoint: str):
    host, port = endpoint.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    await client_handshake(reader, writer)
    return reader, writer


def _rows(n: int, width: int = 576) -> np.ndarray:
    return np.random.default_rng(n).standard_normal((n, width), dtype=np.float32)


def test_stop_with_deferred_replies_pending_is_refused(make_stage, caplog):
    caplog.set_level(logging.WARNING, logger="skippy.stage")

    async def main():
        chain = await start_chain(make_stage, 3)
        middle, final = chain.servers
        try:
            reader, writer = await _raw_client(middle.endpoint)
            common = dict(request_id=1, session_id=1, source_stage_index=0)
            await write_message(writer, StageMessage(MessageKind.ConfigureGeneration, **common))
            assert (await read_reply(reader)).kind == ReplyKind.Ack
            for start in (0, 3):
                rows = _rows(3)
                await write_message(writer, StageMessage(
                    MessageKind.PrefillEmbd, pos_start=start, token_count=3, tokens=[5, 6, 7],
                    activation_rows=3, activation_width=576, activation=rows.data, **common))
                assert (await read_reply(reader)).kind == ReplyKind.Ack  # the early ACKs
            await write_message(writer, StageMessage(MessageKind.Stop, **common))
            assert await read_reply(reader) is None   # refused: the connection is closed
            for _ in range(100):
                if not len(middle.runtime.sessions) and not len(final.runtime.sessions):
                    break
                await asyncio.sleep(0.05)
            assert len(middle.runtime.sessions) == 0 and len(final.runtime.sessions) == 0
            writer.close()
        finally:
            await chain.close()

    run(main())
    assert "cannot stop with 2 deferred prefill replies" in caplog.text


def test_two_concurrent_sessions_are_independent_and_batched(make_stage):
    prompts = [PROMPTS[1], PROMPTS[3]]
    expected = [reference_greedy(make_stage(), p, 12)[0] for p in prompts]

    async def main():
        chain = await start_chain(make_stage, 3, concurrency=2, batch=BatchSettings(batch_wait_s=1.0))
        try:
            # In lock step, so both sessions' steps reach every stage together whatever the
            # machine's load (free-running, they settle into two waves that need not meet).
            async with chain.client.session(SamplingConfig(), len(prompts[0])) as a, \
                    chain.client.session(SamplingConfig(), len(prompts[1])) as b:
                tokens = [list(await asyncio.gather(a.prefill(prompts[0]), b.prefill(prompts[1])))]
                while len(tokens) < 12:
                    tokens.append(list(await asyncio.gather(a.decode(tokens[-1][0]), b.decode(tokens[-1][1]))))
            assert [[t[0] for t in tokens], [t[1] for t in tokens]] == expected
            assert chain.client.telemetry.counters[BATCHED_STEPS_COUNTER] >= 1
            assert any(server.runtime.num_batched_forwards for server in chain.servers)
            # and each alone afterwards still gives the same tokens
            solo = await chain.client.generate(prompts[1], max_tokens=12)
            assert solo.tokens == expected[1]
        finally:
            await chain.close()

    run(main())


def test_relay_fallback_and_persistent_lanes(make_stage, greedy):
    """Without a direct return stream the middle stage relays predictions upstream; Stop
    resets the session but keeps the lane's connection for the next request."""
    async def main():
        chain = await start_chain(make_stage, 3)
        chain.servers[-1].returns.driver_endpoint = None   # the final stage cannot dial back
        try:
            for _ in range(2):
                result = await chain.client.generate(PROMPT, max_tokens=4)
                assert result.tokens == greedy[:4]
            assert chain.client.inbox.num_streams == 0       # nothing came back directly
            assert len(chain.servers[0].lanes) == 1       # one lane, reused
            assert len(chain.servers[1].lanes) == 1
            assert all(len(server.runtime.sessions) == 0 for server in chain.servers)
        finally:
            await chain.close()

    run(main())


def test_every_stage_reports_its_own_layers_and_open_sessions(make_stage, greedy):
    """GetStageStatus, asked of each stage on a connection of its own: the count is the
    stage's session table, so a session a stage failed to drop would show."""
    from skippy.stage.transport import Transport

    def query_stage_status(endpoint, token):
        return Transport(auth_token=token).query_status(endpoint)

    async def sessions_per_stage(chain) -> list[int]:
        reports = [await query_stage_status(server.endpoint, "t" * 16) for server in chain.servers]
        return [r.active_sessions for r in reports]

    async def main():
        chain = await start_chain(make_stage, 3, splits=[(0, 10), (10, 21), (21, 30)],
                                  stage_options={"auth_token": "t" * 16})
        try:
            reports = [await query_stage_status(s.endpoint, "t" * 16) for s in chain.servers]
            assert [(r.stage_index, r.layer_start, r.layer_end, r.lane_count) for r in reports] == [
                (1, 10, 21, 4), (2, 21, 30, 4)]
            assert await sessions_per_stage(chain) == [0, 0]
            async with chain.client.session(SamplingConfig(), P) as s:
                assert await s.prefill(PROMPT) == greedy[0]
                assert await sessions_per_stage(chain) == [1, 1]
            assert await sessions_per_stage(chain) == [0, 0]
            runtime = chain.servers[1].runtime  # a session leaked on stage 2 alone
            await chain.servers[1].engine.call(lambda: runtime.open_session((999, 1), 1))
            assert await sessions_per_stage(chain) == [0, 1]
            assert await query_stage_status(chain.servers[0].endpoint, "wrong-token-0000") is None
            assert await query_stage_status("127.0.0.1:1", None) is None  # nothing listens
        finally:
            await chain.close()

    run(main())
