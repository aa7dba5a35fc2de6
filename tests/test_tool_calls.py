"""Tool calls end to end on the bundled SmolLM2 through the real `openai` SDK and LangChain's
`ChatOpenAI.bind_tools`: a required or named tool_choice always yields a valid call to a declared
function whose arguments validate (jsonschema) against its parameters, on one stage in this
process and on a `skippy serve --stages 2` chain; streamed deltas reassemble into the same calls;
a full round trip (call -> tool result -> answer) works; the tool-call history answers 200 on
SmolLM2's template (no tools: the generic JSON format) and on a template with native
`<tool_call>` rendering (tests/chat_templates.py). Bad tool requests get the error envelope."""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import openai
import pytest
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_core.tools import tool as langchain_tool
from langchain_openai import ChatOpenAI

from chat_templates import TOOLS_TEMPLATE
from frontend_support import ServeProcess, running_server
from skippy.api.app import ApiSettings, create_app
from skippy.driver.chain_backend import ChainBackend
from skippy.launch.local_chain import start_stage0
from skippy.launch.serve import model_id_for

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct.Q4_1"
CTX = 2048
MAX_TOKENS = 80

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"]}}}
STOCK = {"type": "function", "function": {
    "name": "stock_price", "description": "The latest price of a stock.",
    "parameters": {"type": "object", "properties": {"ticker": {"type": "string", "maxLength": 8},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 30}},
                   "required": ["ticker", "days"]}}}
TOOLS = [WEATHER, STOCK]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
QUESTIONS = ["What is the weather in Paris right now?", "How did Apple stock do over the last week?",
             "Should I take an umbrella in London today?"]


@pytest.fixture(scope="module")
def servers(gguf_path, tokenizer):
    """(SmolLM2's own template, our native-tools template): two apps over one in-process stage."""
    client = asyncio.run(start_stage0(gguf_path, concurrency=4, ctx_size=CTX))
    backend = ChainBackend(client, None)
    settings = ApiSettings(model_id=model_id_for(gguf_path))
    with running_server(create_app(backend, tokenizer, settings)) as plain, \
            running_server(create_app(backend, tokenizer.with_chat_template(TOOLS_TEMPLATE), settings)) as native:
        yield plain, native
    asyncio.run(backend.close())


@pytest.fixture(scope="module")
def two_stages(tmp_path_factory):
    server = ServeProcess(["--stages", "2", "--concurrency", "4", "--ctx-size", str(CTX)],
                          tmp_path_factory.mktemp("tools") / "serve.log")
    yield server.url
    assert server.stop() == 0


def sdk(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)


def assert_valid(calls, names=frozenset(PARAMETERS)) -> list[tuple[str, dict]]:
    """(name, arguments) of each call, checked: a declared function, arguments that validate."""
    assert calls, "expected tool calls"
    found = []
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, PARAMETERS[call.function.name])
        found.append((call.function.name, arguments))
    return found


def streamed_calls(client: openai.OpenAI, **request) -> tuple[list[tuple[str, dict]], str, str]:
    """(name, arguments) of each call reassembled from deltas (OpenAI's shape checked), the
    finish reason, and the content."""
    calls: dict[int, dict] = {}
    finish_reason, content = None, ""
    for chunk in client.chat.completions.create(stream=True, **request):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or ():
                if delta.index not in calls:  # the first delta of a call: id, type, name, ""
                    assert delta.id.startswith("call_") and delta.type == "function"
                    assert delta.function.name and delta.function.arguments == ""
                    calls[delta.index] = {"name": delta.function.name, "arguments": ""}
                else:
                    assert delta.id is None and delta.function.name is None
                    calls[delta.index]["arguments"] += delta.function.arguments
            finish_reason = choice.finish_reason or finish_reason
    assert sorted(calls) == list(range(len(calls)))
    return [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())], finish_reason, content


@pytest.mark.parametrize("choice", ["required", "get_weather", "stock_price"])
def test_forced_choices_give_valid_calls_on_both_templates(servers, choice):
    for url in servers:
        client = sdk(url)
        tool_choice = choice if choice == "required" else {"type": "function", "function": {"name": choice}}
        for index, question in enumerate(QUESTIONS[:2]):
            request = dict(model=MODEL, messages=[{"role": "user", "content": question}], tools=TOOLS,
                           tool_choice=tool_choice, parallel_tool_calls=False, temperature=0, max_tokens=MAX_TOKENS)
            response = client.chat.completions.create(**request)
            choice_ = response.choices[0]
            assert choice_.finish_reason == "tool_calls", choice_
            calls = assert_valid(choice_.message.tool_calls,
                                 PARAMETERS.keys() if choice == "required" else {choice})
            if index == 0:
                streamed, finish_reason, _ = streamed_calls(client, **request)
                assert finish_reason == "tool_calls" and streamed == calls


def test_parallel_calls_and_sampling_stay_valid(servers):
    # sampled (temperature 1, seeds) and with parallel calls allowed: still only valid calls
    for url in servers:
        client = sdk(url)
        for seed in range(2):
            response = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Weather in Paris and in Rome, please."}],
                tools=TOOLS, tool_choice="required", parallel_tool_calls=True, temperature=1.0, seed=seed,
                max_tokens=120)
            if response.choices[0].finish_reason == "length":
                continue  # a sampled list of calls may run past max_tokens; every finished one is checked
            assert_valid(response.choices[0].message.tool_calls)


def test_a_two_stage_chain_gives_the_same_calls(servers, two_stages):
    plain, _ = servers
    for question in QUESTIONS[:2]:
        request = dict(model=MODEL, messages=[{"role": "user", "content": question}], tools=TOOLS,
                       tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=MAX_TOKENS)
        here = sdk(plain).chat.completions.create(**request).choices[0].message.tool_calls
        there = sdk(two_stages).chat.completions.create(**request).choices[0].message.tool_calls
        assert assert_valid(there) == assert_valid(here)
        assert streamed_calls(sdk(two_stages), **request)[0] == assert_valid(here)


def test_a_full_round_trip_on_both_templates(servers):
    for url in servers:
        client = sdk(url)
        messages = [{"role": "user", "content": "What is the weather in Paris in celsius?"}]
        first = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                               tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                               temperature=0, max_tokens=MAX_TOKENS)
        message = first.choices[0].message
        (name, _), = assert_valid(message.tool_calls)
        assert message.content is None
        messages.append(message.model_dump(exclude_none=True))  # content null + tool_calls
        messages.append({"role": "tool", "tool_call_id": message.tool_calls[0].id,
                         "content": json.dumps({"temperature": 18, "sky": "cloudy"})})
        final = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, temperature=0,
                                               max_tokens=40)
        assert final.choices[0].finish_reason in ("stop", "length")
        assert final.choices[0].message.content and not final.choices[0].message.tool_calls
        # the same history by plain HTTP, streamed: 200, text
        with httpx.stream("POST", url + "/v1/chat/completions", timeout=300, json={
                "model": MODEL, "messages": messages, "max_tokens": 8, "stream": True}) as response:
            assert response.status_code == 200
            assert any('"content"' in line for line in response.iter_lines())


def test_auto_parses_whatever_the_model_chooses(servers):
    # auto lets the model choose; whatever it writes comes back as text or as valid calls
    for url in servers:
        for question in QUESTIONS:
            request = dict(model=MODEL, messages=[{"role": "user", "content": question}], tools=TOOLS,
                           tool_choice="auto", temperature=0, max_tokens=MAX_TOKENS)
            choice = sdk(url).chat.completions.create(**request).choices[0]
            if choice.message.tool_calls:
                assert choice.finish_reason == "tool_calls"
                calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
                assert all(name in PARAMETERS for name, _ in calls)
            else:
                assert choice.message.content
            streamed, _, content = streamed_calls(sdk(url), **request)
            assert content == (choice.message.content or "")
            assert [name for name, _ in streamed] == [c.function.name for c in choice.message.tool_calls or ()]


def test_langchain_bind_tools(servers, two_stages):
    @langchain_tool
    def get_weather(city: str, unit: str) -> str:
        """The current weather in a city; unit is celsius or fahrenheit."""
        return f"18 degrees {unit} in {city}"

    for url in (*servers, two_stages):
        llm = ChatOpenAI(model=MODEL, base_url=url + "/v1", api_key="unused", temperature=0, max_tokens=MAX_TOKENS,
                         max_retries=0)
        bound = llm.bind_tools([get_weather], tool_choice="required", parallel_tool_calls=False)
        question = HumanMessage("What is the weather in Paris?")
        reply = bound.invoke([question])
        assert len(reply.tool_calls) >= 1
        call = reply.tool_calls[0]
        assert call["name"] == "get_weather"
        jsonschema.validate(call["args"], get_weather.args_schema.model_json_schema())
        chunks = list(bound.stream([question]))
        merged = chunks[0]
        for chunk in chunks[1:]:
            merged += chunk
        assert [(c["name"], c["args"]) for c in merged.tool_calls] == [(c["name"], c["args"]) for c in reply.tool_calls]
        result = ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"])
        final = llm.bind_tools([get_weather]).invoke([question, reply, result])
        assert isinstance(final.content, str)


@pytest.mark.parametrize("body, param", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}],
      "tool_choice": "required"}, "tools"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
])
def test_bad_tool_requests_are_400_envelopes(servers, body, param):
    request = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, **body}
    response = httpx.post(servers[0] + "/v1/chat/completions", json=request, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
