"""pydantic models for the OpenAI-compatible API: requests, responses, the error envelope.

Requests ignore fields they do not know (clients send many); fields we know but
cannot honour are rejected in completion.py with a 400 that says why. Response
fields that are extensions (`timings`, token ids) are left out when empty.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_STOP_STRINGS = 4
MAX_ABS_LOGIT_BIAS = 100.0


def _omit_none(value: Any) -> bool:
    return value is None


# ---- requests ---------------------------------------------------------------------


class StreamOptions(BaseModel):
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    """response_format's `json_schema`: the schema the output must validate against."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    name: str = Field("response", max_length=64)
    description: str | None = None
    json_schema: dict[str, Any] = Field(alias="schema")  # "schema" would shadow BaseModel.schema
    strict: bool | None = None  # the output is constrained either way


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_for_json_schema(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError(f"Expected json_schema exactly with type 'json_schema', got type {self.type!r} "
                             f"{'with' if self.json_schema is not None else 'without'} it")
        return self


class SpeculativeOptions(BaseModel):
    """Extension: speculative decoding for one request. Unset fields keep the server's setting.
    Greedy output is the same with it on or off; only the speed changes."""

    model_config = ConfigDict(extra="forbid")

    mode: str | None = None  # "ngram-suffix", "ngram-simple", "draft" or "off"
    min_window: int | None = Field(None, ge=1, le=64)  # drafts per verify window, adaptive in between
    max_window: int | None = Field(None, ge=1, le=64)
    pipeline_depth: int | None = Field(None, ge=1, le=64)  # verify windows in flight at once

    @model_validator(mode="before")
    @classmethod
    def _mode_alone(cls, value: Any) -> Any:
        """`"speculative": "ngram-suffix"` and `"speculative": false` are shorthands."""
        if isinstance(value, bool):
            return {} if value else {"mode": "off"}
        return {"mode": value} if isinstance(value, str) else value


class GenerationParams(BaseModel):
    """Fields shared by chat and text completions."""

    model_config = ConfigDict(extra="ignore")

    # optional, as llama.cpp's server and vLLM have it: one model is served, so None means it
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)  # extension, as llama-server and vLLM
    min_p: float | None = Field(None, ge=0.0, le=1.0)  # extension
    repetition_penalty: float | None = Field(None, gt=0.0)  # extension
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: list[str] | None = None
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    return_token_ids: bool = False  # extension (as vLLM): prompt and completion token ids
    # OpenAI: partitions the prefix cache; requests share cached prefixes only under one key
    prompt_cache_key: str | None = Field(None, max_length=1024)
    speculative: SpeculativeOptions | None = None  # extension: see SpeculativeOptions
    # constrained decoding (JSON mode, a JSON Schema); on /v1/completions an extension
    response_format: ResponseFormat | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: list[str] | None) -> list[str] | None:
        if value is None:
            return None
        if len(value) > MAX_STOP_STRINGS:
            raise ValueError(f"Expected at most {MAX_STOP_STRINGS} stop strings, got {len(value)}")
        if any(not s for s in value):
            raise ValueError("Expected non-empty stop strings, got an empty one")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, value: dict[int, float] | None) -> dict[int, float] | None:
        for token_id, bias in (value or {}).items():
            if token_id < 0:
                raise ValueError(f"Expected logit_bias token ids >= 0, got {token_id}")
            if not -MAX_ABS_LOGIT_BIAS <= bias <= MAX_ABS_LOGIT_BIAS:
                raise ValueError(f"Expected logit_bias values in [-100, 100], got {bias} for token {token_id}")
        return value

    @field_validator("n")
    @classmethod
    def _check_n(cls, value: int) -> int:
        if value != 1:
            raise ValueError(f"Expected n=1, got {value}: one choice per request is supported; send {value} requests")
        return value


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_calls, tool_call_id reach the template

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(GenerationParams):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[dict[str, Any]] | None = None  # checked in tools.py
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # extension (as vLLM): template variables
    reasoning_effort: str | None = None  # "none" turns a thinking template's thought off
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)


class CompletionRequest(GenerationParams):
    max_tokens: int | None = Field(None, ge=0)  # 0 with echo: the prompt alone (its logprobs)
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)
    logprobs: int | None = Field(None, ge=0, le=5)


# ---- responses --------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class Timings(BaseModel):
    """llama-server's per-request figures (tools/server: `timings`)."""

    model_config = ConfigDict(extra="allow")  # backend-specific counters

    cache_n: int
    prompt_n: int
    prompt_ms: float
    prompt_per_token_ms: float
    prompt_per_second: float
    predicted_n: int
    predicted_ms: float
    predicted_per_token_ms: float
    predicted_per_second: float


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None
    refusal: list[ChatTokenLogprob] | None = None


class CompletionLogprobs(BaseModel):
    """The legacy completions shape; the prompt's first token (echo) has None everywhere."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None] | None
    text_offset: list[int]


class ToolCallFunction(BaseModel):
    name: str | None = Field(None, exclude_if=_omit_none)
    arguments: str | None = Field(None, exclude_if=_omit_none)  # JSON text (a fragment, in a delta)


class ToolCallDelta(BaseModel):
    """A streamed tool call: the first delta of a call carries its id, type and name."""

    index: int
    id: str | None = Field(None, exclude_if=_omit_none)
    type: Literal["function"] | None = Field(None, exclude_if=_omit_none)
    function: ToolCallFunction

    @classmethod
    def opening(cls, index: int, call) -> ToolCallDelta:
        return cls(index=index, id=call.id, type="function", function=ToolCallFunction(name=call.name, arguments=""))

    @classmethod
    def arguments_of(cls, index: int, call) -> ToolCallDelta:
        return cls(index=index, function=ToolCallFunction(arguments=call.arguments))


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = Field(None, exclude_if=_omit_none)
    tool_calls: list[dict[str, Any]] | None = Field(None, exclude_if=_omit_none)


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str
    token_ids: list[int] | None = Field(None, exclude_if=_omit_none)


class _Response(BaseModel):
    """What every completion response and chunk carries."""

    id: str
    object: str
    created: int
    model: str
    choices: list
    usage: Usage | None = Field(None, exclude_if=_omit_none)
    timings: Timings | None = Field(None, exclude_if=_omit_none)
    prompt_token_ids: list[int] | None = Field(None, exclude_if=_omit_none)


class ChatCompletion(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = Field(None, exclude_if=_omit_none)
    content: str | None = Field(None, exclude_if=_omit_none)
    reasoning_content: str | None = Field(None, exclude_if=_omit_none)
    tool_calls: list[ToolCallDelta] | None = Field(None, exclude_if=_omit_none)


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = Field(None, exclude_if=_omit_none)


class ChatCompletionChunk(_Response):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = Field(None, exclude_if=_omit_none)


class Completion(_Response):
    """A text completion, or one chunk of a streamed one (same object, as in OpenAI's API)."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "skippy"
    context_length: int
    num_stages: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class StandbyInfo(BaseModel):
    endpoint: str
    state: str  # ready, down
    active_sessions: int


class StageInfo(BaseModel):
    id: str
    layer_start: int
    layer_end: int  # exclusive
    endpoint: str
    state: str  # ready, down, restarting, failed
    active_sessions: int
    restarts: int = 0
    last_failure: str = ""
    standbys: list[StandbyInfo] = []  # the same layers elsewhere; requests fail over to them
    node_ip: str = ""  # the Ray node it runs on ("" when not on a cluster)
    moves: int = 0  # restarts that came back on another node
    # a live view's figures (driver/stage_figures.py): tokens_per_s, decode_forward_ms, queue_wait_ms,
    # queue_depth, prefix_cache_hit_rate, kv bytes, totals; stage 0 adds speculative_acceptance
    figures: dict[str, float] = {}
    # what it measured of itself and its link at start (decode_row_ms, prefill_chunk_ms, link_rtt_ms,
    # link_mbit_s, the dtypes it sends...), and its decode forward predicted from that against measured
    measured: dict[str, float | int | str | None] = {}
    predicted_vs_measured: dict[str, float] | None = None


class StageList(BaseModel):
    object: Literal["list"] = "list"
    data: list[StageInfo]
    # set when a stage is more than 15% off its prediction: the split its measured times give
    split_advice: dict | None = None


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorEnvelope(BaseModel):
    error: ErrorDetail
