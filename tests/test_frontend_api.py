"""The OpenAI API end to end: the real `openai` package against real uvicorn servers on loopback,
with the whole model in-process (a one-stage chain, as `skippy serve --stages 1`). One model
load; several small apps share it:

    main        defaults (8 lanes)
    tight       1 lane, queue 1, 1 s admission timeout      (429s)
    impatient   1 ms backend timeout                         (504)
    faulty      a backend wrapper that fails on demand        (503, mid-stream errors)
    locked      --auth-token                                  (401)
    aliased     --served-model-name smol gpt-4o-mini, --allowed-origins http://localhost:3000, a token
"""

from __future__ import annotations

import asyncio
import json
import threading
import uuid

import httpx
import openai
import pytest

from frontend_support import running_server, wait_until
from skippy import cli
from skippy.api.app import ApiSettings, create_app
from skippy.driver.backend import Readiness, StageUnavailable, Token
from skippy.driver.chain_backend import ChainBackend
from skippy.launch.local_chain import start_stage0
from skippy.launch.serve import model_id_for

CTX = 1024
# Asked for one sentence, so the answer is short. (On the bare question llama.cpp's
# one int8 level of activations answers "L'Étoile, la Cité, la Nation, ..."; ours, with
# two levels, says Paris as float32 does.)
QUESTION = "What is the capital of France? Answer in one sentence."
NO_EOS = {"0": -100, "2": -100}  # logit_bias banning SmolLM2's end tokens: runs to max_tokens


class FaultyBackend:
    """Delegates to a real backend; `mode` = "down" fails before any output, "midstream" after 3 tokens,
    "bug" raises what no handler knows (an internal failure)."""

    def __init__(self, inner):
        self.inner, self.mode = inner, None
        self.num_lanes, self.ctx_size = inner.num_lanes, inner.ctx_size
        self.speculative, self.check_speculative = inner.speculative, inner.check_speculative
        self.check_grammar = inner.check_grammar
        self.cache_stats = inner.cache_stats

    async def generate(self, request):
        if self.mode == "down":
            raise StageUnavailable("stage-1", "connection refused by 127.0.0.1:1")
        if self.mode == "bug":
            raise RuntimeError("an internal failure")
        num_tokens = 0
        async for event in self.inner.generate(request):
            yield event
            num_tokens += isinstance(event, Token)
            if self.mode == "midstream" and num_tokens == 3:
                raise StageUnavailable("stage-1", "connection reset mid-generation")

    async def status(self):
        return await self.inner.status()

    async def ready(self):
        if self.mode == "down":
            return Readiness(False, "stage-1", "connection refused by 127.0.0.1:1")
        return await self.inner.ready()

    async def close(self):
        pass


@pytest.fixture(scope="module")
def stack(gguf_path, tokenizer):
    client = asyncio.run(start_stage0(gguf_path, concurrency=8, ctx_size=CTX))
    backend = ChainBackend(client, None)
    faulty = FaultyBackend(backend)
    model_id = model_id_for(gguf_path)
    apps = {
        "main": create_app(backend, tokenizer, ApiSettings(model_id=model_id)),
        "tight": create_app(backend, tokenizer, ApiSettings(model_id=model_id, concurrency=1, queue_size=1,
                                                            admission_timeout_s=1)),
        "impatient": create_app(backend, tokenizer, ApiSettings(model_id=model_id, backend_timeout_s=0.001)),
        "faulty": create_app(faulty, tokenizer, ApiSettings(model_id=model_id)),
        "locked": create_app(backend, tokenizer, ApiSettings(model_id=model_id, auth_token="s3cret")),
        "aliased": create_app(backend, tokenizer, ApiSettings(model_id="smol", aliases=("gpt-4o-mini",),
                                                              allowed_origins=("http://localhost:3000",),
                                                              auth_token="s3cret")),
    }  # fmt: skip
    with running_server(apps["main"]) as main, running_server(apps["tight"]) as tight, \
            running_server(apps["impatient"]) as impatient, running_server(apps["faulty"]) as faulty_url, \
            running_server(apps["locked"]) as locked, running_server(apps["aliased"]) as aliased:  # fmt: skip
        yield dict(main=main, tight=tight, impatient=impatient, faulty=faulty_url, locked=locked, aliased=aliased,
                   backend=backend, faulty_backend=faulty, model=model_id)  # fmt: skip
    asyncio.run(backend.close())


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack["main"] + "/v1", api_key="unused", max_retries=0, timeout=120)


def chat(client, stack, content=QUESTION, **kwargs):
    messages = kwargs.pop("messages", [{"role": "user", "content": content}])
    return client.chat.completions.create(model=stack["model"], messages=messages, **kwargs)


def sse_events(response: httpx.Response) -> list:
    """The `data:` payloads of an SSE response, JSON-decoded except [DONE]."""
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            payload = line.removeprefix("data: ")
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def active_sessions(url: str) -> int:
    return sum(stage["active_sessions"] for stage in httpx.get(url + "/v1/stages").json()["data"])


# ---- happy paths ------------------------------------------------------------------


def test_models_stages_health(client, stack):
    models = client.models.list()
    assert [m.id for m in models.data] == [stack["model"]]
    assert models.data[0].model_extra["context_length"] == CTX
    assert httpx.get(stack["main"] + "/health").json() == {"status": "ok"}
    assert httpx.get(stack["main"] + "/readyz").status_code == 200
    stages = httpx.get(stack["main"] + "/v1/stages").json()["data"]
    assert [(s["id"], s["layer_start"], s["layer_end"], s["state"]) for s in stages] == [("stage-0", 0, 30, "ready")]


def test_greedy_chat_equals_skippy_generate(client, stack, tokenizer, capsys):
    assert cli.main(["generate", "--json", "--max-tokens", "24", QUESTION]) == 0
    reference = json.loads(capsys.readouterr().out)
    response = chat(client, stack, temperature=0, max_tokens=24, extra_body={"return_token_ids": True})
    choice = response.choices[0]
    assert response.model_extra["prompt_token_ids"] == reference["prompt_ids"]
    assert choice.model_extra["token_ids"] == reference["completion_ids"]
    assert choice.message.content == reference["text"]
    assert "Paris" in choice.message.content
    assert choice.finish_reason == ("length" if len(reference["completion_ids"]) == 24 else "stop")
    # usage counts are the tokenizer's counts
    template = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}])
    assert response.usage.prompt_tokens == len(tokenizer.encode(template)) == len(reference["prompt_ids"])
    assert response.usage.completion_tokens == len(reference["completion_ids"])
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens
    assert response.usage.prompt_tokens_details.cached_tokens == 0
    timings = response.model_extra["timings"]
    assert timings["prompt_n"] == response.usage.prompt_tokens
    assert timings["predicted_n"] == response.usage.completion_tokens
    assert timings["predicted_ms"] > 0 and timings["prompt_per_second"] > 0


def test_history_and_content_parts_reach_the_template(client, stack, tokenizer):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": [{"type": "text", "text": "Name a colour."}]},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": [{"type": "text", "text": "Another "}, {"type": "text", "text": "one?"}]},
    ]
    def flatten(content):
        return content if isinstance(content, str) else "".join(part["text"] for part in content)

    flat = [{**m, "content": flatten(m["content"])} for m in messages]
    response = chat(client, stack, messages=messages, temperature=0, max_tokens=4,
                    extra_body={"return_token_ids": True})  # fmt: skip
    expected = tokenizer.encode(tokenizer.apply_chat_template(flat), add_special_tokens=False)  # as transformers
    assert response.model_extra["prompt_token_ids"] == expected
    # "developer" is OpenAI's newer name for the system role
    developer = [{"role": "developer", "content": "You are terse."}, *messages[1:]]
    response = chat(client, stack, messages=developer, temperature=0, max_tokens=4,
                    extra_body={"return_token_ids": True})  # fmt: skip
    assert response.model_extra["prompt_token_ids"] == expected


def test_streaming_chat_matches_non_streaming(client, stack):
    whole = chat(client, stack, temperature=0, max_tokens=16)
    chunks = list(chat(client, stack, temperature=0, max_tokens=16, stream=True,
                       stream_options={"include_usage": True}))  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [c.choices[0].finish_reason for c in finals] == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump()


def test_sse_wire_order(stack):
    body = {"model": stack["model"], "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 5,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    with httpx.stream("POST", stack["main"] + "/v1/chat/completions", json=body, timeout=60) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 5
    assert events[-3]["choices"][0]["finish_reason"] == "length" and "timings" in events[-3]
    assert all(e["object"] == "chat.completion.chunk" for e in events[:-1])


def test_completions_streaming_and_not(client, stack, tokenizer):
    prompt = "Once upon a time"
    whole = client.completions.create(model=stack["model"], prompt=prompt, temperature=0, max_tokens=12,
                                      extra_body={"return_token_ids": True})  # fmt: skip
    choice = whole.choices[0]
    assert whole.object == "text_completion" and choice.finish_reason == "length"
    assert whole.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert whole.usage.completion_tokens == 12
    assert choice.text == tokenizer.decode(choice.model_extra["token_ids"])
    streamed = client.completions.create(model=stack["model"], prompt=prompt, temperature=0, max_tokens=12,
                                         stream=True)  # fmt: skip
    assert "".join(c.choices[0].text for c in streamed) == choice.text
    echoed = client.completions.create(model=stack["model"], prompt=prompt, temperature=0, max_tokens=12, echo=True)
    assert echoed.choices[0].text == prompt + choice.text
    by_ids = client.completions.create(model=stack["model"], prompt=tokenizer.encode(prompt), temperature=0,
                                       max_tokens=12)  # fmt: skip
    assert by_ids.choices[0].text == choice.text


def test_stop_strings_streaming_and_not(client, stack):
    full = chat(client, stack, temperature=0, max_tokens=24).choices[0].message.content
    assert "Paris" in full, full
    stop = "aris"  # starts inside a token: the stream must hold back "P" and cut there
    expected = full[: full.index(stop)]
    response = chat(client, stack, temperature=0, max_tokens=24, stop=[stop, "never-appears"])
    assert response.choices[0].message.content == expected
    assert response.choices[0].finish_reason == "stop"
    pieces = [c.choices[0].delta.content or "" for c in chat(client, stack, temperature=0, max_tokens=24,
                                                             stop=stop, stream=True) if c.choices]  # fmt: skip
    assert "".join(pieces) == expected
    assert not any(stop in p for p in pieces)


def test_max_tokens_and_max_completion_tokens(client, stack):
    for field in ("max_tokens", "max_completion_tokens"):
        response = chat(client, stack, "Write a long story about a dragon.", temperature=0, **{field: 7})
        assert response.usage.completion_tokens == 7
        assert response.choices[0].finish_reason == "length"


def test_seed_determinism_and_sampling_knobs(client, stack):
    def sample(**kwargs):
        return chat(client, stack, "Tell me a story.", max_tokens=8, **kwargs).choices[0].message.content

    first = sample(seed=123, temperature=1.0)
    assert sample(seed=123, temperature=1.0) == first
    assert any(sample(seed=s, temperature=1.0) != first for s in (1, 2, 3))
    # top_k=1 leaves only the most likely token: greedy at any temperature
    greedy = sample(temperature=0)
    assert sample(seed=5, temperature=1.5, extra_body={"top_k": 1}) == greedy
    assert sample(seed=5, temperature=1.0, extra_body={"min_p": 1.0}) == greedy  # only the top token is left


def test_logit_bias_bans_a_token(client, stack):
    greedy = chat(client, stack, temperature=0, max_tokens=1, extra_body={"return_token_ids": True})
    first = greedy.choices[0].model_extra["token_ids"][0]
    banned = chat(client, stack, temperature=0, max_tokens=1, logit_bias={str(first): -100},
                  extra_body={"return_token_ids": True})  # fmt: skip
    assert banned.choices[0].model_extra["token_ids"][0] != first
    penalised = chat(client, stack, temperature=0, max_tokens=8, presence_penalty=1.5, frequency_penalty=1.0)
    assert penalised.usage.completion_tokens >= 1


def test_request_id_is_echoed(stack):
    given = str(uuid.uuid4())
    response = httpx.get(stack["main"] + "/v1/models", headers={"x-request-id": given})
    assert response.headers["x-request-id"] == given
    replaced = httpx.get(stack["main"] + "/v1/models", headers={"x-request-id": "not-a-uuid"})
    assert str(uuid.UUID(replaced.headers["x-request-id"])) == replaced.headers["x-request-id"]
    error = httpx.get(stack["main"] + "/v1/nope", headers={"x-request-id": given})
    assert error.headers["x-request-id"] == given


# ---- concurrency and cancellation -------------------------------------------------


def test_eight_concurrent_streams_complete(client, stack):
    results: list = [None] * 8

    def run(i: int) -> None:
        stream = chat(client, stack, f"Count from {i} to {i + 5}.", temperature=0, max_tokens=12, stream=True)
        chunks = list(stream)
        results[i] = ("".join(c.choices[0].delta.content or "" for c in chunks if c.choices),
                      chunks[-1].choices[0].finish_reason)  # fmt: skip

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert all(r is not None for r in results), results
    assert all(text and reason in ("stop", "length") for text, reason in results), results
    assert wait_until(lambda: active_sessions(stack["main"]) == 0)


def test_client_disconnect_frees_the_session(stack):
    body = {"model": stack["model"], "messages": [{"role": "user", "content": "Write a very long essay."}],
            "max_tokens": 500, "temperature": 0, "stream": True, "logit_bias": NO_EOS}  # fmt: skip
    with httpx.stream("POST", stack["main"] + "/v1/chat/completions", json=body, timeout=60) as response:
        num_events = 0
        for line in response.iter_lines():
            num_events += line.startswith("data: ")
            if num_events == 3:
                assert active_sessions(stack["main"]) == 1
                break
    assert wait_until(lambda: active_sessions(stack["main"]) == 0, timeout_s=5)
    metrics = httpx.get(stack["main"] + "/metrics").text
    assert 'skippy_generations_total{outcome="cancelled"}' in metrics
    assert "skippy_active_generations 0.0" in metrics


def test_client_disconnect_before_a_non_streaming_answer_frees_the_session(stack):
    body = {"model": stack["model"], "messages": [{"role": "user", "content": "Write a very long essay."}],
            "max_tokens": 900, "temperature": 0, "logit_bias": NO_EOS}  # fmt: skip
    # we hang up while the model is still writing: 900 tokens took 2.4 s on an AVX-512 Xeon,
    # where 500 had outrun a 1.5 s timeout
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(stack["main"] + "/v1/chat/completions", json=body, timeout=0.5)
    assert wait_until(lambda: active_sessions(stack["main"]) == 0, timeout_s=5)
    metrics = httpx.get(stack["main"] + "/metrics").text
    assert 'skippy_generations_total{outcome="cancelled"}' in metrics
    assert "skippy_active_generations 0.0" in metrics


# ---- errors -----------------------------------------------------------------------


def envelope(response: httpx.Response) -> dict:
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


@pytest.mark.parametrize(
    "body, param",
    [
        (b"{not json", None),  # bad JSON
        (b'{"model": "M"}', "messages"),  # missing field
        (b'{"model": "M", "messages": [{"role": "user", "content": "x"}], "temperature": -1}', "temperature"),
        (b'{"model": "M", "messages": [{"role": "user", "content": "x"}], "n": 3}', "n"),
        (b'{"model": "M", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1024}', "max_tokens"),
        (b'{"model": "M", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}', "messages"),
        (b'{"model": "M", "messages": [{"role": "user", "content": "x"}], "logit_bias": {"999999": 1}}',
         "logit_bias"),
    ],
)
def test_400s(stack, body, param):
    response = httpx.post(stack["main"] + "/v1/chat/completions", content=body.replace(b'"M"', json.dumps(
        stack["model"]).encode()), headers={"content-type": "application/json"})  # fmt: skip
    assert response.status_code == 400, response.text
    error = envelope(response)
    assert error["type"] == "invalid_request_error" and error["param"] == param


def test_unhonourable_features_are_400s_that_say_so(client, stack):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    with pytest.raises(openai.BadRequestError, match="not among the tools"):
        chat(client, stack, tools=tools, tool_choice={"type": "function", "function": {"name": "get_time"}})
    with pytest.raises(openai.BadRequestError, match="response_format cannot be honoured: .*Invalid type"):
        chat(client, stack, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "strin"}}})
    with pytest.raises(openai.BadRequestError, match="n=1"):
        chat(client, stack, n=2)
    with pytest.raises(openai.BadRequestError, match="maximum context length is 1024 tokens"):
        chat(client, stack, max_tokens=CTX)


def test_404s(client, stack):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}])
    response = httpx.get(stack["main"] + "/v1/no-such-route")
    assert response.status_code == 404 and envelope(response)["type"] == "not_found_error"
    assert httpx.get(stack["main"] + "/v1/chat/completions").status_code == 405


def test_413_body_over_limit(client, stack):
    with pytest.raises(openai.APIStatusError) as caught:
        chat(client, stack, "x" * (4 * 1024 * 1024 + 10))
    assert caught.value.status_code == 413
    assert caught.value.body["code"] == "request_too_large"


def test_401_without_the_auth_token(stack):
    locked = openai.OpenAI(base_url=stack["locked"] + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        locked.models.list()
    opened = openai.OpenAI(base_url=stack["locked"] + "/v1", api_key="s3cret", max_retries=0)
    assert opened.models.list().data[0].id == stack["model"]
    assert httpx.get(stack["locked"] + "/health").status_code == 200  # liveness needs no key


def test_429_queue_full_and_admission_timeout(stack):
    url = stack["tight"] + "/v1/chat/completions"
    # 900 tokens hold the only lane well past the 1 s admission timeout (2.4 s at 370 tok/s on
    # an AVX-512 Xeon; with a 3 s timeout there the queued request was admitted, not timed out);
    # the prompt and they fit the 1024-token context.
    long = {"model": stack["model"], "messages": [{"role": "user", "content": "Write a long essay."}],
            "max_tokens": 900, "temperature": 0, "stream": True, "logit_bias": NO_EOS}  # fmt: skip
    short = {**long, "max_tokens": 1, "stream": False}
    with httpx.stream("POST", url, json=long, timeout=60) as holder:
        lines = holder.iter_lines()  # keep a reference: a collected iterator closes the connection
        next(lines)  # the only lane is now busy
        queued: dict = {}
        waiter = threading.Thread(target=lambda: queued.update(r=httpx.post(url, json=short, timeout=30)))
        waiter.start()
        assert wait_until(lambda: "skippy_queue_depth 1.0" in httpx.get(stack["tight"] + "/metrics").text)
        full = httpx.post(url, json=short, timeout=30)
        waiter.join()
    assert full.status_code == 429 and int(full.headers["retry-after"]) >= 1
    assert envelope(full)["code"] == "queuefull"
    timed_out = queued["r"]
    assert timed_out.status_code == 429 and envelope(timed_out)["code"] == "admissiontimeout"
    assert "retry-after" in timed_out.headers


def test_503_when_a_stage_is_down(stack):
    faulty = stack["faulty_backend"]
    client = openai.OpenAI(base_url=stack["faulty"] + "/v1", api_key="unused", max_retries=0)
    faulty.mode = "down"
    try:
        with pytest.raises(openai.InternalServerError) as caught:
            chat(client, stack)
        assert caught.value.status_code == 503 and "stage-1" in caught.value.message
        ready = httpx.get(stack["faulty"] + "/readyz")
        assert ready.status_code == 503 and "stage-1" in envelope(ready)["message"]
    finally:
        faulty.mode = None
    assert httpx.get(stack["faulty"] + "/readyz").status_code == 200


def local_port(response: httpx.Response) -> int:
    return response.extensions["network_stream"].get_extra_info("socket").getsockname()[1]


def test_an_internal_failure_is_a_500_envelope_on_a_connection_that_stays_open(stack):
    faulty = stack["faulty_backend"]
    body = {"model": stack["model"], "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 4}
    with httpx.Client(base_url=stack["faulty"], timeout=60) as http:
        faulty.mode = "bug"
        try:
            failed = http.post("/v1/chat/completions", json=body)
        finally:
            faulty.mode = None
        assert failed.status_code == 500 and envelope(failed)["code"] == "internal_error"
        assert "RuntimeError" in envelope(failed)["message"] and failed.headers.get("connection") != "close"
        after = http.post("/v1/chat/completions", json=body)  # the same keep-alive connection
        assert after.status_code == 200 and local_port(after) == local_port(failed)


def test_a_tool_call_history_with_null_content_is_answered(stack):
    """An agent loop's history: the assistant's tool call has no content, then a tool result.
    SmolLM2's template concatenates content (no tool support): the call's content is empty text."""
    messages = [{"role": "user", "content": "What is the weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21C"}]
    with httpx.Client(base_url=stack["main"], timeout=60) as http:
        first = http.post("/v1/chat/completions", json={"model": stack["model"], "messages": messages,
                                                          "max_tokens": 8, "temperature": 0})
        assert first.status_code == 200, first.text
        assert first.json()["choices"][0]["message"]["content"]
        second = http.post("/v1/chat/completions", json={"model": stack["model"], "max_tokens": 4,
                                                           "messages": [{"role": "user", "content": "hi"}]})
        assert second.status_code == 200 and local_port(second) == local_port(first)


def test_stream_failing_midway_ends_with_error_then_done(stack):
    faulty = stack["faulty_backend"]
    body = {"model": stack["model"], "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 20,
            "temperature": 0, "stream": True}  # fmt: skip
    faulty.mode = "midstream"
    try:
        with httpx.stream("POST", stack["faulty"] + "/v1/chat/completions", json=body, timeout=60) as response:
            assert response.status_code == 200
            events = sse_events(response)
    finally:
        faulty.mode = None
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == "stage_unavailable" and "stage-1" in events[-2]["error"]["message"]
    # the SDK surfaces the error event as an exception
    client = openai.OpenAI(base_url=stack["faulty"] + "/v1", api_key="unused", max_retries=0)
    faulty.mode = "midstream"
    try:
        with pytest.raises(openai.APIError, match="stage-1"):
            list(chat(client, stack, temperature=0, max_tokens=20, stream=True))
    finally:
        faulty.mode = None
    assert wait_until(lambda: active_sessions(stack["main"]) == 0)


def test_504_on_backend_timeout(stack):
    client = openai.OpenAI(base_url=stack["impatient"] + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.APIStatusError) as caught:
        chat(client, stack, max_tokens=4)
    assert caught.value.status_code == 504
    assert wait_until(lambda: active_sessions(stack["main"]) == 0)


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": QUESTION}]}),
    ("/v1/completions", {"prompt": "The capital of France is"}),
])
@pytest.mark.parametrize("stream", [False, True])
def test_model_may_be_left_out(stack, path, body, stream):
    """One model is served, so a request without `model` gets it (as llama.cpp's server and vLLM do)."""
    request = {**body, "max_tokens": 4, "temperature": 0, "stream": stream}
    response = httpx.post(stack["main"] + path, json=request, timeout=120)
    assert response.status_code == 200, response.text
    replies = sse_events(response)[:-1] if stream else [response.json()]
    assert replies and all(reply["model"] == stack["model"] for reply in replies)
    if stream:
        assert sse_events(response)[-1] == "[DONE]"
    pieces = [choice.get("text") or (choice.get("message") or choice.get("delta") or {}).get("content")
              for reply in replies for choice in reply["choices"]]
    assert "".join(piece or "" for piece in pieces).strip()


def test_served_model_names_and_cors(stack):
    url, auth = stack["aliased"], {"Authorization": "Bearer s3cret"}
    assert [m["id"] for m in httpx.get(url + "/v1/models", headers=auth).json()["data"]] == ["smol", "gpt-4o-mini"]
    client = openai.OpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0)
    answer = client.chat.completions.create(model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=3)
    assert answer.model == "gpt-4o-mini"  # the name the request used
    unnamed = httpx.post(url + "/v1/chat/completions", headers=auth, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    assert unnamed.status_code == 200 and unnamed.json()["model"] == "smol"  # no `model`: the served id
    with pytest.raises(openai.NotFoundError, match="'smol' or 'gpt-4o-mini'"):
        client.chat.completions.create(model=stack["model"], messages=[{"role": "user", "content": "hi"}])
    # a browser's preflight needs no API key; only the allowed origin is let in
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
    allowed = httpx.options(url + "/v1/chat/completions", headers={"Origin": "http://localhost:3000", **preflight})
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == "http://localhost:3000"
    other = httpx.options(url + "/v1/chat/completions", headers={"Origin": "http://evil.example", **preflight})
    assert "access-control-allow-origin" not in other.headers
    listed = httpx.get(url + "/v1/models", headers={"Origin": "http://localhost:3000", **auth})
    assert listed.headers["access-control-allow-origin"] == "http://localhost:3000"
    assert "access-control-allow-origin" not in httpx.get(stack["main"] + "/v1/models",
                                                          headers={"Origin": "http://localhost:3000"}).headers
