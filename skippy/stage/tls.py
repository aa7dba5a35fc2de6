"""Mutual TLS on the links of a chain that leaves loopback (docs/operations.md).

One process is one place in a chain, so its TLS identity is set once at start (`use`):
every link it dials (lanes, status queries, the direct return) and every listener it opens
then runs over TLS whenever the far host is not loopback, both sides checking the other's
certificate against the chain's CA (`skippy plan` writes them). Loopback links stay plain.
The auth token check runs inside TLS as before. A listener (`start_server`) accepts plain TCP
and runs the handshake itself, since asyncio's own TLS server drops a failed handshake without
a word: a refused peer (another CA's certificate, none, plain TCP) gets one WARNING line naming
its address and why, at most one a minute per host and reason.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections.abc import Awaitable, Callable
from functools import cache
from pathlib import Path

from ..protocol import TlsConfig, is_loopback

log = logging.getLogger("skippy.stage")
HANDSHAKE_TIMEOUT_S = 30.0
REFUSAL_LOG_EVERY_S = 60.0  # a host refused again for the same reason within this: counted, not logged
_identity: TlsConfig | None = None
_handshakes: set[asyncio.Task] = set()   # in flight; the loop holds tasks only weakly
_refusals: dict[tuple[str, str], tuple[float, int]] = {}  # (peer host, reason) -> (logged at, repeats since)


def use(tls: TlsConfig | None) -> None:
    """This process's certificate, key and chain CA (None: plain TCP only)."""
    global _identity
    _identity = tls
    _contexts.cache_clear()


def client_context(host: str) -> ssl.SSLContext | None:
    """The TLS context to dial `host` with; None for loopback or without an identity."""
    return None if is_loopback(host) or _identity is None else _contexts(_identity, ssl.Purpose.SERVER_AUTH)


def server_context(host: str) -> ssl.SSLContext | None:
    """The TLS context to listen on `host` with; None for loopback or without an identity."""
    return None if is_loopback(host) or _identity is None else _contexts(_identity, ssl.Purpose.CLIENT_AUTH)


async def start_server(client_connected: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
                       host: str, port: int = 0, *, sock=None, where: str) -> asyncio.Server:
    """asyncio.start_server on `host` (or on `sock`, bound there), over TLS off loopback; `where`
    names the listener in a refusal's log line."""
    context = server_context(host)
    if context is None:
        return await asyncio.start_server(client_connected, host=None if sock else host, port=None if sock else port,
                                          sock=sock)
    loop = asyncio.get_running_loop()
    accept = lambda: _Handshake(client_connected, context, where)  # noqa: E731
    if sock is not None:
        return await loop.create_server(accept, sock=sock)
    return await loop.create_server(accept, host, port)


class _Handshake(asyncio.Protocol):
    """An accepted TCP connection until its TLS handshake ends: then a stream, as start_server makes."""

    def __init__(self, client_connected, context: ssl.SSLContext, where: str):
        self._client_connected, self._context, self._where = client_connected, context, where

    def connection_made(self, transport: asyncio.Transport) -> None:
        # before the loop first reads the socket, so the ClientHello is still there for start_tls
        transport.pause_reading()
        task = asyncio.get_running_loop().create_task(self._upgrade(transport))
        _handshakes.add(task)
        task.add_done_callback(_handshakes.discard)

    async def _upgrade(self, transport: asyncio.Transport) -> None:
        reader = asyncio.StreamReader()
        protocol = asyncio.StreamReaderProtocol(reader, self._client_connected)  # calls it on connection_made
        peer = transport.get_extra_info("peername")
        try:
            secure = await asyncio.get_running_loop().start_tls(transport, protocol, self._context, server_side=True,
                                                                ssl_handshake_timeout=HANDSHAKE_TIMEOUT_S)
        except OSError as error:  # ssl.SSLError, a reset, or the timeout's ConnectionAbortedError
            _log_refusal(self._where, peer, error)
            return
        protocol.connection_made(secure)  # start_tls leaves that to its caller


def _log_refusal(where: str, peer, error: OSError) -> None:
    host, port = (peer[0], peer[1]) if peer else ("unknown", 0)
    reason, now = refusal_reason(error), time.monotonic()
    logged_at, since = _refusals.get((host, reason), (float("-inf"), 0))
    if now - logged_at < REFUSAL_LOG_EVERY_S:  # a repeat: counted, said on its next line
        _refusals[host, reason] = (logged_at, since + 1)
        return
    if len(_refusals) > 4096:  # many peers: forget the quiet ones
        for key in [key for key, (at, _) in _refusals.items() if now - at >= REFUSAL_LOG_EVERY_S]:
            del _refusals[key]
    _refusals[host, reason] = (now, 0)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    repeats = f" ({since} more like it from {host} since the last line)" if since else ""
    log.warning("%s: TLS handshake from %s refused: %s%s", where, address, reason, repeats)


def refusal_reason(error: OSError) -> str:
    """Why a peer's TLS handshake failed, in words, with OpenSSL's code where there is one."""
    code = getattr(error, "reason", None)
    if isinstance(error, ssl.SSLCertVerificationError):
        # OpenSSL's X509_V_ERR_*: no issuer here, a self-signed one, a signature from another key
        other_ca = error.verify_code in (2, 7, 18, 19, 20)
        what = "is not from this chain's CA" if other_ca else "failed verification"
        return f"its certificate {what} ({code}: {error.verify_message})"
    words = {"TLSV1_ALERT_UNKNOWN_CA": "it does not trust this listener's certificate, from another chain's CA?",
             "SSLV3_ALERT_BAD_CERTIFICATE": "it refused this listener's certificate",
             "PEER_DID_NOT_RETURN_A_CERTIFICATE": "it sent no client certificate",
             "TLSV13_ALERT_CERTIFICATE_REQUIRED": "it sent no client certificate",
             "WRONG_VERSION_NUMBER": "it does not speak TLS (plain TCP?)",
             "HTTP_REQUEST": "it does not speak TLS (plain HTTP)",
             "UNSUPPORTED_PROTOCOL": "it offers an older TLS than 1.3",
             "NO_SHARED_CIPHER": "no cipher in common"}
    if code in words:
        return f"{words[code]} ({code})"
    if isinstance(error, ssl.SSLError):
        return f"{code or error}"
    if isinstance(error, ConnectionAbortedError):
        return f"no handshake within {HANDSHAKE_TIMEOUT_S:g} s"
    # a dialer that rejects this listener's certificate hangs up without a word (Python's does)
    return (f"it hung up during the handshake: does it trust another CA than this chain's? "
            f"({type(error).__name__})")


@cache
def _contexts(tls: TlsConfig, purpose: ssl.Purpose) -> ssl.SSLContext:
    for path in (tls.ca_file, tls.cert_file, tls.key_file):
        if not Path(path).is_file():
            raise ValueError(f"TLS file {path} not found. Fix: copy the plan's tls/ directory beside the stage config.")
    context = ssl.create_default_context(purpose, cafile=tls.ca_file)  # the chain's CA only
    context.load_cert_chain(tls.cert_file, tls.key_file)
    context.verify_mode = ssl.CERT_REQUIRED  # mutual: a listener checks its dialer too
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    return context


def check_exposure(where: str, host: str, *, auth_token: str | None, tls: TlsConfig | None,
                   insecure: bool) -> None:
    """Refuse to listen off loopback without an auth token and TLS, unless told to (`insecure`)."""
    if is_loopback(host):
        return
    missing = [name for name, value in (("an auth token", auth_token), ("TLS", tls)) if value is None]
    if not missing:
        return
    if not insecure:
        raise ValueError(f"{where} would listen on {host} without {' and '.join(missing)}: anyone who can reach "
                         f"it could read the activations and drive the model. Fix: start it from a `skippy plan` "
                         f"output (it writes a chain token and TLS certificates), or pass --insecure to do it anyway.")
    log.warning("%s listens on %s without %s (--insecure): its traffic is open to the network", where, host,
                " and ".join(missing))
