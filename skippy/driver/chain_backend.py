"""`ChainBackend`: the GenerationBackend seam over the stage-0 `ChainClient` (client.py).

Each generation leases a lane, prefills, decodes until a stop id, max_tokens or
the context end, and Stops, which reaches every stage (a stage ACKs Stop only
after its downstream did). A consumer that leaves early (stop string, client
gone, timeout) still gets a Stop sent; if that fails the lane is closed, and each
stage reclaims a session whose connection ended without Stop (spec §3.3).

Stage state comes from asking each stage directly (`GetStageStatus` on a
connection of its own): a stage that answers is ready and reports the sessions
open on it, so a session a stage failed to drop shows there. A chain failure is
reported as `StageUnavailable`, naming the first stage that does not answer.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing

from ..protocol import (
    MessageKind, ProtocolError, ReplyKind, StageMessage, StageReplyStats, StageStatusReport, Topology,
    cache_namespace_digest, read_reply, write_message,
)
from ..runtime.speculation import SpeculativeSettings
from ..stage.downstream import LinkBroken, open_connection
from .backend import (
    BackendError,
    Finished,
    GenerationEvent,
    GenerationRequest,
    PrefillDone,
    Readiness,
    StageStatus,
    StageUnavailable,
    Token,
)
from .session import ChainError, ChainSession, SessionTimings
from .client import ChainClient

PROBE_TIMEOUT_S = 1.0
STOP_TIMEOUT_S = 5.0  # an early Stop that takes longer is abandoned: the lane is closed instead


class ChainBackend:
    def __init__(self, client: ChainClient, topology: Topology | None, *, num_lanes: int,
                 auth_token: str | None = None, on_close: Callable[[], Awaitable[None]] | None = None):
        """`topology` None: stage 0 holds the whole model in this process. `num_lanes` must be
        the client's concurrency; `on_close` stops what started the chain."""
        layers = client.runtime.model.layers
        first = "in-process" if topology is None else topology.stages[0].endpoint
        self._first = StageStatus("stage-0", layers.start, layers.end, first, "ready", 0)
        self._client, self._remote = client, [] if topology is None else topology.stages[1:]
        self._num_lanes = num_lanes
        self._auth_token = auth_token
        self._on_close = on_close
        # prefix-cache restores as the chain saw them, per stage: [hits, misses]
        self._restores = [[0, 0] for _ in range(1 + len(self._remote))]

    @property
    def num_lanes(self) -> int:
        return self._num_lanes

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
        client, prompt = self._client, request.prompt_ids
        try:
            namespace = cache_namespace_digest(request.prompt_cache_key)
            async with client.session(request.sampling, len(prompt), namespace) as session:
                decoder = None
                try:
                    decoder = client.decoder(session, max_tokens=request.max_tokens,
                                             stop_ids=request.stop_ids,
                                             speculative=request.speculative)
                    started = time.perf_counter()
                    token = await session.prefill(prompt)
                    first_token_at = time.perf_counter()
                    self._observe_restore(session)
                    yield PrefillDone(len(prompt), session.timings.restored_tokens,
                                      (first_token_at - started) * 1e3)
                    num_generated = 0
                    async with aclosing(decoder.tokens(prompt, token)) as tokens:
                        async for token in tokens:
                            num_generated += 1
                            yield Token(token)
                    reason = "stop" if decoder.finish_reason == "stop" else "length"  # or context
                    decode_ms = (time.perf_counter() - first_token_at) * 1e3
                    stats = await session.stop()
                    extras = {**_timing_extras(stats, session.timings),
                              **decoder.report(client.telemetry)}
                    yield Finished(reason, num_generated, decode_ms, extras)
                finally:
                    if not session.stopped:
                        if decoder is not None:  # the consumer left early: still log its figures
                            decoder.report(client.telemetry)
                        await _stop_quietly(session)
        except (ChainError, LinkBroken) as exc:
            raise await self._unavailable(exc) from exc

    def _observe_restore(self, session: ChainSession) -> None:
        """Count each stage's part in this request's restore attempt: a stage is asked only
        when every stage above it hit (spec §4.4), and it hit when its mask bit is set."""
        if not session.timings.restore_decision or session.timings.restore_decision == "stage0_error":
            return
        mask = session.stats.kv_hit_stage_mask
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
        for stage, report in zip(self._remote, await self._query_all()):
            statuses.append(StageStatus(stage.stage_id, stage.layer_start, stage.layer_end, stage.endpoint,
                                        "down" if report is None else "ready",
                                        0 if report is None else report.active_sessions))  # fmt: skip
        return statuses

    async def ready(self) -> Readiness:
        for stage, report in zip(self._remote, await self._query_all()):
            if report is None:
                return Readiness(False, stage.stage_id, f"no status answer from {stage.endpoint}")
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
        reader, writer = await open_connection(endpoint, auth_token=auth_token, timeout_s=PROBE_TIMEOUT_S)
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


async def _stop_quietly(session: ChainSession) -> None:
    """Send Stop for a session the consumer left early. It runs as its own task, so a
    consumer being cancelled cannot cut it short. If it fails, `session.stopped` stays
    False: the driver then closes the lane and every stage reclaims the session."""
    stopping = asyncio.ensure_future(asyncio.wait_for(session.stop(), STOP_TIMEOUT_S))
    try:
        await asyncio.shield(stopping)
    except (asyncio.CancelledError, Exception):
        pass  # whatever brought us here still propagates


def _timing_extras(stats: StageReplyStats, timings: SessionTimings) -> dict[str, float]:
    """Chain figures for the `timings` object: the worst prefill edge and the prefix restore
    (tokens restored on every stage, tokens prefilled after them, its time, the stages that
    hit, the entries recorded). `cache_n` / `prompt_n` carry the same two token counts."""
    return {
        "chain_prefill_edge_max_ms": stats.prefill_edge_total_us_max / 1e3,
        "chain_kv_imported_tokens": stats.kv_imported_tokens,
        "kv_restored_tokens": timings.restored_tokens,
        "kv_suffix_prefill_tokens": timings.prefilled_tokens,
        "kv_restore_ms": timings.restore_s * 1e3,
        "kv_hit_stage_mask": stats.kv_hit_stage_mask,
        "kv_recorded_entries": stats.kv_recorded_pages,
    }
