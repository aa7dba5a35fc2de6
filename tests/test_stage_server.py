"""Protocol robustness at the server: bad frames close only their connection (spec §2.1-2.2).

The server under test is a final stage holding one layer, so every request is cheap.
Without a driver endpoint its predictions come back upstream (the relay fallback).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chain_support import blocking_connect, read_until_eof, run, stage_config
from skippy.protocol import (
    FrameError, MessageKind, ReplyKind, StageMessage, StageReplyStats, client_handshake,
    encode_message,
    read_reply, write_message,
)
from skippy.protocol.constants import MESSAGE_HEADER_FIELDS, PROTOCOL_VERSION, header_offset
from skippy.runtime.stage_runtime import StageRuntime
from skippy.stage.server import StageServer

WIDTH = 576


async def start_server(make_stage, **options) -> StageServer:
    lane_count = options.pop("lane_count", 4)
    config = stage_config(1, (29, 30), "bundled.gguf", lane_count=lane_count, **options)
    server = StageServer(config, StageRuntime(make_stage(29, 30), lane_count=lane_count))
    await server.start()
    return server


async def connect(server: StageServer, token: str | None = None):
    host, port = server.endpoint.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    await client_handshake(reader, writer, token)
    return reader, writer


def prefill_final(session_id: int = 1, rows: int = 3) -> StageMessage:
    activation = np.random.default_rng(rows).standard_normal((rows, WIDTH), dtype=np.float32)
    return StageMessage(MessageKind.PrefillFinalEmbd, pos_start=0, token_count=rows,
                        request_id=session_id, session_id=session_id, tokens=list(range(rows)),
                        source_stage_index=0, activation_rows=rows, activation_width=WIDTH,
                        activation=activation.data)


async def predict(reader, writer, session_id: int = 1) -> int:
    """A full request on a good connection: configure, one prefill-final, the token, Stop."""
    common = dict(request_id=session_id, session_id=session_id)
    await write_message(writer, StageMessage(MessageKind.ConfigureGeneration, **common))
    assert (await read_reply(reader)).kind == ReplyKind.Ack
    await write_message(writer, prefill_final(session_id))
    reply = await read_reply(reader)
    assert reply.kind == ReplyKind.PredictedToken
    await write_message(writer, StageMessage(MessageKind.Stop, **common))
    assert (await read_reply(reader)).kind == ReplyKind.Ack
    return reply.predicted


async def expect_closed(reader, timeout: float = 10.0) -> None:
    """The server closes the connection: EOF (or a reset) without any reply."""
    try:
        data = await asyncio.wait_for(reader.read(), timeout)
    except ConnectionResetError:
        return
    assert data == b""


def _patched(frame: bytes, field: str, fmt: str, value: int) -> bytes:
    offset = header_offset(MESSAGE_HEADER_FIELDS, field)
    return frame[:offset] + struct.pack("<" + fmt, value) + frame[offset + struct.calcsize(fmt):]


GOOD = encode_message(prefill_final())
BAD_FRAMES = [
    # (case,                       bytes,                                              logged)
    ("garbage",                    b"\x00\x01garbage" * 20,                            "magic"),
    ("truncated body",             GOOD[:-100],                                        "truncated"),
    ("truncated header",           GOOD[:50],                                          "truncated"),
    ("oversized activation",       _patched(GOOD, "activation_bytes", "Q", 1 << 40),    "activation_bytes"),
    ("phase does not match kind",  _patched(GOOD, "phase", "i", 2),                    "phase"),
    ("unknown kind",               _patched(GOOD, "kind", "i", 99),                    "kind"),
    ("other protocol version",     _patched(GOOD, "version", "i", PROTOCOL_VERSION + 1), "version"),
    ("negative token count",       _patched(GOOD, "token_count", "i", -1),             "token_count"),
    ("rows disagree with tokens",  _patched(GOOD, "token_count", "i", 2),              "activation"),
    ("return-open on a stage",     encode_message(StageMessage(MessageKind.PredictionReturnOpen)),
                                                                                       "PredictionReturnOpen"),
]


def test_bad_frames_close_only_their_connection(make_stage, caplog):
    caplog.set_level(logging.WARNING, logger="skippy.stage")

    async def main():
        server = await start_server(make_stage)
        try:
            good = await connect(server)
            expected = await predict(*good)
            for case, frame, logged in BAD_FRAMES:
                caplog.clear()
                reader, writer = await connect(server)
                writer.write(frame)
                writer.write_eof()
                await expect_closed(reader)
                writer.close()
                assert "closing connection" in caplog.text and logged in caplog.text, case
                # the stage keeps serving the good connection, with the same answer
                assert await predict(*good) == expected, case
            assert len(server.runtime.sessions) == 0
        finally:
            await server.close()

    run(main())


@pytest.fixture(scope="module")
def background_server(make_stage):
    """A stage server on its own event loop thread, for blocking-socket clients."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server = asyncio.run_coroutine_threadsafe(start_server(make_stage), loop).result(60)
    yield server
    asyncio.run_coroutine_threadsafe(server.close(), loop).result(60)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, len(GOOD) - 1), st.integers(1, 255)), min_size=1,
                max_size=4),
       st.integers(0, len(GOOD)))
def test_mutated_or_cut_frames_never_take_the_stage_down(background_server, flips, cut):
    """Flip bytes of a valid frame and cut it anywhere: the connection either gets its
    answer or is closed, and a good client is always served afterwards."""
    frame = bytearray(GOOD)
    for position, mask in flips:
        frame[position] ^= mask
    with blocking_connect(background_server) as sock:
        sock.sendall(bytes(frame[:cut]))
        sock.shutdown(socket.SHUT_WR)
        read_until_eof(sock)
    with blocking_connect(background_server) as sock:   # the stage still serves
        sock.sendall(encode_message(prefill_final(session_id=7)))
        sock.sendall(encode_message(StageMessage(MessageKind.Stop, request_id=7, session_id=7)))
        sock.shutdown(socket.SHUT_WR)
        replies = read_until_eof(sock)
        assert replies.count(b"SRPY"[::-1]) == 2   # PredictedToken, then the Stop ACK


def test_wrong_auth_token_is_refused_with_a_logged_reason(make_stage, caplog):
    caplog.set_level(logging.WARNING, logger="skippy.stage")

    async def main():
        server = await start_server(make_stage, auth_token="s3cret")
        try:
            with pytest.raises(FrameError, match="refuse"):
                await connect(server, token="wrong")
            # a dialer without the token: its first frame is read as a bad preamble
            host, port = server.endpoint.rsplit(":", 1)
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(GOOD)
            await expect_closed(reader)
            writer.close()
            assert len(server.refusals) == 2
            assert all("AuthError" in reason for reason in server.refusals)
            assert await predict(*await connect(server, token="s3cret")) >= 0
        finally:
            await server.close()

    run(main())
    assert "refused connection" in caplog.text and "auth token" in caplog.text


def test_a_connection_that_ends_without_stop_has_its_sessions_reclaimed(make_stage, caplog):
    caplog.set_level(logging.INFO, logger="skippy.stage")

    async def main():
        server = await start_server(make_stage)
        try:
            reader, writer = await connect(server)
            for session_id in (1, 2):
                await write_message(writer, StageMessage(
                    MessageKind.ConfigureGeneration, request_id=session_id, session_id=session_id))
                assert (await read_reply(reader)).kind == ReplyKind.Ack
            assert len(server.runtime.sessions) == 2
            writer.close()
            for _ in range(100):
                if not len(server.runtime.sessions):
                    break
                await asyncio.sleep(0.02)
            assert len(server.runtime.sessions) == 0
        finally:
            await server.close()

    run(main())
    assert "reclaimed 2 session(s)" in caplog.text


def test_sessions_beyond_lane_count_are_refused(make_stage, caplog):
    caplog.set_level(logging.WARNING, logger="skippy.stage")

    async def main():
        server = await start_server(make_stage, lane_count=1)
        try:
            first = await connect(server)
            await write_message(first[1], StageMessage(MessageKind.ConfigureGeneration,
                                                       request_id=1, session_id=1))
            assert (await read_reply(first[0])).kind == ReplyKind.Ack
            reader, writer = await connect(server)
            await write_message(writer, StageMessage(MessageKind.ConfigureGeneration,
                                                     request_id=2, session_id=2))
            await expect_closed(reader)
            writer.close()
            await write_message(first[1], StageMessage(MessageKind.Stop, request_id=1,
                                                       session_id=1))
            assert (await read_reply(first[0])).kind == ReplyKind.Ack
            assert await predict(*first, session_id=3) >= 0   # the lane is free again
        finally:
            await server.close()

    run(main())
    assert "lane_count" in caplog.text


def test_prefix_restore_is_a_miss_with_neutral_stats(make_stage):
    """A stage without a prefix cache: TryRestorePrefill(Decode) answer an ACK with all-zero
    stats (its upstream counts that neutral reply as a miss, spec §4.4)."""
    async def main():
        server = await start_server(make_stage)
        try:
            reader, writer = await connect(server)
            for kind in (MessageKind.TryRestorePrefill, MessageKind.TryRestorePrefillDecode):
                await write_message(writer, StageMessage(kind, request_id=1, session_id=1,
                                                         tokens=[1, 2, 3]))
                reply = await read_reply(reader)
                assert reply.kind == ReplyKind.Ack and reply.stats == StageReplyStats()
            assert await predict(reader, writer) >= 0
        finally:
            await server.close()

    run(main())


def test_a_taken_port_fails_fast_with_its_own_exit_status():
    """`skippy stage` binds before loading the model; launchers retry on this status."""
    from skippy.stage.process import EXIT_ADDRESS_IN_USE, bind_listener

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit) as exit_info:
            bind_listener(stage_config(1, (29, 30), "x.gguf", bind_addr=f"127.0.0.1:{port}"))
    assert exit_info.value.code == EXIT_ADDRESS_IN_USE
