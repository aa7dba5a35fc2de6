"""The connection to the next stage, on the engine thread: frames out in order, replies in (spec §3.2).

One `DownLink` per lane, for the lane's life; every frame sent down goes through it in order.

* A prefill chunk's ACK is *deferred* (the seed's `pending_prefill_replies`): past
  `max_deferred` outstanding the lane takes one (`credit`, spec §2.6), and before anything
  that needs a prediction or a control reply it takes all (`drained`).
* Replies are checked against what was sent (the seed's "stop expected downstream ACK"):
  each frame owed an ACK waits in `_acks`, in order, with the predictions the frames before
  it may still relay (0 or 1 each: the final stage uses the return stream when it can).
  Anything else is a protocol fault. A fault, EOF, or an ACK not back within `reply_s`
  breaks the link: `on_broken(reason)` once, and every wait fails.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..protocol import (
    ActivationDtype, MessageKind, ReplyKind, StageMessage, StageReply, StageReplyStats, encode_message, merge,
    prefill_edge_observation,
)
from ..protocol.decode_frames import DecodeFrames, is_decode_frame, read_reply_from
from .channel import Channel
from .link import Conditioner
from .transport import LinkBroken

log = logging.getLogger("skippy.stage")
# what a frame of each kind is owed by the stage below, on this connection
_ACKED = frozenset({MessageKind.PrefillEmbd, MessageKind.Stop, MessageKind.TrimSession,
                    MessageKind.ConfigureGeneration, MessageKind.TryRestorePrefill,
                    MessageKind.TryRestorePrefillDecode, MessageKind.GetStageStatus})
_MAY_PREDICT = frozenset({MessageKind.PrefillFinalEmbd, MessageKind.DecodeEmbd, MessageKind.VerifyWindow,
                          MessageKind.TryRestorePrefillDecode})


@dataclass(slots=True)
class _AckWait:
    kind: MessageKind
    deadline: float
    predictions: int                       # predictions the frames before it may still relay
    on_ack: Callable[[StageReply | LinkBroken], None] | None  # None: a deferred prefill ACK


class DownLink:
    stages_below = True  # a lane to real stages (driver/session.py NoStagesBelow: none)

    def __init__(self, engine, sock, *, endpoint: str, stage_index: int, max_deferred: int, reply_s: float,
                 on_prediction: Callable[[StageReply], None], on_broken: Callable[[str], None],
                 on_deferred: Callable[[], None] | None = None,
                 conditioner: Conditioner | None = None):
        """`on_prediction`: a prediction relayed up the lane (the direct return's fallback);
        `on_deferred()`: a deferred prefill ACK came back; `on_broken(reason)`: once."""
        self.engine, self.endpoint, self.stage_index = engine, endpoint, stage_index
        self.max_deferred, self.reply_s = max_deferred, reply_s
        self.on_prediction, self.on_broken, self.on_deferred = on_prediction, on_broken, on_deferred
        self.pending_deferred = 0                  # prefill chunks sent whose ACK is not taken yet
        self._arrived: deque[StageReplyStats] = deque()  # their ACKs' stats, come and not taken
        self.deferred_stats = StageReplyStats()    # of those taken
        self.broken: str | None = None
        self.edge_stats = StageReplyStats()       # write observations of prefill forwards
        self._acks: deque[_AckWait] = deque()
        self._trailing_predictions = 0             # predictions the frames after the last ACK wait may relay
        self._frames: DecodeFrames | None = None   # the template of this lane's one-row decode frames
        self._timer = None
        self.channel = Channel(engine, sock, name=f"link to {endpoint}", parse=read_reply_from,
                               on_frame=self._on_reply, on_close=self._on_close, conditioner=conditioner)

    # -- sending ---------------------------------------------------------------------------
    def send(self, msg: StageMessage, on_ack: Callable[[StageReply | LinkBroken], None] | None = None) -> None:
        """Write `msg` after every frame before it; `on_ack` gets its ACK when one is owed (or
        LinkBroken, when the link breaks first)."""
        self._sent(msg.kind, encode_message(msg), on_ack)

    def send_step(self, msg: StageMessage, rows: np.ndarray, dtype: ActivationDtype, source: int,
                  on_ack: Callable[[StageReply | LinkBroken], None] | None = None) -> None:
        """`msg` carrying `rows` (this stage's output) instead of its own activation. A session's
        one-row decode frames are written into its template (protocol/decode_frames.py)."""
        if is_decode_frame(msg):
            frames = self._frames
            if frames is None or not frames.fits(msg, rows):
                frames = self._frames = DecodeFrames(msg.with_activation(rows, dtype, source))
            frame = frames.encode(msg.pos_start, msg.decode_step, msg.current_token, rows)
        else:
            frame = encode_message(msg.with_activation(rows, dtype, source))
        if msg.kind == MessageKind.PrefillEmbd:  # an async forward: its write is an edge observation
            started = time.perf_counter()
            self._sent(msg.kind, frame, on_ack)
            write_us = int((time.perf_counter() - started) * 1e6)
            self.edge_stats = merge(self.edge_stats, prefill_edge_observation(self.stage_index, write_us, 0,
                                                                              rows.nbytes))
        else:
            self._sent(msg.kind, frame, on_ack)

    def _sent(self, kind: MessageKind, frame: bytes, on_ack) -> None:
        if self.broken is not None:
            raise LinkBroken(f"stage at {self.endpoint}: {self.broken}")
        if kind in _ACKED:
            if kind == MessageKind.TryRestorePrefillDecode:  # its token may come first, relayed
                self._trailing_predictions += 1
            self._acks.append(_AckWait(kind, time.perf_counter() + self.reply_s, self._trailing_predictions,
                                       on_ack))
            self._trailing_predictions = 0
            if kind == MessageKind.PrefillEmbd:
                self.pending_deferred += 1
            if self._timer is None:
                self._timer = self.engine.at(self._acks[0].deadline, self._check_deadline)
        elif kind in _MAY_PREDICT:
            self._trailing_predictions += 1
        self.channel.send(frame)

    def credit(self) -> bool:
        """Take the deferred ACKs that came while past the credit window; True once within it
        (False: the next prefill chunk waits for one, a credit wait)."""
        while self.pending_deferred > self.max_deferred and self._arrived:
            self._take_deferred()
        return self.pending_deferred <= self.max_deferred

    def drained(self) -> bool:
        """Take every deferred ACK that came; True when none is outstanding (spec §2.6: before
        a message that needs a prediction or a control reply)."""
        while self._arrived:
            self._take_deferred()
        return self.pending_deferred == 0

    def _take_deferred(self) -> None:
        self.pending_deferred -= 1
        self.deferred_stats = merge(self.deferred_stats, self._arrived.popleft())

    def take_stats(self) -> StageReplyStats:
        """Stats owed upstream from this link: the deferred ACKs taken, the edge writes."""
        stats = merge(self.deferred_stats, self.edge_stats)
        self.deferred_stats = self.edge_stats = StageReplyStats()
        return stats

    # -- replies ---------------------------------------------------------------------------
    def _on_reply(self, reply: StageReply) -> None:
        if reply.kind == ReplyKind.Ack:
            if not self._acks:
                self.fail("answered with an ACK that no message was owed")
                return
            wait = self._acks.popleft()
            if wait.kind == MessageKind.PrefillEmbd:
                self._arrived.append(reply.stats)
                if self.on_deferred is not None:
                    self.on_deferred()
            elif wait.on_ack is not None:
                wait.on_ack(reply)
            self._rearm()
            return
        if reply.kind in (ReplyKind.PredictedToken, ReplyKind.PredictedTokens):
            if self._acks:
                head = self._acks[0]
                if head.predictions == 0:
                    self.fail(f"answered {head.kind.name} with {reply.kind.name}, expected its ACK")
                    return
                head.predictions -= 1
            elif self._trailing_predictions:
                self._trailing_predictions -= 1
            else:
                self.fail(f"sent {reply.kind.name} that no message asked for")
                return
            self.on_prediction(reply)
            return
        expected = self._acks[0].kind.name + " ACK" if self._acks else "nothing"
        self.fail(f"answered with {reply.kind.name}, expected {expected}")

    def _rearm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._acks and self.broken is None:
            self._timer = self.engine.at(self._acks[0].deadline, self._check_deadline)

    def _check_deadline(self) -> None:
        self._timer = None
        if self._acks and self.broken is None:
            head = self._acks[0]
            if head.deadline <= time.perf_counter():
                what = "deferred prefill ACK" if head.kind == MessageKind.PrefillEmbd else f"{head.kind.name} ACK"
                self.fail(f"no {what} within {self.reply_s:g} s")
            else:
                self._rearm()

    # -- breaking and closing ----------------------------------------------------------------
    def fail(self, reason: str) -> None:
        """Break the link (a protocol fault of the stage below, or a timeout)."""
        self.channel.close(reason, fault=True)

    def close(self) -> None:
        """A deliberate close: not reported as a failure."""
        self.on_broken = None
        self.channel.close("link closed")

    def _on_close(self, reason: str, fault: bool) -> None:
        if self.broken is None:
            self.broken = reason
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        waits, self._acks = self._acks, deque()
        error = LinkBroken(f"stage at {self.endpoint}: {reason}")
        for wait in waits:
            if wait.on_ack is not None:
                wait.on_ack(error)
        if self.on_broken is not None:
            self.on_broken(reason)
