"""The protocol package's only I/O: frames and the handshake over asyncio streams (a client's:
the stages themselves use stage/transport.py).

Each read takes the fixed header first and checks every count and limit on it
before reading (and allocating) the body, so an oversized length never allocates.
A clean EOF between frames returns None; an EOF inside a frame is a FrameError.
"""

from __future__ import annotations

import asyncio

from .constants import AUTH_MAGIC, FETCH_MAGIC, MESSAGE_HEADER, READY, REPLY_HEADER, STATS_BLOCK
from .errors import AuthError, FrameError, HandshakeTimeout
from .frames import (
    StageMessage, StageReply, decode_message_body, decode_reply_body, encode_message,
    encode_reply, parse_message_header, parse_reply_header,
)
from .handshake import AuthPreamble, Ready, token_bytes
from .tensor_frames import (
    TENSOR_HEADER, TensorFrame, TensorFrameKind, TensorRefused, decode_tensor_body, encode_tensor_frame,
    parse_tensor_header,
)

HANDSHAKE_TIMEOUT_S = 20.0  # client_handshake's wait for READY


async def _read_exactly(reader: asyncio.StreamReader, nbytes: int, what: str, *, frame_start: bool = False):
    """`nbytes` bytes; at a `frame_start`, None on a clean EOF before the first of them."""
    try:
        return await reader.readexactly(nbytes)
    except asyncio.IncompleteReadError as error:
        if frame_start and not error.partial:
            return None
        raise FrameError(f"{what}: expected {nbytes} bytes, got {len(error.partial)} before EOF "
                         "(truncated)") from None


async def read_message(reader: asyncio.StreamReader) -> StageMessage | None:
    """Read one stage message; None means the peer closed cleanly between frames."""
    head = await _read_exactly(reader, MESSAGE_HEADER.size, "message header", frame_start=True)
    if head is None:
        return None
    header = parse_message_header(head)  # limits checked before the body is read
    return decode_message_body(header, await _read_exactly(reader, header.body_bytes, "message body"))


async def write_message(writer: asyncio.StreamWriter, msg: StageMessage) -> None:
    writer.write(encode_message(msg))
    await writer.drain()


async def read_reply(reader: asyncio.StreamReader) -> StageReply | None:
    """Read one reply; None means the peer closed cleanly between frames."""
    head = await _read_exactly(reader, REPLY_HEADER.size, "reply header", frame_start=True)
    if head is None:
        return None
    header = parse_reply_header(head)
    body = await _read_exactly(reader, STATS_BLOCK.size + header.body_bytes, "reply body")
    return decode_reply_body(header, body)


async def write_reply(writer: asyncio.StreamWriter, reply: StageReply) -> None:
    writer.write(encode_reply(reply))
    await writer.drain()


async def client_handshake(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                           token: str | bytes | None = None, *,
                           timeout: float = HANDSHAKE_TIMEOUT_S, tensors: bool = False) -> Ready:
    """Dialer side (spec §2.1): the auth preamble if we have a token, then READY
    (`tensors`: the tensor side channel, §11). VersionMismatch, FrameError (closed, e.g.
    a refused token) or HandshakeTimeout when it fails."""
    if tensors and token is None:
        raise AuthError("the tensor side channel needs the chain's auth token")
    if token is not None:
        writer.write(AuthPreamble(token_bytes(token), FETCH_MAGIC if tensors else AUTH_MAGIC).encode())
        await writer.drain()
    try:
        data = await asyncio.wait_for(_read_exactly(reader, READY.size, "READY"), timeout)
    except TimeoutError:
        raise HandshakeTimeout(f"READY: none within {timeout} s") from None
    except FrameError as error:
        raise FrameError(f"{error} (did the server refuse our auth token?)") from None
    return Ready.decode(data)


async def read_tensor_frame(reader: asyncio.StreamReader, expected: TensorFrameKind, *,
                            timeout: float | None = None) -> TensorFrame:
    """The next frame on the tensor side channel, which must be of kind `expected`. A Refused
    frame raises TensorRefused with the holder's reason; a clean EOF is a FrameError here."""
    async def read() -> TensorFrame:
        kind, length = parse_tensor_header(await _read_exactly(reader, TENSOR_HEADER.size, "tensor frame header"))
        frame = decode_tensor_body(kind, await _read_exactly(reader, length, f"{kind.name} body"))
        if kind == TensorFrameKind.Refused:
            raise TensorRefused(frame.reason)
        if kind != expected:
            raise FrameError(f"tensor frame kind: expected {expected.name}, got {kind.name}")
        return frame

    return await asyncio.wait_for(read(), timeout)


async def write_tensor_frame(writer: asyncio.StreamWriter, frame: TensorFrame) -> None:
    writer.write(encode_tensor_frame(frame))
    await writer.drain()
