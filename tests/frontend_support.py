"""Helpers for the frontend tests: uvicorn in a thread on a free loopback port; `skippy serve` as a process."""

from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from collections.abc import Iterator
from pathlib import Path

import uvicorn


@contextlib.contextmanager
def running_server(app, timeout_s: float = 30.0) -> Iterator[str]:
    """Serve `app` on 127.0.0.1:<free port>; yield its base URL (no trailing slash)."""
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off",
                            timeout_graceful_shutdown=2)  # fmt: skip
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="test-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    host, port = server.servers[0].sockets[0].getsockname()[:2]
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def wait_until(predicate, timeout_s: float = 10.0, interval_s: float = 0.05):
    """Poll until predicate() is truthy; return its last value."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval_s)


class ServeProcess:
    """`skippy serve` as a subprocess on a free port; stderr (stage logs included) goes to a file."""

    READY = re.compile(r"skippy: ready: (http://\S+)/v1 ")

    def __init__(self, args: list[str], log_path, timeout_s: float = 900.0):
        self.log_path = log_path
        command = [sys.executable, "-m", "skippy.cli", "--log-level", "INFO", "serve", "--port", "0", *args]
        self._log = open(log_path, "w")
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=self._log, text=True,
                                        env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self.ready_line = self.wait_for_line(self.READY, timeout_s)
        self.url = self.READY.search(self.ready_line).group(1)

    def _pump(self) -> None:
        for line in self.process.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def wait_for_line(self, pattern: re.Pattern, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"no line matching {pattern.pattern!r} within {timeout_s:g} s") from None
            if line is None:
                raise RuntimeError(f"skippy serve exited ({self.process.wait()}); see {self.log_path}")
            if pattern.search(line):
                return line

    def log_text(self) -> str:
        if not self._log.closed:  # still running; after stop() the file is complete
            self._log.flush()
        return Path(self.log_path).read_text()

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            return self.process.wait(timeout=timeout_s)
        finally:
            if self.process.poll() is None:
                self.process.kill()
            self._log.close()


def child_pids(pid: int) -> list[int]:
    """Direct children of `pid`, from /proc."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            children.append(int(stat.parent.name))
    return children


def is_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@dataclass(frozen=True)
class SpanRecord:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str  # "" for a root span
    attributes: dict


def _attributes(pairs) -> dict:
    """OTLP KeyValues as a dict of Python values (every kind our spans send)."""
    out = {}
    for pair in pairs:
        kind = pair.value.WhichOneof("value")
        out[pair.key] = getattr(pair.value, kind)
    return out


class FakeCollector:
    """An OTLP/HTTP trace collector on a free loopback port: keeps every span it is sent, as
    (service.name, span name, attribute keys) in `spans`, and in full in `records`."""

    def __init__(self) -> None:
        import http.server

        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        spans, records = self.spans, self.records = [], []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers["Content-Length"]))
                request = ExportTraceServiceRequest.FromString(body)
                for resource_spans in request.resource_spans:
                    service = next(a.value.string_value for a in resource_spans.resource.attributes
                                   if a.key == "service.name")
                    for scope in resource_spans.scope_spans:
                        spans.extend((service, s.name, {a.key for a in s.attributes}) for s in scope.spans)
                        records.extend(SpanRecord(service, s.name, s.trace_id.hex(), s.span_id.hex(),
                                                  s.parent_span_id.hex(), _attributes(s.attributes))
                                       for s in scope.spans)
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def services(self) -> set[str]:
        return {service for service, _, _ in self.spans}

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
