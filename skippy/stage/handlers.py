"""One handler per message kind, and the table that dispatches to them (spec §2.4).

The ordering rules follow the original stage's control handlers:

* prefill chunk: (early ACK already sent on arrival) compute, hand the output to
  the async forwarder, count a deferred downstream ACK within the credit window;
* a kind that needs a prediction: drain every deferred ACK first; the final stage
  samples and returns the token straight to stage 0; others compute and forward;
* control (Stop, TrimSession, ConfigureGeneration, prefix-cache control): flush
  the forwarder, drain deferred ACKs, act locally, forward and wait for the ACK,
  merge its stats into ours, ACK upstream. Stop refuses to run while deferred
  prefill replies are outstanding.
* prefix cache (the seed's `handle_prefix_cache_control`, spec §4.4): restore
  locally, forward only on a local hit; a neutral downstream reply counts as a
  miss; on a downstream miss roll the local restore back. A stage records its
  prefill after the last prefill chunk and again at Stop (before the session goes).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from ..protocol import (
    LOOKUP_ERROR, FrameError, MessageKind, StageMessage, StageReply, StageReplyStats, StageStatusReport,
    encode_message, encode_reply, lookup_observation, merge, prefill_compute_observation,
    prefill_edge_observation, record_observation, restore_missed_below,
)
from ..protocol.decode_frames import token_reply
from ..protocol.stats import is_empty
from ..runtime import SampleMode, StepResult, Timed
from ..telemetry import Span
from .downstream import DownstreamLink
from .link_probe import on_link_probe
from .shared_writer import WorkerSend

if TYPE_CHECKING:
    from .connection import StageConnection

log = logging.getLogger("skippy.stage")
# this stage's prefix-cache counters on its summary line (stage 0's /metrics cannot see them)
SUMMARY_CACHE_FIELDS = ("hits", "misses", "disk_hits", "evictions", "rollbacks", "num_entries",
                        "num_bytes", "disk_tier_quarantined")
Handler = Callable[["StageConnection", StageMessage, Span], Awaitable[None]]


class StageError(RuntimeError):
    """A message this stage refuses to execute; its connection is closed (spec §2.6)."""


def _us(seconds: float) -> int:
    return int(seconds * 1e6)


def _note_compute(conn: StageConnection, msg: StageMessage, span: Span, timed: Timed) -> None:
    span.set("compute_ms", timed.run_s * 1e3)
    span.set("runtime_lock_wait_ms", timed.wait_s * 1e3)
    span.set("batch_size", timed.batch_size)
    summary = conn.summary(msg.session_id)
    summary.messages += 1
    summary.rows += msg.token_count
    summary.compute_ms += timed.run_s * 1e3
    summary.lock_wait_ms += timed.wait_s * 1e3
    if timed.value.auto_aligned_from is not None:  # spec §3.4 auto-align
        span.set("auto_align_from_tokens", timed.value.auto_aligned_from)
        conn.telemetry.count("skippy.stage.session_auto_align")


async def on_prefill(conn: StageConnection, msg: StageMessage, span: Span) -> None:
    """PrefillEmbd: compute, forward asynchronously, defer the downstream ACK."""
    session = conn.open_session(msg)
    link = await conn.downstream()
    timed = await conn.runtime.prefill(conn.step(session, msg, SampleMode.NONE), last=False)
    _note_compute(conn, msg, span, timed)
    index = conn.config.stage_index
    conn.add_stats(prefill_compute_observation(index, _us(timed.run_s), msg.token_count))
    if link is None:
        return
    rows = timed.value.rows
    await link.forward_async(conn.forwarded(msg, rows))
    waits = link.credit_waits
    started = time.perf_counter()
    conn.add_stats(await link.note_deferred())
    if link.credit_waits > waits:  # a credit wait: the downstream edge is the bottleneck
        wait_s = time.perf_counter() - started
        span.set("downstream_wait_ms", wait_s * 1e3)
        conn.summary(msg.session_id).downstream_wait_ms += wait_s * 1e3
        conn.add_stats(prefill_edge_observation(index, 0, _us(wait_s), rows.nbytes))


async def on_predicting(conn: StageConnection, msg: StageMessage, span: Span) -> None:
    """PrefillFinalEmbd, DecodeEmbd and VerifyWindow."""
    session = conn.open_session(msg)
    link = await conn.downstream()
    if link is not None and link.pending_deferred:
        started = time.perf_counter()
        conn.add_stats(await link.drain())
        span.set("deferred_drain_ms", (time.perf_counter() - started) * 1e3)
    is_window = msg.kind == MessageKind.VerifyWindow
    if is_window and link is None and session.is_discarded(msg.seq_id):
        span.set("skipped_stale_window", True)  # middle stages ran it; the final skips it
        return
    sample = SampleMode.NONE if link is not None else SampleMode.ALL if is_window else SampleMode.LAST
    step = conn.step(session, msg, sample, window=is_window)
    send = reply_stats = None
    if msg.kind == MessageKind.PrefillFinalEmbd:
        timed = await conn.runtime.prefill(step)
        conn.add_stats(prefill_compute_observation(conn.config.stage_index, _us(timed.run_s),
                                                   msg.token_count))
    else:
        if not is_window or link is not None:  # a window's reply carries its own stats: the loop's way
            send, reply_stats = worker_send(conn, msg, link)
        timed = await conn.runtime.iterate(step, send)  # batched with other sessions' steps
    sent = send is not None and send.sent
    if send is not None:
        span.set("sent_by_worker", sent)
    _note_compute(conn, msg, span, timed)
    write_s = 0.0
    if link is not None:
        write_s = send.write_s if sent else await link.send(conn.forwarded(msg, timed.value.rows))
        span.set("forward_write_ms", write_s * 1e3)
        conn.summary(msg.session_id).forward_write_ms += write_s * 1e3
    if is_window:
        conn.add_stats(StageReplyStats(
            verify_window_compute_us=_us(timed.run_s), verify_window_forward_write_us=_us(write_s),
            verify_window_total_us=_us(timed.run_s + write_s), verify_window_stage_count=1,
            verify_window_request_count=int(link is None), verify_window_token_count=msg.token_count,
            verify_window_max_tokens=msg.token_count))
    if link is None and not sent:
        stats = conn.take_stats() if reply_stats is None else merge(reply_stats, conn.take_stats())
        await conn.return_prediction(msg, _prediction_reply(msg, timed.value, stats, is_window))
    if msg.kind == MessageKind.PrefillFinalEmbd:  # the prompt is in: record it (spec §4.3)
        await _record(conn, msg, span)


def _prediction_reply(msg: StageMessage, result: StepResult, stats: StageReplyStats,
                      is_window: bool) -> StageReply:
    if is_window:
        return StageReply.window(result.tokens, msg.seq_id, stats, result.logprobs)
    return StageReply.token(result.tokens[0], stats, logprobs=result.logprobs,
                            prompt_logprobs=result.prompt_logprobs)


async def deliver_step(conn: StageConnection, msg: StageMessage, result: StepResult) -> None:
    """A lent lane's decode step whose frame the worker could not send (lane_loan.py): its
    row down the chain, or its token back to stage 0, the loop's way."""
    if conn.link is not None:
        await conn.link.send(conn.forwarded(msg, result.rows))
    else:
        await conn.return_prediction(msg, _prediction_reply(msg, result, conn.take_stats(), False))


def worker_send(conn: StageConnection, msg: StageMessage,
                 link: DownstreamLink | None) -> tuple[WorkerSend | None, StageReplyStats | None]:
    """The step's outgoing frame for the worker to send as the forward ends (shared_writer.py),
    and, on the final stage, the stats its reply carries (taken now; they go back into the
    reply if the frame goes the loop's way). No send: the loop's way (link busy, TLS, no stream)."""
    if link is not None:
        writer = link.idle_writer()
        if writer is None:
            return None, None
        return WorkerSend(writer, lambda result: encode_message(conn.forwarded(msg, result.rows))), None
    writer = conn.server.returns.writer(conn.key(msg.session_id), msg.request_id)
    if writer is None:
        return None, None
    stats = conn.take_stats()

    def encode(result: StepResult) -> bytes:
        if is_empty(stats) and result.logprobs is None and result.prompt_logprobs is None:
            return token_reply(result.tokens[0])  # the rule: a template (protocol/decode_frames.py)
        return encode_reply(_prediction_reply(msg, result, stats, False))

    return WorkerSend(writer, encode), stats


async def _record(conn: StageConnection, msg: StageMessage, span: Span) -> None:
    """Record the session's prefill; the stats ride on the next reply upstream."""
    key = conn.key(msg.session_id)
    if conn.runtime.prefix_cache is None or key not in conn.runtime.sessions:
        return
    recorded = (await conn.runtime.record_prefix(key)).value
    if recorded.num_entries:
        span.set("kv_recorded_entries", recorded.num_entries)
        conn.add_stats(record_observation(conn.config.stage_index, recorded.num_entries,
                                          recorded.num_bytes))


async def on_stop(conn: StageConnection, msg: StageMessage, span: Span) -> None:
    """End the logical session; the connection (the lane) stays open."""
    link = conn.link
    if link is not None and link.pending_deferred:
        raise StageError(f"cannot stop with {link.pending_deferred} deferred prefill replies")
    if link is not None:
        await link.flush()
    stats = conn.take_stats()
    if link is not None:
        started = time.perf_counter()
        stats = merge(stats, (await link.request(msg)).stats)
        span.set("downstream_wait_ms", (time.perf_counter() - started) * 1e3)
    key = conn.key(msg.session_id)
    if key in conn.runtime.sessions:
        await _record(conn, msg, span)  # the full-prefill record, before the session goes
        stats = merge(stats, conn.take_stats())
        timed = await conn.runtime.drop(key)
        span.set("runtime_lock_wait_ms", timed.wait_s * 1e3)
    conn.server.returns.close(key)
    summary = conn.summaries.pop(msg.session_id, None)
    if summary is not None:
        kv = conn.runtime.prefix_cache
        cache = {} if kv is None else {f"kv_{name}": value for name, value in kv.stats().items()
                                       if name in SUMMARY_CACHE_FIELDS}
        conn.telemetry.summary("stage.request_summary", stage_index=conn.config.stage_index,
                               messages=summary.messages, rows=summary.rows,
                               compute_ms=summary.compute_ms, lock_wait_ms=summary.lock_wait_ms,
                               forward_write_ms=summary.forward_write_ms,
                               downstream_wait_ms=summary.downstream_wait_ms, **cache)
    await conn.reply(StageReply.ack(stats))


async def on_control(conn: StageConnection, msg: StageMessage, span: Span) -> None:
    """TrimSession and ConfigureGeneration: flush, drain, act locally, forward, ACK."""
    stats = conn.take_stats()
    link = await conn.downstream()
    if link is not None:
        await link.flush()
        stats = merge(stats, await link.drain())
    key = conn.key(msg.session_id)
    if msg.kind == MessageKind.TrimSession:
        timed = await conn.runtime.trim(key, msg.token_count)
    else:
        conn.open_session(msg).cache_namespace = msg.cache_namespace
        # decode_step of a ConfigureGeneration: the draws a replayed request already made
        timed = await conn.runtime.configure(key, msg.sampling, msg.prompt_token_count,
                                             skip_draws=msg.decode_step)
        if link is None:  # the final stage opens the direct return stream (spec §2.7)
            span.set("direct_return", await conn.server.returns.open(key, msg.request_id))
    span.set("runtime_lock_wait_ms", timed.wait_s * 1e3)
    if link is not None:
        started = time.perf_counter()
        stats = merge(stats, (await link.request(msg)).stats)
        span.set("downstream_wait_ms", (time.perf_counter() - started) * 1e3)
    await conn.reply(StageReply.ack(stats))


async def on_prefix_cache(conn: StageConnection, msg: StageMessage, span: Span) -> None:
    """TryRestorePrefill(Decode), as the seed's `handle_prefix_cache_control` (spec §4.4).

    Restore exactly the sideband's prefix locally. Only on a local hit is the message
    forwarded; a downstream reply with neutral stats (a stage without a cache) counts as
    a miss; on a downstream miss the local restore is rolled back, so the session holds
    nothing and the cold prefill that follows starts clean. A stage without a cache
    answers neutral stats and forwards nothing. The ACK always carries the merged stats.
    """
    stats = conn.take_stats()
    kv = conn.runtime.prefix_cache
    link = conn.link if kv is None or not kv.lookup_enabled else await conn.downstream()
    if link is not None:
        await link.flush()
        stats = merge(stats, await link.drain())
    if kv is None or not kv.lookup_enabled:
        span.set("kv_control_hit", False)
        await conn.reply(StageReply.ack(stats))
        return
    key, index = conn.key(msg.session_id), conn.config.stage_index
    is_new = key not in conn.runtime.sessions
    session = conn.open_session(msg)
    if msg.cache_namespace is not None:
        session.cache_namespace = msg.cache_namespace
    prefix = msg.tokens.tolist()
    if msg.kind == MessageKind.TryRestorePrefillDecode:
        prefix = prefix[:msg.pos_start]
    try:
        restored = (await conn.runtime.restore_prefix(key, prefix, longest=False)).value
        local = lookup_observation(index, restored)
    except Exception as error:  # noqa: BLE001 - a failed restore is a miss, never a crash
        log.warning("stage %d: prefix restore failed: %s", index, error)
        kv.restore_errors += 1
        restored, local = 0, LOOKUP_ERROR
    stats = merge(stats, local)
    hit = restored > 0
    decision = "local_hit" if hit else "local_miss"
    if hit and msg.kind == MessageKind.TryRestorePrefillDecode:
        hit, stats = await _restore_decode(conn, msg, session, link, stats, span)
        decision = "chain_hit" if hit else "downstream_miss_rollback"
    elif hit and link is not None:
        started = time.perf_counter()
        down = (await link.request(msg)).stats
        span.set("downstream_wait_ms", (time.perf_counter() - started) * 1e3)
        missed, extra = restore_missed_below(down)
        hit = hit and not missed
        stats = merge(stats, merge(down, extra))
        decision = "chain_hit" if hit else "downstream_miss_rollback"
    if restored and not hit:
        await conn.runtime.rollback_prefix(key)
    if not hit and is_new:  # opened by this message alone: leave nothing behind
        await conn.runtime.drop(key)
    span.set("kv_control_hit", hit)
    span.set("kv_decision", decision)
    span.set("kv_restored_tokens", restored if hit else 0)
    await conn.reply(StageReply.ack(stats))


async def _restore_decode(conn: StageConnection, msg: StageMessage, session, link, stats, span):
    """TryRestorePrefillDecode after a local hit: run the current token's row at pos_start.
    The final stage samples it and returns the token on the prediction path; every stage
    still ACKs upstream with the merged stats, so each one learns whether the chain hit."""
    step_msg = dataclasses.replace(msg, tokens=[msg.current_token])
    sample = SampleMode.NONE if link is not None else SampleMode.LAST
    timed = await conn.runtime.prefill(conn.step(session, step_msg, sample))
    _note_compute(conn, msg, span, timed)
    if link is None:
        result = timed.value
        await conn.return_prediction(msg, StageReply.token(result.tokens[0], logprobs=result.logprobs))
        return True, stats
    down = (await link.request(conn.forwarded(msg, timed.value.rows))).stats
    missed, extra = restore_missed_below(down)
    return not missed, merge(stats, merge(down, extra))


async def on_retire(conn: StageConnection, msg: StageMessage, span: Span) -> None:
    """RetireVerifyWindow: free the checkpoints, forward, no ACK."""
    link = conn.link
    if link is not None:
        await link.flush()
    key = conn.key(msg.session_id)
    if key in conn.runtime.sessions:
        span.set("retired_windows", (await conn.runtime.retire(key, msg.pos_start,
                                                                msg.token_count)).value)
    if link is not None:
        await link.send(msg)


async def on_discard(conn: StageConnection, msg: StageMessage, span: Span) -> None:
    """DiscardStaleWindows: recorded on arrival by the reader; here it is only forwarded."""
    if conn.link is not None:
        await conn.link.send(msg)


async def on_return_open(conn: StageConnection, msg: StageMessage, span: Span) -> None:
    raise FrameError("PredictionReturnOpen: expected only as the first frame of a "
                     "prediction-return stream to stage 0, got it on a stage connection")


K = MessageKind
async def on_stage_status(conn: StageConnection, msg: StageMessage, span: Span) -> None:
    """GetStageStatus: this stage's own layers and open sessions; not forwarded (stage 0
    asks every stage directly, as it probes them)."""
    config = conn.config
    await conn.reply(StageReply.of_status(StageStatusReport(
        config.stage_index, config.layer_start, config.layer_end, len(conn.runtime.sessions),
        config.lane_count,
        conn.runtime.metric_values(connections=len(conn.server.connections) - 1),  # not this query
        conn.server.measurement.probe)))


HANDLERS: dict[MessageKind, Handler] = {
    K.PrefillEmbd:             on_prefill,
    K.PrefillFinalEmbd:        on_predicting,
    K.DecodeEmbd:              on_predicting,
    K.VerifyWindow:            on_predicting,
    K.Stop:                    on_stop,
    K.TrimSession:             on_control,
    K.ConfigureGeneration:     on_control,
    K.TryRestorePrefill:       on_prefix_cache,
    K.TryRestorePrefillDecode: on_prefix_cache,
    K.RetireVerifyWindow:      on_retire,
    K.DiscardStaleWindows:     on_discard,
    K.PredictionReturnOpen:    on_return_open,
    K.GetStageStatus:          on_stage_status,
    K.LinkProbe:               on_link_probe,
}
del K
assert set(HANDLERS) == set(MessageKind), "every kind needs a handler"
