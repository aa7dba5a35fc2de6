"""Tool formats without a model: each format is detected from a template's text, its enforced
grammar (compiled by llguidance on SmolLM2's tokenizer) accepts a valid call in that format and
refuses one with bad arguments or an undeclared name, and the parser turns the model's text
back into calls (text that is no valid call stays text), whole and streamed in small pieces."""

from __future__ import annotations

import json

import pytest

from skippy.api.errors import ApiError
from skippy.api.tools import ToolCallStream, ToolFormat, ToolPlan
from skippy.model.grammar import GrammarCompiler
from skippy.protocol.constants import GrammarKind
from skippy.protocol.sampling_config import GrammarSpec

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}},
    {"type": "function", "function": {"name": "echo", "parameters": {
        "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}]
TEMPLATES = {  # the marker each family's template carries (ours, not any model's text)
    ToolFormat.HERMES: "{% for t in tools %}{{ t | tojson }}{% endfor %} answer in <tool_call></tool_call>",
    ToolFormat.MISTRAL: "{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}{% endif %}[TOOL_CALLS]",
    ToolFormat.LLAMA3_JSON: '{% if tools %}<|python_tag|>{"name": ..., "parameters": ...}{% endif %}ipython',
    ToolFormat.GENERIC: "{% for m in messages %}{{ m.content }}{% endfor %}",
}
ADD = '{"name": "add", "arguments": {"a": 1, "b": 2}}'
ECHO = '{"name": "echo", "arguments": {"text": "hi"}}'
VALID = {
    ToolFormat.HERMES: f"<tool_call>\n{ADD}\n</tool_call>\n<tool_call>\n{ECHO}\n</tool_call>",
    ToolFormat.MISTRAL: f"[TOOL_CALLS][{ADD}, {ECHO}]",
    ToolFormat.LLAMA3_JSON: '{"name": "add", "parameters": {"a": 1, "b": 2}}',
    ToolFormat.GENERIC: f'{{"tool_calls": [{ADD}, {ECHO}]}}',
}
EXPECTED = {ToolFormat.HERMES: 2, ToolFormat.MISTRAL: 2, ToolFormat.LLAMA3_JSON: 1, ToolFormat.GENERIC: 2}


@pytest.fixture(scope="module")
def grammars(tokenizer):
    return GrammarCompiler(tokenizer)


def accepts(grammars, tokenizer, grammar: str, text: str) -> bool:
    state = grammars.state(GrammarSpec(GrammarKind.LARK, grammar), 0)
    matcher = state._matcher
    ids = tokenizer.encode(text, add_special_tokens=False)
    return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()


@pytest.mark.parametrize("fmt", list(ToolFormat))
def test_each_format_is_detected_enforced_and_parsed(fmt, grammars, tokenizer):
    plan = ToolPlan.build(TEMPLATES[fmt], TOOLS, "required", None)
    assert plan.format is fmt
    grammar = plan.grammar()
    assert accepts(grammars, tokenizer, grammar, VALID[fmt])
    for bad in (VALID[fmt].replace('"a": 1', '"a": "one"'), VALID[fmt].replace('"add"', '"sub"')):
        assert not accepts(grammars, tokenizer, grammar, bad)
    content, calls = plan.parse(VALID[fmt])
    assert content == "" and len(calls) == EXPECTED[fmt]
    assert (calls[0].name, json.loads(calls[0].arguments)) == ("add", {"a": 1, "b": 2})
    for size in (1, 3, 7):  # streamed in pieces: the same calls, no text
        stream = ToolCallStream(plan)
        text = [stream.push(VALID[fmt][i:i + size])[0] for i in range(0, len(VALID[fmt]), size)]
        text.append(stream.flush()[0])
        assert "".join(text) == "" and [(c.name, c.arguments) for c in stream.calls] == \
            [(c.name, c.arguments) for c in calls]


def test_one_call_only_without_parallel_calls_and_named_choice(grammars, tokenizer):
    single = ToolPlan.build(TEMPLATES[ToolFormat.HERMES], TOOLS, "required", False).grammar()
    assert not accepts(grammars, tokenizer, single, VALID[ToolFormat.HERMES])
    assert accepts(grammars, tokenizer, single, f"<tool_call>\n{ADD}\n</tool_call>")
    named = ToolPlan.build(None, TOOLS, {"type": "function", "function": {"name": "echo"}}, None).grammar()
    assert accepts(grammars, tokenizer, named, f'{{"tool_calls": [{ECHO}]}}')
    assert not accepts(grammars, tokenizer, named, f'{{"tool_calls": [{ADD}]}}')


def test_auto_text_stays_text_and_text_before_a_hermes_call_streams():
    generic = ToolPlan.build(None, TOOLS, "auto", None)
    for text in ("The answer is 3.", '{"name": "nope", "arguments": {}}', "{not json"):
        assert generic.parse(text) == (text, [])
    assert [c.name for c in generic.parse(f"```json\n{ADD}\n```")[1]] == ["add"]
    hermes = ToolPlan.build(TEMPLATES[ToolFormat.HERMES], TOOLS, "auto", None)
    stream = ToolCallStream(hermes)
    released = [stream.push(piece)[0] for piece in ("Let me add. <tool", "_call>\n", ADD, "\n</tool_call>\n")]
    released.append(stream.flush()[0])
    assert released[0] == "Let me add." and "".join(released) == "Let me add."
    assert [c.name for c in stream.calls] == ["add"]


@pytest.mark.parametrize("tools, choice", [
    (TOOLS, {"type": "function", "function": {"name": "missing"}}),
    (TOOLS, "always"),
    (None, "required"),
    ([{"type": "retrieval"}], "auto"),
])
def test_bad_requests_say_why(tools, choice):
    with pytest.raises(ApiError) as raised:
        ToolPlan.build(None, tools, choice, None)
    assert raised.value.status == 400
