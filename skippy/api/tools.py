"""Tool calls: the model's tool format, the prompt it needs, the grammar that enforces a call,
and the parser that turns the output back into OpenAI `tool_calls`.

    ToolFormat.detect(template)       which format the chat template speaks (GENERIC: none)
    ToolPlan.build(...)               one request's tools, choice and format, checked (400s)
    plan.prepare_messages(messages)   the history as the template needs it (generic: the
                                      tool instruction in the system prompt, calls as JSON)
    plan.grammar(prefix)              the lark grammar of "one (or several) valid call(s)"
    ToolCallStream(plan)              text pieces in -> content text and whole calls out,
                                      holding back text that may be the start of a call

A template that reads `tools` renders them itself and the model answers in its own format
(ToolFormat); one without (SmolLM2's) gets the generic format llama.cpp's server uses: an
instruction in the system prompt and a `{"tool_calls": [...]}` JSON reply.
"""

from __future__ import annotations

import copy
import enum
import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .errors import ApiError

# The grammar engine's JSON options for every embedded schema (as model/grammar.py's JSON_OPTIONS):
# one space after "," and ":", no free whitespace a small model could fill until max_tokens.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_TOOLS = 128
MAX_PARALLEL_CALLS = 8  # an enforced reply's calls: a small model may otherwise repeat calls until max_tokens


class ToolFormat(enum.Enum):
    HERMES = "hermes"  # <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>, one block a call
    LLAMA3_JSON = "llama3_json"  # {"name": ..., "parameters": {...}}
    MISTRAL = "mistral"  # [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]
    GENERIC = "generic"  # ours in the system prompt: {"tool_calls": [{"name": ..., "arguments": ...}]}

    @classmethod
    def detect(cls, template: str | None) -> ToolFormat:
        """The format the template's own tool rendering teaches (its markers say which)."""
        text = template or ""
        if "tools" not in text:
            return cls.GENERIC
        if "<tool_call>" in text:
            return cls.HERMES
        if "[TOOL_CALLS]" in text:
            return cls.MISTRAL
        if "parameters" in text and ("<|python_tag|>" in text or "ipython" in text):
            return cls.LLAMA3_JSON
        return cls.GENERIC  # reads tools in a way we cannot parse back: ours instead

    @property
    def arguments_key(self) -> str:
        return "parameters" if self is ToolFormat.LLAMA3_JSON else "arguments"


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object's text, as OpenAI sends it

    @classmethod
    def new(cls, name: str, arguments: Mapping[str, Any]) -> ToolCall:
        return cls("call_" + uuid.uuid4().hex[:24], name, json.dumps(arguments, ensure_ascii=False))

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """One request's tools: what the model is shown, what it must (or may) answer."""

    format: ToolFormat
    functions: tuple[dict[str, Any], ...]  # each {"name", "description"?, "parameters"}
    declared: tuple[dict[str, Any], ...]  # the request's tools as sent: what a template renders
    choice: str  # "auto" or "required"
    forced_name: str | None  # a named tool_choice: only this function
    parallel: bool

    @classmethod
    def build(cls, template: str | None, tools: Sequence[Mapping[str, Any]] | None,
              tool_choice: str | Mapping[str, Any] | None, parallel_tool_calls: bool | None) -> ToolPlan | None:
        """The plan, or None when the request asks for no tool use (no tools, or choice none)."""
        if tool_choice is not None and not tools and tool_choice != "none":
            raise ApiError(400, "tool_choice needs tools: send the functions it may call", param="tool_choice")
        if not tools or tool_choice == "none":
            return None
        if len(tools) > MAX_TOOLS:
            raise ApiError(400, f"Expected at most {MAX_TOOLS} tools, got {len(tools)}", param="tools")
        functions = tuple(_function(tool, f"tools[{index}]") for index, tool in enumerate(tools))
        names = [f["name"] for f in functions]
        if len(set(names)) != len(names):
            raise ApiError(400, "Expected distinct tool names, got a repeated one", param="tools")
        forced_name, choice = None, tool_choice or "auto"
        if isinstance(choice, Mapping):
            forced_name = ((choice.get("function") or {}).get("name") if choice.get("type") == "function"
                           else None)
            if not isinstance(forced_name, str):
                raise ApiError(400, 'Expected tool_choice {"type": "function", "function": {"name": ...}}, got '
                                    f"{json.dumps(choice)[:200]}", param="tool_choice")
            if forced_name not in names:
                raise ApiError(400, f"tool_choice names {forced_name!r}, which is not among the tools "
                                    f"({', '.join(names)})", param="tool_choice")
            choice = "required"
        elif choice not in ("auto", "required"):
            raise ApiError(400, f"Expected tool_choice 'none', 'auto', 'required' or a named function, got "
                                f"{choice!r}", param="tool_choice")
        return cls(ToolFormat.detect(template), functions, tuple(copy.deepcopy(list(tools))), choice, forced_name,
                   parallel=parallel_tool_calls is not False and forced_name is None)

    @property
    def is_forced(self) -> bool:
        return self.choice == "required"

    @property
    def is_native(self) -> bool:
        return self.format is not ToolFormat.GENERIC

    def template_tools(self) -> list[dict[str, Any]]:
        """`tools` for the template: the client's own objects, key order and all, since templates
        write them out with `tojson` or key by key (as transformers gets them from its caller)."""
        return copy.deepcopy(list(self.declared))

    # ---- the prompt ----------------------------------------------------------------

    def prepare_messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The history for the template. Native: call arguments as objects (what templates
        iterate over). Generic: the tool instruction joins the system prompt, past calls
        become the JSON the model is asked to write, tool results a user turn."""
        if self.is_native:
            return prepare_history(messages)
        prepared = generic_history(messages)
        instruction = self._instruction()
        if prepared and prepared[0]["role"] == "system":
            prepared[0] = dict(prepared[0], content=f"{prepared[0]['content']}\n\n{instruction}")
        else:
            prepared.insert(0, {"role": "system", "content": instruction})
        return prepared

    def _instruction(self) -> str:
        listing = "\n".join(json.dumps(f, ensure_ascii=False) for f in self._offered())
        if self.is_forced:
            ask = "You must call a tool: reply with only this JSON object, nothing else:"
        else:
            ask = ("When a tool helps, reply with only this JSON object, nothing else; "
                   "otherwise answer the user in plain text:")
        many = " (one entry per call)" if self.parallel else ""
        return (f"You can call these tools (JSON descriptions, one per line):\n{listing}\n\n{ask}\n"
                f'{{"tool_calls": [{{"name": "<tool name>", "arguments": {{<arguments>}}}}]}}{many}')

    def _offered(self) -> tuple[dict[str, Any], ...]:
        if self.forced_name is None:
            return self.functions
        return tuple(f for f in self.functions if f["name"] == self.forced_name)

    # ---- the grammar ---------------------------------------------------------------

    def grammar(self, prefix: str = "") -> str:
        """A lark grammar (llguidance's dialect) for the output of a forced choice: `prefix`
        (a lark expression, e.g. a reasoning block) then one call to an offered function with
        arguments matching its parameters schema, or several with parallel_tool_calls."""
        one = _lark_json(self._call_schema())
        calls = {"type": "array", "items": self._call_schema(), "minItems": 1,
                 "maxItems": MAX_PARALLEL_CALLS if self.parallel else 1}
        key = self.format
        if key is ToolFormat.GENERIC:
            body = _lark_json({"type": "object", "properties": {"tool_calls": calls}, "required": ["tool_calls"]})
            rules = [f"calls: {body}"]
        elif key is ToolFormat.HERMES:
            repeat = f' ("\\n" call){{0,{MAX_PARALLEL_CALLS - 1}}}' if self.parallel else ""
            rules = [f"calls: call{repeat}", f'call: "<tool_call>\\n" {one} "\\n</tool_call>"']
        elif key is ToolFormat.MISTRAL:
            rules = [f'calls: "[TOOL_CALLS]" {_lark_json(calls)}']
        else:  # Llama 3.x: one JSON object a reply
            rules = [f"calls: {one}"]
        return "\n".join([f"start: {prefix} calls" if prefix else "start: calls", *rules])

    def _call_schema(self) -> dict[str, Any]:
        key = self.format.arguments_key
        options = [{"type": "object", "properties": {"name": {"const": f["name"]}, key: _closed(f["parameters"])},
                    "required": ["name", key], "additionalProperties": False} for f in self._offered()]
        return options[0] if len(options) == 1 else {"anyOf": options}

    # ---- the output ----------------------------------------------------------------

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """(the text that is no call, the calls) of a whole reply. Anything that does not
        parse as a call to a declared function stays text."""
        names = {f["name"] for f in self.functions}
        if self.format is ToolFormat.HERMES:
            calls, rest = [], []
            position = 0
            for match in re.finditer(r"<tool_call>(.*?)(?:</tool_call>|\Z)", text, re.DOTALL):
                found = _calls_in(match.group(1), "arguments", names)
                if found is None:
                    continue
                rest.append(text[position:match.start()])
                calls.extend(found)
                position = match.end()
            rest.append(text[position:])
            return ("".join(rest).strip() if calls else text), calls
        body = text.strip()
        if self.format is ToolFormat.MISTRAL:
            if not body.startswith("[TOOL_CALLS]"):
                return text, []
            body = body.removeprefix("[TOOL_CALLS]")
        elif self.format is ToolFormat.LLAMA3_JSON:
            body = body.removeprefix("<|python_tag|>")
        body = _unfenced(body)
        found = _calls_in(body, self.format.arguments_key, names)
        return ("", found) if found else (text, [])

    def may_start_call(self, text: str) -> int | None:
        """Where in `text` a call may begin (held back while streaming), or None."""
        if self.format is ToolFormat.HERMES:
            return _marker_start(text, "<tool_call>")
        stripped = text.lstrip()
        offset = len(text) - len(stripped)
        if not stripped:
            return 0 if text else None
        starts = {ToolFormat.MISTRAL: ("[TOOL_CALLS]",), ToolFormat.LLAMA3_JSON: ("{", "<|python_tag|>")}
        for start in starts.get(self.format, ("{", "```")):
            if stripped.startswith(start) or start.startswith(stripped):
                return offset
        return None


class ToolCallStream:
    """Text pieces in; (content text, whole calls) out as they settle.

    Text is released as soon as it cannot be the start of a call. The generic, Llama 3 and
    Mistral formats are the whole reply: one that begins like a call is held to the end and
    parsed there. Hermes blocks are released one by one, each as its `</tool_call>` arrives;
    trailing whitespace waits for what follows it (between calls it is no content).
    """

    def __init__(self, plan: ToolPlan):
        self._plan = plan
        self._held = ""
        self._released_any = False
        self.calls: list[ToolCall] = []

    def push(self, text: str) -> tuple[str, list[ToolCall]]:
        self._held += text
        if self._plan.format is ToolFormat.HERMES:
            return self._release_blocks(is_final=False)
        if self._released_any or self._plan.may_start_call(self._held) is None:
            text, self._held = self._held, ""
            self._released_any = self._released_any or bool(text)
            return text, []
        return "", []

    def flush(self) -> tuple[str, list[ToolCall]]:
        if self._plan.format is ToolFormat.HERMES:
            return self._release_blocks(is_final=True)
        text, self._held = self._held, ""
        if self._released_any:
            return text, []
        rest, calls = self._plan.parse(text)
        self.calls.extend(calls)
        return rest, calls

    def _release_blocks(self, is_final: bool) -> tuple[str, list[ToolCall]]:
        out, calls = [], []
        while True:
            start = self._held.find("<tool_call>")
            end = -1 if start < 0 else self._held.find("</tool_call>", start)
            if start < 0 or (end < 0 and not is_final):
                if start < 0:
                    start = len(self._held) - (0 if is_final else _partial_marker(self._held, "<tool_call>"))
                if not is_final:  # trailing whitespace waits
                    start = len(self._held[:start].rstrip())
                out.append(self._held[:start])
                self._held = self._held[start:]
                break
            stop = len(self._held) if end < 0 else end + len("</tool_call>")
            block = self._held[start:stop]
            rest, found = self._plan.parse(block)
            out.append(self._held[:start] + (rest if found else block))
            calls.extend(found)
            self._held = self._held[stop:]
        self.calls.extend(calls)
        text = "".join(out)
        if self.calls and (is_final or calls):  # whitespace around calls is no content
            text = text.strip() if not self._released_any else text.rstrip()
        self._released_any = self._released_any or bool(text)
        return text, calls


# ---- history ------------------------------------------------------------------------


def prepare_history(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tool-call arguments as objects: templates render `arguments | tojson` or iterate over
    them, and OpenAI clients send them as JSON text (as vLLM, we parse them back)."""
    prepared = []
    for message in messages:
        calls = message.get("tool_calls")
        if message["role"] == "assistant" and calls:
            message = dict(message, tool_calls=[_call_with_object(call) for call in calls])
        prepared.append(message)
    return prepared


def generic_history(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For a template without tools: past calls as the JSON reply we ask for, tool results as
    user turns (llama.cpp's server does the same for such templates)."""
    names: dict[str, str] = {}
    prepared = []
    for message in prepare_history(messages):
        role, calls = message["role"], message.get("tool_calls")
        if role == "assistant" and calls:
            entries = []
            for call in calls:
                function = call.get("function") or {}
                names[call.get("id", "")] = function.get("name", "")
                entries.append({"name": function.get("name"), "arguments": function.get("arguments")})
            text = json.dumps({"tool_calls": entries}, ensure_ascii=False)
            content = f"{message['content']}\n{text}" if message.get("content") else text
            prepared.append({"role": "assistant", "content": content})
        elif role == "tool":
            result = {"tool_response": {"name": names.get(message.get("tool_call_id", ""), message.get("name")),
                                        "content": message.get("content")}}
            prepared.append({"role": "user", "content": json.dumps(result, ensure_ascii=False)})
        else:
            prepared.append({key: value for key, value in message.items() if key in ("role", "content")})
    return prepared


def _call_with_object(call: Any) -> Any:
    if not isinstance(call, Mapping) or not isinstance(call.get("function"), Mapping):
        raise ApiError(400, 'Expected each tool_calls entry to be {"id", "type": "function", "function": '
                            '{"name", "arguments"}}', param="messages")
    function = dict(call["function"])
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            function["arguments"] = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            raise ApiError(400, f"Expected tool call arguments to be JSON text, got {arguments[:200]!r}",
                           param="messages") from None
    return dict(call, function=function)


# ---- helpers ------------------------------------------------------------------------


def _function(tool: Any, where: str) -> dict[str, Any]:
    if not isinstance(tool, Mapping) or tool.get("type", "function") != "function":
        raise ApiError(400, f'Expected {where} to be {{"type": "function", "function": {{...}}}}', param="tools")
    function = tool.get("function")
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str) or not function["name"]:
        raise ApiError(400, f"Expected {where}.function.name to be a non-empty string", param="tools")
    parameters = function.get("parameters")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, Mapping):
        raise ApiError(400, f"Expected {where}.function.parameters to be a JSON Schema object", param="tools")
    fields = {"name": function["name"], "parameters": copy.deepcopy(dict(parameters))}
    if function.get("description"):
        fields["description"] = str(function["description"])
    return fields


def _closed(parameters: dict[str, Any]) -> dict[str, Any]:
    """The parameters schema without keys it does not name, unless it says otherwise (as
    OpenAI's strict mode): a small model otherwise invents keys until max_tokens."""
    if "properties" in parameters and "additionalProperties" not in parameters:
        return {**parameters, "additionalProperties": False}
    return parameters


def _lark_json(schema: dict[str, Any]) -> str:
    return "%json " + json.dumps({"x-guidance": JSON_STYLE, **schema}, ensure_ascii=False)


def _calls_in(text: str, arguments_key: str, names: set[str]) -> list[ToolCall] | None:
    """The calls a JSON text holds (an object, a list of them, or {"tool_calls": [...]});
    None unless every one names a declared function with object arguments."""
    text = text.strip()
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        try:  # Llama 3 may separate calls with ";"
            value = [json.loads(part) for part in text.split(";") if part.strip()]
        except json.JSONDecodeError:
            return None
    if isinstance(value, Mapping) and "tool_calls" in value:
        value = value["tool_calls"]
    entries = value if isinstance(value, list) else [value]
    calls = []
    for entry in entries:
        if not isinstance(entry, Mapping) or entry.get("name") not in names:
            return None
        arguments = entry.get(arguments_key, entry.get("arguments", entry.get("parameters", {})))
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                return None
        if not isinstance(arguments, Mapping):
            return None
        calls.append(ToolCall.new(entry["name"], arguments))
    return calls or None


def _unfenced(text: str) -> str:
    match = re.fullmatch(r"```(?:json)?\s*(.*?)\s*```", text, re.DOTALL)
    return match.group(1) if match else text


def _marker_start(text: str, marker: str) -> int | None:
    found = text.find(marker)
    if found >= 0:
        return found
    hold = _partial_marker(text, marker)
    return len(text) - hold if hold else None


def _partial_marker(text: str, marker: str) -> int:
    """Length of the longest tail of `text` that `marker` starts with."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
