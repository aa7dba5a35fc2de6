"""Prefix-cache counters per stage on /metrics (spec §4, §7), read from the backend at scrape time.

    skippy_prefix_cache_chain_restore_hits_total{stage}    restores the chain saw this stage hit
    skippy_prefix_cache_chain_restore_misses_total{stage}  ... and miss (then every stage rolled back)
    skippy_prefix_cache_hits_total{stage}                  lookups served by this stage's cache
    skippy_prefix_cache_misses_total{stage}
    skippy_prefix_cache_evictions_total{stage}             entries dropped from memory
    skippy_prefix_cache_disk_hits_total{stage}             memory misses served from disk
    skippy_prefix_cache_disk_tier_quarantined_total{stage} ... and the rest of StagePrefixCache.stats()
    skippy_prefix_cache_num_entries{stage} / _num_bytes{stage}   gauges

A backend exposes `cache_stats() -> [(stage id, {name: value})]`; stages report what they
know (see ChainBackend.cache_stats).
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

GAUGES = frozenset({"num_entries", "num_bytes", "num_pinned", "num_files"})
Source = Callable[[], list[tuple[str, dict[str, int]]]]


class PrefixCacheCollector:
    def __init__(self, source: Source):
        self.source = source

    def describe(self):
        return []  # values appear at scrape time; nothing to check at registration

    def collect(self):
        families: dict[str, CounterMetricFamily | GaugeMetricFamily] = {}
        for stage, counters in self.source():
            for name, value in counters.items():
                metric = f"skippy_prefix_cache_{name}"
                if metric not in families:
                    is_gauge = name.removeprefix("disk_tier_") in GAUGES
                    cls = GaugeMetricFamily if is_gauge else CounterMetricFamily
                    families[metric] = cls(metric, f"Prefix cache {name.replace('_', ' ')}, per stage",
                                           labels=["stage"])
                families[metric].add_metric([stage], value)
        yield from families.values()
