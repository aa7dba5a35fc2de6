"""A chat reply's shape: the prompt a request's tools and reasoning need, and the text out split
into reasoning, content and tool calls (whole, or as OpenAI's streamed deltas).

Reasoning is split first (a thought may mention a call it never makes), then the rest goes
through the tool-call parser.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from ..protocol.constants import GrammarKind
from ..protocol.sampling_config import GrammarSpec
from .errors import ApiError
from .reasoning import RESERVED_VARIABLES, Reasoning, ReasoningStream
from .schemas import AssistantMessage, ChatCompletionRequest, ChatDelta, ChatMessage, ToolCallDelta
from .tools import ToolCall, ToolCallStream, ToolPlan


@dataclass(frozen=True, slots=True)
class ChatShape:
    reasoning: Reasoning | None
    starts_in_thought: bool  # the prompt opened the think block
    tools: ToolPlan | None

    @property
    def is_plain(self) -> bool:
        return self.tools is None and not (self.reasoning and self.reasoning.splits)


async def render_chat(ctx, body: ChatCompletionRequest) -> tuple[list[int], ChatShape, GrammarSpec | None]:
    """The prompt ids for the request's messages with its tools and reasoning switch, the reply's
    shape, and, for a forced tool choice, the grammar that makes the reply a valid call."""
    messages = [chat_message(message) for message in body.messages]
    template = ctx.tokenizer.chat_template
    plan = ToolPlan.build(template, body.tools, body.tool_choice, body.parallel_tool_calls)
    reasoning = Reasoning.for_request(template, body.chat_template_kwargs, body.reasoning_effort)
    variables = dict(reasoning.variables) if reasoning else {}
    bad = sorted(set(variables) & RESERVED_VARIABLES)
    if bad:
        raise ApiError(400, f"chat_template_kwargs may not set {', '.join(bad)}", param="chat_template_kwargs")
    if plan is not None and plan.is_native:
        variables["tools"] = plan.template_tools()
    if plan is not None:
        messages = plan.prepare_messages(messages)
    prompt = await asyncio.to_thread(ctx.tokenizer.apply_chat_template, messages, True, **variables)
    prompt_ids = await asyncio.to_thread(ctx.tokenizer.encode, prompt, False)
    starts_in_thought = bool(reasoning and reasoning.splits and Reasoning.opens_in_thought(prompt))
    grammar = None
    if plan is not None and plan.is_forced:
        if body.response_format is not None and body.response_format.type != "text":
            raise ApiError(400, "A required or named tool_choice constrains the reply already; send it without "
                                "response_format", param="response_format")
        prefix = reasoning.grammar_prefix(prompt) if reasoning and reasoning.splits else ""
        grammar = GrammarSpec(GrammarKind.LARK, plan.grammar(prefix))
        try:
            await asyncio.to_thread(ctx.backend.check_grammar, grammar)
        except ValueError as exc:
            raise ApiError(400, f"tools cannot be enforced: {exc}", param="tools",
                           code="invalid_tool_schema") from None
    return prompt_ids, ChatShape(reasoning, starts_in_thought, plan), grammar


def chat_message(message: ChatMessage) -> dict[str, Any]:
    """A request message as the template reads it: the fields the client sent (its tool_calls,
    tool_call_id, name, reasoning_content, ...), with OpenAI's newer "developer" as "system"."""
    fields = message.model_dump(exclude_none=True)
    if fields["role"] == "developer":
        fields["role"] = "system"
    return fields


class ChatOutput:
    """One reply's text in; OpenAI deltas out, and the whole message at the end."""

    def __init__(self, shape: ChatShape):
        self._shape = shape
        splits = shape.reasoning is not None and shape.reasoning.splits
        self._thought = ReasoningStream(shape.starts_in_thought) if splits else None
        self._calls = ToolCallStream(shape.tools) if shape.tools is not None else None
        self._content: list[str] = []
        self._reasoning: list[str] = []
        self.calls: list[ToolCall] = []

    def push(self, piece: str) -> list[ChatDelta]:
        return self._deltas(*(self._thought.push(piece) if self._thought else ("", piece)), is_final=False)

    def flush(self) -> list[ChatDelta]:
        return self._deltas(*(self._thought.flush() if self._thought else ("", "")), is_final=True)

    def _deltas(self, reasoning: str, content: str, is_final: bool) -> list[ChatDelta]:
        calls: list[ToolCall] = []
        if self._calls is not None:
            content, calls = self._calls.push(content)
            if is_final:
                tail, more = self._calls.flush()
                content, calls = content + tail, calls + more
        deltas = []
        if reasoning:
            self._reasoning.append(reasoning)
            deltas.append(ChatDelta(reasoning_content=reasoning))
        if content:
            self._content.append(content)
            deltas.append(ChatDelta(content=content))
        for call in calls:
            index = len(self.calls)
            self.calls.append(call)
            deltas.append(ChatDelta(tool_calls=[ToolCallDelta.opening(index, call)]))
            deltas.append(ChatDelta(tool_calls=[ToolCallDelta.arguments_of(index, call)]))
        return deltas

    def message(self) -> AssistantMessage:
        content = "".join(self._content)
        reasoning = "".join(self._reasoning) or None
        if self.calls:
            return AssistantMessage(content=content or None, reasoning_content=reasoning,
                                    tool_calls=[call.to_openai() for call in self.calls])
        return AssistantMessage(content=content, reasoning_content=reasoning)

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if self.calls and reason == "stop" else reason
