"""Link conditioning (a test knob): frames arrive late by the delay, the bandwidth and the
stalls asked for, in order, the same way on every run with one seed; a conditioned chain
decodes slower by about its round trip."""

from __future__ import annotations

import asyncio
import time

import pytest

from chain_support import run
from skippy.cli import build_parser, stage_config
from skippy.launch.local_chain import LocalChain
from skippy.protocol import LinkConditioning, StageConfig
from skippy.stage.link import ConditionedWriter


async def arrivals(conditioning: LinkConditioning, frames: list[bytes]) -> list[tuple[float, bytes]]:
    """(seconds after the first write, frame) as a reader on a real socket receives them."""
    received: asyncio.Queue = asyncio.Queue()

    async def serve(reader, writer):
        for frame in frames:
            data = await reader.readexactly(len(frame))
            received.put_nowait((time.monotonic(), data))

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    _, raw = await asyncio.open_connection("127.0.0.1", server.sockets[0].getsockname()[1])
    writer = ConditionedWriter(raw, conditioning)
    started = time.monotonic()
    for frame in frames:
        writer.write(frame)
        await writer.drain()  # returns at once: the sender is not held up by the wire
    assert time.monotonic() - started < 0.05
    got = [await asyncio.wait_for(received.get(), 10) for _ in frames]
    writer.close()
    server.close()
    return [(at - started, frame) for at, frame in got]


def test_delay_bandwidth_order_and_stalls():
    frames = [bytes([i]) * 12_500 for i in range(4)]  # 100 kbit each
    delayed = run(arrivals(LinkConditioning(delay_ms=50), frames))
    assert [f for _, f in delayed] == frames and all(0.05 <= at < 0.09 for at, _ in delayed)
    capped = run(arrivals(LinkConditioning(mbps=2), frames))  # 50 ms a frame, back to back
    # A busy machine can only make a frame later, so the schedule is a floor; the ceiling is loose.
    assert [f for _, f in capped] == frames
    assert all(0.05 * (i + 1) - 0.005 <= at < 0.05 * (i + 1) + 0.25 for i, (at, _) in enumerate(capped))
    stalled = run(arrivals(LinkConditioning(stall_ms=100, stall_p=1.0), frames[:1]))
    assert stalled[0][0] >= 0.1


def test_jitter_is_seeded_and_keeps_order():
    frames = [bytes([i]) * 10 for i in range(20)]
    first = run(arrivals(LinkConditioning(delay_ms=5, jitter_ms=30, seed=7), frames))
    second = run(arrivals(LinkConditioning(delay_ms=5, jitter_ms=30, seed=7), frames))
    assert [f for _, f in first] == frames  # jitter never reorders a link
    assert [round(a, 2) for a, _ in first] == pytest.approx([round(a, 2) for a, _ in second], abs=0.02)


def test_the_stage_command_sets_each_field(tmp_path):
    StageConfig(stage_id="s1", stage_index=1, layer_start=0, layer_end=1, model_path="m.gguf").save(tmp_path / "s.json")
    flags = ["--downstream-wire-delay-ms", "20", "--downstream-wire-jitter-ms", "3", "--downstream-wire-mbps", "100",
             "--downstream-wire-stall-ms", "50", "--downstream-wire-stall-p", "0.1", "--downstream-wire-seed", "4"]
    config = stage_config(build_parser().parse_args(["stage", "--config", str(tmp_path / "s.json"), *flags]))
    assert config.link_conditioning == LinkConditioning(delay_ms=20, jitter_ms=3, mbps=100, stall_ms=50,
                                                        stall_p=0.1, seed=4)


@pytest.mark.slow
def test_a_conditioned_chain_pays_its_round_trip(gguf_path):
    async def per_token_s(conditioning: LinkConditioning | None) -> float:
        async with LocalChain(gguf_path, 2, threads=1, ctx_size=256, link_conditioning=conditioning) as client:
            prompt = list(range(100, 120))
            await client.generate(prompt, max_tokens=2)  # warm
            result = await client.generate(prompt, max_tokens=12)
            return result.timings.decode_s / (len(result.tokens) - 1)

    plain = run(per_token_s(None))
    delayed = run(per_token_s(LinkConditioning(delay_ms=20)))  # stage 0 -> 1 and 1's return -> 0
    assert delayed - plain >= 0.038
