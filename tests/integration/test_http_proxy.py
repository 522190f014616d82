"""The HTTP proxy (gateway/http_proxy.py) on real loopback sockets, driven by curl and raw bytes:
plain forwarding, CONNECT tunnels, Basic auth, reply codes, the PAC file, bad input; and
through a three-node in-process mesh (A — B — C), the same destinations SOCKS5 reaches."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import tempfile
from collections.abc import AsyncIterator
from typing import Any

import pytest

from meshgate.config import (
    AdminConfig,
    Config,
    HostPort,
    HttpProxyConfig,
    LimitsConfig,
    NodeConfig,
    Socks5Config,
    User,
    from_dict,
)
from meshgate.gateway import http_proxy
from meshgate.gateway.http_proxy import HttpProxyService
from meshgate.node import Node
from tests.helpers import Metric, async_wait_until, both_loops, free_port, require_tool

# pytest-asyncio 1.x prefers a conftest hook for loop factories; a module-local
# policy fixture keeps this choice inside this file (as in test_socks5_server.py).
pytestmark = pytest.mark.filterwarnings("ignore:Overriding the \"event_loop_policy\" fixture")


event_loop_policy = both_loops  # every test here on both loops




class Origin:
    """A loopback HTTP/1.1 server that answers every request with what it received."""

    def __init__(self, port: int = 0) -> None:
        self.heads: list[bytes] = []
        self.server: asyncio.Server | None = None
        self.port = port

    async def __aenter__(self) -> Origin:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()

    async def _handle(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            head = await r.readuntil(b"\r\n\r\n")
            self.heads.append(head)
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            body = await r.readexactly(length) if length else b""
            out = b"origin saw " + head.split(b"\r\n")[0] + b" body=" + body
            w.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(out), out))
            await w.drain()
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        finally:
            w.close()


async def curl(*args: str, timeout: float = 20) -> tuple[str, str, str]:
    """Run curl; returns (status of the last response, status of a CONNECT, body)."""
    exe = require_tool("curl")
    proc = await asyncio.create_subprocess_exec(
        exe, "-sS", "--max-time", str(timeout), "-w", "\n%{http_code} %{http_connect}", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), timeout + 5)
    body, _, codes = out.decode(errors="replace").rpartition("\n")
    code, connect = codes.split()
    return code, connect, body


@contextlib.asynccontextmanager
async def proxy(users: tuple[tuple[str, str], ...] = (), resolver: Any = None, max_clients: int = 1024,
                **limits: Any) -> AsyncIterator[HttpProxyService]:
    state = tempfile.TemporaryDirectory()  # not the default: other nodes may run on this host
    cfg = Config(
        node=NodeConfig(state_dir=state.name),
        socks5=Socks5Config(enable=False, users=tuple(User(n, p) for n, p in users), max_clients=max_clients),
        http_proxy=HttpProxyConfig(enable=True, listen=HostPort("127.0.0.1", 0)),
        admin=AdminConfig(enable=False),
        limits=LimitsConfig(**limits),
    )
    node = Node(cfg)
    node.resolver = resolver
    await node.start()
    try:
        svc = next(s for s in node.services if s.name == "http_proxy")
        assert isinstance(svc, HttpProxyService)
        yield svc
    finally:
        await node.stop()
        state.cleanup()


def url(svc: HttpProxyService) -> str:
    addr = svc.address
    assert addr is not None
    return f"http://{addr}"


async def raw(svc: HttpProxyService, data: bytes, timeout: float = 10) -> bytes:
    """Send `data`, return everything the proxy answers until it closes."""
    addr = svc.address
    assert addr is not None
    r, w = await asyncio.open_connection(addr.host, addr.port)
    try:
        w.write(data)
        await w.drain()
        return await asyncio.wait_for(r.read(), timeout)
    finally:
        w.close()


# --------------------------------------------------------------------------- one node


async def test_plain_get_is_rewritten_to_origin_form_without_hop_by_hop_headers() -> None:
    async with Origin() as origin, proxy() as svc:
        forwarded = Metric("meshgate_http_proxy_requests_total", "forward", "200")
        code, _, body = await curl("-x", url(svc), "-H", "X-Drop: 1", "-H", "Connection: X-Drop",
                                   "-H", "X-Keep: yes", f"http://127.0.0.1:{origin.port}/path?q=1")
        assert code == "200"
        assert body == "origin saw GET /path?q=1 HTTP/1.1 body="
        head = origin.heads[0].decode().lower()
        assert f"host: 127.0.0.1:{origin.port}\r\n" in head
        assert "x-keep: yes" in head and "connection: close\r\n" in head
        assert "proxy-connection" not in head and "x-drop" not in head
        assert forwarded.delta == 1
        # a body behind the head goes through too
        code, _, body = await curl("-x", url(svc), "--data-binary", "hello=1",
                                   f"http://127.0.0.1:{origin.port}/post")
        assert code == "200" and body == "origin saw POST /post HTTP/1.1 body=hello=1"


async def test_connect_tunnel_reaches_the_origin() -> None:
    async with Origin() as origin, proxy() as svc:
        connects = Metric("meshgate_http_proxy_requests_total", "connect", "200")
        code, connect, body = await curl("-p", "-x", url(svc), f"http://127.0.0.1:{origin.port}/tunnelled")
        assert (code, connect) == ("200", "200")
        assert body == "origin saw GET /tunnelled HTTP/1.1 body="
        assert connects.delta == 1


async def test_basic_auth_against_socks5_users() -> None:
    async with Origin() as origin, proxy(users=(("alice", "s3cret-pw"),)) as svc:
        failures = Metric("meshgate_http_proxy_auth_failures_total")
        target = f"http://127.0.0.1:{origin.port}/"
        assert (await curl("-x", url(svc), target))[0] == "407"
        assert (await curl("-p", "-x", url(svc), target))[1] == "407"
        assert (await curl("-x", url(svc), "--proxy-user", "alice:wrong", target))[0] == "407"
        assert (await curl("-x", url(svc), "--proxy-user", "bob:s3cret-pw", target))[0] == "407"
        assert failures.delta == 4
        assert origin.heads == []
        out = await raw(svc, f"GET {target} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        assert out.startswith(b"HTTP/1.1 407 ")
        assert b'\r\nProxy-Authenticate: Basic realm="meshgate"\r\n' in out
        code, _, _ = await curl("-x", url(svc), "--proxy-user", "alice:s3cret-pw", target)
        assert code == "200"
        code, connect, _ = await curl("-p", "-x", url(svc), "--proxy-user", "alice:s3cret-pw", target)
        assert (code, connect) == ("200", "200")
        # the credentials never reach the origin
        assert all(b"proxy-authorization" not in h.lower() for h in origin.heads)


async def test_refused_port_is_502_and_a_slow_destination_504() -> None:
    class Resolver:
        async def resolve_host(self, name: str) -> list[str]:
            if name == "slow.test":
                await asyncio.sleep(30)
            raise OSError(f"no such name {name}")

    async with Origin() as origin:
        dead = origin.port  # closed on leaving the block
    async with proxy(resolver=Resolver(), socks5_connect_timeout=0.5) as svc:
        assert (await curl("-x", url(svc), f"http://127.0.0.1:{dead}/"))[0] == "502"
        assert (await curl("-p", "-x", url(svc), f"http://127.0.0.1:{dead}/"))[1] == "502"
        assert (await curl("-x", url(svc), "http://nxdomain.test/"))[0] == "502"
        assert (await curl("-x", url(svc), "http://slow.test/"))[0] == "504"
        assert (await curl("-p", "-x", url(svc), "http://slow.test/"))[1] == "504"


async def test_pac_file_is_served_from_the_proxy_itself() -> None:
    async with proxy() as svc:
        pac = Metric("meshgate_http_proxy_requests_total", "pac", "200")
        addr = svc.address
        out = await raw(svc, b"GET /proxy.pac HTTP/1.1\r\nHost: x\r\n\r\n")
        head, _, body = out.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 ")
        assert b"\r\nContent-Type: application/x-ns-proxy-autoconfig" in head
        text = body.decode()
        assert "function FindProxyForURL(url, host)" in text
        assert f'var mesh = "PROXY {addr}";' in text
        assert 'dnsDomainIs(host, ".mesh.internal")' in text  # no mesh: only the zone is proxied
        assert "isInNet" not in text and text.rstrip().endswith('return "DIRECT";\n}'.rstrip())
        assert pac.delta == 1
        assert (await raw(svc, b"GET /other HTTP/1.1\r\n\r\n")).startswith(b"HTTP/1.1 404 ")


@pytest.mark.parametrize(
    "data,status,kind",
    [
        (b"GET http://x/ HTTP/1.1\r\nX: " + b"a" * 20000 + b"\r\n\r\n", 431, "header_too_large"),
        (b"GET http://x/ HTTP/1.1\r\n" + b"X: a\r\n" * 200 + b"\r\n", 431, "header_too_large"),
        (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03 garbage\r\n\r\n", 400, "bad_request_line"),
        (b"CONNECT nohost HTTP/1.1\r\n\r\n", 400, "bad_target"),
        (b"CONNECT 127.0.0.1:0 HTTP/1.1\r\n\r\n", 400, "bad_target"),
        (b"CONNECT bad_host!:443 HTTP/1.1\r\n\r\n", 400, "bad_target"),
        (b"GET ftp://x/ HTTP/1.1\r\n\r\n", 400, "bad_target"),
        (b"GET http://x/ HTTP/1.1\r\n folded\r\n\r\n", 400, "bad_header"),
        (b"GET http://x/ HTTP/2.0\r\n\r\n", 505, "bad_version"),
        (b"POST http://x/ HTTP/1.1\r\nContent-Length: 1x\r\n\r\n", 400, "bad_header"),
        (b"POST http://x/ HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n", 400, "bad_header"),
    ],
)
async def test_bad_input_gets_a_status_a_counter_and_a_debug_line(
    data: bytes, status: int, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, "meshgate.gateway.http_proxy")
    http_proxy.rlog._last.clear()  # rate-limited per kind: the previous case may have just logged
    async with Origin() as origin, proxy() as svc:
        bad = Metric("meshgate_http_proxy_bad_requests_total", kind)
        out = await raw(svc, data)
        assert out.startswith(b"HTTP/1.1 %d " % status), out[:80]
        assert bad.delta == 1
        assert any("127.0.0.1:" in r.getMessage() and r.levelno == logging.DEBUG for r in caplog.records)
        assert "Traceback" not in caplog.text
        # and it keeps serving
        assert (await curl("-x", url(svc), f"http://127.0.0.1:{origin.port}/"))[0] == "200"


class KeptAliveOrigin:
    """An origin that keeps every connection open and answers each request on it, ignoring the
    proxy's `Connection: close` (non-compliant, but it exists): records each request line."""

    def __init__(self) -> None:
        self.lines: list[bytes] = []
        self.bodies: list[bytes] = []
        self.server: asyncio.Server | None = None
        self.port = 0

    async def __aenter__(self) -> KeptAliveOrigin:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()

    async def _handle(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            while True:
                head = await r.readuntil(b"\r\n\r\n")
                self.lines.append(head.split(b"\r\n", 1)[0])
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                self.bodies.append(await r.readexactly(length))
                w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                await w.drain()
        w.close()


async def read_response(r: asyncio.StreamReader) -> bytes:
    head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 10)
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    return head + await asyncio.wait_for(r.readexactly(length), 10)


async def test_a_request_behind_a_forwarded_one_never_reaches_that_origin() -> None:
    """One request per upstream connection: what a client sends behind a forwarded request (on
    a connection it reuses, or pipelined) is not relayed to that request's origin, whatever
    host it names; a reused connection is closed, so the client asks again on a new one."""
    async with KeptAliveOrigin() as origin, proxy() as svc:
        addr = svc.address
        assert addr is not None
        nxt = Metric("meshgate_http_proxy_bad_requests_total", "request_after_forward")
        first = b"GET http://127.0.0.1:%d/first HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n" % origin.port
        other = b"GET http://other.example/second HTTP/1.1\r\nHost: other.example\r\n\r\n"
        # reused: the answer did not say close, so a browser sends its next request here
        r, w = await asyncio.open_connection(addr.host, addr.port)
        w.write(first)
        assert (await read_response(r)).endswith(b"\r\n\r\nok")
        w.write(other)
        assert await asyncio.wait_for(r.read(), 10) == b""  # closed, nothing more answered
        w.close()
        # pipelined behind a body: the body goes to the origin, the request behind it does not
        r, w = await asyncio.open_connection(addr.host, addr.port)
        w.write(b"POST http://127.0.0.1:%d/post HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello%s"
                % (origin.port, other))
        assert (await read_response(r)).endswith(b"ok")
        w.close()
        await async_wait_until(lambda: len(origin.bodies) == 2, 10, "the origin to read the body")
        assert origin.lines == [b"GET /first HTTP/1.1", b"POST /post HTTP/1.1"]
        assert origin.bodies == [b"", b"hello"]
        assert nxt.delta == 2


async def test_slowloris_is_cut_at_the_handshake_timeout() -> None:
    async with proxy(socks5_handshake_timeout=0.3) as svc:
        timeouts = Metric("meshgate_http_proxy_timeouts_total", "handshake")
        addr = svc.address
        assert addr is not None
        r, w = await asyncio.open_connection(addr.host, addr.port)
        w.write(b"GET http://x/ HTTP/1.1\r\nX-Slow: ")
        t0 = asyncio.get_running_loop().time()
        assert await asyncio.wait_for(r.read(), 5) == b""  # closed, no answer
        assert asyncio.get_running_loop().time() - t0 < 3
        assert timeouts.delta == 1
        w.close()
        await async_wait_until(lambda: svc.server is not None and not svc.server.clients, 5, "client gone")


async def tunnel(svc: HttpProxyService, target: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A CONNECT tunnel opened with raw bytes; the 200 head is read off."""
    addr = svc.address
    assert addr is not None
    r, w = await asyncio.open_connection(addr.host, addr.port)
    w.write(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
    head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 10)
    assert head.startswith(b"HTTP/1.1 200 "), head
    return r, w


async def test_idle_tunnel_is_closed_and_max_clients_refuses() -> None:
    held = asyncio.Event()

    async def silent(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await r.read()  # says nothing, holds the connection until the other side goes
        held.set()
        w.close()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with proxy(max_clients=1, socks5_idle_timeout=0.3) as svc:
            idle = Metric("meshgate_http_proxy_timeouts_total", "idle")
            refused = Metric("meshgate_http_proxy_clients_refused_total")
            r, w = await tunnel(svc, f"127.0.0.1:{port}")
            # the one slot is taken: a second client is closed at once, counted
            try:
                out = await raw(svc, b"GET /proxy.pac HTTP/1.1\r\n\r\n")
            except ConnectionResetError:  # aborted: a reset may beat the read
                out = b""
            assert out == b""
            assert refused.delta == 1
            t0 = asyncio.get_running_loop().time()
            assert await asyncio.wait_for(r.read(), 5) == b""  # nothing either way: closed
            assert asyncio.get_running_loop().time() - t0 < 3
            assert idle.delta == 1
            await asyncio.wait_for(held.wait(), 5)  # and the destination side with it
            w.close()
    finally:
        server.close()


# --------------------------------------------------------------------------- three nodes

SECRET = "http-proxy-mesh-secret"


def node_cfg(name: str, ipv4: str, **sections: Any) -> Any:
    raw: dict[str, Any] = {
        "node": {"name": name, "network": "hp", "secret": SECRET, "ipv4": ipv4},
        "admin": {"enable": False},
        "socks5": {"enable": False},
    }
    for k, v in sections.items():
        raw.setdefault(k, {}).update(v)
    return from_dict(raw)


SERVED = free_port()  # the port c publishes on its virtual IP ([serve]): the mesh tests' origins


@pytest.fixture
async def line(tmp_path: Any) -> AsyncIterator[dict[str, Node]]:
    """A — B — C; C an exit with 127.0.0.0/24 advertised as 10.2.2.0/24; A sends the internet to
    exits; B has no exit configured. A and B run the HTTP proxy."""
    started: list[Node] = []

    async def start(cfg: Any) -> Node:
        n = Node(cfg)
        await n.start()
        started.append(n)
        return n

    hp = {"enable": True, "listen": "127.0.0.1:0"}
    try:
        b = await start(node_cfg("b", "10.144.1.2/24", node={"state_dir": str(tmp_path / "b")},
                                 mesh={"listen": ["tcp://127.0.0.1:0"]}, http_proxy=hp))
        link = b.mesh.listen_addrs[0] if b.mesh else ""
        c = await start(node_cfg("c", "10.144.1.3/24", node={"state_dir": str(tmp_path / "c")},
                                 serve={str(SERVED): f"127.0.0.1:{SERVED}"},
                                 mesh={"peers": [link], "exit_node": True,
                                       "proxy_cidrs": ["127.0.0.0/24->10.2.2.0/24"]}))
        a = await start(node_cfg("a", "10.144.1.1/24", node={"state_dir": str(tmp_path / "a")},
                                 mesh={"peers": [link], "exit_nodes": ["auto"], "direct_fallback": False},
                                 http_proxy=hp))
        nodes = {"a": a, "b": b, "c": c}
        ids = {n.mesh.node_id for n in nodes.values() if n.mesh}
        await async_wait_until(lambda: all(n.mesh is not None and ids <= set(n.mesh.table.hop_paths)
                                           for n in nodes.values()), 15, "routes to converge")
        yield nodes
    finally:
        for n in reversed(started):
            await n.stop()


def svc_of(node: Node) -> HttpProxyService:
    svc = next(s for s in node.services if s.name == "http_proxy")
    assert isinstance(svc, HttpProxyService)
    return svc


async def test_through_the_mesh_reaches_c(line: dict[str, Node]) -> None:
    a = svc_of(line["a"])
    async with Origin(SERVED) as origin:
        peer = Metric("meshgate_socks5_routed_total", "peer")
        code, _, body = await curl("-x", url(a), f"http://10.144.1.3:{origin.port}/at-c")
        assert (code, body) == ("200", "origin saw GET /at-c HTTP/1.1 body=")
        assert peer.delta == 1  # routed to another node, not this host
        code, connect, body = await curl("-p", "-x", url(a), f"http://c.mesh.internal:{origin.port}/byname")
        assert (code, connect) == ("200", "200") and body.endswith("/byname HTTP/1.1 body=")
        code, _, body = await curl("-x", url(a), f"http://10.2.2.1:{origin.port}/mapped")
        assert code == "200" and "/mapped" in body


async def test_bulk_both_ways_through_a_tunnel_over_the_mesh(line: dict[str, Node]) -> None:
    """4 MiB each way through A's CONNECT tunnel to C (relayed by B), with a half-close: the
    relay's back-pressure and EOF handling are the portal's."""
    payload = hashlib.sha256(b"x").digest() * (4 << 15)  # 4 MiB

    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        h = hashlib.sha256()
        while chunk := await r.read(1 << 16):
            h.update(chunk)
        w.write(h.hexdigest().encode() + payload)
        await w.drain()
        w.close()

    server = await asyncio.start_server(handle, "127.0.0.1", SERVED)
    port = server.sockets[0].getsockname()[1]
    try:
        r, w = await tunnel(svc_of(line["a"]), f"10.144.1.3:{port}")
        w.write(payload)
        await w.drain()
        w.write_eof()
        got = await asyncio.wait_for(r.read(), 60)
        w.close()
        assert got[:64].decode() == hashlib.sha256(payload).hexdigest()
        assert got[64:] == payload
    finally:
        server.close()


async def test_mesh_refusals_map_to_statuses(line: dict[str, Node]) -> None:
    a = svc_of(line["a"])
    async with Origin() as origin:
        unpublished = origin.port
        # a port C does not publish on its virtual IP ([serve]), though something listens (0x02)
        assert (await curl("-x", url(a), f"http://10.144.1.3:{unpublished}/"))[0] == "403"
    dead = SERVED  # published, nothing listening
    # loopback outside C's proxy CIDR: C's exit policy refuses it (0x02)
    assert (await curl("-x", url(a), "http://127.0.1.1/"))[0] == "403"
    assert (await curl("-p", "-x", url(a), "http://127.0.1.1/"))[1] == "403"
    # nobody serves this virtual IP (0x03) and a closed port at C (0x05)
    assert (await curl("-x", url(a), "http://10.144.1.99/"))[0] == "502"
    assert (await curl("-x", url(a), f"http://10.144.1.3:{dead}/"))[0] == "502"


async def test_pac_from_live_routes(line: dict[str, Node]) -> None:
    b = svc_of(line["b"])
    out = await raw(b, b"GET /proxy.pac HTTP/1.1\r\n\r\n")
    text = out.partition(b"\r\n\r\n")[2].decode()
    assert f'var mesh = "PROXY {b.address}";' in text
    assert 'dnsDomainIs(host, ".mesh.internal")' in text
    assert 'isInNet(host, "10.144.1.0", "255.255.255.0")' in text  # the mesh subnet
    assert 'isInNet(host, "10.2.2.0", "255.255.255.0")' in text  # C's proxy CIDR as advertised
    assert "127.0.0.0" not in text  # the real side is C's business
    assert text.rstrip().endswith('return "DIRECT";\n}'.rstrip())
    # A sends the internet to exits: everything through its proxy
    a = svc_of(line["a"])
    text = (await raw(a, b"GET /proxy.pac HTTP/1.0\r\n\r\n")).partition(b"\r\n\r\n")[2].decode()
    assert "return mesh;" in text and "DIRECT" not in text


CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--proxy-bypass-list=<-loopback>",
]


async def test_chromium_loads_a_mesh_page_through_the_pac_file(line: dict[str, Node], tmp_path: Any) -> None:
    """Headless Chromium configured only with B's PAC URL opens a page at C's virtual IP (no
    route on this host: only the proxy reaches it)."""
    chromium = require_tool("chromium")
    b = svc_of(line["b"])
    async with Origin(SERVED) as origin:
        forwarded = Metric("meshgate_http_proxy_requests_total", "forward", "200")
        pac = Metric("meshgate_http_proxy_requests_total", "pac", "200")
        proc = await asyncio.create_subprocess_exec(
            chromium, *CHROMIUM_FLAGS, f"--proxy-pac-url={url(b)}/proxy.pac",
            f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom",
            f"http://10.144.1.3:{origin.port}/through-pac",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(proc.communicate(), 120)
        assert "origin saw GET /through-pac HTTP/1.1" in out.decode(), err.decode()[-2000:]
        assert pac.delta >= 1 and forwarded.delta >= 1
