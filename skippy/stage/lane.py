"""One upstream connection of a stage, on the engine thread: its frames, in order (spec §2.4, §2.9).

On arrival, ahead of the frames queued before, a prefill chunk is ACKed (the early ACK, spec
§2.6) and a DiscardStaleWindows is recorded, so the windows queued ahead of it are skipped.
Then the lane takes one frame at a time: a prefill chunk computes and goes down (past the
credit window it waits for a deferred ACK); a kind that needs a prediction, or a control
message, first waits for every deferred ACK. Control messages run on the event loop
(`LaneControl`, stage/handlers.py) and the lane takes its next frame once their reply is
written.

Any error closes this lane only; its sessions are reclaimed and its link is closed, so the
stages below reclaim theirs too (spec §3.3).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from ..model.errors import ContextOverflowError, RequestError
from ..model.grammar import GrammarError
from ..protocol import (
    FrameError, MessageKind, ProtocolError, StageConfig, StageMessage, StageReply,
    StageReplyStats, encode_reply, merge, prefill_compute_observation, prefill_edge_observation,
    record_observation,
)
from ..protocol.constants import activation_dtype_of
from ..protocol.decode_frames import MessageReader, token_reply
from ..protocol.stats import NO_STATS, is_empty
from ..runtime import LaneLimitError, SampleMode, Session, SessionError, Step, StepResult
from ..runtime.stage_runtime import StageRuntime, Timed
from ..telemetry import Span, Telemetry
from .channel import Channel
from .downlink import DownLink
from .engine import Engine, EngineClosed
from .measure import StageMeasurement
from .returns import ReturnStreams
from .transport import LinkBroken, Transport

T = TypeVar("T")
log = logging.getLogger("skippy.stage")

INBOX_MESSAGES = 128            # frames read ahead of the one running (spec §2.9: 2 x 64) ...
INBOX_BYTES = 32 * 1024 * 1024  # ... and their wire bytes; past either, reading pauses
K = MessageKind
DATA_KINDS = frozenset({K.PrefillEmbd, K.PrefillFinalEmbd, K.DecodeEmbd, K.VerifyWindow, K.RetireVerifyWindow,
                        K.DiscardStaleWindows, K.PredictionReturnOpen})
_PREDICTING = frozenset({K.PrefillFinalEmbd, K.DecodeEmbd, K.VerifyWindow})
# kinds that first wait for every deferred prefill ACK (Stop refuses instead)
_DRAINS = frozenset({*_PREDICTING, K.TrimSession, K.ConfigureGeneration, K.TryRestorePrefill,
                     K.TryRestorePrefillDecode})
_ACK = encode_reply(StageReply.ack())
del K


class StageError(RuntimeError):
    """A message this stage refuses to execute; its connection is closed (spec §2.6)."""


class LaneClosed(ConnectionError):
    """A control message's work found its connection closed under it."""


# A peer's faults: what a message causes by itself (malformed, out of order, for no such
# session, past the context or the lanes, inputs the model cannot take, a grammar that does not
# compile) and a peer gone (a reset, a broken or timed-out link). The connection closes with
# one WARNING line naming the reason; the stage is fine, so no traceback. Anything else is ours:
# an ERROR with its traceback.
UPSTREAM_FAULTS = (ProtocolError, StageError, SessionError, LaneLimitError, ContextOverflowError, RequestError,
                   GrammarError, ConnectionError, TimeoutError)


@dataclass(slots=True)
class RequestSummary:
    """Per-session totals for the summary line emitted at Stop (numbers only)."""
    messages: int = 0
    rows: int = 0
    compute_ms: float = 0.0
    lock_wait_ms: float = 0.0
    forward_write_ms: float = 0.0
    downstream_wait_ms: float = 0.0


@dataclass(slots=True)
class LaneEnv:
    """What every lane of one stage shares."""
    config: StageConfig                        # replaced whole when the next stage moves (StageServer.repoint)
    engine: Engine
    runtime: StageRuntime
    telemetry: Telemetry
    returns: ReturnStreams
    transport: Transport
    measurement: StageMeasurement               # its probe, and the dtype of each frame it sends down
    control: Callable[[LaneControl], None]     # on the event loop: run a control message's handler
    needs_link: Callable[[Lane], None]          # on the event loop: dial the lane's link, then lane.resume()
    ended: Callable[[Lane], None]               # on the engine: the lane is closed
    lanes: dict = field(default_factory=dict)   # lane id -> Lane: the stage's open lanes (the engine's)


def _us(seconds: float) -> int:
    return int(seconds * 1e6)


class Lane:
    def __init__(self, env: LaneEnv, lane_id: int, sock, peer):
        self.env, self.lane_id, self.peer = env, lane_id, peer
        self.is_final = env.config.downstream is None
        self.link: DownLink | None = None
        self.pending_stats = NO_STATS
        self.summaries: dict[int, RequestSummary] = {}
        self.closed = False
        self.close_reason: str | None = None
        self._backlog: deque[tuple[StageMessage, int]] = deque()
        self._backlog_bytes = 0
        self._busy = False         # a step or a control message of this lane is under way
        self._credit_wait: tuple[float, int] | None = None  # (since, session id): past the credit window
        self._eof = False          # the peer closed its side: end once its frames are done
        self._pumping = False      # _pump is running: frames that arrive inside it wait for its loop
        self.channel = Channel(env.engine, sock, name=f"connection {lane_id}", parse=MessageReader(),
                               on_frame=self._arrived, on_close=self._channel_closed, on_eof=self._peer_done,
                               conditioner=env.transport.conditioner())  # replies cross the WAN too

    def key(self, session_id: int) -> tuple[int, int]:
        return (self.lane_id, session_id)

    def open_session(self, msg: StageMessage) -> Session:
        """The message's session; a new request on a session id replaces it, and what the old
        request held goes with it."""
        key, runtime = self.key(msg.session_id), self.env.runtime
        if key in runtime.sessions and runtime.session(key).request_id != msg.request_id:
            self.env.returns.close(key)
            self.summaries.pop(msg.session_id, None)
        return runtime.open_session(key, msg.request_id)

    def summary(self, session_id: int) -> RequestSummary:
        return self.summaries.setdefault(session_id, RequestSummary())

    # -- arrival ---------------------------------------------------------------------------
    def _arrived(self, msg: StageMessage) -> None:
        if msg.kind == MessageKind.PrefillEmbd:
            self.channel.send(_ACK)  # early ACK, before compute (spec §2.6)
        elif msg.kind == MessageKind.DiscardStaleWindows:
            key = self.key(msg.session_id)
            if key in self.env.runtime.sessions:  # ahead of the windows queued before it
                low, high = (int(t) for t in msg.tokens)
                self.env.runtime.session(key).discard_windows(low, high)
        nbytes = msg.activation.nbytes
        self._backlog.append((msg, nbytes))
        self._backlog_bytes += nbytes
        if len(self._backlog) >= INBOX_MESSAGES or self._backlog_bytes > INBOX_BYTES:
            self.channel.pause_reading()
        self._pump()

    def _peer_done(self) -> None:
        self._eof = True
        self._pump()

    def _pump(self) -> None:
        """Take the next frames while nothing of this lane is under way. Not re-entered:
        resuming reading inside the loop hands it the frames read meanwhile (`_arrived`), and
        those must wait for the frame just taken from the front, which the loop starts next."""
        if self._pumping:
            return
        self._pumping = True
        try:
            self._take_frames()
        finally:
            self._pumping = False

    def _take_frames(self) -> None:
        while not self._busy and self._backlog and not self.closed:
            msg = self._backlog[0][0]
            link = self.link
            if msg.kind in _DRAINS and link is not None and not link.drained():
                return  # every deferred prefill ACK first: each one that comes back calls _pump
            msg, nbytes = self._backlog.popleft()
            self._backlog_bytes -= nbytes
            if len(self._backlog) < INBOX_MESSAGES // 2 and self._backlog_bytes <= INBOX_BYTES // 2:
                self.channel.resume_reading()
            try:
                self._take(msg)
            except Exception as error:  # noqa: BLE001 - every failure closes this lane only
                self.fail(error)
        if self._eof and not self._busy and not self._backlog:
            self.channel.close("closed the connection")

    def _take(self, msg: StageMessage) -> None:
        if msg.kind not in DATA_KINDS:
            self._start_control(msg)
            return
        if msg.kind == MessageKind.PredictionReturnOpen:
            raise FrameError("PredictionReturnOpen: expected only as the first frame of a "
                             "prediction-return stream to stage 0, got it on a stage connection")
        if self.link is None and not self.is_final and msg.kind != MessageKind.DiscardStaleWindows:
            self._backlog.appendleft((msg, 0))  # taken again once the link is dialed
            self._busy = True
            self.env.engine.emit(self.env.needs_link, self)
            return
        span = self._span(msg)
        if msg.kind == MessageKind.PrefillEmbd or msg.kind in _PREDICTING:
            self._compute(msg, span)
        else:
            if msg.kind == MessageKind.RetireVerifyWindow:
                key = self.key(msg.session_id)
                if key in self.env.runtime.sessions:
                    span.set("retired_windows", self.env.runtime.retire(key, msg.pos_start, msg.token_count))
            if self.link is not None:  # Retire and Discard go on down, no ACK
                self.link.send(self._traced(msg, span))
            span.end()

    def _span(self, msg: StageMessage) -> Span:
        # the child of the span that sent the frame; what this stage forwards names this span
        return self.env.telemetry.start_span("stage.binary_message", parent=msg.trace_context, kind=msg.kind.name,
                                             stage_index=self.env.config.stage_index, token_count=msg.token_count,
                                             bytes_in=msg.activation.nbytes)

    @staticmethod
    def _traced(msg: StageMessage, span: Span) -> StageMessage:
        if msg.trace_context is not None and span.traceparent is not None:
            return msg.derived(trace_context=span.traceparent)
        return msg

    # -- steps -----------------------------------------------------------------------------
    def _step(self, session: Session, msg: StageMessage, sample: SampleMode, *, window: bool = False) -> Step:
        runtime = self.env.runtime
        tokens = msg.tokens.tolist() or ([msg.current_token] if msg.token_count == 1 else [])
        rows = None
        if not runtime.is_first:
            width = runtime.model.args.hidden_size
            if msg.activation_rows != msg.token_count or msg.activation_width != width:
                raise FrameError(f"activation: expected {msg.token_count} rows x {width}, got "
                                 f"{msg.activation_rows} x {msg.activation_width}")
            rows = msg.activation_array()
        return Step(session, msg.pos_start, msg.token_count, tokens, rows, msg.activation_dtype, sample,
                    None if self.is_final else self.env.measurement.codec.dtype_for(msg.token_count), msg.seq_id if window else None)

    def _took(self, msg: StageMessage, span: Span, result: StepResult | Exception, timed: Timed) -> bool:
        """A step's result is back: its compute noted, or False (its span ended) when the lane
        has closed meanwhile or the step failed, which fails the lane."""
        if self.closed or isinstance(result, Exception):
            span.end()
            if not self.closed:
                self.fail(result)
            return False
        span.set("compute_ms", timed.run_s * 1e3)
        span.set("runtime_lock_wait_ms", timed.wait_s * 1e3)
        span.set("batch_size", timed.batch_size)
        summary = self.summary(msg.session_id)
        summary.messages += 1
        summary.rows += msg.token_count
        summary.compute_ms += timed.run_s * 1e3
        summary.lock_wait_ms += timed.wait_s * 1e3
        if timed.value.auto_aligned_from is not None:  # spec §3.4 auto-align
            span.set("auto_align_from_tokens", timed.value.auto_aligned_from)
            self.env.telemetry.count("skippy.stage.session_auto_align")
        return True

    def _forward(self, msg: StageMessage, span: Span, result: StepResult) -> bool:
        """The step's rows go down the link; False (the span ended, the lane failed) when it broke."""
        try:
            self.link.send_step(self._traced(msg, span), result.rows, activation_dtype_of(result.rows),
                                self.env.config.stage_index)
        except LinkBroken as error:
            span.end()
            self.fail(error)
            return False
        return True

    def _compute(self, msg: StageMessage, span: Span) -> None:
        """A prompt chunk, a decode step or a verify window into a forward; its result goes to
        `_prefilled` (a chunk: rows down, a deferred ACK) or `_predicted`."""
        session = self.open_session(msg)
        is_window, is_chunk = msg.kind == MessageKind.VerifyWindow, msg.kind == MessageKind.PrefillEmbd
        if is_window and self.is_final and session.is_discarded(msg.seq_id):
            span.set("skipped_stale_window", True)  # middle stages ran it; the final skips it
            span.end()
            return
        sample = (SampleMode.NONE if is_chunk or not self.is_final else SampleMode.ALL if is_window
                  else SampleMode.LAST)
        step = self._step(session, msg, sample, window=is_window)
        then = self._prefilled if is_chunk else self._predicted
        self._busy = True
        self.env.runtime.submit(step, lambda result, timed: then(msg, span, result, timed),
                                prefill=is_chunk or msg.kind == MessageKind.PrefillFinalEmbd, last_chunk=not is_chunk)

    def _prefilled(self, msg: StageMessage, span: Span, result: StepResult | Exception, timed: Timed) -> None:
        if not self._took(msg, span, result, timed):
            return
        index = self.env.config.stage_index
        self.add_stats(prefill_compute_observation(index, _us(timed.run_s), msg.token_count))
        link = self.link
        if link is not None:
            if not self._forward(msg, span, result):
                return
            if not link.credit():  # the downstream edge is the bottleneck: wait for a deferred ACK
                self._credit_wait = (time.perf_counter(), msg.session_id)
                span.end()
                return
        span.end()
        self.resume()

    def _predicted(self, msg: StageMessage, span: Span, result: StepResult | Exception, timed: Timed) -> None:
        if not self._took(msg, span, result, timed):
            return
        index, link = self.env.config.stage_index, self.link
        is_window = msg.kind == MessageKind.VerifyWindow
        write_s = 0.0
        if msg.kind == MessageKind.PrefillFinalEmbd:
            self.add_stats(prefill_compute_observation(index, _us(timed.run_s), msg.token_count))
        if link is not None:
            started = time.perf_counter()
            if not self._forward(msg, span, result):
                return
            write_s = time.perf_counter() - started
            span.set("forward_write_ms", write_s * 1e3)
            self.summary(msg.session_id).forward_write_ms += write_s * 1e3
        if is_window:
            self.add_stats(StageReplyStats(
                verify_window_compute_us=_us(timed.run_s), verify_window_forward_write_us=_us(write_s),
                verify_window_total_us=_us(timed.run_s + write_s), verify_window_stage_count=1,
                verify_window_request_count=int(link is None), verify_window_token_count=msg.token_count,
                verify_window_max_tokens=msg.token_count))
        if self.is_final:
            self._return_prediction(msg, result, is_window)
        if msg.kind == MessageKind.PrefillFinalEmbd:  # the prompt is in: record it (spec §4.3)
            self.record(msg.session_id, span)
        span.end()
        self.resume()

    def return_frame(self, msg: StageMessage, frame: bytes) -> None:
        """A prediction reply, on the direct return stream when the request has one, else up this lane."""
        if not self.env.returns.send(self.key(msg.session_id), msg.request_id, frame):
            self.channel.send(frame)

    def _return_prediction(self, msg: StageMessage, result: StepResult, is_window: bool) -> None:
        stats = self.take_stats()
        if is_window:
            frame = encode_reply(StageReply.window(result.tokens, msg.seq_id, stats, result.logprobs))
        elif is_empty(stats) and result.logprobs is None and result.prompt_logprobs is None:
            frame = token_reply(result.tokens[0])  # the rule: a template (protocol/decode_frames.py)
        else:
            frame = encode_reply(StageReply.token(result.tokens[0], stats, logprobs=result.logprobs,
                                                  prompt_logprobs=result.prompt_logprobs))
        self.return_frame(msg, frame)

    def record(self, session_id: int, span: Span | None = None) -> None:
        """Record the session's prefill; the stats ride on the next reply upstream."""
        recorded = self.env.runtime.record_prefix(self.key(session_id))
        if recorded.num_entries:
            if span is not None:
                span.set("kv_recorded_entries", recorded.num_entries)
            self.add_stats(record_observation(self.env.config.stage_index, recorded.num_entries,
                                              recorded.num_bytes))

    # -- the link below --------------------------------------------------------------------
    def attach_link(self, sock, endpoint: str) -> None:
        """On the engine: the dialed link to the next stage is this lane's, for its life."""
        if self.closed:
            sock.close()
            return
        config = self.env.config
        self.link = DownLink(self.env.engine, sock, endpoint=endpoint, stage_index=config.stage_index,
                             max_deferred=config.max_deferred_replies, reply_s=config.timeouts.reply_s,
                             on_prediction=lambda reply: self.channel.send(encode_reply(reply)),
                             on_broken=self._link_broken, on_deferred=self._deferred_ack,
                             conditioner=self.env.transport.conditioner())

    def resume(self) -> None:
        """On the engine: what this lane waited for is done; take the next frame."""
        self._busy = False
        self._pump()

    def _deferred_ack(self) -> None:
        link = self.link
        if self._credit_wait is not None and link.credit():
            (since, session_id), self._credit_wait = self._credit_wait, None
            wait_s = time.perf_counter() - since
            self.summary(session_id).downstream_wait_ms += wait_s * 1e3
            self.add_stats(prefill_edge_observation(self.env.config.stage_index, 0, _us(wait_s), 0))
            self.resume()
        elif not self._busy:
            self._pump()

    def _link_broken(self, reason: str) -> None:
        # Propagate the failure upstream at once: closing our side ends the upstream's lane.
        if not self.closed:
            log.warning("stage %d: downstream link of connection %d broke: %s", self.env.config.stage_index,
                        self.lane_id, reason)
            self.close_reason = self.close_reason or f"downstream {reason}"
            self.channel.close(self.close_reason)

    # -- stats -----------------------------------------------------------------------------
    def add_stats(self, stats: StageReplyStats) -> None:
        self.pending_stats = merge(self.pending_stats, stats)

    def take_stats(self) -> StageReplyStats:
        """Stats owed upstream: early-ACKed chunks' own, deferred ACKs', edge writes'."""
        stats, self.pending_stats = self.pending_stats, NO_STATS
        if self.link is not None:
            stats = merge(stats, self.link.take_stats())
        return stats

    # -- control ---------------------------------------------------------------------------
    def _start_control(self, msg: StageMessage) -> None:
        link = self.link
        if msg.kind == MessageKind.Stop and link is not None and link.pending_deferred:
            raise StageError(f"cannot stop with {link.pending_deferred} deferred prefill replies")
        self._busy = True
        self.env.engine.emit(self.env.control, LaneControl(self, msg, self.take_stats()))

    def reply(self, reply: StageReply) -> None:
        """On the engine: a control message's reply goes up; the lane takes its next frame."""
        if not self.closed:
            self.channel.send(encode_reply(reply))
            self.resume()

    # -- the end ---------------------------------------------------------------------------
    def fail(self, error: Exception) -> None:
        """Close this lane with a logged reason: a warning for what the peer did (an upstream
        fault), an error with its traceback for what is ours."""
        if self.closed:
            return
        reason, ours = f"{type(error).__name__}: {error}", not isinstance(error, UPSTREAM_FAULTS)
        log.log(logging.ERROR if ours else logging.WARNING, "stage %d: closing connection %d: %s",
                self.env.config.stage_index, self.lane_id, reason, exc_info=error if ours else None)
        self.close_reason = self.close_reason or reason
        self.channel.close(reason)

    def close(self) -> None:
        """The stage is shutting down."""
        self.close_reason = self.close_reason or "stage shutting down"
        self.channel.close("stage shutting down")

    def _channel_closed(self, reason: str, fault: bool) -> None:
        if self.closed:
            return
        self.closed = True
        if self.close_reason is None:  # the channel ended it: EOF, a bad frame, a failed write
            self.close_reason = reason
            if fault:  # the peer broke the protocol: a warning, as for any bad frame
                log.warning("stage %d: closing connection %d: %s", self.env.config.stage_index, self.lane_id, reason)
        if self.link is not None:
            self.link.close()
        runtime = self.env.runtime
        orphans = runtime.reclaim_lane(self.lane_id)
        self.env.returns.close_lane(self.lane_id)
        if orphans:
            log.info("stage %d: connection %d ended without Stop; reclaimed %d session(s)",
                     self.env.config.stage_index, self.lane_id, len(orphans))
        self.env.ended(self)


class LaneControl:
    """A lane's control message on the event loop (stage/handlers.py): its handler runs runtime
    work on the engine (`run`, `step`), talks to the stage below (`ensure_link`, `forward`),
    and ends with `reply` (the lane takes its next frame) or an exception (the lane closes)."""

    def __init__(self, lane: Lane, msg: StageMessage, stats: StageReplyStats):
        self.lane, self.msg, self.stats = lane, msg, stats
        self.env = lane.env
        self.key = lane.key(msg.session_id)
        self.is_final = lane.is_final
        self.has_link = lane.link is not None

    async def run(self, fn: Callable[[Lane], T]) -> T:
        """fn(lane) on the engine thread (the runtime is `lane.env.runtime`); not once the lane
        has closed (a bad frame read behind this message, say): its sessions are reclaimed,
        and nothing may open one again."""
        lane = self.lane

        def run() -> T:
            if lane.closed:
                raise LaneClosed(f"connection {lane.lane_id} closed: {lane.close_reason}")
            return fn(lane)

        return await self.env.engine.call(run)

    async def step(self, msg: StageMessage, sample: SampleMode) -> Timed:
        """`msg`'s rows through this stage's layers (a one-off step of its session)."""
        done, engine = asyncio.get_running_loop().create_future(), self.env.engine

        def submit(lane: Lane) -> None:
            step = lane._step(lane.open_session(msg), msg, sample)
            lane.env.runtime.submit(step, lambda result, timed: engine.settle(done, (result, timed)), prefill=True)

        await self.run(submit)
        result, timed = await done
        if isinstance(result, Exception):
            raise result
        return timed

    async def ensure_link(self) -> None:
        """Dial this lane's link to the next stage, unless it has one (or is the final stage)."""
        if not self.is_final and not self.has_link:
            await dial_link(self.lane)
            self.has_link = True

    async def forward(self, span: Span, rows=None) -> StageReplyStats:
        """The message on down, naming `span` as parent (carrying `rows` when given); its
        ACK's stats (kind-checked: downlink.py), the wait on the span. LinkBroken when the
        link breaks first."""
        loop = asyncio.get_running_loop()
        acked, started = loop.create_future(), time.perf_counter()
        engine, lane, msg = self.env.engine, self.lane, Lane._traced(self.msg, span)

        def on_ack(reply) -> None:
            engine.settle(acked, reply)

        def send() -> None:
            link = lane.link
            if link is None or lane.closed:
                on_ack(LinkBroken("the lane closed"))
            elif rows is None:
                link.send(msg, on_ack)
            else:
                link.send_step(msg, rows, activation_dtype_of(rows), self.env.config.stage_index, on_ack)

        engine.post(send)
        reply = await acked
        if isinstance(reply, Exception):
            raise reply
        span.set("downstream_wait_ms", (time.perf_counter() - started) * 1e3)
        return reply.stats

    def reply(self, reply: StageReply) -> None:
        self.env.engine.post(lambda: self.lane.reply(reply))

    def fail(self, error: Exception) -> None:
        lane = self.lane
        try:
            self.env.engine.post(lambda: lane.fail(error))
        except EngineClosed:
            pass


async def dial_link(lane: Lane) -> None:
    """On the event loop: dial the lane's link to the next stage (or its standby) and hand it to
    the engine (LinkBroken when none answers)."""
    env = lane.env
    sock, endpoint = await env.transport.dial(env.config.downstream.endpoints)
    await env.engine.call(lambda: lane.attach_link(sock, endpoint))

