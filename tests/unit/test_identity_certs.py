"""Node identities, certificates, revocation lists, signed HELLOs and records (sans-I/O)."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import ipaddress
import os
import stat
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshgate.mesh import authority, certs
from meshgate.mesh.certs import CertError
from meshgate.mesh.frames import Hello, LinkError, decode_hello, encode_hello, hello_signed_data
from meshgate.mesh.identity import (
    Identity,
    IdentityError,
    load_or_create,
    node_id_of,
    parse_public,
    public_text,
)
from meshgate.mesh.routing import Record, RecordError, RouteTable, decode_one
from meshgate.mesh.trust import MAX_VERSION_AHEAD_MS, Trust
from tests.identity_testing import TestCA

NOW = int(time.time())


@pytest.fixture(autouse=True)
def _now() -> None:
    """NOW is this test's start (the module may be imported minutes before a test runs, and
    the certificates a test issues are valid from their issue time on)."""
    global NOW
    NOW = int(time.time())


# ---------------------------------------------------------------- identity


def test_identity_is_made_once_kept_private_and_reloaded(tmp_path: Path) -> None:
    state = tmp_path / "state"
    first = load_or_create(state)
    key = state / "identity.key"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert stat.S_IMODE(state.stat().st_mode) == 0o700
    again = load_or_create(state)
    assert again.public == first.public and again.node_id == first.node_id
    assert first.node_id == node_id_of(first.public)
    # the repr names the key, never the private halves
    private = key.read_text().split()[-1]
    assert private not in repr(first) and first.dh_private.hex() not in repr(first)


def test_a_damaged_key_file_is_an_error_not_a_new_identity(tmp_path: Path) -> None:
    load_or_create(tmp_path)
    (tmp_path / "identity.key").write_text("meshgate identity v1\nnot-base64!\n")
    with pytest.raises(IdentityError, match=r"identity\.key"):
        load_or_create(tmp_path)


def test_public_key_text_round_trip_and_errors() -> None:
    ident = Identity.generate()
    assert parse_public(public_text(ident.public)) == ident.public
    for bad in ("", "mgk1:", "mgk1:AAAA", "xyz:" + public_text(ident.public)[5:], "mgk1:!!!"):
        with pytest.raises(IdentityError):
            parse_public(bad)


# ---------------------------------------------------------------- certificates


@pytest.fixture
def ca(tmp_path: Path) -> TestCA:
    return TestCA(tmp_path)


def _cert(ca: TestCA, ident: Identity, **grants: object) -> certs.Certificate:
    return certs.load_certificate_text(ca.issue("b", ident, "10.9.0.2/24", **grants).read_text())  # type: ignore[arg-type]


def _cas(*cas: TestCA) -> dict[bytes, certs.Certificate]:
    return {hashlib.sha256(c.cert.raw).digest(): c.cert for c in cas}


def test_certificate_round_trip_carries_every_grant(ca: TestCA) -> None:
    ident = Identity.generate()
    cert = _cert(ca, ident, ip6="fd00::2/64", cidrs=("10.1.0.0/16", "192.168.1.0/24->10.200.1.0/24"),
                 exit=True, groups=("laptops", "ops"))
    again = certs.load_certificate_text(certs.armor(certs.CERT_LABEL, cert.raw))
    assert again == cert
    assert cert.public == ident.public and cert.name == "b" and cert.network == "testnet"
    assert cert.ipv4 == ipaddress.IPv4Interface("10.9.0.2/24")
    assert cert.ipv6 == ipaddress.IPv6Interface("fd00::2/64")
    assert cert.cidrs == ((ipaddress.ip_network("10.1.0.0/16"), False),
                          (ipaddress.ip_network("10.200.1.0/24"), True))
    assert cert.exit and cert.groups == ("laptops", "ops")
    assert certs.check_certificate(cert, _cas(ca), "testnet", NOW) == ca.cert
    assert "node certificate" in authority.describe(certs.armor(certs.CERT_LABEL, cert.raw))


def test_each_bad_certificate_is_refused_with_its_own_reason(tmp_path: Path, ca: TestCA) -> None:
    ident = Identity.generate()
    good = _cert(ca, ident)
    cas = _cas(ca)
    other = TestCA(tmp_path / "other")
    foreign_net = TestCA(tmp_path / "net2", network="othernet")
    cases = {
        "expired": (_cert(ca, ident, now=NOW - 10 * 86400, valid=86400), cas, "testnet"),
        "unknown_ca": (_cert(other, ident), cas, "testnet"),
        "wrong_network": (_cert(foreign_net, ident), {**cas, **_cas(foreign_net)}, "testnet"),
        "not_a_node": (ca.cert, cas, "testnet"),
    }
    for reason, (cert, trusted, network) in cases.items():
        with pytest.raises(CertError) as e:
            certs.check_certificate(cert, trusted, network, NOW)
        assert e.value.reason == reason, reason
    with pytest.raises(CertError) as e:
        certs.check_certificate(good, cas, "testnet", good.not_before - 3600)
    assert e.value.reason == "not_yet_valid"
    # a tampered field (the exit grant switched on): the signature no longer verifies
    raw = bytearray(good.raw)
    raw[5] |= 0x01
    with pytest.raises(CertError) as e:
        certs.check_certificate(certs.parse_certificate(bytes(raw)), cas, "testnet", NOW)
    assert e.value.reason == "bad_signature"
    # truncated anywhere: the parser's own error
    for n in range(len(good.raw)):
        with pytest.raises(CertError):
            certs.parse_certificate(good.raw[:n])


def test_revocation_list_round_trip_and_serials(ca: TestCA) -> None:
    ident = Identity.generate()
    path = ca.issue("b", ident, "10.9.0.2/24")
    cert = certs.load_certificate_text(path.read_text())
    first = ca.revoke(path)
    assert first.serial == 1 and hashlib.sha256(cert.raw).digest() in first.revoked
    second = authority.revoke(ca.dir, "ab" * 32)
    assert second.serial == 2 and first.revoked < second.revoked
    text = (ca.dir / "revoked").read_text()
    parsed = certs.parse_revocation_list(certs.dearmor(text, certs.REVOCATION_LABEL))
    assert parsed == second
    certs.check_revocation_list(parsed, _cas(ca), "testnet")
    with pytest.raises(CertError) as e:
        certs.check_certificate(cert, _cas(ca), "testnet", NOW, parsed.revoked)
    assert e.value.reason == "revoked"
    trust = Trust("testnet", (ca.cert,), cert)
    assert trust.adopt(second) is None and trust.adopt(first) == "stale"
    tampered = bytearray(second.raw)
    tampered[19] ^= 1  # the serial
    assert trust.adopt(certs.parse_revocation_list(bytes(tampered))) == "bad_signature"


# ---------------------------------------------------------------- signed HELLO


def _hello(ident: Identity, hs_hash: bytes, initiator: bool, cert: bytes = b"", name: str = "b") -> Hello:
    signature = ident.sign(hello_signed_data(hs_hash, initiator))
    return Hello(ident.node_id, 7, name, ident.public, cert, signature)


def test_hello_checks(ca: TestCA) -> None:
    ident, other = Identity.generate(), Identity.generate()
    h = os.urandom(32)
    secret = Trust("testnet")
    hello = decode_hello(encode_hello(_hello(ident, h, True)))
    ok = secret.check_hello(hello, ident.dh_public, h, True, NOW)
    assert not isinstance(ok, str) and ok.node_id == ident.node_id
    assert secret.check_hello(hello, other.dh_public, h, True, NOW) == "bad_key"  # not this link's static
    renamed = dataclasses.replace(hello, node_id=5)
    assert secret.check_hello(renamed, ident.dh_public, h, True, NOW) == "bad_node_id"
    assert secret.check_hello(hello, ident.dh_public, os.urandom(32), True, NOW) == "bad_signature"
    assert secret.check_hello(hello, ident.dh_public, h, False, NOW) == "bad_signature"  # reflected
    cert = _cert(ca, ident)
    mine = _cert(ca, other)
    strict = Trust("testnet", (ca.cert,), mine)
    assert strict.check_hello(hello, ident.dh_public, h, True, NOW) == "no_certificate"
    with_cert = _hello(ident, h, True, cert.raw)
    checked = strict.check_hello(with_cert, ident.dh_public, h, True, NOW)
    assert not isinstance(checked, str) and checked.cert == cert
    # someone else's valid certificate does not make a key valid
    stolen = _hello(other, h, True, cert.raw)
    assert strict.check_hello(stolen, other.dh_public, h, True, NOW) == "wrong_key"


def test_while_moving_to_certificates_a_node_takes_secret_peers_but_checks_any_certificate(
    ca: TestCA, tmp_path: Path
) -> None:
    ident, me = Identity.generate(), Identity.generate()
    h = os.urandom(32)
    moving = Trust("testnet", (ca.cert,), _cert(ca, me), require=False)
    assert not isinstance(moving.check_hello(_hello(ident, h, True), ident.dh_public, h, True, NOW), str)
    foreign = _cert(TestCA(tmp_path / "other"), ident)
    shown = _hello(ident, h, True, foreign.raw)
    assert moving.check_hello(shown, ident.dh_public, h, True, NOW) == "unknown_ca"
    assert moving.check_record(_signed(ident), None, NOW) is None
    claims_exit = _signed(ident, _cert(ca, ident).raw, exit=True)
    assert moving.check_record(claims_exit, None, NOW) == "not_granted"


def test_hello_parser_rejects_truncation() -> None:
    body = encode_hello(_hello(Identity.generate(), os.urandom(32), True, b"x" * 40))
    for n in range(len(body)):
        with pytest.raises(LinkError):
            decode_hello(body[:n])


# ---------------------------------------------------------------- signed records


def _signed(ident: Identity, cert: bytes = b"", **fields: object) -> Record:
    base = dict(origin=ident.node_id, session=1, version=NOW * 1000, name="b",
                ipv4=ipaddress.IPv4Interface("10.9.0.2/24"), key=ident.public, cert=cert)
    base.update(fields)
    rec = Record(**base)  # type: ignore[arg-type]
    return dataclasses.replace(rec, signature=ident.sign(rec.signed_part))


def test_record_signatures_in_secret_mode() -> None:
    ident, mallory = Identity.generate(), Identity.generate()
    trust = Trust("testnet")
    rec = decode_one(_signed(ident).encode())
    assert trust.check_record(rec, None, NOW) is None
    assert trust.check_record(dataclasses.replace(rec, signature=b""), None, NOW) == "unsigned"
    # mallory re-signs a record naming the victim's origin: its key does not own that id
    forged = _signed(mallory, origin=ident.node_id)
    assert trust.check_record(forged, None, NOW) == "bad_origin"
    # a changed claim under the origin's old signature
    assert trust.check_record(dataclasses.replace(rec, exit=True), None, NOW) == "bad_signature"
    ahead = _signed(ident, version=(NOW * 1000) + MAX_VERSION_AHEAD_MS + 60_000)
    assert trust.check_record(ahead, None, NOW) == "future_version"
    assert trust.check_record(_signed(ident, version=(1 << 64) - 1), None, NOW) == "future_version"


def test_records_hold_to_the_certificate(ca: TestCA) -> None:
    ident, me = Identity.generate(), Identity.generate()
    cert = _cert(ca, ident, cidrs=("10.1.0.0/16",))
    trust = Trust("testnet", (ca.cert,), _cert(ca, me))
    raw = cert.raw
    assert trust.check_record(_signed(ident, raw), None, NOW) is None
    assert trust.check_record(_signed(ident, raw, cidrs=((ipaddress.ip_network("10.1.2.0/24"), False),)),
                              None, NOW) is None
    claims = {
        "someone's IP": {"ipv4": ipaddress.IPv4Interface("10.9.0.1/24")},
        "a CIDR not granted": {"cidrs": ((ipaddress.ip_network("10.2.0.0/16"), False),)},
        "exit without the grant": {"exit": True},
        "another name": {"name": "a"},
    }
    for what, change in claims.items():
        assert trust.check_record(_signed(ident, raw, **change), None, NOW) == "not_granted", what
    assert trust.check_record(_signed(ident), None, NOW) == "no_certificate"
    assert trust.check_record(_signed(me, raw), None, NOW) == "wrong_key"


def test_route_table_drops_refused_records_whole_and_counts_them() -> None:
    ident, me = Identity.generate(), Identity.generate()
    trust = Trust("testnet")
    local = Record(origin=me.node_id, session=1, version=1, key=me.public)
    table = RouteTable(local, sign=me.sign, accept=lambda r, held: trust.check_record(r, held, NOW))
    assert trust.check_record(table.local, None, NOW) is None  # the own record is signed
    good, bad = _signed(ident), dataclasses.replace(_signed(ident, version=NOW * 1000 + 1), exit=True)
    table.receive_records(5, [good], NOW)
    assert ident.node_id not in table.records  # held until checked
    assert table.settle() == 1
    table.receive_records(5, [bad], NOW)
    assert table.settle() == 0
    assert table.records[ident.node_id] == good and table.refused == 1
    # a forged newer version beside a genuine one: the genuine one is stored
    newer = _signed(ident, version=NOW * 1000 + 2)
    forged = dataclasses.replace(_signed(ident, version=NOW * 1000 + 3), exit=True)
    table.receive_records(5, [newer], NOW)
    table.receive_records(6, [forged], NOW)
    assert table.settle() == 1 and table.records[ident.node_id] == newer and table.refused == 2
    table.forget([ident.node_id])
    assert ident.node_id not in table.records


# ---------------------------------------------------------------- the parsers never raise anything else


def _samples() -> dict[str, bytes]:
    ident = Identity.generate()
    return {
        "hello": encode_hello(_hello(ident, os.urandom(32), True, b"c" * 50)),
        "record": _signed(ident, b"c" * 50, cidrs=((ipaddress.ip_network("10.1.0.0/16"), True),)).encode(),
    }


_SAMPLES = _samples()
_FUZZ = 12_500  # four parsers: 50,000 inputs in all


def _mutate(data: bytes, cut: int, flips: list[tuple[int, int]]) -> bytes:
    out = bytearray(data[: len(data) - cut % (len(data) + 1)])
    for pos, value in flips:
        if out:
            out[pos % len(out)] = value
    return bytes(out)


_mutations = st.tuples(st.integers(0, 5000), st.lists(st.tuples(st.integers(0, 5000), st.integers(0, 255)),
                                                       max_size=4))


@pytest.fixture(scope="module")
def sample_cert(tmp_path_factory: pytest.TempPathFactory) -> tuple[bytes, bytes]:
    ca = TestCA(tmp_path_factory.mktemp("fuzz"))
    path = ca.issue("b", Identity.generate(), "10.9.0.2/24", ip6="fd00::2/64", cidrs=("10.1.0.0/16",),
                    groups=("g",))
    return certs.load_certificate_text(path.read_text()).raw, ca.revoke(path).raw


@settings(max_examples=_FUZZ, deadline=None, database=None)
@given(_mutations)
def test_fuzz_hello(m: tuple[int, list[tuple[int, int]]]) -> None:
    with contextlib.suppress(LinkError):
        decode_hello(_mutate(_SAMPLES["hello"], *m))


@settings(max_examples=_FUZZ, deadline=None, database=None)
@given(_mutations)
def test_fuzz_record(m: tuple[int, list[tuple[int, int]]]) -> None:
    with contextlib.suppress(RecordError):
        decode_one(_mutate(_SAMPLES["record"], *m))


def test_fuzz_certificates_and_lists(sample_cert: tuple[bytes, bytes]) -> None:
    cert_raw, rl_raw = sample_cert

    @settings(max_examples=_FUZZ, deadline=None, database=None)
    @given(_mutations)
    def cert(m: tuple[int, list[tuple[int, int]]]) -> None:
        with contextlib.suppress(CertError):
            certs.parse_certificate(_mutate(cert_raw, *m))

    @settings(max_examples=_FUZZ, deadline=None, database=None)
    @given(_mutations)
    def rlist(m: tuple[int, list[tuple[int, int]]]) -> None:
        with contextlib.suppress(CertError):
            certs.parse_revocation_list(_mutate(rl_raw, *m))

    cert()
    rlist()


# ---------------------------------------------------------------- DNS suffixes (dns.serve_suffixes)


def test_dns_suffix_grants_round_trip_and_cover_names_under_them_on_label_boundaries(ca: TestCA) -> None:
    ident = Identity.generate()
    cert = _cert(ca, ident, dns=("LAN.example", "corp.example."))
    again = certs.load_certificate_text(certs.armor(certs.CERT_LABEL, cert.raw))
    assert again.dns == ("lan.example.", "corp.example.") == cert.dns
    assert again.grants_dns("lan.example.") and again.grants_dns("printers.lan.example.")
    assert not again.grants_dns("xlan.example.") and not again.grants_dns("example.")
    assert not _cert(ca, ident).grants_dns("lan.example.")  # no grant: none
    assert "lan.example., corp.example." in authority.describe(certs.armor(certs.CERT_LABEL, cert.raw))
    with pytest.raises(authority.AuthorityError, match="--dns"):
        _cert(ca, ident, dns=(".",))


def test_records_carry_dns_suffixes_and_malformed_ones_are_refused() -> None:
    ident = Identity.generate()
    rec = _signed(ident, dns=("lan.example.", "corp.example."))
    back = decode_one(rec.encode())
    assert back.dns == ("lan.example.", "corp.example.") and back.signature == rec.signature
    assert decode_one(_signed(ident).encode()).dns == ()
    assert not back.same_content(dataclasses.replace(back, dns=("lan.example.",)))
    for bad in ("LAN.example.", "lan.example", "a..b.", "with space.", "x" * 64 + "."):
        forged = dataclasses.replace(rec, dns=(bad,))
        with pytest.raises(RecordError):
            decode_one(dataclasses.replace(forged, signature=ident.sign(forged.signed_part)).encode())
    many = dataclasses.replace(rec, dns=tuple(f"s{i}.example." for i in range(17)))
    with pytest.raises(RecordError):
        decode_one(many.encode())


def test_a_member_with_a_valid_certificate_cannot_claim_a_dns_suffix_it_was_not_granted(ca: TestCA) -> None:
    """Certificate mode: the record's suffixes must be in its origin's certificate, or the whole
    record is dropped (not_granted), so no member can pull another's names to itself."""
    ident, me = Identity.generate(), Identity.generate()
    raw = _cert(ca, ident, dns=("lan.example.",)).raw
    trust = Trust("testnet", (ca.cert,), _cert(ca, me))
    assert trust.check_record(_signed(ident, raw, dns=("lan.example.",)), None, NOW) is None
    assert trust.check_record(_signed(ident, raw, dns=("a.lan.example.",)), None, NOW) is None
    for claim in (("example.",), ("corp.example.",), ("lan.example.", "com.")):
        assert trust.check_record(_signed(ident, raw, dns=claim), None, NOW) == "not_granted", claim
    plain = _cert(ca, ident).raw  # a valid certificate without any DNS grant
    assert trust.check_record(_signed(ident, plain, dns=("lan.example.",)), None, NOW) == "not_granted"
