"""Standby stages on a multi-host style chain: `skippy plan --standby`, stages started by hand
(`skippy stage`), stage 0 by `skippy serve --topology`. Losing a stage moves every lane onto
its standby: a stream running through the lost stage goes on, with the same text."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from frontend_support import ServeProcess, wait_until
from skippy.launch.local_chain import free_ports
from skippy.stage.process import READY_PREFIX
from test_serve_recovery import complete
from test_serve_supervision import stage

pytestmark = pytest.mark.slow

TOKEN = "standby-test-token-0123456789"


def start_stage(config_path, topology_path, log_path, extra: list[str] = ()) -> subprocess.Popen:
    command = [sys.executable, "-m", "skippy.cli", "--log-level", "INFO", "stage", "--config", str(config_path),
               "--topology", str(topology_path), "--threads", "1", *extra]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=open(log_path, "w"), text=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    for line in process.stdout:
        if line.startswith(READY_PREFIX):
            threading.Thread(target=process.stdout.read, daemon=True).start()  # keep its pipe drained
            return process
    raise AssertionError(f"{config_path.name} exited with {process.wait()}; see {log_path}")


def stream_while(url: str, prompt: str, action, after_s: float) -> str:
    """The streamed answer to `prompt`, with `action` run `after_s` into it."""
    answer: list[str] = []
    thread = threading.Thread(target=lambda: answer.append(complete(url, prompt, max_tokens=160, stream=True)))
    thread.start()
    time.sleep(after_s)
    action()
    thread.join(timeout=300)
    return answer[0]


def test_a_lost_stage_fails_over_to_its_standby(tmp_path):
    ports = free_ports(5)
    hosts = ",".join(f"127.0.0.1:{port}" for port in ports[:3])
    standby_1, standby_2 = (f"127.0.0.1:{port}" for port in ports[3:])
    plan = subprocess.run([sys.executable, "-m", "skippy.cli", "plan", "--stages", "3", "--hosts", hosts,
                           "--standby", f"1={standby_1}", "--standby", f"2={standby_2}", "--auth-token", TOKEN,
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert plan.returncode == 0, plan.stderr
    assert f"(standbys: {standby_1})" in plan.stdout
    topology = tmp_path / "topology.json"
    names = ["stage-1", "stage-1-standby-1", "stage-2", "stage-2-standby-1"]
    stages = {name: start_stage(tmp_path / f"{name}.json", topology, tmp_path / f"{name}.log") for name in names}
    server = None
    try:
        server = ServeProcess(["--topology", str(topology), "--chain-auth-token", TOKEN, "--recovery-timeout", "5",
                               "--threads", "1"], tmp_path / "serve.log")
        url = server.url
        prompt = "Once upon a time, in a village by the sea, there lived"
        expected = complete(url, prompt, max_tokens=160)
        middle = stage(url, "stage-1")
        assert middle["standbys"] == [{"endpoint": standby_1, "state": "ready", "active_sessions": 0}]

        # the middle stage is lost mid-stream: the stream pauses, goes on through its standby
        assert stream_while(url, prompt, stages["stage-1"].kill, 0.8) == expected
        middle = stage(url, "stage-1")
        assert middle["state"] == "down" and middle["standbys"][0]["state"] == "ready"
        assert httpx.get(url + "/readyz").status_code == 200  # the chain still serves
        assert complete(url, prompt, max_tokens=160) == expected

        # then the final stage: its standby takes the lanes (and returns the tokens to stage 0)
        assert stream_while(url, prompt, stages["stage-2"].kill, 0.8) == expected
        assert stage(url, "stage-2")["state"] == "down"
        assert httpx.get(url + "/readyz").status_code == 200
        assert wait_until(lambda: all(s["active_sessions"] == 0 for s in stage(url, "stage-1")["standbys"]), 10)

        # with the standby lost too, nothing serves stage-1's layers: 503 naming it
        stages["stage-1-standby-1"].kill()
        assert wait_until(lambda: httpx.get(url + "/readyz").status_code == 503, 10)
        assert "stage-1" in httpx.get(url + "/readyz").json()["error"]["message"]
        started = time.monotonic()
        body = {"model": "SmolLM2-135M-Instruct.Q4_1", "prompt": prompt, "max_tokens": 4}
        response = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert response.status_code == 503 and "stage-1" in response.json()["error"]["message"]
        assert time.monotonic() - started < 5 + 1  # --recovery-timeout, then the error
        log = server.log_text()
        assert "dialed its standby" in log or "dialed its standby" in (tmp_path / "stage-1-standby-1.log").read_text()
    finally:
        if server is not None:
            server.stop()
        for process in stages.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in stages.values():
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
