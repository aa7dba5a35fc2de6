"""The metric values a stage reports in its StageStatus reply (docs/protocol.md §5.1).

A fixed, versioned layout of i64 values: counters (only grow), gauges (a value now), and
histograms (one count per bucket, non-cumulative, the last above every bound, then the sum
of what was observed). Times are microseconds, sizes bytes. Stage 0 turns them into
Prometheus series with a `stage` label (api/stage_metrics.py), so a remote stage needs no
port of its own. Numbers only: nothing here can carry text or token ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field

FORWARD_KINDS = ("prefill", "decode", "verify")   # what a forward computed
FORWARD_BUCKETS_US = (250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 100_000, 250_000, 1_000_000)
WAIT_BUCKETS_US = (50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 100_000)
STEPS_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)

# name -> bucket bounds, in wire order
HISTOGRAMS: dict[str, tuple[int, ...]] = {
    **{f"forward_us.{kind}": FORWARD_BUCKETS_US for kind in FORWARD_KINDS},  # one op's worker time
    "queue_wait_us": WAIT_BUCKETS_US,   # queued before its forward began
    "batch_steps": STEPS_BUCKETS,       # sessions' steps in one decode/verify forward
}
COUNTERS = (
    *(f"rows.{kind}" for kind in FORWARD_KINDS),  # rows computed: tokens through this stage's layers
    "sessions_opened", "sessions_reclaimed",      # reclaimed: their lane ended without Stop
    "kv_hits", "kv_misses", "kv_disk_hits", "kv_evictions", "kv_rollbacks", "kv_recorded_entries",
    "kv_recorded_bytes", "kv_restore_errors",
)
GAUGES = (
    "active_sessions", "kv_session_bytes",   # KV memory of the open sessions
    "kv_cache_entries", "kv_cache_bytes",    # the prefix cache's memory tier
    "queue_depth",                           # steps waiting for a forward now
    "connections",                           # upstream lanes open on this stage
    "start_time_s",                          # when the process started (unix seconds): a restart moves it
)
METRIC_VALUE_COUNT = len(COUNTERS) + len(GAUGES) + sum(len(b) + 2 for b in HISTOGRAMS.values())


@dataclass(frozen=True, slots=True)
class HistogramValues:
    counts: tuple[int, ...]   # per bucket of HISTOGRAMS[name], plus one above the last bound
    total: int                # sum of the observed values

    @property
    def count(self) -> int:
        return sum(self.counts)

    def since(self, then: HistogramValues) -> HistogramValues:
        """The observations after `then`, an earlier value of the same histogram."""
        return HistogramValues(tuple(a - b for a, b in zip(self.counts, then.counts)), self.total - then.total)


def _zero_histograms() -> dict[str, HistogramValues]:
    return {name: HistogramValues((0,) * (len(bounds) + 1), 0) for name, bounds in HISTOGRAMS.items()}


@dataclass(frozen=True, slots=True)
class StageMetricValues:
    counters: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))
    gauges: dict[str, int] = field(default_factory=lambda: dict.fromkeys(GAUGES, 0))
    histograms: dict[str, HistogramValues] = field(default_factory=_zero_histograms)

    def __post_init__(self) -> None:
        if set(self.counters) != set(COUNTERS) or set(self.gauges) != set(GAUGES):
            raise ValueError("stage metrics: expected exactly the COUNTERS and GAUGES of the layout")
        if set(self.histograms) != set(HISTOGRAMS):
            raise ValueError("stage metrics: expected exactly the HISTOGRAMS of the layout")
        for name, bounds in HISTOGRAMS.items():
            if len(self.histograms[name].counts) != len(bounds) + 1:
                raise ValueError(f"stage metrics: {name} needs {len(bounds) + 1} bucket counts")

    def flat(self) -> list[int]:
        """The wire order: counters, gauges, then each histogram's counts and sum."""
        values = [self.counters[name] for name in COUNTERS] + [self.gauges[name] for name in GAUGES]
        for name in HISTOGRAMS:
            values += [*self.histograms[name].counts, self.histograms[name].total]
        return values

    @classmethod
    def from_flat(cls, values: list[int]) -> StageMetricValues:
        if len(values) != METRIC_VALUE_COUNT:
            raise ValueError(f"stage metrics: expected {METRIC_VALUE_COUNT} values, got {len(values)}")
        at = len(COUNTERS) + len(GAUGES)
        counters = dict(zip(COUNTERS, values[:len(COUNTERS)]))
        gauges = dict(zip(GAUGES, values[len(COUNTERS):at]))
        histograms = {}
        for name, bounds in HISTOGRAMS.items():
            n = len(bounds) + 1
            histograms[name] = HistogramValues(tuple(values[at:at + n]), values[at + n])
            at += n + 1
        return cls(counters, gauges, histograms)
