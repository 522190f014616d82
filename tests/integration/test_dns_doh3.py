"""DoH over HTTP/3 (issue 16 item 2): the `doh3` listener kind beside a `doh` listener on the
same port number, in process on loopback. Real clients: dnspython's DoH-over-HTTP/3 client
(aioquic underneath; GET and POST), curl over HTTP/1.1 and HTTP/2 for the Alt-Svc header, and
an aioquic h3 client as the attacker (requests that never end, malformed headers, too many
connections from one address) while dnspython is still served."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import socket
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import dns.message
import dns.query
import dns.rcode
import pytest
from aioquic.asyncio.client import connect as quic_connect
from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.h3.connection import ErrorCode, H3Connection
from aioquic.h3.events import DataReceived, HeadersReceived
from aioquic.quic import events as qevents
from aioquic.quic.configuration import QuicConfiguration

from meshgate.config import from_dict
from meshgate.dns import service
from tests.helpers import async_wait_until, free_port, require_tool
from tests.integration.test_dns_h1 import run
from tests.integration.test_dns_upstream import LocalAuthority

NAME = "static.example.test."


class Env:
    def __init__(self, svc: service.DnsService, port: int) -> None:
        self.svc = svc
        self.port = port
        self.h3 = next(lst for lst in svc.listeners if lst.cfg.protocol == "doh3")

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}/dns-query"

    def stats(self) -> dict[str, Any]:
        return self.h3.stats.snapshot()


async def start(tmp_path: Path, auth: LocalAuthority, **limits: Any) -> Env:
    # One port number for both: TCP for HTTP/1.1 and HTTP/2, UDP for HTTP/3.
    port = free_port(socket.SOCK_DGRAM)
    cfg = from_dict({
        "node": {"name": "alpha", "ipv4": "10.144.144.1/24", "state_dir": str(tmp_path / "state")},
        "dns": {"upstreams": [auth.url], "records": {NAME: "10.1.2.9"},
                "listener": [{"protocol": "doh", "listen": f"127.0.0.1:{port}"},
                             {"protocol": "doh3", "listen": f"127.0.0.1:{port}"}]},
        "limits": {"dns_timeout": 60.0, **limits},
    })
    svc = service.DnsService(cfg, service.Pipeline(cfg))
    await svc.start()
    return Env(svc, port)


@pytest.fixture
async def auth() -> AsyncIterator[LocalAuthority]:
    a = await LocalAuthority().start()
    yield a
    a.release.set()
    await a.stop()


def answers(r: dns.message.Message) -> list[str]:
    return sorted(rr.to_text() for rrset in r.answer for rr in rrset)


def h3_query(url: str, name: str, post: bool = True) -> dns.message.Message:
    q = dns.message.make_query(name, "A")
    return dns.query.https(q, url, timeout=10, verify=False, post=post,
                           http_version=dns.query.HTTPVersion.H3)


async def test_dnspython_over_http3_get_and_post(tmp_path: Path, auth: LocalAuthority) -> None:
    env = await start(tmp_path, auth)
    try:
        assert env.h3.url == f"h3://127.0.0.1:{env.port}/dns-query"
        assert answers(await asyncio.to_thread(h3_query, env.url, NAME)) == ["10.1.2.9"]
        assert answers(await asyncio.to_thread(h3_query, env.url, NAME, False)) == ["10.1.2.9"]
        # Through the upstream (an answer that comes later, from a task).
        assert answers(await asyncio.to_thread(h3_query, env.url, "www.example.test")) == ["192.0.2.1"]
        st = env.stats()
        assert st["queries"] == 3 and st["responses"] == {"NOERROR": 3}
    finally:
        await env.svc.stop()


async def test_alt_svc_on_http11_and_http2(tmp_path: Path, auth: LocalAuthority) -> None:
    curl = require_tool("curl")
    env = await start(tmp_path, auth)
    try:
        q = dns.message.make_query(NAME, "A").to_wire()
        get = f"{env.url}?dns={base64.urlsafe_b64encode(q).rstrip(b'=').decode()}"
        for version in ("--http1.1", "--http2"):
            rc, out = await run(curl, "-sSk", version, "-D", "-", "-o", "/dev/null", get)
            assert rc == 0, out
            assert f'alt-svc: h3=":{env.port}"; ma=86400' in out.lower(), out
        # Worker processes (dns.workers > 1) bind the doh listener from this config: they advertise too.
        doh = next(lst for lst in env.svc.listeners if lst.cfg.protocol == "doh")
        assert doh.worker_config().alt_svc == f'h3=":{env.port}"; ma=86400'
    finally:
        await env.svc.stop()


# --------------------------------------------------------------------------- attackers


class H3Client(QuicConnectionProtocol):
    def __init__(self, *a: Any, **k: Any) -> None:
        super().__init__(*a, **k)
        self.h3 = H3Connection(self._quic)
        self.status: dict[int, int] = {}
        self.ended: set[int] = set()
        self.reset: dict[int, int] = {}
        self.terminated: qevents.ConnectionTerminated | None = None

    def quic_event_received(self, event: qevents.QuicEvent) -> None:
        if isinstance(event, qevents.ConnectionTerminated):
            self.terminated = event
        if isinstance(event, qevents.StreamReset):
            self.reset[event.stream_id] = event.error_code
        for ev in self.h3.handle_event(event):
            if isinstance(ev, HeadersReceived):
                self.status[ev.stream_id] = int(dict(ev.headers)[b":status"])
            if isinstance(ev, HeadersReceived | DataReceived) and ev.stream_ended:
                self.ended.add(ev.stream_id)

    def request(self, headers: list[tuple[bytes, bytes]], end: bool) -> int:
        sid = self._quic.get_next_available_stream_id()
        self.h3.send_headers(sid, headers, end_stream=end)
        self.transmit()
        return sid


def h3_config() -> QuicConfiguration:
    cfg = QuicConfiguration(is_client=True, alpn_protocols=["h3"])
    cfg.verify_mode = ssl.CERT_NONE
    return cfg


POST = [(b":method", b"POST"), (b":scheme", b"https"), (b":authority", b"localhost"),
        (b":path", b"/dns-query"), (b"content-type", b"application/dns-message")]


async def test_never_finished_stream_gets_408_then_idle_close(tmp_path: Path, auth: LocalAuthority) -> None:
    env = await start(tmp_path, auth, doh_request_timeout=0.5, dns_tcp_idle_timeout=1.5)
    try:
        async with quic_connect("127.0.0.1", env.port, configuration=h3_config(),
                                create_protocol=H3Client) as c:
            client: H3Client = c  # type: ignore[assignment]
            stalled = [client.request(POST, end=False) for _ in range(5)]
            # Others are served while the attacker's streams wait.
            assert answers(await asyncio.to_thread(h3_query, env.url, NAME)) == ["10.1.2.9"]
            await async_wait_until(lambda: all(client.status.get(s) == 408 for s in stalled),
                                   what="408 on every stalled stream")
            assert env.stats()["errors"].get("request_timeout", 0) == 5
            # Nothing else asked: the idle connection is closed by the server.
            await async_wait_until(lambda: client.terminated is not None, what="the idle close")
            assert client.terminated is not None and client.terminated.error_code == ErrorCode.H3_NO_ERROR
        await async_wait_until(lambda: not env.h3.conns, what="the connection forgotten")
    finally:
        await env.svc.stop()


async def test_malformed_headers_close_that_connection_only(tmp_path: Path, auth: LocalAuthority) -> None:
    env = await start(tmp_path, auth)
    try:
        async with quic_connect("127.0.0.1", env.port, configuration=h3_config(),
                                create_protocol=H3Client) as c:
            client: H3Client = c  # type: ignore[assignment]
            client.request([*POST, (b"Upper-Case", b"x")], end=True)
            await async_wait_until(lambda: client.terminated is not None, what="the close")
            assert client.terminated is not None
            assert client.terminated.error_code == ErrorCode.H3_MESSAGE_ERROR
        await async_wait_until(lambda: env.stats()["errors"].get("h3_protocol", 0) == 1,
                               what="the error counted")
        # Another connection is served.
        assert answers(await asyncio.to_thread(h3_query, env.url, NAME)) == ["10.1.2.9"]
    finally:
        await env.svc.stop()


async def test_connections_capped_per_client_address(tmp_path: Path, auth: LocalAuthority) -> None:
    env = await start(tmp_path, auth, dns_tcp_max_clients=4, dns_tcp_max_clients_per_source=2,
                      doh_request_timeout=60.0, dns_tcp_idle_timeout=60.0)
    try:
        async with contextlib.AsyncExitStack() as stack:
            for _ in range(2):
                c = await stack.enter_async_context(quic_connect(
                    "127.0.0.1", env.port, configuration=h3_config(), create_protocol=H3Client))
                c.request(POST, end=False)  # type: ignore[attr-defined]
            # The third from the same address is closed at its first packet (H3_EXCESSIVE_LOAD,
            # before the handshake ends: the client's connect fails).
            with pytest.raises(ConnectionError):
                async with quic_connect("127.0.0.1", env.port, configuration=h3_config(),
                                        create_protocol=H3Client):
                    pass
            assert env.stats()["drops"].get("max_clients_per_source", 0) == 1
            assert len(env.h3.conns) == 2
            # Another address is served while those two are held.
            q = dns.message.make_query(NAME, "A")
            r = await asyncio.to_thread(dns.query.https, q, env.url, timeout=10, verify=False,
                                        source="127.0.0.2", http_version=dns.query.HTTPVersion.H3)
            assert answers(r) == ["10.1.2.9"]
            assert r.rcode() == dns.rcode.NOERROR
    finally:
        await env.svc.stop()


async def test_streams_per_connection_capped_and_given_back(tmp_path: Path, auth: LocalAuthority) -> None:
    """doh_max_streams is what the connection may hold at once (advertised as MAX_STREAMS): with
    a cap of 3, five never-finished requests are held at most three at a time, and the last two
    get their turn (and their 408) once the first three have ended."""
    env = await start(tmp_path, auth, doh_max_streams=3, doh_request_timeout=0.5, dns_tcp_idle_timeout=60.0)
    try:
        async with quic_connect("127.0.0.1", env.port, configuration=h3_config(),
                                create_protocol=H3Client) as c:
            client: H3Client = c  # type: ignore[assignment]
            stalled = [client.request(POST, end=False) for _ in range(5)]
            most = 0

            def all_timed_out() -> bool:
                nonlocal most
                for p in env.h3.conns:
                    most = max(most, len(p.requests) + len(p.running))
                return all(client.status.get(s) == 408 for s in stalled)

            await async_wait_until(all_timed_out, what="408 on all five")
            assert 1 <= most <= 3
            assert env.stats()["errors"].get("request_timeout", 0) == 5
    finally:
        await env.svc.stop()
