"""`StageRuntime`: the async face of one stage's model, sessions and scheduler.

Stage servers and the stage-0 driver call these coroutines; all model work runs
on the scheduler's single worker, so callers never touch the model directly.
Session-table changes happen on the event loop; the worker only mutates the
sessions it was handed, in submission order.
"""

from __future__ import annotations

from ..model.llama import StageModel
from ..protocol.sampling_config import SamplingConfig
from ..telemetry import Telemetry
from .runner import Runner
from .scheduler import IterationScheduler, Timed
from .session import Session, SessionKey, SessionTable
from .step import Step, StepResult

BATCHED_STEPS_COUNTER = "skippy.runtime.batched_decode_iterations"
BATCH_ROWS_COUNTER = "skippy.runtime.batched_decode_steps"


class StageRuntime:
    def __init__(self, model: StageModel, *, lane_count: int = 4, ctx_size: int | None = None,
                 telemetry: Telemetry | None = None, batch_wait_s: float = 0.002,
                 record_logits: bool = False, name: str = "skippy-runtime"):
        self.model = model
        self.telemetry = telemetry or Telemetry()
        self.sessions = SessionTable(lane_count)
        self.runner = Runner(model, ctx_size or model.args.context_length,
                             record_logits=record_logits)
        self.scheduler = IterationScheduler(self.runner.run_batch, capacity=64 + lane_count,
                                            batch_wait_s=batch_wait_s, on_batch=self._count_batch,
                                            name=name)

    @property
    def is_first(self) -> bool:
        return self.runner.is_first

    @property
    def is_last(self) -> bool:
        return self.runner.is_last

    def _count_batch(self, size: int) -> None:
        if size > 1:
            self.telemetry.count(BATCHED_STEPS_COUNTER)
            self.telemetry.count(BATCH_ROWS_COUNTER, size)

    # -- sessions -------------------------------------------------------------------
    def open_session(self, key: SessionKey, request_id: int) -> Session:
        return self.sessions.open(key, request_id)

    def session(self, key: SessionKey) -> Session:
        return self.sessions.get(key)

    def reclaim_lane(self, lane_id: int) -> list[Session]:
        """Drop every session of a lane that ended without Stop (spec §3.3 orphan reclaim)."""
        dropped = self.sessions.drop_lane(lane_id)
        for session in dropped:
            self.scheduler.forget(session.key)
        if dropped:
            self.telemetry.count("skippy.runtime.orphan_sessions_reclaimed", len(dropped))
        return dropped

    # -- model work -----------------------------------------------------------------
    async def iterate(self, step: Step) -> Timed[StepResult]:
        """A decode or verify step: batched with other sessions' steps."""
        return await self.scheduler.submit_iteration(step, step.session.key)

    async def run_alone(self, step: Step) -> Timed[StepResult]:
        """A prefill chunk: one forward of its own (spec §6.1 runtime operation)."""
        def run() -> StepResult:
            result = self.runner.run_batch([step])[0]
            if isinstance(result, Exception):
                raise result
            return result

        return await self.scheduler.submit_op(run)

    async def configure(self, key: SessionKey, sampling: SamplingConfig | None,
                        prompt_token_count: int) -> Timed[None]:
        session = self.sessions.get(key)
        session.prompt_token_count = prompt_token_count
        return await self.scheduler.submit_op(lambda: self.runner.configure(session, sampling))

    async def trim(self, key: SessionKey, num_tokens: int) -> Timed[int]:
        session = self.sessions.get(key)
        return await self.scheduler.submit_op(lambda: self.runner.trim(session, num_tokens))

    async def retire(self, key: SessionKey, start: int, count: int) -> Timed[int]:
        session = self.sessions.get(key)
        return await self.scheduler.submit_op(lambda: self.runner.retire(session, start, count))

    async def drop(self, key: SessionKey) -> Timed[bool]:
        """Stop's reset. The reset passes through the worker, so it is ordered after any
        compute already queued for the session, and its runtime-lock wait is measured."""
        session = self.sessions.get(key) if key in self.sessions else None

        def reset() -> bool:
            if session is not None:
                session.cache = None  # free the KV memory on the owner thread
            return session is not None

        timed = await self.scheduler.submit_op(reset)
        self.sessions.drop(key)
        self.scheduler.forget(key)
        return timed

    def close(self) -> None:
        self.scheduler.shutdown()
