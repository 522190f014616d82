"""The SOCKS5 sans-I/O core (RFC 1928/1929) and the UDP NAT table."""

from __future__ import annotations

import ipaddress
import socket
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshgate.gateway import socks5
from meshgate.gateway.nat import NatTable
from meshgate.gateway.socks5 import (
    ATYP_DOMAIN,
    ATYP_IPV4,
    ATYP_IPV6,
    Authenticated,
    MethodSelected,
    Request,
    ServerConnection,
    Socks5Error,
)

USERS = {b"alice": b"s3cret"}


def drive(conn: ServerConnection, data: bytes) -> list[object]:
    conn.receive_data(data)
    events: list[object] = []
    while (ev := conn.next_event()) is not None:
        events.append(ev)
        if isinstance(ev, Request):
            break
    return events


def connect_request(atyp: int, addr: bytes, port: int, cmd: int = socks5.CMD_CONNECT) -> bytes:
    if atyp == ATYP_DOMAIN:
        return bytes((5, cmd, 0, atyp, len(addr))) + addr + struct.pack("!H", port)
    return bytes((5, cmd, 0, atyp)) + addr + struct.pack("!H", port)


# --------------------------------------------------------------------------- negotiation


def test_no_auth_connect_ipv4_in_one_segment_keeps_trailing_data() -> None:
    conn = ServerConnection()
    data = b"\x05\x01\x00" + connect_request(ATYP_IPV4, bytes([10, 0, 0, 1]), 80) + b"GET /"
    events = drive(conn, data)
    assert events == [MethodSelected(0), Request(1, ATYP_IPV4, bytes([10, 0, 0, 1]), 80)]
    assert conn.data_to_send() == b"\x05\x00"
    assert conn.trailing_data() == b"GET /"
    assert events[1].host == "10.0.0.1"  # type: ignore[attr-defined]


def test_byte_at_a_time_ipv6_and_domain() -> None:
    for atyp, addr, host in (
        (ATYP_IPV6, ipaddress.IPv6Address("::1").packed, "::1"),
        (ATYP_DOMAIN, b"example.com", "example.com"),
    ):
        conn = ServerConnection()
        data = b"\x05\x02\x02\x00" + connect_request(atyp, addr, 443)
        events: list[object] = []
        for i in range(len(data)):
            events += drive(conn, data[i : i + 1])
        assert events[0] == MethodSelected(0)
        req = events[1]
        assert isinstance(req, Request) and req.host == host and req.port == 443


def test_users_configured_picks_userpass_even_if_no_auth_offered() -> None:
    conn = ServerConnection(USERS)
    assert drive(conn, b"\x05\x02\x00\x02") == [MethodSelected(2)]
    assert conn.data_to_send() == b"\x05\x02"
    events = drive(conn, b"\x01\x05alice\x06s3cret" + connect_request(ATYP_IPV4, b"\x7f\0\0\1", 1))
    assert events[0] == Authenticated("alice")
    assert conn.data_to_send() == b"\x01\x00"
    assert isinstance(events[1], Request)


def test_users_configured_client_offers_only_no_auth_gets_ff() -> None:
    conn = ServerConnection(USERS)
    with pytest.raises(Socks5Error) as ei:
        drive(conn, b"\x05\x01\x00")
    assert ei.value.reply is None and ei.value.kind == "method"
    assert conn.data_to_send() == b"\x05\xff"


def test_no_users_client_offers_only_userpass_gets_ff() -> None:
    conn = ServerConnection()
    with pytest.raises(Socks5Error):
        drive(conn, b"\x05\x01\x02")
    assert conn.data_to_send() == b"\x05\xff"


@pytest.mark.parametrize(
    "creds", [b"\x01\x05alice\x05wrong", b"\x01\x03bob\x06s3cret", b"\x01\x05alice\x00", b"\x02\x05alice"]
)
def test_bad_credentials_status_01_and_no_secret_in_message(creds: bytes) -> None:
    conn = ServerConnection(USERS)
    drive(conn, b"\x05\x01\x02")
    conn.data_to_send()
    with pytest.raises(Socks5Error) as ei:
        drive(conn, creds)
    assert ei.value.kind == "auth" and ei.value.reply is None
    assert conn.data_to_send() == b"\x01\x01"
    assert b"s3cret" not in str(ei.value).encode()
    assert b"wrong" not in str(ei.value).encode()


def test_wrong_version_closes_without_reply() -> None:
    conn = ServerConnection()
    with pytest.raises(Socks5Error) as ei:
        drive(conn, b"\x04\x01\x00\x50")
    assert ei.value.reply is None
    assert conn.data_to_send() == b""


@pytest.mark.parametrize(
    ("request_bytes", "reply"),
    [
        (b"\x05\x01\x00\x05\x00\x00", socks5.REP_ATYP_NOT_SUPPORTED),
        (connect_request(ATYP_IPV4, b"\1\2\3\4", 80, cmd=9), socks5.REP_COMMAND_NOT_SUPPORTED),
        (connect_request(ATYP_DOMAIN, b"", 80), socks5.REP_HOST_UNREACHABLE),
        (connect_request(ATYP_DOMAIN, "bücher.de".encode(), 80), socks5.REP_HOST_UNREACHABLE),
        (b"\x04\x01\x00\x01\1\2\3\4\0\x50", socks5.REP_GENERAL_FAILURE),
    ],
)
def test_bad_requests_queue_the_right_reply(request_bytes: bytes, reply: int) -> None:
    conn = ServerConnection()
    drive(conn, b"\x05\x01\x00")
    conn.data_to_send()
    with pytest.raises(Socks5Error) as ei:
        drive(conn, request_bytes)
    assert ei.value.reply == reply
    out = conn.data_to_send()
    assert out[:2] == bytes((5, reply)) and len(out) == 10


def test_bind_and_udp_are_parsed_for_the_adapter_to_answer() -> None:
    for cmd in (socks5.CMD_BIND, socks5.CMD_UDP_ASSOCIATE):
        conn = ServerConnection()
        events = drive(conn, b"\x05\x01\x00" + connect_request(ATYP_IPV4, b"\0\0\0\0", 0, cmd=cmd))
        assert isinstance(events[1], Request) and events[1].command == cmd


def test_build_reply_encodes_bound_address() -> None:
    assert socks5.build_reply(0, "127.0.0.1", 1080) == b"\x05\x00\x00\x01\x7f\x00\x00\x01\x04\x38"
    v6 = socks5.build_reply(0, "::1", 2)
    assert v6[:4] == b"\x05\x00\x00\x04" and v6[4:20] == socket.inet_pton(socket.AF_INET6, "::1")
    assert socks5.build_reply(5) == b"\x05\x05\x00\x01\x00\x00\x00\x00\x00\x00"


def test_udp_header_round_trip() -> None:
    for atyp, addr in ((ATYP_IPV4, b"\1\2\3\4"), (ATYP_IPV6, bytes(range(16))), (ATYP_DOMAIN, b"a.example")):
        hdr = socks5.build_udp_header(atyp, addr, 5353)
        parsed = socks5.parse_udp_header(memoryview(hdr + b"payload"))
        assert (parsed.frag, parsed.atyp, parsed.addr, parsed.port) == (0, atyp, addr, 5353)
        assert (hdr + b"payload")[parsed.offset :] == b"payload"


@pytest.mark.parametrize(
    "data",
    [b"", b"\0\0\0", b"\0\0\0\x01\1\2", b"\0\0\0\x03\0\0\0", b"\0\0\0\x07abcd", b"\0\0\0\x04" + bytes(17)],
)
def test_udp_header_junk_raises_protocol_error(data: bytes) -> None:
    with pytest.raises(Socks5Error) as ei:
        socks5.parse_udp_header(data)
    assert ei.value.reply is None


# --------------------------------------------------------------------------- fuzzing


def _run_parser(users: dict[bytes, bytes] | None, chunks: list[bytes]) -> None:
    conn = ServerConnection(users)
    try:
        for chunk in chunks:
            conn.receive_data(chunk)
            while (ev := conn.next_event()) is not None:
                conn.data_to_send()
                if isinstance(ev, Request):
                    assert ev.command in (1, 2, 3)
                    _ = ev.host  # text form must not raise either
                    return
    except Socks5Error as e:
        out = conn.data_to_send()
        # A reply code means a full 10-byte reply was queued with that code.
        if e.reply is not None:
            assert out[:2] == bytes((5, e.reply))


# Mostly-valid prefixes make the fuzzer reach the deep states, not just byte 0.
_prefixes = st.sampled_from(
    [
        b"",
        b"\x05",
        b"\x05\x01\x00",
        b"\x05\x02\x00\x02",
        b"\x05\x01\x02\x01\x05alice\x06s3cret",
        b"\x05\x01\x00\x05",
    ]
)


@settings(max_examples=50_000, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(
    prefix=_prefixes,
    body=st.binary(max_size=64),
    split=st.integers(min_value=0, max_value=80),
    with_users=st.booleans(),
)
def test_fuzz_parser_raises_only_its_own_error(
    prefix: bytes, body: bytes, split: int, with_users: bool
) -> None:
    data = prefix + body
    _run_parser(USERS if with_users else None, [data[:split], data[split:]])


@settings(max_examples=5_000, deadline=None, database=None)
@given(st.binary(max_size=300))
def test_fuzz_udp_header(data: bytes) -> None:
    try:
        h = socks5.parse_udp_header(data)
    except Socks5Error:
        return
    assert h.offset <= len(data)


# --------------------------------------------------------------------------- NAT table


def v4(ip: str, port: int) -> tuple[int, bytes, int]:
    return (ATYP_IPV4, ipaddress.IPv4Address(ip).packed, port)


def test_nat_address_targets_and_reply_mapping() -> None:
    nat = NatTable(max_targets=8, idle_timeout=10)
    e = nat.add_address(v4("192.0.2.1", 53), now=0)
    assert e.sockaddr == ("192.0.2.1", 53) and e.family == 4
    assert nat.lookup(v4("192.0.2.1", 53), now=1) is e
    r = nat.reply_entry(("192.0.2.1", 53), now=2)
    assert r is not None and r.header == socks5.build_udp_header(ATYP_IPV4, bytes([192, 0, 2, 1]), 53)
    assert nat.reply_entry(("192.0.2.1", 54), now=2) is None  # unsolicited port


def test_nat_ipv6_and_ipv4_mapped() -> None:
    nat = NatTable(8, 10)
    six = (ATYP_IPV6, ipaddress.IPv6Address("2001:db8::1").packed, 5)
    mapped = (ATYP_IPV6, ipaddress.IPv6Address("::ffff:198.51.100.7").packed, 5)
    assert nat.add_address(six, 0).sockaddr == ("2001:db8::1", 5)
    e = nat.add_address(mapped, 0)
    assert e.sockaddr == ("198.51.100.7", 5) and e.family == 4
    r = nat.reply_entry(("198.51.100.7", 5), 1)
    assert r is not None and r.key == mapped  # reported back as the mapped IPv6 the client used


def test_nat_domain_keeps_precedence_over_address() -> None:
    nat = NatTable(8, 10)
    name = (ATYP_DOMAIN, b"dns.example", 53)
    nat.add(name, ("192.0.2.1", 53), 4, now=0)
    nat.add_address(v4("192.0.2.1", 53), now=1)  # the client also talks to the address
    r = nat.reply_entry(("192.0.2.1", 53), 2)
    assert r is not None and r.key == name
    # Order reversed: the address first, then the name, still the name wins.
    nat2 = NatTable(8, 10)
    nat2.add_address(v4("192.0.2.1", 53), now=0)
    nat2.add(name, ("192.0.2.1", 53), 4, now=1)
    r2 = nat2.reply_entry(("192.0.2.1", 53), 2)
    assert r2 is not None and r2.key == name
    # When the name's entry expires the address entry takes the replies again.
    nat2.lookup(v4("192.0.2.1", 53), now=20)
    assert nat2.expire(now=15) == 1
    r3 = nat2.reply_entry(("192.0.2.1", 53), 16)
    assert r3 is not None and r3.key[0] == ATYP_IPV4


def test_nat_bounded_lru_and_idle_expiry() -> None:
    nat = NatTable(max_targets=3, idle_timeout=10)
    for i in range(3):
        nat.add_address(v4(f"192.0.2.{i}", 1), now=i)
    nat.lookup(v4("192.0.2.0", 1), now=5)  # refresh the oldest
    nat.add_address(v4("192.0.2.9", 1), now=6)
    assert len(nat) == 3 and nat.evicted == 1
    assert nat.lookup(v4("192.0.2.1", 1), now=6) is None  # the least recently used went
    assert nat.reply_entry(("192.0.2.1", 1), 6) is None
    assert nat.expire(now=14) == 1  # 192.0.2.2 last used at 2
    assert nat.expire(now=100) == 2
    assert len(nat) == 0 and nat.reply_entry(("192.0.2.9", 1), 100) is None
