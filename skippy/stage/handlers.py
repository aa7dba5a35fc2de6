"""The control messages of a stage, on the event loop, one handler per kind (spec §2.4).

The data kinds never come here (stage/lane.py). A control message arrives once the lane's
deferred prefill ACKs are in, with the stats owed so far (`ctl.stats`), and the lane takes
no other frame until its handler replies. Each acts locally, forwards and waits for the
ACK, and ACKs upstream with the merged stats, as the original stage's handlers did.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Awaitable, Callable

from ..protocol import (
    LOOKUP_ERROR, MessageKind, StageReply, StageReplyStats, StageStatusReport, encode_reply,
    lookup_observation, merge, restore_missed_below,
)
from ..runtime import SampleMode
from ..telemetry import Span
from .lane import DATA_KINDS, Lane, LaneControl
from .link_probe import on_link_probe

log = logging.getLogger("skippy.stage")
# this stage's prefix-cache counters on its summary line (stage 0's /metrics cannot see them)
SUMMARY_CACHE_FIELDS = ("hits", "misses", "disk_hits", "evictions", "rollbacks", "num_entries",
                        "num_bytes", "disk_tier_quarantined")
Handler = Callable[[LaneControl, Span], Awaitable[None]]


async def on_stop(ctl: LaneControl, span: Span) -> None:
    """End the logical session; the connection (the lane) stays open."""
    msg, stats = ctl.msg, ctl.stats
    if ctl.has_link:
        stats = merge(stats, await ctl.forward(span))

    def reset(lane: Lane):
        runtime = lane.env.runtime
        owed, summary, cache = lane.take_stats(), None, {}
        if ctl.key in runtime.sessions:
            lane.record(msg.session_id)  # the full-prefill record, before the session goes
            owed = lane.take_stats()
            runtime.drop(ctl.key)
        lane.env.returns.close(ctl.key)
        summary = lane.summaries.pop(msg.session_id, None)
        kv = runtime.prefix_cache
        if summary is not None and kv is not None:
            cache = {f"kv_{name}": value for name, value in kv.stats().items() if name in SUMMARY_CACHE_FIELDS}
        return owed, summary, cache

    owed, summary, cache = await ctl.run(reset)
    stats = merge(stats, owed)
    if summary is not None:
        ctl.env.telemetry.summary("stage.request_summary", stage_index=ctl.env.config.stage_index,
                                  messages=summary.messages, rows=summary.rows, compute_ms=summary.compute_ms,
                                  lock_wait_ms=summary.lock_wait_ms, forward_write_ms=summary.forward_write_ms,
                                  downstream_wait_ms=summary.downstream_wait_ms, **cache)
    ctl.reply(StageReply.ack(stats))


async def on_control(ctl: LaneControl, span: Span) -> None:
    """TrimSession and ConfigureGeneration: act locally, forward, ACK."""
    msg, key, stats = ctl.msg, ctl.key, ctl.stats
    await ctl.ensure_link()
    if msg.kind == MessageKind.TrimSession:
        await ctl.run(lambda lane: lane.env.runtime.trim(key, msg.token_count))
    else:
        def configure(lane: Lane) -> None:
            lane.open_session(msg).cache_namespace = msg.cache_namespace  # a new request replaces the session
            # decode_step of a ConfigureGeneration: the draws a replayed request already made
            lane.env.runtime.configure(key, msg.sampling, msg.prompt_token_count, skip_draws=msg.decode_step)

        await ctl.run(configure)
        if ctl.is_final:  # the final stage opens the direct return stream (spec §2.7)
            sock = await ctl.env.returns.dial(msg.request_id, msg.session_id)
            if sock is not None:
                try:
                    await ctl.run(lambda lane: lane.env.returns.attach(key, msg.request_id, sock))
                except BaseException:
                    sock.close()
                    raise
            span.set("direct_return", sock is not None)
    if ctl.has_link:
        stats = merge(stats, await ctl.forward(span))
    ctl.reply(StageReply.ack(stats))


async def on_prefix_cache(ctl: LaneControl, span: Span) -> None:
    """TryRestorePrefill(Decode), as the seed's `handle_prefix_cache_control` (spec §4.4):
    restore exactly the sideband's prefix; forward only on a local hit; on a downstream miss
    (neutral stats count as one) roll the restore back, so the cold prefill starts clean."""
    msg, key, stats = ctl.msg, ctl.key, ctl.stats
    kv = ctl.env.runtime.prefix_cache  # set when the stage was built; read-only here
    if kv is None or not kv.lookup_enabled:
        span.set("kv_control_hit", False)
        ctl.reply(StageReply.ack(stats))
        return
    await ctl.ensure_link()
    index = ctl.env.config.stage_index

    def restore(lane: Lane) -> tuple[bool, int, StageReplyStats]:
        runtime = lane.env.runtime
        is_new = key not in runtime.sessions
        session = lane.open_session(msg)
        if msg.cache_namespace is not None:
            session.cache_namespace = msg.cache_namespace
        prefix = msg.tokens.tolist()
        if msg.kind == MessageKind.TryRestorePrefillDecode:
            prefix = prefix[:msg.pos_start]
        try:
            restored = runtime.restore_prefix(key, prefix, longest=False)
        except Exception as error:  # noqa: BLE001 - a failed restore is a miss, never a crash
            log.warning("stage %d: prefix restore failed: %s", index, error)
            kv.restore_errors += 1
            return is_new, 0, LOOKUP_ERROR
        return is_new, restored, lookup_observation(index, restored)

    is_new, restored, local = await ctl.run(restore)
    stats = merge(stats, local)
    hit = restored > 0
    decision = "local_hit" if hit else "local_miss"
    if hit and msg.kind == MessageKind.TryRestorePrefillDecode:
        hit, stats = await _restore_decode(ctl, stats, span)
        decision = "chain_hit" if hit else "downstream_miss_rollback"
    elif hit and ctl.has_link:
        down = await ctl.forward(span)
        missed, extra = restore_missed_below(down)
        hit = not missed
        stats = merge(stats, merge(down, extra))
        decision = "chain_hit" if hit else "downstream_miss_rollback"

    def settle(lane: Lane) -> None:
        runtime = lane.env.runtime
        if restored and not hit:
            runtime.rollback_prefix(key)
        if not hit and is_new:  # opened by this message alone: leave nothing behind
            runtime.drop(key)

    if not hit:
        await ctl.run(settle)
    span.set("kv_control_hit", hit)
    span.set("kv_decision", decision)
    span.set("kv_restored_tokens", restored if hit else 0)
    ctl.reply(StageReply.ack(stats))


async def _restore_decode(ctl: LaneControl, stats: StageReplyStats, span: Span) -> tuple[bool, StageReplyStats]:
    """TryRestorePrefillDecode after a local hit: the current token's row at pos_start. The
    final stage returns its token on the prediction path at once, ahead of the ACKs."""
    msg = ctl.msg
    step_msg = dataclasses.replace(msg, tokens=[msg.current_token])
    timed = await ctl.step(step_msg, SampleMode.LAST if ctl.is_final else SampleMode.NONE)
    span.set("compute_ms", timed.run_s * 1e3)
    if ctl.is_final:
        result = timed.value
        frame = encode_reply(StageReply.token(result.tokens[0], logprobs=result.logprobs))
        await ctl.run(lambda lane: lane.return_frame(msg, frame))
        return True, stats
    down = await ctl.forward(span, rows=timed.value.rows)
    missed, extra = restore_missed_below(down)
    return not missed, merge(stats, merge(down, extra))


async def on_stage_status(ctl: LaneControl, span: Span) -> None:
    """GetStageStatus: this stage's own layers and open sessions; not forwarded (stage 0
    asks every stage directly, as it probes them)."""
    config = ctl.env.config

    def report(lane: Lane) -> StageStatusReport:
        runtime = lane.env.runtime
        return StageStatusReport(config.stage_index, config.layer_start, config.layer_end, len(runtime.sessions),
                                 config.lane_count,
                                 runtime.metric_values(connections=len(lane.env.lanes) - 1),  # not this query
                                 lane.env.measurement.probe)

    ctl.reply(StageReply.of_status(await ctl.run(report)))


K = MessageKind
CONTROL_HANDLERS: dict[MessageKind, Handler] = {
    K.Stop:                    on_stop,
    K.TrimSession:             on_control,
    K.ConfigureGeneration:     on_control,
    K.TryRestorePrefill:       on_prefix_cache,
    K.TryRestorePrefillDecode: on_prefix_cache,
    K.GetStageStatus:          on_stage_status,
    K.LinkProbe:               on_link_probe,
}
del K
assert set(CONTROL_HANDLERS) | DATA_KINDS == set(MessageKind) and not set(CONTROL_HANDLERS) & DATA_KINDS, \
    "every kind is the engine's (lane.py) or has a control handler, not both"


async def run_control(ctl: LaneControl) -> None:
    """One control message, start to reply; any failure closes its lane only."""
    msg, telemetry = ctl.msg, ctl.env.telemetry
    try:
        # the child of the span that sent the frame; what it forwards names this span
        with telemetry.span("stage.binary_message", parent=msg.trace_context, kind=msg.kind.name,
                            stage_index=ctl.env.config.stage_index, token_count=msg.token_count,
                            bytes_in=msg.activation.nbytes) as span:
            await CONTROL_HANDLERS[msg.kind](ctl, span)
    except Exception as error:  # noqa: BLE001 - every failure closes this connection only
        ctl.fail(error)
