"""`StageRuntime`: one stage's model, sessions, prefix cache, step queue and batch policy.

Everything here belongs to the stage's engine thread: no locks, no futures. `submit` is the
one place a step starts, on every stage; `run_ready` runs the forward the batch policy picks
and hands each step its result.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

from ..model.grammar import GrammarCompiler
from ..model.llama import StageModel
from ..protocol.sampling_config import SamplingConfig
from ..protocol.stage_metrics import StageMetricValues
from ..telemetry import Telemetry
from .batch_policy import BatchPolicy, BatchSettings, Queued
from .metrics import StageMetrics
from .runner import Runner
from .session import Session, SessionKey, SessionTable
from .step import Step, StepResult

if TYPE_CHECKING:
    from .prefix_cache import RecordResult
    from .stage_cache import StagePrefixCache

T = TypeVar("T")
log = logging.getLogger("skippy.runtime")

BATCHED_STEPS_COUNTER = "skippy.runtime.batched_decode_iterations"
BATCH_ROWS_COUNTER = "skippy.runtime.batched_decode_steps"


@dataclass(frozen=True, slots=True)
class Timed(Generic[T]):
    value: T
    wait_s: float      # queued before its forward began (spec §3.5's runtime-lock wait)
    run_s: float       # the forward's time (for a batch: the whole batch)
    batch_size: int = 1


StepDone = Callable[[StepResult | Exception, Timed], None]


class StageRuntime:
    def __init__(self, model: StageModel, *, lane_count: int = 4, ctx_size: int | None = None,
                 telemetry: Telemetry | None = None, batch: BatchSettings = BatchSettings(),
                 record_logits: bool = False, prefix_cache: StagePrefixCache | None = None,
                 grammars: GrammarCompiler | None = None):
        """`prefix_cache`: this stage's prefix KV cache (None: every restore is a miss).
        `grammars`: the grammar engine of the stage that samples (None: no constrained decoding)."""
        self.model = model
        self.prefix_cache = prefix_cache
        self.telemetry = telemetry or Telemetry()
        self.metrics = StageMetrics()
        self.sessions = SessionTable(lane_count)
        self.runner = Runner(model, ctx_size or model.args.context_length,
                             record_logits=record_logits, grammars=grammars)
        self.policy = BatchPolicy(batch)
        self._queue: list[Queued] = []
        self.num_batched_forwards = 0

    @property
    def is_first(self) -> bool:
        return self.runner.is_first

    @property
    def ctx_size(self) -> int:
        return self.runner.ctx_size

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
            self.policy.announce(key, time.perf_counter())
        return session

    def session(self, key: SessionKey) -> Session:
        return self.sessions.get(key)

    def drop(self, key: SessionKey) -> bool:
        """Stop's reset: the session's KV and checkpoints go (its queued steps must be done)."""
        self.policy.forget(key)
        return self.sessions.drop(key) is not None

    def reclaim_lane(self, lane_id: int) -> list[Session]:
        """Drop every session of a lane that ended without Stop (spec §3.3 orphan reclaim)."""
        self._queue = [item for item in self._queue if item.key[0] != lane_id]
        dropped = self.sessions.drop_lane(lane_id)
        for session in dropped:
            self.policy.forget(session.key)
        if dropped:
            self.telemetry.count("skippy.runtime.orphan_sessions_reclaimed", len(dropped))
            self.metrics.count("sessions_reclaimed", len(dropped))
        return dropped

    def metric_values(self, connections: int = 0) -> StageMetricValues:
        """This stage's metrics now (what its StageStatus reply carries)."""
        sessions = [self.sessions.get(key) for key in self.sessions.keys()]
        gauges = {"active_sessions": len(sessions), "queue_depth": len(self._queue),
                  "kv_session_bytes": sum(s.cache.nbytes for s in sessions if s.cache is not None),
                  "connections": connections}
        cache = None if self.prefix_cache is None else self.prefix_cache.stats()
        return self.metrics.values(gauges, cache)

    # -- steps: the one way into a forward --------------------------------------------
    def submit(self, step: Step, done: StepDone, *, prefill: bool = False, last_chunk: bool = True) -> None:
        """Queue `step` for a forward; `done(result or exception, timing)` runs after it.
        `prefill`: a prompt chunk (`last_chunk`: the prompt's last), else a decode or verify step."""
        item = Queued(step.session.key, step.num_rows, prefill, time.perf_counter(), last_chunk, (step, done))
        self._queue.append(item)
        self.policy.queued(item)

    def cancel(self, key: SessionKey) -> None:
        """Forget the queued steps of a session (its request ended while they waited)."""
        self._queue = [item for item in self._queue if item.key != key]

    def run_ready(self) -> float | None:
        """Run the forward the policy picks now, if any; returns when to ask again (None: when
        something new is submitted, or 0.0 at once: more may be ready)."""
        if not self._queue:
            return None
        choice = self.policy.choose(self._queue, time.perf_counter())
        if choice.batch is None:
            return choice.wait_until
        taken = {id(item) for item in choice.batch}
        self._queue = [item for item in self._queue if id(item) not in taken]
        self._run_wave(choice.batch, choice.waves)
        return 0.0

    def _run_wave(self, batch: list[Queued], waves: int) -> None:
        self.runner.share_cores(waves)
        steps = [item.payload[0] for item in batch]
        started = time.perf_counter()
        try:
            results = self.runner.run_batch(steps)
        except Exception as error:  # a failure fails these steps only; the engine keeps serving (spec §6.1)
            log.exception("runtime: a forward of %d steps failed", len(steps))
            results = [error] * len(steps)
        finished = time.perf_counter()
        run_s = finished - started
        self.policy.ran(batch, run_s, finished)
        self._count(batch, run_s, started)
        for item, result in zip(batch, results):
            step, done = item.payload
            timed = Timed(result, started - item.submitted, run_s, len(batch))
            done(result, timed)

    def _count(self, batch: list[Queued], run_s: float, started: float) -> None:
        size = len(batch)
        if not batch[0].is_prefill:
            self.metrics.observe("batch_steps", size)
            if size > 1:
                self.num_batched_forwards += 1
                self.telemetry.count(BATCHED_STEPS_COUNTER)
                self.telemetry.count(BATCH_ROWS_COUNTER, size)
        for item in batch:
            step = item.payload[0]
            kind = "prefill" if item.is_prefill else "decode" if step.window_id is None else "verify"
            self.metrics.observe_forward(kind, step.num_rows, run_s, started - item.submitted)

    # -- session operations (run on the engine thread, in order with its steps) -------------
    def configure(self, key: SessionKey, sampling: SamplingConfig | None, prompt_token_count: int,
                  skip_draws: int = 0) -> None:
        session = self.sessions.get(key)
        session.prompt_token_count = prompt_token_count
        self.runner.configure(session, sampling, skip_draws)

    def trim(self, key: SessionKey, num_tokens: int) -> int:
        return self.runner.trim(self.sessions.get(key), num_tokens)

    def retire(self, key: SessionKey, start: int, count: int) -> int:
        return self.runner.retire(self.sessions.get(key), start, count)

    # -- prefix cache (spec §4) ------------------------------------------------------
    def restore_prefix(self, key: SessionKey, tokens: list[int], *, longest: bool) -> int:
        """Restore a cached prefix of `tokens` into the session; the restored length (0: miss).
        `longest`: the longest prefix on the candidate ladder (stage 0), else exactly `tokens`."""
        session, cache = self.sessions.get(key), self.prefix_cache
        if cache is None:
            return 0
        return cache.restore(session, tokens, longest=longest,
                             new_cache=lambda: self.model.new_cache(self.runner.ctx_size))

    def record_prefix(self, key: SessionKey) -> RecordResult:
        """Record the session's prefill (nothing without a recording cache)."""
        from .prefix_cache import RecordResult

        cache = self.prefix_cache
        if cache is None or not cache.record_enabled or key not in self.sessions:
            return RecordResult(0, 0)
        return cache.record(self.sessions.get(key))

    def rollback_prefix(self, key: SessionKey) -> None:
        """Drop a restore that the chain did not complete: the session holds nothing again."""
        if self.prefix_cache is not None:
            self.prefix_cache.rollback(self.sessions.get(key))

    def close(self) -> None:
        if self.prefix_cache is not None:  # the engine is gone: nothing else touches the cache
            self.prefix_cache.close()
