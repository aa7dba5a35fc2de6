"""Mutual TLS on the links of a chain that leaves loopback (docs/operations.md).

A stage's TLS identity (certificate, key, the chain's CA) lives in its `Transport`: every
link it dials and every listener runs over TLS whenever the far host is not loopback, both
sides checking the other's certificate; the auth token check runs inside. A refused peer
gets one WARNING line, at most one a minute per host and reason (`RefusalLog`).
"""

from __future__ import annotations

import logging
import ssl
import time
from functools import cache
from pathlib import Path

from ..protocol import TlsConfig, is_loopback

log = logging.getLogger("skippy.stage")
REFUSAL_LOG_EVERY_S = 60.0  # a host refused again for the same reason within this: counted, not logged


def context(tls: TlsConfig | None, host: str, *, server: bool) -> ssl.SSLContext | None:
    """The TLS context to dial (`server` False) or listen on `host` with; None for loopback
    or without an identity."""
    if tls is None or is_loopback(host):
        return None
    return _contexts(tls, ssl.Purpose.CLIENT_AUTH if server else ssl.Purpose.SERVER_AUTH)


class RefusalLog:
    """One WARNING line per refused TLS handshake, at most one a minute per host and reason."""

    def __init__(self, where: str):
        self.where = where
        self._seen: dict[tuple[str, str], tuple[float, int]] = {}  # (peer host, reason) -> (logged at, repeats since)

    def refused(self, peer, error: OSError, timeout_s: float) -> None:
        host, port = (peer[0], peer[1]) if peer else ("unknown", 0)
        reason, now = refusal_reason(error, timeout_s), time.monotonic()
        logged_at, since = self._seen.get((host, reason), (float("-inf"), 0))
        if now - logged_at < REFUSAL_LOG_EVERY_S:  # a repeat: counted, said on its next line
            self._seen[host, reason] = (logged_at, since + 1)
            return
        if len(self._seen) > 4096:  # many peers: forget the quiet ones
            for key in [key for key, (at, _) in self._seen.items() if now - at >= REFUSAL_LOG_EVERY_S]:
                del self._seen[key]
        self._seen[host, reason] = (now, 0)
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        repeats = f" ({since} more like it from {host} since the last line)" if since else ""
        log.warning("%s: TLS handshake from %s refused: %s%s", self.where, address, reason, repeats)


def refusal_reason(error: OSError, timeout_s: float) -> str:
    """Why a peer's TLS handshake failed, in words, with OpenSSL's code where there is one."""
    code = getattr(error, "reason", None)
    if isinstance(error, ssl.SSLCertVerificationError):
        # OpenSSL's X509_V_ERR_*: no issuer here, a self-signed one, a signature from another key
        other_ca = error.verify_code in (2, 7, 18, 19, 20)
        what = "is not from this chain's CA" if other_ca else "failed verification"
        return f"its certificate {what} ({code}: {error.verify_message})"
    another_ca = "it does not trust this listener's certificate, from another chain's CA?"
    words = {"TLSV1_ALERT_UNKNOWN_CA": another_ca,
             "TLSV1_ALERT_DECRYPT_ERROR": another_ca,  # a CA of the same name, another key: its signature fails
             "SSLV3_ALERT_BAD_CERTIFICATE": "it refused this listener's certificate",
             "PEER_DID_NOT_RETURN_A_CERTIFICATE": "it sent no client certificate",
             "TLSV13_ALERT_CERTIFICATE_REQUIRED": "it sent no client certificate",
             "WRONG_VERSION_NUMBER": "it does not speak TLS (plain TCP?)",
             "HTTP_REQUEST": "it does not speak TLS (plain HTTP)",
             "UNSUPPORTED_PROTOCOL": "it offers an older TLS than 1.3",
             "NO_SHARED_CIPHER": "no cipher in common"}
    if code in words:
        return f"{words[code]} ({code})"
    if isinstance(error, ssl.SSLError) and not isinstance(error, ssl.SSLEOFError):
        return f"{code or error}"
    if isinstance(error, TimeoutError):
        return f"no handshake within {timeout_s:g} s"
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
