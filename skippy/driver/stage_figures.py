"""Per-stage figures for a live view (`/v1/stages`): rates and means from two metric samples.

A stage reports only totals; stage 0 keeps, per stage, a sample at least RATE_WINDOW_S old and
computes each rate since it, so any poller sees rates over the last few seconds however often
it asks.
"""

from __future__ import annotations

import time

from ..protocol.stage_metrics import StageMetricValues

RATE_WINDOW_S = 2.0


def _decode_rows(m: StageMetricValues) -> int:
    return m.counters["rows.decode"] + m.counters["rows.verify"]


def _mean_ms(now: StageMetricValues, then: StageMetricValues | None, name: str) -> float:
    h = now.histograms[name]
    if then is not None and h.count > then.histograms[name].count:  # the window's mean, when it saw any
        h = h.since(then.histograms[name])
    return h.total / h.count / 1e3 if h.count else 0.0


def _cpu_ms_per_token(now: StageMetricValues, then: StageMetricValues | None, cpu_ns: int, then_cpu: int) -> float:
    tokens = _decode_rows(now) - (_decode_rows(then) if then is not None else 0)
    return (cpu_ns - then_cpu) / 1e6 / tokens if then is not None and cpu_ns and then_cpu and tokens > 0 else 0.0


class StageFigures:
    def __init__(self) -> None:
        self._samples: dict[str, list[tuple[float, StageMetricValues]]] = {}  # oldest first, at most 2

    def window_start(self, stage_id: str) -> StageMetricValues | None:
        """The sample this stage's figures are taken since (None before the first)."""
        samples = self._samples.get(stage_id)
        return samples[0][1] if samples else None

    def figures(self, stage_id: str, metrics: StageMetricValues, cpu_ns: int = 0, **extra: float) -> dict[str, float]:
        """`cpu_ns`: the stage process's CPU time so far (its probe's clock; 0: unknown)."""
        now = time.monotonic()
        samples = self._samples.setdefault(stage_id, [])
        if metrics.gauges["start_time_s"] != (samples[-1][1].gauges["start_time_s"] if samples else None):
            samples.clear()  # a restarted stage counts from zero again
        then_t, then, then_cpu = samples[0] if samples else (now, None, 0)
        if not samples or now - samples[-1][0] >= RATE_WINDOW_S:
            samples.append((now, metrics, cpu_ns))
            del samples[:-2]
        elapsed = now - then_t
        rate = (lambda a, b: (a - b) / elapsed) if then is not None and elapsed > 0 else (lambda a, b: 0.0)
        c, g = metrics.counters, metrics.gauges
        lookups = c["kv_hits"] + c["kv_misses"]
        return {
            "tokens_per_s": rate(_decode_rows(metrics), _decode_rows(then) if then else 0),
            "prefill_tokens_per_s": rate(c["rows.prefill"], then.counters["rows.prefill"] if then else 0),
            "decode_forward_ms": _mean_ms(metrics, then, "forward_us.decode"),
            "verify_forward_ms": _mean_ms(metrics, then, "forward_us.verify"),
            "prefill_forward_ms": _mean_ms(metrics, then, "forward_us.prefill"),
            "queue_wait_ms": _mean_ms(metrics, then, "queue_wait_us"),
            "queue_depth": g["queue_depth"],
            "prefix_cache_hit_rate": c["kv_hits"] / lookups if lookups else 0.0,
            "kv_session_bytes": g["kv_session_bytes"], "kv_cache_bytes": g["kv_cache_bytes"],
            "decoded_tokens_total": _decode_rows(metrics), "prefilled_tokens_total": c["rows.prefill"],
            # the CPU a decoded token cost the stage over the window: its forward and all around it
            "cpu_ms_per_token": _cpu_ms_per_token(metrics, then, cpu_ns, then_cpu),
            **extra,
        }
