"""How a stage process reaches other stages and lets them reach it: dials, listeners, handshakes.

One `Transport` per stage, built from its config (no process-wide state). Every handshake
(TLS, the auth preamble, READY: spec §2.1) runs on the event loop over the raw socket, so the
engine gets a plain or TLS socket that no asyncio transport ever wrapped. FETCH_MAGIC in the
preamble opens the tensor side channel instead of a lane (stage/holder.py, protocol §11).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import ssl
import time
from collections.abc import Awaitable, Callable, Sequence

from ..protocol import (
    AuthError, FrameError, LinkConditioning, MessageKind, ProtocolError, ReplyKind, StageMessage, StageReply,
    StageConfig, StageStatusReport, Timeouts, TlsConfig, encode_message, parse_endpoint,
)
from ..protocol.constants import AUTH_MAGIC, AUTH_PREFIX, FETCH_MAGIC, READY, REPLY_FIXED_BYTES, REPLY_HEADER
from ..protocol.frames import decode_reply_body, parse_reply_header
from ..protocol.handshake import AuthPreamble, Ready, check_auth, preamble_fields, token_bytes
from . import tls
from .link import Conditioner

log = logging.getLogger("skippy.stage")
MIN_READY_WAIT_S = 5.0  # a stage busy loading answers READY late


class LinkBroken(ConnectionError):
    """A stage could not be reached, closed the connection, sent a bad frame, or stopped answering."""


def answers_later(error: LinkBroken) -> bool:
    """Whether a failed dial may succeed if tried again later: nothing listens there yet, or a
    stage listens but is still loading (no READY yet). A refused token or certificate will not."""
    cause = error.__cause__
    if isinstance(cause, ssl.SSLError):
        return False
    return (isinstance(cause, (ConnectionRefusedError, TimeoutError))
            or isinstance(cause, OSError) and cause.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH))


class Transport:
    def __init__(self, *, tls_identity: TlsConfig | None = None, auth_token: str | None = None,
                 conditioning: LinkConditioning | None = None, timeouts: Timeouts = Timeouts()):
        self.tls_identity, self.auth_token = tls_identity, auth_token
        self.conditioning, self.timeouts = conditioning, timeouts
        self._failed_at: dict[str, float] = {}  # endpoint -> when a dial to it last failed

    @classmethod
    def for_stage(cls, config: StageConfig) -> Transport:
        """A stage's: its config's TLS identity, token, link conditioning and timeouts."""
        return cls(tls_identity=config.tls, auth_token=config.auth_token, conditioning=config.link_conditioning,
                   timeouts=config.timeouts)

    def conditioner(self) -> Conditioner | None:
        """The conditioning of one channel this process writes (None: a plain link)."""
        return None if self.conditioning is None else Conditioner(self.conditioning)

    # -- dialing ----------------------------------------------------------------------------
    async def dial(self, endpoints: str | Sequence[str], *, connect_s: float | None = None,
                   handshake_s: float | None = None, tensors: bool = False) -> tuple[socket.socket, str]:
        """A handshaken socket to the first of `endpoints` (a stage, then its standbys) that
        answers, and its endpoint; LinkBroken when none does. One that failed lately is tried
        last, so once a stage is lost new lanes go to its standby without waiting on it."""
        if tensors and self.auth_token is None:
            raise AuthError("the tensor side channel needs the chain's auth token")
        candidates = [endpoints] if isinstance(endpoints, str) else list(endpoints)
        errors = []
        for endpoint in sorted(candidates, key=lambda e: self._failed_at.get(e, 0.0)):  # stable: config order
            try:
                sock = await self._dial_one(endpoint, connect_s or self.timeouts.connect_s, handshake_s, tensors)
            except LinkBroken as error:
                self._failed_at[endpoint] = time.monotonic()
                errors.append(error)
                continue
            if endpoint != candidates[0]:
                log.info("stage at %s does not answer; dialed its standby at %s", candidates[0], endpoint)
            return sock, endpoint
        raise LinkBroken("; ".join(map(str, errors))) from errors[-1].__cause__

    async def _dial_one(self, endpoint: str, connect_s: float, handshake_s: float | None,
                        tensors: bool) -> socket.socket:
        host, port = parse_endpoint(endpoint)
        loop = asyncio.get_running_loop()
        sock = None
        try:
            async with asyncio.timeout(connect_s):
                family, kind, proto, _, address = (await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM))[0]
                sock = socket.socket(family, kind, proto)
                sock.setblocking(False)
                await loop.sock_connect(sock, address)
        except (OSError, TimeoutError) as error:
            if sock is not None:
                sock.close()
            raise LinkBroken(f"cannot connect to stage at {endpoint}: {error or type(error).__name__}") from error
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            async with asyncio.timeout(max(connect_s, MIN_READY_WAIT_S) if handshake_s is None else handshake_s):
                context = tls.context(self.tls_identity, host, server=False)
                if context is not None:
                    sock = context.wrap_socket(sock, server_hostname=host, do_handshake_on_connect=False)
                    await _io(sock, sock.do_handshake)
                if self.auth_token is not None:
                    magic = FETCH_MAGIC if tensors else AUTH_MAGIC
                    await send_all(sock, AuthPreamble(token_bytes(self.auth_token), magic).encode())
                try:
                    Ready.decode(await recv_exactly(sock, READY.size, "READY"))
                except ProtocolError as error:
                    raise ProtocolError(f"{error} (did the server refuse our auth token?)") from None
        except (ProtocolError, OSError, TimeoutError) as error:
            sock.close()
            what = "no READY in time" if isinstance(error, TimeoutError) else error
            raise LinkBroken(f"handshake with stage at {endpoint} failed: {what}") from error
        return sock

    async def query_status(self, endpoint: str) -> StageStatusReport | None:
        """The stage's own status, or None when it does not answer within `probe_s` (its dial,
        handshake and answer, each)."""
        probe_s = self.timeouts.probe_s
        try:
            sock, _ = await self.dial(endpoint, connect_s=probe_s, handshake_s=probe_s)
        except LinkBroken:
            return None
        try:
            async with asyncio.timeout(probe_s):
                await send_all(sock, encode_message(StageMessage(MessageKind.GetStageStatus)))
                reply = await recv_reply(sock)
            return reply.status if reply.kind == ReplyKind.StageStatus else None
        except (ProtocolError, OSError, TimeoutError):
            return None
        finally:
            sock.close()

    # -- listening --------------------------------------------------------------------------
    async def listen(self, host: str, port: int, on_connection: Callable[[socket.socket, tuple], Awaitable[None]],
                     *, where: str, sock: socket.socket | None = None,
                     on_tensors: Callable[[SocketStream], Awaitable[None]] | None = None) -> Listener:
        """Accept on `host`:`port` (or on `sock`, bound and listening); each connection that
        passes its handshake goes to `on_connection(sock, peer)`, or, for the tensor side
        channel, to `on_tensors` (None: closed)."""
        sock = sock or bound_socket(host, port)
        listener = Listener(self, sock, tls.context(self.tls_identity, host, server=True), on_connection, where,
                            on_tensors)
        listener.start()
        return listener

    async def accept_handshake(self, sock: socket.socket, context: ssl.SSLContext | None,
                               refusals: tls.RefusalLog, peer) -> tuple[socket.socket, bool]:
        """TLS (off loopback), then the auth check, then READY: the socket ready for frames, and
        whether its dialer opened the tensor side channel (only one with the token can)."""
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if context is not None:
            sock = context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
            try:
                async with asyncio.timeout(self.timeouts.tls_handshake_s):
                    await _io(sock, sock.do_handshake)
            except (OSError, TimeoutError) as error:  # ssl.SSLError, a reset, or the timeout
                refusals.refused(peer, error, self.timeouts.tls_handshake_s)
                raise
        magic = AUTH_MAGIC
        try:  # asyncio.timeout raises TimeoutError only where its block ends, so the except is out here
            async with asyncio.timeout(self.timeouts.handshake_s):
                if self.auth_token is not None:
                    try:
                        magic, length = preamble_fields(await recv_exactly(sock, AUTH_PREFIX.size, "auth preamble"))
                        token = await recv_exactly(sock, length, "auth token")
                    except ProtocolError as error:
                        raise AuthError(str(error)) from None
                    check_auth(AuthPreamble(token, magic), self.auth_token)
                await send_all(sock, Ready().encode())
        except TimeoutError:
            raise AuthError(f"auth preamble and READY: none within {self.timeouts.handshake_s:g} s") from None
        return sock, magic == FETCH_MAGIC


def bound_socket(host: str, port: int) -> socket.socket:
    """A listening socket on `host`:`port` (SO_REUSEADDR; closed again when it cannot bind)."""
    return socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET, backlog=128)


class Listener:
    """An accepting socket; each accepted connection's handshake is a task of its own."""

    def __init__(self, transport: Transport, sock: socket.socket, context: ssl.SSLContext | None,
                 on_connection: Callable[[socket.socket, tuple], Awaitable[None]], where: str,
                 on_tensors: Callable[[SocketStream], Awaitable[None]] | None = None):
        self.transport, self.sock, self.context = transport, sock, context
        self.on_connection, self.on_tensors, self.where = on_connection, on_tensors, where
        self.refusals: list[str] = []        # handshake refusals, newest last (also logged)
        self._refusal_log = tls.RefusalLog(where)
        self._tasks: set[asyncio.Task] = set()
        self._accepting: asyncio.Task | None = None
        sock.setblocking(False)

    @property
    def port(self) -> int:
        return self.sock.getsockname()[1]

    def start(self) -> None:
        self._accepting = asyncio.get_running_loop().create_task(self._accept())

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, peer = await loop.sock_accept(self.sock)
            except OSError as error:  # out of descriptors, say: the next try may work
                log.warning("%s: accept failed: %s", self.where, error)
                await asyncio.sleep(0.1)
                continue
            task = loop.create_task(self._serve(sock, peer))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _serve(self, sock: socket.socket, peer) -> None:
        try:
            sock, tensors = await self.transport.accept_handshake(sock, self.context, self._refusal_log, peer)
        except (ProtocolError, OSError, TimeoutError) as error:
            sock.close()
            if isinstance(error, ProtocolError):  # TLS refusals were logged by accept_handshake
                reason = f"{type(error).__name__}: {error}"
                self.refusals.append(reason)
                log.warning("%s: refused connection from %s: %s", self.where, peer, reason)
            return
        except asyncio.CancelledError:
            sock.close()
            raise
        if not tensors:
            await self.on_connection(sock, peer)
        elif self.on_tensors is None:
            sock.close()
        else:
            await self.on_tensors(SocketStream(sock))

    async def close(self) -> None:
        if self._accepting is not None:
            self._accepting.cancel()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*([self._accepting] if self._accepting else []), *self._tasks, return_exceptions=True)
        self.sock.close()


# -- non-blocking I/O on the event loop, plain or TLS ----------------------------------------
async def _io(sock: socket.socket, operation: Callable[[], object], *, write: bool = False):
    """operation() on a non-blocking socket, waiting for it to be readable or writable as it asks:
    TLS says which; otherwise a full send buffer waits to be writable (`write`), an empty receive
    buffer readable. A send must never wait for readability: a reader of the same socket (a link
    probe's ACKs) waits for that, and the loop keeps one reader a socket, so the send's would
    replace it and, once done, remove it, leaving the reader asleep beside its bytes."""
    while True:
        try:
            return operation()
        except ssl.SSLWantReadError:
            await _ready(sock, write=False)
        except ssl.SSLWantWriteError:
            await _ready(sock, write=True)
        except (BlockingIOError, InterruptedError):
            await _ready(sock, write=write)


async def _ready(sock: socket.socket, *, write: bool) -> None:
    loop = asyncio.get_running_loop()
    future = loop.create_future()
    fd = sock.fileno()

    def wake() -> None:
        if not future.done():
            future.set_result(None)

    (loop.add_writer if write else loop.add_reader)(fd, wake)
    try:
        await future
    finally:
        (loop.remove_writer if write else loop.remove_reader)(fd)


async def send_all(sock: socket.socket, data: bytes) -> None:
    view = memoryview(data)
    while view:
        sent = await _io(sock, lambda: sock.send(view), write=True)
        view = view[sent:]


async def recv_reply(sock: socket.socket) -> StageReply:
    """One whole reply frame, decoded and checked (ProtocolError when it is not one)."""
    header = parse_reply_header(await recv_exactly(sock, REPLY_HEADER.size, "reply header"))
    return decode_reply_body(header, await recv_exactly(
        sock, REPLY_FIXED_BYTES - REPLY_HEADER.size + header.body_bytes, "reply body"))


async def recv_exactly(sock: socket.socket, nbytes: int, what: str) -> bytes:
    try:
        return await SocketStream(sock).readexactly(nbytes)
    except asyncio.IncompleteReadError as error:
        raise FrameError(f"{what}: expected {nbytes} bytes, got {len(error.partial)} before EOF (truncated)") from None


class SocketStream:
    """A handshaken socket as the reader and writer of the tensor side channel's frames, which
    live on the event loop (the engine never sees this socket)."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._out: list[bytes] = []

    async def readexactly(self, nbytes: int) -> bytes:
        data = bytearray()
        while len(data) < nbytes:
            chunk = await _io(self.sock, lambda: self.sock.recv(nbytes - len(data)))
            if not chunk:
                raise asyncio.IncompleteReadError(bytes(data), nbytes)
            data += chunk
        return bytes(data)

    def write(self, data: bytes) -> None:
        self._out.append(data)

    async def drain(self) -> None:
        out, self._out = self._out, []
        for data in out:
            await send_all(self.sock, data)

    def peer(self) -> str:
        try:
            host, port = self.sock.getpeername()[:2]
        except OSError:
            return "an unknown peer"
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def peer_certificate(self) -> dict | None:
        """The peer's certificate under TLS (None on a plain socket)."""
        return self.sock.getpeercert() if isinstance(self.sock, ssl.SSLSocket) else None

    def close(self) -> None:
        self.sock.close()
