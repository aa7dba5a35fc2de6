"""Speculative generation in one process: the reference for verify windows on a chain.

Same contract as local_generation.generate_tokens (the tokens, the stops, the
context limit), but each decode step verifies a window [current, d1..dn] of
proposed tokens in one forward and keeps the prefix the target agrees with.
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
from .speculation import AdaptiveWindow, SpeculationStats, settle_window


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
    window = window or AdaptiveWindow()
    stats = stats if stats is not None else SpeculationStats()
    cache = model.new_cache(ctx_size)
    sampler = RequestSampler(sampling, model.device)
    history = list(prompt_ids)

    # Prefill: the first token comes from the prompt's last row, as without speculation.
    if len(prompt_ids) > cache.max_tokens:
        return
    hidden = model.forward(torch.tensor(prompt_ids), [Segment(cache, 0, len(prompt_ids))])
    current = sampler.sample(model.compute_logits(hidden[-1:])[0], history)
    if current in limits.stop_ids:
        return
    yield current
    history.append(current)
    num_emitted = 1
    if proposer is not None:
        proposer.reset(history)

    while num_emitted < limits.max_tokens:
        pos_start = cache.length  # the committed position P; `current` goes there
        num_free = cache.max_tokens - pos_start
        if num_free < 1:
            return
        # A window of n drafts yields up to n + 1 tokens: never propose past max_tokens.
        width = min(window.width, limits.max_tokens - num_emitted - 1, num_free - 1)
        drafts: list[int] = []
        if proposer is not None and width > 0:
            started = time.perf_counter()
            drafts = proposer.propose(width)[:width]
            stats.propose_seconds += time.perf_counter() - started

        started = time.perf_counter()
        checkpoint = cache.checkpoint()  # stands for the stages' native verify checkpoint
        ids = [current, *drafts]
        hidden = model.forward(torch.tensor(ids), [Segment(cache, pos_start, len(ids))])
        # targets[i]: the sampler's pick after current, d1..di (row i)
        targets = sampler.sample(model.compute_logits(hidden), history, row_tokens=drafts)
        outcome = settle_window(drafts, targets, limits.stop_ids, limits.max_tokens - num_emitted)
        # Keep the KV of current and the accepted drafts; the rejected rows are
        # overwritten by the next window. Then retire the checkpoint.
        cache.truncate(pos_start + outcome.num_kv_kept)
        cache.release(checkpoint)
        stats.verify_seconds += time.perf_counter() - started

        stats.record(outcome)
        if drafts:
            window.record(outcome.num_drafts, outcome.num_accepted)
        for token in outcome.tokens:
            yield token
        if outcome.is_stopped:
            return
        history.extend(outcome.tokens)
        num_emitted += len(outcome.tokens)
        current = history[-1]
        if proposer is not None:
            proposer.commit(outcome.tokens)
