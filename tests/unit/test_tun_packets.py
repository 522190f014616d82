"""tun_packets: header parsing, TTL handling, ICMP errors and fragmentation, without a network.

Checksums are verified two ways: the RFC 1071 property (summing a message that
contains its own checksum gives 0) computed by an independent byte loop here,
and known-answer headers from RFC 1071's worked example.
"""

from __future__ import annotations

import ipaddress
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshgate.mesh import tun_packets as tp

A4 = ipaddress.IPv4Address("10.144.144.1").packed
B4 = ipaddress.IPv4Address("10.144.144.3").packed
A6 = ipaddress.IPv6Address("fd00:144::1").packed
B6 = ipaddress.IPv6Address("fd00:144::3").packed


def ref_sum(data: bytes) -> int:
    """Independent ones' complement sum (byte loop) for verifying the module's checksum."""
    if len(data) % 2:
        data += b"\x00"
    total = 0
    for i in range(0, len(data), 2):
        total += data[i] << 8 | data[i + 1]
        total = (total & 0xFFFF) + (total >> 16)
    return total


def ipv4(src: bytes, dst: bytes, proto: int, payload: bytes, ttl: int = 64, df: bool = True,
         ident: int = 0x1234, options: bytes = b"") -> bytes:
    ihl = 5 + len(options) // 4
    hdr = bytearray(struct.pack("!BBHHHBBH4s4s", 0x40 | ihl, 0, ihl * 4 + len(payload), ident,
                                0x4000 if df else 0, ttl, proto, 0, src, dst)) + options
    struct.pack_into("!H", hdr, 10, ~ref_sum(bytes(hdr)) & 0xFFFF)
    return bytes(hdr) + payload


def ipv6(src: bytes, dst: bytes, nxt: int, payload: bytes, hop: int = 64) -> bytes:
    return struct.pack("!IHBB16s16s", 6 << 28, len(payload), nxt, hop, src, dst) + payload


def icmp_echo(seq: int = 1, data: bytes = b"x" * 56, v6: bool = False) -> bytes:
    return struct.pack("!BBHHH", 128 if v6 else 8, 0, 0, 7, seq) + data


def v4_header_ok(pkt: bytes) -> bool:
    hlen = (pkt[0] & 0x0F) * 4
    return ref_sum(pkt[:hlen]) == 0xFFFF


def icmp6_ok(pkt: bytes) -> bool:
    src, dst = pkt[8:24], pkt[24:40]
    body = pkt[40:]
    pseudo = src + dst + struct.pack("!IxxxB", len(body), 58)
    return ref_sum(pseudo + body) == 0xFFFF


# --------------------------------------------------------------------------- parse


def test_parse_ipv4_udp() -> None:
    pkt = ipv4(A4, B4, tp.PROTO_UDP, b"\x00" * 8 + b"hello", ttl=17)
    p = tp.parse(pkt)
    assert (p.version, p.src, p.dst, p.proto, p.length, p.header_len, p.ttl) == (
        4, A4, B4, tp.PROTO_UDP, len(pkt), 20, 17)
    assert p.dont_fragment and p.first_fragment


def test_parse_ipv4_with_options_and_trailing_bytes() -> None:
    pkt = ipv4(A4, B4, tp.PROTO_TCP, b"t" * 20, options=b"\x01\x01\x01\x00")
    p = tp.parse(pkt + b"\x00\x00")  # padding after the datagram (Ethernet-style) is tolerated
    assert p.header_len == 24 and p.length == len(pkt)


def test_parse_ipv6() -> None:
    pkt = ipv6(A6, B6, tp.PROTO_TCP, b"x" * 20, hop=3)
    p = tp.parse(pkt)
    assert (p.version, p.src, p.dst, p.proto, p.length, p.ttl) == (6, A6, B6, tp.PROTO_TCP, 60, 3)


@pytest.mark.parametrize(
    ("pkt", "reason"),
    [
        (b"", "empty"),
        (b"\x45" + b"\x00" * 10, "short_header"),
        (b"\x60" + b"\x00" * 30, "short_header"),
        (b"\x55" + b"\x00" * 30, "bad_version"),
        (b"\x44" + b"\x00" * 30, "bad_header_length"),
        (ipv4(A4, B4, 17, b"abc")[:-1], "bad_total_length"),
        (bytes([0x46]) + ipv4(A4, B4, 17, b"")[1:], "bad_total_length"),  # IHL beyond total length
        (ipv6(A6, B6, 17, b"abcd")[:-1], "bad_total_length"),
        (ipv6(A6, B6, 0, b""), "jumbogram"),
    ],
)
def test_parse_rejects_malformed(pkt: bytes, reason: str) -> None:
    with pytest.raises(tp.PacketError) as e:
        tp.parse(pkt)
    assert e.value.reason == reason


@given(st.binary(max_size=120))
@settings(max_examples=500)
def test_parse_never_raises_anything_else(data: bytes) -> None:
    try:
        p = tp.parse(data)
    except tp.PacketError:
        return
    assert p.length <= len(data)
    assert p.header_len <= p.length


# --------------------------------------------------------------------------- checksums / TTL


def test_checksum_rfc1071_example() -> None:
    # RFC 1071 section 3: the sum of 0001 f203 f4f5 f6f7 is ddf2 (checksum 220d).
    assert tp.checksum(bytes.fromhex("0001f203f4f5f6f7")) == 0x220D


@given(st.binary(max_size=200))
def test_checksum_matches_reference(data: bytes) -> None:
    assert tp.checksum(data) == ~ref_sum(data) & 0xFFFF


@given(st.integers(2, 255), st.integers(0, 255), st.binary(min_size=4, max_size=4),
       st.binary(min_size=4, max_size=4), st.integers(0, 0xFFFF))
def test_decrement_ttl_v4_keeps_checksum_valid(ttl: int, proto: int, src: bytes, dst: bytes,
                                               ident: int) -> None:
    pkt = bytearray(ipv4(src, dst, proto, b"payload", ttl=ttl, ident=ident))
    assert tp.decrement_ttl(pkt) == ttl - 1
    assert pkt[8] == ttl - 1
    assert v4_header_ok(bytes(pkt))


def test_decrement_ttl_v4_every_checksum_carry() -> None:
    # the ident field steers the header checksum through its whole range, carries included
    for ident in range(0, 0x10000, 3):
        pkt = bytearray(ipv4(A4, B4, 6, b"", ttl=2, ident=ident))
        tp.decrement_ttl(pkt)
        assert ref_sum(bytes(pkt)) == 0xFFFF, ident


def test_decrement_hop_limit_v6() -> None:
    pkt = bytearray(ipv6(A6, B6, 17, b"x" * 8, hop=9))
    assert tp.decrement_ttl(pkt) == 8
    assert tp.parse(pkt).ttl == 8


# --------------------------------------------------------------------------- ICMP errors


def test_frag_needed_v4() -> None:
    orig = ipv4(A4, B4, tp.PROTO_TCP, b"T" * 1400)
    p = tp.parse(orig)
    err = tp.icmp_error(orig, p, tp.TOO_BIG, B4, mtu=1380)
    assert err is not None
    e = tp.parse(err)
    assert (e.version, e.src, e.dst, e.proto) == (4, B4, A4, tp.PROTO_ICMP)
    assert v4_header_ok(err)
    body = err[20:]
    assert ref_sum(body) == 0xFFFF  # ICMP checksum over the whole message
    icmp_type, code, _csum, unused, mtu = struct.unpack_from("!BBHHH", body)
    assert (icmp_type, code, unused, mtu) == (3, 4, 0, 1380)
    assert body[8:] == orig[: len(body) - 8]  # quotes the original header and data
    assert len(err) <= tp.ICMPV4_ERROR_MAX


def test_packet_too_big_v6() -> None:
    orig = ipv6(A6, B6, tp.PROTO_UDP, b"U" * 1400)
    p = tp.parse(orig)
    err = tp.icmp_error(orig, p, tp.TOO_BIG, B6, mtu=1380)
    assert err is not None
    e = tp.parse(err)
    assert (e.version, e.src, e.dst, e.proto) == (6, B6, A6, tp.PROTO_ICMPV6)
    assert icmp6_ok(err)
    icmp_type, code, _csum, mtu = struct.unpack_from("!BBHI", err, 40)
    assert (icmp_type, code, mtu) == (2, 0, 1380)
    assert len(err) == tp.IPV6_MIN_MTU  # as much of the original as fits in the minimum MTU
    assert err[48:] == orig[: tp.IPV6_MIN_MTU - 48]


@pytest.mark.parametrize("v6", [False, True])
def test_time_exceeded_and_no_route(v6: bool) -> None:
    orig = ipv6(A6, B6, 58, icmp_echo(v6=True)) if v6 else ipv4(A4, B4, 1, icmp_echo(), ttl=1)
    p = tp.parse(orig)
    me = B6 if v6 else B4
    for kind, expect in ((tp.TIME_EXCEEDED, (3, 0) if v6 else (11, 0)),
                         (tp.NO_ROUTE, (1, 0) if v6 else (3, 0)),
                         (tp.ADMIN_PROHIBITED, (1, 1) if v6 else (3, 13))):
        err = tp.icmp_error(orig, p, kind, me)
        assert err is not None
        hlen = 40 if v6 else 20
        assert (err[hlen], err[hlen + 1]) == expect
        assert icmp6_ok(err) if v6 else (v4_header_ok(err) and ref_sum(err[20:]) == 0xFFFF)
        assert err[hlen + 8:] == orig  # short original: quoted whole


def test_no_error_about_errors_fragments_or_multicast() -> None:
    # an ICMP error (dest unreachable) is never answered with another error
    unreach = ipv4(A4, B4, 1, struct.pack("!BBHI", 3, 1, 0, 0) + b"q" * 28)
    assert tp.icmp_error(unreach, tp.parse(unreach), tp.TIME_EXCEEDED, B4) is None
    # but an echo request is
    echo = ipv4(A4, B4, 1, icmp_echo())
    assert tp.icmp_error(echo, tp.parse(echo), tp.TIME_EXCEEDED, B4) is not None
    # ICMPv6 error (type < 128) vs informational
    ptb = ipv6(A6, B6, 58, struct.pack("!BBHI", 2, 0, 0, 1280) + b"q" * 40)
    assert tp.icmp_error(ptb, tp.parse(ptb), tp.NO_ROUTE, B6) is None
    # non-first fragment
    frag = bytearray(ipv4(A4, B4, 17, b"z" * 16, df=False))
    struct.pack_into("!H", frag, 6, 10)
    assert tp.icmp_error(frag, tp.parse(frag), tp.NO_ROUTE, B4) is None
    # multicast / broadcast destinations and unspecified sources
    mc = ipv4(A4, bytes([239, 1, 1, 1]), 17, b"z" * 8)
    assert tp.icmp_error(mc, tp.parse(mc), tp.NO_ROUTE, B4) is None
    unspec = ipv4(bytes(4), B4, 17, b"z" * 8)
    assert tp.icmp_error(unspec, tp.parse(unspec), tp.NO_ROUTE, B4) is None
    mc6 = ipv6(A6, bytes([0xFF, 2]) + bytes(13) + b"\x01", 17, b"z" * 8)
    assert tp.icmp_error(mc6, tp.parse(mc6), tp.TOO_BIG, B6, 1280) is None


def test_wrong_family_source_gives_nothing() -> None:
    pkt = ipv6(A6, B6, 17, b"z" * 8)
    assert tp.icmp_error(pkt, tp.parse(pkt), tp.NO_ROUTE, B4) is None


# --------------------------------------------------------------------------- fragmentation


@given(st.integers(1, 3000), st.integers(tp.IPV4_MIN_MTU, 1500), st.integers(0, 0xFFFF))
@settings(max_examples=200)
def test_fragment_v4_reassembles(size: int, mtu: int, ident: int) -> None:
    payload = bytes(i & 0xFF for i in range(size))
    pkt = ipv4(A4, B4, 17, payload, df=False, ident=ident)
    frags = tp.fragment_v4(pkt, tp.parse(pkt), mtu)
    got = bytearray()
    for i, f in enumerate(frags):
        assert len(f) <= mtu
        assert v4_header_ok(f)
        fp = tp.parse(f)
        flags_off = struct.unpack_from("!H", f, 6)[0]
        assert struct.unpack_from("!H", f, 4)[0] == ident
        assert (flags_off & 0x1FFF) * 8 == len(got)
        assert bool(flags_off & 0x2000) == (i < len(frags) - 1)
        got += f[fp.header_len : fp.length]
    assert bytes(got) == payload


def test_fragment_refuses_df_and_tiny_mtu() -> None:
    pkt = ipv4(A4, B4, 17, b"x" * 100, df=True)
    with pytest.raises(tp.PacketError):
        tp.fragment_v4(pkt, tp.parse(pkt), 60)
    pkt = ipv4(A4, B4, 17, b"x" * 100, df=False)
    with pytest.raises(tp.PacketError):
        tp.fragment_v4(pkt, tp.parse(pkt), 27)
