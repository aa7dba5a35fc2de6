"""`/v1/responses` on the bundled SmolLM2 through the real `openai` SDK's `client.responses` and
LangChain's `ChatOpenAI(use_responses_api=True)`: plain text input and message lists,
`instructions`, streamed events (the SDK's own event types, reassembled to the same text),
`max_output_tokens` (an incomplete response), a function tool round trip (function_call item ->
function_call_output -> answer), structured output through `text.format`, and
`previous_response_id` over a kept response (`store: false` keeps nothing)."""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import openai
import pytest
from langchain_core.tools import tool as langchain_tool
from langchain_openai import ChatOpenAI

from frontend_support import running_server
from skippy.api.app import ApiSettings, create_app
from skippy.driver.chain_backend import ChainBackend
from skippy.launch.local_chain import start_stage0
from skippy.launch.serve import model_id_for

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct.Q4_1"
WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CITY = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
        "required": ["city", "country"], "additionalProperties": False}


@pytest.fixture(scope="module")
def url(gguf_path, tokenizer):
    client = asyncio.run(start_stage0(gguf_path, concurrency=4, ctx_size=2048))
    backend = ChainBackend(client, None)
    with running_server(create_app(backend, tokenizer, ApiSettings(model_id=model_id_for(gguf_path)))) as base:
        yield base
    asyncio.run(backend.close())


def sdk(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)


def test_plain_and_streamed_give_the_same_text(url):
    client = sdk(url)
    request = dict(model=MODEL, input="Name three colours.", instructions="Answer in one short line.",
                   temperature=0, max_output_tokens=24)
    response = client.responses.create(**request)
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.output_text and response.status in ("completed", "incomplete")
    assert response.usage.output_tokens <= 24 and response.usage.input_tokens > 0
    kinds, text, final = [], "", None
    for event in client.responses.create(stream=True, **request):
        kinds.append(event.type)
        if event.type == "response.output_text.delta":
            text += event.delta
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert "response.output_item.added" in kinds and "response.output_text.done" in kinds
    assert text == response.output_text == final.output_text
    assert [e for e in kinds if "sequence" in e] == []  # the SDK parsed every event into its own type


def test_message_list_input_and_max_output_tokens(url):
    response = sdk(url).responses.create(
        model=MODEL, temperature=0, max_output_tokens=3,
        input=[{"role": "developer", "content": "You are terse."},
               {"role": "user", "content": [{"type": "input_text", "text": "Count from one to twenty in words."}]}])
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 3


def test_model_may_be_left_out(url):
    response = httpx.post(url + "/v1/responses", json={"input": "Hi!", "max_output_tokens": 3}, timeout=300)
    assert response.status_code == 200, response.text
    assert response.json()["model"] == MODEL  # the one model served
    unknown = httpx.post(url + "/v1/responses", json={"model": "gpt-4o", "input": "Hi!"}, timeout=300)
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"


def test_a_function_tool_round_trip(url):
    client = sdk(url)
    first = client.responses.create(model=MODEL, input="What is the weather in Paris?", tools=[WEATHER],
                                    tool_choice="required", parallel_tool_calls=False, temperature=0,
                                    max_output_tokens=60)
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) >= 1 and calls[0].name == "get_weather" and calls[0].call_id.startswith("call_")
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["parameters"])
    # streamed: the function_call item's argument deltas reassemble into the same call
    arguments, done = "", None
    for event in client.responses.create(model=MODEL, input="What is the weather in Paris?", tools=[WEATHER],
                                         tool_choice="required", parallel_tool_calls=False, temperature=0,
                                         max_output_tokens=60, stream=True):
        if event.type == "response.function_call_arguments.delta":
            arguments += event.delta
        if event.type == "response.output_item.done" and event.item.type == "function_call":
            done = event.item
    assert done.name == calls[0].name and json.loads(arguments) == json.loads(calls[0].arguments)
    # the result goes back as input items, statelessly
    final = client.responses.create(model=MODEL, tools=[WEATHER], temperature=0, max_output_tokens=30, input=[
        {"role": "user", "content": "What is the weather in Paris?"},
        {"type": "function_call", "call_id": calls[0].call_id, "name": calls[0].name, "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": '{"temperature": 18}'}])
    assert final.output_text
    # and through previous_response_id: the kept call comes first
    chained = client.responses.create(model=MODEL, previous_response_id=first.id, temperature=0, max_output_tokens=30,
                                      tools=[WEATHER], input=[{"type": "function_call_output",
                                                               "call_id": calls[0].call_id, "output": "18 C"}])
    assert chained.output_text and chained.previous_response_id == first.id
    assert client.responses.retrieve(first.id).id == first.id


def test_structured_output_through_text_format(url):
    response = sdk(url).responses.create(
        model=MODEL, input="Give a city and its country as JSON.", temperature=0, max_output_tokens=60,
        text={"format": {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}})
    jsonschema.validate(json.loads(response.output_text), CITY)


def test_previous_response_id_and_store_false(url):
    client = sdk(url)
    kept = client.responses.create(model=MODEL, input="My name is Ada.", temperature=0, max_output_tokens=8)
    follow = client.responses.create(model=MODEL, input="What is my name?", previous_response_id=kept.id,
                                     temperature=0, max_output_tokens=8)
    assert follow.usage.input_tokens > kept.usage.input_tokens + kept.usage.output_tokens
    unkept = client.responses.create(model=MODEL, input="Hello", store=False, temperature=0, max_output_tokens=4)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input="Hi", previous_response_id=unkept.id, max_output_tokens=4)
    response = httpx.post(url + "/v1/responses", timeout=60, json={
        "model": MODEL, "input": [{"type": "web_search_call"}]})
    assert response.status_code == 400 and response.json()["error"]["param"] == "input"


def test_langchain_use_responses_api(url):
    @langchain_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        return f"18 degrees in {city}"

    llm = ChatOpenAI(model=MODEL, base_url=url + "/v1", api_key="unused", temperature=0, max_tokens=40,
                     max_retries=0, use_responses_api=True)
    reply = llm.invoke("Say hello.")
    assert reply.text
    streamed = "".join(chunk.text for chunk in llm.stream("Say hello."))
    assert streamed == reply.text
    bound = llm.bind_tools([get_weather], tool_choice="required", parallel_tool_calls=False)
    called = bound.invoke("What is the weather in Paris?")
    assert called.tool_calls and called.tool_calls[0]["name"] == "get_weather"
    jsonschema.validate(called.tool_calls[0]["args"], get_weather.args_schema.model_json_schema())
