"""One Job's run: the backend's events in, text pieces out; counts, timings and metrics kept.

`ServeContext` is what every request shares (built once per app); a `Job` is one
prepared request (completion.py builds it from the validated schema).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from ..tasks import to_the_end

from ..driver.backend import (
    BackendError, BackendTimeout, Finished, GenerationBackend, GenerationRequest, PrefillDone, Token,
)
from ..model.tokenizer import Tokenizer
from .activity import Activity, RequestFigures
from .admission import Admission, Lease
from .metrics import Metrics
from .schemas import PromptTokensDetails, Timings, Usage
from .streaming import StopTextStream

if TYPE_CHECKING:
    from .chat_output import ChatShape



@dataclass(slots=True)
class ServeContext:
    """Everything a request needs, built once per app."""

    backend: GenerationBackend
    tokenizer: Tokenizer
    model_names: tuple[str, ...]  # the served id first, then its aliases
    admission: Admission
    metrics: Metrics
    backend_timeout_s: float  # longest wait for the next backend event; 0 = none
    abandon_timeout_s: float  # a consumer that left waits this long for the backend's next event, then cancels
    activity: Activity = field(default_factory=Activity)  # the chain page's live figures


@dataclass(frozen=True, slots=True)
class Job:
    kind: Literal["chat", "text"]
    id: str
    created: int
    model: str
    received_at: float  # perf_counter at arrival, for TTFT
    request: GenerationRequest
    stop: tuple[str, ...]
    is_stream: bool
    include_usage: bool
    return_token_ids: bool
    echo: str = ""  # text completions with echo=true start with the prompt
    shape: ChatShape | None = None  # a chat reply split into reasoning, content, tool calls; None: all content


class Generation:
    """Drive one backend generation: text pieces out; counts, timings and metrics kept.

    The backend's iterator runs in a task of its own (the pump), so a client disconnect,
    which cancels the response task, cannot cut its cleanup (Stop down the chain) short. A
    consumer that leaves stops the pump at the backend's next event; a silent one is cancelled.
    """

    def __init__(self, ctx: ServeContext, job: Job):
        self._ctx, self._job = ctx, job
        self._text = StopTextStream(ctx.tokenizer, job.stop)
        self._events: asyncio.Queue = asyncio.Queue()  # backend events, or the exception that ended it
        self._pump: asyncio.Task | None = None
        self._pending: PrefillDone | Token | Finished | None = None
        self.prefill = PrefillDone(len(job.request.prompt_ids), 0, 0.0)
        self.finished: Finished | None = None
        self.finish_reason: str | None = None
        self.completion_ids: list[int] = []
        self.logprobs: list = []  # TokenLogprob per completion token, when the request asked
        self._num_logprobs_taken = 0
        self._is_abandoned = False
        self._is_failed = False
        self._is_closed = False
        self._first_token_at = self._last_token_at = 0.0

    async def start(self) -> None:
        """Wait for the first event, so failures before any output still get their HTTP status."""
        self._pump = asyncio.create_task(self._run_backend())
        self._pending = await self._next_event()
        if isinstance(self._pending, PrefillDone):  # the prompt's figures (and logprobs) are known now
            self.prefill = self._pending

    async def _run_backend(self) -> None:
        try:
            async with aclosing(self._ctx.backend.generate(self._job.request)) as events:
                async for event in events:
                    self._events.put_nowait(event)
                    if self._is_abandoned or isinstance(event, Finished):
                        return  # aclosing closes the backend's iterator at this event
            self._events.put_nowait(BackendError("The backend ended the generation without finishing it"))
        except Exception as exc:
            self._events.put_nowait(exc)

    async def close(self) -> None:
        """End the backend generation (freeing its session everywhere) and record metrics."""
        self._is_abandoned = True
        pump = self._pump
        if pump is not None and not pump.done():
            if self._is_failed:  # silent or broken: do not wait for an event that may never come
                pump.cancel()
            done, _ = await asyncio.wait([pump], timeout=self._ctx.abandon_timeout_s)
            if not done:
                pump.cancel()
                await asyncio.wait([pump])
        if not self._is_closed:
            self._is_closed = True
            self._record()

    async def pieces(self) -> AsyncIterator[str]:
        """Text safe to send, piece by piece; ends at EOS, max_tokens or a stop string."""
        while self.finish_reason is None:
            event, self._pending = self._pending or await self._next_event(), None
            match event:
                case PrefillDone():
                    self.prefill = event
                case Token(token_id=token_id, logprob=logprob):
                    self._count_token(token_id)
                    if logprob is not None:
                        self.logprobs.append(logprob)
                    text = self._text.push(token_id)
                    if text:
                        yield text
                    if self._text.is_stopped:
                        self.finish_reason = "stop"
                case Finished():
                    self.finished, self.finish_reason = event, event.reason
                    text = self._text.flush()
                    if text:
                        yield text

    @property
    def tokenizer(self) -> Tokenizer:
        return self._ctx.tokenizer

    def take_logprobs(self) -> list:
        """The completion tokens' logprob entries not taken yet (a streamed chunk's)."""
        taken, self._num_logprobs_taken = self.logprobs[self._num_logprobs_taken:], len(self.logprobs)
        return taken

    async def _next_event(self):
        timeout = self._ctx.backend_timeout_s or None
        try:
            async with asyncio.timeout(timeout):
                item = await self._events.get()
        except TimeoutError:
            self._is_failed = True
            raise BackendTimeout(f"The backend produced nothing for {timeout:g} s") from None
        if isinstance(item, Exception):
            self._is_failed = True
            raise item
        return item

    def _count_token(self, token_id: int) -> None:
        now = time.perf_counter()
        metrics = self._ctx.metrics
        if not self.completion_ids:
            self._first_token_at = now
            metrics.ttft.observe(now - self._job.received_at)
        else:
            metrics.inter_token.observe(now - self._last_token_at)
        self._last_token_at = now
        self.completion_ids.append(token_id)
        self._ctx.activity.token()

    def _record(self) -> None:
        metrics = self._ctx.metrics
        outcome = "error" if self._is_failed else self.finish_reason or "cancelled"
        metrics.generations.labels(outcome).inc()
        metrics.prompt_tokens.inc(self.prefill.num_prompt_tokens)
        metrics.cached_tokens.inc(self.prefill.num_cached_tokens)
        metrics.completion_tokens.inc(len(self.completion_ids))
        if self.finished is not None:
            metrics.observe_speculation(self.finished.extra)
            metrics.recoveries.inc(self.finished.extra.get("chain_recoveries", 0))
        num_tokens = len(self.completion_ids)
        decoding_s = self._last_token_at - self._first_token_at
        self._ctx.activity.finished(RequestFigures(
            time.time(), outcome, self.prefill.num_prompt_tokens, self.prefill.num_cached_tokens, num_tokens,
            (self._first_token_at - self._job.received_at) * 1e3 if num_tokens else None,
            (num_tokens - 1) / decoding_s if num_tokens > 1 and decoding_s > 0 else None,
        ))

    def usage(self) -> Usage:
        num_prompt, num_completion = len(self._job.request.prompt_ids), len(self.completion_ids)
        return Usage(
            prompt_tokens=num_prompt,
            completion_tokens=num_completion,
            total_tokens=num_prompt + num_completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=self.prefill.num_cached_tokens),
        )

    def timings(self) -> Timings:
        prompt_n = self.prefill.num_prompt_tokens - self.prefill.num_cached_tokens
        prompt_ms = self.prefill.prefill_ms
        predicted_n = len(self.completion_ids)
        if self.finished is not None:
            predicted_ms = self.finished.decode_ms
        else:  # stopped early by a stop string: our own clock
            predicted_ms = (self._last_token_at - self._first_token_at) * 1e3
        extra = self.finished.extra if self.finished else {}
        return Timings(
            cache_n=self.prefill.num_cached_tokens,
            prompt_n=prompt_n,
            prompt_ms=prompt_ms,
            prompt_per_token_ms=prompt_ms / prompt_n if prompt_n else 0.0,
            prompt_per_second=prompt_n / prompt_ms * 1e3 if prompt_ms > 0 else 0.0,
            predicted_n=predicted_n,
            predicted_ms=predicted_ms,
            predicted_per_token_ms=predicted_ms / predicted_n if predicted_n else 0.0,
            predicted_per_second=predicted_n / predicted_ms * 1e3 if predicted_ms > 0 else 0.0,
            **extra,
        )


async def start_generation(ctx: ServeContext, job: Job) -> tuple[Generation, Lease]:
    """Take a lane and wait for the backend's first event; raises with the HTTP-mappable cause."""
    lease = await ctx.admission.acquire()
    generation = Generation(ctx, job)
    try:
        await generation.start()
    except BaseException:
        await finish(generation, lease)
        raise
    return generation, lease


async def finish(generation: Generation, lease: Lease) -> None:
    """Free the backend session, then the lane, even while the caller is being cancelled
    (a client disconnect cancels the response task; cleanup must still run to the end)."""
    try:
        await to_the_end(generation.close())
    finally:
        lease.release()
