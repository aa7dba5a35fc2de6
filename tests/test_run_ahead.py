"""Stage 0 runs each decode step ahead from its token (driver/run_ahead.py): it starts
exactly the steps the decoder would take, the output stays one process's, and a request
that ends early leaves its lane clean."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random

import pytest

from chain_support import PROMPTS, reference_greedy, run, start_chain
from skippy.driver.client import Token
from skippy.driver.run_ahead import DecodePlan, RunAhead
from skippy.protocol import StageReply, encode_reply
from skippy.protocol.decode_frames import token_reply
from skippy.runtime.lending import NEED_MORE, Taken
from skippy.runtime.speculation import Speculator


@pytest.mark.parametrize("seed", range(6))
def test_the_plan_continues_exactly_when_the_decoder_does(seed):
    rng = random.Random(seed)
    for _ in range(50):
        stop_ids = set(rng.sample(range(8), rng.randint(0, 2)))
        max_tokens, ctx_size, prompt = rng.randint(1, 12), rng.randint(4, 24), [9] * rng.randint(1, 6)
        if len(prompt) >= ctx_size:
            continue
        plan, spec = DecodePlan(stop_ids, max_tokens, ctx_size), Speculator(None, max_tokens, stop_ids)
        spec.start(prompt, 9)
        while not spec.is_finished:  # the decoder's plain loop (decoder.py _steps)
            position = spec.num_committed_positions
            if position + 1 > ctx_size:
                break
            token = rng.randrange(8)
            predicted = plan.continues(token, position, spec.num_emitted)
            spec.settle([], [token])
            assert predicted == (not spec.is_finished and spec.num_committed_positions + 1 <= ctx_size)


def test_the_feed_hands_each_token_on_and_starts_only_what_the_plan_allows():
    async def main():
        delivered, started = [], []

        def start_step(token, position, decode_step):
            started.append((token, position, decode_step))
            return ("step", token, position), None

        ahead = RunAhead(DecodePlan({2}, max_tokens=100, ctx_size=100), start_step, delivered.append,
                         asyncio.get_running_loop())
        buffer = bytearray(token_reply(5) + token_reply(6)[:100])
        assert ahead.feed(buffer) is NEED_MORE and not started  # not armed: the tokens only go on
        await asyncio.sleep(0)
        assert [r.predicted_tokens for r in delivered] == [[5]]

        ahead.arm(position=10, emitted=3, decode_step=4)
        buffer += token_reply(6)[100:] + token_reply(2)
        taken = ahead.feed(buffer)
        assert isinstance(taken, Taken) and taken.step == ("step", 6, 11) and started == [(6, 11, 5)]
        await asyncio.sleep(0)
        assert len(delivered) == 1  # a token whose step runs ahead reaches the loop after the step
        assert taken.done(None, "timed") is True
        assert ahead.take(11, 6).result() == ("timed", None)
        assert ahead.feed(buffer) is NEED_MORE  # 2 is a stop id: delivered, nothing started, disarmed
        assert not buffer and len(started) == 1
        buffer += token_reply(7)
        assert ahead.feed(buffer) is NEED_MORE and len(started) == 1
        await asyncio.sleep(0)
        assert [r.predicted_tokens for r in delivered] == [[5], [6], [2], [7]]

        ahead.arm(position=20, emitted=3, decode_step=9)
        other = bytearray(encode_reply(StageReply.window([1, 2], 3)))
        assert ahead.feed(other) is None and len(other) > 0  # not a plain token: the loop reads it
        buffer = bytearray(token_reply(8))
        ahead.feed(buffer)
        with pytest.raises(RuntimeError, match="fed token 8"):
            ahead.take(21, 9)

    run(main())


@pytest.mark.parametrize("max_tokens, stop_at", [(24, None), (7, None), (24, 9)])
def test_run_ahead_output_equals_one_process(make_stage, max_tokens, stop_at):
    expected, _ = reference_greedy(make_stage(), PROMPTS[1], 24)
    stop_ids = () if stop_at is None else (expected[stop_at],)
    expected = expected[:max_tokens] if stop_at is None else expected[:expected.index(expected[stop_at])]

    async def main():
        chain = await start_chain(make_stage, 2)
        try:
            result = await chain.client.generate(PROMPTS[1], max_tokens=max_tokens, stop_ids=stop_ids)
            assert result.tokens == expected
            assert result.finish_reason == ("length" if stop_at is None else "stop")
            assert chain.client.runtime.scheduler.stats.lent_steps >= len(expected) - 4  # it ran ahead
        finally:
            await chain.close()

    run(main())


def test_a_request_with_logprobs_does_not_lend_its_return_stream(make_stage):
    """The final stage's replies then carry logprobs, which the run-ahead never takes: lending
    the stream for each one, only to have it handed back, would cost a loan a token."""
    from skippy.protocol.sampling_config import SamplingConfig

    expected, _ = reference_greedy(make_stage(), PROMPTS[1], 12)

    async def main():
        chain = await start_chain(make_stage, 2)
        try:
            stats = chain.client.runtime.scheduler.stats
            result = await chain.client.generate(PROMPTS[1], max_tokens=12, sampling=SamplingConfig(logprobs=2))
            assert result.tokens == expected
            assert stats.loans == 0 and stats.lent_steps == 0
            await chain.client.generate(PROMPTS[1], max_tokens=12)
            assert stats.loans == 1 and stats.lent_steps >= 12 - 4  # a plain request still runs ahead
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
            assert chain.client.runtime.scheduler.stats.lent_steps > 0
        finally:
            await chain.close()

    run(main())
