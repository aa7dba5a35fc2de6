"""Sampler tests: oracles are plain-Python softmax/sort code, not the sampler's own maths."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from numerics import sampling_slack
from skippy.model.sampling import (
    Draws,
    RequestSampler,
    apply_penalties,
    draw_token,
    filter_logits,
    greedy,
    penalty_window,
)
from skippy.model.errors import RequestError
from skippy.protocol.sampling_config import SamplingConfig

NUM_VOCAB = 49152


def random_logits(seed: int, *shape: int, scale: float = 3.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen) * scale


def draw_many(sampler: RequestSampler, logits: torch.Tensor, num_draws: int, history=()) -> list[int]:
    return [sampler.sample(logits, list(history)) for _ in range(num_draws)]


def slack_for(logits: torch.Tensor) -> float:
    """How far float32 filtering may sit from the float64 oracle (tests/numerics.py)."""
    return sampling_slack(logits.shape[-1], float(logits.abs().max()))


def allowed_tokens(logits: list[float], top_k: int, top_p: float, min_p: float, slack: float) -> set[int]:
    """Oracle in float64, llama.cpp order. slack > 0 widens the set, slack < 0 narrows it."""
    order = sorted(range(len(logits)), key=lambda i: -logits[i])
    if 0 < top_k < len(order):
        order = order[:top_k]
    if top_p < 1.0:
        top = logits[order[0]]
        weights = [math.exp(logits[i] - top) for i in order]
        total = sum(weights)
        kept, mass_before = [], 0.0
        for token, weight in zip(order, weights):
            if mass_before < top_p + slack:
                kept.append(token)
            mass_before += weight / total
        order = kept
    if min_p > 0.0:
        threshold = logits[order[0]] + math.log(min_p)
        order = [i for i in order if logits[i] >= threshold - slack]
    return set(order)


# --- greedy -----------------------------------------------------------------


@pytest.mark.parametrize(
    "config",
    [
        SamplingConfig(temperature=0.0),  # temperature 0 is greedy
        SamplingConfig(temperature=1.0, top_k=1),  # top_k 1 is greedy
        SamplingConfig(temperature=0.7, top_k=1, top_p=0.5, min_p=0.1),  # top_k 1 wins over filters
    ],
)
def test_greedy_configs_pick_argmax(config):
    sampler = RequestSampler(config)
    for seed in range(20):
        logits = random_logits(seed, NUM_VOCAB)
        assert sampler.sample(logits, []) == int(logits.argmax()) == greedy(logits)


def test_greedy_rows():
    logits = random_logits(0, 4, NUM_VOCAB)
    expected = [int(row.argmax()) for row in logits]
    assert greedy(logits) == expected
    assert RequestSampler(SamplingConfig()).sample(logits, [], row_tokens=[1, 2, 3]) == expected


def test_greedy_breaks_ties_and_nans_as_torch_does():
    """greedy reads CPU float32 logits through numpy: the first of equal maxima, and a
    NaN as the maximum, exactly as torch.argmax picks (float16 stays on torch's)."""
    rows = torch.tensor([[1.0, 3.0, 3.0, 0.0], [float("nan"), 5.0, float("nan"), 1.0],
                         [2.0, float("inf"), float("inf"), 0.0], [-float("inf")] * 4])
    for dtype in (torch.float32, torch.float16):
        logits = rows.to(dtype)
        assert greedy(logits) == logits.argmax(dim=-1).tolist()
        assert [greedy(row) for row in logits] == [int(row.argmax()) for row in logits]


def test_top_k_1_filter_keeps_only_argmax():
    for seed in range(10):
        logits = random_logits(seed, NUM_VOCAB)
        kept = torch.isfinite(filter_logits(logits, top_k=1)).nonzero().flatten().tolist()
        assert kept == [int(logits.argmax())]


# --- seeds and independence ---------------------------------------------------


def test_same_seed_same_tokens_different_seed_differs():
    logits = random_logits(1, NUM_VOCAB, scale=1.0)
    config = SamplingConfig(temperature=1.0, seed=7)
    first = draw_many(RequestSampler(config), logits, 50)
    again = draw_many(RequestSampler(config), logits, 50)
    other = draw_many(RequestSampler(SamplingConfig(temperature=1.0, seed=8)), logits, 50)
    assert first == again
    assert first != other


def test_unseeded_samplers_get_distinct_recorded_seeds():
    seeds = {RequestSampler(SamplingConfig(temperature=1.0)).seed for _ in range(5)}
    assert len(seeds) == 5


def test_interleaved_samplers_match_each_alone():
    logits = random_logits(2, NUM_VOCAB, scale=1.0)
    config_a = SamplingConfig(temperature=1.0, top_p=0.5, seed=1)
    config_b = SamplingConfig(temperature=0.8, top_k=100, seed=2)
    alone_a = draw_many(RequestSampler(config_a), logits, 30)
    alone_b = draw_many(RequestSampler(config_b), logits, 30)

    sampler_a, sampler_b = RequestSampler(config_a), RequestSampler(config_b)
    mixed_a, mixed_b = [], []
    for _ in range(30):
        mixed_a.append(sampler_a.sample(logits, []))
        torch.rand(10)  # the global generator must not matter either
        mixed_b.append(sampler_b.sample(logits, []))
    assert (mixed_a, mixed_b) == (alone_a, alone_b)


# --- filters ---------------------------------------------------------------


filter_params = st.fixed_dictionaries(
    {
        "top_k": st.integers(0, 70),
        "top_p": st.floats(0.05, 1.0),
        "min_p": st.sampled_from([0.0, 0.01, 0.1, 0.5, 1.0]),
        "logits_seed": st.integers(0, 10_000),
        "scale": st.floats(0.1, 10.0),
    }
)


@settings(max_examples=60, deadline=None)
@given(filter_params)
def test_filter_logits_matches_oracle(params):
    logits = random_logits(params["logits_seed"], 64, scale=params["scale"])
    knobs = {k: params[k] for k in ("top_k", "top_p", "min_p")}
    kept = set(torch.isfinite(filter_logits(logits, **knobs)).nonzero().flatten().tolist())
    values = logits.double().tolist()
    # float32 vs float64 may disagree only on tokens sitting on a boundary.
    slack = slack_for(logits)
    assert allowed_tokens(values, slack=-slack, **knobs) <= kept <= allowed_tokens(values, slack=slack, **knobs)
    assert int(logits.argmax()) in kept  # never filters everything


@settings(max_examples=30, deadline=None)
@given(filter_params, st.floats(0.1, 3.0))
def test_draws_stay_inside_allowed_set(params, temperature):
    logits = random_logits(params["logits_seed"], 64, scale=params["scale"])
    knobs = {k: params[k] for k in ("top_k", "top_p", "min_p")}
    sampler = RequestSampler(SamplingConfig(temperature=temperature, seed=params["logits_seed"], **knobs))
    allowed = allowed_tokens(logits.double().tolist(), slack=slack_for(logits), **knobs)
    assert set(draw_many(sampler, logits, 100)) <= allowed


@pytest.mark.parametrize(
    "scale, top_p",
    [
        (0.1, 0.9),  # nearly flat: the nucleus is most of the vocab, the head must grow
        (1.0, 0.5),  # a few thousand tokens
        (3.0, 0.95),  # a few hundred
        (10.0, 0.9),  # peaked: a handful
    ],
)
def test_top_p_on_full_vocab_matches_oracle(scale, top_p):
    logits = random_logits(7, NUM_VOCAB, scale=scale)
    kept = set(torch.isfinite(filter_logits(logits, top_p=top_p)).nonzero().flatten().tolist())
    values = logits.double().tolist()
    slack = slack_for(logits)
    strict = allowed_tokens(values, top_k=0, top_p=top_p, min_p=0.0, slack=-slack)
    assert strict <= kept <= allowed_tokens(values, top_k=0, top_p=top_p, min_p=0.0, slack=slack)


@pytest.mark.parametrize(
    "probs, expected",
    [
        ([0.0, 1.0, 0.0], {1}),  # only one token possible
        ([0.0, 0.0, 2.0], {2}),  # unnormalised, last token
        ([3.0, 0.0, 0.0], {0}),  # first token, zeros after it
        ([0.5, 0.0, 0.5, 0.0], {0, 2}),  # zero-probability tokens between
    ],
)
def test_draw_token_never_picks_zero_probability(probs, expected):
    draws = Draws(0)
    uniforms = [draws.next() for _ in range(300)] + [0.0, 1.0 - 2.0**-53]  # and both ends of [0, 1)
    assert {draw_token(torch.tensor(probs), u) for u in uniforms} == expected


@pytest.mark.parametrize(
    "temperature, top_k",
    [
        (1.0, 0),  # plain softmax
        (0.5, 0),  # sharper
        (2.0, 0),  # flatter
        (1.0, 3),  # renormalised over the top 3
    ],
)
def test_empirical_distribution_matches_softmax(temperature, top_k):
    values = [1.0, 0.5, 0.0, -0.5, -1.0]
    kept = values[:top_k] if top_k else values
    weights = [math.exp(v / temperature) for v in kept]
    expected = [w / sum(weights) for w in weights] + [0.0] * (len(values) - len(kept))

    num_draws = 10_000
    sampler = RequestSampler(SamplingConfig(temperature=temperature, top_k=top_k, seed=11))
    tokens = draw_many(sampler, torch.tensor(values), num_draws)
    observed = [tokens.count(t) / num_draws for t in range(len(values))]
    # 4 standard deviations of p(1-p)/n at p = 0.5, n = 10k
    assert observed == pytest.approx(expected, abs=0.02)


# --- logit bias ---------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logit_bias_forbids_and_forces(temperature):
    logits = random_logits(3, NUM_VOCAB, scale=5.0)
    top = int(logits.argmax())

    forbid = RequestSampler(SamplingConfig(temperature=temperature, logit_bias={top: -math.inf}, seed=0))
    assert top not in draw_many(forbid, logits, 100)

    force = RequestSampler(SamplingConfig(temperature=temperature, logit_bias={7: 100.0}, seed=0))
    assert set(draw_many(force, logits, 100)) == {7}


# --- penalties ----------------------------------------------------------------


def test_repetition_penalty_divides_positive_multiplies_negative():
    logits = torch.tensor([2.0, -2.0, 0.0, 1.0])
    out = apply_penalties(logits, [0, 1, 2], repetition_penalty=2.0)
    assert out.tolist() == [1.0, -4.0, 0.0, 1.0]
    assert logits.tolist() == [2.0, -2.0, 0.0, 1.0]  # input untouched


def test_presence_and_frequency_subtract_openai_style():
    logits = torch.zeros(5)
    out = apply_penalties(logits, [3, 3, 1], presence_penalty=0.5, frequency_penalty=0.25)
    assert out.tolist() == pytest.approx([0.0, -0.75, 0.0, -1.0, 0.0])


@pytest.mark.parametrize(
    "penalties, history, expected",
    [
        ({}, [0], 0),  # no penalty: the top logit wins
        ({"presence_penalty": 0.5}, [0], 1),  # presence knocks out the seen leader
        ({"presence_penalty": 0.5}, [0, 1], 0),  # both seen: order restored
        ({"frequency_penalty": 0.05}, [0], 0),  # one sighting is not enough
        ({"frequency_penalty": 0.05}, [0, 0, 0], 1),  # three are
        ({"repetition_penalty": 2.0}, [0], 1),  # 1.0 -> 0.5 < 0.9
    ],
)
def test_penalties_change_argmax(penalties, history, expected):
    logits = torch.tensor([1.0, 0.9, 0.0])
    assert RequestSampler(SamplingConfig(**penalties)).sample(logits, history) == expected


@pytest.mark.parametrize(
    "history, last_n, expected",
    [
        ([5, 6, 7], -1, [5, 6, 7]),  # -1 is the whole history
        ([5, 6, 7], 2, [6, 7]),  # the last two
        ([5, 6, 7], 64, [5, 6, 7]),  # window longer than history
        ([5, 6, 7], 0, []),  # 0 turns penalties off
    ],
)
def test_penalty_window(history, last_n, expected):
    assert penalty_window(history, last_n) == expected


@pytest.mark.parametrize(
    "history, last_n, expected",
    [
        ([0, 1], 1, 0),  # only token 1 is in the window
        ([1, 0], 1, 1),  # only token 0 is, so it loses the lead
        ([1, 0], 2, 0),  # both are: order restored
        ([0, 2, 2], 2, 0),  # token 0 fell out of the window
    ],
)
def test_penalty_last_n_window_respected(history, last_n, expected):
    logits = torch.tensor([1.0, 0.9, 0.0])
    config = SamplingConfig(presence_penalty=0.5, penalty_last_n=last_n)
    assert RequestSampler(config).sample(logits, history) == expected


# --- verify windows -------------------------------------------------------------


@pytest.mark.parametrize(
    "config",
    [
        SamplingConfig(repetition_penalty=1.3, presence_penalty=0.5, penalty_last_n=8),  # greedy, penalised
        SamplingConfig(temperature=0.9, top_p=0.9, frequency_penalty=0.3, seed=5),  # sampled, penalised
        SamplingConfig(temperature=1.0, top_k=40, min_p=0.05, seed=6),  # sampled, no penalties
        # sampled, biased, penalties over the whole history
        SamplingConfig(temperature=1.0, logit_bias={3: 2.0}, penalty_last_n=-1, repetition_penalty=1.1, seed=7),
    ],
)
def test_rows_equal_one_by_one_with_extended_history(config):
    logits = random_logits(4, 5, NUM_VOCAB)
    history = torch.randint(NUM_VOCAB, (20,), generator=torch.Generator().manual_seed(5)).tolist()
    row_tokens = [int(row.argmax()) for row in logits[:-1]]  # drafts the penalties will notice

    batched = RequestSampler(config).sample(logits, history, row_tokens=row_tokens)
    one_by_one = RequestSampler(config)
    expected = [one_by_one.sample(logits[i], history + row_tokens[:i]) for i in range(5)]
    assert batched == expected


def test_row_history_includes_earlier_drafts():
    logits = torch.zeros(3, 10)
    logits[:, 5] = 1.0
    sampler = RequestSampler(SamplingConfig(presence_penalty=100.0))
    # row 0 has not seen draft 5 yet; rows 1 and 2 have
    tokens = sampler.sample(logits, [0], row_tokens=[5, 6])
    assert tokens[0] == 5 and 5 not in tokens[1:]


# --- bad input ----------------------------------------------------------------


@pytest.mark.parametrize(
    "config, logits, history, row_tokens",
    [
        (SamplingConfig(), torch.zeros(2, 2, 8), [], None),  # 3-D logits
        (SamplingConfig(), torch.zeros(3, 8), [], [1]),  # one draft short for 3 rows
        (SamplingConfig(), torch.zeros(8), [], [1]),  # drafts for a single row
        (SamplingConfig(logit_bias={8: 1.0}), torch.zeros(8), [], None),  # bias id past the vocab
        (SamplingConfig(presence_penalty=1.0), torch.zeros(8), [9], None),  # history id past the vocab
        # every token banned: nothing left to draw
        (SamplingConfig(temperature=1.0, logit_bias={0: -math.inf, 1: -math.inf}), torch.zeros(2), [], None),
    ],
)
def test_bad_input_says_expected(config, logits, history, row_tokens):
    with pytest.raises(ValueError, match="Expected"):
        RequestSampler(config).sample(logits, history, row_tokens=row_tokens)


def test_negative_bias_id_rejected():
    with pytest.raises(ValueError, match="Expected logit_bias token ids >= 0"):
        RequestSampler(SamplingConfig(logit_bias={-1: 1.0}))


# --- device -----------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_logits_sample_on_cuda_generator():
    logits = random_logits(6, NUM_VOCAB, scale=1.0).cuda()
    config = SamplingConfig(temperature=1.0, top_p=0.9, repetition_penalty=1.2, logit_bias={1: 3.0}, seed=3)
    draws = draw_many(RequestSampler(config, "cuda"), logits, 20, [1, 2])
    assert draws == draw_many(RequestSampler(config, "cuda"), logits, 20, [1, 2])  # same seed, same draws
    assert len(set(draws)) > 1  # and really sampled
    assert RequestSampler(SamplingConfig(), "cuda").sample(logits, []) == int(logits.argmax())
    with pytest.raises(ValueError, match="Expected logits on cpu"):
        RequestSampler(config).sample(logits, [])


def test_skipping_draws_resumes_the_seeded_stream():
    """A replayed request's sampler skips the draws its first session made: the draws after
    that are the ones an uninterrupted sampler makes."""
    logits = random_logits(1, NUM_VOCAB, scale=1.0)
    config = SamplingConfig(temperature=1.0, top_p=0.9, seed=5)
    uninterrupted = draw_many(RequestSampler(config), logits, 30)
    resumed = RequestSampler(config)
    resumed.skip_draws(12)
    assert draw_many(resumed, logits, 18) == uninterrupted[12:]
    assert draw_many(RequestSampler(config), logits, 18) != uninterrupted[12:]  # not by chance


# --- what a peer may send that the API never does (issue 43) ---------------------


def test_a_plus_inf_bias_forces_its_token_at_any_temperature():
    logits = random_logits(2, NUM_VOCAB, scale=1.0)
    forced = {11: math.inf, 4000: math.inf}
    for config in (SamplingConfig(temperature=1.3, top_p=0.9, min_p=0.1, seed=1, logit_bias=forced),
                   SamplingConfig(temperature=0.7, top_k=40, seed=2, logit_bias=forced)):
        assert set(draw_many(RequestSampler(config), logits, 60)) == {11, 4000}  # each as likely
    assert RequestSampler(SamplingConfig(logit_bias=forced)).sample(logits, []) == 11  # greedy: the first


def test_a_row_with_nothing_to_draw_fails_with_its_reason():
    nan = random_logits(3, NUM_VOCAB)
    nan[100] = math.nan
    with pytest.raises(RequestError, match="Expected finite logits, got NaN"):
        RequestSampler(SamplingConfig(temperature=0.8, seed=1)).sample(nan, [])
    with pytest.raises(RequestError, match="Expected logit_bias token ids < 49152"):
        RequestSampler(SamplingConfig(logit_bias={NUM_VOCAB: 1.0}), vocab_size=NUM_VOCAB)


def test_skipping_any_count_of_draws_is_a_jump():
    """decode_step is an i32 a peer sends: 2^31 - 1 skipped draws cost what a few do (Draws)."""
    config = SamplingConfig(temperature=1.0, seed=9)
    far = RequestSampler(config)
    far.skip_draws(2**31 - 1)
    stepped = Draws(9)
    stepped.skip(2**31 - 3)
    stepped.skip(2)
    assert far._draws.next() == stepped.next()
    reference = Draws(9)
    first = [reference.next() for _ in range(5)]
    resumed = Draws(9)
    resumed.skip(3)
    assert [resumed.next(), resumed.next()] == first[3:]
