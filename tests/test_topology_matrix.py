"""One engine for every topology: the same API requests through `skippy serve --stages 1`,
`--stages 2` and `--stages 3` give identical greedy text and identical cached-token counts
(stream and not, stop strings, a seed, penalties, a prefix-cache hit, speculation on)."""

from __future__ import annotations

import json

import httpx
import pytest

from frontend_support import ServeProcess
from prefix_chain_support import system_text

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct.Q4_1"
QUESTION = [{"role": "user", "content": "Name three rivers of Europe and one fact about each."}]
NO_EOS = {"0": -100, "2": -100}  # SmolLM2's end tokens banned: every answer runs to max_tokens


def chat(url: str, **body) -> dict:
    response = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": QUESTION, **body},
                          timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


def streamed_chat(url: str, **body) -> str:
    parts = []
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=300,
                      json={"model": MODEL, "messages": QUESTION, "stream": True, **body}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choices = json.loads(line[6:])["choices"]
                if choices and choices[0]["delta"].get("content"):
                    parts.append(choices[0]["delta"]["content"])
    return "".join(parts)


def completion(url: str, prompt, **body) -> tuple[str, int, str]:
    response = httpx.post(url + "/v1/completions", timeout=300,
                          json={"model": MODEL, "prompt": prompt, "temperature": 0, **body})
    assert response.status_code == 200, response.text
    data = response.json()
    choice = data["choices"][0]
    return choice["text"], data["usage"]["prompt_tokens_details"]["cached_tokens"], choice["finish_reason"]


def outcomes(url: str, long_prompt: list[int]) -> dict:
    greedy = dict(temperature=0, max_tokens=24, logit_bias=NO_EOS)
    out = {
        "greedy": chat(url, **greedy)["choices"][0]["message"]["content"],
        "streamed": streamed_chat(url, **greedy),
        "stop": completion(url, "The three primary colours are", max_tokens=40, stop=[","]),
        "seed": chat(url, temperature=0.9, top_p=0.95, seed=1234, max_tokens=20,
                     logit_bias=NO_EOS)["choices"][0]["message"]["content"],
        "penalties": chat(url, **greedy, frequency_penalty=0.8, presence_penalty=0.5,
                          repetition_penalty=1.2)["choices"][0]["message"]["content"],
        "speculative": chat(url, **greedy, speculative="ngram-suffix")["choices"][0]["message"]["content"],
        "cold": completion(url, long_prompt, max_tokens=8),
        "repeated": completion(url, long_prompt, max_tokens=8),
    }
    return out


@pytest.fixture(scope="module")
def long_prompt(tokenizer) -> list[int]:
    ids = tokenizer.encode(system_text(40) + " Question: what does rule 4 ask for?")
    assert len(ids) >= 600
    return ids[:600]


def test_every_topology_answers_alike(tmp_path, long_prompt):
    results = {}
    for stages in (1, 2, 3):
        server = ServeProcess(["--stages", str(stages), "--kv-cache-mem", "512MiB", "--ctx-size", "2048"],
                              tmp_path / f"serve-{stages}.log")
        try:
            results[stages] = outcomes(server.url, long_prompt)
        finally:
            assert server.stop() == 0
    one = results[1]
    assert one["streamed"] == one["greedy"] and one["speculative"] == one["greedy"]
    assert one["stop"][2] == "stop" and "," not in one["stop"][0]
    cold_text, cold_cached, _ = one["cold"]
    text, cached, _ = one["repeated"]
    assert cold_cached == 0 and cached > 0 and text == cold_text  # --stages 1 has a prefix cache
    for stages in (2, 3):
        assert results[stages] == one, f"--stages {stages} answered differently from --stages 1"
