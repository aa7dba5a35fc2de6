"""One request on stage 0's engine thread: its steps, its frames down the lane, its predictions back.

(llama.cpp's server calls this a slot.) It runs on the engine, which owns the lane's socket
and the return streams, so a prediction reaches the decode loop (driver/decoder.py) and the
next step starts with no hand-off between threads. Every step goes through `_step`; on a
chain of one stage (`NoStagesBelow`) stage 0 samples it itself. Predictions are owed in
order, each with a deadline (`reply_s`); a broken link, a failed step or a missed deadline
fails the slot with `ChainError`, and the request's recovery (driver/client.py) takes over.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ..protocol import (
    MessageKind, ReplyKind, SamplingConfig, StageMessage, StageReply, StageReplyStats, merge,
    prefill_compute_observation, record_observation,
)
from ..protocol.constants import activation_dtype_of
from ..runtime import SampleMode, Step, StepResult
from ..runtime.stage_runtime import StageRuntime, Timed
from ..stage.engine import Engine
from ..stage.measure import LinkCodec

log = logging.getLogger("skippy.driver")
_I32 = np.dtype("<i4")


class ChainError(RuntimeError):
    """The chain could not complete a request: a stage died, hung, or refused a message."""


@dataclass(frozen=True, slots=True)
class SlotEnv:
    """What every request of one stage 0 shares."""
    engine: Engine
    runtime: StageRuntime          # stage 0's own layers
    prefill_chunk: int             # prompt tokens per PrefillEmbd chunk (spec §6.4: 256)
    reply_s: float                 # the longest wait for any reply of the chain
    codec: LinkCodec               # the wire dtype of each frame of rows sent to stage 1 (stage/measure.py)


Reply = StageReply | Exception


@dataclass(slots=True)
class _Owed:
    """A prediction the chain owes: a plain step's (window_id None) or a verify window's."""
    window_id: int | None
    what: str                      # the phase, for a failure's message
    deadline: float
    on_reply: Callable[[Reply], None]


class Slot:
    def __init__(self, env: SlotEnv, link, lane_id: int, request_id: int, session_id: int,
                 sampling: SamplingConfig, prompt_token_count: int, trace_context: bytes | None):
        """On the engine. `link`: the lane's DownLink, or NoStagesBelow when stage 0 holds the
        whole model (then stage 0 samples its own steps)."""
        self.env, self.link = env, link
        self.request_id, self.session_id = request_id, session_id
        self.key = (lane_id, session_id)
        self.sampling, self.prompt_token_count, self.trace_context = sampling, prompt_token_count, trace_context
        self.session = env.runtime.open_session(self.key, request_id)
        self.samples_here = not link.stages_below
        self.position = 0          # the next position to write: what every stage holds
        self.decode_step = 0
        self.draws = 0             # predictions received: one sampler draw each (a window: one a row)
        self.stats = StageReplyStats()
        self.failed: Exception | None = None
        self.on_deferred: Callable[[], None] | None = None  # a prompt waiting for deferred ACKs
        self.on_failure: Callable[[Exception], None] | None = None  # the decode loop's, while one runs
        self._owed: deque[_Owed] = deque()
        self._timer = None
        self._cancelled = False
        self._decode = StageMessage(MessageKind.DecodeEmbd, request_id=request_id, session_id=session_id,
                                    prompt_token_count=prompt_token_count, trace_context=trace_context,
                                    token_count=1, tokens=[0])  # what every plain step's frame derives from

    # -- the one kind of step stage 0 runs ------------------------------------------------------
    def _step(self, kind: MessageKind, tokens: list[int], start: int, *, window_id: int | None = None,
              last_chunk: bool = True, then: Callable[[StepResult], None] | None = None) -> None:
        """Run `tokens` at `start` through stage 0's layers, then send the frame of `kind` down
        (or, holding the head, hand over what stage 0 sampled); `then(result)` after that."""
        samples = self.samples_here and kind != MessageKind.PrefillEmbd
        sample = SampleMode.NONE if not samples else SampleMode.ALL if window_id is not None else SampleMode.LAST
        step = Step(self.session, start, len(tokens), tokens, sample=sample,
                    out_dtype=None if self.samples_here else self.env.codec.dtype_for(len(tokens)), window_id=window_id)
        decode_step = self.decode_step
        is_prompt = kind in (MessageKind.PrefillEmbd, MessageKind.PrefillFinalEmbd)

        def done(result: StepResult | Exception, timed: Timed) -> None:
            if self.failed is not None or self._cancelled:
                return
            if isinstance(result, Exception):
                return self.fail(ChainError(f"stage 0 failed a {kind.name} step: {result}"), cause=result)
            if is_prompt:
                self.stats = merge(self.stats, prefill_compute_observation(0, int(timed.run_s * 1e6), len(tokens)))
            if self.samples_here:
                if result.tokens is not None:
                    self.on_reply(StageReply.token(result.tokens[0], logprobs=result.logprobs,
                                                   prompt_logprobs=result.prompt_logprobs)
                                  if window_id is None else
                                  StageReply.window(result.tokens, window_id, logprobs=result.logprobs))
            else:
                try:
                    self.link.send_step(self._message(kind, tokens, start, decode_step, window_id), result.rows,
                                        activation_dtype_of(result.rows), 0)
                except ConnectionError as error:
                    return self.fail(ChainError(f"stage chain failed during {kind.name}: {error}"))
            if then is not None:
                then(result)

        self.env.runtime.submit(step, done, prefill=is_prompt, last_chunk=last_chunk)

    def _message(self, kind: MessageKind, tokens: list[int], start: int, decode_step: int,
                 window_id: int | None) -> StageMessage:
        if kind == MessageKind.DecodeEmbd and len(tokens) == 1:
            token = tokens[0]
            return self._decode.derived(pos_start=start, decode_step=decode_step, current_token=token,
                                        tokens=np.array(tokens, dtype=_I32))
        return self.message(kind, pos_start=start, token_count=len(tokens), seq_id=window_id or 0,
                            decode_step=decode_step, current_token=tokens[0], tokens=tokens)

    # -- what a request asks of stage 0 --------------------------------------------------------
    def prefill(self, tokens: Sequence[int], on_first: Callable[[Reply], None]) -> None:
        """Prefill `tokens` at the current position, in chunks (spec §2.6); `on_first` gets the
        first prediction. The prompt is recorded while the stages below compute (spec §4.3)."""
        chunk_size, runtime = self.env.prefill_chunk, self.env.runtime
        chunks = [list(tokens[start:start + chunk_size]) for start in range(0, len(tokens), chunk_size)]

        def next_chunk() -> None:
            chunk = chunks.pop(0)
            start = self.position
            self.position += len(chunk)
            if chunks:
                self._step(MessageKind.PrefillEmbd, chunk, start, last_chunk=False, then=lambda _: after_chunk())
            else:
                self.on_failure = None  # from here the first token is owed, and hears a failure as such
                self._owe(None, "prefill (first token)", on_first)
                self._step(MessageKind.PrefillFinalEmbd, chunk, start, then=lambda _: recorded())

        def after_chunk() -> None:
            self.go_when_acked(next_chunk, last=not chunks)

        def recorded() -> None:
            result = runtime.record_prefix(self.key)
            if result.num_entries:
                self.stats = merge(self.stats, record_observation(0, result.num_entries, result.num_bytes))

        self.on_failure = on_first  # a failure between chunks (a link that breaks) ends the prompt
        self.go_when_acked(next_chunk, last=len(chunks) == 1)

    def go_when_acked(self, then: Callable[[], None], *, last: bool) -> None:
        """then() once the lane's deferred ACKs allow: within the credit window, or, before a
        frame that needs a prediction (`last`), none outstanding at all (spec §2.6)."""
        link = self.link
        if not (link.drained() if last else link.credit()) and self.failed is None:
            self.on_deferred = lambda: self.go_when_acked(then, last=last)
            return
        self.on_deferred = None
        then()

    def decode(self, token: int, position: int, on_reply: Callable[[Reply], None]) -> None:
        """One DecodeEmbd of `token` at `position`; `on_reply` gets its prediction."""
        self.position = position
        self.decode_step += 1
        self._owe(None, f"DecodeEmbd step {self.decode_step}", on_reply)
        self._step(MessageKind.DecodeEmbd, [token], position)
        self.position = position + 1

    def verify(self, tokens: list[int], window_id: int, base: int, on_reply: Callable[[Reply], None]) -> None:
        """A VerifyWindow of [current, drafts...] at `base`; `on_reply` gets its predictions."""
        self._owe(window_id, f"VerifyWindow {window_id}", on_reply)
        self._step(MessageKind.VerifyWindow, tokens, base, window_id=window_id)
        self.position = base + len(tokens)

    def restore_decode(self, msg: StageMessage, token: int, start: int, on_reply: Callable[[Reply], None],
                       on_ack: Callable[[Reply], None]) -> None:
        """TryRestorePrefillDecode (`msg`): stage 0's row of the prompt's last `token` at `start`
        rides along. Its ACK goes to `on_ack`; on a chain hit the final stage samples the first
        token and returns it (to `on_reply`) before the ACKs climb back."""
        self._owe(None, "TryRestorePrefillDecode (first token)", on_reply)
        step = Step(self.session, start, 1, [token], out_dtype=self.env.codec.dtype_for(1))

        def done(result: StepResult | Exception, timed: Timed) -> None:
            if self.failed is not None or self._cancelled:
                return
            if isinstance(result, Exception):
                return self.fail(ChainError(f"stage 0 failed a TryRestorePrefillDecode step: {result}"), cause=result)
            try:
                self.link.send_step(msg, result.rows, activation_dtype_of(result.rows), 0, on_ack)
            except ConnectionError as error:
                on_ack(error)

        self.env.runtime.submit(step, done, prefill=True)
        self.position = start + 1

    def forget_prediction(self) -> None:
        """The restore-decode missed below: no first token is coming."""
        if self._owed and self._owed[0].what.startswith("TryRestorePrefillDecode"):
            self._owed.popleft()
            self._arm()

    def retire(self, start: int, count: int) -> None:
        """RetireVerifyWindow on every stage: the checkpoints of windows based in [start, start + count)."""
        self._send(self.message(MessageKind.RetireVerifyWindow, pos_start=start, token_count=count))
        if self.key in self.env.runtime.sessions:
            self.env.runtime.retire(self.key, start, count)

    def discard(self, low: int, high: int) -> None:
        """Windows [low, high] are stale: the final stage skips them, their late answers are ignored."""
        self.session.discard_windows(low, high)
        self._owed = deque(owed for owed in self._owed
                           if owed.window_id is None or not low <= owed.window_id <= high)
        self._send(self.message(MessageKind.DiscardStaleWindows, tokens=[low, high]))
        self._arm()

    def message(self, kind: MessageKind, **fields) -> StageMessage:
        """A frame of this request's session."""
        return StageMessage(kind, request_id=self.request_id, session_id=self.session_id,
                            prompt_token_count=self.prompt_token_count, trace_context=self.trace_context, **fields)

    def _send(self, msg: StageMessage) -> None:
        try:
            self.link.send(msg)
        except ConnectionError as error:
            self.fail(ChainError(f"stage chain failed during {msg.kind.name}: {error}"))

    # -- predictions ----------------------------------------------------------------------------
    def _owe(self, window_id: int | None, what: str, on_reply: Callable[[Reply], None]) -> None:
        self._owed.append(_Owed(window_id, what, time.perf_counter() + self.env.reply_s, on_reply))
        if self._timer is None:
            self._arm()

    def on_reply(self, reply: StageReply) -> None:
        """A prediction for this request (from the return stream, relayed up the lane, or
        sampled here): the oldest owed one, or a window's by its id."""
        if self.failed is not None or self._cancelled:
            return
        self.stats = merge(self.stats, reply.stats)
        owed = self._owed
        if reply.kind == ReplyKind.PredictedToken:
            match = 0 if owed and owed[0].window_id is None else None
        else:
            match = next((i for i, o in enumerate(owed) if o.window_id == reply.window_id), None)
        if match is None:  # a late answer to a window that was discarded as stale
            return
        for _ in range(match):
            owed.popleft()
        self.draws += len(reply.predicted_tokens)
        owed.popleft().on_reply(reply)
        self._arm()

    def _arm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._owed and self.failed is None:
            self._timer = self.env.engine.at(self._owed[0].deadline, self._check_deadline)

    def _check_deadline(self) -> None:
        self._timer = None
        if self._owed and self.failed is None:
            head = self._owed[0]
            if head.deadline <= time.perf_counter():
                self.fail(ChainError(f"stage chain failed during {head.what}: no prediction within "
                                     f"{self.env.reply_s:g} s"))
            else:
                self._arm()

    # -- the end --------------------------------------------------------------------------------
    def fail(self, error: Exception, cause: Exception | None = None) -> None:
        """Every wait of this request hears `error` (once)."""
        if self.failed is not None:
            return
        if cause is not None:
            error.__cause__ = cause
        self.failed = error
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.env.runtime.cancel(self.key)
        owed, self._owed = self._owed, deque()
        for waiting in owed:
            waiting.on_reply(error)
        self.on_deferred = None
        if self.on_failure is not None:
            self.on_failure(error)

    def link_broken(self, reason: str) -> None:
        what = self._owed[0].what if self._owed else "the request"
        self.fail(ChainError(f"stage chain failed during {what}: stage at {getattr(self.link, 'endpoint', '?')}: "
                             f"{reason}"))

    def deferred_acked(self) -> None:
        if self.on_deferred is not None:
            self.on_deferred()

    def cancel(self) -> None:
        """The request is over (its consumer left, or it finished): start nothing more, drop
        what is queued, ignore what comes back."""
        self._cancelled = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._owed.clear()
        self.on_deferred = None
        self.env.runtime.cancel(self.key)

    def take_stats(self) -> StageReplyStats:
        self.link.drained()  # the deferred ACKs that came: their stats are the request's
        stats, self.stats = self.stats, StageReplyStats()
        return merge(stats, self.link.take_stats())


class NoStagesBelow:
    """The link of a chain of one stage: nothing goes on the wire, every control message gets an
    ACK with no stats, and stage 0 samples its own steps (Slot.samples_here)."""

    stages_below = False  # a prefix restore is complete at stage 0; nothing overlaps a window
    broken = None
    pending_deferred = 0

    def credit(self) -> bool:
        return True

    def drained(self) -> bool:
        return True

    def send(self, msg: StageMessage, on_ack: Callable[[Reply], None] | None = None) -> None:
        if on_ack is not None:
            on_ack(StageReply.ack(StageReplyStats()))

    def send_step(self, msg, rows, dtype, source, on_ack=None) -> None:
        self.send(msg, on_ack)

    def take_stats(self) -> StageReplyStats:
        return StageReplyStats()

    def close(self) -> None:
        pass
