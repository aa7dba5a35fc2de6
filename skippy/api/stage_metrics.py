"""Every stage's own metrics on stage 0's /metrics, with a `stage` label (the series: docs/operations.md).

Each stage's StageStatus carries its counters, gauges and histograms (protocol/stage_metrics.py),
so a remote stage needs no port of its own. The /metrics route sets `latest` from
`backend.status()` just before it renders; a stage that does not answer has no series in
that scrape (and `skippy_stage_up{stage} 0`).
"""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from ..protocol.stage_metrics import COUNTERS, GAUGES, HISTOGRAMS, StageMetricValues

_HISTOGRAMS = {  # layout name -> (series, help, label values, scale to the series' unit)
    **{f"forward_us.{kind}": ("skippy_stage_forward_seconds", "One forward's worker time, per stage and kind",
                              [kind], 1e-6) for kind in ("prefill", "decode", "verify")},
    "queue_wait_us": ("skippy_stage_queue_wait_seconds", "Time a forward waited for the stage's worker", [], 1e-6),
    "batch_steps": ("skippy_stage_batch_steps", "Sessions' steps in one decode/verify forward", [], 1),
}
_GAUGE_NAMES = {"start_time_s": "start_time_seconds"}


def _counter_series(name: str) -> tuple[str, list[str]]:
    if name.startswith("rows."):
        return "skippy_stage_tokens", [name.removeprefix("rows.")]
    return f"skippy_stage_{name}", []


class StageMetricsCollector:
    def __init__(self) -> None:
        self.latest: list[tuple[str, StageMetricValues]] = []

    def describe(self):
        return []  # values appear at scrape time

    def collect(self):
        families: dict[str, object] = {}

        def family(cls, series: str, doc: str, labels: list[str]):
            if series not in families:
                families[series] = cls(series, doc, labels=["stage", *labels])
            return families[series]

        for stage, metrics in self.latest:
            for name in COUNTERS:
                series, labels = _counter_series(name)
                doc = "Tokens computed by the stage, per kind" if labels else f"Stage {name.replace('_', ' ')}"
                family(CounterMetricFamily, series, doc, ["kind"] if labels else []).add_metric(
                    [stage, *labels], metrics.counters[name])
            for name in GAUGES:
                series = f"skippy_stage_{_GAUGE_NAMES.get(name, name)}"
                family(GaugeMetricFamily, series, f"Stage {name.replace('_', ' ')}", []).add_metric(
                    [stage], metrics.gauges[name])
            for name, (series, doc, labels, scale) in _HISTOGRAMS.items():
                values = metrics.histograms[name]
                buckets, cumulative = [], 0
                for bound, count in zip((*HISTOGRAMS[name], float("inf")), values.counts):
                    cumulative += count
                    buckets.append(("+Inf" if bound == float("inf") else f"{bound * scale:g}", cumulative))
                family(HistogramMetricFamily, series, doc, ["kind"] if labels else []).add_metric(
                    [stage, *labels], buckets, values.total * scale)
        yield from families.values()
