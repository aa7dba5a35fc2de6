"""One config from the command line to every stage: each `skippy serve` option arrives in every
local stage's effective settings (the line each stage logs once its model is loaded, from what
it actually runs with), every stage's spans reach the OTLP endpoint as one trace per request,
and stage 0's /metrics carries every stage's own series."""

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
            before = _stage_series(httpx.get(server.url + "/metrics", timeout=30).text)
            response = httpx.post(server.url + "/v1/completions", timeout=300, json={
                "model": "SmolLM2-135M-Instruct.Q4_1", "prompt": "The sea is", "max_tokens": 4,
                "temperature": 0})
            assert response.status_code == 200, response.text
            request_id = response.headers["x-request-id"]
            after = _stage_series(httpx.get(server.url + "/metrics", timeout=30).text)
            stages = httpx.get(server.url + "/v1/stages", timeout=30).json()["data"]
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
        assert {"skippy-stage0", "skippy-stage1", "skippy-stage2"} <= collector.services()
        
        # every stage's own series, labelled by stage, moved with the request
        stage_ids = [stage["id"] for stage in stages]
        assert len(stage_ids) == 3
        for stage in stage_ids:
            tokens = f'skippy_stage_tokens_total{{kind="decode",stage="{stage}"}}'
            assert after[tokens] - before.get(tokens, 0) == 3, stage  # 4 tokens: the first comes from prefill
            prefill = f'skippy_stage_tokens_total{{kind="prefill",stage="{stage}"}}'
            assert after[prefill] > before.get(prefill, 0), stage
            forwards = f'skippy_stage_forward_seconds_count{{kind="decode",stage="{stage}"}}'
            assert after[forwards] - before.get(forwards, 0) == 3, stage
            assert after[f'skippy_stage_sessions_opened_total{{stage="{stage}"}}'] >= 1
            assert after[f'skippy_stage_start_time_seconds{{stage="{stage}"}}'] > 0
        for stage in stages:  # the live view's figures, per stage
            assert stage["figures"]["decoded_tokens_total"] >= 3 and "tokens_per_s" in stage["figures"]
    finally:
        collector.close()


def _stage_series(text: str) -> dict[str, float]:
    """`skippy_stage_*` samples of a Prometheus text page, by name and labels."""
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("skippy_stage_")}


def _assert_one_trace(records, request_id: str) -> None:
    """The request is one trace: stage 0's request span is its root, stage 1's message spans are
    its children, stage 2's the children of stage 1's; attributes are numbers and labels."""
    (root,) = [r for r in records if r.name == "stage0.request" and r.attributes["request_id"] == request_id]
    assert root.service == "skippy-stage0" and root.parent_span_id == ""
    assert root.attributes["completion_tokens"] == 4 and root.attributes["finish_reason"] == "length"
    spans = [r for r in records if r.trace_id == root.trace_id]
    by_id = {r.span_id: r for r in spans}
    kinds = {}
    for record in spans:
        if record.name != "stage.binary_message":
            continue
        index = record.attributes["stage_index"]
        kinds.setdefault(index, []).append(record.attributes["kind"])
        parent = by_id[record.parent_span_id]
        assert parent is root if index == 1 else (parent.attributes["stage_index"] == index - 1
                                                   and parent.attributes["kind"] == record.attributes["kind"])
        for key, value in record.attributes.items():
            assert isinstance(value, (bool, int, float)) or len(value) <= 64, (key, value)
    assert sorted(kinds) == [1, 2] and kinds[1].count("DecodeEmbd") == kinds[2].count("DecodeEmbd") == 3
