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

from ..protocol import (
    MessageKind, ProtocolError, ReplyKind, StageMessage, StageStatusReport, Topology,
    cache_namespace_digest, read_reply, write_message,
)
from ..runtime.speculation import SpeculativeSettings
from ..stage.downstream import LinkBroken, open_connection
from .backend import (
    BackendError, GenerationEvent, GenerationRequest, PrefillDone, Readiness, StageStatus, StageUnavailable,
)
from .client import ChainClient
from .session import ChainError

PROBE_TIMEOUT_S = 1.0


class ChainBackend:
    def __init__(self, client: ChainClient, topology: Topology | None, *,
                 auth_token: str | None = None, on_close: Callable[[], Awaitable[None]] | None = None,
                 health: Sequence | None = None):
        """`topology` None: stage 0 holds the whole model in this process. `on_close` stops
        what started the chain. `health`: per stage, its supervisor's `StageHealth` (state,
        restarts, last failure) when something restarts the stages. Requests at once: the
        client's lanes (`num_lanes`)."""
        layers = client.runtime.model.layers
        first = "in-process" if topology is None else topology.stages[0].endpoint
        self._first = StageStatus("stage-0", layers.start, layers.end, first, "ready", 0)
        self._client, self._remote = client, [] if topology is None else topology.stages[1:]
        self._auth_token = auth_token
        self._health = health
        self._on_close = on_close
        # prefix-cache restores as the chain saw them, per stage: [hits, misses]
        self._restores = [[0, 0] for _ in range(1 + len(self._remote))]

    @property
    def num_lanes(self) -> int:
        return self._client.num_lanes

    @property
    def ctx_size(self) -> int:
        return self._client.ctx_size

    @property
    def speculative(self) -> SpeculativeSettings:
        """The server's default speculative decoding; a request may ask for other settings."""
        return self._client.speculative

    def check_speculative(self, settings: SpeculativeSettings) -> None:
        """ValueError when the chain cannot run `settings` (draft mode without a draft model)."""
        self._client.check_speculative(settings)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        events = self._client.run(request.prompt_ids, max_tokens=request.max_tokens, sampling=request.sampling,
                                  stop_ids=request.stop_ids, speculative=request.speculative,
                                  cache_namespace=cache_namespace_digest(request.prompt_cache_key))
        try:
            async with aclosing(events):
                async for event in events:
                    if isinstance(event, PrefillDone):
                        self._observe_restore(event)
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
        local = self._client.runtime.prefix_cache
        stage_ids = [self._first.stage_id, *(stage.stage_id for stage in self._remote)]
        for index, (stage_id, (hits, misses)) in enumerate(zip(stage_ids, self._restores)):
            counters = {"chain_restore_hits": hits, "chain_restore_misses": misses}
            if index == 0 and local is not None:
                counters.update(local.stats())
            out.append((stage_id, counters))
        return out

    async def _unavailable(self, exc: Exception) -> BackendError:
        for stage, report in zip(self._remote, await self._query_all()):
            if report is None:
                where = f"{stage.endpoint}, layers [{stage.layer_start}, {stage.layer_end})"
                return StageUnavailable(stage.stage_id, f"it does not answer at {where} ({exc})")
        return BackendError(f"The stage chain failed: {exc}")

    async def _query_all(self) -> list[StageStatusReport | None]:
        stages = self._remote
        return await asyncio.gather(*(query_stage_status(s.endpoint, self._auth_token) for s in stages))

    async def status(self) -> list[StageStatus]:
        statuses = [dataclasses.replace(self._first, num_active_sessions=len(self._client.runtime.sessions))]
        for index, (stage, report) in enumerate(zip(self._remote, await self._query_all()), start=1):
            state = "down" if report is None else "ready"
            restarts, last_failure = 0, ""
            if self._health is not None:
                health = self._health[index]
                state = state if health.state == "ready" else health.state
                restarts, last_failure = health.restarts, health.last_failure
            statuses.append(StageStatus(stage.stage_id, stage.layer_start, stage.layer_end, stage.endpoint, state,
                                        0 if report is None else report.active_sessions, restarts,
                                        last_failure))  # fmt: skip
        return statuses

    async def ready(self) -> Readiness:
        for index, (stage, report) in enumerate(zip(self._remote, await self._query_all()), start=1):
            health = None if self._health is None else self._health[index]
            if health is not None and health.state == "failed":
                return Readiness(False, stage.stage_id, f"it {health.last_failure} and was not restarted "
                                 f"again after {health.in_a_row} restart(s) in a row")
            if report is None:
                detail = f"no status answer from {stage.endpoint}"
                if health is not None and health.state == "restarting":
                    detail += f" (restarting: it {health.last_failure})"
                return Readiness(False, stage.stage_id, detail)
        return Readiness(True)

    async def close(self) -> None:
        if self._on_close is not None:
            await self._on_close()
        else:
            await self._client.close()


async def query_stage_status(endpoint: str, auth_token: str | None) -> StageStatusReport | None:
    """The stage's own status, or None when it does not answer within PROBE_TIMEOUT_S. The
    connection then closes cleanly, which a stage ends quietly (no sessions to reclaim)."""
    try:
        reader, writer = await open_connection(endpoint, auth_token=auth_token, timeout_s=PROBE_TIMEOUT_S,
                                               handshake_timeout_s=PROBE_TIMEOUT_S)  # a hung stage: quickly None
    except (LinkBroken, OSError, TimeoutError):
        return None
    try:
        await write_message(writer, StageMessage(MessageKind.GetStageStatus))
        reply = await asyncio.wait_for(read_reply(reader), PROBE_TIMEOUT_S)
        return reply.status if reply is not None and reply.kind == ReplyKind.StageStatus else None
    except (ProtocolError, OSError, TimeoutError, asyncio.IncompleteReadError):
        return None
    finally:
        writer.close()
        try:
            await writer.wait_closed()
        except OSError:
            pass
