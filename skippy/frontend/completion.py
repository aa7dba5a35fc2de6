"""One completion request: validated schema -> prompt ids -> backend events -> response or SSE.

    prepare_chat / prepare_text   request fields -> a `Job` (400s for what we cannot honour)
    Generation                    a Job's run: text pieces out, counts and timings kept
    complete_* / stream_*         the non-streaming response, or the SSE byte stream
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Literal

import anyio

from ..model.tokenizer import Tokenizer
from ..protocol.sampling_config import SamplingConfig
from .admission import Admission, Lease, check_fits
from .backend import BackendError, BackendTimeout, Finished, GenerationBackend, GenerationRequest, PrefillDone, Token
from .errors import ApiError, to_api_error
from .metrics import Metrics
from .schemas import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    Completion,
    CompletionChoice,
    CompletionRequest,
    GenerationParams,
    PromptTokensDetails,
    Timings,
    Usage,
)
from .streaming import DONE, StopTextStream, sse

OPENAI_DEFAULT_TEMPERATURE = 1.0
ABANDON_WAIT_S = 5.0  # how long a consumer that left waits for the backend's next event before cancelling


@dataclass(slots=True)
class ServeContext:
    """Everything a request needs, built once per app."""

    backend: GenerationBackend
    tokenizer: Tokenizer
    model_id: str
    admission: Admission
    metrics: Metrics
    backend_timeout_s: float  # longest wait for the next backend event; 0 = none


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


# ---- request -> Job ---------------------------------------------------------------


async def prepare_chat(ctx: ServeContext, body: ChatCompletionRequest, request_id: str, received_at: float) -> Job:
    _check_common(ctx, body)
    if body.logprobs:
        raise ApiError(400, "logprobs are not supported by this server; send logprobs=false", param="logprobs")
    if body.tools and body.tool_choice != "none":
        uses_tools = "tools" in (ctx.tokenizer.chat_template or "")
        reason = (
            "this server does not parse tool calls from the output"
            if uses_tools
            else "the model's chat template has no tool support (it never reads `tools`)"
        )
        raise ApiError(400, f"tools cannot be honoured: {reason}. Send the request without tools.", param="tools")
    if body.response_format is not None and body.response_format.type != "text":
        raise ApiError(
            400,
            f"response_format {body.response_format.type!r} cannot be honoured: this server has no constrained "
            f"decoding (JSON mode or schemas). Send response_format {{\"type\": \"text\"}} or leave it out.",
            param="response_format",
        )
    messages = []
    for message in body.messages:
        fields = message.model_dump()
        if fields["role"] == "developer":  # OpenAI's newer name for the system role
            fields["role"] = "system"
        messages.append(fields)

    def tokenize() -> list[int]:
        text = ctx.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return ctx.tokenizer.encode(text)

    prompt_ids = await asyncio.to_thread(tokenize)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    return _job(ctx, "chat", body, request_id, received_at, prompt_ids, max_tokens)


async def prepare_text(ctx: ServeContext, body: CompletionRequest, request_id: str, received_at: float) -> Job:
    _check_common(ctx, body)
    for name, value, allowed in (("suffix", body.suffix, None), ("logprobs", body.logprobs, None)):
        if value != allowed:
            raise ApiError(400, f"{name} is not supported by this server; leave it out", param=name)
    if body.best_of not in (None, 1):
        raise ApiError(400, f"Expected best_of=1, got {body.best_of}: one choice per request", param="best_of")
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise ApiError(400, f"Expected one prompt per request, got {len(prompt)}", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        prompt_ids = await asyncio.to_thread(ctx.tokenizer.encode, prompt)
    else:
        prompt_ids = list(prompt)
        bad = [t for t in prompt_ids if not 0 <= t < ctx.tokenizer.vocab_size]
        if bad:
            raise ApiError(400, f"Expected token ids in [0, {ctx.tokenizer.vocab_size}), got {bad[0]}", param="prompt")
    if not prompt_ids:
        raise ApiError(400, "Expected a non-empty prompt, got one that encodes to no tokens", param="prompt")
    echo = (prompt if isinstance(prompt, str) else ctx.tokenizer.decode(prompt_ids)) if body.echo else ""
    return _job(ctx, "text", body, request_id, received_at, prompt_ids, body.max_tokens, echo)


def _check_common(ctx: ServeContext, body: GenerationParams) -> None:
    if body.model != ctx.model_id:
        raise ApiError(
            404, f"The model {body.model!r} does not exist; this server serves {ctx.model_id!r}",
            param="model", code="model_not_found",
        )  # fmt: skip
    vocab = ctx.tokenizer.vocab_size
    bad = [t for t in (body.logit_bias or {}) if t >= vocab]
    if bad:
        raise ApiError(400, f"Expected logit_bias token ids < {vocab}, got {bad[0]}", param="logit_bias")


def _job(ctx, kind, body: GenerationParams, request_id, received_at, prompt_ids, max_tokens, echo="") -> Job:
    max_tokens = check_fits(len(prompt_ids), max_tokens, ctx.backend.ctx_size)
    temperature = OPENAI_DEFAULT_TEMPERATURE if body.temperature is None else body.temperature
    sampling = SamplingConfig(
        temperature=temperature,
        top_k=body.top_k or 0,
        top_p=1.0 if body.top_p is None else body.top_p,
        min_p=body.min_p or 0.0,
        repetition_penalty=body.repetition_penalty or 1.0,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        logit_bias=dict(body.logit_bias or {}),
        seed=body.seed,
    )
    request = GenerationRequest(request_id, prompt_ids, max_tokens, sampling, ctx.tokenizer.eog_ids,
                                body.prompt_cache_key)
    prefix = "chatcmpl-" if kind == "chat" else "cmpl-"
    return Job(
        kind=kind, id=prefix + request_id, created=int(time.time()), model=ctx.model_id, received_at=received_at,
        request=request, stop=tuple(body.stop or ()), is_stream=body.stream,
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
        return_token_ids=body.return_token_ids, echo=echo,
    )  # fmt: skip


# ---- a Job's run ------------------------------------------------------------------


class Generation:
    """Drive one backend generation: text pieces out; counts, timings and metrics kept.

    The backend's event iterator runs in a task of its own (the pump), never in the
    response's task: a client disconnect cancels the response task (anyio, repeatedly),
    and a backend's cleanup (Stop down the chain) must not be cut short by that. When
    the consumer leaves early, the pump stops at the backend's next event and closes
    the iterator there, so the session ends between steps; a backend that stays silent
    is cancelled instead.
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
        self._is_abandoned = False
        self._is_failed = False
        self._is_closed = False
        self._first_token_at = self._last_token_at = 0.0

    async def start(self) -> None:
        """Wait for the first event, so failures before any output still get their HTTP status."""
        self._pump = asyncio.create_task(self._run_backend())
        self._pending = await self._next_event()

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
            done, _ = await asyncio.wait([pump], timeout=ABANDON_WAIT_S)
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
                case Token(token_id=token_id):
                    self._count_token(token_id)
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

    def _record(self) -> None:
        metrics = self._ctx.metrics
        outcome = "error" if self._is_failed else self.finish_reason or "cancelled"
        metrics.generations.labels(outcome).inc()
        metrics.prompt_tokens.inc(self.prefill.num_prompt_tokens)
        metrics.cached_tokens.inc(self.prefill.num_cached_tokens)
        metrics.completion_tokens.inc(len(self.completion_ids))

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
        with anyio.CancelScope(shield=True):
            await generation.close()
    finally:
        lease.release()


# ---- responses --------------------------------------------------------------------


async def complete(job: Job, generation: Generation) -> ChatCompletion | Completion:
    text = "".join([piece async for piece in generation.pieces()])
    token_ids = generation.completion_ids if job.return_token_ids else None
    prompt_ids = job.request.prompt_ids if job.return_token_ids else None
    common = dict(id=job.id, created=job.created, model=job.model, usage=generation.usage(),
                  timings=generation.timings(), prompt_token_ids=prompt_ids)  # fmt: skip
    if job.kind == "chat":
        message = AssistantMessage(content=text)
        choice = ChatChoice(message=message, finish_reason=generation.finish_reason, token_ids=token_ids)
        return ChatCompletion(choices=[choice], **common)
    choice = CompletionChoice(text=job.echo + text, finish_reason=generation.finish_reason, token_ids=token_ids)
    return Completion(choices=[choice], **common)


async def stream(job: Job, generation: Generation, lease: Lease) -> AsyncIterator[bytes]:
    """SSE bytes: (chat) a role chunk, content chunks, the finish chunk, a usage chunk if asked, [DONE].

    A failure after the first byte becomes an error event before [DONE]. The lane and
    the backend session are released however the stream ends, client disconnect included.
    """
    chunk = _chat_chunk if job.kind == "chat" else _text_chunk
    try:
        try:
            prompt_ids = job.request.prompt_ids if job.return_token_ids else None
            if job.kind == "chat":
                yield sse(_chat_chunk(job, ChatDelta(role="assistant", content=""), prompt_token_ids=prompt_ids))
            elif job.echo or prompt_ids:
                yield sse(_text_chunk(job, job.echo, prompt_token_ids=prompt_ids))
            async for piece in generation.pieces():
                yield sse(chunk(job, piece))
            token_ids = generation.completion_ids if job.return_token_ids else None
            yield sse(chunk(job, None, finish_reason=generation.finish_reason, timings=generation.timings(),
                            token_ids=token_ids))  # fmt: skip
            if job.include_usage:
                yield sse(_usage_chunk(job, generation.usage()))
        except Exception as exc:
            yield sse(to_api_error(exc).envelope())
        yield DONE
    finally:
        await finish(generation, lease)


def _chat_chunk(job: Job, content: ChatDelta | str | None, *, finish_reason=None, token_ids=None, **extra):
    delta = content if isinstance(content, ChatDelta) else ChatDelta(content=content)
    choice = ChatChunkChoice(delta=delta, finish_reason=finish_reason, token_ids=token_ids)
    return ChatCompletionChunk(id=job.id, created=job.created, model=job.model, choices=[choice], **extra)


def _text_chunk(job: Job, text: str | None, *, finish_reason=None, token_ids=None, **extra):
    choice = CompletionChoice(text=text or "", finish_reason=finish_reason, token_ids=token_ids)
    return Completion(id=job.id, created=job.created, model=job.model, choices=[choice], **extra)


def _usage_chunk(job: Job, usage: Usage):
    cls = ChatCompletionChunk if job.kind == "chat" else Completion
    return cls(id=job.id, created=job.created, model=job.model, choices=[], usage=usage)
