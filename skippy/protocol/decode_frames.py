"""A decode step's frames from templates: a session's DecodeEmbd, the final stage's token.

Two decode frames of a session differ in four header values (pos_start, decode_step,
current_token, the token sideband) and the activation row. `encode_message` checks every
section: 70-130 us right after a forward (caches full of weights), on the critical path at
every stage of every token. So a session's first frame is encoded and checked in full and
each later one is a copy with those values written in; `token_reply` does the same for the
final stage's usual reply, and `DecodeFrameReader` reads a frame that differs from a
checked one only there (cold, 78 -> 42 us). tests/test_protocol_frames.py holds both byte
for byte to encode_message and encode_reply.
"""

from __future__ import annotations

import struct

import numpy as np

from .constants import (
    ACTIVATION_NUMPY_DTYPE, MESSAGE_HEADER, MESSAGE_HEADER_FIELDS, REPLY_FIXED_BYTES, REPLY_HEADER,
    REPLY_HEADER_FIELDS, MessageKind, header_offset,
)
from .errors import FrameError
from .frames import (
    StageMessage, StageReply, decode_message_body, decode_reply_body, encode_message, encode_reply,
    parse_message_header, parse_reply_header,
)

_POS_START = header_offset(MESSAGE_HEADER_FIELDS, "pos_start")
_STEP_AND_TOKEN = header_offset(MESSAGE_HEADER_FIELDS, "decode_step")
assert header_offset(MESSAGE_HEADER_FIELDS, "current_token") == _STEP_AND_TOKEN + 4
_I32, _TWO_I32 = struct.Struct("<i"), struct.Struct("<ii")
_WIRE_I32 = np.dtype("<i4")
_TOKEN = MESSAGE_HEADER.size  # the token sideband comes first in the body


def is_decode_frame(message: StageMessage) -> bool:
    """Whether `message` is a frame both classes below take: a one-token DecodeEmbd without positions."""
    return (message.kind == MessageKind.DecodeEmbd and message.token_count == 1 and len(message.tokens) == 1
            and len(message.positions) == 0)


class DecodeFrames:
    """Frames of one session's one-row DecodeEmbd steps, like its first (`prototype`)."""

    def __init__(self, prototype: StageMessage):
        if not is_decode_frame(prototype):
            raise ValueError("a decode-frame template is a one-token DecodeEmbd without positions")
        self.prototype = prototype
        self._dtype = ACTIVATION_NUMPY_DTYPE[prototype.activation_dtype]  # q8: one record per 32 values
        self._frame = bytearray(encode_message(prototype))  # every section checked once, here
        start = _TOKEN + 4
        self._activation = slice(start, start + prototype.activation.nbytes)

    def fits(self, message: StageMessage, rows: np.ndarray) -> bool:
        """Whether the frame of `message`'s step carrying `rows` is this template's but for the
        four values `encode` writes: the same request, session, trace context and row shape."""
        p = self.prototype
        return (message.request_id == p.request_id and message.session_id == p.session_id
                and message.trace_context == p.trace_context and message.prompt_token_count == p.prompt_token_count
                and rows.shape[0] == p.activation_rows and rows.dtype == self._dtype
                and rows.nbytes == p.activation.nbytes)  # q8 rows: one record per 32 values

    def encode(self, pos_start: int, decode_step: int, token: int, rows: np.ndarray) -> bytes:
        """The frame of the step at `pos_start` feeding `token`, carrying `rows` (wire dtype,
        the template's shape: see `matches`)."""
        if pos_start < 0:
            raise FrameError(f"message.pos_start: expected >= 0, got {pos_start}")
        frame = self._frame
        try:
            _I32.pack_into(frame, _POS_START, pos_start)
            _TWO_I32.pack_into(frame, _STEP_AND_TOKEN, decode_step, token)
            _I32.pack_into(frame, _TOKEN, token)
        except struct.error as error:
            raise FrameError(f"decode frame: expected i32 values, got pos_start {pos_start}, "
                             f"decode_step {decode_step}, token {token} ({error})") from error
        frame[self._activation] = memoryview(np.ascontiguousarray(rows)).cast("B")
        return bytes(frame)


class DecodeFrameReader:
    """A session's one-row DecodeEmbd frames read against one already checked in full: a frame
    that equals it but for the four values and the row passed every check it did."""

    def __init__(self, frame: bytes, message: StageMessage):
        if not is_decode_frame(message):
            raise ValueError("a decode-frame reader reads one-token DecodeEmbd frames without positions")
        self.message, self._frame, self.size = message, bytes(frame), len(frame)
        start = _TOKEN + 4
        self._activation = slice(start, start + message.activation.nbytes)
        # the bytes two frames of the session share: the header but for its three values, what follows the row
        self._same = [slice(0, _POS_START), slice(_POS_START + 4, _STEP_AND_TOKEN),
                      slice(_STEP_AND_TOKEN + 8, MESSAGE_HEADER.size), slice(self._activation.stop, self.size)]

    def read(self, buffer) -> StageMessage | None:
        """The message of the frame at the front of `buffer` when it is whole there and differs
        from the reader's only in those values; None otherwise (decode it in full)."""
        if len(buffer) < self.size:
            return None
        frame = self._frame
        if any(buffer[same] != frame[same] for same in self._same):
            return None
        pos_start = _I32.unpack_from(buffer, _POS_START)[0]
        if pos_start < 0:
            return None
        decode_step, current_token = _TWO_I32.unpack_from(buffer, _STEP_AND_TOKEN)
        data = bytes(buffer[:self.size])  # the caller deletes the frame from `buffer`
        return self.message.derived(pos_start=pos_start, decode_step=decode_step, current_token=current_token,
                                    tokens=np.frombuffer(data, dtype=_WIRE_I32, count=1, offset=_TOKEN),
                                    activation=memoryview(data)[self._activation])


_TOKEN_REPLY = encode_reply(StageReply.token(0))  # header, an all-zero stats block, the token
_PREDICTED = header_offset(REPLY_HEADER_FIELDS, "predicted")


def token_reply(token: int) -> bytes:
    """encode_reply(StageReply.token(token)): no stats, no logprobs."""
    frame = bytearray(_TOKEN_REPLY)
    try:
        _I32.pack_into(frame, _PREDICTED, token)
        _I32.pack_into(frame, len(frame) - 4, token)
    except struct.error as error:
        raise FrameError(f"reply tokens: expected i32 token ids ({error})") from error
    return bytes(frame)


TOKEN_REPLY_BYTES = len(_TOKEN_REPLY)
_AFTER_PREDICTED = _PREDICTED + 4


def token_of_reply(frame) -> int | None:
    """The token of a reply `token_reply` would have written (the first TOKEN_REPLY_BYTES of
    `frame`); None for any other reply (stats, logprobs, a window...)."""
    view = memoryview(frame)[:TOKEN_REPLY_BYTES]
    if len(view) < TOKEN_REPLY_BYTES:
        return None
    token = _I32.unpack_from(view, _PREDICTED)[0]
    if (_I32.unpack_from(view, TOKEN_REPLY_BYTES - 4)[0] != token
            or view[:_PREDICTED] != _TOKEN_REPLY[:_PREDICTED]
            or view[_AFTER_PREDICTED:-4] != _TOKEN_REPLY[_AFTER_PREDICTED:-4]):
        return None
    return token


class MessageReader:
    """Stage messages taken whole from the front of a byte buffer: (message, size), or None
    while not whole; each header is checked before its body is waited for."""

    def __init__(self) -> None:
        self._decode: DecodeFrameReader | None = None

    def __call__(self, buffer: bytearray) -> tuple[StageMessage, int] | None:
        if len(buffer) < MESSAGE_HEADER.size:
            return None
        reader = self._decode
        if reader is not None and (message := reader.read(buffer)) is not None:
            return message, reader.size
        header = parse_message_header(buffer)  # counts and limits checked before the body is awaited
        size = MESSAGE_HEADER.size + header.body_bytes
        if len(buffer) < size:
            return None
        frame = bytes(buffer[:size])
        message = decode_message_body(header, memoryview(frame)[MESSAGE_HEADER.size:])
        if is_decode_frame(message):  # the session's next decode frames are read against this one
            self._decode = DecodeFrameReader(frame, message)
        return message, size


def read_reply_from(buffer: bytearray) -> tuple[StageReply, int] | None:
    """The reply whole at the front of `buffer` and its size, or None (not whole yet); a plain
    token reply (the rule on the decode path) is read from its one value."""
    if (token := token_of_reply(buffer)) is not None:
        return StageReply.token(token), TOKEN_REPLY_BYTES
    if len(buffer) < REPLY_HEADER.size:
        return None
    header = parse_reply_header(buffer)
    size = REPLY_FIXED_BYTES + header.body_bytes
    if len(buffer) < size:
        return None
    return decode_reply_body(header, bytes(buffer[REPLY_HEADER.size:size])), size
