"""Telemetry: a span per stage message with timings, counters, summary lines; no text, no ids."""

from __future__ import annotations

import logging

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from chain_support import PROMPTS, run, start_chain
from frontend_support import FakeCollector
from skippy.protocol import SamplingConfig
from skippy.telemetry import Telemetry, TelemetryError

ALLOWED_KEYS = {
    "kind", "stage_index", "bytes_in", "compute_ms", "runtime_lock_wait_ms", "batch_size",
    "forward_write_ms", "downstream_wait_ms", "deferred_drain_ms", "direct_return",
    "auto_align_from_tokens", "skipped_stale_window", "retired_windows", "kv_control_hit",
}


def test_every_stage_message_gets_a_span_with_timings_and_no_token_ids(make_stage, caplog):
    caplog.set_level(logging.INFO, logger="skippy.telemetry")
    exporters = {1: InMemorySpanExporter(), 2: InMemorySpanExporter()}
    prompt = PROMPTS[2]

    async def main():
        chain = await start_chain(make_stage, 3, server_telemetry=lambda i: Telemetry(
            f"stage{i}", span_exporter=exporters[i]))
        try:
            result = await chain.client.generate(prompt, max_tokens=3,
                                                 sampling=SamplingConfig())
        finally:
            await chain.close()
        return result

    result = run(main())
    for index, exporter in exporters.items():
        spans = exporter.get_finished_spans()
        kinds = [span.attributes["kind"] for span in spans]
        assert kinds == ["ConfigureGeneration", "PrefillFinalEmbd", "DecodeEmbd", "DecodeEmbd",
                         "Stop"], index
        for span in spans:
            assert span.name == "stage.binary_message"
            assert set(span.attributes) <= ALLOWED_KEYS, set(span.attributes) - ALLOWED_KEYS
            assert span.attributes["stage_index"] == index
        decode = [s for s in spans if s.attributes["kind"] == "DecodeEmbd"]
        assert all(s.attributes["compute_ms"] > 0 and "runtime_lock_wait_ms" in s.attributes
                   for s in decode)
        assert all(s.attributes["bytes_in"] == 576 * 4 for s in decode)
        if index == 1:  # the middle stage writes downstream
            assert all("forward_write_ms" in s.attributes for s in decode)
    assert "stage.request_summary" in caplog.text and "stage0.generation_summary" in caplog.text
    for token in prompt + result.tokens:   # no token id shows up in a log line as a value
        assert f"={token} " not in caplog.text.replace("stage_index=", "")


def test_telemetry_refuses_text_attributes():
    telemetry = Telemetry()
    with telemetry.span("x") as span:
        with pytest.raises(ValueError, match="never text"):
            span.set("prompt", "The capital of France is")
        with pytest.raises(ValueError, match="never text"):
            span.set("tokens", [1, 2, 3])
    with pytest.raises(ValueError):
        telemetry.summary("request", text="hello world")


def test_otlp_endpoint_must_be_an_http_url():
    with pytest.raises(TelemetryError, match="Expected --otlp-endpoint as http"):
        Telemetry(otlp_endpoint="localhost:4317")


def test_spans_reach_an_otlp_collector():
    collector = FakeCollector()
    try:
        telemetry = Telemetry("skippy-stage7", otlp_endpoint=collector.endpoint)
        with telemetry.span("stage.binary_message", kind="DecodeEmbd", stage_index=7) as span:
            span.set("compute_ms", 1.5)
        telemetry.shutdown()  # flushes the batch
        assert collector.spans == [("skippy-stage7", "stage.binary_message",
                                    {"kind", "stage_index", "compute_ms"})]
    finally:
        collector.close()
