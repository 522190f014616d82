"""The cache-hit fast path on loopback: the udp and doh listeners give the same answers and the
same counts as with it off (`limits.dns_fast_path = false`) to dnspython (UDP, DoH GET and POST),
repeats are served from the table, and the UDP listener reads its socket in batches without one
callback per datagram."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import dns.asyncquery
import dns.flags
import dns.message
import dns.query
import dns.rcode
import pytest

from meshgate import udpbatch
from meshgate.config import from_dict
from meshgate.dns import service
from meshgate.dns.plain import UdpDnsServer
from meshgate.metrics import REGISTRY
from tests.helpers import require
from tests.integration.test_dns_upstream import LocalAuthority

NAMES = ["www.example.test.", "five.example.test.", "nx1.example.test.", "alpha.mesh.internal.",
         "printer.mesh.internal.", "big.example.test."]


@pytest.fixture
async def auth() -> AsyncIterator[LocalAuthority]:
    a = await LocalAuthority().start()
    yield a
    a.release.set()
    await a.stop()


async def _start(tmp_path: Path, auth: LocalAuthority, fast_entries: int) -> service.DnsService:
    cfg = from_dict({
        "node": {"name": "alpha", "ipv4": "10.144.144.1/24", "state_dir": str(tmp_path / "state")},
        "dns": {"upstreams": [auth.url], "records": {"printer.mesh.internal.": "10.1.2.9"},
                "listener": [{"protocol": "udp", "listen": "127.0.0.1:0"},
                             {"protocol": "doh", "listen": "127.0.0.1:0"}]},
        "limits": {"dns_fast_path": fast_entries > 0, "dns_fast_path_entries": max(fast_entries, 1)},
    })
    svc = service.DnsService(cfg, service.Pipeline(cfg))
    await svc.start()
    return svc


def _port(svc: service.DnsService) -> int:
    return int(svc.urls[0].rsplit(":", 1)[1])


def _server(svc: service.DnsService) -> UdpDnsServer:
    t = svc.listeners[0].transport  # type: ignore[attr-defined]
    assert isinstance(t, UdpDnsServer)
    return t


async def _ask(svc: service.DnsService, how: str, q: dns.message.Message) -> dns.message.Message:
    if how == "udp":
        return await dns.asyncquery.udp(q, "127.0.0.1", port=_port(svc), timeout=5)
    return await asyncio.to_thread(dns.query.https, q, svc.urls[1], timeout=10, verify=False,
                                   post=how == "post")


async def _ask_all(svc: service.DnsService, how: str, rounds: int) -> list[tuple[str, int, list[str]]]:
    """Every name, A and AAAA, with and without EDNS, `rounds` times: (question, rcode, records
    without their TTLs), and every TTL checked to be at most the one first seen."""
    out = []
    first_ttl: dict[tuple[str, int, bool], int] = {}
    for _ in range(rounds):
        for name in NAMES:
            for rdtype in ("A", "AAAA"):
                for edns in (False, True):
                    q = dns.message.make_query(name, rdtype, use_edns=0 if edns else False)
                    if how != "udp":
                        q.id = 0  # RFC 8484 4.1: cache-friendly
                    r = await _ask(svc, how, q)
                    assert r.id == q.id
                    recs = sorted(rr.to_text() for rrset in r.answer + r.authority for rr in rrset)
                    ttls = [rrset.ttl for rrset in r.answer + r.authority]
                    key = (name, q.question[0].rdtype, edns)
                    if ttls:
                        assert min(ttls) <= first_ttl.setdefault(key, min(ttls))
                    out.append((f"{name} {rdtype} {edns} tc={bool(r.flags & dns.flags.TC)}", r.rcode(),
                                recs))
    return out


def _counts(svc: service.DnsService, i: int) -> dict[str, Any]:
    snap = svc.stats[svc.urls[i]].snapshot()
    return {"queries": snap["queries"], "responses": snap["responses"], "drops": snap["drops"],
            "errors": snap["errors"]}


@pytest.mark.parametrize("how", ["udp", "get", "post"])
async def test_fast_path_answers_and_counts_as_the_general_path(tmp_path: Path, auth: LocalAuthority,
                                                                how: str) -> None:
    hits = REGISTRY.counter("meshgate_dns_cache_hits_total", "")
    results = {}
    counts = {}
    cache_hits = {}
    listener = 0 if how == "udp" else 1
    for entries in (0, 4096):
        svc = await _start(tmp_path / str(entries), auth, entries)
        try:
            before = hits.value
            results[entries] = await _ask_all(svc, how, 3)
            await asyncio.sleep(0)  # the last batch's counts are added as its loop tick ends
            counts[entries] = _counts(svc, listener)
            cache_hits[entries] = hits.value - before
            lst = svc.listeners[listener]
            fast = _server(svc).fast if how == "udp" else lst.app.fast  # type: ignore[attr-defined]
            if entries:
                assert fast is not None and len(fast) > 0
            else:
                assert fast is None
        finally:
            await svc.stop()
    assert results[4096] == results[0]
    # the same queries, responses by rcode, and cache hits, counted in batches or one by one
    assert counts[4096] == counts[0]
    assert cache_hits[4096] == cache_hits[0] > 0


async def test_repeats_come_from_the_table(tmp_path: Path, auth: LocalAuthority) -> None:
    svc = await _start(tmp_path, auth, 4096)
    try:
        port = _port(svc)
        fast = _server(svc).fast
        assert fast is not None
        from_table = [0]
        entry = fast.entry  # what both the batched and the one-by-one reads look up

        def spy(key: bytes, now: float) -> object:
            out = entry(key, now)
            from_table[0] += out is not None
            return out

        fast.entry = spy  # type: ignore[method-assign,assignment]
        q = dns.message.make_query("five.example.test.", "A")
        await dns.asyncquery.udp(q, "127.0.0.1", port=port, timeout=5)  # upstream, then cached
        await dns.asyncquery.udp(q, "127.0.0.1", port=port, timeout=5)  # the cache: learned
        assert from_table[0] == 0
        for _ in range(20):
            fresh = dns.message.make_query("five.example.test.", "A")
            r = await dns.asyncquery.udp(fresh, "127.0.0.1", port=port, timeout=5)
            assert r.id == fresh.id and len(r.answer[0]) == 5
        # all from the table but those asked as the memo's second turned (the general path
        # then runs and learns again)
        assert from_table[0] >= 15
        assert auth.queries["five.example.test."] == 1
    finally:
        await svc.stop()


@pytest.mark.parametrize("calls", ["recvmmsg", "none"])
async def test_a_burst_is_answered_in_batches(tmp_path: Path, auth: LocalAuthority, calls: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """300 queries already waiting on the socket: all answered, in a few wake-ups of the loop
    rather than one callback per datagram; with recvmmsg/sendmmsg, or (a C library without
    them) a system call per datagram."""
    if calls == "none":
        monkeypatch.setattr(udpbatch, "_CALLS", None)
    else:
        require(udpbatch.available(), "recvmmsg/sendmmsg in the C library (Linux, 64-bit)")
    svc = await _start(tmp_path, auth, 4096)
    try:
        port = _port(svc)
        q = dns.message.make_query("www.example.test.", "A")
        await dns.asyncquery.udp(q, "127.0.0.1", port=port, timeout=5)
        server = _server(svc)
        assert (server.batch is None) == (calls == "none")
        wakeups = [0]
        orig = server._readable if server.batch is None else server._readable_batch

        def counting() -> None:
            wakeups[0] += 1
            orig()

        loop = asyncio.get_running_loop()
        fd = server.sock.fileno()
        loop.remove_reader(fd)
        loop.add_reader(fd, counting)
        client = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        client.bind(("127.0.0.1", 0))
        client.setblocking(False)
        # filled while the loop is not running: every datagram waits on the listener's socket
        for i in range(300):
            q.id = i
            client.sendto(q.to_wire(), ("127.0.0.1", port))
        ids: set[int] = set()
        deadline = loop.time() + 10
        while len(ids) < 300 and loop.time() < deadline:
            await asyncio.sleep(0.01)
            while True:
                try:
                    ids.add(dns.message.from_wire(client.recv(4096)).id)
                except BlockingIOError:
                    break
        client.close()
        assert ids == set(range(300))
        assert wakeups[0] <= 300 // 64 + 3, wakeups[0]
    finally:
        await svc.stop()


async def test_stopping_closes_the_socket(tmp_path: Path, auth: LocalAuthority) -> None:
    svc = await _start(tmp_path, auth, 4096)
    server = _server(svc)
    port = _port(svc)
    await svc.stop()
    assert server.sock.fileno() == -1
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("127.0.0.1", port))  # the port is free again
    s.close()
