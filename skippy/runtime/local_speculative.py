"""Speculative generation in one process: the reference for verify windows on a chain.

Same contract as local_generation.generate_tokens, but each step verifies a window of
proposed tokens in one forward; acceptance, stops and counters are `speculation.Speculator`'s,
shared with the chain's stage-0 decoder (driver/decoder.py).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch

from ..model.llama import Segment, StageModel
from ..model.sampling import RequestSampler
from ..protocol.sampling_config import SamplingConfig
from .local_generation import GenerationLimits
from .proposers import Proposer
from .speculation import AdaptiveWindow, SpeculationStats, Speculator


def generate_tokens_speculative(
    model: StageModel,
    prompt_ids: list[int],
    limits: GenerationLimits,
    proposer: Proposer | None,
    sampling: SamplingConfig = SamplingConfig(),
    window: AdaptiveWindow | None = None,
    stats: SpeculationStats | None = None,
    ctx_size: int | None = None,
) -> Iterator[int]:
    """Yield sampled token ids until a stop id (not yielded), max_tokens, or the context ends.

    `proposer` None decodes one token per step, exactly like generate_tokens.
    `window` sets how many drafts each step verifies (default: adaptive, 1..4);
    `stats`, when given, collects acceptance counters as the generator runs.
    """
    if not (model.layers.is_first and model.layers.is_last):
        raise ValueError(f"Local generation needs the whole model, got layers {model.layers}")
    if not prompt_ids:
        raise ValueError("Expected a non-empty prompt")
    if limits.max_tokens <= 0:
        return
    spec = Speculator(proposer, limits.max_tokens, limits.stop_ids, window, stats)
    cache = model.new_cache(ctx_size)
    sampler = RequestSampler(sampling, model.device)

    # Prefill: the first token comes from the prompt's last row, as without speculation.
    if len(prompt_ids) > cache.max_tokens:
        return
    hidden = model.forward(torch.tensor(prompt_ids), [Segment(cache, 0, len(prompt_ids))])
    yield from spec.start(prompt_ids, sampler.sample(model.compute_logits(hidden[-1:])[0], prompt_ids))

    while not spec.is_finished:
        pos_start = cache.length  # the committed position P; the current token goes there
        num_free = cache.max_tokens - pos_start
        if num_free < 1:
            return
        drafts = spec.propose(spec.next_width(num_free))

        started = time.perf_counter()
        checkpoint = cache.checkpoint()  # stands for the stages' native verify checkpoint
        ids = [spec.current, *drafts]
        hidden = model.forward(torch.tensor(ids), [Segment(cache, pos_start, len(ids))])
        # targets[i]: the sampler's pick after current, d1..di (row i)
        targets = sampler.sample(model.compute_logits(hidden), spec.history, row_tokens=drafts)
        outcome = spec.settle(drafts, targets)
        # Keep the KV of current and the accepted drafts; the rejected rows are
        # overwritten by the next window. Then retire the checkpoint.
        cache.truncate(pos_start + outcome.num_kv_kept)
        cache.release(checkpoint)
        spec.stats.verify_seconds += time.perf_counter() - started
        yield from outcome.tokens
