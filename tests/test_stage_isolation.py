"""One bad peer never touches another user's stream (issue 43), at a live final stage.

Two sessions on two connections share one wave of the stage's worker (held busy while both
frames arrive); one of them misbehaves. The other's tokens are those of a run alone, its
connection stays open, and the misbehaving one either fails alone with a named reason (one
WARNING line, no traceback) or, where the protocol gives its frame a meaning, is served.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import socket
import struct
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from chain_support import stage_config
from skippy.model.grammar import GrammarCompiler
from skippy.model.locate import bundled_model_path
from skippy.protocol import SamplingConfig, StageMessage, encode_message
from skippy.protocol.constants import GrammarKind
from skippy.protocol.constants import (
    MAX_ACTIVATION_BYTES, MAX_GRAMMAR_BYTES, MAX_LOGIT_BIAS_COUNT, MAX_METADATA_BYTES, MAX_SAMPLING_BYTES,
    MAX_SIDEBAND_COUNT, MESSAGE_HEADER, MESSAGE_HEADER_FIELDS, SAMPLING_FIELDS, ReplyKind, header_offset,
)
from skippy.protocol.logprobs import MAX_TOP_LOGPROBS
from skippy.runtime.runner import MAX_PROMPT_LOGPROB_ROWS, MAX_WINDOW_ROWS
from skippy.runtime.session import MAX_DISCARD_RANGES, MAX_OPEN_WINDOWS
from skippy.protocol.sampling_config import GrammarSpec
from skippy.runtime.stage_runtime import StageRuntime
from skippy.stage.server import StageServer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from stage_peer import CLOSED, K, Peer, Request, established, expect  # noqa: E402

WIDTH = 576
DECODE_STEPS = 6
WAVE_STEP = 2  # the bystander's decode step that shares its wave with the misbehaving frame
BYSTANDER = SamplingConfig(temperature=0.7, top_p=0.95, seed=11)
OOV = 1_000_000
LANES, CTX = 8, 2048


@pytest.fixture(scope="module")
def stage(make_stage):
    """A final stage holding one layer, on an event loop thread of its own: (server, loop)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start():
        config = stage_config(1, (29, 30), "bundled.gguf", lane_count=LANES)
        grammars = GrammarCompiler.for_model(bundled_model_path())
        runtime = StageRuntime(make_stage(29, 30), lane_count=LANES, ctx_size=CTX, grammars=grammars)
        server = StageServer(config, runtime)
        await server.start()
        return server

    server = asyncio.run_coroutine_threadsafe(start(), loop).result(60)
    yield server, loop
    asyncio.run_coroutine_threadsafe(server.close(), loop).result(60)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


class HeldWorker:
    """The stage's engine busy for `seconds`: frames sent meanwhile queue up and run as one wave."""

    def __init__(self, stage, seconds: float = 0.4):
        server, loop = stage
        self.done = asyncio.run_coroutine_threadsafe(server.engine.call(lambda: time.sleep(seconds)), loop)
        time.sleep(0.05)  # the engine has taken it

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.done.result(10)


def batches_of_two(server: StageServer) -> int:
    """Decode forwards of this stage that held 2 sessions' steps (GetStageStatus, §5.1)."""
    with Peer(server.endpoint) as peer:
        return peer.status().metrics.histograms["batch_steps"].counts[1]


def run_bystander(stage, misbehave=None) -> list[int]:
    """The bystander's tokens (its first, then DECODE_STEPS more); `misbehave(peer, at)` is
    called once with the bystander's frame `at` to send in the same wave ("prompt" or "decode")."""
    server, _ = stage
    request = Request(1, WIDTH, BYSTANDER)
    with Peer(server.endpoint) as me:
        me.send(request.configure())
        expect(me.reply(), ReplyKind.Ack)
        if misbehave is not None and misbehave.at == "prompt":
            misbehave(stage, me, request.prompt())
        else:
            me.send(request.prompt())
        tokens = [expect(me.reply(), ReplyKind.PredictedToken).predicted]
        for step in range(DECODE_STEPS):
            frame = request.decode(step, tokens[-1])
            if misbehave is not None and misbehave.at == "decode" and step == WAVE_STEP:
                misbehave(stage, me, frame)
            else:
                me.send(frame)
            tokens.append(expect(me.reply(), ReplyKind.PredictedToken).predicted)
        me.send(request.stop())
        expect(me.reply(), ReplyKind.Ack)  # its connection is still open after it all
    return tokens


def bad_rows(value: float, dtype=np.float32) -> memoryview:
    row = np.random.default_rng(5).standard_normal((1, WIDTH), dtype=np.float32)
    row[0, 17] = value
    if dtype == "bf16":
        return (row.view(np.uint32) >> 16).astype(np.uint16).data
    return row.astype(dtype).data


class Misbehaviour:
    """A second session, `sampling`, whose frame beside the bystander's is `frame(request, token)`
    (None: its ConfigureGeneration is what is wrong). `expected`: "closed" with `reason` logged,
    or the token it is served."""

    def __init__(self, name, sampling, frame=None, *, at="decode", reason=None, served=None):
        self.name, self.sampling, self.frame, self.at = name, sampling, frame, at
        self.reason, self.served = reason, served

    def __call__(self, stage, bystander: Peer, bystander_frame: StageMessage) -> None:
        server, _ = stage
        request = Request(2, WIDTH, self.sampling, seed=7)
        with Peer(server.endpoint) as bad:
            bad.send(request.configure())
            if self.frame is None:  # refused on arrival: it never reaches a wave
                assert bad.reply() is CLOSED
                bystander.send(bystander_frame)
                return
            expect(bad.reply(), ReplyKind.Ack)
            if self.at == "decode":
                bad.send(request.prompt())
                expect(bad.reply(), ReplyKind.PredictedToken)
            before = batches_of_two(server) if self.at == "decode" else None
            with HeldWorker(stage):
                bystander.send(bystander_frame)
                bad.send(self.frame(request))
            reply = bad.reply()
            if self.served is None:
                assert reply is CLOSED, reply
            else:
                assert expect(reply, ReplyKind.PredictedToken).predicted == self.served
            self.shared_wave = before is None or batches_of_two(server) > before


def decode_with(rows_view, dtype="f32", token=5):
    from skippy.protocol import ActivationDtype

    def frame(request: Request) -> StageMessage:
        return StageMessage(K.DecodeEmbd, pos_start=request.prompt_len, token_count=1, tokens=[token],
                            current_token=token, decode_step=1, activation_rows=1, activation_width=WIDTH,
                            activation=rows_view, activation_dtype=ActivationDtype[dtype], **request.ids)
    return frame


def prompt_with(tokens):
    def frame(request: Request) -> StageMessage:
        n = len(tokens)
        return StageMessage(K.PrefillFinalEmbd, pos_start=0, token_count=n, tokens=tokens, prompt_token_count=n,
                            activation_rows=n, activation_width=WIDTH,
                            activation=np.zeros((n, WIDTH), np.float32).data, **request.ids)
    return frame


HOT = SamplingConfig(temperature=0.7, seed=3)
ONLY_18 = GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps({"enum": ["a"]}))  # SmolLM2's first token: 18 alone
MISBEHAVIOURS = [
    Misbehaviour("inf_row", HOT, decode_with(bad_rows(math.inf)), reason="Expected finite activations"),
    Misbehaviour("nan_row_f16", HOT, decode_with(bad_rows(math.nan, np.float16), "f16"),
                 reason="Expected finite activations"),
    Misbehaviour("inf_row_bf16", HOT, decode_with(bad_rows(-math.inf, "bf16"), "bf16"),
                 reason="Expected finite activations"),
    # §3.4 allows a +inf bias: it forces its token, at any temperature
    Misbehaviour("inf_bias", SamplingConfig(temperature=0.7, seed=3, logit_bias={77: math.inf}),
                 decode_with(bad_rows(0.5)), served=77),
    Misbehaviour("oov_bias", SamplingConfig(temperature=0.7, logit_bias={OOV: 1.0}),
                 reason="Expected logit_bias token ids < 49152"),
    Misbehaviour("oov_history_with_penalties", SamplingConfig(temperature=0.7, repetition_penalty=1.3, seed=1),
                 decode_with(bad_rows(0.5), token=OOV), reason="Expected token ids in [0, 49152)"),
    Misbehaviour("prompt_logprobs_over_oov", SamplingConfig(logprobs=2, prompt_logprobs=True),
                 prompt_with([1, 2**31 - 1, 3]), at="prompt", reason="Expected token ids in [0, 49152)"),
    # a sampler with no token to draw (its grammar allows token 18 alone, its bias bans it): the
    # row fails after the forward the two prompts shared
    Misbehaviour("no_token_left", SamplingConfig(temperature=0.7, seed=3, grammar=ONLY_18, logit_bias={18: -math.inf}),
                 prompt_with([1, 2, 3]), at="prompt", reason="Expected some token with probability > 0"),
    Misbehaviour("no_token_left_greedy", SamplingConfig(grammar=ONLY_18, logit_bias={18: -math.inf}),
                 prompt_with([1, 2, 3]), at="prompt", reason="Expected some token the sampling settings allow"),
    Misbehaviour("bad_grammar", SamplingConfig(grammar=GrammarSpec(GrammarKind.JSON_SCHEMA, "{not json")),
                 reason="Expected a valid JSON Schema"),
]


@pytest.fixture(scope="module")
def alone(stage) -> list[int]:
    return run_bystander(stage)


@pytest.mark.parametrize("bad", MISBEHAVIOURS, ids=[m.name for m in MISBEHAVIOURS])
def test_a_misbehaving_session_leaves_its_wave_neighbour_as_if_alone(stage, alone, bad, caplog):
    caplog.set_level(logging.INFO, logger="skippy")
    server, _ = stage
    assert run_bystander(stage, bad) == alone
    assert getattr(bad, "shared_wave", True), "the two steps did not share a forward"
    closes = [r for r in caplog.records if "closing connection" in r.getMessage()]
    if bad.served is not None:
        assert not closes
    else:
        assert len(closes) == 1 and bad.reason in closes[0].getMessage(), [r.getMessage() for r in closes]
        assert closes[0].levelno == logging.WARNING and not closes[0].exc_info  # a peer's fault
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    deadline = time.monotonic() + 5
    while len(server.runtime.sessions) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(server.runtime.sessions) == 0



def closes_logged(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if "closing connection" in r.getMessage()]


def test_a_peer_that_resets_is_one_warning_line(stage, caplog):
    """A peer gone mid-frame (a reset) is its own fault: one WARNING with the reason, no traceback."""
    caplog.set_level(logging.INFO, logger="skippy")
    server, _ = stage
    peer = Peer(server.endpoint)
    frame = encode_message(Request(4, WIDTH, HOT).prompt())
    peer.sock.sendall(frame[:len(frame) // 2])
    time.sleep(0.1)
    peer.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    peer.close()  # an RST, not a FIN
    deadline = time.monotonic() + 5
    while not closes_logged(caplog) and time.monotonic() < deadline:
        time.sleep(0.02)
    [close] = closes_logged(caplog)
    assert "ConnectionResetError" in close.getMessage()
    assert close.levelno == logging.WARNING and not close.exc_info


def test_a_dial_that_gives_up_before_its_first_byte_is_no_fault(stage, caplog):
    """A peer that resets a lane it never wrote on (a readiness dial whose timeout passed) is
    not a fault: the lane closes without a warning, and the stage serves on."""
    caplog.set_level(logging.INFO, logger="skippy")
    server, _ = stage
    before = set(server.lanes)
    peer = Peer(server.endpoint)
    deadline = time.monotonic() + 5
    while set(server.lanes) == before and time.monotonic() < deadline:
        time.sleep(0.02)
    [lane_id] = set(server.lanes) - before
    peer.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    peer.close()  # an RST, not a FIN
    while lane_id in server.lanes and time.monotonic() < deadline:
        time.sleep(0.02)
    assert lane_id not in server.lanes  # the reset closed it
    assert not closes_logged(caplog) and not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert run_bystander(stage) == run_bystander(stage)


def test_an_internal_error_keeps_its_traceback(stage, caplog, monkeypatch):
    """What is not the peer's fault is ours: an ERROR with the traceback."""
    caplog.set_level(logging.INFO, logger="skippy")
    server, _ = stage

    def broken(*args, **kwargs):
        raise RuntimeError("a bug of ours")

    monkeypatch.setattr(server.runtime.runner, "configure", broken)
    with Peer(server.endpoint) as peer:
        peer.send(Request(5, WIDTH, HOT).configure())
        assert peer.reply() is CLOSED
    [close] = closes_logged(caplog)
    assert "RuntimeError: a bug of ours" in close.getMessage()
    assert close.levelno == logging.ERROR and close.exc_info


def wait_for(predicate, timeout_s: float = 5.0):
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()) and time.monotonic() < deadline:
        time.sleep(0.02)
    return value


@pytest.fixture
def returns(stage, monkeypatch):
    """Stage 0's return listener for the final stage's streams: (its port, prediction), where
    prediction(request) is a future of the request's next prediction on its stream."""
    from skippy.stage.returns import ReturnInbox, ReturnListener

    server, loop = stage
    inbox = ReturnInbox(server.engine)  # stage 0's end, here on the final stage's own engine
    listener = ReturnListener(inbox, server.transport)
    endpoint = asyncio.run_coroutine_threadsafe(listener.start(), loop).result(10)
    monkeypatch.setattr(server.returns, "driver_endpoint", endpoint)

    queues: dict[tuple[int, int], asyncio.Queue] = {}

    def queue_of(key: tuple[int, int]) -> asyncio.Queue:
        if key not in queues:
            queue = queues[key] = asyncio.Queue()
            inbox.handlers[key] = lambda reply: loop.call_soon_threadsafe(queue.put_nowait, reply)
        return queues[key]

    def prediction(request: Request):
        queue = queue_of((request.ids["request_id"], request.session_id))  # before its frame is sent

        async def take():
            return await asyncio.wait_for(queue.get(), 10)
        return asyncio.run_coroutine_threadsafe(take(), loop)

    yield int(endpoint.rsplit(":", 1)[1]), prediction
    asyncio.run_coroutine_threadsafe(listener.close(), loop).result(10)


def test_a_replaced_session_releases_its_return_stream_and_kv(stage, returns):
    """Configure(A), then Configure(B) on the same session id: B replaces A, and A's return
    stream and KV go with it (issue 43, defect 2: the streams to stage 0 went 1 -> 2)."""
    server, _ = stage
    port, prediction = returns

    def kv_bytes() -> int:
        with Peer(server.endpoint) as peer:
            return peer.status().metrics.gauges["kv_session_bytes"]

    first, second, third = (Request(7, WIDTH, HOT, request_id=r) for r in (70, 71, 72))
    if True:
        with Peer(server.endpoint) as peer:
            peer.send(first.configure())
            expect(peer.reply(), ReplyKind.Ack)
            assert wait_for(lambda: established(port) == 1)
            token = prediction(first)
            peer.send(first.prompt())
            assert expect(token.result(10), ReplyKind.PredictedToken)
            one_session = kv_bytes()
            assert one_session > 0

            peer.send(second.configure())  # the same session id, a new request
            expect(peer.reply(), ReplyKind.Ack)
            assert wait_for(lambda: established(port) == 1), established(port)
            assert len(server.returns) == 1
            assert kv_bytes() == 0  # A's KV went with A; B has written none yet
            token = prediction(second)
            peer.send(second.prompt())
            assert expect(token.result(10), ReplyKind.PredictedToken)
            assert kv_bytes() == one_session

            peer.send(third.prompt())  # a request that never configured replaces it too
            assert expect(peer.reply(), ReplyKind.PredictedToken)  # no stream: the reply comes upstream
            assert wait_for(lambda: established(port) == 0) and len(server.returns) == 0
            assert kv_bytes() == one_session
            peer.send(third.stop())
            expect(peer.reply(), ReplyKind.Ack)
        assert wait_for(lambda: len(server.runtime.sessions) == 0)
        assert kv_bytes() == 0


# -- every count a peer controls is bounded (docs/protocol.md §8): each at its limit + 1 ------
def patched(frame: bytes, offset: int, fmt: str, value: int) -> bytes:
    return frame[:offset] + struct.pack("<" + fmt, value) + frame[offset + struct.calcsize(fmt):]


def header(frame: bytes, name: str, value: int) -> bytes:
    spec = next(f for f in MESSAGE_HEADER_FIELDS if f.name == name)
    return patched(frame, header_offset(MESSAGE_HEADER_FIELDS, name), spec.fmt, value)


def sampling_field(frame: bytes, name: str, value: int) -> bytes:
    """A ConfigureGeneration's sampling-block field (the block follows the 104-byte header)."""
    spec = next(f for f in SAMPLING_FIELDS if f.name == name)
    return patched(frame, MESSAGE_HEADER.size + header_offset(SAMPLING_FIELDS, name), spec.fmt, value)


REQUEST = Request(9, WIDTH, SamplingConfig(temperature=0.5, seed=1, logprobs=1))
CONFIGURE = encode_message(REQUEST.configure())
DECODE = encode_message(REQUEST.decode(0, 5))


def f16_rows(n: int, **fields) -> StageMessage:
    from skippy.protocol import ActivationDtype

    return StageMessage(activation_rows=n, activation_width=WIDTH, activation_dtype=ActivationDtype.f16,
                        activation=np.zeros((n, WIDTH), np.float16).data, **REQUEST.ids, **fields)


def window(window_id: int, rows: int) -> StageMessage:
    return f16_rows(rows, kind=K.VerifyWindow, pos_start=REQUEST.prompt_len, token_count=rows,
                    tokens=[5] * rows, current_token=5, seq_id=window_id, prompt_token_count=REQUEST.prompt_len)


def configured(*frames) -> list:
    return [CONFIGURE, encode_message(REQUEST.prompt()), *frames]


LIMITS = [  # (count, frames on one connection: the last one is past the limit, reason)
    ("token_sideband_count", [header(DECODE, "token_sideband_count", MAX_SIDEBAND_COUNT + 1)],
     "token_sideband_count: expected 0..1048576"),
    ("position_sideband_count", [header(DECODE, "position_sideband_count", MAX_SIDEBAND_COUNT + 1)],
     "position_sideband_count: expected 0..1048576"),
    ("activation_bytes", [header(DECODE, "activation_bytes", MAX_ACTIVATION_BYTES + 1)], "activation_bytes"),
    ("sampling_bytes", [header(CONFIGURE, "sampling_bytes", MAX_SAMPLING_BYTES + 1)], "sampling_bytes"),
    ("metadata_bytes", [header(CONFIGURE, "metadata_bytes", MAX_METADATA_BYTES + 1)], "metadata_bytes"),
    ("logit_bias_count", [sampling_field(CONFIGURE, "logit_bias_count", MAX_LOGIT_BIAS_COUNT + 1)],
     "logit_bias_count"),
    ("grammar_bytes", [sampling_field(CONFIGURE, "grammar_bytes", MAX_GRAMMAR_BYTES + 1)], "grammar_bytes"),
    ("logprobs", [sampling_field(CONFIGURE, "logprobs", MAX_TOP_LOGPROBS + 1)], "sampling.logprobs"),
    ("decode_step", [header(CONFIGURE, "decode_step", -1)], "Expected decode_step >= 0"),
    ("prompt_token_count", [header(CONFIGURE, "prompt_token_count", CTX + 1)], "Expected prompt_token_count <="),
    ("token_count", [CONFIGURE, encode_message(f16_rows(CTX + 1, kind=K.PrefillFinalEmbd, token_count=CTX + 1))],
     "context size is 2048"),
    ("window_rows", configured(encode_message(window(1, MAX_WINDOW_ROWS + 1))),
     f"Expected a verify window of at most {MAX_WINDOW_ROWS} rows"),
    ("open_windows", configured(*(encode_message(window(i, 1)) for i in range(MAX_OPEN_WINDOWS + 1))),
     f"Expected at most {MAX_OPEN_WINDOWS} verify windows"),
    ("prompt_logprob_rows", [encode_message(StageMessage(
        K.ConfigureGeneration, sampling=SamplingConfig(logprobs=0, prompt_logprobs=True),
        prompt_token_count=MAX_PROMPT_LOGPROB_ROWS + 1, **REQUEST.ids)),
        encode_message(f16_rows(MAX_PROMPT_LOGPROB_ROWS + 1, kind=K.PrefillFinalEmbd,
                                token_count=MAX_PROMPT_LOGPROB_ROWS + 1,
                                prompt_token_count=MAX_PROMPT_LOGPROB_ROWS + 1))],
     f"Expected a prompt chunk of at most {MAX_PROMPT_LOGPROB_ROWS} rows"),
    ("sessions", [encode_message(StageMessage(K.ConfigureGeneration, request_id=i, session_id=i))
                  for i in range(LANES + 1)], "lane_count"),
    ("trim", configured(encode_message(StageMessage(K.TrimSession, token_count=REQUEST.prompt_len + 2,
                                                    **REQUEST.ids))), "cannot trim"),
    ("pos_start", configured(encode_message(REQUEST.decode(5, 5))), "is past the session's"),
]


@pytest.mark.parametrize("name, frames, reason", LIMITS, ids=[case[0] for case in LIMITS])
def test_every_count_a_peer_sends_is_refused_past_its_bound(stage, caplog, name, frames, reason):
    caplog.set_level(logging.INFO, logger="skippy")
    server, _ = stage
    with Peer(server.endpoint) as peer:
        for frame in frames:
            peer.send(frame)
        replies = peer.replies_until_close()  # the stage closes it, nothing owed
    [close] = closes_logged(caplog)
    assert reason in close.getMessage() and close.levelno == logging.WARNING and not close.exc_info
    assert all(reply.kind != ReplyKind.StageStatus for reply in replies)
    assert wait_for(lambda: len(server.runtime.sessions) == 0)


def test_frames_read_past_the_read_ahead_while_the_engine_is_busy_keep_their_order(stage, caplog):
    """More frames than the read-ahead holds (128), all read at once behind a busy engine, then
    EOF: reading pauses and resumes with the rest, and every frame is taken in order, so the
    window past the bound is the one refused (not a frame taken twice or skipped at the end)."""
    caplog.set_level(logging.INFO, logger="skippy")
    server, _ = stage
    _, frames, reason = next(case for case in LIMITS if case[0] == "open_windows")
    assert len(frames) > 128
    with Peer(server.endpoint) as peer, HeldWorker(stage, 0.5):
        for frame in frames:
            peer.send(frame)
        replies = peer.replies_until_close()
    [close] = closes_logged(caplog)
    assert reason in close.getMessage() and close.levelno == logging.WARNING
    assert all(reply.kind != ReplyKind.StageStatus for reply in replies)
    assert wait_for(lambda: len(server.runtime.sessions) == 0)


def test_the_largest_decode_step_is_served_in_constant_time(stage):
    """decode_step = 2^31 - 1 (the i32's largest): the sampler jumps past that many draws."""
    server, _ = stage
    request = Request(10, WIDTH, SamplingConfig(temperature=1.0, seed=4))
    with Peer(server.endpoint) as peer:
        started = time.perf_counter()
        peer.send(header(encode_message(request.configure()), "decode_step", 2**31 - 1))
        expect(peer.reply(), ReplyKind.Ack)
        assert time.perf_counter() - started < 1.0  # drawing them took 0.79 s for 2^27
        peer.send(request.prompt())
        expect(peer.reply(), ReplyKind.PredictedToken)


def test_discarded_window_ranges_are_the_newest_only(stage):
    """A session keeps its newest MAX_DISCARD_RANGES DiscardStaleWindows ranges: a window in an
    older one is run again (the final stage skips only what it still knows to be stale)."""
    server, _ = stage
    discard = [encode_message(StageMessage(K.DiscardStaleWindows, tokens=[w, w], **REQUEST.ids))
               for w in [0, *range(10, 10 + MAX_DISCARD_RANGES)]]
    with Peer(server.endpoint) as peer:
        peer.send(CONFIGURE, encode_message(REQUEST.prompt()))
        expect(peer.reply(), ReplyKind.Ack)
        expect(peer.reply(), ReplyKind.PredictedToken)
        peer.send(*discard[:2], encode_message(window(10, 1)), encode_message(window(11, 1)))  # 10 is stale
        assert expect(peer.reply(), ReplyKind.PredictedTokens).window_id == 11
        peer.send(*discard[2:], encode_message(window(0, 1)))  # 0's range is the oldest of 129: gone
        assert expect(peer.reply(), ReplyKind.PredictedTokens).window_id == 0


def test_a_lane_with_a_return_stream_refuses_a_non_finite_row(stage, returns, caplog):
    """A session decoding alone, its tokens on the direct return stream (written by the engine
    as its forward ends): its step is checked as any other, and the refusal closes the lane
    with the reason."""
    caplog.set_level(logging.INFO, logger="skippy")
    server, _ = stage
    _, prediction = returns
    request = Request(11, WIDTH, HOT)
    with Peer(server.endpoint) as peer:
        peer.send(request.configure())
        expect(peer.reply(), ReplyKind.Ack)
        token = prediction(request)
        peer.send(request.prompt())
        tokens = [expect(token.result(10), ReplyKind.PredictedToken).predicted]
        for step in range(4):
            token = prediction(request)
            peer.send(request.decode(step, tokens[-1]))
            tokens.append(expect(token.result(10), ReplyKind.PredictedToken).predicted)
        peer.send(dataclasses.replace(request.decode(4, tokens[-1]), activation=bad_rows(math.nan)))
        assert peer.reply() is CLOSED
    assert wait_for(lambda: len(server.returns) == 0)  # its stream closed with the lane
    [close] = closes_logged(caplog)
    assert "Expected finite activations" in close.getMessage() and close.levelno == logging.WARNING
