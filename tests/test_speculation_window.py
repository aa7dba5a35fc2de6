"""The acceptance rule, stops inside a window, the adaptive width and the counters (no torch)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from skippy.runtime.proposers import Proposer
from skippy.runtime.speculation import (
    AdaptiveWindow,
    SpeculationStats,
    Speculator,
    WindowOutcome,
    accept_window,
    settle_window,
)

# (drafts, targets, accepted_count, tokens_to_commit)
ACCEPT_CASES = [
    ([], [7], 0, [7]),  # no drafts: a plain decode step commits the one target
    ([5, 6, 7], [5, 6, 7, 8], 3, [5, 6, 7, 8]),  # all accepted, plus the bonus token
    ([5, 6, 7], [9, 6, 7, 8], 0, [9]),  # the first draft is wrong: only the correction
    ([5, 6, 7], [5, 9, 7, 8], 1, [5, 9]),  # d2 wrong: d1 and the correction t1
    ([5, 6, 7], [5, 6, 9, 8], 2, [5, 6, 9]),  # the last draft wrong
    ([5, 6, 7], [5, 9, 6, 7], 1, [5, 9]),  # later rows agreeing with shifted drafts do not count
    ([4, 4], [4, 4, 4], 2, [4, 4, 4]),  # repeated tokens
]


@pytest.mark.parametrize("drafts, targets, accepted, committed", ACCEPT_CASES)
def test_accept_window(drafts, targets, accepted, committed):
    assert accept_window(drafts, targets) == (accepted, committed)


def test_accept_window_needs_one_target_per_row():
    with pytest.raises(ValueError, match="Expected 3 targets for 2 drafts, got 2"):
        accept_window([1, 2], [1, 2])


# (drafts, targets, stop_ids, max_new_tokens, expected outcome)
SETTLE_CASES = [
    ([5, 6], [5, 6, 8], set(), 10, WindowOutcome(2, 2, [5, 6, 8], False)),  # nothing stops
    ([5, 6], [5, 6, 8], {6}, 10, WindowOutcome(2, 2, [5], True)),  # a stop id among the accepted drafts
    ([5, 6], [5, 6, 8], {8}, 10, WindowOutcome(2, 2, [5, 6], True)),  # the bonus token is the stop
    ([5, 6], [5, 9, 8], {9}, 10, WindowOutcome(2, 1, [5], True)),  # the correction is the stop
    ([5, 6], [5, 9, 8], {8}, 10, WindowOutcome(2, 1, [5, 9], False)),  # a stop in a rejected row is ignored
    ([5, 6], [5, 6, 8], set(), 2, WindowOutcome(2, 2, [5, 6], True)),  # the budget ends inside the window
    ([5, 6], [5, 6, 8], set(), 3, WindowOutcome(2, 2, [5, 6, 8], True)),  # ... or exactly at its end
    ([5, 6], [5, 6, 8], {5}, 1, WindowOutcome(2, 2, [], True)),  # a stop first: nothing emitted
    ([], [7], set(), 1, WindowOutcome(0, 0, [7], True)),  # a plain step that uses the last token
]


@pytest.mark.parametrize("drafts, targets, stop_ids, max_new_tokens, expected", SETTLE_CASES)
def test_settle_window_stops_where_token_by_token_decoding_would(drafts, targets, stop_ids, max_new_tokens, expected):
    assert settle_window(drafts, targets, stop_ids, max_new_tokens) == expected
    # Token by token: emit targets in order until a stop id or the budget.
    reference = []
    for token in targets[: expected.num_accepted + 1]:
        if token in stop_ids or len(reference) == max_new_tokens:
            break
        reference.append(token)
    assert expected.tokens == reference


def test_settle_window_kv_kept():
    assert settle_window([5, 6, 7], [5, 9, 1, 2], set(), 10).num_kv_kept == 2  # current and d1


# (min, max, start, [(num_drafts, num_accepted), ...], widths after each record)
ADAPTIVE_CASES = [
    (1, 4, 2, [(2, 2), (3, 3), (4, 4), (4, 4)], [3, 4, 4, 4]),  # full accepts grow to max and stay
    (1, 8, 8, [(8, 3), (4, 0), (2, 1), (1, 0), (1, 0)], [4, 2, 1, 1, 1]),  # rejections halve down to min
    (2, 6, 4, [(4, 0), (2, 2), (3, 3)], [2, 3, 4]),  # back off, then earn the width back
    (1, 4, 3, [(1, 1), (2, 2)], [3, 3]),  # full accepts of fewer drafts than the width: no growth
    (1, 4, 4, [(0, 0)], [4]),  # an empty proposal changes nothing
]


@pytest.mark.parametrize("min_tokens, max_tokens, start, records, widths", ADAPTIVE_CASES)
def test_adaptive_window(min_tokens, max_tokens, start, records, widths):
    window = AdaptiveWindow(min_tokens, max_tokens, start)
    seen = []
    for num_drafts, num_accepted in records:
        window.record(num_drafts, num_accepted)
        seen.append(window.width)
    assert seen == widths


def test_adaptive_window_counts_grows_and_shrinks():
    window = AdaptiveWindow(1, 4, 2)
    for num_drafts, num_accepted in [(2, 2), (3, 0), (1, 0), (1, 1)]:
        window.record(num_drafts, num_accepted)
    assert (window.num_grows, window.num_shrinks, window.width) == (2, 1, 2)


@pytest.mark.parametrize("args", [(0, 4), (3, 2), (1, 4, 5)])  # min 0; min above max; start outside
def test_adaptive_window_bounds(args):
    with pytest.raises(ValueError, match="Expected"):
        AdaptiveWindow(*args)


def test_stats_count_windows_tokens_and_widths():
    stats = SpeculationStats()
    stats.record(settle_window([5, 6, 7], [5, 6, 7, 8], set(), 10))  # full accept
    stats.record(settle_window([5, 6, 7], [5, 9, 7, 8], set(), 10))  # rejected at position 1
    stats.record(settle_window([], [3], set(), 10))  # nothing proposed
    stats.record(settle_window([4], [4, 2], {2}, 10))  # accepted, then the bonus stops the request
    assert stats.as_dict() == {
        "num_windows": 3,
        "num_proposed_tokens": 7,
        "num_accepted_tokens": 5,
        "num_rejected_tokens": 2,
        "num_full_accept_windows": 2,
        "num_rejected_windows": 1,
        "num_stopped_windows": 1,
        "num_empty_proposals": 1,
        "first_reject_position_sum": 1,
        "propose_seconds": 0.0,
        "verify_seconds": 0.0,
        "acceptance_rate": 5 / 7,
        "width_histogram": {1: 1, 3: 2},
    }
    total = SpeculationStats()
    total += stats
    total += stats
    assert (total.num_windows, total.width_histogram[3], total.acceptance_rate) == (6, 4, 5 / 7)
    assert SpeculationStats().acceptance_rate == 0.0


def test_bookkeeping_imports_no_torch():
    """speculation.py and proposers.py decide; only draft_proposer.py computes (style §5.2)."""
    code = "import sys, skippy.runtime.speculation; assert 'torch' not in sys.modules, 'torch was imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


class Echo(Proposer):
    """Proposes fixed drafts and remembers what it was told."""

    def __init__(self, drafts):
        super().__init__()
        self.drafts = drafts

    def propose(self, max_tokens):
        return self.drafts[:max_tokens] + [99] * 3  # longer than asked: the speculator cuts it


def test_speculator_runs_a_request():
    proposer = Echo([5, 6, 7])
    spec = Speculator(proposer, max_tokens=6, stop_ids={0}, window=AdaptiveWindow(1, 4, 3))
    assert spec.start([1, 2], 4) == [4] and proposer.history == [1, 2, 4]
    assert spec.next_width(num_free=100) == 3  # the window's width
    assert spec.next_width(num_free=3) == 2  # the context: the current token needs a row too
    assert spec.next_width(num_free=100, num_pending=3) == 1  # 6 - 1 emitted - 3 in flight - 1
    drafts = spec.propose(3)
    assert drafts == [5, 6, 7]
    outcome = spec.settle(drafts, [5, 6, 8, 9])  # d3 rejected: commit 5, 6 and the correction 8
    assert (outcome.tokens, outcome.num_kv_kept, spec.current) == ([5, 6, 8], 3, 8)
    assert proposer.history == [1, 2, 4, 5, 6, 8] and spec.num_committed_positions == 5
    assert spec.next_width(num_free=100) == 1  # halved by the rejection, and 2 tokens left
    outcome = spec.settle([3], [3, 2])
    assert outcome.tokens == [3, 2] and spec.finish_reason == "length"
    assert spec.stats.num_proposed_tokens == 4 and spec.stats.num_accepted_tokens == 3


# (max_tokens, first token, drafts, targets, emitted, finish reason)
SPECULATOR_STOP_CASES = [
    (5, 0, None, None, [], "stop"),  # the prefill's token is a stop id
    (1, 4, None, None, [4], "length"),  # the prefill's token uses the whole budget
    (5, 4, [5, 6], [5, 0, 9], [4, 5], "stop"),  # the correction is a stop id
    (5, 4, [5, 6], [5, 6, 7], [4, 5, 6, 7], None),  # nothing stops: 1 token left
    (3, 4, [5, 6], [5, 6, 7], [4, 5, 6], "length"),  # the budget ends inside the window
]


@pytest.mark.parametrize("max_tokens, first, drafts, targets, emitted, reason", SPECULATOR_STOP_CASES)
def test_speculator_stops(max_tokens, first, drafts, targets, emitted, reason):
    spec = Speculator(None, max_tokens, {0})
    out = spec.start([1], first)
    if drafts is not None:
        out += spec.settle(drafts, targets).tokens
    assert (out, spec.finish_reason) == (emitted, reason)
