"""`POST /v1/responses` (OpenAI's Responses API, as vLLM serves it) over the chat path.

    ResponsesRequest         the request; to_chat() -> the ChatCompletionRequest it runs as
    ResponseStore            responses kept for `previous_response_id` (bounded, in memory)
    respond_once / events    a run's ChatOutput -> the Response object, or its SSE events

A request becomes a chat completion, so tool calls, reasoning and structured output behave
exactly as on /v1/chat/completions. `previous_response_id` puts a kept response's
conversation (not its instructions) first; `store: false` keeps nothing.
"""

from __future__ import annotations

import collections
import json
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from .chat_output import ChatOutput, ChatShape
from .errors import ApiError, to_api_error
from .generation import Generation, Job
from .schemas import ChatCompletionRequest

MAX_STORED_RESPONSES = 256


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None  # None: the one model served (as on chat and completions)
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None  # {"format": {"type": "text" | "json_object" | "json_schema", ...}}
    reasoning: dict[str, Any] | None = None  # {"effort": ...}
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    seed: int | None = None  # extension, as on chat
    top_k: int | None = Field(None, ge=0)  # extension
    prompt_cache_key: str | None = Field(None, max_length=1024)

    def conversation(self, store: ResponseStore) -> list[dict[str, Any]]:
        """The chat messages before `instructions`: the previous response's conversation, then the input."""
        history: list[dict[str, Any]] = []
        if self.previous_response_id is not None:
            kept = store.get(self.previous_response_id)
            if kept is None:
                raise ApiError(404, f"Previous response with id {self.previous_response_id!r} not found",
                               param="previous_response_id", code="previous_response_not_found")
            history = list(kept["conversation"])
        return history + input_messages(self.input)

    def to_chat(self, conversation: list[dict[str, Any]]) -> ChatCompletionRequest:
        messages = ([{"role": "system", "content": self.instructions}] if self.instructions else []) + conversation
        if not messages:
            raise ApiError(400, "Expected input to hold at least one message", param="input")
        fields: dict[str, Any] = {
            "model": self.model, "messages": messages, "max_tokens": self.max_output_tokens,
            "temperature": self.temperature, "top_p": self.top_p, "seed": self.seed, "top_k": self.top_k,
            "prompt_cache_key": self.prompt_cache_key, "stream": self.stream,
            "parallel_tool_calls": self.parallel_tool_calls,
        }  # fmt: skip
        if self.tools:
            fields["tools"] = [_chat_tool(tool, index) for index, tool in enumerate(self.tools)]
        if self.tool_choice is not None:
            fields["tool_choice"] = _chat_tool_choice(self.tool_choice)
        text_format = (self.text or {}).get("format")
        if text_format:
            fields["response_format"] = _chat_format(text_format)
        effort = (self.reasoning or {}).get("effort")
        if effort is not None:
            fields["reasoning_effort"] = effort
        return ChatCompletionRequest.model_validate(fields)


class ResponseStore:
    """The last MAX_STORED_RESPONSES responses (object and conversation), oldest dropped first."""

    def __init__(self, max_kept: int = MAX_STORED_RESPONSES):
        self._kept: collections.OrderedDict[str, dict[str, Any]] = collections.OrderedDict()
        self._max_kept = max_kept

    def get(self, response_id: str) -> dict[str, Any] | None:
        return self._kept.get(response_id)

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        self._kept[response["id"]] = {"response": response, "conversation": conversation}
        while len(self._kept) > self._max_kept:
            self._kept.popitem(last=False)


# ---- the run ------------------------------------------------------------------------


class ResponseRun:
    """One request's Response object, built from its ChatOutput (whole or event by event)."""

    def __init__(self, body: ResponsesRequest, job: Job, conversation: list[dict[str, Any]], store: ResponseStore,
                 count_tokens):
        self.body, self.job, self._conversation, self._store = body, job, conversation, store
        self.id = "resp_" + uuid.uuid4().hex
        self.created_at = int(time.time())
        self.output = ChatOutput(job.shape or ChatShape(None, False, None))
        self._count_tokens = count_tokens

    def response(self, generation: Generation | None, status: str = "completed") -> dict[str, Any]:
        body = self.body
        output = [] if generation is None else self._items()
        incomplete = None
        if generation is not None and generation.finish_reason == "length":
            status, incomplete = "incomplete", {"reason": "max_output_tokens"}
        text_format = (body.text or {}).get("format") or {"type": "text"}
        response = {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "model": self.job.model, "output": output, "error": None, "incomplete_details": incomplete,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id, "store": body.store,
            "reasoning": {"effort": (body.reasoning or {}).get("effort"), "summary": None},
            "temperature": body.temperature, "top_p": body.top_p, "text": {"format": text_format},
            "tool_choice": body.tool_choice or "auto", "tools": body.tools or [], "truncation": "disabled",
            "metadata": body.metadata or {}, "user": body.user,
        }  # fmt: skip
        if generation is not None:
            usage = generation.usage()
            reasoning = self._reasoning_text()
            response["usage"] = {
                "input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens,
                "total_tokens": usage.total_tokens,
                "input_tokens_details": {"cached_tokens": usage.prompt_tokens_details.cached_tokens},
                "output_tokens_details": {"reasoning_tokens": self._count_tokens(reasoning) if reasoning else 0},
            }  # fmt: skip
        return response

    def keep(self, response: dict[str, Any]) -> None:
        if not self.body.store:
            return
        message = self.output.message()
        reply: dict[str, Any] = {"role": "assistant", "content": message.content}
        if message.tool_calls:
            reply["tool_calls"] = message.tool_calls
        self._store.put(response, [*self._conversation, reply])

    def _reasoning_text(self) -> str:
        return self.output.message().reasoning_content or ""

    def _items(self) -> list[dict[str, Any]]:
        message, items = self.output.message(), []
        if message.reasoning_content:
            items.append(_reasoning_item(self.id, message.reasoning_content, "completed"))
        if message.content:
            items.append(_message_item(self.id, message.content, "completed"))
        for call in message.tool_calls or ():
            items.append(_call_item(call["id"], call["function"]["name"], call["function"]["arguments"], "completed"))
        return items


async def respond_once(run: ResponseRun, generation: Generation) -> dict[str, Any]:
    async for piece in generation.pieces():
        run.output.push(piece)
    run.output.flush()
    response = run.response(generation)
    run.keep(response)
    return response


async def events(run: ResponseRun, generation: Generation) -> AsyncIterator[bytes]:
    """The Responses API's SSE events: created, in_progress, each item's added / deltas / done,
    completed (incomplete at max_output_tokens). A failure becomes an `error` event."""
    stream = _EventStream()
    yield stream.event("response.created", response=run.response(None, "in_progress"))
    yield stream.event("response.in_progress", response=run.response(None, "in_progress"))
    try:
        async for piece in generation.pieces():
            for delta in run.output.push(piece):
                for event in stream.delta(run.id, delta):
                    yield event
        for delta in run.output.flush():
            for event in stream.delta(run.id, delta):
                yield event
        for event in stream.close_item():
            yield event
        response = run.response(generation)
        run.keep(response)
        kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
        yield stream.event(kind, response=response)
    except Exception as exc:
        error = to_api_error(exc)
        yield stream.event("error", code=error.code, message=error.message, param=error.param)


class _EventStream:
    """Numbers events and keeps the open output item (reasoning, message or function call)."""

    def __init__(self):
        self._sequence = 0
        self._index = -1
        self._open: dict[str, Any] | None = None
        self._text = ""

    def event(self, kind: str, **fields) -> bytes:
        payload = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n".encode()

    def delta(self, response_id: str, delta) -> list[bytes]:
        out: list[bytes] = []
        if delta.reasoning_content:
            if self._open is None or self._open["type"] != "reasoning":
                out += self._open_item(_reasoning_item(response_id, "", "in_progress"))
            self._text += delta.reasoning_content
            out.append(self.event("response.reasoning_text.delta", item_id=self._open["id"],
                                  output_index=self._index, content_index=0, delta=delta.reasoning_content))
        if delta.content:
            if self._open is None or self._open["type"] != "message":
                item = _message_item(response_id, "", "in_progress")
                item["content"] = []
                out += self._open_item(item)
                out.append(self.event("response.content_part.added", item_id=item["id"], output_index=self._index,
                                      content_index=0, part=_text_part("")))
            self._text += delta.content
            out.append(self.event("response.output_text.delta", item_id=self._open["id"], output_index=self._index,
                                  content_index=0, delta=delta.content, logprobs=[]))
        for call in delta.tool_calls or ():
            if call.id is not None:  # a call's first delta opens its item
                out += self._open_item(_call_item(call.id, call.function.name, "", "in_progress"))
            elif call.function.arguments:
                self._text += call.function.arguments
                out.append(self.event("response.function_call_arguments.delta", item_id=self._open["id"],
                                      output_index=self._index, delta=call.function.arguments))
        return out

    def _open_item(self, item: dict[str, Any]) -> list[bytes]:
        out = self.close_item()
        self._index += 1
        self._open, self._text = item, ""
        out.append(self.event("response.output_item.added", output_index=self._index, item=item))
        return out

    def close_item(self) -> list[bytes]:
        item, text, out = self._open, self._text, []
        if item is None:
            return out
        self._open = None
        where = {"item_id": item["id"], "output_index": self._index}
        if item["type"] == "reasoning":
            out.append(self.event("response.reasoning_text.done", **where, content_index=0, text=text))
            done = _reasoning_item(item["id"].removeprefix("rs_"), text, "completed", item_id=item["id"])
        elif item["type"] == "message":
            out.append(self.event("response.output_text.done", **where, content_index=0, text=text, logprobs=[]))
            out.append(self.event("response.content_part.done", **where, content_index=0, part=_text_part(text)))
            done = _message_item("", text, "completed", item_id=item["id"])
        else:
            out.append(self.event("response.function_call_arguments.done", **where, arguments=text,
                                  name=item["name"]))
            done = _call_item(item["call_id"], item["name"], text, "completed")
        out.append(self.event("response.output_item.done", output_index=self._index, item=done))
        return out


# ---- items and conversions --------------------------------------------------------------


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message_item(response_id: str, text: str, status: str, item_id: str | None = None) -> dict[str, Any]:
    return {"type": "message", "id": item_id or "msg_" + response_id.removeprefix("resp_"), "status": status,
            "role": "assistant", "content": [_text_part(text)]}


def _reasoning_item(response_id: str, text: str, status: str, item_id: str | None = None) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id or "rs_" + response_id.removeprefix("resp_"), "status": status,
            "summary": [], "content": [{"type": "reasoning_text", "text": text}]}


def _call_item(call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": "fc_" + call_id.removeprefix("call_"), "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The Responses API's input as chat messages: messages (text parts joined), function calls
    (consecutive ones in one assistant message) and their outputs (tool messages)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for index, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message" or ("role" in item and kind not in ("function_call", "function_call_output")):
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise ApiError(400, f"Expected input[{index}].role to be user, assistant, system or developer, "
                                    f"got {role!r}", param="input")
            messages.append({"role": "system" if role == "developer" else role,
                             "content": _text(item.get("content"), f"input[{index}]")})
        elif kind == "function_call":
            call = {"id": item.get("call_id") or item.get("id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "")}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": _text(item.get("output"), f"input[{index}].output")})
        elif kind == "reasoning":
            continue  # a past thought: templates drop them from the history
        else:
            raise ApiError(400, f"input[{index}] has type {kind!r}; this server takes message, function_call, "
                                "function_call_output and reasoning items", param="input")
    return messages


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") not in ("input_text", "output_text", "text"):
                raise ApiError(400, f"Expected {where}.content to hold text parts (input_text, output_text), got "
                                    f"{json.dumps(part)[:100]}", param="input")
            texts.append(str(part.get("text", "")))
        return "".join(texts)
    raise ApiError(400, f"Expected {where}.content to be text or a list of text parts", param="input")


def _chat_tool(tool: Mapping[str, Any], index: int) -> dict[str, Any]:
    if tool.get("type") != "function":
        raise ApiError(400, f"tools[{index}] has type {tool.get('type')!r}; this server runs function tools only",
                       param="tools")
    function = {key: tool[key] for key in ("name", "description", "parameters") if tool.get(key) is not None}
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: str | Mapping[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, Mapping) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice if isinstance(choice, str) else dict(choice)


def _chat_format(text_format: Mapping[str, Any]) -> dict[str, Any]:
    if text_format.get("type") != "json_schema":
        return dict(text_format)
    schema = {"name": text_format.get("name", "response"), "schema": text_format.get("schema")}
    if text_format.get("strict") is not None:
        schema["strict"] = text_format["strict"]
    return {"type": "json_schema", "json_schema": schema}
