"""Frames written to one stream by the event loop and, for decode steps, by the runtime's worker.

A decode step's outgoing frame (stage 0's or a middle stage's activation row, the final
stage's predicted token) used to wait for the event loop: the worker settles the step's
future, the loop wakes, resumes the handler, encodes and writes. On 2 cores that hand-off
measured ~150 us after each forward, plus ~40-170 us of encoding and writing that ran with
the loop's caches cold, on every stage of every token (a 2-stage chain: ~1.3 ms of hops
against a ~5.5 ms step). `WorkerSend` encodes and sends the frame on the worker thread the
moment the forward ends; the loop does the rest of the step's bookkeeping later, off the
chain's critical path.

`SharedWriter` makes that safe: every write takes one lock, and the worker sends only when
the stream is idle (nothing buffered in the transport, nothing handed back), so frames never
interleave and a stream keeps its order. A partial send hands the rest to the loop, ahead of
anything written after it. TLS and conditioned links have no socket to share: their writers
are not wrapped and their frames go the loop's way.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from ..protocol.stream import ONE_WRITE_BYTES
from .stand_in import WriterStandIn


class SharedWriter(WriterStandIn):
    """The asyncio.StreamWriter calls the protocol uses, and `try_send_now` for other threads."""

    def __init__(self, writer: asyncio.StreamWriter):
        super().__init__(writer)
        self._transport = writer.transport
        self._loop = asyncio.get_running_loop()
        self._fd = writer.get_extra_info("socket").fileno()
        self._lock = threading.Lock()
        self._backlog: list[bytes] | None = None  # the rest of a partial send, and what came after it

    @classmethod
    def wrap(cls, writer):
        """`writer`, shared when it is a plain TCP stream (not TLS, not a conditioned test link)."""
        if (isinstance(writer, asyncio.StreamWriter) and writer.get_extra_info("sslcontext") is None
                and writer.get_extra_info("socket") is not None):
            return cls(writer)
        return writer

    # -- the event loop's side --------------------------------------------------------------
    def write(self, data) -> None:
        with self._lock:
            if self._backlog is not None:
                self._backlog.append(bytes(data))
            else:
                self._writer.write(data)

    async def drain(self) -> None:
        await self._writer.drain()

    def _write_backlog(self) -> None:
        with self._lock:
            backlog, self._backlog = self._backlog, None
            if backlog and not self._transport.is_closing():
                self._writer.write(b"".join(backlog))

    # -- any thread ---------------------------------------------------------------------------
    def try_send_now(self, frame: bytes) -> bool:
        """Send `frame` now if the stream is idle: True once it is sent or handed to the loop,
        False when nothing was written (busy, closed, large or failing: the loop's way then)."""
        if len(frame) > ONE_WRITE_BYTES:
            return False
        with self._lock:
            if (self._backlog is not None or self._transport.is_closing()
                    or self._transport.get_write_buffer_size()):
                return False
            try:
                sent = os.write(self._fd, frame)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError:
                return False  # the loop's write meets the same error and reports it
            if sent < len(frame):
                self._backlog = [frame[sent:]]
                self._loop.call_soon_threadsafe(self._write_backlog)
            return True


class WorkerSend:
    """A step's outgoing frame, encoded from the step's result and sent by the runtime's worker
    (the scheduler's `then`). After the step, `sent` tells the handler whether to send it."""

    __slots__ = ("writer", "encode", "sent", "write_s")

    def __init__(self, writer: SharedWriter, encode: Callable[[Any], bytes]):
        self.writer, self.encode = writer, encode
        self.sent = False
        self.write_s = 0.0

    def __call__(self, result: Any) -> None:
        started = time.perf_counter()
        self.sent = self.writer.try_send_now(self.encode(result))
        self.write_s = time.perf_counter() - started
