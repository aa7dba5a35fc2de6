"""Structured outputs end to end: response_format json_schema and json_object through the API,
with the whole model in this process (a one-stage chain: stage 0 samples) and through a
`skippy serve --stages 3` process (the final stage samples), streamed and not, speculation
on and off. Every answer parses and validates against its schema (jsonschema), and greedy
decoding gives each schema the same text whatever the topology, streaming or speculation.
A schema the grammar engine cannot handle is a 400 with OpenAI's envelope; the real `openai`
SDK's `parse()` gets its pydantic model back."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pydantic
import pytest

from frontend_support import ServeProcess, running_server
from skippy.api.app import ApiSettings, create_app
from skippy.driver.chain_backend import ChainBackend
from skippy.launch.local_chain import start_stage0
from skippy.launch.serve import model_id_for
from structured_schemas import SCHEMAS
from test_serve_supervision import stage, stage_pid

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct.Q4_1"
CTX = 1024
MAX_TOKENS = 96  # the longest answer to SCHEMAS takes about 50 tokens
# Prompts whose json_object answers close within MAX_TOKENS (a small model asked for JSON with
# no schema can write keys forever: the grammar guarantees a valid prefix, not an end).
JSON_OBJECT_PROMPTS = ["Reply with a JSON object with the keys city and country for Paris.",
                       "Give the name and age of a person as a JSON object.",
                       "Output a JSON object describing a cat with keys name and colour."]


@pytest.fixture(scope="module")
def one_stage(gguf_path, tokenizer):
    client = asyncio.run(start_stage0(gguf_path, concurrency=8, ctx_size=CTX))
    backend = ChainBackend(client, None)
    with running_server(create_app(backend, tokenizer, ApiSettings(model_id=model_id_for(gguf_path)))) as url:
        yield url
    asyncio.run(backend.close())


@pytest.fixture(scope="module")
def serve3(tmp_path_factory):
    server = ServeProcess(["--stages", "3", "--concurrency", "8", "--ctx-size", str(CTX)],
                          tmp_path_factory.mktemp("structured") / "serve.log")
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="module")
def three_stages(serve3):
    return serve3.url


def schema_format(name: str, schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def ask(url: str, content: str, response_format: dict, *, stream: bool, speculative: bool | int,
        route: str = "chat", on_chunk=lambda num_chunks: None) -> tuple[str, str, dict]:
    """(text, finish_reason, timings) of one greedy request, streamed or not; `speculative` is
    False or the verify windows in flight (ngram-suffix proposals). A stream calls `on_chunk`
    with the number of chunks read so far."""
    body = {"model": MODEL, "temperature": 0, "max_tokens": MAX_TOKENS, "response_format": response_format,
            "speculative": {"mode": "ngram-suffix", "pipeline_depth": int(speculative)} if speculative else False,
            "stream": stream}
    if route == "chat":
        body["messages"] = [{"role": "user", "content": content}]
    else:
        body["prompt"] = content
    path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
    if not stream:
        response = httpx.post(url + path, json=body, timeout=300)
        assert response.status_code == 200, response.text
        data = response.json()
        choice = data["choices"][0]
        return (choice["message"]["content"] if route == "chat" else choice["text"]), choice["finish_reason"], \
            data["timings"]
    parts, finish_reason, timings = [], None, {}
    with httpx.stream("POST", url + path, json=body, timeout=300) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            assert "error" not in chunk, chunk
            for choice in chunk["choices"]:
                parts.append((choice["delta"].get("content") if route == "chat" else choice["text"]) or "")
                finish_reason = choice["finish_reason"] or finish_reason
            timings = chunk.get("timings") or timings
            on_chunk(len(parts))
    return "".join(parts), finish_reason, timings


def prompt_for(name: str) -> str:
    return f"Reply with one example {name.replace('_', ' ')} as a JSON object."


def test_fifty_schemas_validate_on_one_and_three_stages(one_stage, three_stages):
    # Each schema is asked on both topologies; streaming and speculation take turns over the
    # schemas (each topology sees all four combinations a dozen times). On 3 stages every other
    # speculative request keeps two verify windows in flight: a run-ahead window is masked over
    # the provisional tokens of the one before it.
    assert len(SCHEMAS) >= 50
    jobs = []
    for index, (name, schema) in enumerate(SCHEMAS):
        for url, turn in ((one_stage, index), (three_stages, index + 1)):
            depth = 2 if url == three_stages and index % 8 < 4 else 1
            jobs.append((name, schema, url, bool(turn % 2), depth if turn // 2 % 2 else 0))

    def run(job):
        name, schema, url, stream, speculative = job
        return job, ask(url, prompt_for(name), schema_format(name, schema), stream=stream, speculative=speculative)

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(run, jobs))
    failures, texts, num_drafts = [], {}, 0
    for (name, schema, url, stream, speculative), (text, finish_reason, timings) in results:
        where = f"{name} on {'1' if url == one_stage else '3'} stage(s), stream={stream}, speculative={speculative}"
        try:
            assert finish_reason == "stop", f"finish_reason {finish_reason}"
            jsonschema.validate(json.loads(text), schema)
        except (AssertionError, ValueError, jsonschema.ValidationError) as error:
            failures.append(f"{where}: {type(error).__name__}: {str(error)[:200]} in {text!r}")
        texts.setdefault(name, set()).add(text)
        num_drafts += timings.get("draft_n", 0) if speculative else 0
    assert not failures, "\n".join(failures)
    # Greedy: the mask of a verify window's row equals a plain step's, so nothing changes the text.
    assert {name: sorted(found) for name, found in texts.items() if len(found) > 1} == {}
    assert num_drafts > 0  # speculation did verify drafts under the grammar


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_json_object_mode_answers_a_json_object(one_stage, three_stages, stream):
    for url in (one_stage, three_stages):
        for index, prompt in enumerate(JSON_OBJECT_PROMPTS):
            text, finish_reason, _ = ask(url, prompt, {"type": "json_object"}, stream=stream,
                                         speculative=bool(index % 2))
            assert finish_reason == "stop" and isinstance(json.loads(text), dict), text


def test_text_completions_take_response_format_too(one_stage, three_stages):
    name, schema = SCHEMAS[0]
    for url in (one_stage, three_stages):
        text, finish_reason, _ = ask(url, "An example person as JSON:", schema_format(name, schema), stream=False,
                                     speculative=False, route="text")
        assert finish_reason == "stop"
        jsonschema.validate(json.loads(text), schema)


UNUSABLE = [
    # (response_format, message fragment)
    (schema_format("typo", {"type": "strin"}), "Invalid type: strin"),
    (schema_format("lookaround", {"type": "string", "pattern": "(?<=a)b"}), "look-around"),
    (schema_format("dangling", {"properties": {"a": {"$ref": "#/$defs/missing"}}}), "does not exist"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}, "json_schema.schema"),
    ({"type": "json_schema"}, "json_schema exactly"),
    ({"type": "yaml"}, "response_format.type"),
]


@pytest.mark.parametrize("response_format, fragment", UNUSABLE, ids=[row[1] for row in UNUSABLE])
def test_a_schema_the_engine_cannot_handle_is_a_400(one_stage, three_stages, response_format, fragment):
    for url in (one_stage, three_stages):
        with httpx.Client(base_url=url, timeout=60) as client:  # one connection: it survives the 400
            response = client.post("/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": "x"}], "response_format": response_format})
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["type"] == "invalid_request_error" and error["param"].startswith("response_format")
            assert fragment in error["message"], error["message"]
            after = client.post("/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
            assert after.status_code == 200


class City(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=16)
    country: str = pydantic.Field(max_length=16)


def test_the_openai_sdk_parses_into_a_pydantic_model(one_stage, three_stages):
    messages = [{"role": "user", "content": "Which city is the capital of France? Answer in JSON."}]
    for url in (one_stage, three_stages):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        completion = client.chat.completions.parse(model=MODEL, messages=messages, response_format=City,
                                                   temperature=0, max_tokens=MAX_TOKENS)
        parsed = completion.choices[0].message.parsed
        assert isinstance(parsed, City) and parsed.city
        beta = client.beta.chat.completions.parse(model=MODEL, messages=messages, response_format=City,
                                                  temperature=0, max_tokens=MAX_TOKENS)
        assert beta.choices[0].message.parsed == parsed


PEOPLE = {"type": "object", "properties": {"people": {"type": "array", "minItems": 6, "maxItems": 6, "items": {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                     "age": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["name", "age"], "additionalProperties": False}}},
    "required": ["people"], "additionalProperties": False}  # an answer of ~80 tokens


def test_a_request_whose_final_stage_dies_resumes_its_grammar(serve3):
    # Last in this module: it restarts the 3-stage server's final stage, which holds the grammar
    # state. The replay's fresh state consumes the committed tokens, so the answer goes on valid
    # and equal to the uninterrupted one, with speculation on.
    prompt, response_format = "List six people with their name and age as JSON.", schema_format("people", PEOPLE)
    expected, _, _ = ask(serve3.url, prompt, response_format, stream=False, speculative=True)
    killed = []

    def kill_the_final_stage(num_chunks: int) -> None:
        if num_chunks == 12 and not killed:
            os.kill(stage_pid(serve3, 2), signal.SIGKILL)
            killed.append(num_chunks)

    text, finish_reason, timings = ask(serve3.url, prompt, response_format, stream=True, speculative=True,
                                       on_chunk=kill_the_final_stage)
    assert killed and timings["chain_recoveries"] == 1
    assert (text, finish_reason) == (expected, "stop")
    jsonschema.validate(json.loads(text), PEOPLE)
    assert stage(serve3.url, "stage-2")["restarts"] == 1
