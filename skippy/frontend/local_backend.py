"""`LocalBackend`: the whole model in this process, behind the GenerationBackend seam.

Model work goes through the runtime's `StageRuntime`: one worker thread owns the
model (the event loop never blocks on a forward), prompt chunks and decode steps
each run batched with those of other sessions waiting at the same time. This module
only sequences one request: open a session, prefill, decode until a stop id,
max_tokens or the context end, then drop the session, also when the consumer
stops iterating early.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator

from ..model.llama import StageModel
from ..runtime import LaneLimitError, SampleMode, Step
from ..runtime.engine import StageRuntime
from .backend import (
    BackendError,
    Finished,
    GenerationEvent,
    GenerationRequest,
    PrefillDone,
    Readiness,
    StageStatus,
    Token,
)

DEFAULT_PREFILL_CHUNK = 256  # prompt tokens per forward (spec §6.4's default)


class LocalBackend:
    """Serve generations from a whole-model StageModel held in this process."""

    def __init__(self, model: StageModel, *, num_lanes: int = 8, ctx_size: int | None = None,
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK):
        if not (model.layers.is_first and model.layers.is_last):
            raise ValueError(f"LocalBackend needs the whole model, got layers {model.layers}")
        self._runtime = StageRuntime(model, lane_count=num_lanes, ctx_size=ctx_size, name="skippy-local")
        self._layers = model.layers
        self._num_lanes = num_lanes
        self._prefill_chunk = prefill_chunk
        self._session_ids = itertools.count(1)
        self._is_closed = False

    @property
    def num_lanes(self) -> int:
        return self._num_lanes

    @property
    def ctx_size(self) -> int:
        return self._runtime.runner.ctx_size

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        if self._is_closed:
            raise BackendError("The model is shut down")
        runtime, prompt = self._runtime, request.prompt_ids
        key = (0, next(self._session_ids))
        try:
            session = runtime.open_session(key, key[1])
        except LaneLimitError as exc:
            raise BackendError(str(exc)) from exc
        try:
            await runtime.configure(key, request.sampling, len(prompt))
            started = time.perf_counter()
            for start in range(0, len(prompt), self._prefill_chunk):
                chunk = prompt[start : start + self._prefill_chunk]
                is_last = start + len(chunk) == len(prompt)
                mode = SampleMode.LAST if is_last else SampleMode.NONE
                timed = await runtime.prefill(Step(session, start, len(chunk), chunk, sample=mode))
            token = timed.value.tokens[0]
            first_token_at = time.perf_counter()
            yield PrefillDone(len(prompt), 0, (first_token_at - started) * 1e3)

            position, num_generated = len(prompt), 0
            while True:
                if token in request.stop_ids:
                    reason = "stop"
                    break
                num_generated += 1
                # Reaching the context end: the next step would write past it.
                if num_generated >= request.max_tokens or position + 1 > self.ctx_size:
                    yield Token(token)
                    reason = "length"
                    break
                yield Token(token)
                timed = await runtime.iterate(Step(session, position, 1, [token], sample=SampleMode.LAST))
                token, position = timed.value.tokens[0], position + 1
            yield Finished(reason, num_generated, (time.perf_counter() - first_token_at) * 1e3)
        finally:
            # Dropping runs on as its own task, so a consumer being cancelled cannot cut it
            # short; the runtime orders it after any step already queued for the session.
            dropping = asyncio.ensure_future(runtime.drop(key))
            try:
                await asyncio.shield(dropping)
            except asyncio.CancelledError:
                pass  # the exception that brought us here still propagates

    async def status(self) -> list[StageStatus]:
        state = "down" if self._is_closed else "ready"
        layers = self._layers
        return [StageStatus("stage-0", layers.start, layers.end, "in-process", state, len(self._runtime.sessions))]

    async def ready(self) -> Readiness:
        if self._is_closed:
            return Readiness(False, "stage-0", "the model is shut down")
        return Readiness(True)

    async def close(self) -> None:
        self._is_closed = True
        await asyncio.to_thread(self._runtime.close)
