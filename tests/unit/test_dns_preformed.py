"""The UDP cache-hit fast path (dns/preformed.py) against the general path (resolver.Frontend).

Hypothesis writes the queries (names in several letter cases, types, classes, RD/CD/AD bits,
opcodes, EDNS absent or with any UDP size, DO, padding, another option, version 0 or 1) and the
times they arrive. Each query is answered as the UDP listener answers it: the table first, the
general path when the table has nothing (which then teaches the table). Whenever the table
answers, the general path is asked the same question at the same instant on a twin pipeline and
must give the same bytes; the ID is the new query's and every TTL is the stored one minus the
whole seconds since it was stored, checked with dnspython.
"""

from __future__ import annotations

import asyncio
import itertools
import socket
import struct
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path

import dns.message
import dns.rrset
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshgate import udpbatch
from meshgate.config import from_dict
from meshgate.dns import plain, wire
from meshgate.dns.blocklist import Blocklist
from meshgate.dns.preformed import PreformedAnswers
from meshgate.dns.ratelimit import ClientRateLimit
from meshgate.dns.resolver import Frontend, Pipeline, Ready
from meshgate.dns.stats import ListenerStats
from meshgate.metrics import REGISTRY
from tests.helpers import async_wait_until, require

T0 = 1000.0
PEER = ("192.0.2.7", 5300)
# name -> (records, TTL, stored at): what each twin pipeline's cache holds
CACHED = {
    "one.example.": (["192.0.2.1"], 300, T0),
    "five.example.": ([f"192.0.2.{i}" for i in range(1, 6)], 3600, T0 - 0.5),
    "short.example.": (["192.0.2.9"], 2, T0),  # expires while the examples run
    "big.example.": ([f"198.51.100.{i}" for i in range(1, 41)], 600, T0),  # over 512 bytes: TC
}
NAMES = [*CACHED, "printer.example.", "bench.mesh.internal.", "nope.mesh.internal.",
         "mesh.internal.", "ads.blocked.example.", "missing.example."]
_BLOCKLIST = Path(tempfile.mkdtemp(prefix="meshgate-preformed-")) / "list.txt"
_BLOCKLIST.write_text("blocked.example\n")


def _responses() -> list[tuple[tuple[bytes, int, int], bytes, float]]:
    """(key, upstream response, stored at) for every cached name; built once, so both twins
    hold the same bytes (dnspython shuffles a record set's order on each to_wire)."""
    out = []
    for name, (addrs, ttl, stored) in CACHED.items():
        q = dns.message.make_query(name, "A")
        q.id = 0
        r = dns.message.make_response(q)
        r.answer.append(dns.rrset.from_text(name, ttl, "IN", "A", *addrs))
        out.append(((wire.encode_name(name), 1, 1), r.to_wire(), stored))
    # a negative answer (RFC 2308: the SOA's TTL) for another name
    q = dns.message.make_query("gone.example.", "A")
    q.id = 0
    r = dns.message.make_response(q)
    r.set_rcode(dns.rcode.NXDOMAIN)
    r.authority.append(dns.rrset.from_text("example.", 60, "IN", "SOA", "ns. host. 1 2 3 4 30"))
    out.append(((wire.encode_name("gone.example."), 1, 1), r.to_wire(), T0))
    return out


RESPONSES = _responses()
BLOCKLIST = Blocklist([str(_BLOCKLIST)], [], 3600.0, now=T0)
CONFIG = from_dict({"node": {"name": "bench"}, "dns": {"records": {"printer.example.": "10.1.2.9"}}})


def _pipeline() -> Pipeline:
    p = Pipeline(CONFIG, upstreams=[])
    p.blocklist = BLOCKLIST
    for key, resp, stored in RESPONSES:
        p.cache.put(key, wire.parse_response(resp, 0, key, stored))
    return p


@st.composite
def queries(draw: st.DrawFn) -> bytes:
    """A query's bytes after its ID (the table's key): header flags, one question, EDNS maybe."""
    name = draw(st.sampled_from([*NAMES, "gone.example."]))
    # every letter in either case (0x20 clients): each spelling is its own table entry
    cased = "".join(c.upper() if c.isalpha() and draw(st.booleans()) else c for c in name)
    qtype = draw(st.sampled_from([1, 1, 1, 28, 2, 6, 15]))
    qclass = draw(st.sampled_from([1, 1, 1, 3]))
    opcode = draw(st.sampled_from([0, 0, 0, 0, 2]))
    flags = (opcode << 11) | (draw(st.sampled_from([0, 0x0100])) | draw(st.sampled_from([0, 0x0010]))
                              | draw(st.sampled_from([0, 0x0020])))
    question = b"".join(
        bytes([len(label)]) + label.encode() for label in cased.rstrip(".").split(".")) + b"\x00"
    question += struct.pack(">HH", qtype, qclass)
    opt = b""
    if draw(st.booleans()):
        size = draw(st.sampled_from([0, 511, 512, 700, 1232, 4096, 65535]))
        do = 0x8000 if draw(st.booleans()) else 0
        version = draw(st.sampled_from([0, 0, 0, 1]))
        options = b""
        if draw(st.booleans()):
            options += struct.pack(">HH", wire.OPT_PADDING, 4) + bytes(4)
        if draw(st.booleans()):
            options += struct.pack(">HH", 10, 8) + draw(st.binary(min_size=8, max_size=8))  # a cookie
        opt = b"\x00" + struct.pack(">HHBBHH", wire.TYPE_OPT, size, 0, version, do, len(options)) + options
    return struct.pack(">HHHHH", flags, 1, 0, 0, 1 if opt else 0) + question + opt


def _general(fe: Frontend, data: bytes, now: float, udp: bool = True,
             fast: PreformedAnswers | None = None) -> bytes | None:
    """The general path's answer now (as the UDP listener asks, or DoH: `udp` False), which
    teaches `fast` as the listeners do; None when it has none at once (dropped, or the question
    goes upstream: these pipelines have no upstream, so that is abandoned). DoH's max-age is
    left in MAX_AGE."""
    fe.answered = None
    res = fe.query(data, now, PEER, udp=udp)
    if res is None:
        return None
    if not isinstance(res, Ready):
        res.abandon()
        return None
    out = res.buffer.tobytes()
    if fast is not None and fe.answered is not None:
        fast.learn(data, now, fe.answered, out)
    MAX_AGE[0] = res.max_age
    res.buffer.recycle()
    return out


MAX_AGE = [0]


def _teach(fe: Frontend, fast: PreformedAnswers, data: bytes, now: float) -> bytes | None:
    """Answer `data` by the general path twice: the table stores a query the second time."""
    _general(fe, data, now, fast=fast)
    return _general(fe, data, now, fast=fast)


def _in_loop(body: Callable[[], Awaitable[None]]) -> None:
    """Run `body` in a loop of its own (a question that goes upstream starts a task)."""
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(body())
    finally:
        loop.close()


def _check_ttls(out: bytes, data: bytes, now: float) -> None:
    """The ID is the query's and each TTL is aged by the whole seconds since it was stored."""
    msg = dns.message.from_wire(out, ignore_trailing=True)
    assert msg.id == struct.unpack_from(">H", data)[0]
    for rrset in msg.answer + msg.authority:
        name = rrset.name.to_text().lower()
        if name in CACHED:
            _, ttl, stored = CACHED[name]
            assert rrset.ttl == max(ttl - int(now - stored), 0)
        elif rrset.rdtype == dns.rdatatype.SOA and name == "example.":
            assert rrset.ttl == max(60 - int(now - T0), 0)


@pytest.mark.parametrize("udp", [True, False], ids=["udp", "doh"])
@settings(max_examples=200, deadline=None)
@given(asked=st.lists(queries(), min_size=1, max_size=3),
       steps=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 0xFFFF), st.floats(0.0, 0.7)), min_size=1,
                max_size=16))
def test_fast_path_answers_as_the_general_path(asked: list[bytes], steps: list[tuple[int, int, float]],
                                               udp: bool) -> None:
    """`asked`: a few distinct queries; `steps`: which one comes next (repeats are what the table
    serves), under which ID, how long after the one before; `udp`: as the UDP listener answers
    (EDNS size, TC) or as DoH does (never truncated, and the cache-control max-age)."""

    async def body() -> None:
        served, twin = _pipeline(), _pipeline()
        fe = Frontend(served, ListenerStats("udp://fast"))
        fe_twin = Frontend(twin, ListenerStats("udp://general"))
        fast = PreformedAnswers(served, 64, udp=udp)
        now = T0
        for which, qid, dt in steps:
            now += dt
            data = struct.pack(">H", qid) + asked[which % len(asked)]
            expected = _general(fe_twin, data, now, udp)
            max_age = MAX_AGE[0]
            out = fast.answer(data, now)
            if out is None:  # what the listener does: the general path, which teaches the table
                got = _general(fe, data, now, udp, fast)
                assert got == expected
                continue
            assert out == expected, (data.hex(), out.hex(), expected)
            _check_ttls(out, data, now)
            if not udp:
                assert fast.max_age == max_age
        fe.close()
        fe_twin.close()

    _in_loop(body)


def test_a_repeated_query_is_served_from_the_table_and_counted() -> None:
    p = _pipeline()
    fe = Frontend(p, ListenerStats("udp://count"))
    fast = PreformedAnswers(p, 64)
    q = dns.message.make_query("five.example.", "A", use_edns=0)
    data = q.to_wire()
    assert fast.answer(data, T0) is None
    assert _teach(fe, fast, data, T0) is not None
    q.id = 4242
    out = fast.answer(q.to_wire(), T0 + 0.2)
    assert out is not None and dns.message.from_wire(out).id == 4242
    stats = ListenerStats("udp://counted")
    cache_hits = REGISTRY.counter("meshgate_dns_cache_hits_total", "")
    before = cache_hits.value
    fast.flush_counts(stats)
    snap = stats.snapshot()
    assert (snap["queries"], snap["responses"], cache_hits.value - before) == (1, {"NOERROR": 1}, 1)
    fast.flush_counts(stats)  # nothing new
    assert stats.snapshot()["queries"] == 1
    # the next second: TTLs patched in the table's own copy
    out = fast.answer(q.to_wire(), T0 + 0.9)
    assert out is not None
    assert dns.message.from_wire(out).answer[0].ttl == 3600 - 1


def test_changes_to_local_data_and_the_cache_take_effect_at_once() -> None:
    p = _pipeline()
    fe = Frontend(p, ListenerStats("udp://change"))
    fast = PreformedAnswers(p, 64)
    data = dns.message.make_query("one.example.", "A").to_wire()
    _teach(fe, fast, data, T0)
    assert fast.answer(data, T0) is not None
    # dns.records now names it (a reload): local data wins over the cache
    p.set_records((("one.example.", "10.9.9.9"),))
    assert fast.answer(data, T0) is None
    out = _teach(fe, fast, data, T0)
    assert out is not None and "10.9.9.9" in dns.message.from_wire(out).to_text()
    p.set_records(())
    assert fast.answer(data, T0) is None
    _teach(fe, fast, data, T0)
    assert fast.answer(data, T0) is not None
    # the cache entry replaced (a reload's new upstreams empty it): never the old bytes
    p.cache.clear()
    assert fast.answer(data, T0) is None
    # a blocklist decision is never served from the table
    blocked = dns.message.make_query("ads.blocked.example.", "A").to_wire()
    _teach(fe, fast, blocked, T0)
    assert fast.answer(blocked, T0) is None and len(fast) == 1


def test_the_table_is_bounded() -> None:
    p = _pipeline()
    fe = Frontend(p, ListenerStats("udp://bound"))
    fast = PreformedAnswers(p, 8)
    for i in range(50):
        q = dns.message.make_query("one.example.", "A", use_edns=0, payload=600 + i)
        data = q.to_wire()
        _teach(fe, fast, data, T0)
        assert len(fast) <= 8


def test_an_expired_cache_answer_is_not_served() -> None:
    p = _pipeline()
    fe = Frontend(p, ListenerStats("udp://expiry"))
    fast = PreformedAnswers(p, 64)
    data = dns.message.make_query("short.example.", "A").to_wire()
    _teach(fe, fast, data, T0 + 1.5)  # the memo's second runs to T0 + 2.5
    assert fast.answer(data, T0 + 1.9) is not None
    assert fast.answer(data, T0 + 2.0) is None  # stored at T0 with TTL 2


def test_a_blocklist_change_is_seen_within_the_memo_second(tmp_path: Path) -> None:
    """The table serves only inside the memo's second: then the general path runs lookup(),
    which re-reads changed lists, and a name blocked meanwhile is blocked at once."""
    lst = tmp_path / "list.txt"
    lst.write_text("other.example\n")
    p = _pipeline()
    p.blocklist = Blocklist([str(lst)], [], 0.5, now=T0)
    fe = Frontend(p, ListenerStats("udp://epoch"))
    fast = PreformedAnswers(p, 64)
    data = dns.message.make_query("one.example.", "A").to_wire()
    assert _teach(fe, fast, data, T0) is not None
    assert fast.answer(data, T0 + 0.5) is not None
    lst.write_text("one.example\n")
    assert fast.answer(data, T0 + 1.0) is None
    out = _general(fe, data, T0 + 1.0)
    assert out is not None and dns.message.from_wire(out).rcode() == dns.rcode.NXDOMAIN


# --------------------------------------------------------------------------- the listener, batched or not
# The same property through the UDP listener itself on loopback: one listener reads and answers
# with recvmmsg/sendmmsg (meshgate/udpbatch.py), its twin with a system call per datagram. Each
# burst is written to both sockets before either is read, so batches mix table hits, the general
# path, junk and (rate-limited) slips and drops; every answer must be the same bytes, and so
# must the counters.

SERIAL = itertools.count()  # a listener name per example: the counters are the registry's
MARKER = struct.pack(">HHHHHH", 0xFFFF, 0, 0, 0, 0, 0)  # QDCOUNT 0: a FORMERR, never rate-limited
JUNK = [b"", b"\x12", bytes(11), bytes(12),  # too short to be DNS; a FORMERR
        struct.pack(">HHHHHH", 7, 0x8000, 1, 0, 0, 0) + b"\x00\x00\x01\x00\x01",  # a response: dropped
        struct.pack(">HHHHHH", 8, 0, 1, 0, 0, 0) + b"\x03one\x07exa",  # a truncated question
        dns.message.make_query("one.example.", "A").to_wire() + b"\x00",  # trailing bytes
        # a long one: a 2,500-byte additional record before the OPT record, whose EDNS size and
        # DO bit (the datagram's last bytes) shape the answer
        struct.pack(">HHHHHH", 9, 0x0100, 1, 0, 0, 2) + wire.encode_name("five.example.")
        + b"\x00\x01\x00\x01" + b"\x00" + struct.pack(">HHIH", 16, 1, 0, 2500) + bytes(2500)
        + b"\x00" + struct.pack(">HHIH", wire.TYPE_OPT, 700, wire.EDNS_DO, 0)]


async def _answers(srv: plain.UdpDnsServer, clients: list[socket.socket], sent: int) -> list[list[bytes]]:
    """Every answer to what each client sent, once `srv` has counted `sent` queries in all and
    has no question still going upstream; then a marker from each, whose answer comes after
    every other to that client."""
    loop = asyncio.get_running_loop()
    await async_wait_until(lambda: srv.stats.queries.value >= sent and not srv.frontend.tasks, 10,
                           f"{sent} queries counted and none upstream")
    got = []
    for c in clients:
        c.sendto(MARKER, srv.sock.getsockname())
        out = []
        while True:
            data = await asyncio.wait_for(loop.sock_recv(c, 65535), 10)
            if data[:2] == MARKER[:2]:
                break
            out.append(data)
        got.append(sorted(out))
    return got


@pytest.mark.parametrize("limited", [False, True], ids=["open", "rate-limited"])
@settings(max_examples=30, deadline=None)
@given(asked=st.lists(queries(), min_size=1, max_size=4),
       junk=st.binary(max_size=40),
       bursts=st.lists(st.tuples(st.lists(st.integers(0, 13), min_size=1, max_size=150), st.floats(0.0, 1.2)),
                       min_size=1, max_size=4))
def test_the_batched_listener_answers_as_the_one_datagram_at_a_time_one(
        asked: list[bytes], junk: bytes, bursts: list[tuple[list[int], float]], limited: bool) -> None:
    _compare_listeners(asked, junk, bursts, limited)


@pytest.mark.parametrize("limited", [False, True], ids=["open", "rate-limited"])
def test_full_batches_answer_as_the_one_datagram_at_a_time_listener(limited: bool) -> None:
    """Bursts of 300 (hypothesis rarely writes long ones): several full batches per burst, so a
    wake-up's bound and the next wake-up are crossed, and the rate limit is reached."""
    asked = [struct.pack(">HHHHH", 0x0100, 1, 0, 0, 0) + wire.encode_name(name) + struct.pack(">HH", qtype, 1)
             for name, qtype in (("five.example.", 1), ("printer.example.", 1), ("missing.example.", 1),
                                 ("one.example.", 28), ("big.example.", 1), ("ads.blocked.example.", 1))]
    picks = [k % 15 for k in range(300)]  # every kind: the asked, JUNK and one more
    _compare_listeners(asked, b"\x01\x02\x03", [(picks, 0.0), (picks, 0.4), (picks, 1.3)], limited)


def _compare_listeners(asked: list[bytes], junk: bytes, bursts: list[tuple[list[int], float]],
                       limited: bool) -> None:
    """`asked`: queries after their ID; `bursts`: which of asked + JUNK + [junk] each datagram
    of a burst is, and how long after the burst before it the burst comes."""
    require(udpbatch.available(), "recvmmsg/sendmmsg in the C library (Linux, 64-bit)")

    async def body() -> None:
        servers: list[plain.UdpDnsServer] = []
        clients: list[list[socket.socket]] = []  # three senders per listener, in turn
        for batched in (True, False):
            limiter = ClientRateLimit(10.0, 40, 2) if limited else None
            stats = ListenerStats(f"udp://batched-{batched}-{next(SERIAL)}")
            srv = await plain.start_udp(_pipeline(), stats, "127.0.0.1", 0, limiter=limiter, fast_entries=64,
                                        batched=batched)
            servers.append(srv)
            clients.append([])
            for _ in range(3):
                c = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 21)
                c.bind(("127.0.0.1", 0))
                c.setblocking(False)
                clients[-1].append(c)
        assert servers[0].batch is not None and servers[1].batch is None
        kinds = [*asked, *JUNK, junk]
        now, sent = T0, 0
        try:
            for picks, dt in bursts:
                now += dt
                datagrams = []
                for n, k in enumerate(picks):
                    body = kinds[k % len(kinds)]
                    # a query under an ID of its own; junk as it is
                    datagrams.append(struct.pack(">H", n) + body if k % len(kinds) < len(asked) else body)
                for srv, cs in zip(servers, clients, strict=True):
                    srv.clock = lambda now=now: now  # type: ignore[misc]
                    for n, d in enumerate(datagrams):
                        cs[n % 3].sendto(d, srv.sock.getsockname())
                sent += len(datagrams)
                got = [await _answers(srv, cs, sent) for srv, cs in zip(servers, clients, strict=True)]
                sent += 3  # the markers
                assert got[0] == got[1]
            assert servers[0].stats.snapshot() == servers[1].stats.snapshot()
        finally:
            for srv, cs in zip(servers, clients, strict=True):
                srv.close()
                for c in cs:
                    c.close()

    _in_loop(body)
