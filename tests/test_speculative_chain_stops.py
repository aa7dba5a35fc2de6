"""Where speculative decoding through the chain stops, and what it reports (spec §5.3, §5.4).

An oracle proposer (the known greedy continuation) makes windows as long as a test wants,
so max_tokens, a stop id or a stop string lands inside an accepted window: the output
must end exactly where token-by-token decoding ends it. A corrupted oracle with
pipelined windows forces stale windows (DiscardStaleWindows) and still changes nothing.
The OpenAI request's `speculative` extension, the timings and /metrics; and speculation
after a prefix-cache restore equals a cold run without speculation.
"""

from __future__ import annotations

import json
import re

import httpx
import pytest

from chain_support import start_chain
from prefix_chain_support import LoopThread, start_cached_chain, system_text
from speculative_support import NUM_TOKENS, Oracle, encode_prompts, one_thread  # noqa: F401
from skippy.api.app import ApiSettings, create_app
from skippy.driver.chain_backend import ChainBackend
from skippy.launch.local_chain import plan_chain
from skippy.protocol import KvCacheConfig, cache_namespace_digest
from skippy.runtime.speculation import SpeculativeSettings

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def loop():
    loop = LoopThread()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def chain(make_stage, loop):
    chain = loop.run(start_chain(make_stage, 3, ctx_size=2048))
    yield chain
    loop.run(chain.close())


@pytest.fixture(scope="module")
def prompt(tokenizer):
    return encode_prompts(tokenizer)["list"]


@pytest.fixture(scope="module")
def future(chain, loop, prompt):
    """The greedy continuation with speculation off, run to NUM_TOKENS (no stop ids)."""
    result = loop.run(chain.client.generate(prompt, max_tokens=NUM_TOKENS))
    assert len(result.tokens) == NUM_TOKENS
    return result.tokens


@pytest.fixture
def oracle(prompt, future):
    Oracle.prompt_len, Oracle.future, Oracle.wrong_every = len(prompt), future, 0
    yield Oracle
    Oracle.wrong_every = 0


def oracle_settings(width: int = 4, depth: int = 1) -> SpeculativeSettings:
    return SpeculativeSettings("test-oracle", width, width, depth)


@pytest.mark.parametrize("depth", [1, 3])
@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5, 7, 9])
def test_max_tokens_inside_an_accepted_window(chain, loop, prompt, future, oracle, max_tokens, depth):
    result = loop.run(chain.client.generate(prompt, max_tokens=max_tokens,
                                            speculative=oracle_settings(4, depth)))
    assert result.tokens == future[:max_tokens]
    assert result.finish_reason == "length"
    figures = result.speculation
    assert figures.get("speculative_num_rejected_tokens", 0) == 0
    if max_tokens in (3, 5, 9):  # the last window reached the budget: cut there, never past it
        assert figures["speculative_num_stopped_windows"] == 1


@pytest.mark.parametrize("depth", [1, 3])
@pytest.mark.parametrize("stop_at", [2, 4, 5, 8])
def test_a_stop_id_inside_an_accepted_window(chain, loop, prompt, future, oracle, stop_at, depth):
    stop = future[stop_at]
    expected = future[:future.index(stop)]  # token by token stops at its first occurrence
    result = loop.run(chain.client.generate(prompt, max_tokens=NUM_TOKENS, stop_ids=[stop],
                                            speculative=oracle_settings(4, depth)))
    assert result.tokens == expected
    assert result.finish_reason == "stop"
    assert result.speculation["speculative_num_stopped_windows"] == 1


def test_rejections_with_pipelined_windows_discard_stale_ones(chain, loop, prompt, future, oracle):
    oracle.wrong_every = 5  # every fifth draft is wrong
    result = loop.run(chain.client.generate(prompt, max_tokens=NUM_TOKENS,
                                            speculative=oracle_settings(3, 3)))
    assert result.tokens == future
    figures = result.speculation
    assert figures["speculative_num_rejected_windows"] > 0
    assert figures["speculative_stale_windows"] > 0  # windows behind a rejection were discarded
    assert figures["speculative_num_accepted_tokens"] > 0
    final = chain.servers[-1].runtime
    assert len(final.sessions) == 0


def test_request_extension_stop_string_timings_and_metrics(make_stage, loop, tokenizer, gguf_path):
    """Through the OpenAI API on a 2-stage ChainBackend: a stop string inside an accepted
    window cuts the text where a non-speculative request cuts it."""

    async def main():
        chain = await start_chain(make_stage, 2, ctx_size=2048)
        topology = plan_chain(gguf_path, ["127.0.0.1:1", "127.0.0.1:2"])[0]
        backend = ChainBackend(chain.client, topology)
        app = create_app(backend, tokenizer, ApiSettings(model_id="m"))
        transport = httpx.ASGITransport(app=app)
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://test",
                                         timeout=600) as http:
                async def chat(**fields):
                    body = {"model": "m", "temperature": 0, "max_tokens": 32,
                            "messages": [{"role": "user", "content": "List the days of the week."}],
                            "logit_bias": {"2": -100}, **fields}  # no end token: run to max_tokens
                    response = await http.post("/v1/chat/completions", json=body)
                    assert response.status_code == 200, response.text
                    return response.json()

                off = await chat(return_token_ids=True, speculative=False)
                text = off["choices"][0]["message"]["content"]
                Oracle.prompt_len = len(off["prompt_token_ids"])
                Oracle.future = off["choices"][0]["token_ids"]
                oracle = {"mode": "test-oracle", "min_window": 8, "max_window": 8}
                on = await chat(speculative=oracle)
                assert on["choices"][0]["message"]["content"] == text
                timings = on["timings"]
                assert timings["speculative_mode"] == "test-oracle"
                assert timings["draft_n"] == timings["draft_n_accepted"] > 0
                assert timings["speculative_acceptance_rate"] == 1.0
                assert "speculative_num_windows" not in off["timings"]

                stop = text[len(text) // 2:len(text) // 2 + 5]  # from the middle of the answer
                cut = await chat(stop=[stop])
                cut_on = await chat(stop=[stop], speculative=oracle)
                assert cut_on["choices"][0]["message"]["content"] == text[:text.index(stop)]
                assert cut_on["choices"][0]["message"]["content"] == cut["choices"][0]["message"]["content"]
                assert cut_on["choices"][0]["finish_reason"] == "stop"
                assert cut_on["usage"] == cut["usage"]
                events = []
                async with http.stream("POST", "/v1/chat/completions", json={
                        "model": "m", "temperature": 0, "max_tokens": 32, "stream": True,
                        "logit_bias": {"2": -100}, "stop": [stop], "speculative": oracle,
                        "messages": [{"role": "user", "content": "List the days of the week."}]}) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            events.append(json.loads(line[6:]))
                streamed = "".join(e["choices"][0]["delta"].get("content") or ""
                                   for e in events if e["choices"])
                assert streamed == text[:text.index(stop)]

                bad = await http.post("/v1/chat/completions", json={
                    "model": "m", "messages": [{"role": "user", "content": "hi"}],
                    "speculative": {"mode": "draft"}})
                assert bad.status_code == 400 and "draft model" in bad.json()["error"]["message"]
                bad = await http.post("/v1/chat/completions", json={
                    "model": "m", "messages": [{"role": "user", "content": "hi"}],
                    "speculative": {"mode": "psychic"}})
                assert bad.status_code == 400 and bad.json()["error"]["param"] == "speculative"

                metrics = (await http.get("/metrics")).text
                accepted = re.search(r'skippy_speculative_draft_tokens_total\{outcome="accepted"\} (\S+)',
                                     metrics)
                assert accepted and float(accepted.group(1)) == timings["draft_n_accepted"]
                assert "skippy_speculative_window_width_bucket" in metrics
        finally:
            await chain.close()

    loop.run(main())


def test_speculation_after_a_prefix_restore_equals_a_cold_run(make_stage, loop, tokenizer, gguf_path):
    """The original system's known failure: speculative windows right after a restore."""
    system = tokenizer.encode(system_text(14))
    settings = SpeculativeSettings("ngram-suffix", 1, 8)

    async def main():
        chain = await start_cached_chain(make_stage, gguf_path, 2, KvCacheConfig(max_bytes=128 << 20))
        try:
            client = chain.client
            first = system + tokenizer.encode(" Question: repeat rule 2 word for word.")
            await client.generate(first, max_tokens=4)  # records the shared system prompt
            prompt = system + tokenizer.encode(" Question: repeat rule 3 word for word.")
            warm = await client.generate(prompt, max_tokens=NUM_TOKENS, speculative=settings,
                                         stop_ids=tokenizer.eog_ids)
            cold = await client.generate(prompt, max_tokens=NUM_TOKENS, stop_ids=tokenizer.eog_ids,
                                         cache_namespace=cache_namespace_digest("never-used"))
            return warm, cold
        finally:
            await chain.close()

    warm, cold = loop.run(main())
    assert warm.timings.restore_decision == "chain_restore_hit" and warm.timings.restored_tokens > 0
    assert cold.timings.restore_decision == "stage0_miss"
    assert warm.speculation["speculative_num_windows"] > 0
    assert (warm.tokens, warm.finish_reason) == (cold.tokens, cold.finish_reason)
