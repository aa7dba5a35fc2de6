"""`skippy serve` as a user runs it: defaults, the ready line, and shutdown with no orphan stage."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import httpx
import pytest

from architecture_support import write_other_gguf
from frontend_support import ServeProcess, child_pids, is_alive, wait_until
from skippy.cli import build_parser

pytestmark = pytest.mark.slow


def test_serve_defaults():
    args = build_parser().parse_args(["serve"])
    assert (args.num_stages, args.host, args.port, args.model) == (2, "127.0.0.1", 9337, None)
    assert (args.concurrency, args.queue_size, args.auth_token, args.dtype) == (None, None, None, "auto")


def test_every_serve_option_is_a_config_field():
    """run_serve hands the options to ServeConfig by name (--ray-X to its RaySettings' X): one
    named otherwise would be lost."""
    from skippy.launch.ray_chain import RaySettings
    from skippy.launch.serve import ServeConfig

    args = vars(build_parser().parse_args(["serve"]))
    ray_options = {"ray"} | {f"ray_{field}" for field in RaySettings.model_fields}
    assert set(args) - {"command", "run"} <= set(ServeConfig.model_fields) | ray_options


def test_sigterm_while_loading_leaves_no_stage_behind():
    serve = subprocess.Popen([sys.executable, "-m", "skippy.cli", "serve", "--port", "0"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
    try:
        children = wait_until(lambda: child_pids(serve.pid), timeout_s=120)
        assert children, "no stage process was started"
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=60) != 0  # interrupted before it was ready
        assert wait_until(lambda: not any(is_alive(pid) for pid in children), timeout_s=15)
    finally:
        if serve.poll() is None:
            serve.kill()


def test_an_unsupported_architecture_fails_at_start_naming_the_supported_ones(tmp_path):
    model = write_other_gguf(tmp_path / "phi3.gguf", "phi3")
    done = subprocess.run([sys.executable, "-m", "skippy.cli", "serve", "--port", "0", "--model", str(model)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "ready" not in done.stdout
    assert "general.architecture='phi3'. skippy supports: llama, qwen2, qwen3, gemma3" in done.stderr


def test_ctrl_c_after_ready_stops_every_stage(tmp_path):
    server = ServeProcess([], tmp_path / "serve.log")
    try:
        (stage_pid,) = child_pids(server.process.pid)
        assert "(llama, 2 stages" in server.ready_line  # the architecture, then the split
        assert httpx.get(server.url + "/readyz").status_code == 200
        started = time.monotonic()
        assert server.stop(signal.SIGINT) == 0
        assert time.monotonic() - started < 30
        assert wait_until(lambda: not is_alive(stage_pid), timeout_s=5)
    finally:
        server.stop(signal.SIGKILL)
