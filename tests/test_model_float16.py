"""The float16-weight path against the float32 path, teacher-forced.

Both models read the same tokens: each prompt followed by the float32 model's own
greedy continuation. At every continuation position we compare the two models'
argmax, so one early disagreement cannot send the rest down a different path.

The float32 continuation decodes the four prompts together, as four segments of
one forward per step. The float16 model reads most of each sequence in one
prefill (its float32-GEMM path) and its last NUM_DECODE_STEPS tokens one step at
a time (its half-precision decode path).
"""

from __future__ import annotations

import torch

from numerics import record
from skippy.model.args import LayerRange
from skippy.model.layers import MIN_ROWS_TO_UPCAST
from skippy.model.llama import Segment, StageModel

PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain in one sentence why the sky is blue.",
    "Tell me a short story about a lighthouse keeper.",
]
NUM_TOKENS = 256  # greedy tokens per prompt
NUM_DECODE_STEPS = 16  # of those, fed to the float16 model one step at a time
MIN_AGREEMENT = 0.99


def float16_stage(full_weights) -> StageModel:
    """The full model with float16 weights; norms stay float32, as the loader keeps them."""
    args, weights = full_weights
    half = {name: w if name.endswith("norm.weight") else w.half() for name, w in weights.items()}
    return StageModel(args, LayerRange.full(args.num_layers), half, torch.device("cpu"))


def forward_argmax(model: StageModel, sequences: list[list[int]], caches) -> list[list[int]]:
    """Append `sequences` (one per session) to the caches; argmax at every new row."""
    segments = [Segment(cache, cache.length, len(ids)) for cache, ids in zip(caches, sequences)]
    hidden = model.forward(torch.tensor([t for ids in sequences for t in ids]), segments)
    argmax = model.compute_logits(hidden).argmax(-1).tolist()
    rows = torch.tensor([0] + [len(ids) for ids in sequences]).cumsum(0).tolist()
    return [argmax[start:end] for start, end in zip(rows, rows[1:])]


def float32_greedy(model: StageModel, prompts: list[list[int]]) -> list[list[int]]:
    caches = [model.new_cache() for _ in prompts]
    continuations = [[rows[-1]] for rows in forward_argmax(model, prompts, caches)]
    while len(continuations[0]) < NUM_TOKENS:
        steps = forward_argmax(model, [c[-1:] for c in continuations], caches)
        for c, (token,) in zip(continuations, steps):
            c.append(token)
    return continuations


def float16_teacher_forced(model: StageModel, prompts: list[list[int]], forced: list[list[int]]) -> list[list[int]]:
    """The float16 argmax after each prompt token and each forced token but the last."""
    caches = [model.new_cache() for _ in prompts]
    num_prefilled = NUM_TOKENS - NUM_DECODE_STEPS
    prefill = forward_argmax(model, [p + f[: num_prefilled - 1] for p, f in zip(prompts, forced)], caches)
    predicted = [rows[len(p) - 1 :] for rows, p in zip(prefill, prompts)]
    for i in range(num_prefilled - 1, NUM_TOKENS - 1):
        for p, (token,) in zip(predicted, forward_argmax(model, [[f[i]] for f in forced], caches)):
            p.append(token)
    return predicted


def test_float16_greedy_agrees_with_float32(full_weights, make_stage, tokenizer):
    assert len(PROMPTS) < MIN_ROWS_TO_UPCAST, "the decode steps must take the half-precision matmul path"
    prompts = [tokenizer.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    expected = torch.tensor(float32_greedy(make_stage(), prompts))  # [prompts, NUM_TOKENS]
    got = torch.tensor(float16_teacher_forced(float16_stage(full_weights), prompts, expected.tolist()))

    assert got.shape == expected.shape
    agreement = (got == expected).float().mean().item()
    mismatches = (got != expected).nonzero().tolist()
    record("float16 argmax disagreement with float32, teacher-forced", 1 - agreement, 1 - MIN_AGREEMENT)
    assert agreement >= MIN_AGREEMENT, (
        f"float16 argmax agrees with float32 at {agreement:.2%} of {expected.numel()} positions "
        f"(want >= {MIN_AGREEMENT:.0%}); first mismatches [prompt, position]: {mismatches[:10]}"
    )
