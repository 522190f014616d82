"""TLS material for DNS listeners and QUIC links: the configured cert, or a self-signed one."""

from __future__ import annotations

import datetime
import ipaddress
import os
import ssl
from pathlib import Path
from typing import Any

CERT_NAME = "dns-selfsigned.crt"
KEY_NAME = "dns-selfsigned.key"
VALID_DAYS = 365


def make_self_signed(common_name: str, sans: list[str], days: int) -> tuple[Any, Any]:
    """A self-signed P-256 certificate and its key (cryptography objects), in memory.

    `sans` holds DNS names and IP literals. Used for the DNS listeners (written to
    the state dir below) and for QUIC mesh links (the Noise handshake inside
    authenticates those, so their certificate only has to exist).
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name),
                      x509.NameAttribute(NameOID.ORGANIZATION_NAME, "meshgate self-signed")])
    alt: list[x509.GeneralName] = []
    for san in sans:
        try:
            alt.append(x509.IPAddress(ipaddress.ip_address(san)))
        except ValueError:
            alt.append(x509.DNSName(san))
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(alt), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    return cert, key


def ensure_self_signed(state_dir: Path) -> tuple[Path, Path]:
    """Reuse the generated certificate if still valid for a day, else write a new one.

    P-256 key, SAN localhost, 127.0.0.1 and ::1; the key file is 0600.
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    cert_path, key_path = state_dir / CERT_NAME, state_dir / KEY_NAME
    now = datetime.datetime.now(datetime.UTC)
    if cert_path.exists() and key_path.exists():
        try:
            cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
            if cert.not_valid_after_utc > now + datetime.timedelta(days=1):
                return cert_path, key_path
        except ValueError:
            pass
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    cert, key = make_self_signed("localhost", ["localhost", "127.0.0.1", "::1"], VALID_DAYS)
    key_bytes = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption())
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key_bytes)
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return cert_path, key_path


def server_context(cert: Path, key: Path, alpn: list[str]) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert, key)
    ctx.set_alpn_protocols(alpn)
    return ctx


def client_context(verify: bool | str, alpn: list[str]) -> ssl.SSLContext:
    """TLS client context for DoT and friends: system CAs, a CA file, or (False) no verification."""
    ctx = ssl.create_default_context()
    if verify is False:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    elif isinstance(verify, str):
        ctx.load_verify_locations(verify)
    ctx.set_alpn_protocols(alpn)
    return ctx
