"""Real models' chat templates against transformers' `apply_chat_template` on the same text.

The templates are llama.cpp's copies of Qwen3 0.6B's, Qwen2.5 Instruct's, Llama 3.1 and 3.2
Instruct's and Mistral Nemo's, which README's test command fetches into `.cache/templates/`
(tests/fetch_reference_templates.py); we may not commit them. The tokenizer carrying them is a
byte-level one built here (one token a byte), so token ids compare as exactly as text.

Checked: our renderer's text equals transformers' over plain, system and multi-turn chats,
with and without the generation prompt, with and without tools, a tool call and its result in
the history, and for Qwen3 the thinking switch and past thoughts; the API layer (render_chat)
hands the template the request's tools, calls and `chat_template_kwargs` as transformers gets
them; and what each template teaches the model to answer with (its own rendering of a past
call) comes back out of the API's reply parser as that call.
"""

from __future__ import annotations

import asyncio
import copy
import json
from types import SimpleNamespace

import pytest
import transformers
from tokenizers import AddedToken, Tokenizer as HfTokenizer, decoders, models, pre_tokenizers

from fetch_reference_templates import DESTINATION, is_complete
from skippy.api.chat_output import ChatOutput, render_chat
from skippy.api.schemas import ChatCompletionRequest
from skippy.api.tools import ToolFormat
from skippy.model.chat_template import ChatTemplateError
from skippy.model.tokenizer import Tokenizer

FAMILIES = {  # ours -> (llama.cpp's file, the text a turn of the model ends with, its call format)
    "qwen3": ("Qwen-Qwen3-0.6B.jinja", "<|im_end|>\n", ToolFormat.HERMES),
    "qwen2.5": ("Qwen-Qwen2.5-7B-Instruct.jinja", "<|im_end|>\n", ToolFormat.HERMES),
    "llama3.1": ("meta-llama-Llama-3.1-8B-Instruct.jinja", "<|eot_id|>", ToolFormat.LLAMA3_JSON),
    "llama3.2": ("meta-llama-Llama-3.2-3B-Instruct.jinja", "<|eot_id|>", ToolFormat.LLAMA3_JSON),
    "mistral-nemo": ("mistralai-Mistral-Nemo-Instruct-2407.jinja", "</s>", ToolFormat.MISTRAL),
}
BOS, EOS = "<s>", "</s>"

TOOLS = [  # OpenAI's tool JSON, key order as clients send it; non-ASCII and HTML-ish text on purpose
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city, in °C or °F <metric & imperial>",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "e.g. Zürich"},
            "unit": {"type": "string", "enum": ["c", "f"]}}, "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "add", "description": "Add two integers",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                       "required": ["a", "b"]}}},
]
CALL_ID = "call12345"  # Mistral Nemo's template wants 9 characters
ARGUMENTS = {"city": "Zürich", "unit": "c"}
CALL = {"id": CALL_ID, "type": "function", "function": {"name": "get_weather", "arguments": ARGUMENTS}}
CONVERSATIONS = {
    "user": [{"role": "user", "content": "What's 'fish & chips' <in> Zürich? 🙂"}],
    "system": [{"role": "system", "content": "  Answer in one word.  "},
               {"role": "user", "content": "Capital of France?"}],
    "multi_turn": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"}, {"role": "user", "content": "Name a colour."}],
    "tool_call": [
        {"role": "system", "content": "You are a weather bot."},
        {"role": "user", "content": "How warm is it in Zürich?"},
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": CALL_ID, "content": json.dumps({"temperature": 21})},
        {"role": "assistant", "content": "It is 21 °C in Zürich."},
        {"role": "user", "content": "And is that warm?"}],
    "past_thought": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>\nTwo and two make four.\n</think>\n\nIt is 4."},
        {"role": "user", "content": "And 3+3?"}],
}


@pytest.fixture(scope="module")
def templates() -> dict[str, str]:
    if not is_complete(DESTINATION):
        pytest.fail(f"The reference chat templates are not in {DESTINATION}. Fix: run "
                    f"`python tests/fetch_reference_templates.py` (README's test command does).")
    return {family: (DESTINATION / file).read_text() for family, (file, _, _) in FAMILIES.items()}


@pytest.fixture(scope="module")
def backend() -> HfTokenizer:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = HfTokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(BOS, normalized=False), AddedToken(EOS, normalized=False)])
    return tokenizer


@pytest.fixture(scope="module")
def hf(backend):
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=BOS, eos_token=EOS)


@pytest.fixture(scope="module")
def ours(backend, templates):
    """family -> our Tokenizer carrying that family's template."""
    bos, eos = backend.token_to_id(BOS), backend.token_to_id(EOS)
    return {family: Tokenizer(backend, bos_id=bos, eos_id=eos, add_bos=False, chat_template=text)
            for family, text in templates.items()}


def reference(hf, template: str, messages, add_generation_prompt: bool, **variables) -> str:
    return hf.apply_chat_template(copy.deepcopy(messages), chat_template=template, tokenize=False,
                                  add_generation_prompt=add_generation_prompt, **variables)


def test_the_fetched_templates_are_the_families_own(templates):
    """The files are the real ones: each carries its family's markers and tool instructions."""
    assert "<|im_start|>" in templates["qwen3"] and "enable_thinking" in templates["qwen3"]
    assert "<tool_call>" in templates["qwen2.5"] and "You are Qwen" in templates["qwen2.5"]
    assert all("<|start_header_id|>" in templates[f] and '"parameters"' in templates[f]
               for f in ("llama3.1", "llama3.2"))
    assert "strftime_now" in templates["llama3.2"]
    assert "[AVAILABLE_TOOLS]" in templates["mistral-nemo"] and "[TOOL_CALLS]" in templates["mistral-nemo"]


@pytest.mark.parametrize("with_tools", [False, True], ids=["no_tools", "tools"])
@pytest.mark.parametrize("add_generation_prompt", [False, True], ids=["no_gen", "gen"])
@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_renders_as_transformers(family, conversation, add_generation_prompt, with_tools, templates, hf, ours):
    messages = CONVERSATIONS[conversation]
    variables = {"tools": TOOLS} if with_tools else {}
    expected = reference(hf, templates[family], messages, add_generation_prompt, **variables)
    assert ours[family].apply_chat_template(messages, add_generation_prompt, **variables) == expected


@pytest.mark.parametrize("with_tools", [False, True], ids=["no_tools", "tools"])
@pytest.mark.parametrize("add_generation_prompt", [False, True], ids=["no_gen", "gen"])
@pytest.mark.parametrize("enable_thinking", [None, True, False], ids=["unset", "on", "off"])
@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
def test_qwen3_thinking_switch_renders_as_transformers(conversation, enable_thinking, add_generation_prompt,
                                                       with_tools, templates, hf, ours):
    variables = {"tools": TOOLS} if with_tools else {}
    if enable_thinking is not None:
        variables["enable_thinking"] = enable_thinking
    messages = CONVERSATIONS[conversation]
    expected = reference(hf, templates["qwen3"], messages, add_generation_prompt, **variables)
    assert ours["qwen3"].apply_chat_template(messages, add_generation_prompt, **variables) == expected
    if add_generation_prompt and enable_thinking is False:
        assert expected.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


@pytest.mark.parametrize("key", ["reasoning_content", "reasoning", "thinking"])
def test_qwen3_past_thought_given_apart_renders_as_transformers(key, templates, hf, ours):
    """A thought sent back in its own field (vLLM's reasoning_content, or the other names
    transformers accepts for it) after the last user turn is written into the think block."""
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", key: "Look it up.", "content": "", "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": CALL_ID, "content": "21"}]
    expected = reference(hf, templates["qwen3"], messages, True, tools=TOOLS)
    assert "<think>\nLook it up.\n</think>" in expected
    assert ours["qwen3"].apply_chat_template(messages, True, tools=TOOLS) == expected


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_call_without_content_renders_as_with_empty_content(family, templates, hf, ours):
    """OpenAI clients send a tool call's content as null; transformers drops the key. Where its
    template then fails (Qwen3's reads every content), we render it as empty text, which is what
    transformers renders for the others too (llama.cpp's server does the same)."""
    with_null = copy.deepcopy(CONVERSATIONS["tool_call"])
    with_null[2]["content"] = None
    expected = reference(hf, templates[family], CONVERSATIONS["tool_call"], True, tools=TOOLS)
    if family == "qwen3":
        with pytest.raises(Exception, match="content"):
            reference(hf, templates[family], with_null, True, tools=TOOLS)
    else:
        assert reference(hf, templates[family], with_null, True, tools=TOOLS) == expected
    assert ours[family].apply_chat_template(with_null, True, tools=TOOLS) == expected


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_fields_set_to_null_are_absent_as_in_transformers(family, templates, hf, ours):
    """`tool_calls: null` on a plain reply (as OpenAI's SDK writes a message back) is no call:
    Llama 3's template tests `'tool_calls' in message`, and transformers drops null fields."""
    messages = copy.deepcopy(CONVERSATIONS["multi_turn"])
    messages[2].update(tool_calls=None, name=None)
    expected = reference(hf, templates[family], messages, True, tools=TOOLS)
    assert expected == reference(hf, templates[family], CONVERSATIONS["multi_turn"], True, tools=TOOLS)
    assert ours[family].apply_chat_template(messages, True, tools=TOOLS) == expected


def test_tools_are_none_unless_given_as_in_transformers(hf, backend, templates):
    """transformers always passes `tools` (None without any). Hermes 3's tool-use template loops
    over it unguarded: without tools both refuse it, with tools both render the same."""
    template = (DESTINATION / "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja").read_text()
    tokenizer = Tokenizer(backend, bos_id=backend.token_to_id(BOS), eos_id=backend.token_to_id(EOS), add_bos=False,
                          chat_template=template)
    messages = CONVERSATIONS["system"]
    with pytest.raises(TypeError):
        reference(hf, template, messages, True)
    with pytest.raises(ChatTemplateError, match="not iterable"):
        tokenizer.apply_chat_template(messages, True)
    expected = reference(hf, template, messages, True, tools=TOOLS)
    assert tokenizer.apply_chat_template(messages, True, tools=TOOLS) == expected


@pytest.mark.parametrize("family", ["mistral-nemo", "llama3.1"])
def test_a_conversation_the_template_refuses_fails_in_both(family, templates, hf, ours):
    """The templates' own checks (raise_exception) reject what transformers rejects: roles
    out of order for Mistral, two calls in one turn for Llama 3.1."""
    if family == "mistral-nemo":
        messages = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
        reason = "alternate"
    else:
        messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "", "tool_calls": [CALL, CALL]}]
        reason = "single tool-calls"
    with pytest.raises(Exception, match=reason):
        reference(hf, templates[family], messages, True, tools=TOOLS)
    with pytest.raises(ChatTemplateError, match=reason):
        ours[family].apply_chat_template(messages, True, tools=TOOLS)


# ---- the API layer ------------------------------------------------------------------------


def openai_history() -> list[dict]:
    """The tool-call conversation as an OpenAI client sends it: arguments as JSON text, a
    call's content null, and fields left null."""
    messages = copy.deepcopy(CONVERSATIONS["tool_call"])
    messages[0]["role"] = "developer"
    call = dict(CALL, function=dict(CALL["function"], arguments=json.dumps(ARGUMENTS, ensure_ascii=False)))
    messages[2] = {"role": "assistant", "content": None, "tool_calls": [call], "refusal": None}
    messages[4]["tool_calls"] = None
    return messages


def api_prompt(tokenizer: Tokenizer, **fields) -> tuple[list[int], object]:
    body = ChatCompletionRequest(model="m", **fields)
    ctx = SimpleNamespace(tokenizer=tokenizer, backend=None)  # a forced choice would need the backend
    prompt_ids, shape, grammar = asyncio.run(render_chat(ctx, body))
    assert grammar is None
    return prompt_ids, shape


def hf_ids(hf, template: str, messages, **variables) -> list[int]:
    return hf.apply_chat_template(copy.deepcopy(messages), chat_template=template, tokenize=True,
                                  return_dict=False, add_generation_prompt=True, **variables)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_api_passes_tools_and_calls_as_transformers_gets_them(family, templates, hf, ours):
    prompt_ids, shape = api_prompt(ours[family], messages=openai_history(), tools=TOOLS)
    assert shape.tools.format is FAMILIES[family][2]
    assert prompt_ids == hf_ids(hf, templates[family], CONVERSATIONS["tool_call"], tools=TOOLS)


@pytest.mark.parametrize("request_fields, variables", [
    ({}, {}),
    ({"chat_template_kwargs": {"enable_thinking": True}}, {"enable_thinking": True}),
    ({"chat_template_kwargs": {"enable_thinking": False}}, {"enable_thinking": False}),
    ({"reasoning_effort": "none"}, {"enable_thinking": False}),
], ids=["default", "kwargs_on", "kwargs_off", "effort_none"])
def test_api_passes_qwen3_thinking_switch_as_transformers_gets_it(request_fields, variables, templates, hf, ours):
    messages = CONVERSATIONS["past_thought"]
    prompt_ids, shape = api_prompt(ours["qwen3"], messages=messages, tools=TOOLS, **request_fields)
    assert prompt_ids == hf_ids(hf, templates["qwen3"], messages, tools=TOOLS, **variables)
    assert shape.reasoning.splits and shape.reasoning.enabled is variables.get("enable_thinking", True)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_call_each_template_teaches_parses_back(family, templates, hf, ours):
    """The model answers a call the way its template writes a past one: that text (transformers'
    rendering of the assistant's turn, less the end-of-turn token the model stops on) run
    through the API's reply parser gives back the call, with no content left over."""
    _, end_of_turn, _ = FAMILIES[family]
    asked = [{"role": "user", "content": "How warm is it in Zürich?"}]
    answered = asked + [{"role": "assistant", "content": "", "tool_calls": [CALL]}]
    prompt = reference(hf, templates[family], asked, True, tools=TOOLS)
    history = reference(hf, templates[family], answered, False, tools=TOOLS)
    assert history.startswith(prompt) and history.endswith(end_of_turn)
    reply = history[len(prompt):-len(end_of_turn)]

    prompt_ids, shape = api_prompt(ours[family], messages=asked, tools=TOOLS)
    assert ours[family].decode(prompt_ids) == prompt
    output = ChatOutput(shape)
    for start in range(0, len(reply), 3):  # streamed in small pieces, tags cut anywhere
        output.push(reply[start:start + 3])
    output.flush()
    message = output.message()
    assert not message.content and not (message.reasoning_content or "").strip()  # Qwen3: an empty thought
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.tool_calls] == [
        ("get_weather", ARGUMENTS)]
    assert output.finish_reason("stop") == "tool_calls"
