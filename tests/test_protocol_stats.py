"""StageReplyStats merge rules (spec §2.6) and the 27 x i64 layout."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from skippy.protocol import (
    FrameError, StageReplyStats, merge, merge_all, prefill_compute_observation,
    prefill_edge_observation, stage_mask,
)
from skippy.protocol.stats import FIELD_NAMES, MERGE_RULES, MergeRule, decode_stats, encode_stats

S = StageReplyStats


def test_layout_is_27_i64_in_spec_order():
    assert len(FIELD_NAMES) == 27
    assert FIELD_NAMES[0] == "kv_lookup_hits"
    assert FIELD_NAMES[-1] == "prefill_compute_observation_count"
    stats = S(*range(1, 28))
    wire = encode_stats(stats)
    assert len(wire) == 27 * 8
    assert wire[:16] == bytes.fromhex("0100000000000000 0200000000000000")
    assert decode_stats(wire) == stats


def test_every_field_has_the_spec_rule():
    expected = {
        MergeRule.SUM: {"kv_lookup_hits", "kv_lookup_misses", "kv_lookup_errors",
                        "kv_imported_pages", "kv_imported_tokens", "kv_recorded_pages",
                        "kv_recorded_bytes", "verify_window_compute_us",
                        "verify_window_forward_write_us", "verify_window_downstream_wait_us",
                        "verify_window_total_us", "verify_window_stage_count",
                        "verify_window_request_count", "verify_window_token_count",
                        "prefill_edge_observation_count", "prefill_compute_observation_count"},
        MergeRule.OR: {"kv_hit_stage_mask", "kv_record_stage_mask"},
        MergeRule.MAX: {"verify_window_max_tokens", "prefill_edge_write_us_max",
                        "prefill_edge_wait_us_max"},
        MergeRule.WORST_EDGE: {"prefill_edge_total_us_max", "prefill_edge_stage_index",
                               "prefill_edge_activation_bytes_max"},
        MergeRule.SLOWEST_COMPUTE: {"prefill_compute_us_at_slowest_rate",
                                    "prefill_compute_stage_index",
                                    "prefill_compute_token_count_at_slowest_rate"},
    }
    for rule, names in expected.items():
        assert {n for n, r in MERGE_RULES.items() if r is rule} == names, rule


SIMPLE_RULE_CASES = [
    # (field, a, b, merged)
    ("kv_lookup_hits", 2, 3, 5),                          # sum
    ("kv_recorded_bytes", 1 << 40, 1 << 40, 1 << 41),     # sum, large
    ("verify_window_total_us", 100, 0, 100),              # sum with zero
    ("prefill_compute_observation_count", 3, 4, 7),       # counts summed
    ("kv_hit_stage_mask", 0b0101, 0b0011, 0b0111),        # bitwise OR, not sum
    ("kv_record_stage_mask", 0b1000, 0b1000, 0b1000),     # OR is idempotent
    ("verify_window_max_tokens", 4, 9, 9),                # max
    ("prefill_edge_write_us_max", 12_000, 4_000, 12_000),  # max, independent of the edge entry
    ("prefill_edge_wait_us_max", 3_000, 40_000, 40_000),
]


@pytest.mark.parametrize("name, a, b, merged", SIMPLE_RULE_CASES)
def test_simple_rules(name, a, b, merged):
    assert getattr(merge(S(**{name: a}), S(**{name: b})), name) == merged
    assert getattr(merge(S(**{name: b}), S(**{name: a})), name) == merged


def _edge(total: int, stage: int, nbytes: int) -> S:
    return S(prefill_edge_total_us_max=total, prefill_edge_stage_index=stage,
             prefill_edge_activation_bytes_max=nbytes)


WORST_EDGE_CASES = [
    # (a, b, winner): the whole (total, stage, bytes) entry moves together
    # the larger total wins
    (_edge(15_000, 2, 1 << 20), _edge(44_000, 1, 1 << 19), _edge(44_000, 1, 1 << 19)),
    (_edge(50, 3, 10), _edge(40, 1, 1 << 30), _edge(50, 3, 10)),  # bytes do not decide
    (_edge(0, 0, 0), _edge(0, 2, 4096), _edge(0, 2, 4096)),       # empty vs a 0 us observation
    (_edge(7, 1, 5), _edge(7, 2, 3), _edge(7, 2, 3)),             # tie: larger stage index
]


@pytest.mark.parametrize("a, b, winner", WORST_EDGE_CASES)
def test_worst_edge(a, b, winner):
    assert merge(a, b) == winner
    assert merge(b, a) == winner


def _compute(us: int, stage: int, tokens: int) -> S:
    return S(prefill_compute_us_at_slowest_rate=us, prefill_compute_stage_index=stage,
             prefill_compute_token_count_at_slowest_rate=tokens)


SLOWEST_COMPUTE_CASES = [
    # (a, b, winner)
    # same chunk size: the slower stage wins
    (_compute(18_000, 2, 128), _compute(42_000, 1, 128), _compute(42_000, 1, 128)),
    # a 9-token tail is slower per token (3.3 ms vs 0.375 ms) but does not displace 128 tokens
    (_compute(48_000, 1, 128), _compute(30_000, 1, 9), _compute(48_000, 1, 128)),
    # a 64-token chunk does not displace a 128-token sample either
    (_compute(42_000, 1, 128), _compute(25_000, 3, 64), _compute(42_000, 1, 128)),
    # any sample beats no sample
    (S(), _compute(5, 4, 1), _compute(5, 4, 1)),
    # full tie: the larger stage index, so the merge stays commutative
    (_compute(10, 1, 8), _compute(10, 2, 8), _compute(10, 2, 8)),
]


@pytest.mark.parametrize("a, b, winner", SLOWEST_COMPUTE_CASES)
def test_slowest_compute(a, b, winner):
    assert merge(a, b) == winner
    assert merge(b, a) == winner


def test_observations_match_the_reference_scenario():
    # The Rust peers' reply-stats test: two edges and three compute samples.
    stats = merge_all([
        prefill_edge_observation(2, 12_000, 3_000, 1_048_576),
        prefill_edge_observation(1, 4_000, 40_000, 524_288),
        prefill_compute_observation(2, 18_000, 128),
        prefill_compute_observation(1, 42_000, 128),
        prefill_compute_observation(3, 25_000, 64),
    ])
    assert (stats.prefill_edge_write_us_max, stats.prefill_edge_wait_us_max) == (12_000, 40_000)
    assert (stats.prefill_edge_total_us_max, stats.prefill_edge_stage_index,
            stats.prefill_edge_activation_bytes_max) == (44_000, 1, 524_288)
    assert stats.prefill_edge_observation_count == 2
    assert (stats.prefill_compute_us_at_slowest_rate, stats.prefill_compute_stage_index,
            stats.prefill_compute_token_count_at_slowest_rate) == (42_000, 1, 128)
    assert stats.prefill_compute_observation_count == 3


def test_stage_mask():
    assert stage_mask(0) == 1 and stage_mask(5) == 32
    with pytest.raises(ValueError):
        stage_mask(-1)


def test_encode_refuses_out_of_range():
    with pytest.raises(FrameError, match="kv_lookup_hits"):
        encode_stats(S(kv_lookup_hits=1 << 63))
    with pytest.raises(FrameError, match="stats block"):
        decode_stats(bytes(215))


# Non-negative values: the all-zero record is only an identity for max when nothing is negative.
values = st.integers(0, 1 << 40)
stats_records = st.builds(S, **{name: values for name in FIELD_NAMES})
any_stats = st.builds(S, **{name: st.integers(-(1 << 40), 1 << 40) for name in FIELD_NAMES})


@given(any_stats, any_stats)
def test_merge_is_commutative(a, b):
    assert merge(a, b) == merge(b, a)


@given(any_stats, any_stats, any_stats)
def test_merge_is_associative(a, b, c):
    assert merge(merge(a, b), c) == merge(a, merge(b, c))


@given(stats_records)
def test_zero_is_the_identity(a):
    assert merge(a, S()) == a
    assert merge_all([a]) == a


@given(any_stats)
def test_stats_round_trip(a):
    assert decode_stats(encode_stats(a)) == a


def test_merge_is_pure():
    a, b = S(kv_lookup_hits=1), S(kv_lookup_hits=2)
    merge(a, b)
    assert a == S(kv_lookup_hits=1) and b == S(kv_lookup_hits=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.kv_lookup_hits = 5  # type: ignore[misc]
