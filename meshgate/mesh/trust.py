"""What a node accepts from other nodes: their HELLOs and their route records.

Two modes (docs/OPERATIONS.md, "Identity"):
- secret mode: anyone who knows the network secret may join; a node's id is
  bound to its key (identity.py) and its records are signed, so no member can
  speak for another node, but what a node claims (virtual IPs, CIDRs, exit) is
  first come, first served;
- certificate mode (node.certificate, node.ca): a node must show a certificate
  from a trusted CA for its key, and every record is held to what its origin's
  certificate grants. Revoked and expired certificates are refused and their
  holders cut off.

Sans-I/O: the caller passes `now` (unix seconds) to every check that needs time.
Checks return a short reason (a counter label) or None.
"""

from __future__ import annotations

import hashlib
import ipaddress
from dataclasses import dataclass

from meshgate.mesh import certs
from meshgate.mesh.certs import CertError, Certificate, RevocationList
from meshgate.mesh.frames import Hello, hello_signed_data
from meshgate.mesh.identity import PUBLIC_LEN, SIGNATURE_LEN, node_id_of, verify
from meshgate.mesh.routing import Record

# A record's version is its origin's wall clock in ms at start, +1 per change (at most 20 a
# second): one far ahead of our clock is forged or from a broken clock, and if stored it would
# outlive its origin's restart (whose versions start at its clock again).
MAX_VERSION_AHEAD_MS = 10 * 60 * 1000
MAX_CERT_CACHE = 8192


@dataclass(frozen=True)
class PeerIdentity:
    """Who is on the other end of a link, as checked at its HELLO."""

    node_id: int
    fingerprint: str  # of the public key
    cert: Certificate | None


class Trust:
    def __init__(
        self, network: str, cas: tuple[Certificate, ...] = (), own_cert: Certificate | None = None,
        revocation: RevocationList | None = None, require: bool = True,
    ) -> None:
        self.network = network
        self.cas = {hashlib.sha256(ca.raw).digest(): ca for ca in cas}
        self.own_cert = own_cert
        # with CAs, a certificate shown is always checked; `require` (node.require_certificates,
        # false only while a secret-mode mesh moves to certificates) refuses peers without one
        self.certificate_mode = own_cert is not None and bool(cas)
        self.require = self.certificate_mode and require
        self.revocation = revocation
        self.revoked: frozenset[bytes] = revocation.revoked if revocation is not None else frozenset()
        # certificates whose signature and CA were checked once: raw -> (certificate, its CA)
        self._verified: dict[bytes, tuple[Certificate, Certificate]] = {}

    # ------------------------------------------------------------ certificates

    def certificate(self, raw: bytes, now: int) -> Certificate:
        """A peer's certificate, checked: its signature and CA once (cached), the clock and
        the revocation list every time. CertError with the reason."""
        entry = self._verified.get(raw)
        if entry is None:
            cert = certs.parse_certificate(raw)
            ca = certs.check_issuer(cert, self.cas, self.network)
            if len(self._verified) >= MAX_CERT_CACHE:
                self._verified.clear()  # bounded; re-verifying is only CPU
            self._verified[raw] = entry = (cert, ca)
        cert, ca = entry
        certs.check_current(cert, ca, int(now), self.revoked)
        return cert

    def certificate_for(self, raw: bytes, public: bytes, now: float) -> Certificate | str | None:
        """What a peer's certificate (possibly empty) proves for `public`: the certificate, None
        when none is needed (secret mode, or none shown while require_certificates is false), or
        why it is refused: no_certificate, wrong_key, or the certificate's own reason."""
        if not self.certificate_mode or not (raw or self.require):
            return None
        if not raw:
            return "no_certificate"
        try:
            cert = self.certificate(raw, int(now))
        except CertError as e:
            return e.reason
        return cert if cert.public == public else "wrong_key"

    def usable(self, raw: bytes, now: int) -> bool:
        try:
            self.certificate(raw, now)
        except CertError:
            return False
        return True

    # ------------------------------------------------------------ HELLO

    def check_hello(
        self, hello: Hello, remote_static: bytes, handshake_hash: bytes, peer_initiated: bool, now: float
    ) -> PeerIdentity | str:
        """The peer's identity, or why it is refused: bad_key (not a key, or not the Noise
        static key of this handshake), bad_node_id (the id is not its key's), bad_signature,
        no_certificate, or a certificate's reason (unknown_ca, expired, revoked, wrong_key...)."""
        key = hello.key
        if len(key) != PUBLIC_LEN or key[32:] != remote_static:
            return "bad_key"
        if hello.node_id != node_id_of(key):
            return "bad_node_id"
        if len(hello.signature) != SIGNATURE_LEN or not verify(
            key[:32], hello.signature, hello_signed_data(handshake_hash, peer_initiated)
        ):
            return "bad_signature"
        cert = self.certificate_for(hello.cert, key, now)
        if isinstance(cert, str):
            return cert
        return PeerIdentity(hello.node_id, hashlib.sha256(key).hexdigest(), cert)

    def check_e2e_peer(self, public: bytes, cert: bytes, held_key: bytes, now: float) -> str | None:
        """The initiator of an end-to-end session (its key proven by the Noise handshake, its id
        already checked against that key): key_changed (not the key its record carries), or in
        certificate mode no_certificate, wrong_key or a certificate's reason."""
        if held_key and held_key != public:
            return "key_changed"
        checked = self.certificate_for(cert, public, now)
        return checked if isinstance(checked, str) else None

    # ------------------------------------------------------------ route records

    def check_record(self, rec: Record, held: Record | None, now: float) -> str | None:
        """Whether to store a received record (None) or why not: unsigned, bad_origin (the
        origin is not its key's id), key_changed, bad_signature, future_version,
        no_certificate, not_granted, or a certificate's reason."""
        if len(rec.key) != PUBLIC_LEN or len(rec.signature) != SIGNATURE_LEN:
            return "unsigned"
        if rec.origin != node_id_of(rec.key):
            return "bad_origin"
        if held is not None and held.key and held.key != rec.key:
            return "key_changed"  # a second key hashing to a held id: first come keeps it
        if rec.version > now * 1000 + MAX_VERSION_AHEAD_MS:
            return "future_version"
        if not verify(rec.key[:32], rec.signature, rec.signed_part):
            return "bad_signature"
        cert = self.certificate_for(rec.cert, rec.key, now)
        if cert is None or isinstance(cert, str):
            return cert
        return None if grants(cert, rec) else "not_granted"

    # ------------------------------------------------------------ revocation

    def adopt(self, rl: RevocationList) -> str | None:
        """Take a revocation list if it is signed by a trusted CA and newer than ours; returns
        None when adopted, else why not (stale, or a CertError reason)."""
        try:
            certs.check_revocation_list(rl, self.cas, self.network)
        except CertError as e:
            return e.reason
        if self.revocation is not None and rl.serial <= self.revocation.serial:
            return "stale"
        self.revocation = rl
        self.revoked = rl.revoked
        return None


def grants(cert: Certificate, rec: Record) -> bool:
    """Whether the certificate allows everything the record claims."""
    if rec.name != cert.name:
        return False
    if rec.ipv4 is not None and rec.ipv4 != cert.ipv4:
        return False
    if rec.ipv6 is not None and rec.ipv6 != cert.ipv6:
        return False
    if rec.exit and not cert.exit:
        return False
    if not all(cert.grants_dns(s) for s in rec.dns):
        return False
    return all(cert.grants_cidr(net, mapped) for net, mapped in rec.cidrs)


def own_claims_granted(
    cert: Certificate, ipv4: ipaddress.IPv4Interface | None, ipv6: ipaddress.IPv6Interface | None,
    cidrs: tuple[tuple[certs.IPNetwork, bool], ...], exit: bool, dns: tuple[str, ...] = (),
) -> list[str]:
    """What the node's own config claims beyond its certificate (config keys), for start-up.
    The name is not among them: in certificate mode the mesh knows a node by its certificate's."""
    out = []
    if ipv4 is not None and ipv4 != cert.ipv4:
        out.append(f"node.ipv4 {ipv4} (the certificate grants {cert.ipv4 or 'none'})")
    if ipv6 is not None and ipv6 != cert.ipv6:
        out.append(f"node.ipv6 {ipv6} (the certificate grants {cert.ipv6 or 'none'})")
    for net, mapped in cidrs:
        if not cert.grants_cidr(net, mapped):
            out.append(f"mesh.proxy_cidrs {net} (not in the certificate)")
    if exit and not cert.exit:
        out.append("mesh.exit_node (the certificate has no exit grant)")
    for suffix in dns:
        if not cert.grants_dns(suffix):
            out.append(f"dns.serve_suffixes {suffix} (not in the certificate)")
    return out
