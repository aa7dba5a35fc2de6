"""Our layer-sliced runtime against Hugging Face transformers loading the same GGUF."""

from __future__ import annotations

import copy

import pytest
import torch

from numerics import assert_close, forward_tolerance
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
    return tokenizer.encode_chat([{"role": "user", "content": prompt}])


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
    # other kernels and RoPE angles computed in float32: rules 2-4 of tests/numerics.py
    bound = forward_tolerance(model.args, layers=model.args.num_layers, positions=len(ids), head=True, rope_angles=True)
    assert_close(f"ours == transformers, last logits: {prompt[:24]!r}", got, expected, bound)


@pytest.fixture(scope="module")
def hf_model_float64(hf_model):
    return copy.deepcopy(hf_model).double()


@pytest.mark.slow
@pytest.mark.parametrize("prompt", PROMPTS[:2])
def test_each_float32_forward_is_within_its_bound_of_float64(prompt, hf_model, hf_model_float64, make_stage, tokenizer):
    """The error model's premise (rule 4 of tests/numerics.py), checked on whatever
    kernels this machine runs: each float32 forward, ours and transformers', lies
    within one evaluation's bound of the same forward in float64."""
    ids = chat_ids(tokenizer, prompt)
    with torch.no_grad():
        exact = hf_model_float64(torch.tensor([ids])).logits[0]
        theirs = hf_model(torch.tensor([ids])).logits[0]
    model = make_stage()
    ours = model.compute_logits(model.forward(torch.tensor(ids), [Segment(model.new_cache(), 0, len(ids))]))
    args = model.args
    # transformers computes RoPE angles in float32 even in a float64 model
    bound = forward_tolerance(args, layers=args.num_layers, positions=len(ids), head=True, evaluations=1,
                              rope_angles=True)
    assert_close(f"ours (float32) == float64 forward: {prompt[:24]!r}", ours, exact, bound)
    assert_close(f"transformers (float32) == float64 forward: {prompt[:24]!r}", theirs, exact, bound)


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
