"""TLS material for DNS listeners and QUIC links.

A DNS listener without its own `cert`/`key` gets a certificate issued by the node's local CA:
one CA per state directory (`ca.crt`, `ca.key`, made once, 10 years), and one listener
certificate (`dns-selfsigned.crt` holding the leaf then the CA, `dns-selfsigned.key`; the file
names are the ones the self-signed certificate of earlier versions had). The leaf names the
listen addresses, loopback, `localhost` and `<node>.<zone>`; it is issued again when those change,
when it has fewer than RENEW_DAYS left, or when the CA changed. Trusting `ca.crt` once
(`meshgate tls trust`) makes browsers accept every certificate the node issues.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import logging
import os
import ssl
from collections.abc import Iterable
from pathlib import Path
from typing import Any

log = logging.getLogger("meshgate.tls")

CERT_NAME = "dns-selfsigned.crt"  # the leaf followed by the CA certificate
KEY_NAME = "dns-selfsigned.key"
CA_CERT_NAME = "ca.crt"
CA_KEY_NAME = "ca.key"
VALID_DAYS = 397  # the listener certificate: browsers refuse a leaf valid for longer than 398 days
CA_VALID_DAYS = 3650
RENEW_DAYS = 30  # issue again (the CA: make a new one) when fewer days than this are left
DEFAULT_ZONE = "mesh.internal"
LOOPBACK = ("127.0.0.1", "::1")
WILDCARD = ("", "0.0.0.0", "::", "*")
# What the CA may issue for (its nameConstraints): localhost, the mesh zone, and the private,
# loopback and link-local address ranges a node's listeners sit on.
PERMITTED_NETS = ("127.0.0.0/8", "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10",
                  "169.254.0.0/16", "::1/128", "fc00::/7", "fe80::/10")


def make_self_signed(common_name: str, sans: list[str], days: int) -> tuple[Any, Any]:
    """A self-signed P-256 certificate and its key (cryptography objects), in memory.

    `sans` holds DNS names and IP literals. Used for QUIC mesh links (the Noise handshake
    inside authenticates those, so their certificate only has to exist).
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name),
                      x509.NameAttribute(NameOID.ORGANIZATION_NAME, "meshgate self-signed")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        _builder(name, name, key, now, days)
        .add_extension(x509.SubjectAlternativeName(_general_names(sans)), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    return cert, key


def _builder(subject: Any, issuer: Any, key: Any, now: datetime.datetime, days: int) -> Any:
    """A certificate builder with what every one here shares: names, key, a random serial, and a
    validity from five minutes ago (clock skew) for `days`."""
    from cryptography import x509

    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
    )


def _general_names(sans: Iterable[str]) -> list[Any]:
    from cryptography import x509

    alt: list[x509.GeneralName] = []
    for san in sans:
        try:
            alt.append(x509.IPAddress(ipaddress.ip_address(san)))
        except ValueError:
            alt.append(x509.DNSName(san))
    return alt


def _zone(zone: str) -> str:
    return zone.strip(".").lower() or DEFAULT_ZONE


def _write(path: Path, data: bytes, mode: int) -> None:
    """Write a file whole (a temporary file renamed over it): a reader sees the old or the new."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def _key_pem(key: Any) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                   serialization.NoEncryption()))


def _cert_pem(cert: Any) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return bytes(cert.public_bytes(serialization.Encoding.PEM))


def _load_pair(cert_path: Path, key_path: Path) -> tuple[Any, Any] | None:
    """The first certificate in `cert_path` and the key in `key_path`, if both load and match."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    try:
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    except (OSError, ValueError, TypeError):
        return None
    if cert.public_key() != key.public_key():
        return None
    return cert, key


def _state_dir(state_dir: Path) -> None:
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)


def ca_name(node_name: str) -> str:
    """The CA's common name; also its nickname in the NSS databases `meshgate tls trust` writes."""
    return f"meshgate local CA ({node_name})"


def ensure_ca(state_dir: Path, node_name: str = "meshgate", zone: str = DEFAULT_ZONE) -> tuple[Path, Path]:
    """The node's local CA in `state_dir` (ca.crt, ca.key 0600; the directory 0700): kept while
    it loads and has RENEW_DAYS left, else made anew (P-256, CA:TRUE pathlen 0, keyCertSign and
    cRLSign, name constraints: localhost, the zone, private and loopback addresses)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    cert_path, key_path = state_dir / CA_CERT_NAME, state_dir / CA_KEY_NAME
    now = datetime.datetime.now(datetime.UTC)
    pair = _load_pair(cert_path, key_path)
    if pair is not None and pair[0].not_valid_after_utc > now + datetime.timedelta(days=RENEW_DAYS):
        return cert_path, key_path
    _state_dir(state_dir)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, ca_name(node_name)),
                      x509.NameAttribute(NameOID.ORGANIZATION_NAME, "meshgate")])
    permitted: list[x509.GeneralName] = [x509.DNSName("localhost"), x509.DNSName(_zone(zone))]
    permitted += [x509.IPAddress(ipaddress.ip_network(n)) for n in PERMITTED_NETS]
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (
        _builder(name, name, key, now, CA_VALID_DAYS)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False,
                                     key_encipherment=False, data_encipherment=False,
                                     key_agreement=False, key_cert_sign=True, crl_sign=True,
                                     encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.NameConstraints(permitted_subtrees=permitted, excluded_subtrees=None),
                       critical=True)
        .add_extension(ski, critical=False)
        .sign(key, hashes.SHA256())
    )
    _write(key_path, _key_pem(key), 0o600)
    _write(cert_path, _cert_pem(cert), 0o644)
    log.info("tls: made the local CA %s (%s)", cert_path, fingerprint(cert_path))
    return cert_path, key_path


def fingerprint(cert_path: Path) -> str:
    """SHA-256 fingerprint of the (first) certificate in a PEM file, as AA:BB:..."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes

    cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    return ":".join(f"{b:02X}" for b in cert.fingerprint(hashes.SHA256()))


def leaf_sans(hosts: Iterable[str], node_name: str = "meshgate", zone: str = DEFAULT_ZONE) -> list[str]:
    """The names a listener certificate carries: each listen host (a wildcard stands for
    loopback), 127.0.0.1, ::1, localhost and `<node>.<zone>`; sorted, no repeats."""
    out: set[str] = set(LOOPBACK) | {"localhost"}
    for host in hosts:
        h = host.strip("[]")
        if h in WILDCARD:
            continue
        try:
            out.add(str(ipaddress.ip_address(h)))
        except ValueError:
            out.add(h.lower().rstrip("."))
    node = f"{node_name}.{_zone(zone)}".lower()
    if node.isascii():
        out.add(node)
    return sorted(out)


def _permitted(san: str, zone: str) -> bool:
    try:
        ip = ipaddress.ip_address(san)
    except ValueError:
        z = _zone(zone)
        return san == "localhost" or san == z or san.endswith("." + z)
    return any(ip in ipaddress.ip_network(n) for n in PERMITTED_NETS)


def ensure_listener_cert(state_dir: Path, hosts: Iterable[str] = (), *, node_name: str = "meshgate",
                         zone: str = DEFAULT_ZONE) -> tuple[Path, Path]:
    """The DNS listeners' certificate, issued by the local CA (made first if need be).

    Kept while it names exactly leaf_sans(hosts), has RENEW_DAYS left and verifies against
    the CA; else issued again (the key is kept: a reader never pairs a new certificate with an
    old key). The certificate file holds the leaf then the CA, so servers send the chain.
    Names the CA's constraints do not permit (a public address) are left out, with a warning:
    configure `cert`/`key` for those.
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    ca_cert_path, ca_key_path = ensure_ca(state_dir, node_name, zone)
    ca_cert = x509.load_pem_x509_certificate(ca_cert_path.read_bytes())
    ca_key = serialization.load_pem_private_key(ca_key_path.read_bytes(), password=None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise ValueError(f"{ca_key_path}: not an EC key (meshgate makes P-256 CA keys)")
    wanted = leaf_sans(hosts, node_name, zone)
    dropped = [s for s in wanted if not _permitted(s, zone)]
    if dropped:
        log.warning("tls: the local CA cannot issue for %s (outside its name constraints); configure"
                    " the listener's cert and key to serve those names", ", ".join(dropped))
        wanted = [s for s in wanted if s not in dropped]
    cert_path, key_path = state_dir / CERT_NAME, state_dir / KEY_NAME
    now = datetime.datetime.now(datetime.UTC)
    pair = _load_pair(cert_path, key_path)
    if pair is not None and _current(pair[0], ca_cert, wanted, now):
        return cert_path, key_path
    if pair is not None and isinstance(pair[1], ec.EllipticCurvePrivateKey):
        key = pair[1]
    else:
        key = ec.generate_private_key(ec.SECP256R1())
        _write(key_path, _key_pem(key), 0o600)
    cn = next((s for s in wanted if s != "localhost" and not _is_ip(s)), "localhost")
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn),
                         x509.NameAttribute(NameOID.ORGANIZATION_NAME, "meshgate")])
    cert = (
        _builder(subject, ca_cert.subject, key, now, VALID_DAYS)
        .add_extension(x509.SubjectAlternativeName(_general_names(wanted)), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False,
                                     key_encipherment=False, data_encipherment=False,
                                     key_agreement=False, key_cert_sign=False, crl_sign=False,
                                     encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                       critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    _state_dir(state_dir)
    _write(cert_path, _cert_pem(cert) + _cert_pem(ca_cert), 0o644)
    log.info("tls: issued %s for %s", cert_path, ", ".join(wanted))
    return cert_path, key_path


def _is_ip(s: str) -> bool:
    try:
        ipaddress.ip_address(s)
    except ValueError:
        return False
    return True


def _current(cert: Any, ca_cert: Any, wanted: list[str], now: datetime.datetime) -> bool:
    """Whether an issued certificate still serves: signed by this CA, the wanted names, time left."""
    from cryptography import x509
    from cryptography.exceptions import InvalidSignature

    try:
        cert.verify_directly_issued_by(ca_cert)
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (ValueError, TypeError, x509.ExtensionNotFound, InvalidSignature):
        return False
    have = sorted({str(v) for v in san.get_values_for_type(x509.IPAddress)}
                  | set(san.get_values_for_type(x509.DNSName)))
    return bool(have == sorted(wanted)
                and cert.not_valid_after_utc > now + datetime.timedelta(days=RENEW_DAYS))


def cert_note(cert_path: Path) -> str:
    """The status/banner line naming an issued listener certificate and its CA."""
    return (f"TLS certificate: {cert_path}, issued by the local CA {cert_path.with_name(CA_CERT_NAME)}"
            " (`meshgate tls trust` adds it to browsers)")


def ensure_self_signed(state_dir: Path) -> tuple[Path, Path]:
    """A listener certificate for loopback and localhost, issued by the local CA in `state_dir`
    (the name is from when it was self-signed; `dns-selfsigned.crt` holds the CA too, so it
    serves as a CA file for clients)."""
    return ensure_listener_cert(state_dir)


def ca_nickname(ca_path: Path) -> str:
    """The CA's common name: its nickname in NSS databases (one nickname per node name, so
    trusting again, or trusting a new CA of the same node, replaces the entry)."""
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    cert = x509.load_pem_x509_certificate(ca_path.read_bytes())
    cns = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(cns[0].value) if cns else "meshgate local CA"


FIREFOX_PROFILES = (".mozilla/firefox/*/cert9.db", "snap/firefox/common/.mozilla/firefox/*/cert9.db")
TRUST_FLAGS = "C,,"  # a CA trusted to issue TLS server certificates (not e-mail, not code)


def nss_databases(home: Path) -> list[tuple[str, Path]]:
    """The NSS databases `meshgate tls trust` writes: Chromium's ~/.pki/nssdb (made if missing)
    and each Firefox profile that has a cert9.db."""
    dbs = [("Chromium", home / ".pki" / "nssdb")]
    for pattern in FIREFOX_PROFILES:
        dbs += [(f"Firefox profile {db.parent.name}", db.parent) for db in sorted(home.glob(pattern))]
    return dbs


def trust_commands(ca_path: Path, home: Path) -> list[str]:
    """The shell commands that trust the CA (what `meshgate tls trust` runs, or prints when
    certutil is missing)."""
    import shlex

    nick = ca_nickname(ca_path)
    cmds = []
    for _label, db in nss_databases(home):
        d = f"sql:{db}"
        if not (db / "cert9.db").exists():
            cmds.append(shlex.join(["mkdir", "-p", "-m", "700", str(db)]))
            cmds.append(shlex.join(["certutil", "-N", "-d", d, "--empty-password"]))
        cmds.append(shlex.join(["certutil", "-D", "-d", d, "-n", nick]) + " 2>/dev/null")
        cmds.append(shlex.join(["certutil", "-A", "-d", d, "-n", nick, "-t", TRUST_FLAGS,
                                "-i", str(ca_path)]))
    return cmds


def trust(ca_path: Path, home: Path) -> int:
    """Add the CA to the user's NSS databases with certutil: 0 when every one took it; 1 (and
    the commands printed) without certutil; 2 when certutil failed somewhere."""
    import shutil
    import subprocess
    import sys

    certutil = shutil.which("certutil")
    if certutil is None:
        print("meshgate: certutil not found (Debian/Ubuntu: apt install libnss3-tools;"
              " Fedora: dnf install nss-tools); to trust the CA, run:", file=sys.stderr)
        for cmd in trust_commands(ca_path, home):
            print(f"  {cmd}")
        return 1
    nick = ca_nickname(ca_path)

    def run(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([certutil, *argv], capture_output=True, text=True, timeout=60, check=False)

    status = 0
    for label, db in nss_databases(home):
        d = f"sql:{db}"
        if not (db / "cert9.db").exists():
            db.mkdir(parents=True, exist_ok=True, mode=0o700)
            made = run("-N", "-d", d, "--empty-password")
            if made.returncode != 0:
                print(f"meshgate: {label}: certutil -N -d {d}: {made.stderr.strip()}", file=sys.stderr)
                status = 2
                continue
        for _ in range(16):  # every entry under the nickname (an older CA of this node included)
            if run("-D", "-d", d, "-n", nick).returncode != 0:
                break
        added = run("-A", "-d", d, "-n", nick, "-t", TRUST_FLAGS, "-i", str(ca_path))
        if added.returncode != 0:
            print(f"meshgate: {label}: certutil -A -d {d}: {added.stderr.strip()}", file=sys.stderr)
            status = 2
            continue
        print(f"{label}: trusted {nick!r} ({TRUST_FLAGS}) in {d}")
    if status == 0:
        print("restart the browser to pick it up")
    return status


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
