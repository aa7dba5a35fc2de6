"""Render a model's jinja chat template the way transformers does.

Templates come from model files, which we do not control, so they run in jinja's
immutable sandbox. The environment mirrors transformers'
`utils/chat_template_utils._cached_compile_jinja_template`: trim_blocks and
lstrip_blocks, loop controls, a `tojson` that keeps non-ASCII text, and the
`raise_exception` / `strftime_now` helpers templates call. What a template sees
mirrors its `apply_chat_template` too: keys set to None are left out, a message's
reasoning under any of its names is offered under each, and `tools` and
`documents` are None unless given. tests/test_reference_templates.py holds real
models' templates to that.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

ROLES = frozenset({"system", "user", "assistant", "tool"})
REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")  # transformers' order of preference


class ChatTemplateError(ValueError):
    """A conversation the template cannot render, or a model without a template."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _tojson(value: Any, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    # jinja's own tojson escapes <, >, & and ' for HTML, which would change the prompt.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _GenerationTag(jinja2.ext.Extension):
    """Accept `{% generation %}...{% endgeneration %}` and render its body unchanged.

    transformers uses the tag to find assistant tokens for training masks; some
    templates carry it, and without this they would fail to compile.
    """

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller) -> str:
        return caller()


def _make_environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def flatten_content(content: Any, where: str) -> str:
    """A message's content as one string: a string as is, text parts joined with ""."""
    if isinstance(content, str):
        return content
    if not isinstance(content, Sequence):
        raise ChatTemplateError(
            f"Expected {where}.content to be a string or a list of text parts, got {type(content).__name__}."
        )
    texts = []
    for index, part in enumerate(content):
        part_where = f"{where}.content[{index}]"
        if not isinstance(part, Mapping):
            raise ChatTemplateError(f'Expected {part_where} to be a {{"type": "text", ...}} object, got {part!r}.')
        if part.get("type") != "text":
            raise ChatTemplateError(
                f"Expected {part_where} to have type 'text', got {part.get('type')!r}. "
                f"Fix: this model takes text only; send the content as text parts or a string."
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise ChatTemplateError(f"Expected {part_where}.text to be a string, got {type(text).__name__}.")
        texts.append(text)
    return "".join(texts)


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Check roles and content, and return copies as transformers hands them to a template:
    content a plain string, keys whose value is None left out (OpenAI clients send
    `tool_calls: null`, which templates testing `'tool_calls' in message` misread), and
    reasoning under each of its names (Qwen3's template reads `reasoning_content`).

    An assistant message that carries `tool_calls` may have no content.
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ChatTemplateError(f"Expected messages to be a list of objects, got {type(messages).__name__}.")
    normalized = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"Expected {where} to be an object with role and content, got {message!r}.")
        role = message.get("role")
        if role not in ROLES:
            raise ChatTemplateError(f"Expected {where}.role to be one of {sorted(ROLES)}, got {role!r}.")
        plain = {key: value for key, value in message.items() if value is not None}
        content = message.get("content")
        if content is not None:
            plain["content"] = flatten_content(content, where)
        elif not (role == "assistant" and message.get("tool_calls")):
            raise ChatTemplateError(f"Expected {where}.content to be a string or a list of text parts, got nothing.")
        reasoning = next((plain[key] for key in REASONING_KEYS if key in plain), None)
        if reasoning is not None:
            plain = {"thinking": reasoning, **plain, "reasoning_content": reasoning}
        normalized.append(plain)
    return normalized


class ChatTemplate:
    """A compiled chat template plus the special-token strings it may refer to."""

    def __init__(self, source: str, *, bos_token: str | None, eos_token: str | None):
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        try:
            self._template = _make_environment().from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as error:
            raise ChatTemplateError(
                f"Expected a valid jinja chat template, got a syntax error at line {error.lineno}: {error.message}. "
                f"Fix: pass a corrected template, or use --raw to send prompts untemplated."
            ) from error

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **extra: Any) -> str:
        """The prompt text for `messages`; `extra` reaches the template as variables (e.g. tools)."""
        # transformers always passes tools and documents: `tools is not none` must be false without any.
        variables = {"bos_token": self.bos_token, "eos_token": self.eos_token, "tools": None, "documents": None,
                     **extra, "add_generation_prompt": add_generation_prompt}
        normalized = normalize_messages(messages)
        try:
            try:
                return self._template.render(messages=normalized, **variables)
            except (TypeError, jinja2.exceptions.UndefinedError):
                if all("content" in m for m in normalized):
                    raise
                # A template that reads every message's content (Qwen3's) fails on a tool call without
                # any, in transformers too; llama.cpp's server renders such content as empty text.
                normalized = [dict(m, content=m.get("content", "")) for m in normalized]
                return self._template.render(messages=normalized, **variables)
        except TypeError as error:
            raise ChatTemplateError(f"The chat template cannot render this conversation: {error}") from error
        except jinja2.exceptions.TemplateError as error:
            # raise_exception() lands here: the template's own words say what is wrong.
            raise ChatTemplateError(f"The chat template rejected the conversation: {error}") from error


# Chat templates of model families whose files may carry none (a base model's GGUF, such
# as the Gemma 3 270M one): the family's own, keyed by GGUF architecture. Gemma 3's is the
# template of Google's instruction-tuned Gemma 3 checkpoints (tokenizer_config.json): a
# system message is prefixed to the first user turn, the assistant's role is "model".
GEMMA3_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\\n'}}
{%- endif -%}
"""
FAMILY_TEMPLATES = {"gemma3": GEMMA3_TEMPLATE}
