"""Link conditioning (a test knob): frames arrive late by the delay, the bandwidth and the
stalls asked for, in order, the same way on every run with one seed; a conditioned chain
decodes slower by about its round trip."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from chain_support import run
from skippy.cli import build_parser, stage_config
from skippy.launch.local_chain import LocalChain
from skippy.protocol import LinkConditioning, StageConfig
from skippy.stage.channel import Channel
from skippy.stage.engine import Engine
from skippy.stage.link import Conditioner


def schedule(conditioning: LinkConditioning, sizes: list[int], now: float = 100.0) -> list[float]:
    """When each frame of `sizes` bytes, all written at `now`, reaches the far end (seconds after)."""
    conditioner = Conditioner(conditioning)
    return [conditioner.deliver_at(size, now) - now for size in sizes]


def test_delay_bandwidth_order_and_stalls():
    frames = [12_500] * 4  # 100 kbit each
    assert schedule(LinkConditioning(delay_ms=50), frames) == pytest.approx([0.05] * 4)
    capped = schedule(LinkConditioning(mbps=2), frames)  # 50 ms a frame, back to back
    assert capped == pytest.approx([0.05 * (i + 1) for i in range(4)])
    assert schedule(LinkConditioning(stall_ms=100, stall_p=1.0), frames[:1]) == pytest.approx([0.1])


def test_jitter_is_seeded_and_keeps_order():
    first = schedule(LinkConditioning(delay_ms=5, jitter_ms=30, seed=7), [10] * 20)
    assert first == sorted(first)  # jitter never reorders a link
    assert first == schedule(LinkConditioning(delay_ms=5, jitter_ms=30, seed=7), [10] * 20)
    assert first != schedule(LinkConditioning(delay_ms=5, jitter_ms=30, seed=8), [10] * 20)


class Recorded(Conditioner):
    """A conditioner that keeps each frame's delivery time."""

    def __init__(self, conditioning: LinkConditioning):
        super().__init__(conditioning)
        self.due: list[float] = []

    def deliver_at(self, nbytes: int, now: float) -> float:
        self.due.append(super().deliver_at(nbytes, now))
        return self.due[-1]


class NoModel:
    def run_ready(self):
        return None


def test_a_delayed_frame_leaves_at_its_delivery_time_not_before_nor_a_millisecond_after():
    """The knob stands for a wire: a frame written now reaches the peer `delay` later. The
    engine's timer used to round each wait up to a whole millisecond (0.5-1 ms late a frame,
    which the WAN bench then charged to the chain). None arrives early; load only ever makes
    one later, so the best of 12 is the knob's own precision."""
    async def main():
        engine = Engine(NoModel(), asyncio.get_running_loop(), name="test-engine")
        engine.start()
        ours, theirs = socket.socketpair()
        conditioner = Recorded(LinkConditioning(delay_ms=2.5))
        arrived = []
        try:
            channel = await engine.call(lambda: Channel(engine, ours, name="knob", parse=None, on_frame=lambda _: None,
                                                        on_close=lambda *_: None, conditioner=conditioner))

            def receive() -> None:
                theirs.recv(64)
                arrived.append(time.perf_counter())

            for _ in range(12):  # one at a time: each frame's own delay, no queue
                reader = asyncio.create_task(asyncio.to_thread(receive))
                await asyncio.sleep(0.005)  # the reader waits in recv
                await engine.call(lambda: channel.send(b"x" * 64))
                await asyncio.wait_for(reader, 5)
        finally:
            await asyncio.to_thread(engine.close)
            theirs.close()
        late = [a - due for a, due in zip(arrived, conditioner.due)]
        assert min(late) >= 0.0 and min(late) < 0.0004, [round(x * 1e3, 3) for x in late]

    run(main())


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
