"""Spans, counters and per-request summary lines (spec §7). A leaf: imports no skippy code.

Every stage message gets one OpenTelemetry span (a no-op without `--otlp-endpoint`, which
installs a batching OTLP exporter that never blocks the caller). One trace per request: each
frame carries a W3C trace context (25 bytes), so each stage's span is the child of the span
that sent the frame.

Privacy rule (spec §7): attributes are numbers, booleans and short labels (kind
names, stage ids) only, never prompt text or token ids. `Telemetry` rejects any
other string so a mistake fails loudly in tests instead of leaking.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

from opentelemetry import trace

log = logging.getLogger("skippy.telemetry")

_LABEL = re.compile(r"^[A-Za-z0-9_.:\-]{0,64}$")  # kind names, stage ids, reasons as slugs
AttrValue = int | float | bool | str
TRACEPARENT_BYTES = 25  # trace id (16), span id (8), trace flags (1), as the protocol carries them
OTLP_PROTOCOLS = ("http", "grpc")


class TelemetryError(RuntimeError):
    """Telemetry was misconfigured (for example an exporter package is missing)."""


def _check(key: str, value: Any) -> AttrValue:
    if isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, str) and _LABEL.match(value):
        return value
    raise ValueError(f"telemetry attribute {key!r}: expected a number, bool or short label, "
                     f"got {type(value).__name__} {str(value)[:20]!r} (never text or token ids)")


class Span:
    """A span being recorded: `set(key, value)` adds numbers or labels to it."""

    __slots__ = ("_span", "attrs", "traceparent", "_ended")

    def __init__(self, span: trace.Span | None) -> None:
        self._span = span
        self.attrs: dict[str, AttrValue] = {}
        # this span's context for the frames it sends (its children's parent); None: not traced
        self.traceparent: bytes | None = None if span is None else _traceparent(span)
        self._ended = False

    @property
    def trace_id(self) -> str:
        """The trace's id as W3C hex (what a trace UI searches for); "" when not traced."""
        return "" if self.traceparent is None else self.traceparent[:16].hex()

    def set(self, key: str, value: Any) -> None:
        self.attrs[key] = _check(key, value)

    def end(self) -> None:
        """Attach the attributes and end the span (once; `Telemetry.span` does it on exit)."""
        if self._span is not None and not self._ended:
            self._ended = True
            self._span.set_attributes(self.attrs)
            self._span.end()


class Telemetry:
    """Per-process telemetry: spans, monotonically increasing counters, summary lines."""

    def __init__(self, service_name: str = "skippy", otlp_endpoint: str | None = None, *,
                 otlp_protocol: str = "http", span_exporter: Any = None) -> None:
        """`otlp_protocol`: "http" (a collector's port 4318) or "grpc" (4317). `span_exporter`
        (an SDK `SpanExporter`, e.g. in-memory in tests) overrides OTLP."""
        self.service_name, self.otlp_endpoint, self.otlp_protocol = service_name, otlp_endpoint, otlp_protocol
        self.counters: Counter[str] = Counter()
        self._lock = threading.Lock()  # counters are bumped from the engine thread too
        self._provider = None
        if otlp_protocol not in OTLP_PROTOCOLS:
            raise TelemetryError(f"Expected --otlp-protocol to be one of {', '.join(OTLP_PROTOCOLS)}, "
                                 f"got {otlp_protocol!r}")
        if span_exporter is not None:
            self._provider = _sdk_provider(service_name, span_exporter, batch=False)
        elif otlp_endpoint is not None:
            exporter = _otlp_exporter(otlp_endpoint, otlp_protocol)
            self._provider = _sdk_provider(service_name, exporter, batch=True)
        self._tracer = None if self._provider is None else self._provider.get_tracer("skippy")

    def start_span(self, name: str, *, parent: bytes | None = None, **attrs: Any) -> Span:
        """A span begun now, the child of `parent` (a 25-byte trace context from a frame; None:
        a new trace); its `end()` ends it with the attributes set on it."""
        span = None
        if self._tracer is not None:
            context = None if parent is None else _parent_context(parent)
            span = self._tracer.start_span(name, context=context)
        holder = Span(span)
        for key, value in attrs.items():
            holder.set(key, value)
        return holder

    @contextlib.contextmanager
    def span(self, name: str, *, parent: bytes | None = None, **attrs: Any) -> Iterator[Span]:
        """`start_span` for the length of a `with` block."""
        holder = self.start_span(name, parent=parent, **attrs)
        try:
            yield holder
        finally:
            holder.end()

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n

    def summary(self, what: str, **numbers: Any) -> None:
        """One INFO log line per request: `<what> key=value ...` (numbers and labels only)."""
        fields = " ".join(f"{key}={_format(_check(key, value))}" for key, value in numbers.items())
        log.info("%s %s %s", self.service_name, what, fields)

    def shutdown(self) -> None:
        if self._provider is not None:
            self._provider.shutdown()


def _format(value: AttrValue) -> str:
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def _traceparent(span: trace.Span) -> bytes:
    context = span.get_span_context()
    return (context.trace_id.to_bytes(16, "big") + context.span_id.to_bytes(8, "big")
            + bytes([context.trace_flags & 0xFF]))


def _parent_context(traceparent: bytes):
    if len(traceparent) != TRACEPARENT_BYTES:
        raise ValueError(f"trace context: expected {TRACEPARENT_BYTES} bytes, got {len(traceparent)}")
    parent = trace.SpanContext(int.from_bytes(traceparent[:16], "big"), int.from_bytes(traceparent[16:24], "big"),
                               is_remote=True, trace_flags=trace.TraceFlags(traceparent[24]))
    return trace.set_span_in_context(trace.NonRecordingSpan(parent))


def _otlp_exporter(endpoint: str, protocol: str):
    """OTLP over HTTP (a collector's port 4318: `http://host:4318` or the full traces URL) or
    gRPC (port 4317: `http://host:4317`, plaintext; `https://` for TLS)."""
    if not endpoint.startswith(("http://", "https://")):
        port = 4317 if protocol == "grpc" else 4318
        raise TelemetryError(f"Expected --otlp-endpoint as http(s)://host:port (OTLP over {protocol}), "
                             f"got {endpoint!r}. Fix: e.g. http://127.0.0.1:{port}")
    url = endpoint.rstrip("/")
    if protocol == "grpc":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
        except ImportError as error:
            raise TelemetryError("--otlp-protocol grpc needs opentelemetry-exporter-otlp-proto-grpc; "
                                 "Fix: pip install opentelemetry-exporter-otlp-proto-grpc") from error
        return GrpcExporter(endpoint=url.split("://", 1)[1], insecure=url.startswith("http://"))
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(endpoint=url if url.endswith("/v1/traces") else url + "/v1/traces")


def _sdk_provider(service_name: str, exporter: Any, *, batch: bool):
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    # Bounded queue, background export: telemetry must never block execution (spec §1.3).
    processor = (BatchSpanProcessor(exporter, max_queue_size=1024) if batch
                 else SimpleSpanProcessor(exporter))
    provider.add_span_processor(processor)
    return provider
