"""One upstream connection on a stage: read-ahead, in-order handling, cleanup.

A reader task parses frames ahead of execution into a bounded inbox (spec §2.9).
It sends the early ACK of a prefill chunk the moment the chunk arrives, and it
records `DiscardStaleWindows` before the windows queued ahead of it run. The
processing loop hands each message to its handler, in order. Any error (a bad
frame, a refused Stop, a broken downstream) closes this connection only; a
connection that ends without Stop has its sessions reclaimed (spec §3.3).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ..model.errors import ContextOverflowError, RequestError
from ..model.grammar import GrammarError
from ..protocol import (
    FrameError, MessageKind, ProtocolError, StageMessage, StageReply,
    NO_STATS, StageReplyStats, merge, read_message_body, read_message_header, write_reply,
)
from ..protocol.constants import activation_dtype_of
from ..runtime import LaneLimitError, SampleMode, Session, SessionError, SessionKey, Step
from .downstream import DownstreamLink
from .handlers import HANDLERS, StageError, deliver_step
from .lane_loan import LaneLoan
from .stream_loan import StreamLoan, has_unread_bytes

# A peer's faults: what a message causes by itself (malformed, out of order, for no such
# session, past the context or the lanes, inputs the model cannot take, a grammar that does not
# compile) and a peer gone (a reset, a broken or timed-out link). The connection closes with
# one WARNING line naming the reason; the stage is fine, so no traceback. Anything else is ours:
# an ERROR with its traceback.
UPSTREAM_FAULTS = (ProtocolError, StageError, SessionError, LaneLimitError, ContextOverflowError, RequestError,
                   GrammarError, ConnectionError, asyncio.IncompleteReadError, TimeoutError)

if TYPE_CHECKING:
    from .server import StageServer

log = logging.getLogger("skippy.stage")

INBOX_MESSAGES = 128          # read-ahead depth (spec §2.9: 2 x 64 messages) ...
INBOX_BYTES = 32 * 1024 * 1024  # ... and wire bytes; past either, reading waits


@dataclass(slots=True)
class RequestSummary:
    """Per-session totals for the summary line emitted at Stop (numbers only)."""

    messages: int = 0
    rows: int = 0
    compute_ms: float = 0.0
    lock_wait_ms: float = 0.0
    forward_write_ms: float = 0.0
    downstream_wait_ms: float = 0.0


class StageConnection:
    def __init__(self, server: StageServer, conn_id: int, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter):
        self.server, self.conn_id = server, conn_id
        self.config, self.runtime, self.telemetry = server.config, server.runtime, server.telemetry
        self.reader, self.writer = reader, writer
        self.link: DownstreamLink | None = None
        self.pending_stats = NO_STATS
        self.codec = server.measurement.codec  # the dtype of each frame it sends down (measure.py)
        self.summaries: dict[int, RequestSummary] = {}
        self.inbox: asyncio.Queue = asyncio.Queue(INBOX_MESSAGES)
        self.inbox_bytes = 0
        self._inbox_drained = asyncio.Event()
        self._between_frames = False  # the read-ahead waits for a frame's first byte
        self._reader_task: asyncio.Task | None = None
        self._loan: StreamLoan | None = None  # the socket, while lent to the runtime's worker
        self.close_reason: str | None = None

    @property
    def is_final(self) -> bool:
        return self.config.downstream is None

    # -- sessions and steps ---------------------------------------------------------------
    def key(self, session_id: int) -> SessionKey:
        return (self.conn_id, session_id)

    def open_session(self, msg: StageMessage) -> Session:
        """The message's session; a new request on a session id replaces the session, and what
        the old request held here goes with it (its KV, sampler, grammar state and checkpoints
        in the runtime; its return stream and summary here)."""
        key = self.key(msg.session_id)
        sessions = self.runtime.sessions
        if key in sessions and sessions.get(key).request_id != msg.request_id:
            self.server.returns.close(key)
            self.summaries.pop(msg.session_id, None)
        return self.runtime.open_session(key, msg.request_id)

    def step(self, session: Session, msg: StageMessage, sample: SampleMode, *,
             window: bool = False) -> Step:
        tokens = msg.tokens.tolist() or ([msg.current_token] if msg.token_count == 1 else [])
        rows = None
        if not self.runtime.is_first:
            width = self.runtime.model.args.hidden_size
            if msg.activation_rows != msg.token_count or msg.activation_width != width:
                raise FrameError(f"activation: expected {msg.token_count} rows x {width}, got "
                                 f"{msg.activation_rows} x {msg.activation_width}")
            rows = msg.activation_array()
        return Step(session, msg.pos_start, msg.token_count, tokens, rows, msg.activation_dtype,
                    sample, None if self.is_final else self.codec.dtype_for(msg.token_count),
                    msg.seq_id if window else None)

    def forwarded(self, msg: StageMessage, rows: np.ndarray) -> StageMessage:
        """`msg` with this stage's output activation in place of its input."""
        return msg.with_activation(rows, activation_dtype_of(rows), self.config.stage_index)

    def summary(self, session_id: int) -> RequestSummary:
        return self.summaries.setdefault(session_id, RequestSummary())

    # -- replies and stats ----------------------------------------------------------------
    async def downstream(self) -> DownstreamLink | None:
        """This lane's link to the next stage, dialed on first use (None on the final stage)."""
        if self.is_final:
            return None
        if self.link is None:
            config = self.config
            self.link = await DownstreamLink.connect(
                config.downstream.endpoints, auth_token=config.auth_token,
                stage_index=config.stage_index, max_inflight=config.max_inflight,
                max_deferred=config.max_deferred_replies,
                reply_timeout_s=self.server.reply_timeout_s,
                on_prediction=self.reply, on_broken=self._downstream_broken)
        return self.link

    def add_stats(self, stats: StageReplyStats) -> None:
        self.pending_stats = merge(self.pending_stats, stats)

    def take_stats(self) -> StageReplyStats:
        """Stats owed upstream: early-ACKed chunks' own, deferred ACKs', edge writes'."""
        stats, self.pending_stats = self.pending_stats, NO_STATS
        if self.link is not None:
            stats = merge(stats, self.link.take_edge_stats())
        return stats

    async def reply(self, reply: StageReply) -> None:
        await write_reply(self.writer, reply)

    async def return_prediction(self, msg: StageMessage, reply: StageReply) -> None:
        """Final stage: straight to stage 0 when the return stream is open, else upstream."""
        if not await self.server.returns.send(self.key(msg.session_id), msg.request_id, reply):
            await self.reply(reply)

    # -- the connection's life --------------------------------------------------------------
    async def run(self) -> None:
        self._reader_task = asyncio.create_task(self._read_ahead())
        try:
            while (msg := await self.inbox.get()) is not None:
                if isinstance(msg, BaseException):
                    raise msg
                self.inbox_bytes -= msg.activation.nbytes
                self._inbox_drained.set()
                # the child of the span that sent the frame; what it forwards names this span
                with self.telemetry.span("stage.binary_message", parent=msg.trace_context,
                                         kind=msg.kind.name, stage_index=self.config.stage_index,
                                         token_count=msg.token_count,
                                         bytes_in=msg.activation.nbytes) as span:
                    if msg.trace_context is not None and span.traceparent is not None:
                        msg = dataclasses.replace(msg, trace_context=span.traceparent)
                    await HANDLERS[msg.kind](self, msg, span)
                if msg.kind == MessageKind.DecodeEmbd and self.inbox.empty():
                    await self._lend(msg)
        except asyncio.CancelledError:
            self.close_reason = self.close_reason or "stage shutting down"
        except Exception as error:  # noqa: BLE001 - every failure closes this connection only
            self.close_reason = f"{type(error).__name__}: {error}"
            # What the upstream sent is at fault: a warning. Anything else is ours: with its traceback.
            upstream_fault = isinstance(error, UPSTREAM_FAULTS)
            log.log(logging.WARNING if upstream_fault else logging.ERROR,
                    "stage %d: closing connection %d: %s", self.config.stage_index, self.conn_id,
                    self.close_reason, exc_info=not upstream_fault)
        finally:
            self._reader_task.cancel()
            # Shielded: a second cancellation must not skip reclaiming the sessions.
            await asyncio.shield(self._cleanup(self._reader_task))

    async def _lend(self, msg: StageMessage) -> None:
        """Lend the socket to the runtime's worker while this lane decodes alone
        (lane_loan.py), from a frame boundary with nothing read ahead; read on once it is back."""
        if (not self._between_frames or has_unread_bytes(self.reader) or not StreamLoan.can_lend(self.writer)
                or (loan := LaneLoan.offer(self, msg)) is None):
            return

        async def stop_reading() -> None:
            self._reader_task.cancel()
            await asyncio.gather(self._reader_task, return_exceptions=True)

        self._loan = StreamLoan(self.runtime, self.reader, self.writer)
        try:
            await self._loan.run(loan.session.key, loan.feed, stop_reading=stop_reading)
        finally:
            self._loan = None
            loan.settle()
        self._reader_task = asyncio.create_task(self._read_ahead())
        if loan.error is not None:
            raise loan.error  # as the step's handler would have
        if loan.unsent is not None:
            await deliver_step(self, *loan.unsent)

    async def _read_ahead(self) -> None:
        try:
            while True:
                self._between_frames = True
                header = await read_message_header(self.reader)
                self._between_frames = False
                if header is None:
                    break
                msg = await read_message_body(self.reader, header)
                if msg.kind == MessageKind.PrefillEmbd:
                    await self.reply(StageReply.ack())  # early ACK, before compute (spec §2.6)
                elif msg.kind == MessageKind.DiscardStaleWindows:
                    self._record_discard(msg)
                while self.inbox_bytes > INBOX_BYTES and not self.inbox.empty():
                    self._inbox_drained.clear()
                    await self._inbox_drained.wait()
                self.inbox_bytes += msg.activation.nbytes
                await self.inbox.put(msg)
            await self.inbox.put(None)
        except (ProtocolError, ConnectionError, OSError, asyncio.IncompleteReadError) as error:
            await self.inbox.put(error)
        finally:
            self._between_frames = False

    def _record_discard(self, msg: StageMessage) -> None:
        key = self.key(msg.session_id)
        if key in self.runtime.sessions:
            low, high = (int(t) for t in msg.tokens)
            self.runtime.session(key).discard_windows(low, high)

    def _downstream_broken(self, reason: str) -> None:
        # Propagate the failure upstream at once: closing our side ends the upstream's lane.
        if self._loan is not None:  # before the socket closes, not while the worker waits on it
            self._loan.recall()
        log.warning("stage %d: downstream link of connection %d broke: %s",
                    self.config.stage_index, self.conn_id, reason)
        self.close_reason = self.close_reason or f"downstream {reason}"
        self.writer.close()

    async def _cleanup(self, reader_task: asyncio.Task) -> None:
        await asyncio.gather(reader_task, return_exceptions=True)
        if self.link is not None:
            await self.link.close()
        orphans = self.runtime.reclaim_lane(self.conn_id)
        self.server.returns.close_lane(self.conn_id)
        if orphans:
            log.info("stage %d: connection %d ended without Stop; reclaimed %d session(s)",
                     self.config.stage_index, self.conn_id, len(orphans))
        self.writer.close()
