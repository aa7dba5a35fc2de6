"""The `draft` proposer: a complete small model in the stage-0 process (spec §5.2)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ..model.inference import inference_mode
from ..model.llama import Segment, StageModel
from ..model.loader import load_stage
from .proposers import Proposer


class DraftProposer(Proposer, name="draft"):
    """Greedy drafts from `model` (or the GGUF at `path`), with its own KV cache: `cached` lists
    the tokens in it (the committed history, then its own drafts). The prefix that still matches
    the history is kept across commits and requests, so only new tokens are fed.
    """

    def __init__(
        self,
        model: StageModel | None = None,
        path: str | Path | None = None,
        ctx_size: int | None = None,
        **load_options: Any,
    ):
        super().__init__()
        if (model is None) == (path is None):
            raise ValueError("Expected exactly one of a draft model or a draft model path")
        if model is None:
            model = load_stage(path, None, **{"progress": False, **load_options})
        if not (model.layers.is_first and model.layers.is_last):
            raise ValueError(f"A draft model needs all of its layers, got layers {model.layers}")
        self.model = model
        self.cache = model.new_cache(ctx_size)
        self.cached: list[int] = []
        self._num_synced = 0  # cached[:_num_synced] == history[:_num_synced] is known

    def reset(self, prompt: Sequence[int]) -> None:
        super().reset(prompt)
        self._num_synced = 0
        self._sync()

    def commit(self, tokens: Sequence[int]) -> None:
        super().commit(tokens)
        self._sync()

    def _sync(self) -> None:
        """Cut the cache back to the longest prefix it shares with the history."""
        n, limit = self._num_synced, min(len(self.cached), len(self.history))
        while n < limit and self.cached[n] == self.history[n]:
            n += 1
        if n < len(self.cached):
            del self.cached[n:]
            self.cache.truncate(n)
        self._num_synced = n

    @inference_mode
    def propose(self, max_tokens: int) -> list[int]:
        history = self.history
        # Each draft but the last is fed back, so n drafts need len(history) + n - 1 positions.
        max_tokens = min(max_tokens, self.cache.max_tokens - len(history) + 1)
        if max_tokens <= 0 or not history:
            return []
        # Feed at least the last history token: its logits give the first draft.
        start = min(self._num_synced, len(history) - 1)
        if start < len(self.cached):
            del self.cached[start:]
            self.cache.truncate(start)
        drafts: list[int] = []
        ids = history[start:]
        while True:
            hidden = self.model.forward(torch.tensor(ids), [Segment(self.cache, len(self.cached), len(ids))])
            self.cached.extend(ids)
            drafts.append(int(self.model.compute_logits(hidden[-1:])[0].argmax()))
            if len(drafts) == max_tokens:
                break
            ids = drafts[-1:]
        self._num_synced = len(history)
        return drafts
