"""Sans-I/O certificates and revocation lists of a network authority (docs/PROTOCOL.md section 10).

A network's CA is an Ed25519 key and a self-signed CA certificate. A node
certificate binds one node's public key (signing key and Noise key, see
identity.py) to its name, virtual IPs, the proxy CIDRs it may advertise, the
exit grant, groups and a validity period, and is signed by a CA. A revocation
list names revoked certificate fingerprints under a serial that only grows and
is signed by a CA too. Files are armored like PEM ("-----BEGIN MESHGATE
CERTIFICATE-----", base64, "-----END ...-----").

Every parser raises `CertError` with a short reason (a counter label) and never
any other exception; every check takes `now` (unix seconds) from the caller.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import ipaddress
import struct
from dataclasses import dataclass

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from meshgate.mesh.identity import verify

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

CERT_MAGIC = b"MGC1"
REVOCATION_MAGIC = b"MGR1"
KIND_CA = 1
KIND_NODE = 2
_F_EXIT = 0x01
_F_DNS = 0x02  # DNS suffix grants follow the groups (certificates before this never set it)
NO_KEY = bytes(32)
SIG_LEN = 64
MAX_CERT = 4096
MAX_LABEL = 63
MAX_GROUPS = 32
MAX_CIDRS = 64
MAX_DNS = 16
MAX_REVOKED = 16384

CERT_LABEL = "MESHGATE CERTIFICATE"
CA_KEY_LABEL = "MESHGATE CA KEY"
REVOCATION_LABEL = "MESHGATE REVOCATION LIST"

_U64 = struct.Struct("!Q")


class CertError(ValueError):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason  # short, for a counter label


# ---------------------------------------------------------------- armor


def armor(label: str, raw: bytes) -> str:
    b64 = base64.b64encode(raw).decode()
    lines = [b64[i : i + 64] for i in range(0, len(b64), 64)]
    return "\n".join([f"-----BEGIN {label}-----", *lines, f"-----END {label}-----", ""])


def dearmor(text: str, label: str) -> bytes:
    begin, end = f"-----BEGIN {label}-----", f"-----END {label}-----"
    start = text.find(begin)
    stop = text.find(end, start + 1)
    if start < 0 or stop < 0:
        raise CertError("malformed", f"not a {label.lower()} (no {begin!r} line)")
    try:
        return base64.b64decode("".join(text[start + len(begin) : stop].split()), validate=True)
    except (binascii.Error, ValueError):
        raise CertError("malformed", f"the {label.lower()} is not valid base64") from None


# ---------------------------------------------------------------- reading


class _Reader:
    __slots__ = ("data", "pos")

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def take(self, n: int) -> bytes:
        if len(self.data) - self.pos < n:
            raise CertError("truncated", "truncated")
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def u8(self) -> int:
        return self.take(1)[0]

    def u16(self) -> int:
        return int.from_bytes(self.take(2), "big")

    def u64(self) -> int:
        return int(_U64.unpack(self.take(8))[0])

    def text(self) -> str:
        raw = self.take(self.u8())
        try:
            s = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise CertError("malformed", "a name is not UTF-8") from None
        if len(raw) > MAX_LABEL or not s.isprintable():
            raise CertError("malformed", "a name is too long or not printable")
        return s

    def suffix(self) -> str:
        """A granted DNS suffix: printable ASCII, lowercase, one trailing dot."""
        raw = self.take(self.u8())
        if not (raw.isascii() and raw.endswith(b".") and raw == raw.lower() and raw.decode().isprintable()):
            raise CertError("malformed", "a DNS suffix grant is not a lowercase name with a trailing dot")
        return raw.decode()

    def iface(self, size: int) -> ipaddress.IPv4Interface | ipaddress.IPv6Interface | None:
        if not self.u8():
            return None
        addr, plen = self.take(size), self.u8()
        if plen > size * 8:
            raise CertError("malformed", "prefix length out of range")
        return ipaddress.IPv4Interface((addr, plen)) if size == 4 else ipaddress.IPv6Interface((addr, plen))


def _put_text(out: bytearray, s: str) -> None:
    raw = s.encode()
    if len(raw) > MAX_LABEL:
        raise CertError("malformed", f"{s[:20]!r}… is longer than {MAX_LABEL} bytes")
    out.append(len(raw))
    out += raw


def _put_iface(out: bytearray, iface: ipaddress.IPv4Interface | ipaddress.IPv6Interface | None) -> None:
    if iface is None:
        out.append(0)
        return
    out.append(1)
    out += iface.ip.packed
    out.append(iface.network.prefixlen)


# ---------------------------------------------------------------- certificates


@dataclass(frozen=True)
class Certificate:
    kind: int
    network: str
    name: str
    signing_key: bytes
    dh_key: bytes
    not_before: int
    not_after: int
    ipv4: ipaddress.IPv4Interface | None
    ipv6: ipaddress.IPv6Interface | None
    cidrs: tuple[tuple[IPNetwork, bool], ...]  # (network it may advertise, mapped)
    exit: bool
    groups: tuple[str, ...]
    issuer: bytes  # the issuing CA certificate's fingerprint (raw 32 bytes); NO_KEY on a CA
    signature: bytes
    raw: bytes
    dns: tuple[str, ...] = ()  # DNS suffixes it may answer for the mesh (dns.serve_suffixes)

    @property
    def public(self) -> bytes:
        """The node's public key as identity.py spells it (signing || Noise)."""
        return self.signing_key + self.dh_key

    @property
    def fingerprint(self) -> str:
        return hashlib.sha256(self.raw).hexdigest()

    @property
    def is_ca(self) -> bool:
        return self.kind == KIND_CA

    def grants_cidr(self, net: IPNetwork, mapped: bool) -> bool:
        return any(
            m == mapped and net.version == g.version and net.subnet_of(g)  # type: ignore[arg-type]
            for g, m in self.cidrs
        )

    def grants_dns(self, suffix: str) -> bool:
        """A granted suffix covers itself and every name under it (label boundaries)."""
        return any(suffix == g or suffix.endswith("." + g) for g in self.dns)


def _cert_body(
    kind: int, network: str, name: str, signing_key: bytes, dh_key: bytes, not_before: int,
    not_after: int, ipv4: ipaddress.IPv4Interface | None, ipv6: ipaddress.IPv6Interface | None,
    cidrs: tuple[tuple[IPNetwork, bool], ...], exit: bool, groups: tuple[str, ...], issuer: bytes,
    dns: tuple[str, ...] = (),
) -> bytes:
    if len(cidrs) > MAX_CIDRS or len(groups) > MAX_GROUPS or len(dns) > MAX_DNS:
        raise CertError("malformed",
                        f"at most {MAX_CIDRS} CIDRs, {MAX_GROUPS} groups and {MAX_DNS} DNS suffixes")
    out = bytearray(CERT_MAGIC)
    out += bytes((kind, (_F_EXIT if exit else 0) | (_F_DNS if dns else 0)))
    _put_text(out, network)
    _put_text(out, name)
    out += signing_key + dh_key
    out += _U64.pack(not_before) + _U64.pack(not_after)
    _put_iface(out, ipv4)
    _put_iface(out, ipv6)
    out.append(len(cidrs))
    for net, mapped in cidrs:
        out.append((net.version == 6) | (0x02 if mapped else 0))
        out.append(net.prefixlen)
        out += net.network_address.packed
    out.append(len(groups))
    for g in groups:
        _put_text(out, g)
    if dns:
        out.append(len(dns))
        for suffix in dns:  # names up to 254 bytes, so not _put_text's 63
            raw = suffix.encode("ascii")
            out.append(len(raw))
            out += raw
    out += issuer
    return bytes(out)


def issue(
    signer: Ed25519PrivateKey, issuer: bytes, *, kind: int, network: str, name: str, public: bytes,
    not_before: int, not_after: int, ipv4: ipaddress.IPv4Interface | None = None,
    ipv6: ipaddress.IPv6Interface | None = None, cidrs: tuple[tuple[IPNetwork, bool], ...] = (),
    exit: bool = False, groups: tuple[str, ...] = (), dns: tuple[str, ...] = (),
) -> Certificate:
    """Sign a certificate. A CA's own: kind=KIND_CA, public = its signing key + NO_KEY, issuer NO_KEY."""
    body = _cert_body(kind, network, name, public[:32], public[32:], not_before, not_after, ipv4,
                      ipv6, cidrs, exit, groups, issuer, dns)
    return parse_certificate(body + signer.sign(body))


def parse_certificate(raw: bytes) -> Certificate:
    """Decode (not verify) a certificate; CertError on anything but a well-formed one."""
    raw = bytes(raw)
    if len(raw) > MAX_CERT:
        raise CertError("malformed", "certificate too long")
    r = _Reader(raw)
    try:
        if r.take(4) != CERT_MAGIC:
            raise CertError("malformed", "not a meshgate certificate")
        kind, flags = r.u8(), r.u8()
        if kind not in (KIND_CA, KIND_NODE) or flags & ~(_F_EXIT | _F_DNS):
            raise CertError("malformed", "unknown certificate kind or flags")
        network, name = r.text(), r.text()
        signing_key, dh_key = r.take(32), r.take(32)
        not_before, not_after = r.u64(), r.u64()
        ipv4 = r.iface(4)
        ipv6 = r.iface(16)
        cidrs: list[tuple[IPNetwork, bool]] = []
        for _ in range(r.u8()):
            k, plen = r.u8(), r.u8()
            if k & ~0x03:
                raise CertError("malformed", "unknown CIDR kind")
            size = 16 if k & 1 else 4
            addr = r.take(size)
            if plen > size * 8:
                raise CertError("malformed", "prefix length out of range")
            net: IPNetwork = (ipaddress.IPv6Network((addr, plen), strict=False) if size == 16
                              else ipaddress.IPv4Network((addr, plen), strict=False))
            cidrs.append((net, bool(k & 0x02)))
        groups = tuple(r.text() for _ in range(r.u8()))
        dns = tuple(r.suffix() for _ in range(r.u8())) if flags & _F_DNS else ()
        if flags & _F_DNS and not 0 < len(dns) <= MAX_DNS:
            raise CertError("malformed", f"1-{MAX_DNS} DNS suffixes")
        issuer = r.take(32)
        signature = r.take(SIG_LEN)
    except ValueError as e:  # CertError is one; ipaddress raises the others
        if isinstance(e, CertError):
            raise
        raise CertError("malformed", f"bad address: {e}") from None
    if r.pos != len(raw):
        raise CertError("malformed", "trailing bytes after the certificate")
    if len(cidrs) > MAX_CIDRS or len(groups) > MAX_GROUPS:
        raise CertError("malformed", "too many CIDRs or groups")
    return Certificate(kind, network, name, signing_key, dh_key, not_before, not_after,
                       ipv4, ipv6, tuple(cidrs), bool(flags & _F_EXIT), groups, issuer, signature, raw,  # type: ignore[arg-type]
                       dns)


def load_certificate_text(text: str) -> Certificate:
    return parse_certificate(dearmor(text, CERT_LABEL))


def check_ca(ca: Certificate, now: int) -> None:
    """A CA certificate as given to a node (node.ca): self-signed and in its validity."""
    if not ca.is_ca:
        raise CertError("not_a_ca", "a node certificate, not a CA certificate")
    if not verify(ca.signing_key, ca.signature, ca.raw[:-SIG_LEN]):
        raise CertError("bad_signature", "the CA certificate's self-signature does not verify")
    _check_time(ca, now)


def _check_time(cert: Certificate, now: int) -> None:
    if now < cert.not_before:
        raise CertError("not_yet_valid", "not valid yet")
    if now >= cert.not_after:
        raise CertError("expired", "expired")


def check_certificate(
    cert: Certificate, cas: dict[bytes, Certificate], network: str, now: int,
    revoked: frozenset[bytes] = frozenset(),
) -> Certificate:
    """Verify a node certificate against the trusted CAs (by fingerprint, raw bytes); returns
    its CA. CertError with the reason: not_a_node, unknown_ca, bad_signature, wrong_network,
    expired, not_yet_valid, revoked."""
    ca = check_issuer(cert, cas, network)
    check_current(cert, ca, now, revoked)
    return ca


def check_issuer(cert: Certificate, cas: dict[bytes, Certificate], network: str) -> Certificate:
    """The part of the check that never changes for a given certificate (cache its result)."""
    if cert.kind != KIND_NODE:
        raise CertError("not_a_node", "a CA certificate where a node's belongs")
    ca = cas.get(cert.issuer)
    if ca is None:
        raise CertError("unknown_ca", "issued by a CA this node does not trust (node.ca)")
    if not verify(ca.signing_key, cert.signature, cert.raw[:-SIG_LEN]):
        raise CertError("bad_signature", "the signature does not verify")
    if cert.network != network or ca.network != network:
        raise CertError("wrong_network", f"for network {cert.network!r}, not {network!r}")
    return ca


def check_current(cert: Certificate, ca: Certificate, now: int, revoked: frozenset[bytes]) -> None:
    """The part that changes with the clock and the revocation list."""
    _check_time(cert, now)
    if now >= ca.not_after:
        raise CertError("expired", "its CA has expired")
    if hashlib.sha256(cert.raw).digest() in revoked:
        raise CertError("revoked", "revoked")


# ---------------------------------------------------------------- revocation lists


@dataclass(frozen=True)
class RevocationList:
    network: str
    serial: int
    issued: int
    revoked: frozenset[bytes]  # certificate fingerprints, raw 32 bytes
    issuer: bytes
    signature: bytes
    raw: bytes


def issue_revocation_list(
    signer: Ed25519PrivateKey, issuer: bytes, network: str, serial: int, issued: int,
    revoked: frozenset[bytes],
) -> RevocationList:
    if len(revoked) > MAX_REVOKED:
        raise CertError("malformed", f"at most {MAX_REVOKED} revoked certificates in one list")
    out = bytearray(REVOCATION_MAGIC)
    _put_text(out, network)
    out += _U64.pack(serial) + _U64.pack(issued)
    out += len(revoked).to_bytes(2, "big")
    for fp in sorted(revoked):
        out += fp
    out += issuer
    body = bytes(out)
    return parse_revocation_list(body + signer.sign(body))


def parse_revocation_list(raw: bytes) -> RevocationList:
    raw = bytes(raw)
    r = _Reader(raw)
    if r.take(4) != REVOCATION_MAGIC:
        raise CertError("malformed", "not a meshgate revocation list")
    network = r.text()
    serial, issued = r.u64(), r.u64()
    count = r.u16()
    if count > MAX_REVOKED:
        raise CertError("malformed", "too many entries")
    revoked = frozenset(r.take(32) for _ in range(count))
    issuer, signature = r.take(32), r.take(SIG_LEN)
    if r.pos != len(raw):
        raise CertError("malformed", "trailing bytes after the revocation list")
    return RevocationList(network, serial, issued, revoked, issuer, signature, raw)


def check_revocation_list(rl: RevocationList, cas: dict[bytes, Certificate], network: str) -> None:
    ca = cas.get(rl.issuer)
    if ca is None:
        raise CertError("unknown_ca", "signed by a CA this node does not trust (node.ca)")
    if not verify(ca.signing_key, rl.signature, rl.raw[:-SIG_LEN]):
        raise CertError("bad_signature", "the signature does not verify")
    if rl.network != network:
        raise CertError("wrong_network", f"for network {rl.network!r}, not {network!r}")
