"""Errors raised for anything wrong that arrives from, or would go onto, the wire.

A `ProtocolError` closes that connection only, logged; messages follow
"<field>: expected <x>, got <y>".
"""

from __future__ import annotations


class ProtocolError(Exception):
    """Base class: the peer (or our encoder's input) broke the wire protocol."""


class FrameError(ProtocolError):
    """A malformed, truncated, oversized or inconsistent frame."""


class HandshakeTimeout(FrameError):
    """No READY within the wait: the server is up but busy (a stage still loading) or hung."""


class VersionMismatch(ProtocolError):
    """The peer speaks another protocol version; we fail closed (spec §2.11)."""

    def __init__(self, where: str, expected: int, got: int) -> None:
        super().__init__(f"{where} version: expected {expected}, got {got}; "
                         "upgrade every stage of the topology together")
        self.expected = expected
        self.got = got


class AuthError(ProtocolError):
    """Missing, malformed or wrong transport auth token (spec §2.1)."""
