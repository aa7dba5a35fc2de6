"""One request's session across the whole chain, driven from stage 0.

`ChainSession` computes stage 0's layers in-process and sends each message down
its leased lane; the final stage's predictions come back on the direct return
stream (or, relayed, on the lane). Every wait has a timeout, and any failure
raises `ChainError` naming the stage and the phase. With a single stage (the
driver holds the whole model) the same calls run over `NoStagesBelow`: nothing goes on
the wire, and stage 0's own samples arrive where the return stream's would.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence

from ..protocol import (
    LOOKUP_ERROR, MessageKind, ReplyKind, SamplingConfig, StageMessage, StageReply,
    StageReplyStats, activation_fields, encode_message, lookup_observation, merge,
    prefill_compute_observation, record_observation, restore_missed_below,
)
from ..protocol.constants import activation_dtype_of
from ..protocol.decode_frames import DecodeFrames
from ..protocol.logprobs import TokenLogprob
from ..runtime import SampleMode, SessionKey, Step, StepResult
from ..runtime.engine import StageRuntime
from ..runtime.prefix_identity import cacheable_prefix_length
from ..stage.downstream import DownstreamLink, LinkBroken
from ..stage.measure import LinkCodec
from ..stage.shared_writer import WorkerSend
from .run_ahead import DecodePlan, RunAhead
from ..telemetry import Telemetry

log = logging.getLogger("skippy.driver")


class ChainError(RuntimeError):
    """The chain could not complete a request: a stage died, hung, or refused a message."""


@dataclasses.dataclass(slots=True)
class SessionTimings:
    prefill_s: float = 0.0
    first_token_s: float = 0.0
    decode_s: float = 0.0         # first token to last (set by ChainClient.run)
    decode_steps: int = 0         # plain DecodeEmbd steps (verify windows are counted apart)
    restored_tokens: int = 0      # prompt tokens restored from the chain's prefix caches
    prefilled_tokens: int = 0     # prompt tokens computed (the suffix after a restore)
    restore_s: float = 0.0        # the restore attempt, hit or not
    restore_decision: str = ""    # chain_restore_hit, stage0_miss, downstream_miss_rollback...


@dataclasses.dataclass(frozen=True, slots=True)
class SessionEnv:
    """What every session of one stage 0 shares (the ChainClient builds it once)."""
    runtime: StageRuntime          # stage 0's own layers
    telemetry: Telemetry
    prefill_chunk: int             # prompt tokens per PrefillEmbd chunk (spec §6.4: 256)
    reply_timeout_s: float         # the longest wait for any reply of the chain
    codec: LinkCodec               # the wire dtype of each frame of rows sent to stage 1 (stage/measure.py)


class NoStagesBelow:
    """The link of a chain of one stage: stage 0 holds every layer, so nothing goes on the
    wire. It answers as an empty chain below would: every control an ACK with no stats, every
    frame sent nowhere. Stage 0 samples its own steps and hands each prediction to the
    session's waiter, where the final stage's return stream puts them on a longer chain."""

    stages_below = False  # a prefix restore is complete at stage 0; nothing overlaps a window
    broken = False
    pending_deferred = 0

    async def flush(self) -> None:
        pass

    async def drain(self) -> StageReplyStats:
        return StageReplyStats()

    async def request(self, msg: StageMessage) -> StageReply:
        return StageReply.ack(StageReplyStats())

    async def send(self, msg: StageMessage) -> float:
        return 0.0

    async def forward_async(self, msg: StageMessage) -> None:
        pass

    async def note_deferred(self) -> StageReplyStats:
        return StageReplyStats()

    def idle_writer(self) -> None:
        return None

    def take_edge_stats(self) -> StageReplyStats:
        return StageReplyStats()

    async def close(self) -> None:
        pass


def _frame_fields(tokens: list[int], start: int, decode_step: int, window_id: int | None) -> dict:
    """The header fields of stage 0's frame for a step of `tokens` at `start`."""
    return dict(pos_start=start, token_count=len(tokens), tokens=tokens, current_token=tokens[0],
                decode_step=decode_step, seq_id=window_id or 0)


class ChainSession:
    def __init__(self, env: SessionEnv, link: DownstreamLink | NoStagesBelow, lane_id: int, request_id: int,
                 session_id: int, sampling: SamplingConfig, prompt_token_count: int,
                 cache_namespace: bytes | None = None, skip_draws: int = 0):
        """`link`: the lane to stage 1, or NoStagesBelow when stage 0 holds the whole model.
        `skip_draws`: the sampler draws an earlier session of this request made (a replay)."""
        self.env, self.link = env, link
        self.request_id, self.session_id = request_id, session_id
        self.sampling = sampling
        self.prompt_token_count = prompt_token_count
        self.key = (lane_id, session_id)
        self.skip_draws = skip_draws
        self.draws = 0            # predictions received: one sampler draw each (a window: one a row)
        self.return_key = (request_id, session_id)
        self.position = 0         # the next position to write: what every stage holds
        self.decode_step = 0
        self.stats = StageReplyStats()
        self.stop_ack_stats = StageReplyStats()   # what the Stop ACK itself carried
        self.timings = SessionTimings()
        self.stopped = False
        self.waiter: asyncio.Queue = asyncio.Queue()
        # the logprobs of the last prediction received (one per predicted token; None when the
        # request asked for none), and the prompt's, from the first-token reply (prompt logprobs)
        self.last_logprobs: list[TokenLogprob] | None = None
        self.prompt_logprobs: list[TokenLogprob] | None = None
        self.session = env.runtime.open_session(self.key, request_id)
        self.session.cache_namespace = self.cache_namespace = cache_namespace
        self.codec = env.codec
        self.trace_context: bytes | None = None  # the request's span: every frame's parent
        self._decode_frames: DecodeFrames | None = None
        self._run_ahead: RunAhead | None = None

    @property
    def samples_here(self) -> bool:
        """Stage 0 holds the head: its steps sample, and no rows go down."""
        return not self.link.stages_below

    def _step(self, start: int, tokens: list[int], sample: SampleMode, window_id: int | None = None) -> Step:
        """Stage 0's step of `tokens` at `start`: sampled (`sample`) when it holds the head,
        else its rows in the wire dtype for stage 1."""
        here = self.samples_here
        return Step(self.session, start, len(tokens), tokens, sample=sample if here else SampleMode.NONE,
                    out_dtype=None if here else self.codec.dtype_for(len(tokens)), window_id=window_id)

    def _deliver(self, result: StepResult, window_id: int | None) -> None:
        """A prediction sampled here goes where the return stream puts a final stage's."""
        tokens = result.tokens
        if tokens is not None:
            self.waiter.put_nowait(
                StageReply.token(tokens[0], logprobs=result.logprobs, prompt_logprobs=result.prompt_logprobs)
                if window_id is None else StageReply.window(tokens, window_id, logprobs=result.logprobs))

    def _message(self, kind: MessageKind, rows=None, **fields) -> StageMessage:
        """A message of this session; `rows`: stage 0's output activation it carries (None:
        nothing to carry, or stage 0 sampled the step itself)."""
        if rows is not None:
            fields.update(activation_fields(rows, activation_dtype_of(rows), 0))
        return StageMessage(kind, request_id=self.request_id, session_id=self.session_id,
                            prompt_token_count=self.prompt_token_count, trace_context=self.trace_context,
                            **fields)

    async def _guard(self, phase: str, coro):
        try:
            return await coro
        except LinkBroken as error:
            raise ChainError(f"stage chain failed during {phase}: {error}") from error
        except TimeoutError as error:
            raise ChainError(f"stage chain failed during {phase}: no prediction within "
                             f"{self.env.reply_timeout_s:g} s") from error

    async def _control(self, msg: StageMessage) -> StageReply:
        link = self.link
        await link.flush()
        self.stats = merge(self.stats, await link.drain())
        reply = await link.request(msg)
        self.stats = merge(self.stats, reply.stats)
        return reply

    async def _prediction(self, window_id: int | None = None) -> StageReply:
        while True:
            item = await self._next_reply()
            if isinstance(item, BaseException):
                raise item
            if window_id is None:
                wanted = item.kind == ReplyKind.PredictedToken
            else:
                wanted = item.kind == ReplyKind.PredictedTokens and item.window_id == window_id
            if wanted:
                self.stats = merge(self.stats, item.stats)
                self.draws += len(item.predicted_tokens)
                self.last_logprobs = item.logprobs
                return item
            # else: a late answer to a window that was discarded as stale; ignore it

    async def _next_reply(self) -> StageReply | BaseException:
        if not self.waiter.empty():  # stage 0 sampled it, or it came while stage 0 was busy
            return self.waiter.get_nowait()
        # asyncio.timeout, not wait_for: wait_for wraps the get in a task of its own, one
        # more task switch per token on the decode path
        async with asyncio.timeout(self.env.reply_timeout_s):
            return await self.waiter.get()

    # -- the request's messages -------------------------------------------------------------
    async def configure(self) -> None:
        runtime = self.env.runtime
        await runtime.configure(self.key, self.sampling, self.prompt_token_count, self.skip_draws)
        await self._guard("ConfigureGeneration", self._control(self._message(
            MessageKind.ConfigureGeneration, sampling=self.sampling, cache_namespace=self.cache_namespace,
            decode_step=self.skip_draws)))

    async def prefill(self, tokens: Sequence[int]) -> int:
        """Prefill `tokens` at the current position, in chunks; returns the first prediction.
        A prompt (position 0) first tries a chain restore of its longest cached prefix and
        then prefills only the rest, unless it asks for prompt logprobs: restored rows have no
        logits, so such a prompt is always computed in full (and still recorded)."""
        started = time.perf_counter()
        runtime, link = self.env.runtime, self.link
        if self.position == 0 and runtime.prefix_cache is not None and not self.sampling.prompt_logprobs:
            restored, first = await self._restore(tokens)
            if first is not None:  # TryRestorePrefillDecode: the first token came with it
                self.timings.prefilled_tokens += 1
                self.timings.prefill_s += time.perf_counter() - started
                self.timings.first_token_s = time.perf_counter() - started
                return first
            tokens = tokens[restored:]
        self.timings.prefilled_tokens += len(tokens)
        chunk_size = self.env.prefill_chunk
        sizes = [min(chunk_size, len(tokens) - start) for start in range(0, len(tokens), chunk_size)]
        offset = 0
        for index, size in enumerate(sizes):
            chunk = list(tokens[offset:offset + size])
            is_last = index == len(sizes) - 1
            step = self._step(self.position, chunk, SampleMode.LAST if is_last else SampleMode.NONE)
            timed = await runtime.prefill(step, last=is_last)
            self.stats = merge(self.stats, prefill_compute_observation(0, int(timed.run_s * 1e6),
                                                                      size))
            self.position += size
            offset += size
            kind = MessageKind.PrefillFinalEmbd if is_last else MessageKind.PrefillEmbd
            msg = self._message(kind, timed.value.rows, pos_start=step.start, token_count=size, tokens=chunk)
            if is_last:
                await self._guard("prefill", self._send_predicting(msg))
                self._deliver(timed.value, None)
                # recorded on the worker while the stages below compute (spec §4.3)
                recording = runtime.record_prefix(self.key)
            else:
                await self._guard("prefill", link.forward_async(msg))
                self.stats = merge(self.stats, await self._guard("prefill", link.note_deferred()))
        self.timings.prefill_s += time.perf_counter() - started
        reply = await self._guard("prefill (first token)", self._prediction())
        self.prompt_logprobs = reply.prompt_logprobs
        self.timings.first_token_s = time.perf_counter() - started
        await self._record(recording)
        return reply.predicted

    async def _restore(self, tokens: Sequence[int]) -> tuple[int, int | None]:
        """The chain restore (spec §4.4): restore stage 0's longest cached prefix of the
        prompt's cacheable part, then ask the stages below for exactly that prefix. Keep it
        only if every stage hit; otherwise drop it (each stage below that hit has already
        rolled back) and return 0 for a cold prefill. Returns (restored length, first token).

        When the hit covers the whole cacheable part (all but the last prompt token), it is
        a TryRestorePrefillDecode: the last token's rows ride along, and on a chain hit the
        final stage samples the first token, so restore and first token take one round trip.
        """
        runtime, started = self.env.runtime, time.perf_counter()
        cacheable = list(tokens[:cacheable_prefix_length(len(tokens))])
        with self.env.telemetry.span("stage0.prefix_restore", parent=self.trace_context,
                                     prompt_tokens=len(tokens)) as span:
            try:
                restored = (await runtime.restore_prefix(self.key, cacheable, longest=True)).value
            except Exception as error:  # noqa: BLE001 - a failed restore is a cold prefill
                log.warning("stage 0: prefix restore failed: %s", error)
                runtime.prefix_cache.restore_errors += 1
                restored, decision = 0, "stage0_error"
                self.stats = merge(self.stats, LOOKUP_ERROR)
            else:
                decision = "chain_restore_hit" if restored else "stage0_miss"
                self.stats = merge(self.stats, lookup_observation(0, restored))
            first = None
            below = self.link.stages_below  # else stage 0's hit is the chain's
            fused = bool(restored) and restored == len(cacheable) and below
            if restored and below:
                msg = await self._restore_message(cacheable[:restored], tokens, fused)
                down = (await self._guard(msg.kind.name, self._control(msg))).stats  # merged in
                missed, extra = restore_missed_below(down)
                if missed:
                    self.stats = merge(self.stats, extra)
                    await runtime.rollback_prefix(self.key)
                    restored, decision = 0, "downstream_miss_rollback"
                elif fused:
                    first = (await self._guard("TryRestorePrefillDecode (first token)",
                                               self._prediction())).predicted
            self.position = restored + (first is not None)
            self.timings.restored_tokens = restored
            self.timings.restore_s = time.perf_counter() - started
            self.timings.restore_decision = decision
            span.set("kv_decision", decision)
            span.set("kv_restore_decode", first is not None)
            span.set("kv_restored_tokens", restored)
            span.set("kv_suffix_tokens", len(tokens) - restored)
            span.set("kv_hit_stage_mask", self.stats.kv_hit_stage_mask)
            span.set("restore_ms", self.timings.restore_s * 1e3)
        self.env.telemetry.count(f"stage0.kv_restore.{decision}")
        return restored, first

    async def _restore_message(self, prefix: list[int], tokens: Sequence[int],
                               fused: bool) -> StageMessage:
        if not fused:
            return self._message(MessageKind.TryRestorePrefill, token_count=len(prefix),
                                 tokens=prefix, cache_namespace=self.cache_namespace)
        last = int(tokens[len(prefix)])
        step = Step(self.session, len(prefix), 1, [last], out_dtype=self.codec.dtype_for(1))
        timed = await self.env.runtime.prefill(step)
        return self._message(
            MessageKind.TryRestorePrefillDecode, timed.value.rows, pos_start=len(prefix), token_count=1,
            tokens=prefix + [last], current_token=last, sampling=self.sampling,
            cache_namespace=self.cache_namespace)

    async def _record(self, recording) -> None:
        """Wait for a record submitted to the worker and count it in the request's stats."""
        recorded = (await recording).value
        if recorded.num_entries:
            self.stats = merge(self.stats, record_observation(0, recorded.num_entries, recorded.num_bytes))

    async def _send_predicting(self, msg: StageMessage) -> None:
        link = self.link
        if link.pending_deferred:  # spec §2.6: drain before predictions
            self.stats = merge(self.stats, await link.drain())
        await link.send(msg)

    async def decode(self, token: int, *, pos_start: int | None = None, emitted: int | None = None) -> int:
        """One decode step of `token` at `pos_start` (default: the current position).
        `emitted`: the tokens the request has emitted so far, from a decoder that enabled the
        run-ahead (run_ahead.py): the worker may then start the next step itself."""
        self.position = self.position if pos_start is None else pos_start
        self.decode_step += 1
        ahead = self._run_ahead
        started = None if ahead is None else ahead.take(self.position, token)
        if started is not None:  # the worker ran it as the token came in
            timed, send = await asyncio.wrap_future(started)
            await self._sent(MessageKind.DecodeEmbd, [token], None, timed, send)
        else:
            if ahead is not None:
                if emitted is None:
                    ahead.disarm()
                else:
                    ahead.arm(self.position, emitted, self.decode_step)
            await self._submit(MessageKind.DecodeEmbd, [token], None)
        reply = await self._guard(f"DecodeEmbd step {self.decode_step}", self._prediction())
        self.timings.decode_steps += 1
        return reply.predicted_tokens[0]

    def enable_run_ahead(self, plan: DecodePlan) -> None:
        """Let stage 0's worker start each decode step from its token (run_ahead.py): for a
        decoder of one stream without speculation, on a chain (a single stage has no trip).
        Not when the request asks for logprobs: the final stage's replies then carry them, and
        the worker would take none of them."""
        if self.link.stages_below and self._run_ahead is None and self.sampling.logprobs is None:
            self._run_ahead = RunAhead(plan, self._run_ahead_step, self.waiter.put_nowait,
                                       asyncio.get_running_loop())

    def return_loan(self) -> tuple[StageRuntime, SessionKey, Callable] | None:
        """What the return stream is lent to, while the run-ahead may go on: (stage 0's runtime,
        this session's key, the feed); None when it may not (no run-ahead, other sessions)."""
        ahead, runtime = self._run_ahead, self.env.runtime
        if ahead is None or self.stopped or len(runtime.sessions) != 1:
            return None
        return runtime, self.key, ahead.feed

    def _run_ahead_step(self, token: int, position: int, decode_step: int):
        """On stage 0's worker: the step of `token` at `position`, and its frame's send."""
        return self._outgoing(MessageKind.DecodeEmbd, [token], position, decode_step, None)

    async def submit_verify(self, tokens: Sequence[int], window_id: int, *,
                            pos_start: int | None = None) -> None:
        """Send a VerifyWindow of [current, draft...] (its predictions: `wait_window`). The rows
        stay in every stage's KV provisionally; the next message's `pos_start` (or a
        TrimSession) decides how many of them are kept."""
        self.position = self.position if pos_start is None else pos_start
        await self._submit(MessageKind.VerifyWindow, list(tokens), window_id)

    async def wait_window(self, window_id: int) -> list[int]:
        reply = await self._guard(f"VerifyWindow {window_id}", self._prediction(window_id))
        return reply.predicted_tokens

    async def _submit(self, kind: MessageKind, tokens: list[int], window_id: int | None) -> None:
        """Run stage 0's rows, then send them down (or, holding the head, deliver its predictions)."""
        step, send = self._outgoing(kind, tokens, self.position, self.decode_step, window_id)
        timed = await self.env.runtime.iterate(step, send)
        await self._sent(kind, tokens, window_id, timed, send)

    def _outgoing(self, kind: MessageKind, tokens: list[int], start: int, decode_step: int,
                  window_id: int | None) -> tuple[Step, WorkerSend | None]:
        """A step of stage 0's, and the send that puts its frame on the wire from the worker
        as the forward ends (None: the link is busy, the loop sends it)."""
        step = self._step(start, tokens, SampleMode.LAST if window_id is None else SampleMode.ALL, window_id)
        fields = _frame_fields(tokens, start, decode_step, window_id)
        writer = self.link.idle_writer()
        send = None if writer is None else WorkerSend(
            writer, lambda result: self._encode(kind, result.rows, fields))
        return step, send

    async def _sent(self, kind: MessageKind, tokens: list[int], window_id: int | None, timed,
                    send: WorkerSend | None) -> None:
        """After stage 0's step at the current position: its frame sent, unless the worker did."""
        start = self.position
        self.position = start + len(tokens)
        if not self.samples_here and (send is None or not send.sent):
            msg = self._message(kind, timed.value.rows, **_frame_fields(tokens, start, self.decode_step, window_id))
            await self._guard(f"{kind.name} step {self.decode_step}", self._send_predicting(msg))
        self._deliver(timed.value, window_id)

    def _encode(self, kind: MessageKind, rows, fields: dict) -> bytes:
        """A step's frame; a one-token decode step's from the session's template
        (protocol/decode_frames.py), made from its first."""
        if kind != MessageKind.DecodeEmbd or fields["token_count"] != 1:
            return encode_message(self._message(kind, rows, **fields))
        frames = self._decode_frames
        if frames is None or not frames.matches(self.trace_context, rows):
            frames = self._decode_frames = DecodeFrames(self._message(kind, rows, **fields))
        return frames.encode(fields["pos_start"], fields["decode_step"], fields["current_token"], rows)

    async def end_run_ahead(self) -> None:
        """Start no step ahead any more, and wait for those the worker is running."""
        if self._run_ahead is not None:
            for started in self._run_ahead.disarm():
                try:
                    await asyncio.wrap_future(started)
                except Exception:  # noqa: BLE001 - its request is over; Stop or the drop follows
                    pass

    async def retire(self, start: int, count: int, *, wait: bool = True) -> None:
        """RetireVerifyWindow on every stage. `wait` False does not wait for stage 0's own
        worker (busy with a run-ahead window, say): only for a range no later window uses."""
        msg = self._message(MessageKind.RetireVerifyWindow, pos_start=start, token_count=count)
        await self._guard("RetireVerifyWindow", self.link.send(msg))
        retiring = asyncio.ensure_future(self.env.runtime.retire(self.key, start, count))
        if wait:
            await retiring
        else:  # a session already stopped has nothing left to retire
            retiring.add_done_callback(lambda f: f.cancelled() or f.exception())

    async def discard_windows(self, low: int, high: int) -> None:
        self.session.discard_windows(low, high)
        msg = self._message(MessageKind.DiscardStaleWindows, tokens=[low, high])
        await self._guard("DiscardStaleWindows", self.link.send(msg))

    async def trim(self, num_tokens: int) -> None:
        await self.env.runtime.trim(self.key, num_tokens)
        self.position = num_tokens
        await self._guard("TrimSession", self._control(self._message(
            MessageKind.TrimSession, token_count=num_tokens)))

    async def stop(self) -> StageReplyStats:
        """End the session on every stage; returns the request's merged stats."""
        await self.end_run_ahead()  # a step run ahead goes down before Stop does
        if self.key in self.env.runtime.sessions:  # the full-prefill record (spec §4.3)
            await self._record(self.env.runtime.record_prefix(self.key))
        reply = await self._guard("Stop", self._control(self._message(MessageKind.Stop)))
        self.stop_ack_stats = reply.stats
        self.stats = merge(self.stats, self.link.take_edge_stats())
        self.stopped = True
        return self.stats
