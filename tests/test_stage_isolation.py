"""One bad peer never touches another user's stream (issue 43), at a live final stage.

Two sessions on two connections share one wave of the stage's worker (held busy while both
frames arrive); one of them misbehaves. The other's tokens are those of a run alone, its
connection stays open, and the misbehaving one either fails alone with a named reason (one
WARNING line, no traceback) or, where the protocol gives its frame a meaning, is served.
"""

from __future__ import annotations

import asyncio
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
from skippy.protocol.constants import ReplyKind
from skippy.protocol.sampling_config import GrammarSpec
from skippy.runtime.engine import StageRuntime
from skippy.stage.server import StageServer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from stage_peer import CLOSED, K, Peer, Request, established, expect  # noqa: E402

WIDTH = 576
DECODE_STEPS = 6
WAVE_STEP = 2  # the bystander's decode step that shares its wave with the misbehaving frame
BYSTANDER = SamplingConfig(temperature=0.7, top_p=0.95, seed=11)
OOV = 1_000_000


@pytest.fixture(scope="module")
def stage(make_stage):
    """A final stage holding one layer, on an event loop thread of its own: (server, loop)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start():
        config = stage_config(1, (29, 30), "bundled.gguf", lane_count=8)
        grammars = GrammarCompiler.for_model(bundled_model_path())
        server = StageServer(config, StageRuntime(make_stage(29, 30), lane_count=8, grammars=grammars))
        await server.start()
        return server

    server = asyncio.run_coroutine_threadsafe(start(), loop).result(60)
    yield server, loop
    asyncio.run_coroutine_threadsafe(server.close(), loop).result(60)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


class HeldWorker:
    """The stage's worker busy for `seconds`: frames sent meanwhile queue up and run as one wave."""

    def __init__(self, stage, seconds: float = 0.4):
        server, loop = stage
        self.done = asyncio.run_coroutine_threadsafe(server.runtime.call(lambda: time.sleep(seconds)), loop)
        time.sleep(0.05)  # the worker has taken it

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


def test_a_replaced_session_releases_its_return_stream_and_kv(stage, monkeypatch):
    """Configure(A), then Configure(B) on the same session id: B replaces A, and A's return
    stream and KV go with it (issue 43, defect 2: the streams to stage 0 went 1 -> 2)."""
    from skippy.stage.prediction_return import PredictionHub, ReturnListener

    server, loop = stage
    hub = PredictionHub()
    listener = ReturnListener(hub)
    endpoint = asyncio.run_coroutine_threadsafe(listener.start(), loop).result(10)
    port = int(endpoint.rsplit(":", 1)[1])
    monkeypatch.setattr(server.returns, "driver_endpoint", endpoint)  # stage 0's return listener

    def prediction(request: Request) -> int:
        async def take():
            queue = hub.register((request.ids["request_id"], request.session_id))
            return await asyncio.wait_for(queue.get(), 10)
        return asyncio.run_coroutine_threadsafe(take(), loop)

    def kv_bytes() -> int:
        with Peer(server.endpoint) as peer:
            return peer.status().metrics.gauges["kv_session_bytes"]

    first, second, third = (Request(7, WIDTH, HOT, request_id=r) for r in (70, 71, 72))
    try:
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
    finally:
        asyncio.run_coroutine_threadsafe(listener.close(), loop).result(10)
