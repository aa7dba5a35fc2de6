"""Generation in one process: the whole model, one session, no network.

The reference that staged execution is measured against."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ..model.llama import Segment, StageModel
from ..model.sampling import RequestSampler
from ..protocol.sampling_config import SamplingConfig


@dataclass(frozen=True, slots=True)
class GenerationLimits:
    max_tokens: int
    stop_ids: frozenset[int]


def generate_tokens(
    model: StageModel,
    prompt_ids: list[int],
    limits: GenerationLimits,
    sampling: SamplingConfig = SamplingConfig(),
    ctx_size: int | None = None,
) -> Iterator[int]:
    """Yield sampled token ids until a stop id (not yielded), max_tokens, or the context ends."""
    if not (model.layers.is_first and model.layers.is_last):
        raise ValueError(f"Local generation needs the whole model, got layers {model.layers}")
    if not prompt_ids:
        raise ValueError("Expected a non-empty prompt")
    cache = model.new_cache(ctx_size)
    sampler = RequestSampler(sampling, model.device)
    history = list(prompt_ids)
    ids = torch.tensor(prompt_ids)
    for _ in range(limits.max_tokens):
        if cache.length + len(ids) > cache.max_tokens:
            return
        hidden = model.forward(ids, [Segment(cache, cache.length, len(ids))])
        token = sampler.sample(model.compute_logits(hidden[-1:])[0], history)
        if token in limits.stop_ids:
            return
        yield token
        history.append(token)
        ids = torch.tensor([token])
