"""Supervised local stages: `skippy serve --stages N` restarts a stage process that dies, with
a budget; past it the stage stays down and the API names it (503 on /readyz and requests)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from frontend_support import ServeProcess, child_pids

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct.Q4_1"


def complete(url: str) -> httpx.Response:
    return httpx.post(url + "/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": "The three primary colours are", "max_tokens": 12, "temperature": 0})


def stage_pid(server: ServeProcess, index: int) -> int:
    """The pid of local stage `index`: the child started from its config file."""
    for pid in child_pids(server.process.pid):
        if f"stage-{index}.json" in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
            return pid
    raise AssertionError(f"no process for stage {index}")


def wait_for(predicate, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.1)
    raise AssertionError(f"not within {timeout_s:g} s")


def stage(url: str, stage_id: str) -> dict:
    return next(s for s in httpx.get(url + "/v1/stages").json()["data"] if s["id"] == stage_id)


def test_a_killed_stage_is_restarted_and_the_chain_serves_again(tmp_path):
    server = ServeProcess(["--stages", "3"], tmp_path / "serve.log")
    try:
        before = complete(server.url)
        assert before.status_code == 200
        killed = stage_pid(server, 1)
        os.kill(killed, signal.SIGKILL)
        wait_for(lambda: stage(server.url, "stage-1")["restarts"] == 1, 30)
        wait_for(lambda: httpx.get(server.url + "/readyz").status_code == 200, 60)
        after = complete(server.url)
        assert after.status_code == 200, after.text
        assert after.json()["choices"][0]["text"] == before.json()["choices"][0]["text"]
        info = stage(server.url, "stage-1")
        assert info["state"] == "ready" and "SIGKILL" in info["last_failure"]
        assert stage_pid(server, 1) != killed
        assert 'skippy_stage_restarts{stage="stage-1"} 1.0' in httpx.get(server.url + "/metrics").text
    finally:
        assert server.stop() == 0
    log = server.log_text()
    assert "stage 1 exited with signal SIGKILL; restarting it in" in log and "stage 1 is back" in log


def test_past_its_restart_budget_a_stage_stays_down_and_is_named(tmp_path):
    server = ServeProcess(["--stages", "2", "--max-restarts", "0"], tmp_path / "serve.log")
    try:
        assert complete(server.url).status_code == 200
        os.kill(stage_pid(server, 1), signal.SIGKILL)
        wait_for(lambda: stage(server.url, "stage-1")["state"] == "failed", 30)
        ready = httpx.get(server.url + "/readyz")
        assert ready.status_code == 503
        assert "stage-1" in ready.json()["error"]["message"] and "SIGKILL" in ready.json()["error"]["message"]
        started = time.monotonic()
        failed = complete(server.url)
        assert failed.status_code == 503 and "stage-1" in failed.json()["error"]["message"]
        assert time.monotonic() - started < 5  # fails fast, never hangs
    finally:
        assert server.stop() == 0


def test_a_hung_stage_is_killed_and_restarted(tmp_path):
    server = ServeProcess(["--stages", "2"], tmp_path / "serve.log")
    try:
        before = complete(server.url).json()["choices"][0]["text"]
        hung = stage_pid(server, 1)
        os.kill(hung, signal.SIGSTOP)  # alive, but answers nothing
        info = wait_for(lambda: (s := stage(server.url, "stage-1"))["restarts"] == 1 and s, 30)
        assert "stopped answering status queries" in info["last_failure"]
        wait_for(lambda: httpx.get(server.url + "/readyz").status_code == 200, 60)
        assert complete(server.url).json()["choices"][0]["text"] == before
        assert stage_pid(server, 1) != hung
    finally:
        assert server.stop() == 0
