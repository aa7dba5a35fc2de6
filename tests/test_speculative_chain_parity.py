"""Speculative decoding through the chain changes no greedy token (spec §5.3).

5 prompts (one copy-heavy) x 1, 2 and 3 in-process stages x every proposer: the output
with speculation on equals the output with it off on the same chain. A draft model that
is the served model itself is always right. Pipelined windows (run-ahead) and sampling
penalties (the final stage samples each row with the drafts before it in its history)
do not change a token either.
"""

from __future__ import annotations

import pytest

from speculative_support import NUM_TOKENS, Chains, encode_prompts, one_thread, small_draft  # noqa: F401
from skippy.protocol import SamplingConfig
from skippy.runtime.speculation import SpeculativeSettings

pytestmark = pytest.mark.slow

ARMS = {  # name -> settings
    "ngram-suffix": SpeculativeSettings("ngram-suffix", 1, 8),
    "ngram-simple": SpeculativeSettings("ngram-simple", 1, 8),
    "draft": SpeculativeSettings("draft", 1, 4),
}


@pytest.fixture(scope="module")
def chains(make_stage, full_weights):
    chains = Chains(make_stage, draft_model=small_draft(full_weights))
    yield chains
    chains.close()


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return encode_prompts(tokenizer)


@pytest.fixture(scope="module")
def reference(chains, prompts, tokenizer):
    """reference(num_stages, name) -> (tokens, finish reason) with speculation off, once each."""
    outputs = {}

    def get(num_stages: int, name: str):
        if (num_stages, name) not in outputs:
            result = chains.generate(num_stages, prompts[name], max_tokens=NUM_TOKENS,
                                     stop_ids=tokenizer.eog_ids)
            assert result.speculation == {}
            outputs[num_stages, name] = result.tokens, result.finish_reason
        return outputs[num_stages, name]

    return get


@pytest.mark.parametrize("num_stages", [1, 2, 3])
@pytest.mark.parametrize("arm", list(ARMS))
def test_greedy_output_is_identical_with_speculation(chains, prompts, reference, tokenizer,
                                                     num_stages, arm):
    for name, prompt in prompts.items():
        result = chains.generate(num_stages, prompt, max_tokens=NUM_TOKENS,
                                 stop_ids=tokenizer.eog_ids, speculative=ARMS[arm])
        assert (result.tokens, result.finish_reason) == reference(num_stages, name), name
        figures = result.speculation
        assert figures["speculative_mode"] == arm
        assert figures["speculative_num_accepted_tokens"] + figures["speculative_num_rejected_tokens"] \
            == figures["speculative_num_proposed_tokens"]
        if name == "copy":  # plenty to copy: windows with accepted drafts
            assert figures["speculative_num_windows"] > 0, figures
            assert figures["speculative_num_accepted_tokens"] > 0, figures
    session_counts = [len(chains.client(num_stages).runtime.sessions),
                      *(len(server.runtime.sessions) for server in chains.chains[num_stages].servers)]
    assert session_counts == [0] * num_stages  # every session ended on every stage


@pytest.mark.parametrize("num_stages", [2, 3])
def test_a_draft_that_is_the_served_model_is_always_accepted(chains, prompts, reference, tokenizer,
                                                           make_stage, num_stages):
    client = chains.client(num_stages)
    small, client.draft_model = client.draft_model, make_stage()
    try:
        result = chains.generate(num_stages, prompts["copy"], max_tokens=NUM_TOKENS,
                                 stop_ids=tokenizer.eog_ids,
                                 speculative=SpeculativeSettings("draft", 1, 6))
    finally:
        client.draft_model = small
    assert (result.tokens, result.finish_reason) == reference(num_stages, "copy")
    figures = result.speculation
    assert figures["speculative_num_proposed_tokens"] > 0
    assert figures["speculative_acceptance_rate"] == 1.0
    assert figures["speculative_num_rejected_windows"] == 0
    assert figures["speculative_window_final"] == 6  # grew to the most after full accepts


@pytest.mark.parametrize("num_stages", [2, 3])
@pytest.mark.parametrize("mode", ["ngram-suffix", "ngram-simple"])
def test_pipelined_windows_are_identical(chains, prompts, reference, tokenizer, num_stages, mode):
    settings = SpeculativeSettings(mode, 1, 6, pipeline_depth=3)
    for name in ("copy", "text", "list"):
        result = chains.generate(num_stages, prompts[name], max_tokens=NUM_TOKENS,
                                 stop_ids=tokenizer.eog_ids, speculative=settings)
        assert (result.tokens, result.finish_reason) == reference(num_stages, name), name
        assert result.speculation["speculative_pipeline_depth"] == 3


def test_penalties_sample_every_row_after_the_drafts_before_it(chains, prompts, tokenizer):
    """Greedy with repetition and presence penalties: each row's penalty window must hold the
    drafts of the rows before it, or a repeated draft would be scored wrongly."""
    sampling = SamplingConfig(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5)
    for name in ("copy", "list"):
        off = chains.generate(2, prompts[name], max_tokens=NUM_TOKENS, sampling=sampling,
                              stop_ids=tokenizer.eog_ids)
        on = chains.generate(2, prompts[name], max_tokens=NUM_TOKENS, sampling=sampling,
                             stop_ids=tokenizer.eog_ids,
                             speculative=SpeculativeSettings("ngram-simple", 1, 8))
        assert on.tokens == off.tokens, name


def test_seeded_sampling_with_speculation_is_reproducible(chains, prompts, tokenizer):
    """Sampling: the final stage draws each row from the request's seeded generator, in row
    order, so the same seed and the same proposer give the same tokens."""
    def sample(seed: int):
        sampling = SamplingConfig(temperature=0.9, top_p=0.95, seed=seed)
        return chains.generate(2, prompts["text"], max_tokens=24, sampling=sampling,
                               speculative=SpeculativeSettings("ngram-suffix", 1, 8)).tokens

    first = sample(7)
    assert sample(7) == first
    assert sample(8) != first
