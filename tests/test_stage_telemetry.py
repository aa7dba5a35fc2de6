"""Telemetry: one trace per request, a span per stage message with timings, counters, summary
lines; no text, no ids."""

from __future__ import annotations

import logging

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from chain_support import PROMPTS, run, start_chain
from frontend_support import FakeCollector
from skippy.protocol import SamplingConfig
from skippy.telemetry import Telemetry, TelemetryError

ALLOWED_KEYS = {
    "kind", "stage_index", "token_count", "bytes_in", "compute_ms", "runtime_lock_wait_ms", "batch_size",
    "forward_write_ms", "sent_by_worker", "downstream_wait_ms", "deferred_drain_ms", "direct_return",
    "auto_align_from_tokens", "skipped_stale_window", "retired_windows", "kv_control_hit",
    "kv_decision", "kv_restored_tokens", "kv_recorded_entries",
}
# stage 0's request span: numbers and labels about the request, never its text
REQUEST_KEYS = {
    "request_id", "prompt_tokens", "cached_tokens", "completion_tokens", "finish_reason", "ttft_ms",
    "prefill_ms", "first_token_ms", "decode_ms", "tokens_per_s", "kv_decision", "recoveries", "stop_ms",
    "speculative_num_windows", "speculative_num_proposed_tokens", "speculative_num_accepted_tokens",
    "speculative_num_full_accept_windows", "speculative_num_rejected_windows", "speculative_stale_windows",
    "speculative_acceptance_rate",
}


def assert_private(attributes, tokens) -> None:
    """No attribute is text or a token id: labels are short slugs, numbers are not the
    request's token ids (a count may equal one by chance, so counts are checked by name)."""
    for key, value in attributes.items():
        assert isinstance(value, (bool, int, float)) or (isinstance(value, str) and len(value) <= 64
                                                          and " " not in value), (key, value)
        if isinstance(value, int) and not isinstance(value, bool) and key not in COUNT_KEYS:
            assert value not in tokens, (key, value)


COUNT_KEYS = {"stage_index", "token_count", "bytes_in", "batch_size", "prompt_tokens", "completion_tokens",
              "cached_tokens", "recoveries", "kv_restored_tokens", "kv_recorded_entries", "retired_windows",
              "speculative_num_windows", "speculative_num_proposed_tokens", "speculative_num_accepted_tokens",
              "speculative_num_full_accept_windows", "speculative_num_rejected_windows",
              "speculative_stale_windows", "auto_align_from_tokens"}


def test_one_request_is_one_trace_over_every_stage_with_timings_and_no_token_ids(make_stage, caplog):
    caplog.set_level(logging.INFO, logger="skippy.telemetry")
    exporters = {i: InMemorySpanExporter() for i in range(3)}
    prompt = PROMPTS[2]

    async def main():
        chain = await start_chain(make_stage, 3, server_telemetry=lambda i: Telemetry(
            f"stage{i}", span_exporter=exporters[i]), telemetry=Telemetry("stage0", span_exporter=exporters[0]))
        try:
            result = await chain.client.generate(prompt, max_tokens=3, request_id="req-7",
                                                 sampling=SamplingConfig())
        finally:
            await chain.close()
        return result

    result = run(main())
    (root,) = [s for s in exporters[0].get_finished_spans() if s.name == "stage0.request"]
    assert root.parent is None and set(root.attributes) <= REQUEST_KEYS, set(root.attributes) - REQUEST_KEYS
    assert root.attributes["request_id"] == "req-7" and root.attributes["completion_tokens"] == 3
    assert root.attributes["finish_reason"] == "length" and root.attributes["ttft_ms"] > 0
    assert_private(root.attributes, prompt + result.tokens)
    trace_id = root.context.trace_id
    by_kind = {}  # (stage, kind) -> span ids, in order
    for index in (1, 2):
        spans = exporters[index].get_finished_spans()
        kinds = [span.attributes["kind"] for span in spans]
        assert kinds == ["ConfigureGeneration", "PrefillFinalEmbd", "DecodeEmbd", "DecodeEmbd",
                         "Stop"], index
        for span in spans:
            assert span.name == "stage.binary_message"
            assert set(span.attributes) <= ALLOWED_KEYS, set(span.attributes) - ALLOWED_KEYS
            assert span.attributes["stage_index"] == index
            assert span.context.trace_id == trace_id  # one trace for the whole request
            assert_private(span.attributes, prompt + result.tokens)
            by_kind.setdefault(index, []).append(span)
    # stage 1's spans are children of the request's span; stage 2's of stage 1's span of that
    # same message (stage 1 forwards each frame naming its own span as the parent)
    assert all(span.parent.span_id == root.context.span_id for span in by_kind[1])
    assert [span.parent.span_id for span in by_kind[2]] == [span.context.span_id for span in by_kind[1]]
    assert by_kind[1][1].attributes["token_count"] == len(prompt)  # PrefillFinalEmbd: the prompt's rows
    for index, exporter in exporters.items():
        if index == 0:
            continue
        spans = exporter.get_finished_spans()
        decode = [s for s in spans if s.attributes["kind"] == "DecodeEmbd"]
        assert all(s.attributes["compute_ms"] > 0 and "runtime_lock_wait_ms" in s.attributes
                   for s in decode)
        assert all(s.attributes["bytes_in"] == 576 * 4 for s in decode)
        if index == 1:  # the middle stage writes downstream
            assert all("forward_write_ms" in s.attributes for s in decode)
    assert "stage.request_summary" in caplog.text
    # stage 0's one line per request leads to the trace
    (line,) = [r.getMessage() for r in caplog.records if "stage0.generation_summary" in r.getMessage()]
    fields = dict(pair.split("=", 1) for pair in line.split()[2:])
    assert fields["trace_id"] == f"{trace_id:032x}" and fields["request_id"] == "req-7"
    assert fields["completion_tokens"] == "3" and fields["finish_reason"] == "length"
    assert float(fields["ttft_ms"]) > 0 and float(fields["tokens_per_s"]) > 0
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


def test_spans_reach_an_otlp_grpc_collector():
    from concurrent import futures

    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    received = []

    class Collector(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):  # noqa: N802 - the service's name
            for resource_spans in request.resource_spans:
                for scope in resource_spans.scope_spans:
                    received.extend((s.name, s.trace_id.hex(), {a.key for a in s.attributes}) for s in scope.spans)
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Collector(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        telemetry = Telemetry("skippy-stage7", otlp_endpoint=f"http://127.0.0.1:{port}", otlp_protocol="grpc")
        with telemetry.span("stage0.request") as root:
            with telemetry.span("stage.binary_message", parent=root.traceparent, kind="Stop") as span:
                span.set("compute_ms", 1.5)
        telemetry.shutdown()  # flushes the batch
        assert sorted(received) == sorted([("stage0.request", root.trace_id, set()),
                                           ("stage.binary_message", root.trace_id, {"kind", "compute_ms"})])
    finally:
        server.stop(None)
    with pytest.raises(TelemetryError, match="otlp-protocol"):
        Telemetry(otlp_endpoint="http://127.0.0.1:4317", otlp_protocol="thrift")
