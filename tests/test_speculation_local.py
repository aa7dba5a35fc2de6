"""One-process speculative generation against token-by-token generation (the oracle).

Greedy speculation must not change a single token, whatever the proposer guesses:
only how many forwards it takes.
"""

from __future__ import annotations

import dataclasses
import pytest
import torch

from skippy.model.args import LayerRange
from skippy.model.llama import StageModel
from skippy.protocol.sampling_config import SamplingConfig
from skippy.runtime.draft_proposer import DraftProposer
from skippy.runtime.local_generation import GenerationLimits, generate_tokens
from skippy.runtime.local_speculative import generate_tokens_speculative
from skippy.runtime.proposers import Proposer, create_proposer
from skippy.runtime.speculation import AdaptiveWindow, SpeculationStats

NUM_TOKENS = 48
CODE = """def total_price(items, tax_rate):
    subtotal = sum(item.price * item.quantity for item in items)
    tax = subtotal * tax_rate
    return round(subtotal + tax, 2)"""
PROMPTS = {
    "copy": "Repeat the following code exactly, changing only the function name to order_total:\n\n" + CODE,
    "free": "Write a haiku about the sea.",
    "list": "List the days of the week, one per line, then the same list in reverse order.",
}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """On two shared cores, two OpenMP threads make multi-row forwards 10-20x slower
    when other processes compete; the tokens do not depend on the thread count."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


@pytest.fixture(scope="module")
def model(make_stage) -> StageModel:
    return make_stage()


@pytest.fixture(scope="module")
def small_draft_model(full_weights) -> StageModel:
    """A real draft that disagrees sometimes: the served model's first 4 layers and its head."""
    args, weights = full_weights
    return StageModel(dataclasses.replace(args, num_layers=4), LayerRange.full(4), weights, torch.device("cpu"))


@pytest.fixture(scope="module")
def prompt_ids(tokenizer) -> dict[str, list[int]]:
    return {name: tokenizer.encode_chat([{"role": "user", "content": text}])
            for name, text in PROMPTS.items()}  # fmt: skip


@pytest.fixture(scope="module")
def reference(model, prompt_ids, tokenizer):
    """reference(prompt, max_tokens, sampling) -> generate_tokens' output, computed once."""

    outputs: dict[tuple[str, int, str], list[int]] = {}

    def run(name: str, max_tokens: int = NUM_TOKENS, sampling: SamplingConfig = SamplingConfig()) -> list[int]:
        key = (name, max_tokens, repr(sampling))  # SamplingConfig holds a dict: not hashable
        if key not in outputs:
            limits = GenerationLimits(max_tokens, tokenizer.eog_ids)
            outputs[key] = list(generate_tokens(model, prompt_ids[name], limits, sampling))
        return outputs[key]

    return run


class Oracle(Proposer):
    """Proposes the reference continuation (optionally corrupting every n-th draft),
    so windows are as long as the test wants."""

    def __init__(self, prompt_len: int, future: list[int], wrong_every: int = 0):
        super().__init__()
        self.prompt_len, self.future, self.wrong_every = prompt_len, future, wrong_every

    def propose(self, max_tokens: int) -> list[int]:
        done = len(self.history) - self.prompt_len
        drafts = self.future[done : done + max_tokens]
        if self.wrong_every:
            drafts = [t + 1 if (done + i) % self.wrong_every == 0 else t for i, t in enumerate(drafts)]
        return drafts


def speculate(model, prompt, proposer, max_tokens=NUM_TOKENS, stop_ids=frozenset(), **options):
    stats = SpeculationStats()
    out = list(generate_tokens_speculative(
        model, prompt, GenerationLimits(max_tokens, frozenset(stop_ids)), proposer, stats=stats, **options
    ))  # fmt: skip
    return out, stats


@pytest.mark.parametrize("name", list(PROMPTS))
@pytest.mark.parametrize("proposer_name", ["ngram-simple", "ngram-suffix", "draft"])
def test_greedy_output_is_identical(model, small_draft_model, tokenizer, prompt_ids, reference, name, proposer_name):
    options = {"model": small_draft_model} if proposer_name == "draft" else {}
    proposer = create_proposer(proposer_name, **options)
    out, stats = speculate(model, prompt_ids[name], proposer, stop_ids=tokenizer.eog_ids)
    assert out == reference(name)
    if name == "copy":  # the copy has plenty to propose; others may propose little
        assert stats.num_windows > 0 and stats.num_accepted_tokens > 0


def test_draft_is_the_served_model_accepts_everything(model, tokenizer, prompt_ids, reference):
    out, stats = speculate(model, prompt_ids["copy"], DraftProposer(model), stop_ids=tokenizer.eog_ids)
    assert out == reference("copy")
    assert stats.num_proposed_tokens > 0 and stats.acceptance_rate == 1.0


def test_draft_cache_is_trimmed_to_the_committed_history(small_draft_model, prompt_ids):
    prompt = prompt_ids["free"]
    draft = DraftProposer(small_draft_model)
    assert draft.propose(3) == []  # no history yet
    draft.reset(prompt)
    d1, d2, _ = draft.propose(3)
    assert draft.cache.length == len(prompt) + 2  # the last draft is never fed
    wrong = d2 + 1
    draft.commit([d1, wrong])  # the target took d1 and corrected d2
    assert draft.cached == [*prompt, d1] and draft.cache.length == len(prompt) + 1
    proposed = draft.propose(2)
    fresh = DraftProposer(small_draft_model)
    fresh.reset([*prompt, d1, wrong])
    assert proposed == fresh.propose(2)


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5, 7, 9])
def test_max_tokens_inside_accepted_windows(model, prompt_ids, reference, max_tokens):
    prompt, future = prompt_ids["copy"], reference("copy")
    out, stats = speculate(model, prompt, Oracle(len(prompt), future), max_tokens, window=AdaptiveWindow(4, 4))
    assert out == future[:max_tokens]
    assert stats.num_rejected_tokens == 0


@pytest.mark.parametrize("stop_at", [2, 4, 5, 8])
def test_stop_id_inside_an_accepted_window(model, prompt_ids, reference, stop_at):
    prompt, future = prompt_ids["list"], reference("list")
    stop = future[stop_at]
    expected = future[: future.index(stop)]  # token-by-token decoding stops at the first one
    out, stats = speculate(model, prompt, Oracle(len(prompt), future), stop_ids={stop}, window=AdaptiveWindow(4, 4))
    assert out == expected
    assert stats.num_stopped_windows == 1  # the stop came from a verified window, not the prefill


def test_rejections_never_change_the_output(model, prompt_ids, reference):
    prompt, future = prompt_ids["copy"], reference("copy")[:24]
    out, stats = speculate(model, prompt, Oracle(len(prompt), future, wrong_every=3), max_tokens=24)
    assert out == future
    assert stats.num_rejected_windows > 0 and stats.num_accepted_tokens > 0


def test_context_limit_matches_token_by_token(model, prompt_ids, tokenizer):
    prompt = prompt_ids["copy"]
    ctx_size = len(prompt) + 6
    limits = GenerationLimits(NUM_TOKENS, tokenizer.eog_ids)
    expected = list(generate_tokens(model, prompt, limits, ctx_size=ctx_size))
    oracle = Oracle(len(prompt), expected + [0] * 8)  # would propose past the context
    out, _ = speculate(
        model, prompt, oracle, stop_ids=tokenizer.eog_ids, window=AdaptiveWindow(4, 4), ctx_size=ctx_size
    )
    assert out == expected and len(out) == 7  # the prompt's last row, then one token per free position


def test_greedy_with_penalties_is_identical(model, tokenizer, prompt_ids, reference):
    """Penalties see each row's drafts (row_tokens), so greedy stays exact with them."""
    sampling = SamplingConfig(repetition_penalty=1.3, frequency_penalty=0.2)
    prompt = prompt_ids["copy"]
    out = list(generate_tokens_speculative(
        model, prompt, GenerationLimits(32, tokenizer.eog_ids), create_proposer("ngram-suffix"), sampling
    ))  # fmt: skip
    assert out == reference("copy", 32, sampling)


def test_seeded_sampling_without_proposals_is_identical(model, tokenizer, prompt_ids, reference):
    sampling = SamplingConfig(temperature=0.8, top_p=0.9, seed=7)
    out = list(generate_tokens_speculative(
        model, prompt_ids["free"], GenerationLimits(16, tokenizer.eog_ids), None, sampling
    ))  # fmt: skip
    assert out == reference("free", 16, sampling)
