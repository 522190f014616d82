"""The offline network authority behind `meshgate ca init|sign|revoke|show`.

A CA directory holds `ca.key` (the Ed25519 private key, 0600), `ca.crt` (the
self-signed CA certificate) and, once something is revoked, `revoked` (the
signed revocation list, whose serial only grows). Keep the directory off the
nodes: a node needs only ca.crt, its own certificate and the list.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import re
import time
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from meshgate.config import dns_suffix, parse_proxy_cidr
from meshgate.mesh import certs
from meshgate.mesh.certs import CertError, Certificate, RevocationList
from meshgate.mesh.identity import fingerprint, node_id_of, parse_public

CA_KEY = "ca.key"
CA_CERT = "ca.crt"
REVOKED = "revoked"

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400, "y": 365 * 86400}


class AuthorityError(ValueError):
    """A problem with a command's input; the message names the option or file."""


def parse_duration(text: str) -> int:
    """'3y', '90d', '12h', '30m', '45s' -> seconds."""
    m = re.fullmatch(r"\s*(\d+)\s*([smhdwy])\s*", text)
    if not m or int(m.group(1)) == 0:
        raise AuthorityError(f"--valid {text!r}: expected a number and a unit (s, m, h, d, w, y), e.g. 90d")
    return int(m.group(1)) * _UNITS[m.group(2)]


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def init(network: str, out: Path, valid: int, now: int | None = None) -> Certificate:
    """Make a CA in `out` (which must not hold one already)."""
    now = int(time.time()) if now is None else now
    if (out / CA_KEY).exists() or (out / CA_CERT).exists():
        raise AuthorityError(f"--out {out}: already holds a CA; give another directory")
    out.mkdir(mode=0o700, parents=True, exist_ok=True)
    key = Ed25519PrivateKey.generate()
    ca = certs.issue(
        key, certs.NO_KEY, kind=certs.KIND_CA, network=network, name=f"{network} CA",
        public=key.public_key().public_bytes_raw() + certs.NO_KEY, not_before=now - 60,
        not_after=now + valid,
    )
    _write_private(out / CA_KEY, certs.armor(certs.CA_KEY_LABEL, key.private_bytes_raw()))
    _write(out / CA_CERT, certs.armor(certs.CERT_LABEL, ca.raw))
    return ca


def load_ca(ca_dir: Path) -> tuple[Ed25519PrivateKey, Certificate]:
    try:
        key_text = (ca_dir / CA_KEY).read_text()
        cert_text = (ca_dir / CA_CERT).read_text()
    except OSError as e:
        raise AuthorityError(f"--ca {ca_dir}: {e.strerror or e} (made by `meshgate ca init`?)") from None
    try:
        raw_key = certs.dearmor(key_text, certs.CA_KEY_LABEL)
        ca = certs.load_certificate_text(cert_text)
        key = Ed25519PrivateKey.from_private_bytes(raw_key)
    except (CertError, ValueError) as e:
        raise AuthorityError(f"--ca {ca_dir}: {e}") from None
    if key.public_key().public_bytes_raw() != ca.signing_key:
        raise AuthorityError(f"--ca {ca_dir}: {CA_KEY} does not belong to {CA_CERT}")
    return key, ca


def sign(
    ca_dir: Path, *, name: str, public: str, ip: str, ip6: str | None = None,
    cidrs: tuple[str, ...] = (), exit: bool = False, groups: tuple[str, ...] = (),
    dns: tuple[str, ...] = (), valid: int = 90 * 86400, now: int | None = None,
) -> Certificate:
    now = int(time.time()) if now is None else now
    key, ca = load_ca(ca_dir)
    try:
        pub = parse_public(public)
    except ValueError as e:
        raise AuthorityError(f"--pub: {e}") from None
    try:
        ipv4 = ipaddress.IPv4Interface(ip)
    except ValueError:
        raise AuthorityError(
            f"--ip {ip!r}: expected an IPv4 address with its prefix, e.g. 10.144.144.5/24"
        ) from None
    ipv6 = None
    if ip6:
        try:
            ipv6 = ipaddress.IPv6Interface(ip6)
        except ValueError:
            raise AuthorityError(f"--ip6 {ip6!r}: expected an IPv6 address with its prefix") from None
    granted: list[tuple[certs.IPNetwork, bool]] = []
    for c in cidrs:
        try:
            pc = parse_proxy_cidr(c)
        except ValueError as e:
            raise AuthorityError(f"--cidr {c!r}: {e}") from None
        granted.append((pc.advertised, pc.mapped is not None))
    suffixes = []
    for d in dns:
        try:
            suffixes.append(dns_suffix(d))
        except ValueError as e:
            raise AuthorityError(f"--dns {d!r}: {e}") from None
    if any(c in name for c in ". /") or not name:
        raise AuthorityError(f"--name {name!r}: a DNS label (no dots, spaces or slashes)")
    not_after = min(now + valid, ca.not_after)
    try:
        return certs.issue(
            key, hashlib.sha256(ca.raw).digest(), kind=certs.KIND_NODE, network=ca.network, name=name,
            public=pub, not_before=now - 60, not_after=not_after, ipv4=ipv4, ipv6=ipv6,
            cidrs=tuple(granted), exit=exit, groups=groups, dns=tuple(suffixes),
        )
    except CertError as e:
        raise AuthorityError(str(e)) from None


def revoke(ca_dir: Path, target: str, now: int | None = None) -> RevocationList:
    """Add a certificate (a file, or its fingerprint in hex) to DIR/revoked, serial + 1."""
    now = int(time.time()) if now is None else now
    key, ca = load_ca(ca_dir)
    path = Path(target)
    if re.fullmatch(r"[0-9a-fA-F]{64}", target):
        fp = bytes.fromhex(target)
    else:
        try:
            cert = certs.load_certificate_text(path.read_text())
        except OSError as e:
            raise AuthorityError(
                f"{target}: {e.strerror or e} (a certificate file or a 64-hex fingerprint)"
            ) from None
        except CertError as e:
            raise AuthorityError(f"{target}: {e}") from None
        fp = hashlib.sha256(cert.raw).digest()
    old = current_list(ca_dir)
    revoked = (old.revoked if old is not None else frozenset()) | {fp}
    serial = (old.serial if old is not None else 0) + 1
    rl = certs.issue_revocation_list(key, hashlib.sha256(ca.raw).digest(), ca.network, serial, now, revoked)
    _write(ca_dir / REVOKED, certs.armor(certs.REVOCATION_LABEL, rl.raw))
    return rl


def current_list(ca_dir: Path) -> RevocationList | None:
    try:
        text = (ca_dir / REVOKED).read_text()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise AuthorityError(f"{ca_dir / REVOKED}: {e.strerror or e}") from None
    try:
        return certs.parse_revocation_list(certs.dearmor(text, certs.REVOCATION_LABEL))
    except CertError as e:
        raise AuthorityError(f"{ca_dir / REVOKED}: {e}") from None


def _when(t: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


def describe(text: str) -> str:
    """A certificate or revocation list in words (`meshgate ca show`)."""
    if certs.REVOCATION_LABEL in text:
        rl = certs.parse_revocation_list(certs.dearmor(text, certs.REVOCATION_LABEL))
        lines = [
            "revocation list", f"  network:  {rl.network}", f"  serial:   {rl.serial}",
            f"  issued:   {_when(rl.issued)}", f"  issuer:   {rl.issuer.hex()}",
            f"  revoked:  {len(rl.revoked)}",
        ]
        lines += [f"    {fp.hex()}" for fp in sorted(rl.revoked)]
        return "\n".join(lines)
    cert = certs.load_certificate_text(text)
    lines = [
        "CA certificate" if cert.is_ca else "node certificate",
        f"  network:     {cert.network}",
        f"  name:        {cert.name}",
        f"  fingerprint: {cert.fingerprint}",
        f"  valid:       {_when(cert.not_before)} to {_when(cert.not_after)}",
    ]
    if not cert.is_ca:
        lines += [
            f"  key:         {fingerprint(cert.public)} (node id {node_id_of(cert.public):08x})",
            f"  ipv4:        {cert.ipv4 or '-'}",
            f"  ipv6:        {cert.ipv6 or '-'}",
            "  cidrs:       " + (", ".join(f"{n}{' (mapped)' if m else ''}" for n, m in cert.cidrs) or "-"),
            f"  exit:        {'yes' if cert.exit else 'no'}",
            "  groups:      " + (", ".join(cert.groups) or "-"),
            "  dns:         " + (", ".join(cert.dns) or "-"),
            f"  issuer:      {cert.issuer.hex()}",
        ]
    return "\n".join(lines)
