"""Stage 0's decode loop for one request, on its engine: token by token, or in speculative verify windows.

With speculation (spec §5.3) stage 0 sends `VerifyWindow [current, d1..dn]` at the committed
position; the final stage samples a target for every row, and `speculation.Speculator` (the
one stop and acceptance rule, shared with the one-process loop) keeps the longest matching
prefix plus one token. Rejected rows are cut on every stage by the next message's `pos_start`.
The loop runs on the engine thread, so no step waits for the event loop, which only hears
the tokens to emit.

Pipelined windows (`pipeline_depth` > 1): while window k is in flight, window k+1 goes at
P + len(window k), its first row the proposer's guess for k's bonus token, so stage 0
computes k+1 while the stages below compute k. It stays valid only if k was accepted in full
with that bonus; otherwise every window in flight is discarded (`DiscardStaleWindows`).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from ..protocol import StageReply
from ..protocol.logprobs import TokenLogprob
from ..runtime.proposers import Proposer
from ..runtime.speculation import AdaptiveWindow, SpeculationStats, SpeculativeSettings, Speculator
from ..telemetry import Telemetry
from .slot import Slot

RETIRE_ALL = 1 << 30  # a RetireVerifyWindow count that covers every window based at or after a position
Emitted = tuple[int, TokenLogprob | None]  # a token and its logprob entry (None: none asked for)
DONE = None  # the last event of a decode loop that ended by its rules (an Exception: it failed)


def paired(tokens: Sequence[int], logprobs: Sequence[TokenLogprob] | None) -> list[Emitted]:
    """The tokens a prediction's rows emit, in row order, each with its row's entry."""
    if logprobs is None:
        return [(token, None) for token in tokens]
    assert all(entry.token == token for token, entry in zip(tokens, logprobs))
    return list(zip(tokens, logprobs))


@dataclass(frozen=True, slots=True)
class _Window:
    window_id: int
    base: int          # its first row's position
    tokens: list[int]  # [first row, drafts...]; the first row is the current token or a guess
    sent_at: float


class ChainDecoder:
    """Decode after the prefill until a stop id, max_tokens or the context end
    (`finish_reason`: "stop", "length" or "context"); each token comes with its row's logprob
    entry (None when the request asked for none)."""

    def __init__(self, *, max_tokens: int, stop_ids: Collection[int], ctx_size: int,
                 proposer: Proposer | None = None, settings: SpeculativeSettings = SpeculativeSettings()):
        if (proposer is None) == settings.is_enabled:
            raise ValueError(f"Expected a proposer exactly when speculation is on, got mode "
                             f"{settings.mode!r} and proposer {proposer!r}")
        self.ctx_size, self.settings = ctx_size, settings
        self.pipeline_depth = 1
        self.stats = SpeculationStats()
        self.spec = Speculator(proposer, max_tokens, stop_ids,
                               AdaptiveWindow(settings.min_window, settings.max_window), self.stats)
        self.finish_reason: str | None = None
        self.num_stale_windows = 0
        self._next_window_id = 1
        self._slot: Slot | None = None
        self._emit: Callable[[list[Emitted] | Exception | None], None] | None = None
        self._inflight: deque[_Window] = deque()

    # -- on the event loop, before and after ------------------------------------------------------
    @property
    def is_started(self) -> bool:
        """The prefill's token is in: there is a committed history to continue from."""
        return bool(self.spec.history) or self.spec.is_finished

    def replay_tokens(self) -> list[int]:
        """What a fresh session prefills to continue where a broken one stopped: the prompt and
        every committed token, ending with the current one (whose prediction comes next)."""
        return list(self.spec.history)

    def report(self, telemetry: Telemetry) -> dict:
        """Log and count the request's speculation summary; returns it with the window-width
        histogram ({} without speculation)."""
        if not self.settings.is_enabled:
            return {}
        summary = {"speculative_mode": self.settings.mode, "speculative_pipeline_depth": self.pipeline_depth,
                   "speculative_stale_windows": self.num_stale_windows, **self.spec.summary()}
        telemetry.summary("stage0.speculation_summary", **summary)
        stats = self.stats
        for name, value in (("windows", stats.num_windows),
                            ("proposed_tokens", stats.num_proposed_tokens),
                            ("accepted_tokens", stats.num_accepted_tokens),
                            ("rejected_tokens", stats.num_rejected_tokens),
                            ("stale_windows", self.num_stale_windows)):
            if value:
                telemetry.count(f"stage0.speculative.{name}", value)
        return {**summary, "speculative_width_histogram": dict(sorted(stats.width_histogram.items()))}

    # -- on the engine -----------------------------------------------------------------------------
    def start(self, slot: Slot, emit, prompt: Sequence[int], first: StageReply) -> None:
        """Decode from the prefill's prediction `first`; `emit(tokens)` for each batch of tokens
        to emit, then `emit(DONE)` (or `emit(error)`)."""
        self._run(slot, emit, paired(self.spec.start(prompt, first.predicted), first.logprobs))

    def resume(self, slot: Slot, emit, first: StageReply) -> None:
        """Go on decoding on `slot`, which has prefilled `replay_tokens()` and predicted `first`.
        Windows that were in flight are gone; the proposer proposes again."""
        self._run(slot, emit, paired(self.spec.settle([], [first.predicted]).tokens, first.logprobs))

    def _run(self, slot: Slot, emit, emitted: list[Emitted]) -> None:
        self._slot, self._emit = slot, emit
        # Windows overlap only while stages below compute one and stage 0 the next.
        self.pipeline_depth = self.settings.pipeline_depth if slot.link.stages_below else 1
        self._inflight.clear()
        slot.on_failure = self._end
        if emitted:
            emit(emitted)
        self._advance()

    def _advance(self) -> None:
        """Send what the loop may: a verify window whenever the proposer has drafts (none
        without speculation), else one plain step of the current token."""
        spec, slot, inflight = self.spec, self._slot, self._inflight
        if slot is None:
            return
        if spec.is_finished:
            return self._end(DONE)
        while len(inflight) < self.pipeline_depth:
            window = self._plan()
            if window is None:
                break
            inflight.append(window)
            slot.verify(window.tokens, window.window_id, window.base,
                        lambda reply, window=window: self._verified(window, reply))
            if self._slot is None:  # the send failed the request
                return
        if not inflight:  # nothing to propose: one plain decode step
            position = spec.num_committed_positions
            if position + 1 > self.ctx_size:
                self.finish_reason = "context"
                return self._end(DONE)
            sent_at = time.perf_counter()
            slot.decode(spec.current, position, lambda reply: self._decoded(reply, sent_at))

    def _decoded(self, reply: StageReply | Exception, sent_at: float) -> None:
        if isinstance(reply, Exception) or self._slot is None:
            return  # the slot's failure ends the loop (on_failure)
        self.stats.verify_seconds += time.perf_counter() - sent_at
        self._emit(paired(self.spec.settle([], [reply.predicted_tokens[0]]).tokens, reply.logprobs))
        self._advance()

    def _verified(self, window: _Window, reply: StageReply | Exception) -> None:
        if isinstance(reply, Exception) or self._slot is None:
            return
        spec, slot, inflight = self.spec, self._slot, self._inflight
        assert inflight and inflight[0] is window, "verify windows are answered in order"
        inflight.popleft()
        self.stats.verify_seconds += time.perf_counter() - window.sent_at
        assert window.tokens[0] == spec.current and window.base == spec.num_committed_positions
        outcome = spec.settle(window.tokens[1:], reply.predicted_tokens)
        if spec.is_finished:
            # Stop ends the session on every stage (no retirement needed); the final stage
            # need not sample what is still in flight.
            if inflight:
                slot.discard(inflight[0].window_id, inflight[-1].window_id)
        elif inflight and (outcome.num_accepted < outcome.num_drafts or inflight[0].tokens[0] != spec.current):
            self.num_stale_windows += len(inflight)
            slot.discard(inflight[0].window_id, inflight[-1].window_id)
            slot.retire(window.base, RETIRE_ALL)  # this window and the stale ones
            inflight.clear()
        else:  # no later window is based at window.base
            slot.retire(window.base, 1)
        if outcome.tokens:
            self._emit(paired(outcome.tokens, reply.logprobs))
        self._advance()

    def _plan(self) -> _Window | None:
        """The next window to send (None: nothing proposed, or no room): [current, d1..dn] at the
        committed position, or behind windows in flight [guess for the last one's bonus, d...]."""
        spec, inflight = self.spec, self._inflight
        if not inflight:
            base = spec.num_committed_positions
            width = spec.next_width(self.ctx_size - base)
            drafts = spec.propose(width) if width > 0 else []
            if not drafts:
                return None
            return self._window(base, [spec.current, *drafts])
        # Tokens already riding on the windows in flight, after the current one.
        pending = [*inflight[0].tokens[1:], *(t for w in list(inflight)[1:] for t in w.tokens)]
        last = inflight[-1]
        base = last.base + len(last.tokens)
        num_yield = sum(len(w.tokens) for w in inflight)  # what they yield if all is accepted
        width = spec.next_width(self.ctx_size - base, num_yield)
        if width < 1:
            return None
        proposal = spec.propose(len(pending) + 1 + width)
        if len(proposal) < len(pending) + 2 or proposal[:len(pending)] != pending:
            return None  # the proposer no longer continues what is in flight
        return self._window(base, proposal[len(pending):])

    def _window(self, base: int, tokens: list[int]) -> _Window:
        window = _Window(self._next_window_id, base, tokens, time.perf_counter())
        self._next_window_id += 1
        return window

    def _end(self, outcome: Exception | None) -> None:
        slot = self._slot
        if slot is None:
            return
        self._slot = None
        slot.on_failure = None
        self.finish_reason = self.finish_reason or self.spec.finish_reason
        self._emit(outcome)
