"""`StageReplyStats`: counters every reply carries upstream, and how they merge (spec §2.6).

A stage merges its own stats with those of downstream replies and deferred ACKs,
so the driver sees one record for the whole chain. `merge` is pure, commutative
and associative, and the all-zero record is its identity for non-negative values.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import Enum
from functools import reduce
from typing import Iterable

from .constants import I64_MAX, I64_MIN, STATS_BLOCK, STATS_FIELD_COUNT
from .errors import FrameError


@dataclass(frozen=True, slots=True)
class StageReplyStats:
    """27 i64 counters, in wire order (spec §2.6). Times are microseconds."""

    kv_lookup_hits: int = 0
    kv_lookup_misses: int = 0
    kv_lookup_errors: int = 0
    kv_imported_pages: int = 0
    kv_imported_tokens: int = 0
    kv_recorded_pages: int = 0
    kv_recorded_bytes: int = 0
    kv_hit_stage_mask: int = 0          # bit 1 << stage_index per stage that hit
    kv_record_stage_mask: int = 0       # bit 1 << stage_index per stage that recorded
    verify_window_compute_us: int = 0
    verify_window_forward_write_us: int = 0
    verify_window_downstream_wait_us: int = 0
    verify_window_total_us: int = 0
    verify_window_stage_count: int = 0
    verify_window_request_count: int = 0
    verify_window_token_count: int = 0
    verify_window_max_tokens: int = 0
    prefill_edge_write_us_max: int = 0
    prefill_edge_wait_us_max: int = 0
    prefill_edge_total_us_max: int = 0            # worst edge: write + wait ...
    prefill_edge_stage_index: int = 0             # ... the stage that sent it ...
    prefill_edge_activation_bytes_max: int = 0    # ... and its frame size
    prefill_edge_observation_count: int = 0
    prefill_compute_us_at_slowest_rate: int = 0           # slowest prefill sample: time ...
    prefill_compute_stage_index: int = 0                  # ... stage ...
    prefill_compute_token_count_at_slowest_rate: int = 0  # ... and its token count
    prefill_compute_observation_count: int = 0


class MergeRule(Enum):
    SUM = "sum"
    OR = "bitwise or"
    MAX = "max"
    WORST_EDGE = "entry with the larger edge total"
    SLOWEST_COMPUTE = "slowest rate among the largest samples"


_RULE_BY_PREFIX = (
    # (field name prefix or name,               rule)
    ("kv_hit_stage_mask",                       MergeRule.OR),
    ("kv_record_stage_mask",                    MergeRule.OR),
    ("kv_",                                     MergeRule.SUM),
    ("verify_window_max_tokens",                MergeRule.MAX),
    ("verify_window_",                          MergeRule.SUM),
    ("prefill_edge_write_us_max",               MergeRule.MAX),
    ("prefill_edge_wait_us_max",                MergeRule.MAX),
    ("prefill_edge_observation_count",          MergeRule.SUM),
    ("prefill_edge_",                           MergeRule.WORST_EDGE),
    ("prefill_compute_observation_count",       MergeRule.SUM),
    ("prefill_compute_",                        MergeRule.SLOWEST_COMPUTE),
)

FIELD_NAMES: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(StageReplyStats))
MERGE_RULES: dict[str, MergeRule] = {
    name: next(rule for prefix, rule in _RULE_BY_PREFIX if name.startswith(prefix))
    for name in FIELD_NAMES
}
assert len(FIELD_NAMES) == STATS_FIELD_COUNT


def _fields_with(rule: MergeRule) -> tuple[str, ...]:
    return tuple(name for name in FIELD_NAMES if MERGE_RULES[name] is rule)


_SUM = _fields_with(MergeRule.SUM)
_OR = _fields_with(MergeRule.OR)
_MAX = _fields_with(MergeRule.MAX)
_EDGE = ("prefill_edge_total_us_max", "prefill_edge_stage_index",
         "prefill_edge_activation_bytes_max")
_COMPUTE = ("prefill_compute_token_count_at_slowest_rate", "prefill_compute_us_at_slowest_rate",
            "prefill_compute_stage_index")
assert set(_EDGE) == set(_fields_with(MergeRule.WORST_EDGE))
assert set(_COMPUTE) == set(_fields_with(MergeRule.SLOWEST_COMPUTE))


def _pick(a: StageReplyStats, b: StageReplyStats, key: tuple[str, ...]) -> dict[str, int]:
    # Whole-entry max under a total order, so the merge stays commutative and associative.
    winner = max(a, b, key=lambda s: tuple(getattr(s, name) for name in key))
    return {name: getattr(winner, name) for name in key}


def merge(a: StageReplyStats, b: StageReplyStats) -> StageReplyStats:
    """Combine two stats records by the spec §2.6 rules.

    * sums for counts and times, bitwise OR for the stage masks, max for the maxima;
    * worst edge: the (total, stage index, bytes) entry with the larger total wins
      (ties go to the larger stage index, then the larger frame);
    * prefill compute calibration: the sample with more tokens wins, then the slower one,
      so a short tail chunk (mostly fixed overhead) never displaces a full one; with equal
      chunks on every stage this keeps the chain's slowest per-token rate.
    """
    if is_empty(b):  # most replies on a decode step carry nothing: skip the 60-field rebuild
        return a
    merged: dict[str, int] = {}
    for name in _SUM:
        merged[name] = getattr(a, name) + getattr(b, name)
    for name in _OR:
        merged[name] = getattr(a, name) | getattr(b, name)
    for name in _MAX:
        merged[name] = max(getattr(a, name), getattr(b, name))
    merged.update(_pick(a, b, _EDGE))
    merged.update(_pick(a, b, _COMPUTE))
    return StageReplyStats(**merged)


# Nothing to report: merge's identity (for the non-negative values stats hold), and the one
# instance a reply or a connection holds while it has nothing (frozen, so it can be shared;
# building 27 fields for each decode step's reply cost ~20 us where that runs cold)
NO_STATS = StageReplyStats()


def is_empty(stats: StageReplyStats) -> bool:
    return stats is NO_STATS or stats == NO_STATS


def merge_all(stats: Iterable[StageReplyStats]) -> StageReplyStats:
    return reduce(merge, stats, NO_STATS)


def stage_mask(stage_index: int) -> int:
    """The `kv_*_stage_mask` bit of one stage."""
    if not 0 <= stage_index < 63:
        raise ValueError(f"Expected 0 <= stage_index < 63 for a stage mask, got {stage_index}")
    return 1 << stage_index


def prefill_edge_observation(stage_index: int, write_us: int, wait_us: int,
                             activation_bytes: int) -> StageReplyStats:
    """One downstream write+wait of a prefill frame, ready to `merge`."""
    return StageReplyStats(
        prefill_edge_write_us_max=write_us,
        prefill_edge_wait_us_max=wait_us,
        prefill_edge_total_us_max=write_us + wait_us,
        prefill_edge_stage_index=stage_index,
        prefill_edge_activation_bytes_max=activation_bytes,
        prefill_edge_observation_count=1,
    )


def prefill_compute_observation(stage_index: int, compute_us: int,
                                token_count: int) -> StageReplyStats:
    """One prefill chunk's compute time on one stage, ready to `merge`."""
    return StageReplyStats(
        prefill_compute_us_at_slowest_rate=compute_us,
        prefill_compute_stage_index=stage_index,
        prefill_compute_token_count_at_slowest_rate=token_count,
        prefill_compute_observation_count=1,
    )


def lookup_observation(stage_index: int, restored_tokens: int) -> StageReplyStats:
    """One stage's prefix-cache lookup: a hit of `restored_tokens` (> 0) or a miss (0)."""
    if restored_tokens <= 0:
        return StageReplyStats(kv_lookup_misses=1)
    return StageReplyStats(kv_lookup_hits=1, kv_imported_pages=1, kv_imported_tokens=restored_tokens,
                           kv_hit_stage_mask=stage_mask(stage_index))


LOOKUP_ERROR = StageReplyStats(kv_lookup_errors=1)  # a lookup that failed: counted, then a miss


def record_observation(stage_index: int, num_entries: int, num_bytes: int) -> StageReplyStats:
    """The prefix-cache entries one stage recorded for a prefill."""
    return StageReplyStats(kv_recorded_pages=num_entries, kv_recorded_bytes=num_bytes,
                           kv_record_stage_mask=stage_mask(stage_index))


def restore_missed_below(down: StageReplyStats) -> tuple[bool, StageReplyStats]:
    """The restore rule (spec §4.4), for every stage alike, from what the stages below answered:
    (False, nothing) when they all hit; (True, the miss to add) when one missed or failed, or
    the reply was neutral (no cache below), which counts as one miss so the lookups add up."""
    neutral = not (down.kv_lookup_hits or down.kv_lookup_misses or down.kv_lookup_errors)
    missed = bool(down.kv_lookup_misses or down.kv_lookup_errors or neutral)
    return missed, StageReplyStats(kv_lookup_misses=int(neutral))


def encode_stats(stats: StageReplyStats) -> bytes:
    values = [getattr(stats, name) for name in FIELD_NAMES]
    for name, value in zip(FIELD_NAMES, values):
        if not (isinstance(value, int) and I64_MIN <= value <= I64_MAX):
            raise FrameError(f"stats.{name}: expected an i64, got {value!r}")
    return STATS_BLOCK.pack(*values)


def decode_stats(buf: bytes | memoryview) -> StageReplyStats:
    if len(buf) != STATS_BLOCK.size:
        raise FrameError(f"stats block: expected {STATS_BLOCK.size} bytes, got {len(buf)}")
    return StageReplyStats(*STATS_BLOCK.unpack(buf))
