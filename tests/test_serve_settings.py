"""One config from the command line to every stage: each `skippy serve` option arrives in every
local stage's effective settings (the line each stage logs once its model is loaded, from what
it actually runs with), and every stage's spans reach the OTLP endpoint."""

from __future__ import annotations

import re

import httpx
import pytest

from frontend_support import FakeCollector, ServeProcess

pytestmark = pytest.mark.slow

SETTINGS = re.compile(r"stage (\d+) settings: (.*)$", re.MULTILINE)
MIB = 1 << 20


def test_every_serve_option_reaches_every_local_stage(tmp_path):
    collector = FakeCollector()
    disk = tmp_path / "kv"
    args = ["--stages", "3", "--device", "cpu", "--dtype", "float16", "--ctx-size", "1024",
            "--threads", "1", "--concurrency", "3", "--kv-cache-mem", "300MiB", "--kv-disk-dir", str(disk),
            "--kv-disk-budget", "600MiB", "--otlp-endpoint", collector.endpoint]
    try:
        server = ServeProcess(args, tmp_path / "serve.log")
        try:
            response = httpx.post(server.url + "/v1/completions", timeout=300, json={
                "model": "SmolLM2-135M-Instruct.Q4_1", "prompt": "The sea is", "max_tokens": 4,
                "temperature": 0})
            assert response.status_code == 200, response.text
        finally:
            assert server.stop() == 0  # every stage flushes its spans as it stops
        settings = {int(index): dict(pair.split("=", 1) for pair in line.split())
                    for index, line in SETTINGS.findall(server.log_text())}
        assert sorted(settings) == [0, 1, 2]
        ends = []
        for index, stage in sorted(settings.items()):
            assert stage["device"] == "cpu"
            assert stage["weights"] == "float16"
            assert stage["ctx_size"] == "1024"
            assert stage["threads"] == "1"
            assert stage["lanes"] == "3"
            assert stage["kv_cache_bytes"] == str(100 * MIB)  # the budgets split evenly
            assert stage["kv_disk_budget"] == str(200 * MIB)
            assert stage["kv_disk_dir"] == str(disk.resolve() / f"stage-{index}")
            assert stage["otlp_endpoint"] == collector.endpoint
            start, end = (int(n) for n in stage["layers"].strip("[)").split(","))
            assert start == (ends[-1] if ends else 0) and end > start
            ends.append(end)
        assert ends[-1] == 30  # SmolLM2-135M's layers, all of them, once
        assert {"skippy-stage1", "skippy-stage2"} <= collector.services()
    finally:
        collector.close()
