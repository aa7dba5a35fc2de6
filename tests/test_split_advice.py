"""`/v1/stages`' drift check and split advice, from figures set by hand: the measured mean is the
recent one, and an advised split must be worth a restart of every stage."""

from __future__ import annotations

import dataclasses

import pytest

from skippy.driver.backend import StageStatus
from skippy.driver.split_check import DRIFT, MIN_FORWARDS, compare, drifted
from skippy.launch.measured_split import RESTART_GAIN, advisor, model_cost
from skippy.protocol.stage_probe import StageProbe
from skippy.runtime.metrics import StageMetrics

ROW_MS = 2.0
PROBE = StageProbe(row_ns=round(ROW_MS * 1e6), chunk_ns=round(40 * ROW_MS * 1e6), chunk_rows=64,
                   weight_bytes=50_000_000, memory_available_bytes=8 << 30, link_rtt_ns=200_000,
                   link_bytes_per_s=1_000_000_000, row_dtype=0, chunk_dtype=0, row_cpu_ns=round(ROW_MS * 1e6),
                   threads=1, cpu_share_milli=2000)


def decoded(metrics: StageMetrics, forwards: int, forward_ms: float) -> None:
    for _ in range(forwards):
        metrics.observe_forward("decode", 1, forward_ms / 1e3, 0.0)
        metrics.observe("batch_steps", 1)


def snapshot(metrics: StageMetrics):
    return metrics.values({}, None)


def test_a_stage_that_slows_down_after_long_on_its_prediction_drifts_at_once():
    metrics = StageMetrics()
    decoded(metrics, 2000, ROW_MS)  # hours on its prediction
    earlier = snapshot(metrics)
    decoded(metrics, 40, 3 * ROW_MS)  # then a neighbour's load: three times slower
    since_start = compare(PROBE, snapshot(metrics))
    recent = compare(PROBE, snapshot(metrics), earlier)
    assert since_start["off_by"] < DRIFT  # the slow forwards are 2% of all: the mean hides them
    assert recent["off_by"] == pytest.approx(2.0) and drifted([recent])
    assert recent["measured_decode_forward_ms"] == pytest.approx(3 * ROW_MS)


def test_too_few_recent_forwards_compare_since_start():
    metrics = StageMetrics()
    decoded(metrics, 100, 3 * ROW_MS)
    earlier = snapshot(metrics)
    decoded(metrics, MIN_FORWARDS - 1, ROW_MS)  # too few to say anything alone
    assert compare(PROBE, snapshot(metrics), earlier) == compare(PROBE, snapshot(metrics))
    assert compare(PROBE, snapshot(metrics))["off_by"] > 1.5
    fresh = StageMetrics()
    decoded(fresh, MIN_FORWARDS - 1, ROW_MS)
    assert compare(PROBE, snapshot(fresh)) is None


def statuses(ranges, off_by):
    """Two stages on `ranges`, each `off_by` its prediction."""
    out = []
    for index, ((start, end), off) in enumerate(zip(ranges, off_by)):
        # every stage's probe predicts ROW_MS for its layers: a stage with more layers is a faster host
        out.append(StageStatus(f"stage-{index}", start, end, f"127.0.0.1:{7000 + index}", "ready", 0,
                               probe=PROBE if index < len(ranges) - 1 else dataclasses.replace(
                                   PROBE, link_rtt_ns=0, link_bytes_per_s=0, row_dtype=-1, chunk_dtype=-1),
                               predicted_vs_measured={"off_by": off}))
    return out


def test_advice_moves_layers_only_for_a_gain_worth_a_restart(gguf_path):
    advise = advisor(model_cost(gguf_path, ctx_size=2048, lane_count=4), use_all_hosts=True)
    current = [(0, 15), (15, 30)]
    # a little off: the measured times' best split differs by a layer or so, for a few percent
    small = advise(statuses(current, [0.0, 0.2]))
    assert [tuple(r) for r in small["ranges"]] == current, small
    assert "nothing to change" in small["detail"] and f"under the {RESTART_GAIN:.0%}" in small["detail"]
    assert small["predicted_tok_s"] == small["current_split_predicted_tok_s"]
    # far off: stage 1 takes three times its prediction; its layers move up to stage 0
    large = advise(statuses(current, [0.0, 2.0]))
    advised = [tuple(r) for r in large["ranges"]]
    assert advised != current and advised[0][1] > 15 and advised[-1][1] == 30, large
    assert large["predicted_tok_s"] > (1 + RESTART_GAIN) * large["current_split_predicted_tok_s"]
    assert "Apply it with `skippy plan --auto" in large["detail"]
