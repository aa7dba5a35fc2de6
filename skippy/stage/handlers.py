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
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from ..protocol import (
    FrameError, MessageKind, StageMessage, StageReply, StageReplyStats, merge,
    prefill_compute_observation, prefill_edge_observation,
)
from ..runtime import SampleMode, Timed
from ..telemetry import Span

if TYPE_CHECKING:
    from .connection import StageConnection

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
    timed = await conn.runtime.run_alone(conn.step(session, msg, SampleMode.NONE))
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
    if msg.kind == MessageKind.PrefillFinalEmbd:
        timed = await conn.runtime.run_alone(step)
        conn.add_stats(prefill_compute_observation(conn.config.stage_index, _us(timed.run_s),
                                                   msg.token_count))
    else:
        timed = await conn.runtime.iterate(step)  # batched with other sessions' steps
    _note_compute(conn, msg, span, timed)
    write_s = 0.0
    if link is not None:
        write_s = await link.send(conn.forwarded(msg, timed.value.rows))
        span.set("forward_write_ms", write_s * 1e3)
        conn.summary(msg.session_id).forward_write_ms += write_s * 1e3
    if is_window:
        conn.add_stats(StageReplyStats(
            verify_window_compute_us=_us(timed.run_s), verify_window_forward_write_us=_us(write_s),
            verify_window_total_us=_us(timed.run_s + write_s), verify_window_stage_count=1,
            verify_window_request_count=int(link is None), verify_window_token_count=msg.token_count,
            verify_window_max_tokens=msg.token_count))
    if link is not None:
        return
    tokens = timed.value.tokens
    stats = conn.take_stats()
    reply = (StageReply.window(tokens, msg.seq_id, stats) if is_window
             else StageReply.token(tokens[0], stats))
    await conn.return_prediction(msg, reply)


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
        timed = await conn.runtime.drop(key)
        span.set("runtime_lock_wait_ms", timed.wait_s * 1e3)
    conn.server.returns.close((msg.request_id, msg.session_id))
    summary = conn.summaries.pop(msg.session_id, None)
    if summary is not None:
        conn.telemetry.summary("stage.request_summary", stage_index=conn.config.stage_index,
                               messages=summary.messages, rows=summary.rows,
                               compute_ms=summary.compute_ms, lock_wait_ms=summary.lock_wait_ms,
                               forward_write_ms=summary.forward_write_ms,
                               downstream_wait_ms=summary.downstream_wait_ms)
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
        conn.open_session(msg)
        timed = await conn.runtime.configure(key, msg.sampling, msg.prompt_token_count)
        if link is None:  # the final stage opens the direct return stream (spec §2.7)
            span.set("direct_return", await conn.server.returns.open((msg.request_id,
                                                                        msg.session_id)))
    span.set("runtime_lock_wait_ms", timed.wait_s * 1e3)
    if link is not None:
        started = time.perf_counter()
        stats = merge(stats, (await link.request(msg)).stats)
        span.set("downstream_wait_ms", (time.perf_counter() - started) * 1e3)
    await conn.reply(StageReply.ack(stats))


async def on_prefix_cache(conn: StageConnection, msg: StageMessage, span: Span) -> None:
    """TryRestorePrefill(Decode): no prefix cache yet, so a local miss. A miss is not
    forwarded (spec §4.4); the ACK carries neutral stats plus what was owed upstream."""
    stats = conn.take_stats()
    link = conn.link
    if link is not None:
        await link.flush()
        stats = merge(stats, await link.drain())
    span.set("kv_control_hit", False)
    await conn.reply(StageReply.ack(stats))


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
}
del K
assert set(HANDLERS) == set(MessageKind), "every kind needs a handler"
