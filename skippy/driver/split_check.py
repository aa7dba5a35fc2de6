"""Predicted against measured, per stage (`/v1/stages`): is the split still the one to have?

A stage's probe (stage/measure.py) predicts its decode forward: affine in the rows of a
forward, through one row and a prompt chunk. Its metrics measure the forwards it actually
ran over the last seconds: their mean time and the mean batch they held. When the two differ
by more than DRIFT on any stage, the split was planned from figures that no longer hold
(another load on the host, a thermal limit, a neighbour's forwards on shared cores), and
stage 0 asks the launcher's advisor for the split the measured times give
(launch/measured_split.py, handed in: the driver does not plan). The advisor names other
ranges only for a gain worth a restart of every stage.
"""

from __future__ import annotations

from ..protocol.stage_metrics import StageMetricValues
from ..protocol.stage_probe import StageProbe

DRIFT = 0.15
MIN_FORWARDS = 16  # decode forwards a stage must have run before its mean says anything


def predicted_forward_s(probe: StageProbe, rows: float) -> float:
    """The probe's line through (1, row) and (chunk_rows, chunk) at `rows` rows."""
    row, chunk = probe.row_ns / 1e9, probe.chunk_ns / 1e9
    slope = max(chunk - row, 0.0) / (probe.chunk_rows - 1) if probe.chunk_rows > 1 else row
    return row + (rows - 1) * slope


def compare(probe: StageProbe, metrics: StageMetricValues,
            since: StageMetricValues | None = None) -> dict[str, float] | None:
    """{predicted and measured mean decode forward (ms), the rows it held, measured / predicted - 1},
    or None before the stage has measured itself and run MIN_FORWARDS decode forwards. The
    measured mean is the one since `since` (an earlier report of the same stage) when at least
    MIN_FORWARDS ran since: a host that slowed down after hours on its prediction shows it
    within seconds, not once the slow forwards outweigh the hours. Else it is the mean since start."""
    forwards, batches = metrics.histograms["forward_us.decode"], metrics.histograms["batch_steps"]
    if since is not None:
        recent = forwards.since(since.histograms["forward_us.decode"])
        if recent.count >= MIN_FORWARDS:
            forwards, batches = recent, batches.since(since.histograms["batch_steps"])
    if probe.row_ns <= 0 or forwards.count < MIN_FORWARDS:
        return None
    # each step records its batch's forward; the rows it held are taken as the mean batch (exact
    # for one stream, and for batches of one size)
    rows = batches.total / batches.count if batches.count else 1.0
    measured = forwards.total / forwards.count / 1e6
    predicted = predicted_forward_s(probe, rows)
    return {"predicted_decode_forward_ms": predicted * 1e3, "measured_decode_forward_ms": measured * 1e3,
            "decode_rows": rows, "off_by": measured / predicted - 1}


def drifted(comparisons: list[dict[str, float] | None]) -> bool:
    return any(c is not None and abs(c["off_by"]) > DRIFT for c in comparisons)
