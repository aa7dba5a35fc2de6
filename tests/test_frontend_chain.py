"""A real `skippy serve` (2 stages: stage 0 in the serve process, stage 1 a child process on
loopback), driven with the `openai` package and httpx. One server for the module; the stage-kill
test runs last (its stage comes back as a new process).
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from frontend_support import ServeProcess, child_pids, is_alive, wait_until

# Asked for one sentence, so the answer is short. (On the bare question llama.cpp's
# one int8 level of activations answers "L'Étoile, la Cité, la Nation, ..."; ours, with
# two levels, says Paris as float32 does.)
QUESTION = "What is the capital of France? Answer in one sentence."
NO_EOS = {"0": -100, "2": -100}  # logit_bias banning SmolLM2's end tokens: runs to max_tokens
STAGE1_SUMMARY = re.compile(r"stage\.request_summary stage_index=1 ")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("serve")
    # The one-process reference loads while the chain does (one model load's wall time, not two).
    reference = subprocess.Popen(
        [sys.executable, "-m", "skippy.cli", "generate", "--json", "--max-tokens", "24", QUESTION],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    server = ServeProcess(["--ctx-size", "1024"], log_dir / "serve.log")
    try:
        out, _ = reference.communicate(timeout=900)
        assert reference.returncode == 0
        server.reference = json.loads(out)
        yield server
    finally:
        code = server.stop(signal.SIGTERM)
        assert code == 0, server.log_text()[-3000:]


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model_id(client):
    return client.models.list().data[0].id


def chat(client, model_id, content=QUESTION, **kwargs):
    return client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": content}], **kwargs)


def stages(served) -> list[dict]:
    return httpx.get(served.url + "/v1/stages").json()["data"]


def all_idle(served) -> bool:
    return all(stage["active_sessions"] == 0 for stage in stages(served))


def test_ready_line_stages_and_readiness(served, client):
    # SmolLM2's output head weighs as much as 8 of its layers: 19 + (11 + 8) balances the stages
    assert "2 stages" in served.ready_line and "stage-1 layers [19, 30)" in served.ready_line
    listed = stages(served)
    assert [(s["id"], s["layer_start"], s["layer_end"], s["state"]) for s in listed] == [
        ("stage-0", 0, 19, "ready"), ("stage-1", 19, 30, "ready")]  # fmt: skip
    assert httpx.get(served.url + "/readyz").json() == {"status": "ready"}
    assert client.models.list().data[0].model_extra["num_stages"] == 2


def test_greedy_chat_on_the_chain_equals_skippy_generate(served, client, model_id, tokenizer):
    reference = served.reference
    response = chat(client, model_id, temperature=0, max_tokens=24, extra_body={"return_token_ids": True})
    choice = response.choices[0]
    assert response.model_extra["prompt_token_ids"] == reference["prompt_ids"]
    assert choice.model_extra["token_ids"] == reference["completion_ids"]
    assert choice.message.content == reference["text"] and "Paris" in choice.message.content
    template = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}])
    assert response.usage.prompt_tokens == len(tokenizer.encode(template))
    assert response.usage.completion_tokens == len(reference["completion_ids"])
    assert response.usage.prompt_tokens_details.cached_tokens == 0
    assert response.model_extra["timings"]["predicted_n"] == response.usage.completion_tokens


def test_streaming_stops_and_completions(served, client, model_id):
    full = chat(client, model_id, temperature=0, max_tokens=24).choices[0].message.content
    stop = "aris"
    chunks = list(chat(client, model_id, temperature=0, max_tokens=24, stop=stop, stream=True,
                       stream_options={"include_usage": True}))  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert "".join(pieces) == full[: full.index(stop)]
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
    assert chunks[-1].usage.completion_tokens >= 1
    whole = client.completions.create(model=model_id, prompt="Once upon a time", temperature=0, max_tokens=10)
    streamed = client.completions.create(model=model_id, prompt="Once upon a time", temperature=0, max_tokens=10,
                                         stream=True)  # fmt: skip
    assert "".join(c.choices[0].text for c in streamed) == whole.choices[0].text
    assert whole.usage.completion_tokens == 10 and whole.choices[0].finish_reason == "length"


def test_seeded_sampling_is_reproducible(client, model_id):
    first = chat(client, model_id, "Tell me a story.", max_tokens=12, temperature=1.0, seed=7)
    again = chat(client, model_id, "Tell me a story.", max_tokens=12, temperature=1.0, seed=7)
    assert again.choices[0].message.content == first.choices[0].message.content


def test_eight_concurrent_streams_complete(served, client, model_id):
    results: list = [None] * 8

    def run(i: int) -> None:
        chunks = list(chat(client, model_id, f"Count from {i} to {i + 5}.", temperature=0, max_tokens=12,
                           stream=True))  # fmt: skip
        results[i] = chunks[-1].choices[0].finish_reason

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert all(reason in ("stop", "length") for reason in results), results
    assert wait_until(lambda: all_idle(served))


def test_client_disconnect_stops_the_session_on_every_stage(served, model_id):
    num_summaries = len(STAGE1_SUMMARY.findall(served.log_text()))
    body = {"model": model_id, "messages": [{"role": "user", "content": "Write a long essay."}],
            "max_tokens": 500, "temperature": 0, "stream": True, "logit_bias": NO_EOS}  # fmt: skip
    with httpx.stream("POST", served.url + "/v1/chat/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        events = 0
        while events < 4:
            events += next(lines).startswith("data: ")
        assert [s["active_sessions"] for s in stages(served)] == [1, 1]
    assert wait_until(lambda: all_idle(served), timeout_s=5)
    # Stage 1 logs its request summary when it handles Stop: the Stop reached it.
    assert wait_until(lambda: len(STAGE1_SUMMARY.findall(served.log_text())) == num_summaries + 1, timeout_s=5)
    assert "ended without Stop" not in served.log_text()


def stream_text(served, body: dict, on_event=lambda count: None) -> tuple[str, list[str]]:
    """(the streamed content, every `data:` payload) of one streamed chat completion;
    `on_event(n)` runs after the n-th payload arrives."""
    events = []
    with httpx.stream("POST", served.url + "/v1/chat/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line.removeprefix("data: "))
                on_event(len(events))
    pieces = [choices[0]["delta"].get("content") or "" for event in events[:-1]
              if (choices := json.loads(event).get("choices"))]
    return "".join(pieces), events


def test_killing_a_stage_mid_stream_the_stream_goes_on(served, client, model_id):
    """The supervisor restarts the killed stage; stage 0 replays the session onto it and
    the client sees a pause, then the rest of the same text: no error event."""
    body = {"model": model_id, "messages": [{"role": "user", "content": "Write a long essay."}],
            "max_tokens": 80, "temperature": 0, "stream": True, "logit_bias": NO_EOS}  # fmt: skip
    uninterrupted, _ = stream_text(served, body)
    (stage_pid,) = child_pids(served.process.pid)

    def kill_at_ten(count: int) -> None:
        if count == 10:
            subprocess.run(["kill", "-9", str(stage_pid)], check=True)

    text, events = stream_text(served, body, kill_at_ten)
    assert events[-1] == "[DONE]" and not any('"error"' in e for e in events), events[-3:]
    assert text == uninterrupted
    assert not is_alive(stage_pid)
    (restarted,) = child_pids(served.process.pid)
    assert restarted != stage_pid
    stage1 = stages(served)[1]
    assert stage1["restarts"] == 1 and stage1["state"] == "ready" and "SIGKILL" in stage1["last_failure"]
    # a request after the recovery answers as before, with no restart of skippy serve
    response = chat(client, model_id, temperature=0, max_tokens=24)
    assert response.choices[0].message.content == served.reference["text"]
    metrics = httpx.get(served.url + "/metrics").text
    assert 'skippy_stage_restarts{stage="stage-1"} 1.0' in metrics and "skippy_chain_recoveries_total 1.0" in metrics
