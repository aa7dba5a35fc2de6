"""The connection to the next stage: async forwarding and the deferred-ACK credit window.

One `DownstreamLink` per upstream lane, kept for the life of that lane (spec §3.2).
It is used by middle stages and by the stage-0 driver alike.

* `forward_async` hands a prefill frame to a bounded background writer (depth
  `max_inflight`), so this stage computes chunk i+1 while chunk i drains
  ("middle-out", spec §2.8). `send` flushes that writer, then writes directly.
* Downstream ACKs of early-ACKed prefill chunks are *deferred*: `note_deferred`
  counts one, and once `max_deferred` are outstanding it reads one (a credit wait,
  spec §2.6). `drain` reads all of them; their stats are returned for merging.
* A reader task owns the socket's read side: ACKs queue up in order for
  `next_ack`, prediction replies (the hop-by-hop fallback of spec §2.7) go to
  `on_prediction` at once. EOF or a bad frame marks the link broken and wakes
  every waiter with `LinkBroken`; every wait has a timeout.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import ssl
import time
from collections.abc import Awaitable, Callable, Sequence

from . import link, tls
from .shared_writer import SharedWriter
from ..protocol import (
    HandshakeTimeout, MessageKind, ProtocolError, ReplyKind, StageMessage, StageReply, StageReplyStats,
    StageStatusReport, client_handshake, merge, parse_endpoint, prefill_edge_observation, read_reply, write_message,
)

log = logging.getLogger("skippy.stage")

CONNECT_TIMEOUT_S = 2.0     # spec §2.7
PROBE_TIMEOUT_S = 1.0       # the longest a status query waits for its dial, handshake and answer, each
REPLY_TIMEOUT_S = 30.0
_BROKEN = object()          # sentinel in the ACK queue
_failed_at: dict[str, float] = {}  # endpoint -> when a dial to it last failed (this process)


class LinkBroken(ConnectionError):
    """The downstream stage closed the connection, sent a bad frame, or stopped answering."""


async def open_connection(endpoint: str, *, auth_token: str | None,
                          timeout_s: float = CONNECT_TIMEOUT_S, handshake_timeout_s: float | None = None,
                          tensors: bool = False):
    """Dial `endpoint`, handshake (auth + READY), return (reader, writer) with TCP_NODELAY.
    The READY wait defaults to at least 5 s (a stage busy loading answers late).
    `tensors`: open the tensor side channel (holder.py) instead of a lane."""
    host, port = parse_endpoint(endpoint)
    context = tls.client_context(host)
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(
            host, port, ssl=context, server_hostname=host if context else None), timeout_s)
    except (OSError, TimeoutError) as error:
        raise LinkBroken(f"cannot connect to stage at {endpoint}: "
                         f"{error or type(error).__name__}") from error
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        await client_handshake(reader, writer, auth_token, tensors=tensors,
                               timeout=max(timeout_s, 5.0) if handshake_timeout_s is None else handshake_timeout_s)
    except (ProtocolError, OSError) as error:
        writer.close()
        raise LinkBroken(f"handshake with stage at {endpoint} failed: {error}") from error
    return reader, link.conditioned(writer)  # as is, unless a test conditions this process's links


def answers_later(error: LinkBroken) -> bool:
    """Whether a failed dial may succeed if tried again later: nothing listens there yet, or a
    stage listens but is still loading (no READY yet). A refused token or certificate will not."""
    cause = error.__cause__
    if isinstance(cause, ssl.SSLError):
        return False
    return (isinstance(cause, (ConnectionRefusedError, TimeoutError, HandshakeTimeout))
            or isinstance(cause, OSError) and cause.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH))


async def query_stage_status(endpoint: str, auth_token: str | None) -> StageStatusReport | None:
    """The stage's own status, or None when it does not answer within PROBE_TIMEOUT_S. The
    connection then closes cleanly, which a stage ends quietly (no sessions to reclaim)."""
    try:
        reader, writer = await open_connection(endpoint, auth_token=auth_token, timeout_s=PROBE_TIMEOUT_S,
                                               handshake_timeout_s=PROBE_TIMEOUT_S)  # a hung stage: quickly None
    except (LinkBroken, OSError, TimeoutError):
        return None
    try:
        await write_message(writer, StageMessage(MessageKind.GetStageStatus))
        reply = await asyncio.wait_for(read_reply(reader), PROBE_TIMEOUT_S)
        return reply.status if reply is not None and reply.kind == ReplyKind.StageStatus else None
    except (ProtocolError, OSError, TimeoutError, asyncio.IncompleteReadError):
        return None
    finally:
        writer.close()
        try:
            await writer.wait_closed()
        except OSError:
            pass


class DownstreamLink:
    stages_below = True  # a lane to real stages (driver/session.py NoStagesBelow: none)

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *,
                 endpoint: str, stage_index: int, max_inflight: int = 4,
                 max_deferred: int | None = None, reply_timeout_s: float = REPLY_TIMEOUT_S,
                 on_prediction: Callable[[StageReply], Awaitable[None] | None] | None = None,
                 on_broken: Callable[[str], None] | None = None):
        self.endpoint = endpoint
        self.stage_index = stage_index  # of the stage that owns this link (edge stats)
        self.max_deferred = max_inflight - 1 if max_deferred is None else max_deferred
        self.reply_timeout_s = reply_timeout_s
        self.on_prediction = on_prediction
        self.on_broken = on_broken
        self.pending_deferred = 0
        self.broken: str | None = None
        self.edge_stats = StageReplyStats()       # write observations of async forwards
        self.credit_waits = 0
        self._reader, self._writer = reader, SharedWriter.wrap(writer)
        self._acks: asyncio.Queue = asyncio.Queue()
        self._outbox: asyncio.Queue[StageMessage] = asyncio.Queue(maxsize=max(1, max_inflight))
        self._reader_task = asyncio.create_task(self._read_replies())
        self._writer_task = asyncio.create_task(self._write_forwards())

    @classmethod
    async def connect(cls, endpoints: str | Sequence[str], *, auth_token: str | None = None,
                      connect_timeout_s: float = CONNECT_TIMEOUT_S, **options) -> DownstreamLink:
        """A link to the first of `endpoints` that answers: a stage, then its standbys (the
        same layers elsewhere). One that failed lately is tried after those that did not, so
        once a stage is lost every new lane goes to its standby without waiting on it first."""
        candidates = [endpoints] if isinstance(endpoints, str) else list(endpoints)
        errors = []
        for endpoint in sorted(candidates, key=lambda e: _failed_at.get(e, 0.0)):  # stable: config order
            try:
                reader, writer = await open_connection(endpoint, auth_token=auth_token,
                                                       timeout_s=connect_timeout_s)
            except LinkBroken as error:
                _failed_at[endpoint] = time.monotonic()
                errors.append(str(error))
                continue
            if endpoint != candidates[0]:
                log.info("stage at %s does not answer; lane dialed its standby at %s", candidates[0], endpoint)
            return cls(reader, writer, endpoint=endpoint, **options)
        raise LinkBroken("; ".join(errors))

    # -- sending ------------------------------------------------------------------------
    async def forward_async(self, msg: StageMessage) -> None:
        """Queue a frame for the background writer; waits only while the queue is full."""
        self._check()
        await self._outbox.put(msg)

    async def flush(self) -> None:
        """Wait until every async-forwarded frame is written (spec §2.8)."""
        await self._outbox.join()
        self._check()

    def idle_writer(self) -> SharedWriter | None:
        """The writer a worker may send the next frame on (stage/shared_writer.py): None while
        async forwards or deferred ACKs are outstanding (the next frame must follow them the
        usual way), once the link broke, or for a TLS or conditioned link."""
        if (not isinstance(self._writer, SharedWriter) or self.broken is not None or self.pending_deferred
                or not self._outbox.empty()):
            return None
        return self._writer

    async def send(self, msg: StageMessage) -> float:
        """Flush the async writer, then write `msg` now; returns the write time in seconds."""
        await self.flush()
        started = time.perf_counter()
        try:
            await write_message(self._writer, msg)
        except (ConnectionError, OSError) as error:
            self._mark_broken(f"write failed: {error}")
            self._check()
        return time.perf_counter() - started

    # -- ACKs -----------------------------------------------------------------------------
    async def next_ack(self, what: str = "reply") -> StageReply:
        """The next ACK from downstream, in order; LinkBroken on EOF or timeout."""
        if self._acks.empty():
            self._check()
        try:
            item = await asyncio.wait_for(self._acks.get(), self.reply_timeout_s)
        except TimeoutError:
            self._mark_broken(f"no {what} within {self.reply_timeout_s:g} s")
            self._check()
        if item is _BROKEN:
            self._acks.put_nowait(_BROKEN)  # wake the next waiter too
            self._check()
        return item

    async def note_deferred(self) -> StageReplyStats:
        """Count one deferred ACK; past the credit limit, read one (a credit wait)."""
        self.pending_deferred += 1
        stats = StageReplyStats()
        while self.pending_deferred > self.max_deferred:
            self.credit_waits += 1
            stats = merge(stats, (await self.next_ack("deferred prefill ACK")).stats)
            self.pending_deferred -= 1
        return stats

    async def drain(self) -> StageReplyStats:
        """Read every outstanding deferred ACK; returns their merged stats."""
        stats = StageReplyStats()
        while self.pending_deferred:
            stats = merge(stats, (await self.next_ack("deferred prefill ACK")).stats)
            self.pending_deferred -= 1
        return stats

    async def request(self, msg: StageMessage) -> StageReply:
        """Control round trip: flush, send, and wait for its ACK (deferred ACKs drained first
        by the caller, so the next ACK is this message's)."""
        await self.send(msg)
        reply = await self.next_ack(f"{msg.kind.name} ACK")
        return reply

    def take_edge_stats(self) -> StageReplyStats:
        stats, self.edge_stats = self.edge_stats, StageReplyStats()
        return stats

    # -- background tasks -----------------------------------------------------------------
    async def _read_replies(self) -> None:
        reason = "closed the connection"
        try:
            while True:
                reply = await read_reply(self._reader)
                if reply is None:
                    break
                if reply.kind == ReplyKind.Ack:
                    self._acks.put_nowait(reply)
                elif self.on_prediction is not None:
                    result = self.on_prediction(reply)
                    if result is not None:
                        await result
        except asyncio.CancelledError:
            reason = "link closed"
            raise
        except ProtocolError as error:
            reason = f"sent a bad reply frame ({error})"
        except (ConnectionError, OSError) as error:
            reason = f"connection lost ({error or type(error).__name__})"
        finally:
            self._mark_broken(reason)

    async def _write_forwards(self) -> None:
        while True:
            msg = await self._outbox.get()
            try:
                if self.broken is None:
                    started = time.perf_counter()
                    await write_message(self._writer, msg)
                    write_us = int((time.perf_counter() - started) * 1e6)
                    self.edge_stats = merge(self.edge_stats, prefill_edge_observation(
                        self.stage_index, write_us, 0, msg.activation.nbytes))
            except (ConnectionError, OSError) as error:
                self._mark_broken(f"write failed: {error}")
            finally:
                self._outbox.task_done()

    def _mark_broken(self, reason: str) -> None:
        if self.broken is not None:
            return
        self.broken = reason
        self._acks.put_nowait(_BROKEN)
        self._writer.close()
        if self.on_broken is not None:
            self.on_broken(reason)

    def _check(self) -> None:
        if self.broken is not None:
            raise LinkBroken(f"stage at {self.endpoint}: {self.broken}")

    async def close(self) -> None:
        self.on_broken = None  # a deliberate close is not a failure to report
        self._mark_broken("link closed")
        for task in (self._reader_task, self._writer_task):
            task.cancel()
        await asyncio.gather(self._reader_task, self._writer_task, return_exceptions=True)
        try:
            await self._writer.wait_closed()
        except (ConnectionError, OSError):
            pass
