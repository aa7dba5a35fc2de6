"""A data socket owned by the engine thread: plain TCP or TLS, non-blocking, whole frames in and out.

`_read` takes everything readable (a TLS socket's `pending()` bytes too, which the selector
cannot see) and hands each whole frame to `on_frame`. `send` writes at once and keeps what the
socket would not take for when it is writable; a TLS write that cannot finish is retried with
the same bytes (OpenSSL's rule). A WAN-conditioned link (stage/link.py) holds each frame until
its delivery time. Whatever ends the socket reaches `on_close` once, with the reason.
"""

from __future__ import annotations

import logging
import ssl
import time
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

from ..protocol import ProtocolError
from .link import Conditioner

F = TypeVar("F")
log = logging.getLogger("skippy.stage")

RECV_BYTES = 256 * 1024
MAX_UNSENT_BYTES = 64 * 1024 * 1024  # a peer that reads none of this is closed (it is not reading)
_WOULD_BLOCK = (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError)


class Channel(Generic[F]):
    """`parse(buffer)`: (frame, size) for the whole frame at the front of `buffer`, None for
    not yet whole (ProtocolError: a bad frame, which closes the channel). `on_frame(frame)`
    for each; `on_close(reason, fault)` once at the end (`fault`: the peer broke the protocol)."""

    def __init__(self, engine, sock, *, name: str, parse: Callable[[bytearray], tuple[F, int] | None] | None,
                 on_frame: Callable[[F], None], on_close: Callable[[str, bool], None],
                 on_eof: Callable[[], None] | None = None, conditioner: Conditioner | None = None):
        """`on_eof()`: the peer closed its side between frames (default: close the channel; a
        stage's lane first finishes the frames it read)."""
        sock.setblocking(False)
        self.engine, self.sock, self.name = engine, sock, name
        self.is_tls = isinstance(sock, ssl.SSLSocket)
        self._parse, self._on_frame, self._on_close, self._on_eof = parse, on_frame, on_close, on_eof
        self._conditioner = conditioner
        self._in = bytearray()
        self._out: deque[memoryview] = deque()
        self._unsent = 0
        self._delayed: deque[tuple[float, bytes]] = deque()  # conditioned frames, by delivery time
        self._timer = None
        self._reading = True
        self._eof = False  # the peer has closed its side: nothing more to read
        self.closed = False
        self.close_reason: str | None = None
        self.bytes_in = 0
        engine.watch(sock, self._ready)

    # -- writing --------------------------------------------------------------------------
    def send(self, data: bytes) -> None:
        """Write `data` after everything sent before it (dropped once the channel is closed)."""
        if self.closed:
            return
        if self._conditioner is not None:
            self._delay(data)
            return
        self._write(data)

    def _write(self, data: bytes) -> None:
        if not self._out:
            try:
                sent = self.sock.send(data)
            except _WOULD_BLOCK:
                sent = 0
            except OSError as error:
                self.close(f"write failed ({error or type(error).__name__})")
                return
            if sent == len(data):
                return
            self._out.append(memoryview(data)[sent:] if not self.is_tls else memoryview(data))
            self._unsent += len(data) - sent
            self._watch()
        else:
            self._out.append(memoryview(data))
            self._unsent += len(data)
        if self._unsent > MAX_UNSENT_BYTES:
            self.close(f"it reads none of what is sent to it ({self._unsent} bytes unsent)", fault=True)

    def _flush(self) -> None:
        out = self._out
        while out:
            data = out[0]
            try:
                sent = self.sock.send(data)
            except _WOULD_BLOCK:
                return
            except OSError as error:
                self.close(f"write failed ({error or type(error).__name__})")
                return
            self._unsent -= sent
            if sent < len(data):  # plain TCP only: TLS writes all of it or nothing
                out[0] = data[sent:]
                return
            out.popleft()
        self._watch()

    def _delay(self, data: bytes) -> None:
        now = time.perf_counter()
        self._delayed.append((self._conditioner.deliver_at(len(data), now), data))
        if self._timer is None:
            self._timer = self.engine.at(self._delayed[0][0], self._deliver, exact=True)

    def _deliver(self) -> None:
        self._timer = None
        now = time.perf_counter()
        while self._delayed and self._delayed[0][0] <= now and not self.closed:
            self._write(self._delayed.popleft()[1])
        if self._delayed and not self.closed:
            self._timer = self.engine.at(self._delayed[0][0], self._deliver, exact=True)

    # -- reading --------------------------------------------------------------------------
    def pause_reading(self) -> None:
        """Read no more until `resume_reading` (what is read waits unprocessed)."""
        if self._reading:
            self._reading = False
            self._watch()

    def resume_reading(self) -> None:
        if not self._reading and not self.closed:
            self._reading = True
            self._watch()
            self._take_frames()  # what was read before the pause
            if self._eof and self._in and not self.closed:
                self.close(f"closed the connection inside a frame: truncated ({len(self._in)} bytes of it read)",
                           fault=True)

    def _ready(self, mask: int) -> None:
        if mask & 2:  # selectors.EVENT_WRITE
            self._flush()
        if mask & 1 and not self.closed:  # selectors.EVENT_READ
            self._read()

    def _read(self) -> None:
        sock, eof = self.sock, False
        while True:
            try:
                chunk = sock.recv(RECV_BYTES)
            except _WOULD_BLOCK:
                break
            except OSError as error:
                # A reset is the peer's doing: one warning line. Before it sent a byte it is a
                # dial that gave up (a readiness probe whose timeout passed before our answer,
                # while a large model loads): quiet, as a clean close is.
                self.close(f"connection lost ({type(error).__name__}: {error})", fault=self.bytes_in > 0)
                return
            if not chunk:
                eof = True
                break
            self.bytes_in += len(chunk)
            self._in += chunk
            if self.is_tls:
                if not sock.pending():
                    break
            elif len(chunk) < RECV_BYTES:  # the kernel's buffer is empty
                break
        self._take_frames()
        if eof and not self.closed:
            if self._in and self._reading:
                self.close(f"closed the connection inside a frame: truncated ({len(self._in)} bytes of it read)",
                           fault=True)
            elif self._on_eof is None:
                self.close("closed the connection")
            else:
                self._eof = True
                self._watch()
                self._on_eof()

    def _take_frames(self) -> None:
        buffer = self._in
        while buffer and self._reading and not self.closed and self._parse is not None:
            try:
                got = self._parse(buffer)
            except ProtocolError as error:
                self.close(f"sent a bad frame ({error})", fault=True)
                return
            if got is None:
                return
            frame, size = got
            del buffer[:size]
            self._on_frame(frame)
        if buffer and self._parse is None:
            self.close("sent bytes on a stream that carries none this way", fault=True)

    def _watch(self) -> None:
        if not self.closed:
            self.engine.watch(self.sock, self._ready, read=self._reading and not self._eof, write=bool(self._out))

    # -- the end ------------------------------------------------------------------------
    def close(self, reason: str = "closed", *, fault: bool = False) -> None:
        if self.closed:
            return
        self.closed, self.close_reason = True, reason
        if self._timer is not None:
            self._timer.cancel()
        self.engine.unwatch(self.sock)
        self._out.clear()
        self._delayed.clear()
        try:
            self._on_close(reason, fault)  # first: the peer sees the socket close after it is logged
        finally:
            try:
                self.sock.close()
            except OSError:
                pass
