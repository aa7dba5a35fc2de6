"""The tensor side channel (docs/protocol.md §11): a stage with no model file fetches its
slice from a holder of the file, on the holder's own port, as bytes <-> dataclasses.

A dialer opens it with the FETCH preamble (the auth preamble's layout and token, magic
"SFET"), so only a peer holding the chain's token (and, off loopback, a certificate from the
chain's CA) reaches it. Then every frame is a 20-byte header (magic "STNS", version, kind,
body length) and a body whose length is bounded per kind before it is read:

    dialer -> holder   ManifestRequest   the asker's stage index and the plan's fingerprint
    holder -> dialer   Manifest          the file's header and size, one digest per tensor
    dialer -> holder   FetchRequest      (tensor index, first byte) of each tensor wanted
    holder -> dialer   Chunk ...         consecutive bytes of those tensors, in request order
    holder -> dialer   Done              total bytes sent
    holder -> dialer   Refused           why, instead of any of the above; then it closes
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum

from .errors import FrameError, ProtocolError, VersionMismatch

TENSORS_MAGIC = 0x53544E53   # "STNS"  every frame on the side channel
TENSORS_VERSION = 1          # the side channel's own version (the data plane's is PROTOCOL_VERSION)
TENSOR_HEADER = struct.Struct("<IiIQ")  # magic, version, kind, body bytes
FINGERPRINT_BYTES = 16       # the plan's model fingerprint (blake2b-128), raw
DIGEST_BYTES = 32            # sha256 per tensor
MAX_MODEL_HEADER_BYTES = 64 << 20    # a GGUF header: metadata and tensor table (a 256k vocabulary: ~10 MiB)
MAX_TENSORS = 1 << 16
MAX_CHUNK_BYTES = 4 << 20
MAX_REASON_BYTES = 4096

MANIFEST_REQUEST = struct.Struct(f"<I{FINGERPRINT_BYTES}s")  # stage index, fingerprint
MANIFEST_PREFIX = struct.Struct("<QII")                      # file size, header bytes, tensor count
FETCH_ITEM = struct.Struct("<IQ")                            # tensor index, first byte
CHUNK_PREFIX = struct.Struct("<IQ")                          # tensor index, offset of the payload
DONE = struct.Struct("<Q")                                   # payload bytes sent in all


class TensorFrameKind(IntEnum):
    ManifestRequest = 1
    Manifest = 2
    FetchRequest = 3
    Chunk = 4
    Done = 5
    Refused = 6


class TensorRefused(ProtocolError):
    """The holder refused the request; the reason is its own words."""


@dataclass(frozen=True, slots=True)
class ManifestRequest:
    stage_index: int
    fingerprint: bytes

    def body(self) -> bytes:
        return MANIFEST_REQUEST.pack(self.stage_index, self.fingerprint)


@dataclass(frozen=True, slots=True)
class Manifest:
    file_size: int
    header: bytes
    digests: list[bytes]

    def body(self) -> bytes:
        return (MANIFEST_PREFIX.pack(self.file_size, len(self.header), len(self.digests)) + self.header
                + b"".join(self.digests))


@dataclass(frozen=True, slots=True)
class FetchRequest:
    items: list[tuple[int, int]]  # (tensor index, first byte)

    def body(self) -> bytes:
        return struct.pack("<I", len(self.items)) + b"".join(FETCH_ITEM.pack(*item) for item in self.items)


@dataclass(frozen=True, slots=True)
class Chunk:
    tensor_index: int
    offset: int
    data: bytes | memoryview

    def body(self) -> bytes:  # the sender writes the prefix and the payload apart (chunk_prefix)
        return CHUNK_PREFIX.pack(self.tensor_index, self.offset) + bytes(self.data)


@dataclass(frozen=True, slots=True)
class Done:
    total_bytes: int

    def body(self) -> bytes:
        return DONE.pack(self.total_bytes)


@dataclass(frozen=True, slots=True)
class Refused:
    reason: str

    def body(self) -> bytes:
        return self.reason.encode("utf-8")[:MAX_REASON_BYTES]


KINDS = {ManifestRequest: TensorFrameKind.ManifestRequest, Manifest: TensorFrameKind.Manifest,
         FetchRequest: TensorFrameKind.FetchRequest, Chunk: TensorFrameKind.Chunk, Done: TensorFrameKind.Done,
         Refused: TensorFrameKind.Refused}
TensorFrame = ManifestRequest | Manifest | FetchRequest | Chunk | Done | Refused

# the largest body each kind may declare: checked on the header, before the body is read
MAX_BODY = {
    TensorFrameKind.ManifestRequest: MANIFEST_REQUEST.size,
    TensorFrameKind.Manifest: MANIFEST_PREFIX.size + MAX_MODEL_HEADER_BYTES + DIGEST_BYTES * MAX_TENSORS,
    TensorFrameKind.FetchRequest: 4 + FETCH_ITEM.size * MAX_TENSORS,
    TensorFrameKind.Chunk: CHUNK_PREFIX.size + MAX_CHUNK_BYTES,
    TensorFrameKind.Done: DONE.size,
    TensorFrameKind.Refused: MAX_REASON_BYTES,
}


def encode_tensor_frame(frame: TensorFrame) -> bytes:
    body = frame.body()
    kind = KINDS[type(frame)]
    if len(body) > MAX_BODY[kind]:
        raise FrameError(f"{kind.name} body: expected at most {MAX_BODY[kind]} bytes, got {len(body)}")
    return TENSOR_HEADER.pack(TENSORS_MAGIC, TENSORS_VERSION, kind, len(body)) + body


def chunk_prefix(tensor_index: int, offset: int, length: int) -> bytes:
    """A Chunk's header and prefix, for a sender that writes the payload from its own buffer."""
    if not 0 < length <= MAX_CHUNK_BYTES:
        raise FrameError(f"Chunk payload: expected 1..{MAX_CHUNK_BYTES} bytes, got {length}")
    return (TENSOR_HEADER.pack(TENSORS_MAGIC, TENSORS_VERSION, TensorFrameKind.Chunk, CHUNK_PREFIX.size + length)
            + CHUNK_PREFIX.pack(tensor_index, offset))


def parse_tensor_header(buf: bytes) -> tuple[TensorFrameKind, int]:
    """(kind, body length) of a 20-byte header, every field checked."""
    magic, version, kind, length = TENSOR_HEADER.unpack(buf)
    if magic != TENSORS_MAGIC:
        raise FrameError(f"tensor frame magic: expected {TENSORS_MAGIC:#010x}, got {magic:#010x}")
    if version != TENSORS_VERSION:
        raise VersionMismatch("tensor frame", TENSORS_VERSION, version)
    try:
        kind = TensorFrameKind(kind)
    except ValueError:
        raise FrameError(f"tensor frame kind: expected 1..{len(TensorFrameKind)}, got {kind}") from None
    if length > MAX_BODY[kind]:
        raise FrameError(f"{kind.name} body: expected at most {MAX_BODY[kind]} bytes, got {length}")
    return kind, length


def decode_tensor_body(kind: TensorFrameKind, body: bytes) -> TensorFrame:
    """The frame of `kind` in `body` (its length already bounded by parse_tensor_header)."""
    view = memoryview(body)
    if kind == TensorFrameKind.ManifestRequest:
        _exact(kind, len(body), MANIFEST_REQUEST.size)
        return ManifestRequest(*MANIFEST_REQUEST.unpack(body))
    if kind == TensorFrameKind.Manifest:
        _at_least(kind, len(body), MANIFEST_PREFIX.size)
        size, header_bytes, count = MANIFEST_PREFIX.unpack_from(body)
        if header_bytes > MAX_MODEL_HEADER_BYTES or count > MAX_TENSORS:
            raise FrameError(f"Manifest: expected a header <= {MAX_MODEL_HEADER_BYTES} bytes and <= {MAX_TENSORS} "
                             f"tensors, got {header_bytes} and {count}")
        _exact(kind, len(body), MANIFEST_PREFIX.size + header_bytes + DIGEST_BYTES * count)
        at = MANIFEST_PREFIX.size + header_bytes
        return Manifest(size, bytes(view[MANIFEST_PREFIX.size:at]),
                        [bytes(view[at + DIGEST_BYTES * i : at + DIGEST_BYTES * (i + 1)]) for i in range(count)])
    if kind == TensorFrameKind.FetchRequest:
        _at_least(kind, len(body), 4)
        (count,) = struct.unpack_from("<I", body)
        if count > MAX_TENSORS:
            raise FrameError(f"FetchRequest count: expected <= {MAX_TENSORS}, got {count}")
        _exact(kind, len(body), 4 + FETCH_ITEM.size * count)
        return FetchRequest([FETCH_ITEM.unpack_from(body, 4 + FETCH_ITEM.size * i) for i in range(count)])
    if kind == TensorFrameKind.Chunk:
        if len(body) <= CHUNK_PREFIX.size:
            raise FrameError(f"Chunk body: expected more than {CHUNK_PREFIX.size} bytes, got {len(body)}")
        index, offset = CHUNK_PREFIX.unpack_from(body)
        return Chunk(index, offset, view[CHUNK_PREFIX.size:])
    if kind == TensorFrameKind.Done:
        _exact(kind, len(body), DONE.size)
        return Done(*DONE.unpack(body))
    try:
        return Refused(bytes(body).decode("utf-8"))
    except UnicodeDecodeError:
        raise FrameError("Refused reason: expected UTF-8") from None


def _exact(kind: TensorFrameKind, got: int, expected: int) -> None:
    if got != expected:
        raise FrameError(f"{kind.name} body: expected {expected} bytes, got {got}")


def _at_least(kind: TensorFrameKind, got: int, expected: int) -> None:
    if got < expected:
        raise FrameError(f"{kind.name} body: expected at least {expected} bytes, got {got}")
