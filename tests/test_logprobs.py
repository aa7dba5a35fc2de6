"""Logprobs end to end: chat `logprobs`/`top_logprobs` and completions `logprobs` + `echo`
through one and three in-process stages (float32 weights, prefix cache on), streamed and not,
speculation on and off, against transformers' log-softmax on the same GGUF."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from prefix_chain_support import LoopThread, start_cached_chain
from skippy.api.app import ApiSettings, create_app
from skippy.driver.chain_backend import ChainBackend
from skippy.protocol import KvCacheConfig

TOLERANCE = 1e-3
KV = KvCacheConfig(min_tokens=8, stride_tokens=16)
TEXT = ("The history of the printing press begins in the fifteenth century, when movable type made "
        "books cheap enough for merchants, students and craftsmen to own.")
MESSAGES = [{"role": "user", "content": f"Repeat the following text exactly:\n\n{TEXT}"}]
MODEL = "m"


@pytest.fixture(scope="module")
def loop():
    thread = LoopThread()
    yield thread
    thread.close()


@pytest.fixture(scope="module")
def chains(loop, make_stage, gguf_path, tokenizer):
    """1 and 3 stages, each with a prefix cache on every stage and 16-token prefill chunks (a
    prompt's logprobs then span chunks), behind the API on their own loop."""
    out = {}
    for num_stages in (1, 3):
        chain = loop.run(start_cached_chain(make_stage, gguf_path, num_stages, KV, prefill_chunk=16))
        out[num_stages] = (chain, create_app(ChainBackend(chain.client, None), tokenizer, ApiSettings(model_id=MODEL)))
    yield out
    for chain, _ in out.values():
        loop.run(chain.client.close())
        for server in chain.servers:
            loop.run(server.close())


@pytest.fixture(scope="module")
def reference(hf_model):
    """ids -> transformers' [len(ids), V] log-softmax (float32 path, the same GGUF)."""
    memo = {}

    def log_probs(ids: list[int]) -> torch.Tensor:
        key = tuple(ids)
        if key not in memo:
            with torch.inference_mode():
                memo[key] = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)
        return memo[key]

    return log_probs


def post(loop, app, path: str, body: dict) -> httpx.Response:
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t",
                                     timeout=600) as http:
            return await http.post(path, json={"model": MODEL, **body})
    return loop.run(go())


def events(response: httpx.Response) -> list[dict]:
    return [json.loads(line[6:]) for line in response.text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


def check_entry(entry: dict, expected: float, row: torch.Tensor, num_top: int, tokenizer) -> None:
    assert abs(entry["logprob"] - expected) < TOLERANCE, (entry["logprob"], expected)
    top = entry["top_logprobs"]
    assert len(top) == num_top
    values = [t["logprob"] for t in top]
    assert values == sorted(values, reverse=True)
    reference_top = row.topk(num_top).values.tolist()
    assert all(abs(a - b) < TOLERANCE for a, b in zip(values, reference_top))
    for item in (entry, *top):
        assert item["bytes"] == list(item["token"].encode("utf-8"))


@pytest.mark.parametrize("num_stages", [1, 3])
def test_chat_logprobs_match_transformers(loop, chains, reference, tokenizer, num_stages):
    _, app = chains[num_stages]
    body = dict(messages=MESSAGES, temperature=0, max_tokens=12, logprobs=True, top_logprobs=5,
                return_token_ids=True, logit_bias={"2": -100})
    plain = post(loop, app, "/v1/chat/completions", {**body, "speculative": False}).json()
    prompt, ids = plain["prompt_token_ids"], plain["choices"][0]["token_ids"]
    content = plain["choices"][0]["logprobs"]["content"]
    assert len(content) == len(ids) == 12
    log_probs = reference(prompt + ids)
    for j, (entry, token) in enumerate(zip(content, ids)):
        row = log_probs[len(prompt) - 1 + j]
        check_entry(entry, float(row[token]), row, 5, tokenizer)
        assert entry["token"] == tokenizer.decode([token])
        assert entry["top_logprobs"][0]["token"] == entry["token"]  # greedy: the top-1 token
        assert int(row.argmax()) == token

    fast = post(loop, app, "/v1/chat/completions", {**body, "speculative": {"mode": "ngram-suffix"}}).json()
    assert fast["choices"][0]["token_ids"] == ids
    assert fast["timings"]["draft_n_accepted"] > 0  # accepted drafts carried their own rows' logprobs
    for got, want in zip(fast["choices"][0]["logprobs"]["content"], content):
        assert got["token"] == want["token"] and abs(got["logprob"] - want["logprob"]) < TOLERANCE
        assert [t["token"] for t in got["top_logprobs"]][:1] == [want["top_logprobs"][0]["token"]]

    for speculative in (False, "ngram-suffix"):
        streamed = events(post(loop, app, "/v1/chat/completions",
                               {**body, "stream": True, "speculative": speculative}))
        chunks = [choice["logprobs"]["content"] for event in streamed for choice in event["choices"]
                  if choice.get("logprobs")]
        assert all(chunks)  # a chunk carries logprobs only for tokens it carries
        joined = [entry for chunk in chunks for entry in chunk]
        assert [e["token"] for e in joined] == [e["token"] for e in content]
        assert all(abs(a["logprob"] - b["logprob"]) < TOLERANCE for a, b in zip(joined, content))

    no_logprobs = post(loop, app, "/v1/chat/completions", {**body, "logprobs": False, "top_logprobs": None})
    assert no_logprobs.json()["choices"][0]["logprobs"] is None


@pytest.mark.parametrize("num_stages", [1, 3])
def test_echo_prompt_logprobs_skip_the_prefix_cache(loop, chains, reference, tokenizer, num_stages):
    _, app = chains[num_stages]
    prompt = f"{TEXT} {TEXT[:60]}"
    ids = tokenizer.encode(prompt)
    assert len(ids) > 32  # several 16-token prefill chunks
    for _ in range(2):  # the second of these restores the prompt's prefix from every stage's cache
        cached = post(loop, app, "/v1/completions", dict(prompt=prompt, max_tokens=1, temperature=0)).json()
    assert cached["usage"]["prompt_tokens_details"]["cached_tokens"] > 0

    log_probs = reference(ids)
    for stream in (False, True):
        response = post(loop, app, "/v1/completions", dict(prompt=prompt, max_tokens=0, echo=True, logprobs=3,
                                                           temperature=0, stream=stream))
        assert response.status_code == 200, response.text
        if stream:
            choices = [event["choices"][0] for event in events(response) if event["choices"]]
            parts = [c["logprobs"] for c in choices if c.get("logprobs")]
            logprobs = {key: [v for part in parts for v in part[key]] for key in parts[0]}
            text = "".join(c["text"] for c in choices)
        else:
            data = response.json()
            assert data["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # computed, not restored
            assert data["usage"]["completion_tokens"] == 0
            logprobs, text = data["choices"][0]["logprobs"], data["choices"][0]["text"]
        assert text == prompt
        assert logprobs["tokens"] == [tokenizer.decode([t]) for t in ids]
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        for j in range(1, len(ids)):
            row = log_probs[j - 1]
            assert abs(logprobs["token_logprobs"][j] - float(row[ids[j]])) < TOLERANCE, j
            top = logprobs["top_logprobs"][j]
            assert logprobs["tokens"][j] in top and len(top) in (3, 4)
        offsets = logprobs["text_offset"]
        assert offsets[0] == 0 and all(b - a == len(t) for a, b, t in zip(offsets, offsets[1:], logprobs["tokens"]))

    # echo with a completion: the prompt's entries, then the completion's, in one list
    data = post(loop, app, "/v1/completions", dict(prompt=ids, max_tokens=3, echo=True, logprobs=1,
                                                   temperature=0, return_token_ids=True)).json()
    completion = data["choices"][0]["token_ids"]
    token_logprobs = data["choices"][0]["logprobs"]["token_logprobs"]
    assert len(token_logprobs) == len(ids) + len(completion)
    full = reference(ids + completion)
    for j in range(1, len(ids) + len(completion)):
        assert abs(token_logprobs[j] - float(full[j - 1][(ids + completion)[j]])) < TOLERANCE


def test_logprob_requests_out_of_range_are_400s(loop, chains):
    _, app = chains[1]
    for path, body, param in (
            ("/v1/chat/completions", dict(messages=MESSAGES, top_logprobs=3), "top_logprobs"),
            ("/v1/chat/completions", dict(messages=MESSAGES, logprobs=True, top_logprobs=21), None),
            ("/v1/completions", dict(prompt="Hello", logprobs=6), None),
            ("/v1/completions", dict(prompt="Hello", max_tokens=-1), None)):
        response = post(loop, app, path, {**body, "max_tokens": body.get("max_tokens", 2)})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error"
        if param:
            assert error["param"] == param
