"""A restart after a stage's death applies the chain's split advice under `--split auto`
(launch/split_restart.py): every stage starts again on the advised ranges, and a request in
flight replays onto the new chain with the same greedy text; without advice the restart is
the supervisor's usual one, on the old ranges."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import time
from pathlib import Path

import pytest

from chain_support import PROMPTS, run
from frontend_support import child_pids
from skippy.driver import split_check
from skippy.launch import local_chain, measured_split
from skippy.launch.local_chain import start_stage0
from skippy.launch.serve import ServeConfig, build_backend
from skippy.launch.split_restart import advised_ranges

pytestmark = pytest.mark.slow

ADVISED = [(0, 7), (7, 30)]
TOKENS = 40


def stage_pid(index: int) -> int:
    for pid in child_pids(os.getpid()):
        if f"stage-{index}.json" in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
            return pid
    raise AssertionError(f"no process for stage {index}")


async def one_process(gguf_path, prompt: list[int]) -> list[int]:
    client = await start_stage0(gguf_path, ctx_size=256)
    try:
        return (await client.generate(prompt, max_tokens=TOKENS)).tokens
    finally:
        await client.close()


async def kill_stage_1_mid_request(backend, prompt: list[int]) -> list[int]:
    """A greedy request's tokens, stage 1 SIGKILLed after its 4th; prints the pause."""
    at: list[float] = []

    def on_token(_token: int) -> None:
        at.append(time.monotonic())
        if len(at) == 4:
            os.kill(stage_pid(1), signal.SIGKILL)

    tokens = (await backend.client.generate(prompt, max_tokens=TOKENS, on_token=on_token)).tokens
    assert len(at) == TOKENS
    print(f"\nstage 1 SIGKILLed mid-request: the next token {at[4] - at[3]:.2f} s later")
    return tokens


async def serve_chain(gguf_path, monkeypatch):
    """`skippy serve --stages 2 --split auto`'s backend, its start-up split kept (the equal one:
    the test moves the advice, not the start), after every stage has decoded enough for
    /v1/stages to compare its forward with its probe."""
    planned = local_chain.plan_from_measurements

    async def kept(client, topology, *args, **kwargs):
        now, plan = await planned(client, topology, *args, **kwargs)
        return now, dataclasses.replace(plan, ranges=tuple((s.layer_start, s.layer_end) for s in topology.stages))

    monkeypatch.setattr(local_chain, "plan_from_measurements", kept)
    config = ServeConfig(model=gguf_path, num_stages=2, split="auto", threads=1, ctx_size=256, concurrency=2,
                         kv_cache_bytes=0, max_restarts=3, recovery_timeout_s=120)
    backend = await build_backend(config)
    for _ in range(2):
        await backend.client.generate(PROMPTS[1], max_tokens=split_check.MIN_FORWARDS)
    await asyncio.sleep(1.5)  # the supervisor's next status query holds those forwards (its last_report)
    return backend


def ranges_of(statuses) -> list[tuple[int, int]]:
    return [(s.layer_start, s.layer_end) for s in statuses]


def test_a_restart_applies_the_split_advice(gguf_path, monkeypatch, caplog):
    # every stage counts as off its prediction, and the advice is moved off the split it runs
    # (on one machine the stages measure alike: the planner's own pick is often the running split)
    monkeypatch.setattr(split_check, "DRIFT", -1.0)
    real = measured_split.advisor

    def moved(model, *, use_all_hosts):
        advise = real(model, use_all_hosts=use_all_hosts)
        return lambda statuses: {**advise(statuses), "ranges": [list(r) for r in ADVISED]}

    monkeypatch.setattr(measured_split, "advisor", moved)
    caplog.set_level(logging.WARNING)

    async def main():
        expected = await one_process(gguf_path, PROMPTS[0])
        backend = await serve_chain(gguf_path, monkeypatch)
        try:
            statuses = await backend.status()
            before = ranges_of(statuses)
            assert before != ADVISED
            advice = await backend.split_advice(statuses)  # what /v1/stages shows
            assert [tuple(r) for r in advice["ranges"]] == ADVISED
            first = backend.client
            assert await kill_stage_1_mid_request(backend, PROMPTS[0]) == expected  # replayed onto the new chain
            statuses = await backend.status()
            assert ranges_of(statuses) == ADVISED and [s.state for s in statuses] == ["ready", "ready"]
            assert backend.client is not first and first.current is backend.client
            assert (await backend.client.generate(PROMPTS[0], max_tokens=TOKENS)).tokens == expected
            line = f"[{before[0][0]}, {before[0][1]}) [{before[1][0]}, {before[1][1]}) -> [0, 7) [7, 30)"
            said = [r.message for r in caplog.records]
            assert any("restarting every stage on the advised split" in m and line in m for m in said), said
            assert any("resumed on a fresh lane" in m for m in said), said  # it broke, and went on
        finally:
            await backend.close()

    run(main())


def test_without_advice_a_restart_keeps_the_ranges(gguf_path, monkeypatch):
    monkeypatch.setattr(split_check, "DRIFT", 1e9)  # no stage is ever off: no advice

    async def main():
        expected = await one_process(gguf_path, PROMPTS[0])
        backend = await serve_chain(gguf_path, monkeypatch)
        try:
            before, first = ranges_of(await backend.status()), backend.client
            assert await kill_stage_1_mid_request(backend, PROMPTS[0]) == expected
            statuses = await backend.status()
            assert ranges_of(statuses) == before and statuses[1].restarts == 1 and backend.client is first
        finally:
            await backend.close()

    run(main())


def test_a_restart_applies_only_advice_it_can():
    current = [(0, 15), (15, 30)]
    assert advised_ranges(None, current) is None
    assert advised_ranges({"detail": "no measurement from stage-1 yet"}, current) is None
    assert advised_ranges({"ranges": [[0, 15], [15, 30]]}, current) is None  # the split it runs
    assert advised_ranges({"ranges": [[0, 30]]}, current) is None  # fewer hosts: not by a restart
    assert advised_ranges({"ranges": [[0, 9], [9, 30]]}, current) == [(0, 9), (9, 30)]
