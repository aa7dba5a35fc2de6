"""Protocol fuzzing at a live stage: 10,000 mutated frames, each on a connection that has
completed a valid handshake (bit flips, truncations, lengths past the limits, kinds out of
order, unknown sessions, windows for stopped sessions). The stage stays up, a good client is
served the same answer throughout, every connection it closed without an answer has a logged
reason, and its session table ends as it began (no leaked sessions or KV)."""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from chain_support import blocking_connect, read_until_eof, stage_config
from skippy.protocol import MessageKind, SamplingConfig, StageMessage, encode_message
from skippy.protocol.constants import (
    MESSAGE_HEADER, MESSAGE_HEADER_FIELDS, REPLY_HEADER, STATS_BLOCK, ReplyKind, header_offset,
)
from skippy.protocol.frames import decode_reply_body, parse_reply_header
from skippy.runtime.stage_runtime import StageRuntime
from skippy.stage.server import StageServer

pytestmark = pytest.mark.slow

NUM_FRAMES = 10_000
WIDTH = 576
K = MessageKind
# Header fields whose values bound what the reader allocates or checks: set past the limits.
LENGTH_FIELDS = [("activation_bytes", "Q"), ("token_count", "i"), ("token_sideband_count", "i"),
                 ("position_sideband_count", "i"), ("activation_rows", "i"), ("activation_width", "i"),
                 ("sampling_bytes", "I"), ("metadata_bytes", "I"), ("pos_start", "i"), ("seq_id", "i")]
EXTREMES = {"Q": [1 << 40, (1 << 64) - 1], "i": [-1, -(1 << 31), (1 << 31) - 1, 1 << 24],
            "I": [1 << 24, (1 << 32) - 1]}


def rows(n: int, seed: int) -> memoryview:
    return np.random.default_rng(seed).standard_normal((n, WIDTH), dtype=np.float32).data


def valid_frames(session_id: int, rng: np.random.Generator) -> list[bytes]:
    """One frame of every kind a stage executes, for `session_id` (as a well-behaved
    upstream would send them, in order)."""
    n = int(rng.integers(1, 4))
    common = dict(request_id=session_id, session_id=session_id)
    messages = [
        StageMessage(K.ConfigureGeneration, sampling=SamplingConfig(temperature=0.7, seed=3), **common),
        StageMessage(K.PrefillEmbd, pos_start=0, token_count=n, tokens=list(range(n)), activation_rows=n,
                     activation_width=WIDTH, activation=rows(n, n), **common),
        StageMessage(K.PrefillFinalEmbd, pos_start=n, token_count=1, tokens=[5], activation_rows=1,
                     activation_width=WIDTH, activation=rows(1, 1), **common),
        StageMessage(K.DecodeEmbd, pos_start=n + 1, token_count=1, tokens=[6], current_token=6,
                     activation_rows=1, activation_width=WIDTH, activation=rows(1, 2), **common),
        StageMessage(K.VerifyWindow, pos_start=n + 2, token_count=2, tokens=[7, 8], current_token=7,
                     seq_id=4, activation_rows=2, activation_width=WIDTH, activation=rows(2, 3), **common),
        StageMessage(K.RetireVerifyWindow, pos_start=n + 2, token_count=1, **common),
        StageMessage(K.DiscardStaleWindows, tokens=[4, 5], **common),
        StageMessage(K.TrimSession, token_count=n, **common),
        StageMessage(K.TryRestorePrefill, token_count=n, tokens=list(range(n)), **common),
        StageMessage(K.GetStageStatus),
        StageMessage(K.Stop, **common),
    ]
    return [encode_message(m) for m in messages]


def patched(frame: bytes, field: str, fmt: str, value: int) -> bytes:
    offset = header_offset(MESSAGE_HEADER_FIELDS, field)
    return frame[:offset] + struct.pack("<" + fmt, value) + frame[offset + struct.calcsize(fmt):]


def case(index: int) -> tuple[str, list[bytes]]:
    """(mutation class, frames to send on one fresh connection) for fuzz case `index`."""
    rng = np.random.default_rng(index)
    session_id = 1000 + index
    frames = valid_frames(session_id, rng)
    configure, body = frames[0], frames[1:]
    kind = ("bit_flip", "truncation", "length_past_limit", "out_of_order", "unknown_session",
            "stale_window")[index % 6]
    if kind == "bit_flip":
        frame = bytearray(frames[int(rng.integers(len(frames)))])
        for _ in range(int(rng.integers(1, 5))):
            frame[int(rng.integers(len(frame)))] ^= 1 << int(rng.integers(8))
        return kind, [configure, bytes(frame)]
    if kind == "truncation":
        frame = frames[int(rng.integers(len(frames)))]
        return kind, [configure, frame[:int(rng.integers(1, len(frame)))]]
    if kind == "length_past_limit":
        field, fmt = LENGTH_FIELDS[int(rng.integers(len(LENGTH_FIELDS)))]
        values = EXTREMES[fmt]
        frame = body[int(rng.integers(len(body)))]
        return kind, [configure, patched(frame, field, fmt, values[int(rng.integers(len(values)))])]
    if kind == "out_of_order":  # any frame before its session is configured, or a shuffled request
        order = rng.permutation(len(frames))
        return kind, [frames[i] for i in order[:int(rng.integers(1, len(frames) + 1))]]
    if kind == "unknown_session":  # a session configured, then frames for another one
        other = valid_frames(session_id + 500_000, rng)[1:]
        return kind, [configure, other[int(rng.integers(len(other)))]]
    # a request run to its Stop, then a window (or a decode) for the stopped session
    late = [frames[4], frames[3], frames[5]][int(rng.integers(3))]
    return kind, [configure, frames[2], frames[-1], late]


@pytest.fixture(scope="module")
def live_stage(make_stage):
    """A final stage holding one layer (cheap steps), on an event loop thread of its own."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start():
        config = stage_config(1, (29, 30), "bundled.gguf", lane_count=64)
        server = StageServer(config, StageRuntime(make_stage(29, 30), lane_count=64))
        await server.start()
        return server

    server = asyncio.run_coroutine_threadsafe(start(), loop).result(60)
    yield server
    asyncio.run_coroutine_threadsafe(server.close(), loop).result(60)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def send(server: StageServer, frames: list[bytes]) -> bytes:
    """Handshake, send `frames`, half-close, and read until the stage closes; its replies."""
    with blocking_connect(server, timeout_s=30) as sock:
        try:
            for frame in frames:
                sock.sendall(frame)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the stage already closed (or reset) on an earlier frame
        return read_until_eof(sock)


def parse_replies(data: bytes) -> list:
    """The replies in a stream of reply frames, as (kind, predicted token)."""
    out, offset = [], 0
    while offset < len(data):
        header = parse_reply_header(data[offset:offset + REPLY_HEADER.size])
        end = offset + REPLY_HEADER.size + STATS_BLOCK.size + header.body_bytes
        reply = decode_reply_body(header, data[offset + REPLY_HEADER.size:end])
        out.append((reply.kind, reply.predicted if reply.kind == ReplyKind.PredictedToken else None))
        offset = end
    return out


def good_request(server: StageServer) -> list:
    """Configure, a 3-row prompt, Stop: ACK, the predicted token, the Stop ACK."""
    common = dict(request_id=1, session_id=1)
    prompt = StageMessage(K.PrefillFinalEmbd, pos_start=0, token_count=3, tokens=[1, 2, 3], activation_rows=3,
                          activation_width=WIDTH, activation=rows(3, 0), **common)
    return parse_replies(send(server, [encode_message(StageMessage(K.ConfigureGeneration, **common)),
                                       encode_message(prompt), encode_message(StageMessage(K.Stop, **common))]))


def test_ten_thousand_mutated_frames_leave_the_stage_serving(live_stage, caplog):
    caplog.set_level(logging.WARNING, logger="skippy.stage")
    expected = good_request(live_stage)
    assert [kind for kind, _ in expected] == [ReplyKind.Ack, ReplyKind.PredictedToken, ReplyKind.Ack]
    baseline = len(live_stage.runtime.sessions)
    classes: Counter = Counter()
    unanswered = 0
    with ThreadPoolExecutor(8) as pool:
        cases = [case(i) for i in range(NUM_FRAMES)]
        for (kind, frames), replies in zip(cases, pool.map(lambda c: send(live_stage, c[1]), cases)):
            classes[kind] += 1
            unanswered += len(replies) == 0
            if len(classes) and sum(classes.values()) % 2500 == 0:
                assert good_request(live_stage) == expected  # served the same throughout
    assert sum(classes.values()) == NUM_FRAMES and min(classes.values()) >= NUM_FRAMES // 6
    assert good_request(live_stage) == expected
    for _ in range(200):  # connections still being torn down reclaim their sessions
        if len(live_stage.runtime.sessions) == baseline:
            break
        threading.Event().wait(0.05)
    assert len(live_stage.runtime.sessions) == baseline
    closes = [r.getMessage() for r in caplog.records if "closing connection" in r.getMessage()]
    assert all(message.split(": ", 2)[-1] for message in closes)  # every close says why
    assert len(closes) >= unanswered  # no connection was dropped without a logged reason
    print(f"fuzz: {dict(classes)}, {unanswered} connections closed unanswered, "
          f"{len(closes)} logged closes; header {MESSAGE_HEADER.size} bytes")
