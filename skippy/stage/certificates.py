"""A chain's certificates: its CA, and each stage's certificate for its host (stage/tls.py uses
them). Imports nothing of skippy's but the TlsConfig it returns, lazily: the Ray actor that
hosts a stage makes its key here and must stay a light process."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..protocol import TlsConfig


def issue_certificates(out_dir: Path, hosts: dict[str, str], *, days: int = 825) -> dict[str, TlsConfig]:
    """A fresh chain CA in `out_dir`, and for each name -> host a certificate for that host
    (subject alternative name; usable by a listener and a dialer alike). Keys are written
    owner-only. Returns each name's TlsConfig, its paths relative to `out_dir`'s parent."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    from ..protocol import TlsConfig

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


def public_key_of(key_pem: bytes) -> bytes:
    """The public key (PEM) of a private key made by `new_key_pair`."""
    from cryptography.hazmat.primitives import serialization

    key = serialization.load_pem_private_key(key_pem, password=None)
    return key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


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


