"""Our layer-sliced runtime against Hugging Face transformers loading the same GGUF."""

from __future__ import annotations

import pytest
import torch

from skippy.model.llama import Segment

PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Translate to French: The weather is nice today.",
    "List three colours of the rainbow.",
    "Explain in one sentence why the sky is blue.",
]
NUM_GREEDY_TOKENS = 32


def chat_ids(tokenizer, prompt: str) -> list[int]:
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": prompt}]))


def greedy_generate(model, prompt_ids: list[int], num_tokens: int) -> list[int]:
    cache = model.new_cache(len(prompt_ids) + num_tokens)
    hidden = model.forward(torch.tensor(prompt_ids), [Segment(cache, 0, len(prompt_ids))])
    out = [int(model.compute_logits(hidden[-1:]).argmax())]
    while len(out) < num_tokens:
        hidden = model.forward(torch.tensor(out[-1:]), [Segment(cache, cache.length, 1)])
        out.append(int(model.compute_logits(hidden).argmax()))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("prompt", PROMPTS)
def test_last_logits_match_transformers(prompt, hf_model, make_stage, tokenizer):
    ids = chat_ids(tokenizer, prompt)
    model = make_stage()
    with torch.no_grad():
        expected = hf_model(torch.tensor([ids])).logits[0, -1]
    hidden = model.forward(torch.tensor(ids), [Segment(model.new_cache(), 0, len(ids))])
    got = model.compute_logits(hidden[-1:])[0]
    assert (got - expected).abs().max().item() < 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_tokens_match_transformers(prompt, hf_model, make_stage, tokenizer):
    ids = chat_ids(tokenizer, prompt)
    # A plain argmax loop, not generate(): it must not stop or bend at EOS either.
    sequence = list(ids)
    with torch.no_grad():
        for _ in range(NUM_GREEDY_TOKENS):
            sequence.append(int(hf_model(torch.tensor([sequence])).logits[0, -1].argmax()))
    reference = sequence[len(ids) :]
    assert greedy_generate(make_stage(), ids, NUM_GREEDY_TOKENS) == reference
