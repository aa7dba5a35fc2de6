"""`StageMetrics`: this stage's counters and histograms, in the layout the protocol carries.

The runtime records every forward it runs (by kind), its wait in the queue, and how many
steps a decode forward batched; `values()` adds the gauges and the prefix cache's counters.
Like the runtime, it belongs to the stage's engine thread: nothing here locks.
"""

from __future__ import annotations

import bisect
import time

from ..protocol.stage_metrics import COUNTERS, GAUGES, HISTOGRAMS, HistogramValues, StageMetricValues

# prefix-cache stats (StagePrefixCache.stats) -> our counter names
_CACHE_COUNTERS = {"hits": "kv_hits", "misses": "kv_misses", "disk_hits": "kv_disk_hits",
                   "evictions": "kv_evictions", "rollbacks": "kv_rollbacks",
                   "recorded_entries": "kv_recorded_entries", "recorded_bytes": "kv_recorded_bytes",
                   "restore_errors": "kv_restore_errors"}


class StageMetrics:
    def __init__(self) -> None:
        self._counters = dict.fromkeys(COUNTERS, 0)
        self._counts = {name: [0] * (len(bounds) + 1) for name, bounds in HISTOGRAMS.items()}
        self._totals = dict.fromkeys(HISTOGRAMS, 0)
        self.start_time_s = int(time.time())

    def count(self, name: str, n: int = 1) -> None:
        self._counters[name] += n

    def observe(self, name: str, value: int) -> None:
        self._counts[name][bisect.bisect_left(HISTOGRAMS[name], value)] += 1  # bounds are inclusive (le)
        self._totals[name] += value

    def observe_forward(self, kind: str, rows: int, run_s: float, wait_s: float) -> None:
        """A forward of `kind` ran `rows` rows for `run_s` after `wait_s` in the queue."""
        self._counters[f"rows.{kind}"] += rows
        self.observe(f"forward_us.{kind}", int(run_s * 1e6))
        self.observe("queue_wait_us", int(wait_s * 1e6))

    def values(self, gauges: dict[str, int], cache_stats: dict[str, int] | None) -> StageMetricValues:
        """A snapshot: the recorded counters and histograms, the prefix cache's counters and
        the given gauges (every name of GAUGES but start_time_s, which is ours)."""
        counters = dict(self._counters)
        histograms = {name: HistogramValues(tuple(self._counts[name]), self._totals[name]) for name in HISTOGRAMS}
        cache = cache_stats or {}
        for source, name in _CACHE_COUNTERS.items():
            counters[name] = int(cache.get(source, 0))
        all_gauges = {**dict.fromkeys(GAUGES, 0), "kv_cache_entries": int(cache.get("num_entries", 0)),
                      "kv_cache_bytes": int(cache.get("num_bytes", 0)), **gauges,
                      "start_time_s": self.start_time_s}
        return StageMetricValues(counters, all_gauges, histograms)
