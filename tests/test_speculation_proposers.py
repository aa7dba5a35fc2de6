"""N-gram proposers and the proposer registry (no torch, milliseconds)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from skippy.runtime.proposers import (
    NgramSimpleProposer,
    NgramSuffixProposer,
    Proposer,
    available_proposers,
    create_proposer,
)


def propose(proposer: Proposer, history: list[int], max_tokens: int) -> list[int]:
    proposer.reset(history)
    return proposer.propose(max_tokens)


# (history, max_tokens, options, expected)
SIMPLE_CASES = [
    ([1, 2, 3, 9, 1, 2, 3], 2, {}, [9, 1]),  # the suffix "1 2 3" occurred before: copy what followed
    ([1, 2, 3, 4], 3, {}, []),  # nothing repeats
    ([5, 1, 2, 7, 1, 2, 8, 1, 2], 1, {"min_ngram": 2}, [8]),  # two earlier "1 2": the latest wins
    ([1, 2, 3, 5, 0, 2, 3, 6, 1, 2, 3], 1, {}, [5]),  # longest suffix first: "1 2 3" beats the later "2 3"
    ([4, 1, 9, 1], 2, {}, []),  # only a 1-gram matches, below min_ngram (default 3)
    ([4, 1, 9, 1], 2, {"min_ngram": 1}, [9, 1]),  # ... which min_ngram=1 accepts
    ([1, 2, 1, 2], 8, {"min_ngram": 2}, [1, 2]),  # the copy stops where the history ends
    ([1, 2, 1, 2, 1, 2], 8, {"min_ngram": 2, "max_ngram": 2}, [1, 2]),  # periodic: the latest match is one period back
    ([3, 1, 2, 3, 4, 5, 6, 7, 1, 2, 3], 8, {"max_proposal_tokens": 3}, [4, 5, 6]),  # the budget caps it
    ([1, 2, 3, 1, 2, 3], 0, {}, []),  # no room: nothing proposed
    ([9, 1, 2, 7, 1, 2], 4, {}, []),  # a 2-token match is below the default min_ngram of 3
    ([7], 4, {}, []),  # a one-token history has nothing earlier
    ([], 4, {}, []),  # an empty history
]


@pytest.mark.parametrize("history, max_tokens, options, expected", SIMPLE_CASES)
def test_ngram_simple(history, max_tokens, options, expected):
    assert propose(NgramSimpleProposer(**options), history, max_tokens) == expected


# (history, max_tokens, options, expected); defaults min_ngram=3 (seed 3), max_ngram=32
SUFFIX_CASES = [
    ([1, 2, 3, 9, 1, 2, 3], 4, {}, [9, 1, 2, 3]),  # a 3-token match: copy what followed
    ([1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3], 16, {}, [4, 5, 6, 7, 8, 9]),  # at most 2x the match length
    ([1, 2, 9, 1, 2], 4, {}, []),  # a 2-token match is below min_ngram: silent
    ([1, 2, 3, 4, 5, 0, 2, 3, 4, 6, 1, 2, 3, 4], 1, {}, [5]),  # the longest match wins over a later one
    ([1, 2, 3, 5, 1, 2, 3, 6, 1, 2, 3], 1, {}, [6]),  # equal lengths: the most recent wins
    ([1, 2, 3, 4, 9, 9, 9, 9, 1, 2, 3, 4], 8, {"max_proposal_tokens": 2}, [9, 9]),  # the budget caps it
    ([5, 6, 7, 8, 1, 5, 6, 7, 8], 8, {"min_ngram": 4}, [1, 5, 6, 7, 8]),  # seed of 4; the copy ends with the history
    ([1, 1, 1, 1, 1, 1], 3, {}, [1]),  # a run: the latest earlier end is one before the last
    ([1, 2, 3], 4, {}, []),  # too short to hold a seed twice
]


@pytest.mark.parametrize("history, max_tokens, options, expected", SUFFIX_CASES)
def test_ngram_suffix(history, max_tokens, options, expected):
    assert propose(NgramSuffixProposer(**options), history, max_tokens) == expected


def test_ngram_suffix_follows_commits_incrementally():
    proposer = NgramSuffixProposer()
    proposer.reset([1, 2, 3, 4])
    assert proposer.propose(4) == []
    proposer.commit([5, 1, 2])
    assert proposer.num_indexed == 7
    proposer.commit([3])  # history ends "1 2 3" again: the index already holds the first one
    assert proposer.propose(4) == [4, 5, 1, 2]
    assert proposer.counters()["rebuilds"] == 1  # the reset; commits only appended


def test_reset_forgets_the_previous_request():
    proposer = NgramSuffixProposer()
    proposer.reset([1, 2, 3, 9, 1, 2, 3])
    assert proposer.propose(1) == [9]
    proposer.reset([4, 1, 2, 3])
    assert proposer.propose(4) == []


@pytest.mark.parametrize(
    "cls, options",
    [
        (NgramSimpleProposer, {"min_ngram": 0}),  # n-grams are at least one token
        (NgramSimpleProposer, {"min_ngram": 3, "max_ngram": 2}),  # min above max
        (NgramSimpleProposer, {"max_proposal_tokens": 0}),  # no budget
        (NgramSuffixProposer, {"min_ngram": 2}),  # the suffix index needs min_ngram >= 3 (spec §5.1)
        (NgramSuffixProposer, {"max_ngram": 65}),  # ... and max_ngram <= 64
    ],
)
def test_bad_bounds_are_refused(cls, options):
    with pytest.raises(ValueError, match="Expected"):
        cls(**options)


def test_registry():
    assert {"ngram-simple", "ngram-suffix", "draft"} <= set(available_proposers())
    assert isinstance(create_proposer("ngram-suffix", max_ngram=8), NgramSuffixProposer)
    with pytest.raises(ValueError, match="Expected a proposer in"):
        create_proposer("ngram-cache")


def test_registration_by_subclassing():
    class Unnamed(Proposer):  # a helper base: not registered
        pass

    assert Unnamed not in Proposer._registry.values()
    with pytest.raises(ValueError, match="already registered"):

        class Clash(Proposer, name="ngram-simple"):
            pass


# --- the index against a brute-force search over every earlier position ---------------


def brute_force(history, max_tokens, min_ngram, max_ngram, budget, double_match_cap):
    """Longest backward match of the history's suffix ending at any earlier position,
    most recent on ties, then the tokens that followed it."""
    last = len(history) - 1
    best_length, best_end = 0, -1
    for end in range(last):
        sizes = range(1, min(max_ngram, end + 1) + 1)
        length = max((n for n in sizes if history[end - n + 1 : end + 1] == history[last - n + 1 :]), default=0)
        if length >= best_length and length > 0:
            best_length, best_end = length, end
    if best_length < min_ngram or max_tokens <= 0:
        return []
    limit = min(max_tokens, budget, 2 * best_length if double_match_cap else budget)
    return history[best_end + 1 : best_end + 1 + limit]


def split_into_commits(history, cuts):
    """history as a prompt (at least 1 token) and commits cut at `cuts`."""
    points = sorted({c % len(history) for c in cuts if c % len(history)} | {1})
    chunks = [history[a:b] for a, b in zip(points, [*points[1:], len(history)])]
    return history[: points[0]], chunks


histories = st.lists(st.integers(0, 3), min_size=1, max_size=60)
cut_points = st.lists(st.integers(0, 1000), max_size=6)


@settings(max_examples=200, deadline=None)
@given(histories, cut_points, st.integers(3, 5), st.integers(0, 4), st.integers(1, 8), st.integers(0, 10))
def test_suffix_index_equals_brute_force(history, cuts, min_ngram, extra, budget, max_tokens):
    max_ngram = min_ngram + extra
    proposer = NgramSuffixProposer(min_ngram, max_ngram, budget)
    prompt, commits = split_into_commits(history, cuts)
    proposer.reset(prompt)
    for chunk in commits:
        proposer.commit(chunk)
    expected = brute_force(history, max_tokens, min_ngram, max_ngram, budget, double_match_cap=True)
    assert proposer.propose(max_tokens) == expected


@settings(max_examples=200, deadline=None)
@given(histories, st.integers(1, 3), st.integers(0, 3), st.integers(1, 8), st.integers(0, 10))
def test_ngram_simple_equals_brute_force(history, min_ngram, extra, budget, max_tokens):
    max_ngram = min_ngram + extra
    proposer = NgramSimpleProposer(min_ngram, max_ngram, budget)
    expected = brute_force(history, max_tokens, min_ngram, max_ngram, budget, double_match_cap=False)
    assert propose(proposer, history, max_tokens) == expected
