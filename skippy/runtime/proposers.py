"""Draft-token proposers for speculative decoding (spec §5.2), behind a name registry.

A proposer guesses the tokens that follow the committed history (the prompt and every
accepted token). Only `reset(prompt)` and `commit(tokens)` change that history, so rejected
drafts never reach it. A subclass registers itself: `class Mine(Proposer, name="mine")`.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any, ClassVar

# Proposers that need heavy imports (torch) register when their module is imported.
_LAZY_MODULES = {"draft": "skippy.runtime.draft_proposer"}


class Proposer:
    """Base class: keeps the committed history; subclasses implement `propose`."""

    name: ClassVar[str]
    _registry: ClassVar[dict[str, type[Proposer]]] = {}

    def __init_subclass__(cls, name: str | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if name is None:
            return  # an unregistered helper class (tests, intermediate bases)
        registered = Proposer._registry.get(name)
        if registered is not None:
            raise ValueError(f"Proposer {name!r} is already registered by {registered.__qualname__}")
        cls.name = name
        Proposer._registry[name] = cls

    def __init__(self) -> None:
        self.history: list[int] = []

    def reset(self, prompt: Sequence[int]) -> None:
        """Start a request whose committed history is `prompt` (a divergence also resets)."""
        self.history = list(prompt)

    def commit(self, tokens: Sequence[int]) -> None:
        """Append tokens the target committed (accepted drafts plus correction or bonus)."""
        self.history.extend(tokens)

    def propose(self, max_tokens: int) -> list[int]:
        """Up to `max_tokens` guesses for the tokens after the history; may be fewer or none."""
        raise NotImplementedError


def available_proposers() -> list[str]:
    return sorted({*Proposer._registry, *_LAZY_MODULES})


def create_proposer(name: str, **options: Any) -> Proposer:
    """A new proposer by registered name, e.g. create_proposer("ngram-suffix", max_ngram=16)."""
    if name not in Proposer._registry and name in _LAZY_MODULES:
        importlib.import_module(_LAZY_MODULES[name])
    cls = Proposer._registry.get(name)
    if cls is None:
        raise ValueError(f"Expected a proposer in {available_proposers()}, got {name!r}")
    return cls(**options)


def _check_ngram_bounds(min_ngram: int, max_ngram: int, max_proposal_tokens: int) -> None:
    if not 0 < min_ngram <= max_ngram:
        raise ValueError(f"Expected 0 < min_ngram <= max_ngram, got {min_ngram} and {max_ngram}")
    if max_proposal_tokens <= 0:
        raise ValueError(f"Expected max_proposal_tokens > 0, got {max_proposal_tokens}")


def match_length(history: Sequence[int], end: int, last: int, cap: int) -> int:
    """How many tokens ending at `end` equal those ending at `last`, compared backwards, at most `cap`."""
    length = 0
    while length < cap and history[end - length] == history[last - length]:
        length += 1
    return length


class NgramSimpleProposer(Proposer, name="ngram-simple"):
    """Rescans the whole history on every proposal for the latest earlier occurrence
    of its current suffix (longest suffix first) and proposes what followed it.

    O(history) per proposal; the suffix proposer keeps an index instead.
    """

    # min_ngram 3: on free-form text 2-token matches mostly guess wrong, and a window
    # with drafts costs about two plain decode steps on CPU (bench/speculative_local.py).
    def __init__(self, min_ngram: int = 3, max_ngram: int = 4, max_proposal_tokens: int = 16):
        super().__init__()
        _check_ngram_bounds(min_ngram, max_ngram, max_proposal_tokens)
        self.min_ngram, self.max_ngram, self.max_proposal_tokens = min_ngram, max_ngram, max_proposal_tokens

    def propose(self, max_tokens: int) -> list[int]:
        h, last = self.history, len(self.history) - 1
        best_length, best_end = 0, -1
        # Most recent first, keeping only strictly longer matches: ties go to the latest.
        for end in range(last - 1, -1, -1):
            length = match_length(h, end, last, min(self.max_ngram, end + 1))
            if length > best_length:
                best_length, best_end = length, end
                if length == self.max_ngram:
                    break
        if best_length < self.min_ngram or max_tokens <= 0:
            return []
        return h[best_end + 1 : best_end + 1 + min(max_tokens, self.max_proposal_tokens)]


class NgramSuffixProposer(Proposer, name="ngram-suffix"):
    """Exact-seed index over the committed history: `index` maps every run of `seed_len`
    tokens to the positions where one ends, appended to on commit, so a proposal visits only
    positions whose last `seed_len` tokens equal the history's. From each (most recent first)
    it compares backwards up to `max_ngram`; the longest match wins (the most recent on ties,
    none below `min_ngram`), and what followed it is copied, at most 2x the match length (a
    short match is weak evidence for a long copy) and `max_proposal_tokens`.
    """

    def __init__(self, min_ngram: int = 3, max_ngram: int = 32, max_proposal_tokens: int = 16):
        super().__init__()
        _check_ngram_bounds(min_ngram, max_ngram, max_proposal_tokens)
        if not 3 <= min_ngram <= max_ngram <= 64:  # spec §5.1
            raise ValueError(f"Expected 3 <= min_ngram <= max_ngram <= 64, got {min_ngram} and {max_ngram}")
        self.min_ngram, self.max_ngram, self.max_proposal_tokens = min_ngram, max_ngram, max_proposal_tokens
        self.seed_len = min(min_ngram, 8)
        self.index: dict[tuple[int, ...], list[int]] = {}
        self.num_indexed = 0  # history[:num_indexed] has its seed-end positions in `index`
        self.num_lookups = self.num_hits = self.num_candidates = self.num_rebuilds = 0
        self.match_length_sum = 0

    def reset(self, prompt: Sequence[int]) -> None:
        super().reset(prompt)
        self.index.clear()
        self.num_indexed = 0
        self.num_rebuilds += 1
        self._extend_index()

    def commit(self, tokens: Sequence[int]) -> None:
        super().commit(tokens)
        self._extend_index()

    def _extend_index(self) -> None:
        h, seed_len = self.history, self.seed_len
        for end in range(max(self.num_indexed, seed_len - 1), len(h)):
            self.index.setdefault(tuple(h[end - seed_len + 1 : end + 1]), []).append(end)
        self.num_indexed = len(h)

    def propose(self, max_tokens: int) -> list[int]:
        h, last = self.history, len(self.history) - 1
        if max_tokens <= 0 or last < self.seed_len:  # no earlier position can hold the seed
            return []
        self.num_lookups += 1
        ends = self.index.get(tuple(h[last - self.seed_len + 1 :]), [])
        best_length, best_end = 0, -1
        for i in range(len(ends) - 1, -1, -1):
            end = ends[i]
            if end == last:
                continue  # the suffix itself: nothing follows it yet
            self.num_candidates += 1
            length = match_length(h, end, last, min(self.max_ngram, end + 1))
            if length > best_length:
                best_length, best_end = length, end
                if length == self.max_ngram:
                    break
        if best_length < self.min_ngram:
            return []
        self.num_hits += 1
        self.match_length_sum += best_length
        budget = min(max_tokens, self.max_proposal_tokens, 2 * best_length)
        return h[best_end + 1 : best_end + 1 + budget]

    def counters(self) -> dict[str, int]:
        """Index counters for telemetry (spec §5.4, suffix proposer)."""
        return {
            "lookups": self.num_lookups,
            "hits": self.num_hits,
            "candidates_examined": self.num_candidates,
            "match_length_sum": self.match_length_sum,
            "rebuilds": self.num_rebuilds,
            "indexed_tokens": self.num_indexed,
        }
