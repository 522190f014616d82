"""Per-client query rate limit (issue 16 item 9) on real listeners over loopback, with dnspython:
a bounded UDP flood from one address is answered up to its burst, then every second query gets
an empty TC answer and the rest no answer (counted); another address is served meanwhile; a
client that gets TC retries over TCP and is answered; DoH answers REFUSED over the limit. The
listeners bind 127.0.0.1 with `rate_limit = true` (on loopback it is off unless asked for)."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path
from typing import Any

import dns.flags
import dns.message
import dns.query
import dns.rcode

from meshgate.config import from_dict
from meshgate.dns import service
from tests.helpers import async_wait_until, free_port

NAME = "static.example.test."
FLOOD = 200


async def start(tmp_path: Path, port: int, **limits: Any) -> service.DnsService:
    cfg = from_dict({
        "node": {"name": "alpha", "ipv4": "10.144.144.1/24", "state_dir": str(tmp_path / "state")},
        "dns": {"upstreams": ["udp://127.0.0.1:9"], "records": {NAME: "10.1.2.9"},
                "listener": [{"protocol": p, "listen": f"127.0.0.1:{port if p != 'doh' else 0}",
                              "rate_limit": True} for p in ("udp", "tcp", "doh")]},
        "limits": limits,
    })
    svc = service.DnsService(cfg, service.Pipeline(cfg))
    await svc.start()
    return svc


def stats(svc: service.DnsService, scheme: str) -> Any:
    return next(s for url, s in svc.stats.items() if url.startswith(scheme + "://"))


def _flood(port: int, n: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
    for i in range(n):
        q = dns.message.make_query(NAME, "A")
        q.id = i
        sock.sendto(q.to_wire(), ("127.0.0.1", port))
    return sock


def _drain(sock: socket.socket) -> list[dns.message.Message]:
    """Every reply already queued on the socket (the listener answers local names at once)."""
    sock.setblocking(False)
    out = []
    while True:
        try:
            out.append(dns.message.from_wire(sock.recv(4096)))
        except BlockingIOError:
            return out


async def test_udp_flood_slips_every_second_limited_query(tmp_path: Path) -> None:
    port = free_port(socket.SOCK_DGRAM)
    svc = await start(tmp_path, port, dns_client_qps=0.5, dns_client_burst=10, dns_client_slip=2)
    try:
        st = stats(svc, "udp")
        sock = await asyncio.to_thread(_flood, port, FLOOD)
        await async_wait_until(lambda: st.snapshot()["queries"] == FLOOD, what="the flood counted")
        # Another client address is its own bucket: answered in full meanwhile.
        q = dns.message.make_query(NAME, "A")
        other = await asyncio.to_thread(dns.query.udp, q, "127.0.0.1", port=port, timeout=5,
                                        source="127.0.0.2")
        assert other.answer and not other.flags & dns.flags.TC
        replies = await asyncio.to_thread(_drain, sock)
        sock.close()
        full = [r for r in replies if r.answer]
        tc = [r for r in replies if r.flags & dns.flags.TC]
        # The burst (and at most a token or two refilled while the flood ran), then every second
        # limited query slips, the others get nothing.
        assert 10 <= len(full) <= 12, len(full)
        limited = FLOOD - len(full)
        assert len(tc) == limited // 2
        assert all(not r.answer and r.question and r.rcode() == dns.rcode.NOERROR for r in tc)
        assert len(replies) == len(full) + len(tc)
        drops = st.snapshot()["drops"]
        assert drops.get("rate_limit_slip", 0) == len(tc)
        assert drops.get("rate_limit", 0) == limited - len(tc)
    finally:
        await svc.stop()


async def test_tc_slip_sends_the_client_to_tcp_and_doh_refuses(tmp_path: Path) -> None:
    port = free_port(socket.SOCK_DGRAM)
    # slip 1: every limited UDP query gets TC (so the retry below is deterministic).
    svc = await start(tmp_path, port, dns_client_qps=0.01, dns_client_burst=3, dns_client_slip=1)
    try:
        q = dns.message.make_query(NAME, "A")
        for _ in range(3):
            r = await asyncio.to_thread(dns.query.udp, q, "127.0.0.1", port=port, timeout=5)
            assert r.answer
        r, used_tcp = await asyncio.to_thread(dns.query.udp_with_fallback, q, "127.0.0.1", port=port,
                                              timeout=5)
        assert used_tcp and [rr.to_text() for rrset in r.answer for rr in rrset] == ["10.1.2.9"]
        assert stats(svc, "udp").snapshot()["drops"].get("rate_limit_slip", 0) == 1
        # DoH: the same bucket size on its own listener; past it, REFUSED (HTTP 200, a DNS answer).
        url = next(u for u in svc.urls if u.startswith("https://"))
        codes = []
        for _ in range(5):
            r = await asyncio.to_thread(dns.query.https, q, url, timeout=10, verify=False)
            codes.append(r.rcode())
        assert codes == [dns.rcode.NOERROR] * 3 + [dns.rcode.REFUSED] * 2
        assert stats(svc, "https").snapshot()["drops"].get("rate_limit", 0) == 2
    finally:
        await svc.stop()


async def test_loopback_listener_is_not_limited_by_default(tmp_path: Path) -> None:
    port = free_port(socket.SOCK_DGRAM)
    cfg = from_dict({
        "node": {"name": "alpha", "state_dir": str(tmp_path / "state")},
        "dns": {"upstreams": ["udp://127.0.0.1:9"], "records": {NAME: "10.1.2.9"},
                "listener": [{"protocol": "udp", "listen": f"127.0.0.1:{port}"}]},
        "limits": {"dns_client_qps": 0.5, "dns_client_burst": 10},
    })
    svc = service.DnsService(cfg, service.Pipeline(cfg))
    await svc.start()
    try:
        st = stats(svc, "udp")
        sock = await asyncio.to_thread(_flood, port, 50)
        await async_wait_until(lambda: st.snapshot()["queries"] == 50, what="the queries counted")
        replies = await asyncio.to_thread(_drain, sock)
        sock.close()
        assert len([r for r in replies if r.answer]) == 50
    finally:
        await svc.stop()
