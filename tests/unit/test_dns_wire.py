"""DNS wire core (sans-I/O): query parsing, answer packing, response validation, cache, DoH/DoQ framing."""

from __future__ import annotations

import asyncio
import base64
import os
import re
import socket
import struct
from pathlib import Path
from typing import Any

import dns.edns
import dns.flags
import dns.message
import dns.opcode
import dns.rcode
import dns.rrset
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshgate.buffers import Buffer, BufferPool
from meshgate.config import from_dict
from meshgate.dns import wire
from meshgate.dns.cache import AnswerCache
from meshgate.dns.doh import DohApp, decode_get_param
from meshgate.dns.doq import DoqProtocolError, DoqStreamState, check_doq_query
from meshgate.dns.plain import UDP_RCVBUF, start_udp
from meshgate.dns.resolver import Pipeline
from meshgate.dns.stats import ListenerStats
from tests.helpers import VECTORS as VECTOR_DIR

VECTORS = VECTOR_DIR / "doh_rfc8484_examples.txt"
RFC_GET = "AAABAAABAAAAAAAAA3d3dwdleGFtcGxlA2NvbQAAAQAB"
RFC_POST = bytes.fromhex("00000100000100000000000003777777076578616d706c6503636f6d0000010001")
RFC_LONG = ("AAABAAABAAAAAAAAAWE-NjJjaGFyYWN0ZXJsYWJlbC1tYWtlcy1iYXNlNjR1cmwtZGlzdGluY3QtZnJvbS1zdGFuZGFy"
            "ZC1iYXNlNjQHZXhhbXBsZQNjb20AAAEAAQ")
RFC_RESPONSE = bytes.fromhex(
    "00008180000100010000000003777777076578616d706c6503636f6d00001c0001c00c001c000100000e7d0010"
    "20010db8abcd00120001000200030004"
)


def buf(size: int = 4096) -> Buffer:
    return Buffer(size, 16)


def test_rfc8484_vectors_decode() -> None:
    if VECTORS.exists():  # the constants above are copied from the shared vectors file
        text = VECTORS.read_text()
        assert RFC_GET in text and RFC_LONG in text
    assert decode_get_param("dns=" + RFC_GET) == RFC_POST
    q = wire.parse_query(decode_get_param("dns=" + RFC_GET) or b"")
    assert (q.id, q.qtype, wire.decode_name(q.name)) == (0, 1, "www.example.com.")
    long_q = wire.parse_query(decode_get_param("ct=x&dns=" + RFC_LONG) or b"")
    assert wire.decode_name(long_q.name).startswith("a.62characterlabel-makes-base64url")
    # Standard base64 ('+', '/') and '=' padding are refused (blocky #176, smartdns #1672).
    std = base64.b64encode(decode_get_param("dns=" + RFC_LONG) or b"").decode()
    assert "+" in std and std.endswith("=")
    assert decode_get_param("dns=" + std) is None
    assert decode_get_param("dns=" + RFC_GET + "=") is None
    assert decode_get_param("dns=" + RFC_GET[:-3]) is None or len(RFC_GET[:-3]) % 4 != 1
    assert decode_get_param("dns=A") is None
    assert decode_get_param("name=x") is None


_B64URL_TEXT = re.compile(r"[A-Za-z0-9_-]*")


def _reference_get_param(qs: str) -> bytes | None:
    """The plain reading of RFC 8484's rule (what decode_get_param must agree with)."""
    value = next((v for k, sep, v in (p.partition("=") for p in qs.split("&")) if k == "dns" and sep), None)
    if not value or _B64URL_TEXT.fullmatch(value) is None or len(value) % 4 == 1:
        return None
    try:
        return base64.urlsafe_b64decode(value + "=" * (-len(value) % 4))
    except ValueError:
        return None


@settings(max_examples=2000, deadline=None)
@given(st.one_of(
    st.text(alphabet="AQw09-_+/=&dns \n\x00\xe9", max_size=24),
    st.text(alphabet="AQw09-_+/=\n\xe9", max_size=24).map(lambda v: "dns=" + v),
    st.binary(max_size=40).map(lambda b: "dns=" + base64.urlsafe_b64encode(b).decode().rstrip("=")),
))
def test_get_param_decoding_agrees_with_the_rfc_reading(qs: str) -> None:
    assert decode_get_param(qs) == _reference_get_param(qs)


def test_rfc8484_response_example_parses_with_max_age() -> None:
    key = (wire.encode_name("www.example.com"), 28, 1)
    ans = wire.parse_response(RFC_RESPONSE, 0, key, 0.0)
    assert ans.ttl == 3709 and ans.rcode == 0  # max-age = min answer TTL


def test_parse_query_edns_and_flags() -> None:
    m = dns.message.make_query("Example.COM", "AAAA", use_edns=0, payload=4096, want_dnssec=True, pad=468)
    q = wire.parse_query(m.to_wire())
    assert q.edns and q.do and q.padding and q.udp_size == 4096
    assert q.name == wire.encode_name("example.com")
    assert q.question[1:8] == b"Example"


@pytest.mark.parametrize(
    ("data", "rcode"),
    [
        (struct.pack(">HHHHHH", 7, 0x0100, 0, 0, 0, 0), wire.FORMERR),  # QDCOUNT=0 (routedns #524)
        (struct.pack(">HHHHHH", 7, 0x0100, 2, 0, 0, 0) + b"\x00\x00\x01\x00\x01" * 2, wire.FORMERR),
        (struct.pack(">HHHHHH", 7, 0x0100, 1, 0, 0, 0) + b"\x03www", wire.FORMERR),
        (struct.pack(">HHHHHH", 7, 0x0100, 1, 0, 0, 0) + b"\xc0\x0c\x00\x01\x00\x01", wire.FORMERR),
        (struct.pack(">HHHHHH", 7, 0x2100, 1, 0, 0, 0) + b"\x00\x00\x01\x00\x01", wire.NOTIMP),
        (struct.pack(">HHHHHH", 7, 0x0100, 1, 0, 0, 0) + b"\x00\x00\x01\x00\x01junk", wire.FORMERR),
    ],
)
def test_malformed_queries_get_error_rcodes(data: bytes, rcode: int) -> None:
    with pytest.raises(wire.FormError) as ei:
        wire.parse_query(data)
    b = buf()
    wire.error_for(b, ei.value)
    r = dns.message.from_wire(b.tobytes(), question_only=True)
    assert r.id == 7 and r.rcode() == rcode and r.flags & dns.flags.QR


def test_badvers_and_unanswerable() -> None:
    m = dns.message.make_query("a.test", "A", use_edns=1)
    with pytest.raises(wire.FormError) as ei:
        wire.parse_query(m.to_wire())
    b = buf()
    wire.error_for(b, ei.value)
    assert dns.message.from_wire(b.tobytes()).rcode() == dns.rcode.BADVERS
    with pytest.raises(wire.WireError):
        wire.parse_query(b"\x00\x01\x02")
    resp = dns.message.make_response(dns.message.make_query("a.test", "A"))
    with pytest.raises(wire.WireError):  # never answer a response
        wire.parse_query(resp.to_wire())


def make_answer() -> tuple[wire.Answer, tuple[bytes, int, int]]:
    q = dns.message.make_query("five.example", "A")
    r = dns.message.make_response(q)
    r.answer.append(dns.rrset.from_text("five.example.", 100, "IN", "A", *[f"192.0.2.{i}" for i in range(5)]))
    r.use_edns(0, payload=1232)
    key = (wire.encode_name("five.example"), 1, 1)
    return wire.parse_response(r.to_wire(), q.id, key, 1000.0), key


def test_pack_patches_id_case_and_ttls_in_place() -> None:
    ans, _key = make_answer()
    assert ans.ttl == 100 and len(ans.ttl_offsets) == 5
    m = dns.message.make_query("FIVE.example", "A")
    m.id = 0xBEEF
    q = wire.parse_query(m.to_wire())
    b = buf()
    max_age = wire.pack_answer(b, ans, q, 1040.5)
    r = dns.message.from_wire(b.tobytes())
    assert r.id == 0xBEEF and r.question[0].name.to_text() == "FIVE.example."
    assert r.answer[0].ttl == 60 and max_age == 60
    assert r.edns < 0  # the client sent no EDNS: no OPT back
    assert ans.wire[:2] == b"\x00\x00"  # the stored answer is never modified


def test_pack_ages_ttls_each_second_from_its_memo() -> None:
    ans, _key = make_answer()
    q = wire.parse_query(dns.message.make_query("five.example", "A").to_wire())
    ttls = []
    for now in (1040.5, 1040.9, 1041.2, 1040.1, 1200.0):  # same second twice, later, earlier, expired
        b = buf()
        max_age = wire.pack_answer(b, ans, q, now)
        r = dns.message.from_wire(b.tobytes())
        ttls.append((max_age, [rr.ttl for rr in r.answer]))
    assert ttls == [(60, [60]), (60, [60]), (59, [59]), (60, [60]), (0, [0])]
    assert ans.aged is not None and ans.aged[0] == 200 and ans.wire[:2] == b"\x00\x00"


def test_padding_blocks_and_udp_truncation() -> None:
    ans, _ = make_answer()
    m = dns.message.make_query("five.example", "A", use_edns=0, pad=468)
    q = wire.parse_query(m.to_wire())
    b = buf()
    wire.pack_answer(b, ans, q, 1000.0, pad=True)
    assert b.length % 468 == 0
    r = dns.message.from_wire(b.tobytes())
    assert r.edns == 0 and any(o.otype == dns.edns.OptionType.PADDING for o in r.options)
    b2 = buf()
    wire.pack_answer(b2, ans, q, 1000.0, limit=60)
    r2 = dns.message.from_wire(b2.tobytes())
    assert r2.flags & dns.flags.TC and not r2.answer and b2.length <= 60


def test_parse_response_rejects_other_questions() -> None:
    _ans, key = make_answer()
    q = dns.message.make_query("five.example", "A")
    r = dns.message.make_response(q)
    with pytest.raises(ValueError):
        wire.parse_response(r.to_wire(), q.id ^ 1, key, 0.0)  # wrong ID
    with pytest.raises(ValueError):
        wire.parse_response(r.to_wire(), q.id, (wire.encode_name("other.example"), 1, 1), 0.0)
    with pytest.raises(ValueError):
        wire.parse_response(q.to_wire(), q.id, key, 0.0)  # not a response


def test_negative_ttl_is_soa_minimum() -> None:
    q = dns.message.make_query("nx.example", "A")
    r = dns.message.make_response(q)
    r.set_rcode(dns.rcode.NXDOMAIN)
    r.authority.append(dns.rrset.from_text("example.", 3600, "IN", "SOA", "ns. host. 1 2 3 4 45"))
    ans = wire.parse_response(r.to_wire(), q.id, (wire.encode_name("nx.example"), 1, 1), 0.0)
    assert ans.rcode == wire.NXDOMAIN and ans.ttl == 45
    r.authority = []
    assert wire.parse_response(r.to_wire(), q.id, (wire.encode_name("nx.example"), 1, 1), 0.0).ttl == 0


def test_cache_lru_bound_and_expiry() -> None:
    cache = AnswerCache(3)
    ans, _ = make_answer()
    for i in range(5):
        cache.put((bytes([i]), 1, 1), ans)
    assert len(cache) == 3
    assert cache.get((b"\x00", 1, 1), 1000.0) is None  # evicted (least recently used)
    assert cache.get((b"\x04", 1, 1), 1099.0) is ans
    assert cache.get((b"\x04", 1, 1), 1100.0) is None  # TTL 100 from stored=1000
    zero = wire.Answer(b"", (), (), 0, 2)
    assert not cache.put((b"z", 1, 1), zero)  # SERVFAIL / TTL 0: never cached


def test_doq_framing_rules() -> None:
    msg = dns.message.make_query("a.test", "A")
    msg.id = 0
    data = msg.to_wire(prepend_length=True)
    assert DoqStreamState(0).feed(data, True) == data[2:]
    s = DoqStreamState(0)
    assert s.feed(data[:5], False) is None
    assert s.feed(data[5:], True) == data[2:]
    with pytest.raises(DoqProtocolError):
        DoqStreamState(0).feed(data[:-1], True)  # FIN before the declared length
    with pytest.raises(DoqProtocolError):
        DoqStreamState(0).feed(data + data, False)  # a second query on the stream
    with pytest.raises(DoqProtocolError):
        DoqStreamState(0).feed(b"\x00", True)
    msg.id = 5
    with pytest.raises(DoqProtocolError):
        check_doq_query(wire.parse_query(msg.to_wire()))
    ka = dns.message.make_query("a.test", "A", use_edns=0,
                                options=[dns.edns.GenericOption(dns.edns.OptionType.KEEPALIVE, b"")])
    ka.id = 0
    with pytest.raises(DoqProtocolError):
        check_doq_query(wire.parse_query(ka.to_wire()))


async def test_doh_app_status_codes_in_process() -> None:
    cfg = from_dict({"node": {"name": "alpha", "ipv4": "10.144.144.1/24"}})
    p = Pipeline(cfg, upstreams=[])
    app = DohApp(p, ListenerStats("unit-doh"), "/dns-query")
    ct = [("content-type", "application/dns-message")]
    q = dns.message.make_query("alpha.mesh.internal", "A")
    q.id = 0
    res: Any = app("POST", "/dns-query", ct, q.to_wire())
    status, headers, body = res
    assert status == 200 and ("cache-control", "max-age=10") in headers
    r = dns.message.from_wire(body.tobytes())
    assert r.answer[0][0].address == "10.144.144.1"
    body.recycle()
    get = "/dns-query?dns=" + base64.urlsafe_b64encode(q.to_wire()).decode().rstrip("=")
    assert app("GET", get, [], b"")[0] == 200  # type: ignore[index]
    assert app("GET", get + "=", [], b"")[0] == 400  # type: ignore[index]
    assert app("POST", "/dns-query", [("content-type", "text/plain")], q.to_wire())[0] == 415  # type: ignore[index]
    assert app("PUT", "/dns-query", ct, b"")[0] == 405  # type: ignore[index]
    assert app("POST", "/other", ct, q.to_wire())[0] == 404  # type: ignore[index]
    assert app("POST", "/dns-query", ct, b"\x00" * 70000)[0] == 413  # type: ignore[index]
    assert app("POST", "/dns-query", ct, b"\x00\x01")[0] == 400  # type: ignore[index]
    nx = dns.message.make_query("nobody.mesh.internal", "A")
    status, headers, body = app("POST", "/dns-query", ct, nx.to_wire())  # type: ignore[misc]
    assert status == 200 and ("cache-control", "max-age=10") in headers  # NXDOMAIN: still 200, SOA MINIMUM
    formerr = struct.pack(">HHHHHH", 0, 0x0100, 0, 0, 0, 0)
    status, _h, body = app("POST", "/dns-query", ct, formerr)  # type: ignore[misc]
    assert status == 200 and dns.message.from_wire(body.tobytes()).rcode() == dns.rcode.FORMERR
    await asyncio.sleep(0)


# --------------------------------------------------------------------------- fuzzing: no decoder may crash


@settings(max_examples=3000, deadline=None)
@given(st.binary(max_size=300))
def test_fuzz_parse_query(data: bytes) -> None:
    try:
        q = wire.parse_query(data)
    except wire.WireError:
        return
    except wire.FormError as e:
        b = buf()
        wire.error_for(b, e, pad=True)
        dns.message.from_wire(b.tobytes(), question_only=True)
        return
    ans = wire.build_answer(q.question, wire.NXDOMAIN, aa=True)
    b = buf()
    wire.pack_answer(b, ans, q, 0.0, pad=True, limit=512)
    assert b.length <= 4096


@settings(max_examples=3000, deadline=None)
@given(st.binary(max_size=300), st.booleans())
def test_fuzz_parse_response_and_address_walk(data: bytes, flip: bool) -> None:
    key = (wire.encode_name("five.example"), 1, 1)
    if flip and len(data) >= 12:
        data = make_answer()[0].wire[:12] + data[12:]
    try:
        ans = wire.parse_response(data, None, key, 0.0)
    except (ValueError, struct.error):
        return
    wire.answer_addresses(ans)


@settings(max_examples=2000, deadline=None)
@given(st.text(max_size=80))
def test_fuzz_get_param(qs: str) -> None:
    out = decode_get_param(qs)
    if out is not None:
        assert re.search(r"dns=[A-Za-z0-9_-]+", qs)


@settings(max_examples=2000, deadline=None)
@given(st.lists(st.tuples(st.binary(max_size=40), st.booleans()), max_size=5))
def test_fuzz_doq_stream(chunks: list[tuple[bytes, bool]]) -> None:
    s = DoqStreamState(0)
    for data, end in chunks:
        try:
            out = s.feed(data, end)
        except DoqProtocolError:
            return
        if end:
            assert out is not None
            return


def test_pool_buffers_are_reused_only_after_recycle() -> None:
    pool = BufferPool(4096, 16, 4)
    a = pool.get()
    a.drop()
    assert len(pool) == 0
    b = pool.get()
    b.recycle()
    assert pool.get() is b


class _FakeTransport:
    def __init__(self) -> None:
        self.out: list[bytes] = []
        self.closed = False

    def write(self, data: bytes | memoryview) -> None:
        self.out.append(bytes(data))

    def writelines(self, chunks: list[bytes]) -> None:
        self.out.extend(bytes(c) for c in chunks)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    abort = close

    def get_extra_info(self, key: str, default: Any = None) -> Any:
        return ("127.0.0.1", 1) if key == "peername" else default

    def get_write_buffer_size(self) -> int:
        return 0

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def _h2_preface_and_request() -> list[bytes]:
    import h2.config
    import h2.connection

    c = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
    c.initiate_connection()
    out = [c.data_to_send()]
    q = dns.message.make_query("alpha.mesh.internal", "A")
    q.id = 0
    c.send_headers(1, [(":method", "POST"), (":path", "/dns-query"), (":scheme", "https"),
                       (":authority", "x"), ("content-type", "application/dns-message")])
    c.send_data(1, q.to_wire(), end_stream=True)
    out.append(c.data_to_send())
    return out


@settings(max_examples=400, deadline=None)
@given(st.lists(st.binary(max_size=200), max_size=6), st.integers(0, 2))
def test_fuzz_h2_server_never_raises(chunks: list[bytes], prefix: int) -> None:
    """Random bytes after 0-2 valid chunks (preface, a POST): the DoH server answers, errors
    or closes, but data_received never raises."""
    from meshgate.dns.h2server import H2ServerProtocol

    async def run() -> None:
        cfg = from_dict({"node": {"name": "alpha", "ipv4": "10.144.144.1/24"}})
        p = Pipeline(cfg, upstreams=[])
        stats = ListenerStats("fuzz-doh")
        srv = H2ServerProtocol(DohApp(p, stats), stats, cfg.limits, set())
        t = _FakeTransport()
        srv.connection_made(t)  # type: ignore[arg-type]
        for data in [*_h2_preface_and_request()[:prefix], *chunks]:
            if t.closed:
                break
            srv.data_received(data)
        srv.connection_lost(None)

    asyncio.run(run())


@settings(max_examples=400, deadline=None)
@given(st.lists(st.binary(max_size=120), max_size=6))
def test_fuzz_tcp_stream_never_raises(chunks: list[bytes]) -> None:
    from meshgate.dns.plain import StreamDnsProtocol

    async def run() -> None:
        cfg = from_dict({"node": {"name": "alpha", "ipv4": "10.144.144.1/24"}})
        p = Pipeline(cfg, upstreams=[])
        proto = StreamDnsProtocol(p, ListenerStats("fuzz-tcp"), cfg.limits, set())
        t = _FakeTransport()
        proto.connection_made(t)  # type: ignore[arg-type]
        good = dns.message.make_query("alpha.mesh.internal", "A").to_wire(prepend_length=True)
        for data in [good, *chunks]:
            proto.data_received(data)
        proto.eof_received()
        proto.connection_lost(None)
        assert t.out and dns.message.from_wire(t.out[0][2:]).answer

    asyncio.run(run())


async def test_doq_internal_error_resets_only_that_stream(tmp_path: Path) -> None:
    import os

    from aioquic.quic.configuration import QuicConfiguration
    from aioquic.quic.connection import QuicConnection
    from aioquic.quic.events import StreamDataReceived

    from meshgate import tls
    from meshgate.dns.doq import DOQ_INTERNAL_ERROR, DoqProtocol
    from meshgate.dns.resolver import Frontend

    cert, key = tls.ensure_self_signed(tmp_path)
    qcfg = QuicConfiguration(is_client=False, alpn_protocols=["doq"])
    qcfg.load_cert_chain(str(cert), str(key))
    cfg = from_dict({"node": {"name": "alpha"}})
    p = Pipeline(cfg, upstreams=[])
    proto = DoqProtocol.__new__(DoqProtocol)
    proto.frontend = Frontend(p, ListenerStats("unit-doq-internal"))
    proto.stats, proto.limits, proto.conns = proto.frontend.stats, cfg.limits, set()
    proto.__init__(QuicConnection(configuration=qcfg, original_destination_connection_id=os.urandom(8)))
    resets: list[tuple[int, int]] = []
    proto._reset = lambda sid, code: resets.append((sid, code))  # type: ignore[method-assign]

    def boom(*_a: Any, **_k: Any) -> Any:
        raise RuntimeError("bug")

    proto.frontend.query = boom  # type: ignore[method-assign]
    q = dns.message.make_query("a.test", "A")
    q.id = 0
    proto.quic_event_received(StreamDataReceived(data=q.to_wire(prepend_length=True), end_stream=True,
                                                 stream_id=0))
    assert resets == [(0, DOQ_INTERNAL_ERROR)] and not proto.closed
    assert proto.stats.snapshot()["errors"]["internal"] == 1


async def test_udp_listener_has_room_for_a_burst_of_queries() -> None:
    cfg = from_dict({"node": {"name": "t"}})
    p = Pipeline(cfg, upstreams=[])
    t = await start_udp(p, ListenerStats("udp-rcvbuf"), "127.0.0.1", 0)
    try:
        got = t.get_extra_info("socket").getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
        rmem_max = int(Path("/proc/sys/net/core/rmem_max").read_text())
        # Linux doubles what was asked (bookkeeping); without root the cap is rmem_max.
        assert got >= 2 * (UDP_RCVBUF if os.geteuid() == 0 else min(UDP_RCVBUF, rmem_max))
    finally:
        t.close()
