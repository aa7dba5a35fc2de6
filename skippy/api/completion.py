"""One completion request: validated schema -> a `Job`, and the run's output -> response or SSE.

    prepare_chat / prepare_text   request fields -> a `Job` (400s for what we cannot honour)
    complete / stream             a `Generation`'s pieces -> the JSON response, or SSE bytes
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

from ..driver.backend import GenerationRequest
from ..protocol.constants import GrammarKind
from ..protocol.sampling_config import GrammarSpec, SamplingConfig
from ..runtime.speculation import SpeculativeSettings
from .admission import Lease, check_fits
from .chat_output import ChatOutput, ChatShape, render_chat
from .errors import ApiError, to_api_error
from .generation import Generation, Job, ServeContext, finish
from .logprobs import LogprobFormatter
from .schemas import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    ChatLogprobs,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    GenerationParams,
    ResponseFormat,
    Usage,
)
from .streaming import DONE, PieceEvents, sse

OPENAI_DEFAULT_TEMPERATURE = 1.0


# ---- request -> Job ---------------------------------------------------------------


async def prepare_chat(ctx: ServeContext, body: ChatCompletionRequest, request_id: str, received_at: float) -> Job:
    _check_common(ctx, body)
    if body.top_logprobs is not None and not body.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true; send both, or neither", param="top_logprobs")
    prompt_ids, shape, grammar = await render_chat(ctx, body)
    if grammar is None:
        grammar = await _grammar(ctx, body.response_format)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    return _job(ctx, "chat", body, request_id, received_at, prompt_ids, max_tokens, grammar=grammar,
                logprobs=logprobs, shape=None if shape.is_plain else shape)


async def prepare_text(ctx: ServeContext, body: CompletionRequest, request_id: str, received_at: float) -> Job:
    _check_common(ctx, body)
    if body.suffix is not None:
        raise ApiError(400, "suffix is not supported by this server; leave it out", param="suffix")
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
    grammar = await _grammar(ctx, body.response_format)
    return _job(ctx, "text", body, request_id, received_at, prompt_ids, body.max_tokens, echo, grammar,
                logprobs=body.logprobs, prompt_logprobs=body.echo and body.logprobs is not None)


def _check_common(ctx: ServeContext, body: GenerationParams) -> None:
    if body.model is not None and body.model not in ctx.model_names:
        raise ApiError(
            404, f"The model {body.model!r} does not exist; this server serves "
                 f"{' or '.join(map(repr, ctx.model_names))}",
            param="model", code="model_not_found",
        )  # fmt: skip
    vocab = ctx.tokenizer.vocab_size
    bad = [t for t in (body.logit_bias or {}) if t >= vocab]
    if bad:
        raise ApiError(400, f"Expected logit_bias token ids < {vocab}, got {bad[0]}", param="logit_bias")


async def _grammar(ctx: ServeContext, response_format: ResponseFormat | None) -> GrammarSpec | None:
    """What `response_format` constrains the output to (None: text). Stage 0 compiles it now, so
    a schema the grammar engine cannot handle is a 400 before the request runs, never a failure
    midway; the compiled grammar stays cached for the sampler."""
    if response_format is None or response_format.type == "text":
        return None
    try:
        if response_format.type == "json_object":
            grammar = GrammarSpec(GrammarKind.JSON_OBJECT)
        else:  # json_schema; the key order of the client's schema is kept (it orders the output)
            grammar = GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(response_format.json_schema.json_schema))
        await asyncio.to_thread(ctx.backend.check_grammar, grammar)
    except ValueError as exc:
        raise ApiError(400, f"response_format cannot be honoured: {exc}", param="response_format",
                       code="invalid_response_format") from None
    return grammar


def _job(ctx, kind, body: GenerationParams, request_id, received_at, prompt_ids, max_tokens, echo="",
         grammar: GrammarSpec | None = None, logprobs: int | None = None, prompt_logprobs: bool = False,
         shape: ChatShape | None = None) -> Job:
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
        grammar=grammar,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
    )
    request = GenerationRequest(request_id, prompt_ids, max_tokens, sampling, ctx.tokenizer.eog_ids,
                                body.prompt_cache_key, _speculative(ctx, body))
    prefix = "chatcmpl-" if kind == "chat" else "cmpl-"
    return Job(
        kind=kind, id=prefix + request_id, created=int(time.time()), model=body.model or ctx.model_names[0],
        received_at=received_at, request=request, stop=tuple(body.stop or ()), is_stream=body.stream,
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
        return_token_ids=body.return_token_ids, echo=echo, shape=shape,
    )  # fmt: skip


def _speculative(ctx: ServeContext, body: GenerationParams) -> SpeculativeSettings | None:
    """The request's `speculative` extension over the server's default (None: the default)."""
    if body.speculative is None:
        return None
    fields = {name: value for name, value in body.speculative.model_dump().items() if value is not None}
    try:
        settings = ctx.backend.speculative.override(**fields)
        if settings.is_enabled:
            ctx.backend.check_speculative(settings)
    except ValueError as exc:
        raise ApiError(400, f"speculative: {exc}", param="speculative") from None
    return settings


# ---- responses --------------------------------------------------------------------


async def complete(job: Job, generation: Generation) -> ChatCompletion | Completion:
    formatter = LogprobFormatter(generation.tokenizer)
    text = "".join([piece async for piece in generation.pieces()])
    token_ids = generation.completion_ids if job.return_token_ids else None
    prompt_ids = job.request.prompt_ids if job.return_token_ids else None
    common = dict(id=job.id, created=job.created, model=job.model, usage=generation.usage(),
                  timings=generation.timings(), prompt_token_ids=prompt_ids)  # fmt: skip
    wants = job.request.sampling.logprobs is not None
    if job.kind == "chat":
        finish_reason, message = generation.finish_reason, AssistantMessage(content=text)
        if job.shape is not None:
            output = ChatOutput(job.shape)
            output.push(text)
            output.flush()
            finish_reason, message = output.finish_reason(finish_reason), output.message()
        logprobs = formatter.chat(generation.logprobs) if wants else None
        choice = ChatChoice(message=message, finish_reason=finish_reason, token_ids=token_ids, logprobs=logprobs)
        return ChatCompletion(choices=[choice], **common)
    logprobs = None
    if wants:
        entries, ids = _prompt_entries(job, generation)
        logprobs = formatter.completion([*entries, *generation.logprobs], [*ids, *generation.completion_ids])
    choice = CompletionChoice(text=job.echo + text, finish_reason=generation.finish_reason, token_ids=token_ids,
                              logprobs=logprobs)
    return Completion(choices=[choice], **common)


def _prompt_entries(job: Job, generation: Generation) -> tuple[list, list[int]]:
    """An echoed prompt's logprob entries and ids: its first token has none ([], [] without echo)."""
    if not job.request.sampling.prompt_logprobs:
        return [], []
    prompt_ids = job.request.prompt_ids
    return [None, *(generation.prefill.prompt_logprobs or [])], list(prompt_ids)


async def stream(job: Job, generation: Generation, lease: Lease) -> AsyncIterator[bytes]:
    """SSE bytes: (chat) a role chunk, content chunks, the finish chunk, a usage chunk if asked,
    [DONE]. A failure after the first byte is an error event before [DONE]; the lane and the
    session are released however the stream ends."""
    chunk = _chat_chunk if job.kind == "chat" else _text_chunk
    logprobs = _ChunkLogprobs(job, generation, LogprobFormatter(generation.tokenizer))
    try:
        try:
            prompt_ids = job.request.prompt_ids if job.return_token_ids else None
            if job.kind == "chat":
                yield sse(_chat_chunk(job, ChatDelta(role="assistant", content=""), prompt_token_ids=prompt_ids))
            elif job.echo or prompt_ids:
                yield sse(_text_chunk(job, job.echo, prompt_token_ids=prompt_ids, logprobs=logprobs.prompt()))
            output = ChatOutput(job.shape) if job.shape is not None else None
            plain = None if output is not None or logprobs.wanted else PieceEvents(lambda text: chunk(job, text))
            async for piece in generation.pieces():
                if plain is not None:  # the common stream: text only
                    yield plain(piece)
                    continue
                # a piece the output holds back (a possible tool call) keeps its logprobs for the next delta
                for delta in output.push(piece) if output else (piece,):
                    yield sse(chunk(job, delta, logprobs=logprobs.take()))
            finish_reason = generation.finish_reason
            if output is not None:
                for delta in output.flush():
                    yield sse(chunk(job, delta, logprobs=logprobs.take()))
                finish_reason = output.finish_reason(finish_reason)
            token_ids = generation.completion_ids if job.return_token_ids else None
            yield sse(chunk(job, None, finish_reason=finish_reason, timings=generation.timings(),
                            token_ids=token_ids, logprobs=logprobs.take()))  # fmt: skip
            if job.include_usage:
                yield sse(_usage_chunk(job, generation.usage()))
        except Exception as exc:
            yield sse(to_api_error(exc).envelope())
        yield DONE
    finally:
        await finish(generation, lease)


class _ChunkLogprobs:
    """A stream's logprobs: each chunk carries those of the tokens that arrived for it, and a
    text stream's offsets run on from chunk to chunk (None throughout when none were asked)."""

    def __init__(self, job: Job, generation: Generation, formatter: LogprobFormatter):
        self._job, self._generation, self._formatter = job, generation, formatter
        self.wanted = job.request.sampling.logprobs is not None
        self._offset = 0

    def prompt(self) -> CompletionLogprobs | None:
        entries, ids = _prompt_entries(self._job, self._generation)
        return self._text(entries, ids) if entries else None

    def take(self) -> ChatLogprobs | CompletionLogprobs | None:
        if not self.wanted:
            return None
        generation = self._generation
        entries = generation.take_logprobs()
        if not entries:
            return None
        if self._job.kind == "chat":
            return self._formatter.chat(entries)
        return self._text(entries, generation.completion_ids[len(generation.logprobs) - len(entries):
                                                             len(generation.logprobs)])

    def _text(self, entries: list, ids: list[int]) -> CompletionLogprobs:
        out = self._formatter.completion(entries, ids, self._offset)
        self._offset += sum(len(token) for token in out.tokens)
        return out


def _chat_chunk(job: Job, content: ChatDelta | str | None, *, finish_reason=None, token_ids=None,
                logprobs=None, **extra):
    delta = content if isinstance(content, ChatDelta) else ChatDelta(content=content)
    choice = ChatChunkChoice(delta=delta, finish_reason=finish_reason, token_ids=token_ids, logprobs=logprobs)
    return ChatCompletionChunk(id=job.id, created=job.created, model=job.model, choices=[choice], **extra)


def _text_chunk(job: Job, text: str | None, *, finish_reason=None, token_ids=None, logprobs=None, **extra):
    choice = CompletionChoice(text=text or "", finish_reason=finish_reason, token_ids=token_ids,
                              logprobs=logprobs)
    return Completion(id=job.id, created=job.created, model=job.model, choices=[choice], **extra)


def _usage_chunk(job: Job, usage: Usage):
    cls = ChatCompletionChunk if job.kind == "chat" else Completion
    return cls(id=job.id, created=job.created, model=job.model, choices=[], usage=usage)
