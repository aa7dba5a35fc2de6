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

from collections import Counter
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

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
    """The number of drafts to verify next: grows after full accepts, shrinks after rejections.

    Additive increase (+1 after a window whose drafts filled the width and were all
    accepted) and multiplicative decrease (halved after any rejection), kept within
    [min_tokens, max_tokens]. Halving backs off quickly when a proposer starts
    guessing wrong, and the +1 steps earn the width back one success at a time.
    A window the proposer could not fill says nothing about a wider one, so a full
    accept of fewer drafts than the width does not grow it.
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
