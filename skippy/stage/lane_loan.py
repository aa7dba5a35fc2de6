"""A stage connection's socket lent to the runtime's worker while its lane decodes alone.

See runtime/lending.py for the why. Here: when a lane may be lent (`LaneLoan.offer`), and
what the worker does with each frame it reads (`feed`): a one-row DecodeEmbd of the lane's
session becomes the step the handler would have submitted, with the same outgoing frame
sent by the worker as the forward ends; anything else ends the loan, and the event loop's
reader takes that frame and the rest, as if it had read them itself. What a handler notes
per step (the request summary) is added up here and handed over at the give-back; the
runtime counts its metrics for every step it takes from a lent socket (engine.lend).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..protocol import MessageKind, ProtocolError, StageMessage
from ..protocol.constants import MESSAGE_HEADER
from ..protocol.decode_frames import DecodeFrameReader, is_decode_frame
from ..protocol.frames import decode_message_body, parse_message_header
from ..protocol.stats import is_empty
from ..runtime import SampleMode, Session, StepResult, Timed
from ..runtime.lending import NEED_MORE, Taken
from .handlers import worker_send
from .shared_writer import WorkerSend

if TYPE_CHECKING:
    from .connection import StageConnection


class LaneLoan:
    def __init__(self, conn: StageConnection, session: Session):
        self.conn, self.session = conn, session
        self.session_id = session.key[1]
        self.sample = SampleMode.NONE if conn.link is not None else SampleMode.LAST
        self.steps, self.compute_s, self.wait_s, self.auto_aligns = 0, 0.0, 0.0, 0
        self.error: Exception | None = None                    # a step failed: the connection closes
        self.unsent: tuple[StageMessage, StepResult] | None = None  # its frame is the loop's to send
        self.reader: DecodeFrameReader | None = None  # from the first frame decoded in full

    @classmethod
    def offer(cls, conn: StageConnection, msg: StageMessage) -> LaneLoan | None:
        """A loan for the lane that just ran `msg`, or None when the next step must take the
        usual way: several sessions on this stage (their steps batch), a traced request or
        stage (a span per message), logprobs or stats owed on the final stage's reply, or a
        link whose frames the worker may not send (stage/shared_writer.py). The stream itself
        must be plain TCP (StreamLoan.can_lend)."""
        runtime = conn.runtime
        key = conn.key(msg.session_id)
        if (msg.kind != MessageKind.DecodeEmbd or msg.token_count != 1 or msg.trace_context is not None
                or conn.telemetry.tracing or len(runtime.sessions) != 1 or key not in runtime.sessions):
            return None
        session = runtime.session(key)
        if conn.is_final:
            sampling = session.sampling
            if (conn.server.returns.writer(key, msg.request_id) is None
                    or not is_empty(conn.pending_stats)
                    or (sampling is not None and (sampling.logprobs is not None or sampling.prompt_logprobs))):
                return None
        elif conn.link is None or conn.link.idle_writer() is None:
            return None
        return cls(conn, session)

    # -- on the worker ----------------------------------------------------------------------
    def feed(self, buffer: bytearray) -> Taken | object | None:
        """The step of the frame at the front of `buffer`, NEED_MORE, or None: not ours to run
        (the event loop's reader reads it again, and reports what is wrong with it)."""
        if len(buffer) < MESSAGE_HEADER.size:
            return NEED_MORE
        reader = self.reader
        msg = None if reader is None else reader.read(buffer)
        if msg is not None:
            size = reader.size
        else:
            try:
                header = parse_message_header(buffer)
            except ProtocolError:
                return None
            if (header.kind != MessageKind.DecodeEmbd or header.session_id != self.session_id
                    or header.request_id != self.session.request_id):  # a new request: the loop replaces the session
                return None
            size = MESSAGE_HEADER.size + header.body_bytes
            if len(buffer) < size:
                return NEED_MORE
        conn = self.conn
        try:
            if msg is None:
                frame = bytes(buffer[:size])
                msg = decode_message_body(header, frame[MESSAGE_HEADER.size:])
                if msg.token_count != 1 or msg.trace_context is not None:
                    return None
                if is_decode_frame(msg):  # the session's next frames are read from their values
                    self.reader = DecodeFrameReader(frame, msg)
            step = conn.step(self.session, msg, self.sample)
            # no stats are owed (offer), so taking them here takes nothing the loop is owed
            send, _ = worker_send(conn, msg, conn.link)
        except Exception:  # noqa: BLE001 - the loop's way raises it again, where it is reported
            return None
        if send is None:
            return None
        del buffer[:size]
        return Taken(step, send, lambda error, timed: self._done(msg, send, error, timed))

    def _done(self, msg: StageMessage, send: WorkerSend, error: Exception | None, timed: Timed) -> bool:
        """After a step: True to read on; False once it failed or its frame is the loop's to send."""
        if error is not None:
            self.error = error
            return False
        self.steps += 1
        self.compute_s += timed.run_s
        self.wait_s += timed.wait_s
        self.auto_aligns += timed.value.auto_aligned_from is not None
        if not send.sent:
            self.unsent = (msg, timed.value)
            return False
        return True

    # -- back on the event loop -------------------------------------------------------------
    def settle(self) -> None:
        """Note what the handlers would have noted for the steps the worker ran."""
        conn = self.conn
        if self.steps:
            summary = conn.summary(self.session_id)
            summary.messages += self.steps
            summary.rows += self.steps
            summary.compute_ms += self.compute_s * 1e3
            summary.lock_wait_ms += self.wait_s * 1e3
        if self.auto_aligns:
            conn.telemetry.count("skippy.stage.session_auto_align", self.auto_aligns)
        self.steps = self.auto_aligns = 0
