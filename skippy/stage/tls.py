"""Mutual TLS on the links of a chain that leaves loopback (docs/operations.md).

One process is one place in a chain, so its TLS identity is set once at start (`use`):
every link it dials (lanes, status queries, the direct return) and every listener it opens
then runs over TLS whenever the far host is not loopback, both sides checking the other's
certificate against the chain's CA (`skippy plan` writes them). Loopback links stay plain.
The auth token check runs inside TLS as before. The listener runs the TLS handshake (an
upgrade after accepting would lose a ClientHello the stream already buffered), so a refused
handshake is logged by the dialer ("certificate verify failed"), not by the listener.
"""

from __future__ import annotations

import logging
import ssl
from functools import cache
from pathlib import Path

from ..protocol import TlsConfig, is_loopback

log = logging.getLogger("skippy.stage")
_identity: TlsConfig | None = None


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
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    out_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)

    def write(path: Path, data: bytes) -> None:
        path.touch(mode=0o600)
        path.chmod(0o600)
        path.write_bytes(data)

    def certificate(subject: str, key, issuer_name, issuer_key, *, ca: bool, host: str | None = None):
        builder = (x509.CertificateBuilder()
                   .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
                   .issuer_name(issuer_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
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

    def pem_key(key) -> bytes:
        return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "skippy chain CA")])
    ca_cert = certificate("skippy chain CA", ca_key, ca_name, ca_key, ca=True)
    write(out_dir / "ca.pem", ca_cert.public_bytes(serialization.Encoding.PEM))
    write(out_dir / "ca.key", pem_key(ca_key))  # kept to issue a standby's certificate later
    configs = {}
    for name, host in hosts.items():
        key = ec.generate_private_key(ec.SECP256R1())
        cert = certificate(name, key, ca_name, ca_key, ca=False, host=host)
        write(out_dir / f"{name}.pem", cert.public_bytes(serialization.Encoding.PEM))
        write(out_dir / f"{name}.key", pem_key(key))
        configs[name] = TlsConfig(ca_file=f"{out_dir.name}/ca.pem", cert_file=f"{out_dir.name}/{name}.pem",
                                  key_file=f"{out_dir.name}/{name}.key")
    return configs
