"""Frame I/O over asyncio streams: round trips, clean vs mid-frame EOF, limits before reads."""

from __future__ import annotations

import asyncio
import socket
import struct

import numpy as np
import pytest

from skippy.protocol import (
    FrameError, MessageKind, SamplingConfig, StageMessage, StageReply, StageReplyStats,
    VersionMismatch, encode_message, encode_reply, read_message, read_reply, write_message,
    write_reply,
)
from skippy.protocol.constants import (
    MAX_ACTIVATION_BYTES, MESSAGE_HEADER, MESSAGE_HEADER_FIELDS, REPLY_HEADER, header_offset,
)

K = MessageKind

MESSAGES = [
    StageMessage(K.ConfigureGeneration, request_id=1, session_id=2,
                 sampling=SamplingConfig(temperature=0.8, seed=7), chat_metadata=b"{}"),
    StageMessage(K.PrefillEmbd, token_count=3, tokens=[1, 2, 3], request_id=1, session_id=2),
    StageMessage(K.PrefillFinalEmbd, pos_start=3, token_count=2, tokens=[4, 5],
                 source_stage_index=0, activation_rows=2, activation_width=4096,
                 activation=np.random.default_rng(0).standard_normal((2, 4096), dtype=np.float32)),
    StageMessage(K.Stop, request_id=1, session_id=2),
]


def _reader(data: bytes, *, eof: bool = True) -> asyncio.StreamReader:
    """A StreamReader holding `data` (call inside a running loop)."""
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    if eof:
        reader.feed_eof()
    return reader


def _read_all(read, data: bytes) -> list:
    """Run `read` on a reader holding `data` until it returns None or raises."""
    async def scenario():
        reader, results = _reader(data), []
        while (item := await read(reader)) is not None:
            results.append(item)
        return results

    return asyncio.run(scenario())


def test_messages_round_trip_over_a_socket():
    async def scenario():
        a, b = socket.socketpair()
        _, writer = await asyncio.open_connection(sock=a)
        reader, other = await asyncio.open_connection(sock=b)
        for msg in MESSAGES:
            await write_message(writer, msg)
        writer.close()
        received = []
        while (msg := await read_message(reader)) is not None:
            received.append(msg)
        other.close()
        return received

    assert asyncio.run(scenario()) == MESSAGES


def test_replies_round_trip_over_a_socket():
    replies = [StageReply.ack(StageReplyStats(kv_lookup_hits=3)), StageReply.token(9),
               StageReply.window([1, 2, 3], 4)]

    async def scenario():
        a, b = socket.socketpair()
        _, writer = await asyncio.open_connection(sock=a)
        reader, other = await asyncio.open_connection(sock=b)
        for reply in replies:
            await write_reply(writer, reply)
        writer.close()
        received = []
        while (reply := await read_reply(reader)) is not None:
            received.append(reply)
        other.close()
        return received

    assert asyncio.run(scenario()) == replies


def test_clean_eof_between_frames_returns_none():
    assert _read_all(read_message, encode_message(MESSAGES[1])) == [MESSAGES[1]]
    assert _read_all(read_message, b"") == []
    assert _read_all(read_reply, b"") == []


MID_FRAME_EOF = [
    # (bytes before EOF, message fragment), one row per place a frame can be cut
    (encode_message(MESSAGES[1])[:1], "message header"),           # one byte of a header
    (encode_message(MESSAGES[1])[:MESSAGE_HEADER.size - 1], "message header"),
    (encode_message(MESSAGES[1])[:MESSAGE_HEADER.size], "message body"),   # header, no body
    (encode_message(MESSAGES[2])[:-1], "message body"),             # one byte short
]


@pytest.mark.parametrize("data, fragment", MID_FRAME_EOF,
                         ids=["1 header byte", "header - 1", "header only", "body - 1"])
def test_mid_frame_eof_is_a_frame_error(data, fragment):
    with pytest.raises(FrameError, match=fragment):
        _read_all(read_message, data)


def test_eof_inside_the_second_frame():
    wire = encode_message(MESSAGES[1])
    with pytest.raises(FrameError, match="message header"):
        _read_all(read_message, wire + wire[:10])


def test_mid_reply_eof_is_a_frame_error():
    wire = encode_reply(StageReply.window([1, 2], 0))
    with pytest.raises(FrameError, match="reply header"):
        _read_all(read_reply, wire[:REPLY_HEADER.size - 3])
    with pytest.raises(FrameError, match="reply body"):
        _read_all(read_reply, wire[:-2])


def _with_field(wire: bytes, name: str, value: int) -> bytes:
    data = bytearray(wire)
    fmt = next(f.fmt for f in MESSAGE_HEADER_FIELDS if f.name == name)
    struct.pack_into("<" + fmt, data, header_offset(MESSAGE_HEADER_FIELDS, name), value)
    return bytes(data)


OVERSIZED_HEADERS = [
    # (field, value): the header alone is rejected; no body is awaited or allocated
    ("activation_bytes", MAX_ACTIVATION_BYTES + 4),
    ("activation_bytes", (1 << 64) - 1),
    ("token_sideband_count", 1 << 30),
    ("metadata_bytes", (1 << 32) - 1),
]


@pytest.mark.parametrize("name, value", OVERSIZED_HEADERS)
def test_limits_are_checked_before_the_body_is_read(name, value):
    header = _with_field(encode_message(MESSAGES[2])[:MESSAGE_HEADER.size], name, value)

    async def scenario():
        # No EOF and no body: a reader that trusted the length would wait forever.
        return await asyncio.wait_for(read_message(_reader(header, eof=False)), timeout=1.0)

    with pytest.raises(FrameError, match=name):
        asyncio.run(scenario())


def test_version_mismatch_on_the_stream():
    header = _with_field(encode_message(MESSAGES[3]), "version", 7)
    with pytest.raises(VersionMismatch):
        _read_all(read_message, header)
