"""A socket lent to the runtime's worker (runtime/lending.py, stage/lane_loan.py): the worker
runs the steps it reads, in order, and gives back every byte it did not take; a lane that
decodes alone is lent, and what ends the loan (a Stop, a bad step) takes the usual way."""

from __future__ import annotations

import asyncio
import logging
import socket

import numpy as np

from chain_support import PROMPTS, reference_greedy, run, start_chain
from skippy.protocol import MessageKind, StageMessage, read_reply, write_message
from skippy.runtime.lending import NEED_MORE, Taken
from skippy.runtime.scheduler import IterationScheduler
from skippy.stage.downstream import open_connection


def feed_steps(done: list):
    """Frames b"S<n>;" are steps; anything else is not the worker's to take."""
    def feed(buffer: bytearray):
        if not buffer.startswith(b"S"):
            return None
        end = buffer.find(b";")
        if end < 0:
            return NEED_MORE
        step = int(buffer[1:end])
        del buffer[:end + 1]
        return Taken(step, None, lambda error, timed: done.append((error, timed.value)) or True)
    return feed


def test_the_worker_runs_lent_steps_in_order_and_gives_back_the_rest():
    async def main():
        ran, done = [], []
        scheduler = IterationScheduler(lambda steps: ran.extend(steps) or [s * 10 for s in steps])
        ours, theirs = socket.socketpair()
        ours.setblocking(False)
        try:
            lent = scheduler.lend(ours.fileno(), "a", feed_steps(done))
            theirs.sendall(b"S1;S2;S")
            await asyncio.sleep(0.05)
            theirs.sendall(b"3;X and the rest")
            rest = await asyncio.wait_for(lent, 2)
            assert ran == [1, 2, 3]
            assert done == [(None, 10), (None, 20), (None, 30)]
            assert rest == b"X and the rest"  # not taken: back to the lender, every byte
            assert scheduler.stats.lent_steps == 3

            # work submitted the usual way ends a loan: a half-read frame goes back too
            lent = scheduler.lend(ours.fileno(), "a", feed_steps(done))
            theirs.sendall(b"S4")
            await asyncio.sleep(0.05)
            assert (await scheduler.submit_op(lambda: "op")).value == "op"
            assert await asyncio.wait_for(lent, 2) == b"S4"

            # a recall (the lender closing) ends it with nothing read
            lent = scheduler.lend(ours.fileno(), "a", feed_steps(done))
            scheduler.recall(lent)
            assert await asyncio.wait_for(lent, 2) == b""
            assert ran == [1, 2, 3]
        finally:
            scheduler.shutdown()
            ours.close()
            theirs.close()

    run(main())


def test_a_failed_lent_step_ends_the_loan_with_its_error():
    async def main():
        done = []
        scheduler = IterationScheduler(lambda steps: [ValueError(f"bad {s}") if s == 2 else s for s in steps])
        ours, theirs = socket.socketpair()
        ours.setblocking(False)

        def feed(buffer):
            taken = feed_steps(done)(buffer)
            if isinstance(taken, Taken):
                taken.done = lambda error, timed: done.append(error) or error is None
            return taken

        try:
            lent = scheduler.lend(ours.fileno(), "a", feed)
            theirs.sendall(b"S1;S2;S3;")
            assert await asyncio.wait_for(lent, 2) == b"S3;"
            assert [type(e).__name__ if e else None for e in done] == [None, "ValueError"]
        finally:
            scheduler.shutdown()
            ours.close()
            theirs.close()

    run(main())


def test_a_lane_decoding_alone_is_lent_and_its_tokens_match_one_process(make_stage):
    expected, _ = reference_greedy(make_stage(), PROMPTS[0], 24)

    async def main():
        chain = await start_chain(make_stage, 3)
        try:
            for _ in range(2):  # the Stop that ends a lent lane's request leaves it usable
                result = await chain.client.generate(PROMPTS[0], max_tokens=24)
                assert result.tokens == expected
            # every stage below stage 0 ran the decode steps after its first from the lent socket
            for server in chain.servers:
                assert server.runtime.scheduler.stats.lent_steps >= 2 * (24 - 3)
            assert chain.client.runtime.scheduler.stats.lent_steps >= 2 * (24 - 4)  # stage 0 ran ahead
            # and each stage's metrics count every step, lent or not: 23 decode steps a request
            for runtime in [chain.client.runtime, *(server.runtime for server in chain.servers)]:
                assert runtime.metric_values().counters["rows.decode"] == 2 * 23
        finally:
            await chain.close()

    run(main())


def test_a_bad_step_on_a_lent_lane_closes_that_lane_only(make_stage, caplog):
    async def main():
        chain = await start_chain(make_stage, 3)
        middle = chain.servers[0]
        try:
            # a lane of our own to stage 1 (predictions relayed back on it: no return stream)
            reader, writer = await open_connection(middle.endpoint, auth_token=None)
            width = make_stage().args.hidden_size
            row = np.zeros((1, width), dtype=np.float32)

            def step(pos: int, kind=MessageKind.DecodeEmbd) -> StageMessage:
                return StageMessage(kind, request_id=7, session_id=1, pos_start=pos, token_count=1,
                                    tokens=[5], current_token=5, source_stage_index=0, activation_rows=1,
                                    activation_width=width, activation=row.data, prompt_token_count=1)

            await write_message(writer, step(0, MessageKind.PrefillFinalEmbd))
            assert (await read_reply(reader)).predicted_tokens
            await write_message(writer, step(1))  # runs the usual way, then the lane is lent
            assert (await read_reply(reader)).predicted_tokens
            lent_before = middle.runtime.scheduler.stats.lent_steps
            with caplog.at_level(logging.WARNING, logger="skippy.stage"):
                await write_message(writer, step(5))  # past the session's 2 positions
                assert await asyncio.wait_for(read_reply(reader), 10) is None  # closed
            assert middle.runtime.scheduler.stats.lent_steps == lent_before + 1  # the worker ran it
            assert "closing connection" in caplog.text and "position 5" in caplog.text
            result = await chain.client.generate(PROMPTS[2], max_tokens=4)  # the stage serves on
            assert len(result.tokens) == 4
        finally:
            await chain.close()

    run(main())
