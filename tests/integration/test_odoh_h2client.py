"""The HTTP/2 client pool the ODoH proxy and client use, against the project's h2 server over TLS."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from meshgate.config import LimitsConfig
from meshgate.dns.h2client import H2ClientError, H2Pool, client_ssl_context
from meshgate.dns.h2server import start_h2
from meshgate.dns.stats import ListenerStats
from meshgate.tls import ensure_self_signed, server_context
from tests.helpers import async_wait_until, free_port


class Server:
    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.waiting = 0
        self.paths: list[str] = []

    async def slow(self, path: str) -> Any:
        self.waiting += 1
        await self.gate.wait()
        return (200, [("content-type", "text/plain")], path.encode())

    def __call__(self, method: str, path: str, headers: list[tuple[str, str]], body: bytes) -> Any:
        self.paths.append(path)
        if path.startswith("/slow"):
            return self.slow(path)
        if path == "/big":
            return (200, [], b"x" * 100_000)
        if path == "/redirect":
            return (302, [("location", "https://elsewhere.example/")], b"")
        return (200, [], body or path.encode())


@pytest.fixture
async def server(tmp_path: Path) -> Any:
    cert, key = ensure_self_signed(tmp_path)
    app = Server()
    port = free_port()
    srv, conns = await start_h2(app, ListenerStats("pool-test"), LimitsConfig(doh_max_streams=100),
                                "127.0.0.1", port, server_context(cert, key, ["h2"]))
    yield app, port, cert
    app.gate.set()
    srv.close()
    for c in list(conns):
        if c.transport is not None:
            c.transport.close()
    await srv.wait_closed()


async def test_reuse_then_second_connection_when_streams_run_out(server: Any) -> None:
    app, port, cert = server
    pool = H2Pool(client_ssl_context(cafile=str(cert)), max_connections=2, max_streams=4)
    try:
        for i in range(5):
            r = await pool.request("127.0.0.1", port, "localhost", b"POST", b"/echo", [], f"b{i}".encode(), 5)
            assert (r.status, r.body) == (200, f"b{i}".encode())
        assert pool.connects == 1  # sequential requests share one connection

        # 8 slow requests: 4 streams per connection, so a second connection opens...
        slow = [asyncio.create_task(pool.request("127.0.0.1", port, "localhost", b"GET", f"/slow{i}".encode(),
                                                 [], b"", 10)) for i in range(8)]
        await async_wait_until(lambda: app.waiting == 8, 10, "8 requests in the server")
        assert pool.connects == 2 and len(pool) == 2
        # ...and a ninth finds the pool full (max_connections = 2, none idle): refused, not queued forever.
        with pytest.raises(H2ClientError) as e:
            await pool.request("127.0.0.1", port, "localhost", b"GET", b"/slow-extra", [], b"", 5)
        assert e.value.kind == "connection_limit_reached"
        app.gate.set()
        done = await asyncio.gather(*slow)
        assert sorted(r.body for r in done) == sorted(f"/slow{i}".encode() for i in range(8))
    finally:
        pool.close()


async def test_body_limit_redirect_and_timeout(server: Any) -> None:
    app, port, cert = server
    pool = H2Pool(client_ssl_context(cafile=str(cert)), max_connections=2, max_body=65535)
    try:
        with pytest.raises(H2ClientError) as e:
            await pool.request("127.0.0.1", port, "localhost", b"GET", b"/big", [], b"", 5)
        assert e.value.kind == "http_response_body_size"
        r = await pool.request("127.0.0.1", port, "localhost", b"GET", b"/redirect", [], b"", 5)
        assert r.status == 302  # returned as is: the caller decides, nothing is followed
        assert app.paths.count("/redirect") == 1 and not any("elsewhere" in p for p in app.paths)
        with pytest.raises(H2ClientError) as e:
            await pool.request("127.0.0.1", port, "localhost", b"GET", b"/slow-timeout", [], b"", 0.3)
        assert e.value.kind == "http_response_timeout"
        # Silent for the whole wait: the connection was PINGed, and the ack puts it back.
        conn = next(iter(pool._conns))
        await async_wait_until(lambda: conn.usable, 5, "PING ack")
        r = await pool.request("127.0.0.1", port, "localhost", b"POST", b"/echo", [], b"again", 5)
        assert r.body == b"again" and pool.connects == 1
    finally:
        pool.close()


async def test_tls_failures_have_proxy_status_kinds(server: Any, tmp_path: Path) -> None:
    _, port, _cert = server
    pool = H2Pool(client_ssl_context(), max_connections=2)  # system CAs: our self-signed cert fails
    try:
        with pytest.raises(H2ClientError) as e:
            await pool.request("127.0.0.1", port, "localhost", b"GET", b"/", [], b"", 5)
        assert e.value.kind == "tls_certificate_error"
        with pytest.raises(H2ClientError) as e:
            await pool.request("127.0.0.1", free_port(), "localhost", b"GET", b"/", [], b"", 5)
        assert e.value.kind == "connection_refused"
    finally:
        pool.close()
