"""Prometheus metrics for one API server (its own registry, so several apps can share a process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Seconds; TTFT spans queueing and prefill, inter-token one decode step of a batch.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
INTER_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)
WINDOW_WIDTH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 32, 64)  # drafts per verify window


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "skippy_http_requests", "HTTP requests by route and status", ["route", "status"], registry=r
        )
        self.generations = Counter("skippy_generations", "Generations by how they ended", ["outcome"], registry=r)
        self.prompt_tokens = Counter("skippy_prompt_tokens", "Prompt tokens of finished generations", registry=r)
        self.cached_tokens = Counter("skippy_cached_prompt_tokens", "Prompt tokens restored from cache", registry=r)
        self.completion_tokens = Counter("skippy_completion_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram(
            "skippy_time_to_first_token_seconds", "Request arrival to first token", buckets=TTFT_BUCKETS, registry=r
        )
        self.inter_token = Histogram(
            "skippy_inter_token_seconds", "Time between consecutive tokens of a generation",
            buckets=INTER_TOKEN_BUCKETS, registry=r,
        )  # fmt: skip
        self.queue_depth = Gauge("skippy_queue_depth", "Requests waiting for a generation lane", registry=r)
        self.active_generations = Gauge("skippy_active_generations", "Generations holding a lane", registry=r)
        self.stage_sessions = Gauge(
            "skippy_stage_active_sessions", "Sessions open on each stage", ["stage"], registry=r
        )
        self.stage_up = Gauge("skippy_stage_up", "1 when the stage is ready", ["stage"], registry=r)
        self.recoveries = Counter(
            "skippy_chain_recoveries", "Generations replayed onto a chain made whole again", registry=r
        )
        self.stage_restarts = Gauge(
            "skippy_stage_restarts", "Times the supervisor restarted the stage (it only grows)", ["stage"], registry=r
        )
        self.speculative_tokens = Counter(
            "skippy_speculative_draft_tokens", "Draft tokens verified, by outcome (proposed, accepted, rejected)",
            ["outcome"], registry=r,
        )  # fmt: skip
        self.speculative_windows = Counter(
            "skippy_speculative_windows", "Verify windows, by outcome (full_accept, rejected, stale)",
            ["outcome"], registry=r,
        )  # fmt: skip
        self.speculative_window_width = Histogram(
            "skippy_speculative_window_width", "Drafts per verify window", buckets=WINDOW_WIDTH_BUCKETS, registry=r
        )

    def observe_speculation(self, figures: dict) -> None:
        """Count one generation's speculation figures (ChainDecoder.report, in `timings`)."""
        if "speculative_num_windows" not in figures:
            return
        for outcome in ("proposed", "accepted", "rejected"):
            self.speculative_tokens.labels(outcome).inc(figures[f"speculative_num_{outcome}_tokens"])
        self.speculative_windows.labels("full_accept").inc(figures["speculative_num_full_accept_windows"])
        self.speculative_windows.labels("rejected").inc(figures["speculative_num_rejected_windows"])
        self.speculative_windows.labels("stale").inc(figures.get("speculative_stale_windows", 0))
        for width, count in figures.get("speculative_width_histogram", {}).items():
            for _ in range(count):
                self.speculative_window_width.observe(width)

    def render(self) -> bytes:
        return generate_latest(self.registry)
