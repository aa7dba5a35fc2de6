"""Speculative decoding bookkeeping: verify windows, acceptance, window width, counters.

Pure Python (no torch): stage 0 decides here, the model computes elsewhere.
The proposers that fill a window live in `proposers.py`; spec §5.

A verify window (spec §5.3) is the committed current token `c` followed by the
proposer's drafts, run through the model in one forward at the committed position:

    rows:     c    d1   d2   ...  dn
    targets:  t0   t1   t2   ...  tn     (the request's sampler, one token per row)

Row i's target t(i) is what the model picks after c, d1..di, so draft d(i+1) is
right exactly when d(i+1) == t(i).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field, replace

from .proposers import Proposer, available_proposers, create_proposer  # noqa: F401  (re-exported)


def accept_window(drafts: Sequence[int], targets: Sequence[int]) -> tuple[int, list[int]]:
    """(accepted_count, tokens_to_commit) for one verify window: drafts d1..dn, targets t0..tn.

    Every committed token is a target sample conditioned on committed tokens only,
    so the output follows the target's distribution for any proposer and any
    sampler (and greedy output is unchanged). gpt-fast's q/p rejection sampling
    accepts more often when sampling, but needs the draft's probabilities, which
    n-gram proposers do not have.
    """
    if len(targets) != len(drafts) + 1:
        raise ValueError(f"Expected {len(drafts) + 1} targets for {len(drafts)} drafts, got {len(targets)}")
    # The acceptance rule (exact match, spec §5.3 step 5):
    # a = the longest prefix where d(i+1) == t(i): the drafts the target agrees with
    # commit t0..ta: the accepted drafts, then t(a), which is the target's correction
    #   at the first mismatch or, when every draft matched, a bonus token
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == targets[accepted]:
        accepted += 1
    return accepted, list(targets[: accepted + 1])


@dataclass(frozen=True, slots=True)
class WindowOutcome:
    """What one verified window does to the request."""

    num_drafts: int
    num_accepted: int  # drafts the target agreed with
    tokens: list[int]  # to emit, in order: cut before a stop id and at the token budget
    is_stopped: bool  # a stop id or the token budget ended the request inside this window

    @property
    def num_kv_kept(self) -> int:
        """Rows of the window whose KV stays valid: c and the accepted drafts.

        The session is trimmed to pos_start + num_kv_kept; the last committed token
        is the next window's current token and has no KV yet."""
        return self.num_accepted + 1


def settle_window(
    drafts: Sequence[int],
    targets: Sequence[int],
    stop_ids: Collection[int],
    max_new_tokens: int,
) -> WindowOutcome:
    """Accept by the rule, then stop exactly where token-by-token decoding would.

    A stop id ends the request and is not emitted; `max_new_tokens` is how many more
    tokens the request may emit. Tokens past either are dropped, never emitted.
    """
    if max_new_tokens < 1:
        raise ValueError(f"Expected max_new_tokens >= 1, got {max_new_tokens}")
    num_accepted, committed = accept_window(drafts, targets)
    tokens: list[int] = []
    for token in committed:
        if token in stop_ids:
            return WindowOutcome(len(drafts), num_accepted, tokens, True)
        tokens.append(token)
        if len(tokens) == max_new_tokens:
            return WindowOutcome(len(drafts), num_accepted, tokens, True)
    return WindowOutcome(len(drafts), num_accepted, tokens, False)


class AdaptiveWindow:
    """The number of drafts to verify next, within [min_tokens, max_tokens]: +1 after a full
    window all accepted, halved after any rejection, so it backs off fast when a proposer
    starts guessing wrong. A window the proposer could not fill does not grow it.
    """

    def __init__(self, min_tokens: int = 1, max_tokens: int = 4, start: int | None = None):
        if not 0 < min_tokens <= max_tokens:
            raise ValueError(f"Expected 0 < min_tokens <= max_tokens, got {min_tokens} and {max_tokens}")
        start = max_tokens if start is None else start
        if not min_tokens <= start <= max_tokens:
            raise ValueError(f"Expected a start width in [{min_tokens}, {max_tokens}], got {start}")
        self.min_tokens, self.max_tokens = min_tokens, max_tokens
        self.width = self.start = start
        self.num_grows = self.num_shrinks = 0

    def record(self, num_drafts: int, num_accepted: int) -> None:
        if num_accepted < num_drafts:
            width = max(self.min_tokens, self.width // 2)
            self.num_shrinks += width < self.width
            self.width = width
        elif num_drafts >= self.width and self.width < self.max_tokens:
            self.width += 1
            self.num_grows += 1


@dataclass(slots=True)
class SpeculationStats:
    """Per-request acceptance counters (spec §5.4), summable across requests with `+=`."""

    num_windows: int = 0  # verify windows with at least one draft
    num_proposed_tokens: int = 0
    num_accepted_tokens: int = 0
    num_rejected_tokens: int = 0  # drafts past the first mismatch count as rejected too
    num_full_accept_windows: int = 0
    num_rejected_windows: int = 0
    num_stopped_windows: int = 0  # a stop or the token budget ended the request inside the window
    num_empty_proposals: int = 0  # the proposer had nothing; the step decoded one token
    first_reject_position_sum: int = 0
    propose_seconds: float = 0.0
    verify_seconds: float = 0.0
    width_histogram: Counter[int] = field(default_factory=Counter)  # drafts per window -> windows

    def record(self, outcome: WindowOutcome) -> None:
        if outcome.num_drafts == 0:
            self.num_empty_proposals += 1
            return
        self.num_windows += 1
        self.width_histogram[outcome.num_drafts] += 1
        self.num_proposed_tokens += outcome.num_drafts
        self.num_accepted_tokens += outcome.num_accepted
        self.num_rejected_tokens += outcome.num_drafts - outcome.num_accepted
        if outcome.num_accepted == outcome.num_drafts:
            self.num_full_accept_windows += 1
        else:
            self.num_rejected_windows += 1
            self.first_reject_position_sum += outcome.num_accepted
        self.num_stopped_windows += outcome.is_stopped

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts / proposed drafts; 0.0 before any draft."""
        return self.num_accepted_tokens / self.num_proposed_tokens if self.num_proposed_tokens else 0.0

    @property
    def mean_accepted_per_window(self) -> float:
        return self.num_accepted_tokens / self.num_windows if self.num_windows else 0.0

    def __iadd__(self, other: SpeculationStats) -> SpeculationStats:
        for name in self.__slots__:
            if name != "width_histogram":
                setattr(self, name, getattr(self, name) + getattr(other, name))
        self.width_histogram.update(other.width_histogram)
        return self

    def as_dict(self) -> dict[str, float | int | dict[int, int]]:
        """Flat numbers for `timings`, /metrics and telemetry (no token ids, no text)."""
        out: dict[str, float | int | dict[int, int]] = {
            name: getattr(self, name) for name in self.__slots__ if name != "width_histogram"
        }
        out["acceptance_rate"] = self.acceptance_rate
        out["width_histogram"] = dict(sorted(self.width_histogram.items()))
        return out


MAX_PIPELINE_DEPTH = 64  # spec §5.1: the hard cap on verify windows in flight
MAX_WINDOW_TOKENS = 64   # drafts per window; a wider window only wastes rows when it misses


@dataclass(frozen=True, slots=True)
class SpeculativeSettings:
    """How one request speculates (spec §5.1): the proposer and the verify window.

    `mode` is a registered proposer name or "off". The window carries between
    `min_window` and `max_window` drafts (adaptive in between); `pipeline_depth`
    windows may be in flight at once on a chain.
    """

    mode: str = "off"
    min_window: int = 1
    max_window: int = 4
    pipeline_depth: int = 1

    def __post_init__(self) -> None:
        modes = ["off", *available_proposers()]
        if self.mode not in modes:
            raise ValueError(f"Expected a speculative mode in {modes}, got {self.mode!r}")
        if not 0 < self.min_window <= self.max_window <= MAX_WINDOW_TOKENS:
            raise ValueError(f"Expected 0 < min_window <= max_window <= {MAX_WINDOW_TOKENS}, "
                             f"got {self.min_window} and {self.max_window}")
        if not 0 < self.pipeline_depth <= MAX_PIPELINE_DEPTH:
            raise ValueError(f"Expected a pipeline depth in [1, {MAX_PIPELINE_DEPTH}], got {self.pipeline_depth}")

    @property
    def is_enabled(self) -> bool:
        return self.mode != "off"

    def override(self, **fields) -> SpeculativeSettings:
        """These settings with a request's `fields` over them; one window bound given alone
        moves the other when it must (ValueError for what cannot run)."""
        if "min_window" in fields and "max_window" not in fields:
            fields["max_window"] = max(self.max_window, fields["min_window"])
        if "max_window" in fields and "min_window" not in fields:
            fields["min_window"] = min(self.min_window, fields["max_window"])
        return replace(self, **fields)

    def proposer_options(self) -> dict[str, int]:
        """Options for the n-gram proposers: a budget that can fill every window in flight."""
        if self.mode.startswith("ngram"):
            return {"max_proposal_tokens": max(16, self.pipeline_depth * (self.max_window + 1))}
        return {}


class Speculator:
    """One request's speculation state: committed history, proposals, settled windows, stops.

    The model-side loop (local_speculative.py, or the chain's driver/decoder.py) owns the KV
    cache and the forwards; this owns the rest, so both decide acceptance and stops with the
    same code. `proposer` None never proposes: every step is a one-row window.
    """

    def __init__(self, proposer: Proposer | None, max_tokens: int, stop_ids: Collection[int],
                 window: AdaptiveWindow | None = None, stats: SpeculationStats | None = None):
        self.proposer = proposer
        self.max_tokens, self.stop_ids = max_tokens, stop_ids
        self.window = window or AdaptiveWindow()
        self.stats = stats if stats is not None else SpeculationStats()
        self.history: list[int] = []  # prompt + every committed token; ends with the current token
        self.num_emitted = 0
        self.finish_reason: str | None = None  # "stop" (a stop id) or "length" (max_tokens)

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def current(self) -> int:
        """The last committed token: the next window's first row."""
        return self.history[-1]

    @property
    def num_committed_positions(self) -> int:
        """Positions whose KV every stage keeps: all of the history but the current token."""
        return len(self.history) - 1

    def start(self, prompt: Sequence[int], first_token: int) -> list[int]:
        """Take the prefill's prediction; returns it to emit, or [] when it is a stop id."""
        if self.max_tokens < 1:
            self.finish_reason = "length"
            return []
        if first_token in self.stop_ids:
            self.finish_reason = "stop"
            return []
        self.history = [*prompt, first_token]
        self.num_emitted = 1
        if self.num_emitted >= self.max_tokens:
            self.finish_reason = "length"
        if self.proposer is not None:
            self.proposer.reset(self.history)
        return [first_token]

    def next_width(self, num_free: int, num_pending: int = 0) -> int:
        """Drafts the next window may carry: the adaptive width, bounded so the window never
        yields past max_tokens (n drafts yield up to n + 1 tokens) or writes past the context.

        `num_free`: positions from the window's first row to the context end.
        `num_pending`: tokens that windows already in flight may yield before this one."""
        budget = self.max_tokens - self.num_emitted - num_pending - 1
        return max(0, min(self.window.width, budget, num_free - 1))

    def propose(self, num_tokens: int) -> list[int]:
        """Up to `num_tokens` guesses for the tokens after the committed history."""
        if self.proposer is None or num_tokens <= 0:
            return []
        started = time.perf_counter()
        drafts = self.proposer.propose(num_tokens)[:num_tokens]
        self.stats.propose_seconds += time.perf_counter() - started
        return drafts

    def settle(self, drafts: Sequence[int], targets: Sequence[int]) -> WindowOutcome:
        """Resolve the window [current, *drafts]: accept, stop, count, and commit."""
        outcome = settle_window(drafts, targets, self.stop_ids, self.max_tokens - self.num_emitted)
        self.stats.record(outcome)
        if drafts:
            self.window.record(outcome.num_drafts, outcome.num_accepted)
        self.num_emitted += len(outcome.tokens)
        self.history.extend(outcome.tokens)
        if outcome.is_stopped:
            self.finish_reason = "length" if self.num_emitted >= self.max_tokens else "stop"
        elif self.proposer is not None:
            self.proposer.commit(outcome.tokens)
        return outcome

    def summary(self) -> dict[str, float | int | str]:
        """Flat figures for `timings`, /metrics and telemetry: the stats plus the window's widths."""
        stats, window = self.stats, self.window
        out: dict[str, float | int | str] = {
            f"speculative_{name}": value for name, value in stats.as_dict().items()
            if name != "width_histogram"
        }
        out.update({
            "draft_n": stats.num_proposed_tokens,  # llama-server's names
            "draft_n_accepted": stats.num_accepted_tokens,
            "speculative_window_start": window.start,
            "speculative_window_final": window.width,
            "speculative_window_min": window.min_tokens,
            "speculative_window_max": window.max_tokens,
            "speculative_window_grows": window.num_grows,
            "speculative_window_shrinks": window.num_shrinks,
            "speculative_mean_window": (stats.num_proposed_tokens / stats.num_windows
                                        if stats.num_windows else 0.0),
        })
        return out
