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


def issue_certificates(out_dir: Path, hosts: dict[str, str], *, days: int = 825) -> dict[str, TlsConfig]:
    """A fresh chain CA in `out_dir`, and for each name -> host a certificate for that host
    (subject alternative name; usable by a listener and a dialer alike). Keys are written
    owner-only. Returns each name's TlsConfig, its paths relative to `out_dir`'s parent."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    out_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "skippy chain CA")])
    ca_cert = _certificate("skippy chain CA", ca_key.public_key(), ca_name, ca_key, ca=True, days=days)
    write_private(out_dir / "ca.pem", ca_cert.public_bytes(serialization.Encoding.PEM))
    write_private(out_dir / "ca.key", _pem_key(ca_key))  # kept to issue a standby's certificate later
    configs = {}
    for name, host in hosts.items():
        key_pem, public_pem = new_key_pair()
        write_private(out_dir / f"{name}.pem", sign_certificate(out_dir, name, host, public_pem, days=days))
        write_private(out_dir / f"{name}.key", key_pem)
        configs[name] = TlsConfig(ca_file=f"{out_dir.name}/ca.pem", cert_file=f"{out_dir.name}/{name}.pem",
                                  key_file=f"{out_dir.name}/{name}.key")
    return configs


def new_key_pair() -> tuple[bytes, bytes]:
    """A fresh private key and its public key, both PEM: a stage that makes its own key sends
    only the public one to be signed (`sign_certificate`), so its private key never travels."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    public = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    return _pem_key(key), public


def sign_certificate(ca_dir: Path, name: str, host: str, public_key_pem: bytes, *, days: int = 825) -> bytes:
    """A certificate (PEM) from the chain CA in `ca_dir` (ca.pem, ca.key) for `name` at `host`,
    for the holder of `public_key_pem`'s private key."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    ca_cert = x509.load_pem_x509_certificate((ca_dir / "ca.pem").read_bytes())
    ca_key = serialization.load_pem_private_key((ca_dir / "ca.key").read_bytes(), password=None)
    public_key = serialization.load_pem_public_key(public_key_pem)
    cert = _certificate(name, public_key, ca_cert.subject, ca_key, ca=False, host=host, days=days)
    return cert.public_bytes(serialization.Encoding.PEM)


def _certificate(subject: str, public_key, issuer_name, issuer_key, *, ca: bool, days: int, host: str | None = None):
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
               .issuer_name(issuer_name).public_key(public_key).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=days))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if host is not None:
        try:
            name = x509.IPAddress(ipaddress.ip_address(host))
        except ValueError:
            name = x509.DNSName(host)
        builder = (builder.add_extension(x509.SubjectAlternativeName([name]), critical=False)
                   .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                         ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False))
    return builder.sign(issuer_key, hashes.SHA256())


def _pem_key(key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def write_private(path: Path, data: bytes) -> None:
    """`data` in a file only its owner may read (created so: never readable in between)."""
    path.touch(mode=0o600)
    path.chmod(0o600)
    path.write_bytes(data)


