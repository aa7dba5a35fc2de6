"""Chains of real processes: the CLI path, and a middle stage killed mid-generation."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import pytest

from chain_support import PROMPTS, reference_greedy, run, stage_config
from skippy.driver.session import ChainError
from skippy.driver.client import ChainClient
from skippy.launch.local_chain import free_ports
from skippy.protocol import PeerEndpoint, Timeouts
from skippy.runtime.stage_runtime import StageRuntime
from skippy.runtime.local_generation import GenerationLimits, generate_tokens
from skippy.stage.process import READY_PREFIX
from skippy.stage.server import StageServer

pytestmark = pytest.mark.slow


def test_cli_generate_on_three_stage_processes_matches_one_process(make_quant_stage, tokenizer):
    """The CLI's default weights are the GGUF's quantized blocks: three processes on
    that path give one process's greedy tokens on the same path."""
    command = [sys.executable, "-m", "skippy.cli", "generate", "--stages", "3", "--threads", "1",
               "--raw", "--json", "--max-tokens", "16", "The capital of France is"]
    out = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    limits = GenerationLimits(max_tokens=16, stop_ids=tokenizer.eog_ids)
    expected = list(generate_tokens(make_quant_stage(), got["prompt_ids"], limits))
    assert got["completion_ids"] == expected and len(expected) > 0


async def _spawn_stage(config_path) -> asyncio.subprocess.Process:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "skippy.cli", "stage", "--config", str(config_path), "--threads", "1",
        stdout=asyncio.subprocess.PIPE)
    while line := await asyncio.wait_for(process.stdout.readline(), 600):
        if line.decode().startswith(READY_PREFIX):
            return process
    raise AssertionError(f"stage exited with {await process.wait()} before it was ready")


async def _final_stage_and_middle_config(make_stage, gguf_path, tmp_path):
    """(the final stage [20, 30) in this process, started; the middle stage's endpoint and the
    path of its config [10, 20), for `_spawn_stage`): stage 0 [0, 10) dials the endpoint."""
    final = StageServer(stage_config(2, (20, 30), str(gguf_path)),
                        StageRuntime(make_stage(20, 30)))
    await final.start()
    middle_endpoint = f"127.0.0.1:{free_ports(1)[0]}"
    config_path = tmp_path / "stage-1.json"
    stage_config(1, (10, 20), str(gguf_path), bind_addr=middle_endpoint, weight_dtype="f32",
                 downstream=PeerEndpoint(stage_id="s2", stage_index=2,
                                         endpoint=final.endpoint)).save(config_path)
    return final, middle_endpoint, config_path


def test_killing_a_middle_stage_fails_fast_and_a_restart_recovers(make_stage, gguf_path, tmp_path):
    prompt = PROMPTS[1]
    expected = reference_greedy(make_stage(), prompt, 6)[0]

    async def main():
        final, middle_endpoint, config_path = await _final_stage_and_middle_config(make_stage, gguf_path, tmp_path)
        middle = await _spawn_stage(config_path)
        # recovery off: this is the path of a chain that does not come back in time
        client = ChainClient(make_stage(0, 10), downstream=middle_endpoint, timeouts=Timeouts(recovery_s=0))
        try:
            await client.start()
            final.returns.driver_endpoint = client.return_endpoint
            assert (await client.generate(prompt, max_tokens=6)).tokens == expected

            seen, killed_at = [], []

            def kill_after_three(token: int) -> None:
                seen.append(token)
                if len(seen) == 3:
                    middle.kill()
                    killed_at.append(time.monotonic())

            with pytest.raises(ChainError, match="during .*(closed|lost)"):
                await client.generate(prompt, max_tokens=200, on_token=kill_after_three)
            assert time.monotonic() - killed_at[0] < 5.0
            await middle.wait()
            # the surviving stages free the session
            for _ in range(100):
                if not len(final.runtime.sessions):
                    break
                await asyncio.sleep(0.05)
            assert len(final.runtime.sessions) == 0
            assert len(client.runtime.sessions) == 0

            restarted = await _spawn_stage(config_path)
            try:
                assert (await client.generate(prompt, max_tokens=6)).tokens == expected
                assert client.telemetry.counters["stage.openai_downstream_lane_replaced"] == 1
            finally:
                restarted.terminate()
                await restarted.wait()
        finally:
            if middle.returncode is None:
                middle.kill()
                await middle.wait()
            await client.close()
            await final.close()

    run(main(), timeout=900)


@pytest.mark.parametrize("mode", ["greedy", "speculative", "seeded"])
def test_a_generation_survives_its_middle_stage_dying_and_coming_back(make_stage, gguf_path, tmp_path, mode):
    """The middle stage is killed twice mid-decode and started again a moment later: the
    generation pauses, replays its prompt and committed tokens on a fresh lane, and ends with
    exactly the tokens of an uninterrupted run (greedy, with speculation, or seeded sampling)."""
    from skippy.protocol import SamplingConfig
    from skippy.runtime.speculation import SpeculativeSettings

    prompt = PROMPTS[1]
    settings = SpeculativeSettings("ngram-suffix" if mode == "speculative" else "off")
    sampling = SamplingConfig(temperature=0.9, top_p=0.95, seed=11) if mode == "seeded" else SamplingConfig()

    async def main():
        final, middle_endpoint, config_path = await _final_stage_and_middle_config(make_stage, gguf_path, tmp_path)
        middle = [await _spawn_stage(config_path)]
        client = ChainClient(make_stage(0, 10), downstream=middle_endpoint, timeouts=Timeouts(recovery_s=60),
                             speculative=settings)
        restarts: list[asyncio.Task] = []

        async def restart_soon() -> None:
            await middle[0].wait()
            await asyncio.sleep(0.5)
            middle[0] = await _spawn_stage(config_path)

        def kill_at(token: int) -> None:
            seen.append(token)
            if len(seen) in (5, 20):
                middle[0].kill()
                restarts.append(asyncio.get_running_loop().create_task(restart_soon()))

        seen: list[int] = []
        try:
            await client.start()
            final.returns.driver_endpoint = client.return_endpoint
            expected = (await client.generate(prompt, max_tokens=40, sampling=sampling)).tokens
            result = await client.generate(prompt, max_tokens=40, sampling=sampling, on_token=kill_at)
            assert result.tokens == expected
            assert len(restarts) == 2 and client.telemetry.counters["stage0.recoveries"] == 2
            await asyncio.gather(*restarts)
            for _ in range(100):  # nothing left behind on any stage
                if not len(final.runtime.sessions):
                    break
                await asyncio.sleep(0.05)
            assert len(final.runtime.sessions) == 0 and len(client.runtime.sessions) == 0
        finally:
            if middle[0].returncode is None:
                middle[0].kill()
                await middle[0].wait()
            await client.close()
            await final.close()

    run(main(), timeout=900)
