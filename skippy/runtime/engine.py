"""`StageRuntime`: the async face of one stage's model, sessions and scheduler.

Stage servers and the stage-0 driver call these coroutines; all model work runs
on the scheduler's single worker, so callers never touch the model directly.
Session-table changes happen on the event loop; the worker only mutates the
sessions it was handed, in submission order.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Callable, TypeVar

from ..model.grammar import GrammarCompiler
from ..model.llama import StageModel
from ..protocol.sampling_config import SamplingConfig
from ..protocol.stage_metrics import StageMetricValues
from ..telemetry import Telemetry
from .lending import Taken
from .metrics import StageMetrics
from .runner import Runner
from .scheduler import PEER_WAIT_FORWARDS, IterationScheduler, Timed
from .session import Session, SessionKey, SessionTable
from .step import Step, StepResult

if TYPE_CHECKING:
    from .stage_cache import StagePrefixCache

T = TypeVar("T")

log = logging.getLogger("skippy.runtime")

BATCHED_STEPS_COUNTER = "skippy.runtime.batched_decode_iterations"
BATCH_ROWS_COUNTER = "skippy.runtime.batched_decode_steps"


class StageRuntime:
    def __init__(self, model: StageModel, *, lane_count: int = 4, ctx_size: int | None = None,
                 telemetry: Telemetry | None = None, batch_wait_s: float = 0.002,
                 peer_wait_forwards: float = PEER_WAIT_FORWARDS, decode_waves: int = 1,
                 record_logits: bool = False, name: str = "skippy-runtime",
                 prefix_cache: StagePrefixCache | None = None, grammars: GrammarCompiler | None = None):
        """`prefix_cache`: this stage's prefix KV cache (None: every restore is a miss).
        `grammars`: the grammar engine of the stage that samples (None: no constrained decoding)."""
        self.model = model
        self.prefix_cache = prefix_cache
        self.telemetry = telemetry or Telemetry()
        self.metrics = StageMetrics()
        self.sessions = SessionTable(lane_count)
        self.runner = Runner(model, ctx_size or model.args.context_length,
                             record_logits=record_logits, grammars=grammars)
        self.scheduler = IterationScheduler(self.runner.run_batch, capacity=64 + lane_count,
                                            batch_wait_s=batch_wait_s, peer_wait_forwards=peer_wait_forwards,
                                            waves=decode_waves, share_cores=self.runner.share_cores,
                                            on_batch=self._count_batch,
                                            name=name)

    @property
    def is_first(self) -> bool:
        return self.runner.is_first

    @property
    def is_last(self) -> bool:
        return self.runner.is_last

    def _count_batch(self, size: int) -> None:
        self.metrics.observe("batch_steps", size)
        if size > 1:
            self.telemetry.count(BATCHED_STEPS_COUNTER)
            self.telemetry.count(BATCH_ROWS_COUNTER, size)

    def effective_settings(self) -> dict[str, str | int]:
        """What this stage runs with, as resolved (device "auto" made concrete, budgets split):
        one log line at start, so an operator (and a test) can see every option arrived."""
        model, kv = self.model, None if self.prefix_cache is None else self.prefix_cache.config
        return {"layers": f"[{model.layers.start},{model.layers.end})", "device": str(model.device),
                "weights": model.weight_format, "kv_dtype": str(model.kv_dtype).removeprefix("torch."),
                "ctx_size": self.runner.ctx_size, "threads": self.runner.num_threads(),
                "lanes": self.sessions.max_sessions,
                "kv_cache_bytes": 0 if kv is None else kv.max_bytes,
                "kv_disk_dir": "none" if kv is None or kv.disk_dir is None else kv.disk_dir,
                "kv_disk_budget": 0 if kv is None else kv.disk_budget_bytes,
                "otlp_endpoint": self.telemetry.otlp_endpoint or "none",
                "otlp_protocol": self.telemetry.otlp_protocol}

    def log_settings(self, stage_index: int) -> None:
        settings = " ".join(f"{key}={value}" for key, value in self.effective_settings().items())
        log.info("stage %d settings: %s", stage_index, settings)

    # -- sessions -------------------------------------------------------------------
    def open_session(self, key: SessionKey, request_id: int) -> Session:
        session = self.sessions.open(key, request_id)
        if session.is_new:  # every message of a request opens its session: count the first only
            session.is_new = False
            self.metrics.count("sessions_opened")
            self.scheduler.announce(key)
        return session

    def session(self, key: SessionKey) -> Session:
        return self.sessions.get(key)

    def reclaim_lane(self, lane_id: int) -> list[Session]:
        """Drop every session of a lane that ended without Stop (spec §3.3 orphan reclaim)."""
        dropped = self.sessions.drop_lane(lane_id)
        for session in dropped:
            self.scheduler.forget(session.key)
        if dropped:
            self.telemetry.count("skippy.runtime.orphan_sessions_reclaimed", len(dropped))
            self.metrics.count("sessions_reclaimed", len(dropped))
        return dropped

    def metric_values(self, connections: int = 0) -> StageMetricValues:
        """This stage's metrics now (what its StageStatus reply carries)."""
        sessions = [self.sessions.get(key) for key in self.sessions.keys()]
        gauges = {"active_sessions": len(sessions), "queue_depth": self.scheduler.depth,
                  "kv_session_bytes": sum(s.cache.nbytes for s in sessions if s.cache is not None),
                  "connections": connections}
        cache = None if self.prefix_cache is None else self.prefix_cache.stats()
        return self.metrics.values(gauges, cache)

    # -- model work -----------------------------------------------------------------
    async def iterate(self, step: Step, then: Callable[[StepResult], None] | None = None) -> Timed[StepResult]:
        """A decode or verify step: batched with other sessions' steps. `then(result)`: on the
        worker, as soon as the step's forward ends (scheduler.submit_iteration)."""
        timed = await self.scheduler.submit_iteration(step, step.session.key, then)
        self._observe_step(step, timed)
        return timed

    def _observe_step(self, step: Step, timed: Timed[StepResult]) -> None:
        self.metrics.observe_forward("decode" if step.window_id is None else "verify", step.num_rows,
                                     timed.run_s, timed.wait_s)

    def lend(self, fd: int, key: SessionKey, feed) -> asyncio.Future:
        """Lend a socket's read side to the worker (runtime/lending.py); the future settles
        with the bytes it read and did not take. A step the worker takes from it counts in
        this stage's metrics as a submitted one does."""
        def counted(buffer: bytearray):
            taken = feed(buffer)
            if isinstance(taken, Taken):
                step, done = taken.step, taken.done

                def observed(error: Exception | None, timed) -> bool:
                    if error is None:
                        self._observe_step(step, timed)
                    return done(error, timed)

                taken.done = observed
            return taken
        return self.scheduler.lend(fd, key, counted)

    def recall(self, loan: asyncio.Future) -> None:
        self.scheduler.recall(loan)

    async def call(self, fn: Callable[[], T]) -> T:
        """fn() on the runtime's worker, after the work queued before it: other model work
        of this process (a draft model's forward) belongs on this thread (model/threads.py)."""
        return (await self.scheduler.submit_op(fn)).value

    async def prefill(self, step: Step, *, last: bool = True) -> Timed[StepResult]:
        """A prompt chunk: in order with this session's other runtime operations (spec
        §6.1), in one forward with other sessions' chunks waiting at the same time. `last`:
        the prompt's last chunk, after which the session decodes."""
        timed = await self.scheduler.submit_prefill(step, step.session.key, step.num_rows, last=last)
        self.metrics.observe_forward("prefill", step.num_rows, timed.run_s, timed.wait_s)
        return timed

    async def configure(self, key: SessionKey, sampling: SamplingConfig | None,
                        prompt_token_count: int, skip_draws: int = 0) -> Timed[None]:
        session = self.sessions.get(key)
        session.prompt_token_count = prompt_token_count
        return await self.scheduler.submit_op(lambda: self.runner.configure(session, sampling, skip_draws), key)

    async def trim(self, key: SessionKey, num_tokens: int) -> Timed[int]:
        session = self.sessions.get(key)
        return await self.scheduler.submit_op(lambda: self.runner.trim(session, num_tokens), key)

    async def retire(self, key: SessionKey, start: int, count: int) -> Timed[int]:
        session = self.sessions.get(key)
        return await self.scheduler.submit_op(lambda: self.runner.retire(session, start, count), key)

    async def drop(self, key: SessionKey) -> Timed[bool]:
        """Stop's reset. The reset passes through the worker, so it is ordered after any
        compute already queued for the session, and its runtime-lock wait is measured."""
        session = self.sessions.get(key) if key in self.sessions else None

        def reset() -> bool:
            if session is not None:
                session.cache = None  # free the KV memory on the owner thread
            return session is not None

        timed = await self.scheduler.submit_op(reset, key)
        self.sessions.drop(key)
        self.scheduler.forget(key)
        return timed

    # -- prefix cache (spec §4): runtime ops, ordered with the session's compute ----------
    async def restore_prefix(self, key: SessionKey, tokens: list[int], *,
                             longest: bool) -> Timed[int]:
        """Restore a cached prefix of `tokens` into the session; the restored length (0: miss).
        `longest`: the longest prefix on the candidate ladder (stage 0), else exactly `tokens`."""
        session, cache = self.sessions.get(key), self.prefix_cache
        if cache is None:
            return Timed(0, 0.0, 0.0)
        runner = self.runner
        return await self.scheduler.submit_op(lambda: cache.restore(
            session, tokens, longest=longest, new_cache=lambda: runner.model.new_cache(runner.ctx_size)), key)

    def record_prefix(self, key: SessionKey) -> asyncio.Future:
        """Record the session's prefill (a Timed[RecordResult] future: submitted now, so it runs
        before any later op or step of this session, while the caller goes on)."""
        from .prefix_cache import RecordResult

        session, cache = self.sessions.get(key), self.prefix_cache
        if cache is None or not cache.record_enabled:
            future = asyncio.get_running_loop().create_future()
            future.set_result(Timed(RecordResult(0, 0), 0.0, 0.0))
            return future
        return self.scheduler.submit_op(lambda: cache.record(session), key)

    async def rollback_prefix(self, key: SessionKey) -> Timed[None]:
        """Drop a restore that the chain did not complete: the session holds nothing again."""
        session, cache = self.sessions.get(key), self.prefix_cache
        if cache is None:
            return Timed(None, 0.0, 0.0)
        return await self.scheduler.submit_op(lambda: cache.rollback(session), key)

    def close(self) -> None:
        self.scheduler.shutdown()
        if self.prefix_cache is not None:  # the worker is gone: nothing else touches the cache
            self.prefix_cache.close()
