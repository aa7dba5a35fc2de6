"""One request's session across the whole chain, driven from stage 0: the event loop's half.

`ChainSession` sends the request's control messages down its leased lane and awaits their
ACKs, and starts what runs on stage 0's engine (driver/slot.py, driver/decoder.py), hearing
back predictions and tokens as events. Any failure raises `ChainError` naming the phase.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence

from ..protocol import (
    LOOKUP_ERROR, MessageKind, SamplingConfig, StageMessage, StageReply, StageReplyStats,
    lookup_observation, merge, record_observation, restore_missed_below,
)
from ..runtime.prefix_identity import cacheable_prefix_length
from ..stage.engine import Engine
from ..stage.returns import ReturnInbox
from ..telemetry import Telemetry
from .decoder import DONE, ChainDecoder, Emitted, paired
from .slot import ChainError, NoStagesBelow, Slot, SlotEnv

log = logging.getLogger("skippy.driver")


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
    slots: SlotEnv
    telemetry: Telemetry
    inbox: ReturnInbox  # the return streams' predictions, by request

    @property
    def engine(self) -> Engine:
        return self.slots.engine


class ChainSession:
    def __init__(self, env: SessionEnv, lane, request_id: int, session_id: int, sampling: SamplingConfig,
                 prompt_token_count: int, cache_namespace: bytes | None = None, skip_draws: int = 0,
                 trace_context: bytes | None = None):
        """`lane`: the leased lane (driver/client.py: its link to stage 1, or NoStagesBelow).
        `skip_draws`: the sampler draws an earlier session of this request made (a replay)."""
        self.env, self.lane = env, lane
        self.request_id, self.session_id = request_id, session_id
        self.sampling, self.prompt_token_count = sampling, prompt_token_count
        self.cache_namespace, self.skip_draws, self.trace_context = cache_namespace, skip_draws, trace_context
        self.key = (lane.lane_id if lane.link.stages_below else 0, session_id)
        self.stats = StageReplyStats()
        self.stop_ack_stats = StageReplyStats()   # what the Stop ACK itself carried
        self.timings = SessionTimings()
        self.stopped = False
        self.position = 0         # where the next step goes (the message API's default pos_start)
        self.prompt_logprobs = None  # the first-token reply's, when the request asks for them
        self.first_reply: StageReply | None = None
        self.slot: Slot | None = None
        self._windows: dict[int, asyncio.Future] = {}
        self._restore_ack: asyncio.Future | None = None

    @property
    def draws(self) -> int:
        """The final stage's sampler draws for this session: one a prediction (a window: one a row)."""
        return self.slot.draws

    async def open(self) -> None:
        """The request's slot on stage 0's engine, holding the lane."""
        env, lane = self.env, self.lane

        def open_slot() -> Slot:
            slot = Slot(env.slots, lane.link, self.key[0], self.request_id, self.session_id, self.sampling,
                        self.prompt_token_count, self.trace_context)
            slot.session.cache_namespace = self.cache_namespace
            lane.slot = slot  # the predictions relayed up the lane
            env.inbox.handlers[(self.request_id, self.session_id)] = slot.on_reply  # those on the return stream
            return slot

        self.slot = await env.engine.call(open_slot)

    # -- talking to the engine --------------------------------------------------------------------
    def _on_loop(self, future: asyncio.Future) -> Callable[[object], None]:
        """A callback for the engine that settles `future` on the event loop."""
        engine = self.env.engine
        return lambda value: engine.settle(future, value)

    def _post(self, start: Callable[[Slot, Callable[[object], None]], None]) -> asyncio.Future:
        """start(slot, settle) on stage 0's engine; the future `settle` sets here."""
        future = asyncio.get_running_loop().create_future()
        slot, settle = self.slot, self._on_loop(future)
        self.env.engine.post(lambda: start(slot, settle))
        return future

    @staticmethod
    def _acked(reply: StageReply | Exception, what: str) -> StageReply:
        if isinstance(reply, Exception):
            raise ChainError(f"stage chain failed during {what}: {reply}") from reply
        return reply

    async def _request(self, msg: StageMessage) -> StageReply:
        """A control round trip: `msg` down the lane, its ACK back (merged into the stats)."""
        def send(slot: Slot, on_ack) -> None:
            try:
                slot.link.send(msg, on_ack)
            except ConnectionError as error:
                on_ack(error)

        reply = self._acked(await self._post(send), msg.kind.name)
        self.stats = merge(self.stats, reply.stats)
        return reply

    async def _prediction(self, future: asyncio.Future) -> StageReply:
        reply = await future
        if isinstance(reply, Exception):
            if isinstance(reply, ChainError):
                raise reply
            raise ChainError(f"stage chain failed: {reply}") from reply
        return reply

    # -- the request's messages ---------------------------------------------------------------------
    async def configure(self) -> None:
        slot = self.slot
        await self.env.engine.call(lambda: self.env.slots.runtime.configure(
            slot.key, self.sampling, self.prompt_token_count, self.skip_draws))
        await self._request(self.slot.message(MessageKind.ConfigureGeneration, sampling=self.sampling,
                                          cache_namespace=self.cache_namespace, decode_step=self.skip_draws))

    async def prefill(self, tokens: Sequence[int]) -> int:
        """Prefill `tokens` at the current position; returns the first prediction. A prompt
        first tries a chain restore of its longest cached prefix, unless it asks for prompt
        logprobs (restored rows have no logits)."""
        started = time.perf_counter()
        runtime = self.env.slots.runtime
        if self.position == 0 and runtime.prefix_cache is not None and not self.sampling.prompt_logprobs:
            restored, first = await self._restore(tokens)
            if first is not None:  # TryRestorePrefillDecode: the first token came with it
                self.timings.prefilled_tokens += 1
                self.timings.prefill_s += time.perf_counter() - started
                self.timings.first_token_s = time.perf_counter() - started
                return self._first(first)
            tokens = tokens[restored:]
        self.timings.prefilled_tokens += len(tokens)
        start = self.position

        def prefill(slot: Slot, on_first) -> None:
            slot.position = start
            slot.prefill(tokens, on_first)

        future = self._post(prefill)
        self.position = start + len(tokens)
        reply = await self._prediction(future)
        self.timings.prefill_s += time.perf_counter() - started
        self.timings.first_token_s = time.perf_counter() - started
        self.prompt_logprobs = reply.prompt_logprobs
        return self._first(reply)

    def _first(self, reply: StageReply) -> int:
        self.first_reply = reply
        return reply.predicted

    async def settled(self) -> None:
        """Wait for what a prompt's first token did not wait for: the ACK of the restore that
        brought it (its stats are the request's, spec §4.4)."""
        if self._restore_ack is not None:
            ack, self._restore_ack = self._restore_ack, None
            await ack

    async def _restore(self, tokens: Sequence[int]) -> tuple[int, StageReply | None]:
        """The chain restore (spec §4.4): stage 0's longest cached prefix, then exactly that
        prefix on the stages below, kept only if every stage hit (else 0: a cold prefill).
        Returns (restored length, first reply). A hit on the whole cacheable part is a
        TryRestorePrefillDecode: the last token rides along and the first token comes back
        before the ACKs climb the chain."""
        env, slot, started = self.env, self.slot, time.perf_counter()
        runtime = env.slots.runtime
        cacheable = list(tokens[:cacheable_prefix_length(len(tokens))])
        span = env.telemetry.start_span("stage0.prefix_restore", parent=self.trace_context, prompt_tokens=len(tokens))
        try:
            restored = await env.engine.call(lambda: runtime.restore_prefix(slot.key, cacheable, longest=True))
        except Exception as error:  # noqa: BLE001 - a failed restore is a cold prefill
            log.warning("stage 0: prefix restore failed: %s", error)
            runtime.prefix_cache.restore_errors += 1
            restored, decision = 0, "stage0_error"
            self.stats = merge(self.stats, LOOKUP_ERROR)
        else:
            decision = "chain_restore_hit" if restored else "stage0_miss"
            self.stats = merge(self.stats, lookup_observation(0, restored))
        first = None
        below = self.lane.link.stages_below  # else stage 0's hit is the chain's
        if restored and below:
            if restored == len(cacheable):
                missed, first = await self._restore_decode(cacheable, tokens, span)
            else:
                down = (await self._request(self.slot.message(
                    MessageKind.TryRestorePrefill, token_count=restored, tokens=cacheable[:restored],
                    cache_namespace=self.cache_namespace))).stats
                missed, extra = restore_missed_below(down)
                self.stats = merge(self.stats, extra) if missed else self.stats
            if missed:
                await env.engine.call(lambda: runtime.rollback_prefix(slot.key))
                restored, decision = 0, "downstream_miss_rollback"
        self.position = restored + (first is not None)
        self.timings.restored_tokens = restored
        self.timings.restore_s = time.perf_counter() - started
        self.timings.restore_decision = decision
        span.set("kv_decision", decision)
        span.set("kv_restore_decode", first is not None)
        span.set("kv_restored_tokens", restored)
        span.set("kv_suffix_tokens", len(tokens) - restored)
        span.set("restore_ms", self.timings.restore_s * 1e3)

        def finish(_=None) -> None:
            span.set("kv_hit_stage_mask", self.stats.kv_hit_stage_mask)
            span.end()

        if self._restore_ack is None:
            finish()
        else:
            self._restore_ack.add_done_callback(finish)
        env.telemetry.count(f"stage0.kv_restore.{decision}")
        return restored, first

    async def _restore_decode(self, prefix: list[int], tokens: Sequence[int], span) -> tuple[bool, StageReply | None]:
        """TryRestorePrefillDecode: stage 0's row of the last prompt token rides along; the
        first of the first token (a chain hit) and the ACK (a hit or a miss) decides."""
        loop = asyncio.get_running_loop()
        predicted, acked = loop.create_future(), loop.create_future()
        slot, last, start = self.slot, int(tokens[len(prefix)]), len(prefix)
        msg = slot.message(MessageKind.TryRestorePrefillDecode, pos_start=start, token_count=1,
                           tokens=prefix + [last], current_token=last, sampling=self.sampling,
                           cache_namespace=self.cache_namespace)
        on_reply, on_ack = self._on_loop(predicted), self._on_loop(acked)
        self.env.engine.post(lambda: slot.restore_decode(msg, last, start, on_reply, on_ack))
        await asyncio.wait([predicted, acked], return_when=asyncio.FIRST_COMPLETED)
        if predicted.done():  # the chain hit: decode from here; the ACK's stats join later
            first = await self._prediction(predicted)
            self._restore_ack = loop.create_task(self._restore_acked(acked))
            return False, first
        reply = self._acked(acked.result(), "TryRestorePrefillDecode")
        missed, extra = restore_missed_below(reply.stats)
        self.stats = merge(self.stats, merge(reply.stats, extra) if missed else reply.stats)
        if missed:
            await self.env.engine.call(slot.forget_prediction)
            return True, None
        return False, await self._prediction(predicted)

    async def _restore_acked(self, acked: asyncio.Future) -> None:
        self.stats = merge(self.stats, self._acked(await acked, "TryRestorePrefillDecode").stats)

    async def decode(self, token: int, *, pos_start: int | None = None) -> int:
        """One decode step of `token` at `pos_start` (default: the current position)."""
        position = self.position if pos_start is None else pos_start
        future = self._post(lambda slot, on_reply: slot.decode(token, position, on_reply))
        self.position = position + 1
        reply = await self._prediction(future)
        self.timings.decode_steps += 1
        return reply.predicted_tokens[0]

    async def submit_verify(self, tokens: Sequence[int], window_id: int, *, pos_start: int | None = None) -> None:
        """Send a VerifyWindow of [current, draft...] (its predictions: `wait_window`)."""
        base = self.position if pos_start is None else pos_start
        tokens = list(tokens)
        self._windows[window_id] = self._post(lambda slot, on_reply: slot.verify(tokens, window_id, base, on_reply))
        self.position = base + len(tokens)

    async def wait_window(self, window_id: int) -> list[int]:
        return (await self._prediction(self._windows.pop(window_id))).predicted_tokens

    async def retire(self, start: int, count: int) -> None:
        """RetireVerifyWindow on every stage."""
        await self.env.engine.call(lambda: self.slot.retire(start, count))

    async def discard_windows(self, low: int, high: int) -> None:
        await self.env.engine.call(lambda: self.slot.discard(low, high))

    async def trim(self, num_tokens: int) -> None:
        slot = self.slot
        await self.env.engine.call(lambda: self.env.slots.runtime.trim(slot.key, num_tokens))
        self.position = num_tokens
        await self._request(self.slot.message(MessageKind.TrimSession, token_count=num_tokens))

    # -- the decode loop ---------------------------------------------------------------------------
    def decode_loop(self, decoder: ChainDecoder, prompt: Sequence[int] | None = None) -> AsyncIterator[Emitted]:
        """Start the decode loop on stage 0's engine (decoder.py) now; the tokens to emit come
        back as they settle, starting with the prefill's. `prompt` None: a replay's resume
        (the prefill was `decoder.replay_tokens()`)."""
        queue: asyncio.Queue = asyncio.Queue()
        engine, slot, first, loop = self.env.engine, self.slot, self.first_reply, asyncio.get_running_loop()

        def emit(item) -> None:  # the loop's work for a token runs while the next step computes
            engine.emit_after_forward(queue.put_nowait, item, loop=loop)

        if prompt is None:
            engine.post(lambda: decoder.resume(slot, emit, first))
        else:
            prompt = list(prompt)
            engine.post(lambda: decoder.start(slot, emit, prompt, first))
        return self._emitted(queue)

    async def _emitted(self, queue: asyncio.Queue) -> AsyncIterator[Emitted]:
        try:
            while (item := await queue.get()) is not DONE:
                if isinstance(item, Exception):
                    raise item
                for emitted in item:
                    yield emitted
        finally:
            self.timings.decode_steps = self.slot.decode_step

    async def stop(self) -> StageReplyStats:
        """End the session on every stage; returns the request's merged stats."""
        slot, runtime = self.slot, self.env.slots.runtime

        def wind_down():
            slot.cancel()  # nothing more starts; a step already sent goes down before Stop
            if slot.key in runtime.sessions:  # the full-prefill record (spec §4.3)
                return runtime.record_prefix(slot.key)
            return None

        recorded = await self.env.engine.call(wind_down)
        if recorded is not None and recorded.num_entries:
            self.stats = merge(self.stats, record_observation(0, recorded.num_entries, recorded.num_bytes))
        await self.settled()
        reply = await self._request(self.slot.message(MessageKind.Stop))
        self.stop_ack_stats = reply.stats
        self.stats = merge(self.stats, await self.env.engine.call(slot.take_stats))
        self.stopped = True
        return self.stats


__all__ = ["ChainError", "ChainSession", "NoStagesBelow", "SessionEnv", "SessionTimings", "paired"]
