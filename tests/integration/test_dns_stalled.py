"""A DoH request that never ends is closed (issue 16 item 8), tried as an attacker would: raw TLS
sockets with the h2 library (HEADERS without END_STREAM, a header block without END_HEADERS,
then silence) and raw HTTP/1.1 (a head dribbled a byte at a time, a body that stops short),
from 127.0.0.2, while curl and dnspython from 127.0.0.1 must still be answered. Blocking
clients run in threads so the listener's loop keeps serving."""

from __future__ import annotations

import asyncio
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import dns.message
import dns.query
import h2.config
import h2.connection
import h2.events
import pytest

from tests.helpers import async_wait_until, require_tool
from tests.integration.test_dns_h1 import Env, Reader, auth, b64, query, run, start, tls_ctx
from tests.integration.test_dns_upstream import LocalAuthority

__all__ = ["auth"]  # the fixture, imported for its use here

ATTACKER = "127.0.0.2"


def attacker_socket(port: int, alpn: list[str]) -> ssl.SSLSocket:
    raw = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    raw.settimeout(10)
    raw.bind((ATTACKER, 0))
    raw.connect(("127.0.0.1", port))
    return tls_ctx(alpn).wrap_socket(raw, server_hostname="localhost")


class StalledH2:
    """An HTTP/2 connection from the attacker holding a stream whose request never ends."""

    def __init__(self, port: int, *, open_block: bool = False) -> None:
        self.sock = attacker_socket(port, ["h2"])
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True,
                                                                         header_encoding="utf-8"))
        self.conn.initiate_connection()
        self.sid = self.conn.get_next_available_stream_id()
        headers = [(":method", "POST"), (":path", "/dns-query"), (":scheme", "https"),
                   (":authority", "localhost"), ("content-type", "application/dns-message")]
        self.conn.send_headers(self.sid, headers, end_stream=False)
        data = self.conn.data_to_send()
        if open_block:
            # Clear END_HEADERS on the HEADERS frame (flags byte of the last frame): the block
            # then waits for a CONTINUATION that never comes.
            at = _last_frame(data)
            data = data[: at + 4] + bytes([data[at + 4] & ~0x4]) + data[at + 5 :]
        self.sock.sendall(data)
        self.status = 0
        self.closed = False
        # With the block open, any other frame (our SETTINGS ACK) is a protocol error: send none.
        self.quiet = open_block

    def wait(self, timeout: float) -> None:
        """Read until the server closes the connection or `timeout` passes; note the status."""
        self.sock.settimeout(timeout)
        try:
            while True:
                data = self.sock.recv(65536)
                if not data:
                    self.closed = True
                    return
                for ev in self.conn.receive_data(data):
                    if isinstance(ev, h2.events.ResponseReceived):
                        self.status = int(dict(ev.headers)[":status"])
                    elif isinstance(ev, h2.events.ConnectionTerminated):
                        self.closed = True
                out = self.conn.data_to_send()
                if out and not self.quiet:
                    self.sock.sendall(out)
        except TimeoutError:
            return
        except (ConnectionError, ssl.SSLError, OSError):
            self.closed = True

    def close(self) -> None:
        self.sock.close()


def _last_frame(data: bytes) -> int:
    """Offset of the last HTTP/2 frame in `data` (after the preface and SETTINGS)."""
    at = len(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
    last = at
    while at < len(data):
        last = at
        at += 9 + int.from_bytes(data[at : at + 3], "big")
    return last


def _read_all(sock: ssl.SSLSocket, timeout: float) -> tuple[bytes, bool]:
    """What the server sends before it closes (True) or `timeout` passes (False)."""
    sock.settimeout(timeout)
    got = b""
    try:
        while True:
            data = sock.recv(65536)
            if not data:
                return got, True
            got += data
    except TimeoutError:
        return got, False
    except (ConnectionError, ssl.SSLError, OSError):
        return got, True


@pytest.fixture
def attackers() -> Iterator[list[StalledH2]]:
    held: list[StalledH2] = []
    yield held
    for a in held:
        a.close()


async def _curl_answers(env: Env) -> str:
    curl = require_tool("curl")
    rc, out = await run(curl, "-sS", "--http2", "--cacert", str(env.cert), "-o", "/dev/null", "-w",
                        "%{http_code}", "--max-time", "10", "--resolve", f"localhost:{env.port}:127.0.0.1",
                        f"https://localhost:{env.port}/dns-query?dns={b64(query('www.example.test'))}")
    return f"{rc} {out}"


async def test_stalled_connections_capped_per_client_address(
        tmp_path: Path, auth: LocalAuthority, attackers: list[StalledH2]) -> None:
    # Deadlines far off: what lets the others in here is the per-address cap alone.
    env = await start(tmp_path, auth, dns_tcp_max_clients=6, dns_tcp_max_clients_per_source=3,
                      doh_request_timeout=60.0, dns_tcp_idle_timeout=60.0)
    try:
        for _ in range(6):
            attackers.append(await asyncio.to_thread(StalledH2, env.port))
        await async_wait_until(lambda: env.stats.snapshot()["drops"].get("max_clients_per_source", 0) == 3,
                               what="three of the attacker's six connections refused")
        assert len(env.conns()) == 3
        # The attacker's own refused connections see the close.
        await asyncio.gather(*(asyncio.to_thread(a.wait, 2.0) for a in attackers))
        assert sum(a.closed for a in attackers) == 3
        # Everyone else is still served: curl over HTTP/2, dnspython over HTTP/2.
        assert await _curl_answers(env) == "0 200"
        q = dns.message.make_query("www.example.test", "A")
        r = await asyncio.to_thread(dns.query.https, q, f"https://127.0.0.1:{env.port}/dns-query",
                                    timeout=10, verify=False)
        assert [rr.to_text() for rrset in r.answer for rr in rrset] == ["192.0.2.1"]
    finally:
        await env.svc.stop()


async def test_request_without_end_stream_gets_408_then_close(
        tmp_path: Path, auth: LocalAuthority, attackers: list[StalledH2]) -> None:
    env = await start(tmp_path, auth, doh_request_timeout=0.5, dns_tcp_idle_timeout=1.0)
    try:
        a = await asyncio.to_thread(StalledH2, env.port)
        attackers.append(a)
        t0 = time.monotonic()
        await asyncio.to_thread(a.wait, 15.0)
        assert a.status == 408 and a.closed
        assert time.monotonic() - t0 < 10
        assert env.stats.snapshot()["errors"].get("request_timeout", 0) == 1
        a.close()  # (TLS: the server's close waits for our close_notify or EOF)
        await async_wait_until(lambda: not env.conns(), what="the stalled connection gone")
    finally:
        await env.svc.stop()


async def test_only_stalled_streams_count_as_idle(
        tmp_path: Path, auth: LocalAuthority, attackers: list[StalledH2]) -> None:
    # The request deadline is far off; the idle timeout closes a connection holding nothing but
    # streams that wait for the client.
    env = await start(tmp_path, auth, doh_request_timeout=60.0, dns_tcp_idle_timeout=0.5)
    try:
        a = await asyncio.to_thread(StalledH2, env.port)
        attackers.append(a)
        await asyncio.to_thread(a.wait, 15.0)
        assert a.closed and a.status == 0
        a.close()  # (TLS: the server's close waits for our close_notify or EOF)
        await async_wait_until(lambda: not env.conns(), what="the stalled connection gone")
    finally:
        await env.svc.stop()


async def test_header_block_without_end_headers_is_closed(
        tmp_path: Path, auth: LocalAuthority, attackers: list[StalledH2]) -> None:
    env = await start(tmp_path, auth, doh_request_timeout=0.5, dns_tcp_idle_timeout=60.0)
    try:
        a = await asyncio.to_thread(lambda: StalledH2(env.port, open_block=True))
        attackers.append(a)
        await asyncio.to_thread(a.wait, 15.0)
        assert a.closed
        assert env.stats.snapshot()["errors"].get("request_timeout", 0) == 1
        a.close()  # (TLS: the server's close waits for our close_notify or EOF)
        await async_wait_until(lambda: not env.conns(), what="the stalled connection gone")
    finally:
        await env.svc.stop()


def _dribble(port: int, first: bytes, data: bytes, stop: threading.Event) -> tuple[bytes, bool]:
    """Send `first` at once, then `data` a byte every 0.1 s (each byte would reset an idle timer),
    until the server closes; what it sent, and whether it closed."""
    sock = attacker_socket(port, ["http/1.1"])
    got = b""
    try:
        if first:
            sock.sendall(first)
        sock.settimeout(0.1)
        for i in range(len(data)):
            if stop.is_set():
                break
            try:
                sock.sendall(data[i : i + 1])
                chunk = sock.recv(65536)
                if not chunk:
                    return got, True
                got += chunk
            except TimeoutError:
                continue
            except (ConnectionError, ssl.SSLError, OSError):
                return got, True
        rest, closed = _read_all(sock, 2.0)
        return got + rest, closed
    finally:
        sock.close()


@pytest.mark.parametrize("case", ["head", "body"])
async def test_http11_slow_request_gets_408_then_close(tmp_path: Path, auth: LocalAuthority,
                                                       case: str) -> None:
    env = await start(tmp_path, auth, doh_request_timeout=0.5, dns_tcp_idle_timeout=1.0)
    wire = query("www.example.test")
    head = (f"POST /dns-query HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/dns-message\r\n"
            f"content-length: {len(wire)}\r\n\r\n").encode()
    stop = threading.Event()
    try:
        # "head": a byte every 0.1 s, the head would take ~12 s and the idle timer never fires;
        # "body": the head at once, then the body a byte at a time (it never completes in time).
        data = head + wire if case == "head" else wire * 4
        got, closed = await asyncio.wait_for(asyncio.to_thread(
            _dribble, env.port, head if case == "body" else b"", data, stop), 30)
        assert closed and got.startswith(b"HTTP/1.1 408 "), got[:80]
        assert b"connection: close" in got.lower()
        assert env.stats.snapshot()["errors"].get("request_timeout", 0) == 1
        # And someone else is answered on the same listener.
        q = dns.message.make_query("www.example.test", "A")
        r = await asyncio.to_thread(dns.query.https, q, f"https://127.0.0.1:{env.port}/dns-query",
                                    timeout=10, verify=False)
        assert r.answer
    finally:
        stop.set()
        await env.svc.stop()


async def test_normal_keepalive_clients_unaffected(tmp_path: Path, auth: LocalAuthority) -> None:
    """A request deadline shorter than the pause between requests closes nothing: the deadline
    runs only while a request is partly in."""
    env = await start(tmp_path, auth, doh_request_timeout=0.3, dns_tcp_idle_timeout=30.0)
    try:
        sock = await asyncio.to_thread(attacker_socket, env.port, ["http/1.1"])
        reader = Reader(sock)
        try:
            for i in range(3):
                get = f"GET /dns-query?dns={b64(query('www.example.test', i))} HTTP/1.1\r\nhost: x\r\n\r\n"
                await asyncio.to_thread(sock.sendall, get.encode())
                assert (await asyncio.to_thread(reader.response))[0] == 200
                await asyncio.sleep(0.5)  # the point: a pause longer than the deadline, between requests
        finally:
            sock.close()
        assert env.stats.snapshot()["errors"].get("request_timeout", 0) == 0
    finally:
        await env.svc.stop()
