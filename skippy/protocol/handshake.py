"""Connection setup frames (spec §2.1): the auth preamble and READY, as bytes <-> dataclasses.

The dialer sends the preamble (only when the run has a token), the server checks it in
constant time and answers READY, whose protocol version makes a mismatched peer fail
closed. FETCH_MAGIC in the preamble opens the tensor side channel instead (§11).
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from .constants import (
    AUTH_MAGIC, AUTH_PREFIX, FETCH_MAGIC, MAX_AUTH_TOKEN_BYTES, MIN_AUTH_TOKEN_BYTES, PROTOCOL_VERSION,
    READY, READY_MAGIC,
)
from .errors import AuthError, FrameError, VersionMismatch


def token_bytes(token: str | bytes) -> bytes:
    """The wire form of an auth token: UTF-8 for str, 1..64 bytes."""
    raw = token.encode("utf-8") if isinstance(token, str) else bytes(token)
    if not MIN_AUTH_TOKEN_BYTES <= len(raw) <= MAX_AUTH_TOKEN_BYTES:
        raise AuthError(f"auth token length: expected {MIN_AUTH_TOKEN_BYTES}.."
                        f"{MAX_AUTH_TOKEN_BYTES} bytes, got {len(raw)}")
    return raw


@dataclass(frozen=True, slots=True)
class AuthPreamble:
    """u32 AUTH_MAGIC (or FETCH_MAGIC: the tensor side channel), u8 token length (1..64),
    then the token bytes."""

    token: bytes
    magic: int = AUTH_MAGIC

    def encode(self) -> bytes:
        raw = token_bytes(self.token)
        return AUTH_PREFIX.pack(self.magic, len(raw)) + raw

    @classmethod
    def decode(cls, buf: bytes) -> AuthPreamble:
        magic, length = preamble_fields(buf[:AUTH_PREFIX.size])
        if len(buf) != AUTH_PREFIX.size + length:
            raise AuthError(f"auth preamble: expected {AUTH_PREFIX.size + length} bytes, "
                            f"got {len(buf)}")
        return cls(bytes(buf[AUTH_PREFIX.size:]), magic)


def preamble_fields(prefix: bytes) -> tuple[int, int]:
    """Check the 5-byte preamble prefix: (its magic, how many token bytes follow)."""
    if len(prefix) != AUTH_PREFIX.size:
        raise AuthError(f"auth preamble: expected {AUTH_PREFIX.size} prefix bytes, "
                        f"got {len(prefix)}")
    magic, length = AUTH_PREFIX.unpack(prefix)
    if magic not in (AUTH_MAGIC, FETCH_MAGIC):
        raise AuthError(f"auth preamble magic: expected {AUTH_MAGIC:#010x} or {FETCH_MAGIC:#010x}, got "
                        f"{magic:#010x} (does the dialer have the run's auth token?)")
    if not MIN_AUTH_TOKEN_BYTES <= length <= MAX_AUTH_TOKEN_BYTES:
        raise AuthError(f"auth token length: expected {MIN_AUTH_TOKEN_BYTES}.."
                        f"{MAX_AUTH_TOKEN_BYTES}, got {length}")
    return magic, length


def check_auth(preamble: AuthPreamble, expected_token: str | bytes) -> None:
    """Raise AuthError unless the tokens match; the comparison is constant-time."""
    if not hmac.compare_digest(preamble.token, token_bytes(expected_token)):
        raise AuthError("auth token: expected the run's transport token, got a different one")


@dataclass(frozen=True, slots=True)
class Ready:
    """u32 READY_MAGIC ("SRDY"), i32 protocol version. Sent by the server after auth."""

    version: int = PROTOCOL_VERSION

    def encode(self) -> bytes:
        return READY.pack(READY_MAGIC, self.version)

    @classmethod
    def decode(cls, buf: bytes) -> Ready:
        """Parse READY and fail closed unless the peer speaks our version."""
        if len(buf) != READY.size:
            raise FrameError(f"READY: expected {READY.size} bytes, got {len(buf)}")
        magic, version = READY.unpack(buf)
        if magic != READY_MAGIC:
            raise FrameError(f"READY magic: expected {READY_MAGIC:#010x}, got {magic:#010x}")
        if version != PROTOCOL_VERSION:
            raise VersionMismatch("READY", PROTOCOL_VERSION, version)
        return cls(version)
