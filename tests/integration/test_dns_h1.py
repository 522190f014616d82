"""DoH and ODoH over HTTP/1.1 on the DoH/ODoH listeners (issue 16 item 1), in process over real TLS
on loopback, with real clients: curl --http1.1 (and --http2 on the same port), Python's
http.client with keep-alive, raw TLS sockets for pipelining and bad input, an h2 client without
ALPN (prior knowledge). Blocking clients run in threads so the listener's loop keeps serving."""

from __future__ import annotations

import asyncio
import base64
import http.client
import logging
import socket
import ssl
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import dns.message
import dns.rcode
import h2.config
import h2.connection
import h2.events
import pytest

from meshgate.config import from_dict
from meshgate.dns import odoh, service
from meshgate.dns.h1server import H1ServerProtocol
from meshgate.dns.h2server import H2ServerProtocol
from meshgate.dns.odoh_server import OdohListener, build_listener
from meshgate.dns.resolver import Pipeline
from meshgate.metrics import REGISTRY
from meshgate.tls import ensure_self_signed
from tests.helpers import async_wait_until, free_port, require_tool
from tests.integration.test_dns_upstream import LocalAuthority

CT = "application/dns-message"


class Env:
    def __init__(self, svc: service.DnsService, auth: LocalAuthority, cert: Path) -> None:
        self.svc = svc
        self.auth = auth
        self.cert = cert
        url = svc.urls[0]
        self.url = url
        self.port = int(url.split("://")[1].split("/")[0].rsplit(":", 1)[1])

    @property
    def stats(self) -> Any:
        return self.svc.stats[self.url]

    def conns(self) -> set[Any]:
        return set(self.svc.listeners[0].conns)


async def start(tmp_path: Path, auth: LocalAuthority, **limits: Any) -> Env:
    cfg = from_dict({
        "node": {"name": "alpha", "ipv4": "10.144.144.1/24", "state_dir": str(tmp_path / "state")},
        "dns": {"upstreams": [auth.url], "records": {"static.example.test.": "10.1.2.9"},
                "listener": [{"protocol": "doh", "listen": "127.0.0.1:0"}]},
        "limits": {"dns_timeout": 60.0, **limits},
    })
    svc = service.DnsService(cfg, service.Pipeline(cfg))
    await svc.start()
    return Env(svc, auth, tmp_path / "state" / "dns-selfsigned.crt")


@pytest.fixture
async def auth() -> AsyncIterator[LocalAuthority]:
    a = await LocalAuthority().start()
    yield a
    a.release.set()
    await a.stop()


@pytest.fixture
async def env(tmp_path: Path, auth: LocalAuthority) -> AsyncIterator[Env]:
    e = await start(tmp_path, auth)
    yield e
    await e.svc.stop()


def query(name: str, qid: int = 0, rdtype: str = "A") -> bytes:
    q = dns.message.make_query(name, rdtype)
    q.id = qid
    return q.to_wire()


def b64(wire: bytes) -> str:
    return base64.urlsafe_b64encode(wire).rstrip(b"=").decode()


def tls_ctx(alpn: list[str] | None) -> ssl.SSLContext:
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    if alpn is not None:
        ctx.set_alpn_protocols(alpn)
    return ctx


def tls_socket(port: int, alpn: list[str] | None = ["http/1.1"]) -> ssl.SSLSocket:  # noqa: B006
    raw = socket.create_connection(("127.0.0.1", port), timeout=10)
    return tls_ctx(alpn).wrap_socket(raw, server_hostname="localhost")


class Reader:
    """HTTP/1.1 responses off a socket, one after another (pipelined answers share reads)."""

    def __init__(self, sock: ssl.SSLSocket) -> None:
        self.sock = sock
        self.buf = b""

    def _more(self) -> bool:
        data = self.sock.recv(65536)
        self.buf += data
        return bool(data)

    def response(self) -> tuple[int, dict[str, str], bytes]:
        while b"\r\n\r\n" not in self.buf:
            if not self._more():
                raise EOFError(f"closed before a response head: {self.buf!r}")
        head, self.buf = self.buf.split(b"\r\n\r\n", 1)
        lines = head.decode("latin-1").split("\r\n")
        version, status, _ = lines[0].split(" ", 2)
        assert version == "HTTP/1.1", lines[0]
        headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
        n = int(headers["content-length"])
        while len(self.buf) < n:
            if not self._more():
                raise EOFError("closed inside a body")
        body, self.buf = self.buf[:n], self.buf[n:]
        return int(status), headers, body

    def closed(self) -> bool:
        """The server closed the connection (nothing more to read)."""
        try:
            return not self.buf and not self._more()
        except (ConnectionError, ssl.SSLError):
            return True


def a_records(body: bytes) -> list[str]:
    msg = dns.message.from_wire(body)
    return sorted(rr.to_text() for rrset in msg.answer for rr in rrset)


async def run(*argv: str, timeout: float = 30.0) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.STDOUT)
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        proc.kill()
        raise
    assert proc.returncode is not None
    return proc.returncode, out.decode(errors="replace")


# --------------------------------------------------------------------------- curl


async def test_curl_http11_get_and_post(env: Env, tmp_path: Path) -> None:
    curl = require_tool("curl")
    get_body, post_body, qfile = tmp_path / "get.bin", tmp_path / "post.bin", tmp_path / "q.bin"
    hdrs = tmp_path / "headers.txt"
    qfile.write_bytes(query("five.example.test", 7))
    w = "%{http_code} %{http_version} %{content_type} %{num_connects}\n"
    common = ["-sS", "--http1.1", "--cacert", str(env.cert), "-w", w,
              "--resolve", f"localhost:{env.port}:127.0.0.1"]
    url = f"https://localhost:{env.port}/dns-query"
    # --next: the second transfer has its own options (a POST) but reuses the first's connection.
    rc, out = await run(curl, *common, "-D", str(hdrs), "-o", str(get_body),
                        f"{url}?dns={b64(query('www.example.test', 5))}", "--next",
                        *common, "-o", str(post_body), "-H", f"content-type: {CT}",
                        "--data-binary", f"@{qfile}", url)
    assert rc == 0, out
    # Both over HTTP/1.1, on one connection (the second transfer made no new connect).
    assert out.splitlines() == [f"200 1.1 {CT} 1", f"200 1.1 {CT} 0"], out
    assert a_records(get_body.read_bytes()) == ["192.0.2.1"]
    assert dns.message.from_wire(get_body.read_bytes()).id == 5
    five = dns.message.from_wire(post_body.read_bytes())
    assert five.id == 7 and a_records(post_body.read_bytes()) == [f"192.0.2.{i}" for i in range(1, 6)]
    text = hdrs.read_text().lower()
    assert "cache-control: max-age=300" in text and text.startswith("http/1.1 200 ok")
    # The same listener still speaks HTTP/2 to a client that offers it.
    rc, out = await run(curl, "-sSk", "--http2", "-o", "/dev/null", "-w", "%{http_code} %{http_version}",
                        f"https://127.0.0.1:{env.port}/dns-query?dns={b64(query('www.example.test'))}")
    assert (rc, out) == (0, "200 2"), out
    rc, out = await run(curl, "-sSk", "--http1.1", "-o", "/dev/null", "-w", "%{http_code}", "-X", "PUT",
                        f"https://127.0.0.1:{env.port}/dns-query")
    assert (rc, out) == (0, "405"), out


# --------------------------------------------------------------------------- http.client keep-alive


def _http_client_session(port: int, n: int) -> tuple[list[tuple[int, str, list[str]]], int]:
    conn = http.client.HTTPSConnection("127.0.0.1", port, context=tls_ctx(None), timeout=10)
    out = []
    socks = set()
    try:
        for i in range(n):
            wire = query("www.example.test" if i % 2 else "static.example.test", i)
            if i % 2:
                conn.request("POST", "/dns-query", body=wire, headers={"content-type": CT, "accept": CT})
            else:
                conn.request("GET", f"/dns-query?dns={b64(wire)}", headers={"accept": CT})
            resp = conn.getresponse()
            body = resp.read()
            assert dns.message.from_wire(body).id == i
            out.append((resp.status, resp.getheader("cache-control") or "", a_records(body)))
            socks.add(id(conn.sock))
    finally:
        conn.close()
    return out, len(socks)


async def test_http_client_keepalive(env: Env) -> None:
    # The general path's pooled buffers are what this watches: repeats would come from the fast
    # path's preformed answers (limits.dns_fast_path), which are bytes, not pooled buffers.
    for lst in env.svc.listeners:
        if getattr(lst, "app", None) is not None:
            lst.app.fast = None  # type: ignore[attr-defined]
    reused = REGISTRY.counter("meshgate_buffer_reused_total", "").value
    results, socks = await asyncio.to_thread(_http_client_session, env.port, 8)
    assert socks == 1  # every request on the one connection
    for i, (status, cc, recs) in enumerate(results):
        assert status == 200
        assert recs == (["192.0.2.1"] if i % 2 else ["10.1.2.9"])
        assert cc.startswith("max-age=")
    # The answers' pooled buffers went back to the pool once written (and came out again).
    assert REGISTRY.counter("meshgate_buffer_reused_total", "").value >= reused + 6
    assert len(env.svc.pipeline.pool) >= 1


# --------------------------------------------------------------------------- pipelining


def _send(sock: ssl.SSLSocket, data: bytes) -> None:
    sock.sendall(data)


def _get(name: str, qid: int) -> bytes:
    return f"GET /dns-query?dns={b64(query(name, qid))} HTTP/1.1\r\nHost: localhost\r\n\r\n".encode()


async def test_pipelined_answers_in_request_order(tmp_path: Path, auth: LocalAuthority) -> None:
    """A held first answer (slow1) holds back the ready ones behind it; at most doh_max_streams
    requests are taken off one connection at a time (the rest wait unread)."""
    env = await start(tmp_path, auth, doh_max_streams=4)
    sock = await asyncio.to_thread(tls_socket, env.port)
    try:
        names = ["slow1.example.test"] + [f"nx{i}.example.test" for i in range(1, 12)]
        await asyncio.to_thread(_send, sock, b"".join(_get(n, i) for i, n in enumerate(names)))
        # slow1 and the three after it went upstream (their upstream queries race each other, so
        # wait for all four); the fifth request is not read while four are in flight.
        await async_wait_until(
            lambda: all(auth.queries[f"nx{i}.example.test."] for i in (1, 2, 3))
            and auth.queries["slow1.example.test."] == 1,
            what="the first four requests in flight")
        assert not any(auth.queries[f"nx{i}.example.test."] for i in range(4, 12))
        auth.release.set()
        reader = Reader(sock)
        got = []
        for _ in names:
            status, _headers, body = await asyncio.to_thread(reader.response)
            assert status == 200
            got.append(dns.message.from_wire(body).id)
        assert got == list(range(len(names)))
        assert all(auth.queries[f"nx{i}.example.test."] == 1 for i in range(1, 12))
    finally:
        sock.close()
        await env.svc.stop()


# --------------------------------------------------------------------------- bad input

HOST = b"Host: localhost\r\n"
GOOD = b64(query("www.example.test"))

BAD = {
    "oversized header": (b"GET /dns-query?dns=" + GOOD.encode() + b" HTTP/1.1\r\n" + HOST
                         + b"x-big: " + b"a" * 20000 + b"\r\n\r\n", 431, True, "h1_header_too_large"),
    "garbage request line": (b"\x16\x03\x01 garbage\r\n\r\n", 400, True, "h1_malformed"),
    "bad header line": (b"GET /dns-query HTTP/1.1\r\n" + HOST + b"no colon here\r\n\r\n", 400, True,
                        "h1_malformed"),
    "no host": (b"GET /dns-query?dns=" + GOOD.encode() + b" HTTP/1.1\r\n\r\n", 400, True, "h1_malformed"),
    "HTTP/3.0": (b"GET /dns-query HTTP/3.0\r\n" + HOST + b"\r\n", 505, True, "h1_version"),
    "post without content-length": (b"POST /dns-query HTTP/1.1\r\n" + HOST + b"content-type: " + CT.encode()
                                    + b"\r\n\r\n", 411, True, "h1_length_required"),
    "chunked": (b"POST /dns-query HTTP/1.1\r\n" + HOST + b"content-type: " + CT.encode()
                + b"\r\ntransfer-encoding: chunked\r\n\r\n5\r\nabcde\r\n0\r\n\r\n", 501, True,
                "h1_transfer_encoding"),
    "body over 65535": (b"POST /dns-query HTTP/1.1\r\n" + HOST + b"content-type: " + CT.encode()
                        + b"\r\ncontent-length: 65536\r\n\r\n", 413, True, "too_large"),
    # The DoH application's own answers: the connection stays usable.
    "bad method": (b"DELETE /dns-query HTTP/1.1\r\n" + HOST + b"\r\n", 405, False, "http_405"),
    "wrong content-type": (b"POST /dns-query HTTP/1.1\r\n" + HOST + b"content-type: text/plain\r\n"
                           b"content-length: 1\r\n\r\nx", 415, False, "http_415"),
    "padded base64": (b"GET /dns-query?dns=" + GOOD.encode() + b"== HTTP/1.1\r\n" + HOST + b"\r\n", 400,
                      False, "http_400_base64"),
    "other path": (b"GET /elsewhere HTTP/1.1\r\n" + HOST + b"\r\n", 404, False, "http_404"),
}


def _exchange(port: int, data: bytes, close: bool) -> tuple[int, dict[str, str], bool, int | None]:
    sock = tls_socket(port)
    try:
        sock.sendall(data)
        reader = Reader(sock)
        status, headers, _ = reader.response()
        if close:
            return status, headers, reader.closed(), None
        # Still keep-alive: a good request on the same connection is answered.
        sock.sendall(_get("www.example.test", 9))
        st2, _, body = reader.response()
        return status, headers, False, st2 if dns.message.from_wire(body).id == 9 else None
    finally:
        sock.close()


@pytest.mark.parametrize("case", list(BAD))
async def test_bad_input(env: Env, case: str, caplog: pytest.LogCaptureFixture) -> None:
    data, status, closes, reason = BAD[case]
    before = env.stats.snapshot()["errors"].get(reason, 0)
    with caplog.at_level(logging.DEBUG, logger="meshgate.dns.h1"):
        got, headers, closed, after = await asyncio.to_thread(_exchange, env.port, data, closes)
    assert got == status, case
    assert env.stats.snapshot()["errors"].get(reason, 0) == before + 1
    if closes:
        assert closed and headers.get("connection") == "close"
        # One debug line naming the peer, no traceback.
        lines = [r.getMessage() for r in caplog.records if r.name == "meshgate.dns.h1"]
        assert len(lines) == 1 and "127.0.0.1" in lines[0], lines
        assert not any(r.exc_info for r in caplog.records)
    else:
        assert after == 200
    if status == 405:
        assert headers["allow"] == "GET, POST"


# --------------------------------------------------------------------------- connections


async def test_idle_timeout_and_connection_cap(tmp_path: Path, auth: LocalAuthority) -> None:
    env = await start(tmp_path, auth, dns_tcp_idle_timeout=0.5, dns_tcp_max_clients=1)
    try:
        first = await asyncio.to_thread(tls_socket, env.port)
        reader = Reader(first)
        await asyncio.to_thread(first.sendall, _get("static.example.test", 1))
        assert (await asyncio.to_thread(reader.response))[0] == 200
        assert {type(c) for c in env.conns()} == {H1ServerProtocol}
        # The cap: a second connection while the first is open is refused at once.
        drops = env.stats.snapshot()["drops"].get("max_clients", 0)

        def second() -> bool:
            try:
                s = tls_socket(env.port)
            except (ConnectionError, ssl.SSLError, OSError):
                return True
            try:
                s.sendall(_get("static.example.test", 2))
                return Reader(s).closed()
            finally:
                s.close()

        assert await asyncio.to_thread(second)
        assert env.stats.snapshot()["drops"].get("max_clients", 0) == drops + 1
        # Idle: the first is closed after dns_tcp_idle_timeout with nothing in flight.
        t0 = time.monotonic()
        assert await asyncio.to_thread(reader.closed)
        assert 0.3 < time.monotonic() - t0 < 5
        first.close()  # (TLS: the server's close waits for our close_notify or EOF)
        await async_wait_until(lambda: not env.conns(), what="the idle connection gone")
    finally:
        await env.svc.stop()


def _h2_prior_knowledge(port: int) -> tuple[int, bytes]:
    """An HTTP/2 client on TLS without ALPN (h2 with prior knowledge)."""
    sock = tls_socket(port, alpn=None)
    assert sock.selected_alpn_protocol() is None
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
    conn.initiate_connection()
    sid = conn.get_next_available_stream_id()
    conn.send_headers(sid, [(":method", "GET"), (":path", f"/dns-query?dns={GOOD}"), (":scheme", "https"),
                            (":authority", "localhost")], end_stream=True)
    sock.sendall(conn.data_to_send())
    status, body = 0, b""
    try:
        while True:
            data = sock.recv(65536)
            if not data:
                raise EOFError("closed")
            for ev in conn.receive_data(data):
                if isinstance(ev, h2.events.ResponseReceived):
                    status = int(dict(ev.headers)[":status"])
                elif isinstance(ev, h2.events.DataReceived):
                    body += ev.data
                    conn.acknowledge_received_data(ev.flow_controlled_length, sid)
                elif isinstance(ev, h2.events.StreamEnded):
                    return status, body
            sock.sendall(conn.data_to_send())
    finally:
        sock.close()


async def test_h2_with_and_without_alpn(env: Env) -> None:
    status, body = await asyncio.to_thread(_h2_prior_knowledge, env.port)
    assert status == 200 and a_records(body) == ["192.0.2.1"]
    sock = await asyncio.to_thread(tls_socket, env.port, ["h2", "http/1.1"])
    try:
        assert sock.selected_alpn_protocol() == "h2"
        await async_wait_until(lambda: any(type(c) is H2ServerProtocol for c in env.conns()),
                               what="the h2 connection counted")
    finally:
        sock.close()


# --------------------------------------------------------------------------- ODoH over HTTP/1.1


async def _odoh(tmp: Path, **listener: Any) -> OdohListener:
    cert, key = ensure_self_signed(tmp / "pki")
    lst = {"protocol": "odoh", "listen": f"127.0.0.1:{free_port()}", "cert": str(cert), "key": str(key),
           **listener}
    cfg = from_dict({"node": {"state_dir": str(tmp)},
                     "dns": {"records": {"pooled.example.": "10.0.0.9"}, "listener": [lst]}})
    return await build_listener(cfg, cfg.dns.listeners[0], Pipeline(cfg, upstreams=[]))


def _odoh_session(port: int) -> list[Any]:
    conn = http.client.HTTPSConnection("127.0.0.1", port, context=tls_ctx(["http/1.1"]), timeout=10)
    out: list[Any] = []
    try:
        conn.request("GET", odoh.CONFIGS_PATH)
        resp = conn.getresponse()
        configs = resp.read()
        out.append(resp.status)
        cfg = odoh.decode_configs(configs)[0]
        for _ in range(3):
            q = dns.message.make_query("pooled.example", "A", use_edns=0)
            wire, ctx = odoh.seal_query(cfg, q.to_wire())
            conn.request("POST", "/dns-query", body=wire, headers={"content-type": odoh.MEDIA_TYPE})
            resp = conn.getresponse()
            body = resp.read()
            assert resp.status == 200, (resp.status, body)
            out.append(a_records(ctx.open_response(body)))
        dead = free_port()
        conn.request("POST", f"/dns-query?targethost=127.0.0.1:{dead}&targetpath=/q", body=wire,
                     headers={"content-type": odoh.MEDIA_TYPE})
        resp = conn.getresponse()
        resp.read()
        out.append((resp.status, resp.getheader("proxy-status") or ""))
    finally:
        conn.close()
    return out


async def test_odoh_target_and_proxy_over_http11(tmp_path: Path) -> None:
    listener = await _odoh(tmp_path, mode="dual", allow_ip_targets=True)
    try:
        out = await asyncio.to_thread(_odoh_session, listener.port)
        assert out[0] == 200
        assert out[1:4] == [["10.0.0.9"]] * 3
        status, proxy_status = out[4]
        # The proxy role answered (over HTTP/1.1): the dead target is a 502 with Proxy-Status.
        assert status == 502 and proxy_status.startswith("meshgate")
        assert {type(c) for c in listener.conns} <= {H1ServerProtocol}
    finally:
        await listener.close()
