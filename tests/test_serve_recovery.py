"""Transparent recovery through `skippy serve --stages 3`: a stage killed under running
requests is restarted by the supervisor, each request replays its prompt and committed tokens
onto the whole chain, and every answer equals its uninterrupted run (greedy)."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time

import httpx
import pytest

from frontend_support import ServeProcess, wait_until
from prefix_chain_support import system_text
from test_serve_supervision import stage, stage_pid

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct.Q4_1"
NO_EOS = {"0": -100, "2": -100}


def complete(url: str, prompt, max_tokens: int = 120, cache_key: str | None = None, stream: bool = False) -> str:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logit_bias": NO_EOS,
            "prompt_cache_key": cache_key, "stream": stream}
    if not stream:
        response = httpx.post(url + "/v1/completions", timeout=300, json=body)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["text"]
    pieces = []
    with httpx.stream("POST", url + "/v1/completions", timeout=300, json=body) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                assert "error" not in event, event  # a pause, never an error event
                pieces.extend(choice["text"] for choice in event["choices"])
    return "".join(pieces)


def run_while_killing(url: str, server: ServeProcess, prompts: list, stage_index: int, after_s: float,
                      cache_key: str | None = None, stream: bool = False) -> list:
    """Answers to `prompts`, sent at once, with stage `stage_index` SIGKILLed `after_s` in."""
    answers: list = [None] * len(prompts)

    def ask(i: int) -> None:
        answers[i] = complete(url, prompts[i], cache_key=cache_key, stream=stream)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    time.sleep(after_s)
    os.kill(stage_pid(server, stage_index), signal.SIGKILL)
    for thread in threads:
        thread.join(timeout=300)
    return answers


def test_requests_survive_killed_stages(tmp_path, tokenizer):
    server = ServeProcess(["--stages", "3", "--ctx-size", "2048", "--concurrency", "8"], tmp_path / "serve.log")
    try:
        url = server.url
        long_prompt = tokenizer.encode(system_text(60))[:1500]  # its prefill takes a while
        prompts = [f"Story {i}: once upon a time, in a village by the sea," for i in range(8)]
        expected, took = {}, {}
        for prompt in [*prompts, long_prompt]:
            key, started = prompt if isinstance(prompt, str) else "long", time.perf_counter()
            expected[key] = complete(url, prompt)
            took[key] = time.perf_counter() - started
        # each kill comes at a share of the request's own uninterrupted time, so that it lands
        # inside the request on a machine of any speed (a fixed 0.6 s outlasted a whole
        # 120-token request on a fast one)

        # killed during the prefill of a long prompt (the middle stage; a cache namespace of its own,
        # so nothing restores it), then mid-decode (the final one)
        assert run_while_killing(url, server, [long_prompt], 1, took["long"] / 4, cache_key="cold") == [
            expected["long"]]
        wait_until(lambda: stage(url, "stage-1")["state"] == "ready", 30)
        assert run_while_killing(url, server, [prompts[0]], 2, took[prompts[0]] / 2) == [expected[prompts[0]]]
        wait_until(lambda: stage(url, "stage-2")["state"] == "ready", 30)
        # eight concurrent streams while the middle stage dies (together they take longer than one alone)
        assert run_while_killing(url, server, prompts, 1, took[prompts[0]] / 2, stream=True) == [
            expected[p] for p in prompts]

        assert stage(url, "stage-1")["restarts"] == 2 and stage(url, "stage-2")["restarts"] == 1
        assert wait_until(lambda: all(s["active_sessions"] == 0
                                      for s in httpx.get(url + "/v1/stages").json()["data"]), timeout_s=10)
        recoveries = re.search(r"^skippy_chain_recoveries_total (\S+)$", httpx.get(url + "/metrics").text, re.M)
        assert float(recoveries.group(1)) >= 10  # every request under a kill replayed itself
    finally:
        assert server.stop() == 0


def test_a_speculative_request_survives_a_killed_stage(tmp_path):
    server = ServeProcess(["--stages", "3", "--speculative", "ngram-suffix"], tmp_path / "serve.log")
    try:
        prompt = "List the days of the week, then list them again in the same order:"
        expected = complete(server.url, prompt)
        assert run_while_killing(server.url, server, [prompt], 1, 0.5, stream=True) == [expected]
        assert stage(server.url, "stage-1")["restarts"] == 1
    finally:
        assert server.stop() == 0
