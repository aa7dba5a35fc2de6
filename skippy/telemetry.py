"""Spans, counters and per-request summary lines (spec §7). A leaf: imports no skippy code.

Every stage message gets one OpenTelemetry span. Without an exporter the spans go
nowhere (the API's no-op tracer, a few hundred nanoseconds each); `--otlp-endpoint`
installs an SDK provider with a batching OTLP exporter, which never blocks the caller.

Privacy rule (spec §7): attributes are numbers, booleans and short labels (kind
names, stage ids) only, never prompt text or token ids. `Telemetry` rejects any
other string so a mistake fails loudly in tests instead of leaking.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

from opentelemetry import trace

log = logging.getLogger("skippy.telemetry")

_LABEL = re.compile(r"^[A-Za-z0-9_.:\-]{0,64}$")  # kind names, stage ids, reasons as slugs
AttrValue = int | float | bool | str


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

    __slots__ = ("_span", "attrs")

    def __init__(self, span: trace.Span) -> None:
        self._span = span
        self.attrs: dict[str, AttrValue] = {}

    def set(self, key: str, value: Any) -> None:
        self.attrs[key] = _check(key, value)

    def add(self, key: str, value: float) -> None:
        """Accumulate a number (for example milliseconds spent in several waits)."""
        self.attrs[key] = self.attrs.get(key, 0) + value


class Telemetry:
    """Per-process telemetry: spans, monotonically increasing counters, summary lines."""

    def __init__(self, service_name: str = "skippy", otlp_endpoint: str | None = None, *,
                 span_exporter: Any = None) -> None:
        """`span_exporter` (an SDK `SpanExporter`, e.g. in-memory in tests) overrides OTLP."""
        self.service_name, self.otlp_endpoint = service_name, otlp_endpoint
        self.counters: Counter[str] = Counter()
        self._lock = threading.Lock()  # counters are bumped from the runtime worker thread too
        self._provider = None
        if span_exporter is not None:
            self._provider = _sdk_provider(service_name, span_exporter, batch=False)
        elif otlp_endpoint is not None:
            self._provider = _sdk_provider(service_name, _otlp_exporter(otlp_endpoint), batch=True)
        self._tracer = (trace.NoOpTracer() if self._provider is None
                        else self._provider.get_tracer("skippy"))

    @contextlib.contextmanager
    def span(self, name: str, **attrs: Any) -> Iterator[Span]:
        """Record one span; attributes set on the yielded `Span` are attached when it ends."""
        start_ns = time.time_ns()
        holder = Span(trace.INVALID_SPAN)
        for key, value in attrs.items():
            holder.set(key, value)
        try:
            yield holder
        finally:
            if self._provider is not None:
                span = self._tracer.start_span(name, start_time=start_ns, attributes=holder.attrs)
                span.end()

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


def _otlp_exporter(endpoint: str):
    """OTLP over HTTP (a collector's port 4318): `http://host:4318` or the full traces URL."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    if not endpoint.startswith(("http://", "https://")):
        raise TelemetryError(f"Expected --otlp-endpoint as http(s)://host:port (OTLP over HTTP), "
                             f"got {endpoint!r}. Fix: e.g. http://127.0.0.1:4318")
    url = endpoint.rstrip("/")
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
