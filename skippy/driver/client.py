"""Stage 0: `ChainClient` drives generation down a chain of stages (spec §1.2).

It owns the first stage's layers on their engine thread, a pool of persistent lanes to stage
1 (one leased per request; a broken lane is replaced on its next lease) and the listener the
final stage returns predictions to. `run` is the one orchestration of a request, and lives
through a chain that breaks and heals under it.

    client = ChainClient(first_stage_model, downstream="127.0.0.1:7001")
    await client.start()
    result = await client.generate(prompt_ids, max_tokens=64, stop_ids=tokenizer.eog_ids)
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from ..model.grammar import GrammarCompiler
from ..model.llama import StageModel
from ..protocol import LinkConditioning, SamplingConfig, StageReplyStats, Timeouts, TlsConfig
from ..protocol.sampling_config import GrammarSpec
from ..protocol.stage_metrics import StageMetricValues
from ..runtime.batch_policy import BatchSettings
from ..runtime.proposers import create_proposer
from ..runtime.speculation import SpeculativeSettings
from ..runtime.stage_cache import StagePrefixCache
from ..runtime.stage_runtime import StageRuntime
from ..stage.downlink import DownLink
from ..stage.engine import Engine, EngineClosed
from ..stage.holder import TensorHolder
from ..stage.returns import ReturnInbox, ReturnListener
from ..stage.transport import LinkBroken, Transport
from ..tasks import to_the_end
from ..stage.measure import StageMeasurement
from ..telemetry import Span, Telemetry
from .backend import Finished, GenerationEvent, PrefillDone, Token
from .decoder import ChainDecoder
from .session import ChainSession, SessionEnv, SessionTimings
from .slot import ChainError, NoStagesBelow, Slot, SlotEnv

# verify-window outcomes on the request's span and summary line (ChainDecoder.report's names)
SPAN_SPECULATION = ("speculative_num_windows", "speculative_num_proposed_tokens", "speculative_num_accepted_tokens",
                    "speculative_num_full_accept_windows", "speculative_num_rejected_windows",
                    "speculative_stale_windows", "speculative_acceptance_rate")
log = logging.getLogger("skippy.driver")
RECOVERY_RETRY_S = 0.5     # between a broken request's tries to lease a lane through the whole chain


@dataclass(frozen=True, slots=True)
class GenerationResult:
    tokens: list[int]             # generated ids, without the stop id
    finish_reason: str            # "stop", "length" or "context"
    prompt_tokens: int
    stats: StageReplyStats        # merged over every reply of the chain
    timings: SessionTimings
    speculation: dict = field(default_factory=dict)  # ChainDecoder.report(); {} when off


@dataclass(slots=True)
class Lane:
    """A lane of stage 0's pool: its link to stage 1 (the engine's) and the slot leasing it."""
    lane_id: int
    link: DownLink | NoStagesBelow | None = None  # None until dialed
    slot: Slot | None = None   # the request holding the lease (set on the engine)

    # the link's callbacks, on the engine: for the request that holds the lane
    def relayed(self, reply) -> None:
        if self.slot is not None:
            self.slot.on_reply(reply)

    def deferred(self) -> None:
        if self.slot is not None:
            self.slot.deferred_acked()

    def broken(self, reason: str) -> None:
        if self.slot is not None:
            self.slot.link_broken(reason)


class ChainClient:
    def __init__(self, model: StageModel, *, downstream: str | Sequence[str] | None = None,
                 auth_token: str | None = None, return_bind: str = "127.0.0.1:0",
                 concurrency: int = 1, ctx_size: int | None = None,
                 activation_dtype: str = "f32", prefill_chunk: int = 256,
                 reply_credit_limit: int = 3,
                 timeouts: Timeouts = Timeouts(), tls: TlsConfig | None = None,
                 link_conditioning: LinkConditioning | None = None,
                 telemetry: Telemetry | None = None, record_logits: bool = False,
                 batch: BatchSettings = BatchSettings(),
                 prefix_cache: StagePrefixCache | None = None,
                 speculative: SpeculativeSettings = SpeculativeSettings(),
                 draft_model: StageModel | None = None,
                 grammars: GrammarCompiler | None = None, holder: TensorHolder | None = None,
                 wait_for_chain: Callable[[Transport], Awaitable[None]] | None = None):
        """`speculative`: a request's default speculative decoding; `draft_model`: the small
        model the "draft" proposer runs here (shared, each request with its own KV).
        `grammars`: None refuses requests with a grammar. `holder`: serves this process's
        model file to stages that fetch their layers (stage/holder.py). `wait_for_chain`:
        awaited before the lanes dial, so stages still fetching or loading are waited for."""
        if not model.layers.is_first:
            raise ValueError(f"Expected the first stage's layers [0, k), got {model.layers}")
        if (downstream is None) != model.layers.is_last:
            raise ValueError("Expected a downstream stage exactly when the driver does not hold "
                             f"the last layer; got layers {model.layers}, downstream {downstream!r}")
        if prefill_chunk < 1:
            raise ValueError(f"Expected a prefill chunk of >= 1 tokens, got {prefill_chunk}")
        self.downstream = downstream  # stage 1's endpoint, or it and its standbys in the order to try
        self.reply_credit_limit = reply_credit_limit
        self.timeouts = timeouts
        # False once the chain cannot heal (a supervisor gave up on a stage): fail at once
        self.can_recover: Callable[[], bool] = lambda: True
        self._chain_back = asyncio.Event()  # set (and replaced) by chain_changed: waiting requests try now
        self.successor: ChainClient | None = None  # stage 0 of the chain started again on another split
        self.retiring = False  # that chain is starting: dial nothing (its stage 1 may be where ours was)
        self.telemetry = telemetry or Telemetry("skippy-stage0")
        self.transport = Transport(tls_identity=tls, auth_token=auth_token, conditioning=link_conditioning,
                                   timeouts=timeouts)
        self.runtime = StageRuntime(model, lane_count=concurrency, ctx_size=ctx_size, telemetry=self.telemetry,
                                    batch=batch, record_logits=record_logits, prefix_cache=prefix_cache,
                                    grammars=grammars)
        self.grammars = grammars
        self.ctx_size = self.runtime.ctx_size
        self.prefill_chunk = prefill_chunk
        # stage 0's forward and its link to stage 1, measured once it is up (stage/measure.py)
        self.measurement = StageMeasurement(self.runtime, activation_dtype=activation_dtype,
                                            transport=self.transport, downstream=downstream)
        self.speculative, self.draft_model = speculative, draft_model
        self.check_speculative(speculative)
        self.return_bind, self.holder, self.wait_for_chain = return_bind, holder, wait_for_chain
        self.return_endpoint: str | None = None
        self.engine: Engine | None = None
        self.inbox: ReturnInbox | None = None
        self.listener: ReturnListener | None = None
        self.env: SessionEnv | None = None
        self._lanes: asyncio.Queue[Lane] = asyncio.Queue()
        self._all_lanes: list[Lane] = []
        self.num_lanes = concurrency  # the one bound on requests at once: the API's admission is checked against it
        self._ids = itertools.count(secrets.randbits(40) << 16)  # unique across drivers

    async def start(self) -> None:
        """Start stage 0's engine, open the return listener and preconnect the lane pool (spec §3.2)."""
        self.engine = Engine(self.runtime, asyncio.get_running_loop(), name="skippy-stage0",
                             join_timeout_s=self.timeouts.shutdown_s)
        self.engine.on_close(self._close_sockets)
        self.engine.start()
        self.inbox = ReturnInbox(self.engine)
        self.env = SessionEnv(SlotEnv(self.engine, self.runtime, self.prefill_chunk, self.timeouts.reply_s,
                                      self.measurement.codec), self.telemetry, self.inbox)
        if self.downstream is not None:
            self.listener = ReturnListener(self.inbox, self.transport, self.return_bind, holder=self.holder)
            self.return_endpoint = await self.listener.start()
            if self.wait_for_chain is not None:
                await self.wait_for_chain(self.transport)
        for lane_id in range(1, self.num_lanes + 1):
            lane = Lane(lane_id, NoStagesBelow() if self.downstream is None else None)
            self._all_lanes.append(lane)
            if self.downstream is not None:
                await self._connect(lane)
            self._lanes.put_nowait(lane)
        self.measurement.start(self.engine.call)

    async def _connect(self, lane: Lane) -> None:
        sock, endpoint = await self.transport.dial(self.downstream)
        engine, transport = self.engine, self.transport

        def attach() -> None:
            lane.link = DownLink(engine, sock, endpoint=endpoint, stage_index=0, max_deferred=self.reply_credit_limit,
                                 reply_s=self.timeouts.reply_s, on_prediction=lane.relayed, on_broken=lane.broken,
                                 on_deferred=lane.deferred, conditioner=transport.conditioner())

        await engine.call(attach)

    @contextlib.asynccontextmanager
    async def session(self, sampling: SamplingConfig = SamplingConfig(),
                      prompt_token_count: int = 0, cache_namespace: bytes | None = None,
                      skip_draws: int = 0, trace_context: bytes | None = None) -> AsyncIterator[ChainSession]:
        """Lease a lane, configure generation, yield the session, Stop it (or drop the lane).
        `trace_context`: the request's span, which every frame of the session names as parent."""
        if self.retiring:
            raise ChainError("the chain is starting again on another split")
        lane = await self._lanes.get()
        session = None
        try:
            if self.downstream is not None and (lane.link is None or lane.link.broken):
                await self._replace(lane)
            request_id = next(self._ids)
            session = ChainSession(self.env, lane, request_id, request_id, sampling, prompt_token_count,
                                   cache_namespace, skip_draws, trace_context)
            await session.open()
            await session.configure()
            yield session
            if not session.stopped:
                await session.stop()
        finally:
            await to_the_end(self._release(lane, session))

    async def _replace(self, lane: Lane) -> None:
        if lane.link is not None:
            link = lane.link
            await self.engine.call(link.close)
        try:
            await self._connect(lane)
        except LinkBroken as error:
            raise ChainError(f"no lane to the chain: {error}") from error
        self.telemetry.count("stage.openai_downstream_lane_replaced")
        log.info("lane %d replaced", lane.lane_id)

    async def _release(self, lane: Lane, session: ChainSession | None) -> None:
        slot = None if session is None else session.slot
        close_link = session is not None and not session.stopped and isinstance(lane.link, DownLink)

        def release() -> None:
            if slot is not None:
                slot.cancel()
                self.inbox.handlers.pop((slot.request_id, slot.session_id), None)
                if slot.key in self.runtime.sessions:
                    self.runtime.drop(slot.key)
            lane.slot = None
            if close_link:
                # Mid-request failure: the lane's state is unknown. Closing it makes every
                # stage reclaim the session; the next lease dials a fresh lane.
                lane.link.close()

        try:
            await self.engine.call(release)
        except EngineClosed:
            pass
        self._lanes.put_nowait(lane)

    def check_speculative(self, settings: SpeculativeSettings) -> None:
        """ValueError when this client cannot run `settings` (a draft mode without a model)."""
        if settings.mode == "draft" and self.draft_model is None:
            raise ValueError("Expected a draft model for speculative mode 'draft'; start with "
                             "--draft-model PATH, or pick an n-gram mode")

    def check_grammar(self, grammar: GrammarSpec) -> None:
        """ValueError (a GrammarError) saying why `grammar` cannot constrain a request here.
        It compiles, so a request that passes finds its grammar cached on a one-stage chain."""
        if self.grammars is None:
            raise ValueError("this server has no grammar engine: constrained decoding is off")
        self.grammars.check(grammar)

    def decoder(self, *, max_tokens: int, stop_ids: Sequence[int],
                speculative: SpeculativeSettings | None = None) -> ChainDecoder:
        """The decode loop for one request, with a fresh proposer when it speculates
        (`speculative` None: the client's default)."""
        settings, proposer = self.speculative if speculative is None else speculative, None
        if settings.is_enabled:
            self.check_speculative(settings)
            options = (dict(model=self.draft_model, ctx_size=self.ctx_size) if settings.mode == "draft"
                       else settings.proposer_options())
            proposer = create_proposer(settings.mode, **options)
        return ChainDecoder(max_tokens=max_tokens, stop_ids=frozenset(stop_ids), ctx_size=self.ctx_size,
                            proposer=proposer, settings=settings)

    async def local_status(self) -> tuple[int, StageMetricValues]:
        """Stage 0's open sessions and metrics, as its engine sees them."""
        runtime = self.runtime
        return await self.engine.call(lambda: (len(runtime.sessions),
                                               runtime.metric_values(connections=self.num_lanes)))

    async def run(self, prompt_ids: Sequence[int], *, request_id: str = "",
                  **options) -> AsyncIterator[GenerationEvent]:
        """`_run` inside the request's root span, which every frame names as parent, so each
        stage's spans join one trace. `request_id`: the API's id, on the span and summary line."""
        with self.telemetry.span("stage0.request", request_id=request_id) as root:
            async with contextlib.aclosing(self._run(prompt_ids, root=root, **options)) as events:
                async for event in events:
                    yield event

    async def _run(self, prompt_ids: Sequence[int], *, root: Span, max_tokens: int = 256,
                   sampling: SamplingConfig = SamplingConfig(), stop_ids: Sequence[int] = (),
                   cache_namespace: bytes | None = None,
                   speculative: SpeculativeSettings | None = None) -> AsyncIterator[GenerationEvent]:
        """One request as events (PrefillDone -> Token* -> Finished). A consumer that leaves
        early still gets the session stopped on every stage (or its lane closed).

        When the chain breaks under the request, it waits up to `timeouts.recovery_s` for the
        chain to be whole, replays the prompt and every committed token on a fresh lane and
        decodes on: the output is the same as without the break, seeded sampling included
        (the new sampler skips the draws the old one made)."""
        if not prompt_ids:
            raise ValueError("Expected a non-empty prompt")
        if len(prompt_ids) > self.ctx_size:
            raise ValueError(f"Expected a prompt of at most {self.ctx_size} tokens (the context "
                             f"size), got {len(prompt_ids)}. Fix: shorten it or raise ctx_size.")
        self.check_speculative(self.speculative if speculative is None else speculative)
        recovery_s = self.timeouts.recovery_s
        decoder, timings, first_token_at, started = None, None, 0.0, time.perf_counter()
        num_tokens, recoveries, recover_by, waiting, draws = 0, 0, None, False, 0
        while True:
            client = self.current  # after a re-split (hand_over), its new stage 0
            try:
                async with client.session(sampling, len(prompt_ids), cache_namespace, draws,
                                          root.traceparent) as session:
                    if decoder is None or not decoder.is_started:
                        decoder = self.decoder(max_tokens=max_tokens, stop_ids=stop_ids, speculative=speculative)
                        await session.prefill(prompt_ids)
                        first_token_at = time.perf_counter()
                        timings = session.timings  # the one clock: usage, `timings`, metrics, logs
                        tokens = session.decode_loop(decoder, prompt_ids)  # decoding starts at once ...
                        await session.settled()  # ... while the restore's ACK is still on its way
                        yield PrefillDone(len(prompt_ids), timings.restored_tokens, timings.first_token_s * 1e3,
                                          timings.restore_decision, session.stats.kv_hit_stage_mask,
                                          session.prompt_logprobs)
                    else:
                        await session.prefill(decoder.replay_tokens())
                        tokens = session.decode_loop(decoder)
                        log.warning("request %d: resumed on a fresh lane after %d token(s)",
                                    session.request_id, num_tokens)
                    if waiting:  # through a whole chain again, and prefilled: one break survived
                        waiting, recover_by, recoveries = False, None, recoveries + 1
                        self.telemetry.count("stage0.recoveries")
                    try:
                        async with contextlib.aclosing(tokens) as stream:
                            async for token, logprob in stream:
                                num_tokens += 1
                                yield Token(token, logprob)
                        timings.decode_s = time.perf_counter() - first_token_at  # first token to last
                        stop_started = time.perf_counter()
                        try:
                            stats = await session.stop()
                        except ChainError as error:  # every token is out: the answer stands
                            log.warning("request %d: Stop failed (%s); the stages reclaim the session",
                                        session.request_id, error)
                            stats = session.stats
                        speculation = decoder.report(self.telemetry)
                        # the request's one line: its trace id leads to every stage's spans
                        figures = dict(
                            prompt_tokens=len(prompt_ids), cached_tokens=timings.restored_tokens,
                            completion_tokens=num_tokens, finish_reason=decoder.finish_reason,
                            ttft_ms=(first_token_at - started) * 1e3, prefill_ms=timings.prefill_s * 1e3,
                            first_token_ms=timings.first_token_s * 1e3, decode_ms=timings.decode_s * 1e3,
                            tokens_per_s=(num_tokens - 1) / timings.decode_s if timings.decode_s > 0 else 0.0,
                            kv_decision=timings.restore_decision or "none", recoveries=recoveries,
                            stop_ms=(time.perf_counter() - stop_started) * 1e3,
                            **{key: speculation[key] for key in SPAN_SPECULATION if key in speculation})
                        for key, value in figures.items():
                            root.set(key, value)
                        self.telemetry.summary("stage0.generation_summary", trace_id=root.trace_id or "none",
                                               request_id=root.attrs["request_id"], **figures)
                        extra = {**_timing_extras(stats, timings), **speculation, "chain_recoveries": recoveries}
                        yield Finished("stop" if decoder.finish_reason == "stop" else "length", num_tokens,
                                       timings.decode_s * 1e3, extra, decoder.finish_reason, stats, timings,
                                       speculation)
                        return
                    finally:
                        draws = session.skip_draws + session.draws  # what a replay's sampler skips
                        if not session.stopped:  # left early, or broken: its figures still go out
                            decoder.report(self.telemetry)
                            await _stop_quietly(session, self.timeouts.stop_s)
            except ChainError as error:
                now = time.monotonic()
                recover_by = recover_by or now + recovery_s
                if not client.can_recover():
                    raise ChainError(f"{error} (a stage is down for good)") from error
                if now >= recover_by:
                    if recovery_s > 0:
                        raise ChainError(f"{error} (not whole again within {recovery_s:g} s)") from error
                    raise
                if not waiting:
                    waiting = True
                    log.warning("the chain broke under a request (%s); waiting for it to be whole again", error)
                with contextlib.suppress(TimeoutError):  # the next try: in a while, or once a stage is back
                    await asyncio.wait_for(client._chain_back.wait(), RECOVERY_RETRY_S)

    def chain_changed(self) -> None:
        """A stage is back (restarted, or moved): requests waiting for the chain try again now."""
        self._chain_back.set()
        self._chain_back = asyncio.Event()

    def hand_over(self, successor: ChainClient) -> None:
        """The chain was started again on another split, `successor` its stage 0: a request
        waiting here for the chain goes on there, replayed as after any break."""
        self.successor = successor
        self.chain_changed()

    @property
    def current(self) -> ChainClient:
        """This client, or the stage 0 it handed its requests over to."""
        client = self
        while client.successor is not None:
            client = client.successor
        return client

    @property
    def idle(self) -> bool:
        """No lane leased: no request is on this client's chain now."""
        return self._lanes.qsize() == len(self._all_lanes)

    async def generate(self, prompt_ids: Sequence[int], *, on_token: Callable[[int], None] | None = None,
                       **options) -> GenerationResult:
        """`run` to the end: the tokens (`on_token` sees each as it arrives) and the figures."""
        tokens: list[int] = []
        async with contextlib.aclosing(self.run(prompt_ids, **options)) as events:
            async for event in events:
                if isinstance(event, Token):
                    tokens.append(event.token_id)
                    if on_token is not None:
                        on_token(event.token_id)
                elif isinstance(event, Finished):
                    finished = event
        return GenerationResult(tokens, finished.ended_by, len(prompt_ids), finished.stats,
                                finished.timings, finished.speculation)

    def _close_sockets(self) -> None:
        """On the engine, as it stops: every lane and return stream closes."""
        for lane in self._all_lanes:
            if lane.link is not None:
                lane.link.close()
        if self.inbox is not None:
            self.inbox.close_all()

    async def close(self) -> None:
        await self.measurement.close()
        if self.listener is not None:
            await self.listener.close()
        if self.engine is not None:
            await asyncio.to_thread(self.engine.close)
        self.runtime.close()
        self.telemetry.shutdown()


async def _stop_quietly(session: ChainSession, stop_s: float) -> None:
    """Stop a session the consumer left early, whatever cancels the consumer meanwhile. If it
    fails or takes over `stop_s`, the lane is closed and every stage reclaims the session."""
    try:
        await to_the_end(asyncio.wait_for(session.stop(), stop_s))
    except (asyncio.CancelledError, Exception):
        pass  # whatever brought us here still propagates


def _timing_extras(stats: StageReplyStats, timings: SessionTimings) -> dict[str, float]:
    """Chain figures for the `timings` object: the worst prefill edge and the prefix restore."""
    return {
        "chain_prefill_edge_max_ms": stats.prefill_edge_total_us_max / 1e3,
        "chain_kv_imported_tokens": stats.kv_imported_tokens,
        "kv_restored_tokens": timings.restored_tokens,
        "kv_suffix_prefill_tokens": timings.prefilled_tokens,
        "kv_restore_ms": timings.restore_s * 1e3,
        "kv_hit_stage_mask": stats.kv_hit_stage_mask,
        "kv_recorded_entries": stats.kv_recorded_pages,
    }
