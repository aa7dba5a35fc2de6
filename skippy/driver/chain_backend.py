"""`ChainBackend`: the GenerationBackend seam over the stage-0 `ChainClient` (client.py).

Each generation is `ChainClient.run` (the one orchestration of a request: lease,
prefill, decode, Stop, also when the consumer leaves early); this adds the API's
view: chain failures as `StageUnavailable`, per-stage restore counts, stage status.

Stage state comes from asking each stage directly (`GetStageStatus` on a
connection of its own): a stage that answers is ready and reports the sessions
open on it, so a session a stage failed to drop shows there. A chain failure is
reported as `StageUnavailable`, naming the first stage that does not answer.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import aclosing

from ..protocol import StageStatusReport, Topology, cache_namespace_digest
from ..stage.transport import LinkBroken
from .backend import (
    BackendError, Finished, GenerationEvent, GenerationRequest, PrefillDone, Readiness, StageStatus,
    StageUnavailable, StandbyStatus,
)
from .client import ChainClient
from .split_check import compare, drifted
from .stage_figures import StageFigures
from .session import ChainError


class ChainBackend:
    def __init__(self, client: ChainClient, topology: Topology | None, *,
                 auth_token: str | None = None, on_close: Callable[[], Awaitable[None]] | None = None,
                 health: Sequence | None = None,
                 advise: Callable[[list[StageStatus]], dict] | None = None):
        """`topology` None: stage 0 holds the whole model in this process. `on_close` stops
        what started the chain. `health`: per stage, its supervisor's `StageHealth` (state,
        restarts, last failure, where it runs now) when something restarts the stages. `advise`:
        the split the stages' measured times give (launch/measured_split.py), asked when they drift."""
        self.rebind(client, topology, health)
        self._auth_token = auth_token
        self._on_close = on_close
        self._advise = advise
        # prefix-cache restores as the chain saw them, per stage: [hits, misses]
        self._restores = [[0, 0] for _ in range(1 + len(self._remote))]
        self._figures = StageFigures()
        self._drafts = [0, 0]  # speculation over every request: [proposed, accepted] draft tokens

    def rebind(self, client: ChainClient, topology: Topology | None, health: Sequence | None) -> None:
        """The chain's stage 0, topology and health: at start, and again when a restart started
        every stage on another split (launch/split_restart.py)."""
        layers = client.runtime.model.layers
        first = "in-process" if topology is None else topology.stages[0].endpoint
        self._first = StageStatus("stage-0", layers.start, layers.end, first, "ready", 0)
        self.client, self._remote, self._health = client, [] if topology is None else topology.stages[1:], health
        # the client's, alike on every client of a chain (GenerationBackend documents each)
        self.num_lanes, self.ctx_size, self.speculative = client.num_lanes, client.ctx_size, client.speculative
        self.check_speculative, self.check_grammar = client.check_speculative, client.check_grammar

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        events = self.client.run(request.prompt_ids, request_id=request.request_id,
                                  max_tokens=request.max_tokens, sampling=request.sampling,
                                  stop_ids=request.stop_ids, speculative=request.speculative,
                                  cache_namespace=cache_namespace_digest(request.prompt_cache_key))
        try:
            async with aclosing(events):
                async for event in events:
                    if isinstance(event, PrefillDone):
                        self._observe_restore(event)
                    elif isinstance(event, Finished) and event.speculation:
                        self._drafts[0] += event.speculation.get("speculative_num_proposed_tokens", 0)
                        self._drafts[1] += event.speculation.get("speculative_num_accepted_tokens", 0)
                    yield event
        except (ChainError, LinkBroken) as exc:
            raise await self._unavailable(exc) from exc

    def _observe_restore(self, prefill: PrefillDone) -> None:
        """Count each stage's part in this request's restore attempt: a stage is asked only
        when every stage above it hit (spec §4.4), and it hit when its mask bit is set."""
        if not prefill.restore_decision or prefill.restore_decision == "stage0_error":
            return
        mask = prefill.hit_stage_mask
        for index, counts in enumerate(self._restores):
            if mask >> index & 1:
                counts[0] += 1
            elif index == 0 or mask >> (index - 1) & 1:
                counts[1] += 1
                break

    def cache_stats(self) -> list[tuple[str, dict[str, int]]]:
        """(stage id, counters) per stage for /metrics. Stage 0 reports its own cache in full;
        every stage reports the restores the chain saw it hit or miss (the wire carries no
        stage-local eviction counts: those are in each stage's telemetry counters)."""
        out = []
        local = self.client.runtime.prefix_cache
        stage_ids = [self._first.stage_id, *(stage.stage_id for stage in self._remote)]
        for index, (stage_id, (hits, misses)) in enumerate(zip(stage_ids, self._restores)):
            counters = {"chain_restore_hits": hits, "chain_restore_misses": misses}
            if index == 0 and local is not None:
                counters.update(local.stats())
            out.append((stage_id, counters))
        return out

    async def _unavailable(self, exc: Exception) -> BackendError:
        for stage in (await self.status())[1:]:
            if not stage.is_serving:
                where = f"{stage.endpoint}, layers [{stage.layer_start}, {stage.layer_end})"
                return StageUnavailable(stage.stage_id, f"it does not answer at {where} ({exc})")
        return BackendError(f"The stage chain failed: {exc}")

    async def status(self, *, last_known: bool = False) -> list[StageStatus]:
        """Stage 0, then every stage below as its own status answers say (a supervisor's view
        of a restarting or failed one first), with its standbys'. `last_known`: a stage that
        does not answer is described by the last answer its supervisor had from it."""
        homes = [self._endpoint(index, stage) for index, stage in enumerate(self._remote, start=1)]
        endpoints = [e for home, stage in zip(homes, self._remote) for e in (home, *stage.standby_endpoints)]
        reports = iter(await asyncio.gather(*(self.client.transport.query_status(e) for e in endpoints)))
        sessions, metrics = await self.client.local_status()
        proposed, accepted = self._drafts
        probe = self.client.measurement.probe
        statuses = [dataclasses.replace(self._first, active_sessions=sessions, metrics=metrics,
                                        node_ip=self._health[0].node_ip if self._health else "",
                                        figures=self._figures.figures(self._first.stage_id, metrics, probe.cpu_ns,
                                            speculative_acceptance=accepted / proposed if proposed else 0.0),
                                        probe=probe, predicted_vs_measured=compare(
                                            probe, metrics, self._figures.window_start(self._first.stage_id)))]
        for index, (stage, home) in enumerate(zip(self._remote, homes), start=1):
            report = next(reports)
            state, restarts, last_failure, where = "down" if report is None else "ready", 0, "", {}
            if report is None and last_known and self._health is not None:
                report = self._health[index].last_report
            if self._health is not None:
                health = self._health[index]
                state = state if health.state == "ready" else health.state
                restarts, last_failure = health.restarts, health.last_failure
                where = dict(node_ip=health.node_ip, moves=health.moves)
            standbys = tuple(StandbyStatus(endpoint, "down" if r is None else "ready", _sessions(r))
                             for endpoint, r in zip(stage.standby_endpoints, reports))
            metrics = None if report is None else report.metrics
            figures = {} if metrics is None else self._figures.figures(stage.stage_id, metrics, report.probe.cpu_ns)
            probe = None if report is None else report.probe
            statuses.append(StageStatus(stage.stage_id, stage.layer_start, stage.layer_end, home, state,
                                        _sessions(report), restarts, last_failure, standbys, metrics=metrics,
                                        figures=figures, probe=probe,
                                        predicted_vs_measured=None if report is None else compare(
                                            probe, metrics, self._figures.window_start(stage.stage_id)),
                                        **where))  # fmt: skip
        return statuses

    def _endpoint(self, index: int, stage) -> str:
        """Where stage `index` listens now: its supervisor's view (it may have moved), else the topology's."""
        return (self._health[index].endpoint if self._health is not None else "") or stage.endpoint

    async def split_advice(self, statuses: list[StageStatus]) -> dict | None:
        """When a stage's decode forward is more than split_check.DRIFT off what its probe
        predicted, the split the measured times give (the launcher's planner, `advise`);
        None while every stage is on its prediction, or without a planner."""
        if self._advise is None or not drifted([s.predicted_vs_measured for s in statuses]):
            return None
        return self._advise(statuses)

    async def split_advice_after_loss(self) -> dict | None:
        """`split_advice` as a restart after a stage's death sees it: the stage that died
        counts with what it said last (launch/split_restart.py)."""
        return await self.split_advice(await self.status(last_known=True))

    async def ready(self) -> Readiness:
        for stage in (await self.status())[1:]:
            if stage.state == "failed":
                return Readiness(False, stage.stage_id, f"it {stage.last_failure} and its restarts are spent")
            if not stage.is_serving:
                detail = f"no status answer from {', '.join([stage.endpoint, *(s.endpoint for s in stage.standbys)])}"
                if stage.state == "restarting":
                    detail += f" (restarting: it {stage.last_failure})"
                return Readiness(False, stage.stage_id, detail)
        return Readiness(True)

    async def close(self) -> None:
        if self._on_close is not None:
            await self._on_close()
        else:
            await self.client.close()


def _sessions(report: StageStatusReport | None) -> int:
    return 0 if report is None else report.active_sessions
