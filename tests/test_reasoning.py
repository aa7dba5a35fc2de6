"""Reasoning split on a thinking template: a tiny random-weight Qwen3 (transformers builds it,
tests/architecture_support.py) with a byte-level tokenizer and our own thinking template
(tests/chat_templates.py: `<think>` blocks, `enable_thinking`). The model's raw output (its
token ids, decoded by the tokenizer) is split at `</think>`: before it `reasoning_content`,
after it `content`, whole and streamed alike, with max_tokens counting both; thinking off
(`chat_template_kwargs` or `reasoning_effort: "none"`) renders the empty block and leaves it
all content. The split itself is checked on text with tags cut anywhere."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import transformers
from tokenizers import AddedToken, Tokenizer as HfTokenizer, decoders, models, pre_tokenizers

from architecture_support import COMMON, Case, build_reference, save_hf_dir
from chat_templates import THINKING_TEMPLATE
from frontend_support import running_server
from skippy.api.app import ApiSettings, create_app
from skippy.api.reasoning import ReasoningStream
from skippy.driver.chain_backend import ChainBackend
from skippy.launch.local_chain import start_stage0
from skippy.model.tokenizer import Tokenizer

SPECIALS = ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>"]
MAX_TOKENS = 24


def write_tokenizer(directory) -> int:
    """A byte-level tokenizer (one token a byte, no merges) plus the chat tokens; its size."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = HfTokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_tokens([AddedToken(text, special=False, normalized=False) for text in SPECIALS])
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "chat_template": THINKING_TEMPLATE}))
    return tokenizer.get_vocab_size()


@pytest.fixture(scope="module")
def thinking(tmp_path_factory):
    directory = tmp_path_factory.mktemp("thinking")
    vocab = write_tokenizer(directory)
    config = transformers.Qwen3Config(**dict(COMMON, vocab_size=vocab), num_hidden_layers=2)
    save_hf_dir(build_reference(Case("qwen3", config, "qwen3")), directory)
    tokenizer = Tokenizer.from_model(directory)
    client = asyncio.run(start_stage0(directory, concurrency=2, ctx_size=128))
    backend = ChainBackend(client, None)
    with running_server(create_app(backend, tokenizer, ApiSettings(model_id="tiny"))) as url:
        yield url, tokenizer
    asyncio.run(backend.close())


def chat(url, *, stream=False, **fields) -> dict:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Why is the sky blue?"}],
            "max_tokens": MAX_TOKENS, "return_token_ids": True, **fields}
    if not stream:
        response = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        return response.json()
    reasoning = content = ""
    with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}, timeout=120) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line.removeprefix("data: "))["choices"]:
                    reasoning += choice["delta"].get("reasoning_content") or ""
                    content += choice["delta"].get("content") or ""
    return {"reasoning": reasoning, "content": content}


def test_thought_and_answer_are_split_whole_and_streamed(thinking):
    url, tokenizer = thinking
    close = tokenizer.token_to_id("</think>")
    # a nudge towards </think> so the random model closes its thought partway (seeds where it
    # does not are passed over; at least two must)
    split = 0
    for seed in range(12):
        fields = dict(temperature=1.0, seed=seed, logit_bias={close: 3.0})
        data = chat(url, **fields)
        raw = tokenizer.decode(data["choices"][0]["token_ids"])
        message = data["choices"][0]["message"]
        assert data["usage"]["completion_tokens"] == len(data["choices"][0]["token_ids"]) <= MAX_TOKENS
        streamed = chat(url, stream=True, **fields)
        if "</think>" not in raw or raw.startswith("</think>"):
            continue
        thought, answer = raw.split("</think>", 1)
        assert message["reasoning_content"] == thought
        assert message["content"] == answer.lstrip()
        assert streamed == {"reasoning": thought, "content": answer.lstrip()}
        split += 1
    assert split >= 2


def test_thinking_off_leaves_everything_content(thinking):
    url, tokenizer = thinking
    off = chat(url, temperature=0, chat_template_kwargs={"enable_thinking": False})
    prompt = tokenizer.decode(off["prompt_token_ids"])
    assert prompt.endswith("<think>\n\n</think>\n\n")
    raw = tokenizer.decode(off["choices"][0]["token_ids"])
    assert not raw.lstrip().startswith("<think>")  # a block opens only at the reply's start; later it is text
    message = off["choices"][0]["message"]
    assert message["content"] == raw and "reasoning_content" not in message
    effort = chat(url, temperature=0, reasoning_effort="none")
    assert effort["prompt_token_ids"] == off["prompt_token_ids"]
    assert effort["choices"][0]["message"] == message
    on = chat(url, temperature=0)
    assert tokenizer.decode(on["prompt_token_ids"]).endswith("<|im_start|>assistant\n<think>\n")
    assert chat(url, stream=True, temperature=0, reasoning_effort="none") == {"reasoning": "", "content": raw}


@pytest.mark.parametrize("starts_inside", [False, True])
def test_the_split_holds_wherever_the_tags_are_cut(starts_inside):
    text = ("" if starts_inside else "\n<think>") + "a <b> and </thin k> stay</think>\n\n The answer </think> too"
    for size in range(1, 12):
        stream = ReasoningStream(starts_inside)
        parts = [stream.push(text[i:i + size]) for i in range(0, len(text), size)] + [stream.flush()]
        assert "".join(r for r, _ in parts) == "a <b> and </thin k> stay"
        assert "".join(c for _, c in parts) == "The answer </think> too"
