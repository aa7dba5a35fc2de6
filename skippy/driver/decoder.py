"""Stage 0's decode loop on a `ChainSession`: token by token, or in speculative verify windows.

Without speculation every token is one `DecodeEmbd` trip through the chain. With
it (spec §5.3), stage 0 proposes drafts from the committed tokens and sends
`VerifyWindow [current, d1..dn]` at the committed position P; the final stage
samples a target for every row with the request's sampler, and stage 0 keeps the
longest prefix where draft == target plus one correction or bonus token
(`speculation.Speculator`, the same code as the one-process loop). The rows it
rejects are cut on every stage by the next message's authoritative `pos_start`
(auto-align); the window's checkpoints are then retired.

Pipelined windows (`pipeline_depth` > 1). While window k is in flight, stage 0
may send window k+1 at P + len(window k), whose first row is the proposer's guess
for window k's bonus token. The proposer still sees only committed tokens: a
run-ahead window is the tail of a proposal that must begin with the tokens already
in flight, so stage 0 computes window k+1 while the stages below compute window
k. Replies are resolved in order. Window k+1 stays valid only if window k was
accepted in full and its bonus equals k+1's first row; otherwise every window
still in flight is stale: `DiscardStaleWindows` (the final stage skips them) and
the next window rewinds every stage with its `pos_start`.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import AsyncIterator, Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..protocol.logprobs import TokenLogprob
from ..runtime.proposers import Proposer
from ..runtime.speculation import AdaptiveWindow, SpeculationStats, SpeculativeSettings, Speculator
from ..telemetry import Telemetry
from .run_ahead import DecodePlan

if TYPE_CHECKING:
    from .session import ChainSession

RETIRE_ALL = 1 << 30  # a RetireVerifyWindow count that covers every window based at or after a position
Emitted = tuple[int, TokenLogprob | None]  # a token and its logprob entry (None: none asked for)


def _paired(tokens: Sequence[int], logprobs: Sequence[TokenLogprob] | None) -> list[Emitted]:
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


class ChainDecoder:
    """Decode after the prefill until a stop id, max_tokens or the context end.

        decoder = ChainDecoder(session, max_tokens=64, stop_ids=eog, ctx_size=2048,
                               proposer=create_proposer("ngram-suffix"), settings=settings)
        async for token, logprob in decoder.tokens(prompt_ids, first_token): ...
        decoder.finish_reason   # "stop", "length" or "context"

    Each token comes with its logprob entry (None when the request asked for none): the
    final stage returns one per predicted row, and an emitted token is always the target
    of its row (a plain step's only row, or a verify window's row i for its i-th token).
    """

    def __init__(self, session: ChainSession, *, max_tokens: int, stop_ids: Collection[int],
                 ctx_size: int, proposer: Proposer | None = None,
                 settings: SpeculativeSettings = SpeculativeSettings()):
        if (proposer is None) == settings.is_enabled:
            raise ValueError(f"Expected a proposer exactly when speculation is on, got mode "
                             f"{settings.mode!r} and proposer {proposer!r}")
        self.session, self.ctx_size, self.settings = session, ctx_size, settings
        # Windows overlap only while stages below compute one and stage 0 the next.
        self.pipeline_depth = settings.pipeline_depth if session.link.stages_below else 1
        self.stats = SpeculationStats()
        self.spec = Speculator(proposer, max_tokens, stop_ids,
                               AdaptiveWindow(settings.min_window, settings.max_window), self.stats)
        self.finish_reason: str | None = None
        self.num_stale_windows = 0
        self._is_heavy = proposer is not None and proposer.name == "draft"  # a model forward
        self._next_window_id = 1

    async def tokens(self, prompt: Sequence[int], first_token: int) -> AsyncIterator[Emitted]:
        """The tokens to emit, in order, starting with the prefill's `first_token`."""
        for emitted in _paired(self.spec.start(prompt, first_token), self.session.last_logprobs):
            yield emitted
        async for emitted in self._steps():  # none when the first token already ended it
            yield emitted
        self.finish_reason = self.finish_reason or self.spec.finish_reason

    @property
    def is_started(self) -> bool:
        """The prefill's token is in: there is a committed history to continue from."""
        return bool(self.spec.history) or self.spec.is_finished

    def replay_tokens(self) -> list[int]:
        """What a fresh session prefills to continue where a broken one stopped: the prompt
        and every committed token, ending with the current one (its prediction is the next
        token, as the interrupted step would have returned)."""
        return list(self.spec.history)

    async def resume(self, session: ChainSession, next_token: int) -> AsyncIterator[Emitted]:
        """Go on decoding on `session`, which has prefilled `replay_tokens()` and predicted
        `next_token`. Windows that were in flight are gone; the proposer proposes again."""
        self.session = session
        for emitted in _paired(self.spec.settle([], [next_token]).tokens, session.last_logprobs):
            yield emitted
        async for emitted in self._steps():
            yield emitted
        self.finish_reason = self.finish_reason or self.spec.finish_reason

    async def _steps(self) -> AsyncIterator[Emitted]:
        """The one decode loop: a verify window whenever the proposer has drafts (none without
        speculation), else one plain step of the current token."""
        spec, session = self.spec, self.session
        if not self.settings.is_enabled:  # every step a plain one: stage 0's worker may run it ahead
            session.enable_run_ahead(DecodePlan(spec.stop_ids, spec.max_tokens, self.ctx_size))
        inflight: deque[_Window] = deque()
        while not spec.is_finished:
            while len(inflight) < self.pipeline_depth:
                window = await self._plan(inflight)
                if window is None:
                    break
                started = time.perf_counter()
                await session.submit_verify(window.tokens, window.window_id, pos_start=window.base)
                self.stats.verify_seconds += time.perf_counter() - started
                inflight.append(window)
            if not inflight:  # nothing to propose: one plain decode step
                position = spec.num_committed_positions
                if position + 1 > self.ctx_size:
                    self.finish_reason = "context"
                    return
                started = time.perf_counter()
                token = await session.decode(spec.current, pos_start=position, emitted=spec.num_emitted)
                self.stats.verify_seconds += time.perf_counter() - started
                for emitted in _paired(spec.settle([], [token]).tokens, session.last_logprobs):
                    yield emitted
                continue
            window = inflight.popleft()
            started = time.perf_counter()
            targets = await session.wait_window(window.window_id)
            logprobs = session.last_logprobs
            self.stats.verify_seconds += time.perf_counter() - started
            assert window.tokens[0] == spec.current and window.base == spec.num_committed_positions
            outcome = spec.settle(window.tokens[1:], targets)
            if spec.is_finished:
                # Stop ends the session on every stage (no retirement needed); the final
                # stage need not sample what is still in flight.
                if inflight:
                    await session.discard_windows(inflight[0].window_id, inflight[-1].window_id)
            elif inflight and (outcome.num_accepted < outcome.num_drafts
                               or inflight[0].tokens[0] != spec.current):
                self.num_stale_windows += len(inflight)
                await session.discard_windows(inflight[0].window_id, inflight[-1].window_id)
                await session.retire(window.base, RETIRE_ALL)  # this window and the stale ones
                inflight.clear()
            else:  # no later window is based at window.base: stage 0 need not wait
                await session.retire(window.base, 1, wait=False)
            for emitted in _paired(outcome.tokens, logprobs):
                yield emitted

    async def _plan(self, inflight: deque[_Window]) -> _Window | None:
        """The next window to send, or None: nothing proposed, or no room left for one.

        With no window in flight it is [current, d1..dn] at the committed position. Behind
        windows in flight it continues their tokens: [guess for the last one's bonus, d...]."""
        spec = self.spec
        if not inflight:
            base = spec.num_committed_positions
            width = spec.next_width(self.ctx_size - base)
            drafts = await self._propose(width)
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
        proposal = await self._propose(len(pending) + 1 + width)
        if len(proposal) < len(pending) + 2 or proposal[:len(pending)] != pending:
            return None  # the proposer no longer continues what is in flight
        return self._window(base, proposal[len(pending):])

    async def _propose(self, num_tokens: int) -> list[int]:
        if num_tokens <= 0:
            return []
        if self._is_heavy:  # a draft model: off the event loop, on the thread that runs stage 0's layers
            return await self.session.env.runtime.call(lambda: self.spec.propose(num_tokens))
        return self.spec.propose(num_tokens)

    def _window(self, base: int, tokens: list[int]) -> _Window:
        window = _Window(self._next_window_id, base, tokens)
        self._next_window_id += 1
        return window

    def report(self, telemetry: Telemetry) -> dict:
        """Log the request's speculation summary and count it; returns the summary (flat
        figures for `timings`, /metrics and telemetry) plus the window-width histogram ({}
        without speculation)."""
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
