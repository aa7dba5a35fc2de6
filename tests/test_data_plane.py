"""The data plane on a chain: every decode step runs on its stage's engine, start to frame, with
no hand-off to the event loop per token; a bad step closes only its own connection; a request
its consumer leaves leaves its lane clean."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import numpy as np
import pytest

from chain_support import PROMPTS, reference_greedy, run, start_chain
from skippy.driver.backend import Token
from skippy.protocol import MessageKind, SamplingConfig, StageMessage, encode_message, read_reply, write_message
from skippy.protocol.stream import client_handshake


@pytest.mark.parametrize("max_tokens, stop_at", [(24, None), (7, None), (24, 9)])
def test_decoding_on_the_engines_equals_one_process(make_stage, max_tokens, stop_at):
    expected, _ = reference_greedy(make_stage(), PROMPTS[1], 24)
    stop_ids = () if stop_at is None else (expected[stop_at],)
    expected = expected[:max_tokens] if stop_at is None else expected[:expected.index(expected[stop_at])]

    async def main():
        chain = await start_chain(make_stage, 3)
        try:
            result = await chain.client.generate(PROMPTS[1], max_tokens=max_tokens, stop_ids=stop_ids)
            assert result.tokens == expected
            assert result.finish_reason == ("length" if stop_at is None else "stop")
        finally:
            await chain.close()

    run(main())


def test_a_decode_token_crosses_every_stage_without_the_event_loop(make_stage):
    """Below stage 0 the event loop hears only a request's control messages: 20 more tokens
    add no event on either stage. Each stage's metrics still count every step."""
    async def events_for(chain, max_tokens: int) -> list[int]:
        before = [server.engine.num_events for server in chain.servers]
        await chain.client.generate(PROMPTS[0], max_tokens=max_tokens)
        await asyncio.sleep(0.2)  # the last request's Stop has run everywhere
        return [server.engine.num_events - count for server, count in zip(chain.servers, before)]

    async def main():
        chain = await start_chain(make_stage, 3)
        try:
            await chain.client.generate(PROMPTS[0], max_tokens=2)  # warm
            short, long = await events_for(chain, 4), await events_for(chain, 24)
            assert short == long
            for server in chain.servers:
                values = await server.engine.call(lambda runtime=server.runtime: runtime.metric_values())
                assert values.counters["rows.decode"] == 1 + 3 + 23
        finally:
            await chain.close()

    run(main())


def test_a_bad_step_closes_that_lane_only(make_stage, caplog):
    async def main():
        chain = await start_chain(make_stage, 3)
        middle = chain.servers[0]
        try:
            # a lane of our own to stage 1 (predictions relayed back on it: no return stream)
            host, port = middle.endpoint.rsplit(":", 1)
            reader, writer = await asyncio.open_connection(host, int(port))
            await client_handshake(reader, writer)
            width = make_stage().args.hidden_size
            row = np.zeros((1, width), dtype=np.float32)

            def step(pos: int, kind=MessageKind.DecodeEmbd) -> StageMessage:
                return StageMessage(kind, request_id=7, session_id=1, pos_start=pos, token_count=1,
                                    tokens=[5], current_token=5, source_stage_index=0, activation_rows=1,
                                    activation_width=width, activation=row.data, prompt_token_count=1)

            await write_message(writer, step(0, MessageKind.PrefillFinalEmbd))
            assert (await read_reply(reader)).predicted_tokens
            await write_message(writer, step(1))
            assert (await read_reply(reader)).predicted_tokens
            with caplog.at_level(logging.WARNING, logger="skippy.stage"):
                await write_message(writer, step(5))  # past the session's 2 positions
                assert await asyncio.wait_for(read_reply(reader), 10) is None  # closed
            assert "closing connection" in caplog.text and "position 5" in caplog.text
            result = await chain.client.generate(PROMPTS[2], max_tokens=4)  # the stage serves on
            assert len(result.tokens) == 4
        finally:
            await chain.close()

    run(main())


def test_a_request_left_early_leaves_its_lane_clean(make_stage, caplog):
    expected, _ = reference_greedy(make_stage(), PROMPTS[0], 16)

    async def main():
        chain = await start_chain(make_stage, 2, lane_count=1)
        try:
            with caplog.at_level(logging.WARNING):
                for _ in range(3):  # a consumer that stops reading, as at a stop string
                    async with contextlib.aclosing(chain.client.run(PROMPTS[0], max_tokens=64)) as events:
                        tokens = []
                        async for event in events:
                            if isinstance(event, Token):
                                tokens.append(event.token_id)
                                if len(tokens) == 10:
                                    break
                    assert tokens == expected[:10]
                result = await chain.client.generate(PROMPTS[0], max_tokens=16)
            assert result.tokens == expected
            assert "closing connection" not in caplog.text and "Stop failed" not in caplog.text
        finally:
            await chain.close()

    run(main())


def test_logprobs_come_with_their_tokens(make_stage):
    expected, _ = reference_greedy(make_stage(), PROMPTS[1], 12)

    async def main():
        chain = await start_chain(make_stage, 2)
        try:
            events = [event async for event in chain.client.run(PROMPTS[1], max_tokens=12,
                                                                 sampling=SamplingConfig(logprobs=2))]
            tokens = [event for event in events if isinstance(event, Token)]
            assert [t.token_id for t in tokens] == expected
            assert all(t.logprob is not None and t.logprob.token == t.token_id for t in tokens)
        finally:
            await chain.close()

    run(main())
