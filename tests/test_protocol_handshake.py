"""Connection setup (spec §2.1): auth preamble, READY and the async handshake helpers."""

from __future__ import annotations

import asyncio
import socket

import pytest

from skippy.protocol import AuthError, AuthPreamble, FrameError, Ready, Timeouts, VersionMismatch, client_handshake
from skippy.protocol.handshake import check_auth, preamble_fields
from skippy.stage.tls import RefusalLog
from skippy.stage.transport import Transport


def test_auth_preamble_bytes():
    wire = AuthPreamble(b"s3cret").encode()
    assert wire == bytes.fromhex("54554153 06") + b"s3cret"  # magic "SAUT", length, token
    assert AuthPreamble.decode(wire) == AuthPreamble(b"s3cret")


def test_ready_bytes():
    assert Ready().encode() == bytes.fromhex("59445253 06000000")  # magic "SRDY", version 6
    assert Ready.decode(Ready().encode()) == Ready(6)


PREAMBLE_ERRORS = [
    # (prefix bytes, message fragment)
    (bytes.fromhex("47534d53 06"), "magic"),       # a stage message instead of a preamble
    (bytes.fromhex("54554153 00"), "length"),      # zero-length token
    (bytes.fromhex("54554153 41"), "length"),      # 65 bytes: over the 64-byte cap
    (bytes.fromhex("545541"), "prefix"),           # cut short
]


@pytest.mark.parametrize("prefix, fragment", PREAMBLE_ERRORS)
def test_preamble_prefix_errors(prefix, fragment):
    with pytest.raises(AuthError, match=fragment):
        preamble_fields(prefix)


def test_token_length_limits_on_encode():
    with pytest.raises(AuthError):
        AuthPreamble(b"").encode()
    with pytest.raises(AuthError):
        AuthPreamble(b"x" * 65).encode()
    assert len(AuthPreamble(b"x" * 64).encode()) == 5 + 64


def test_check_auth():
    check_auth(AuthPreamble(b"token"), "token")
    with pytest.raises(AuthError, match="auth token"):
        check_auth(AuthPreamble(b"token"), "tokem")
    with pytest.raises(AuthError):
        check_auth(AuthPreamble(b"tok"), "token")


READY_ERRORS = [
    # (bytes, error)
    (Ready(7).encode(), VersionMismatch),                 # newer peer
    (Ready(5).encode(), VersionMismatch),                 # older peer (before q8 and LinkProbe)
    (bytes.fromhex("59445254 01000000"), FrameError),     # wrong magic
    (Ready().encode()[:7], FrameError),                   # short
]


@pytest.mark.parametrize("wire, error", READY_ERRORS)
def test_ready_errors(wire, error):
    with pytest.raises(error):
        Ready.decode(wire)


# ---------------------------------------------------------------------------
# A client's streams against a stage's own accepting side (stage/transport.py), over TCP
# ---------------------------------------------------------------------------
async def _pair():
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = await asyncio.open_connection("127.0.0.1", listener.getsockname()[1])
        server, _ = listener.accept()
    server.setblocking(False)
    return client, server


async def _accept(sock, token, timeout=2.0):
    transport = Transport(auth_token=token, timeouts=Timeouts(handshake_s=timeout))
    return await transport.accept_handshake(sock, None, RefusalLog("test"), "peer")


async def _run_handshake(client_token, server_token, *, timeout=2.0):
    (c_reader, c_writer), s_sock = await _pair()

    async def server():
        try:
            await _accept(s_sock, server_token, timeout)
        finally:
            s_sock.close()  # after READY or a refusal, as the stage server does

    try:
        results = await asyncio.gather(
            client_handshake(c_reader, c_writer, client_token, timeout=timeout), server(),
            return_exceptions=True)
    finally:
        c_writer.close()
    return results


def test_right_token_passes():
    client, server = asyncio.run(_run_handshake("s3cret", "s3cret"))
    assert client == Ready(6) and server is None


def test_no_token_on_either_side_passes():
    client, server = asyncio.run(_run_handshake(None, None))
    assert client == Ready(6) and server is None


def test_wrong_token_is_refused():
    client, server = asyncio.run(_run_handshake("guess", "s3cret"))
    assert isinstance(server, AuthError)
    assert isinstance(client, FrameError)  # connection closed before READY
    assert "auth token" in str(client)


def test_missing_token_times_out_as_auth_error():
    client, server = asyncio.run(_run_handshake(None, "s3cret", timeout=0.2))
    assert isinstance(server, AuthError) and "none within" in str(server)
    assert isinstance(client, FrameError)


def test_wrong_version_is_refused():
    async def scenario():
        (c_reader, c_writer), s_sock = await _pair()
        s_sock.send(Ready(version=7).encode())
        try:
            return await client_handshake(c_reader, c_writer, None, timeout=2.0)
        finally:
            c_writer.close()
            s_sock.close()

    with pytest.raises(VersionMismatch, match="expected 6, got 7"):
        asyncio.run(scenario())


def test_server_reads_nothing_past_the_preamble():
    # A message written right after the preamble must still be readable afterwards.
    async def scenario():
        (c_reader, c_writer), s_sock = await _pair()
        c_writer.write(AuthPreamble(b"tok").encode() + b"NEXT")
        await c_writer.drain()
        s_sock, _ = await _accept(s_sock, "tok")
        s_sock.setblocking(True)
        leftover = s_sock.recv(4)
        ready = await client_handshake(c_reader, c_writer, None)
        c_writer.close()
        s_sock.close()
        return leftover, ready

    assert asyncio.run(scenario()) == (b"NEXT", Ready(6))
