"""The SOCKS5 portal on real loopback sockets, driven by python-socks and raw RFC 1928 bytes."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import random
import resource
import socket
import struct
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from python_socks import ProxyError
from python_socks.async_.asyncio import Proxy

from meshgate.config import AdminConfig, Config, HostPort, LimitsConfig, NodeConfig, Socks5Config, User
from meshgate.gateway.server import READ_SIZE, ClientProtocol
from meshgate.gateway.service import Socks5Service
from meshgate.metrics import REGISTRY
from meshgate.node import Node
from tests.helpers import (
    Metric,
    UdpEcho,
    async_wait_until,
    both_loops,
    can_bind,
    open_fds,
    require,
)

# pytest-asyncio 1.x prefers a conftest hook for loop factories; a module-local
# policy fixture keeps this choice inside this file.
pytestmark = pytest.mark.filterwarnings("ignore:Overriding the \"event_loop_policy\" fixture")

# --------------------------------------------------------------------------- fixtures


event_loop_policy = both_loops  # every test here on both loops


class Portal:
    def __init__(self, node: Node, svc: Socks5Service) -> None:
        self.node = node
        self.svc = svc
        addr = svc.address
        assert addr is not None
        self.port = addr.port
        self.url = f"socks5://127.0.0.1:{self.port}"

    @property
    def clients(self) -> set[ClientProtocol]:
        assert self.svc.server is not None
        return self.svc.server.clients


@contextlib.asynccontextmanager
async def portal(
    users: tuple[tuple[str, str], ...] = (),
    max_clients: int = 1024,
    udp: bool = True,
    resolver: Any = None,
    listen: str = "127.0.0.1",
    **limits: Any,
) -> AsyncIterator[Portal]:
    cfg = Config(
        socks5=Socks5Config(
            listen=HostPort(listen, 0),
            users=tuple(User(n, p) for n, p in users),
            udp=udp,
            max_clients=max_clients,
        ),
        admin=AdminConfig(enable=False),
        limits=LimitsConfig(**limits),
    )
    node = Node(cfg)
    node.resolver = resolver
    await node.start()
    try:
        svc = next(s for s in node.services if s.name == "socks5")
        assert isinstance(svc, Socks5Service)
        yield Portal(node, svc)
    finally:
        await node.stop()




@contextlib.asynccontextmanager
async def echo_server(host: str = "127.0.0.1") -> AsyncIterator[tuple[int, list[tuple[str, int]]]]:
    peers: list[tuple[str, int]] = []

    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        peers.append(w.get_extra_info("peername")[:2])
        try:
            while data := await r.read(65536):
                w.write(data)
                await w.drain()
        except OSError:
            pass
        finally:
            w.close()

    srv = await asyncio.start_server(handle, host, 0)
    try:
        yield srv.sockets[0].getsockname()[1], peers
    finally:
        srv.close()
        await srv.wait_closed()


def request(cmd: int, atyp: int, addr: bytes, port: int) -> bytes:
    if atyp == 3:
        return bytes((5, cmd, 0, 3, len(addr))) + addr + struct.pack("!H", port)
    return bytes((5, cmd, 0, atyp)) + addr + struct.pack("!H", port)


async def read_reply(r: asyncio.StreamReader) -> tuple[int, int, bytes, int]:
    head = await r.readexactly(4)
    atyp = head[3]
    n = {1: 4, 4: 16}.get(atyp)
    if n is None:
        n = (await r.readexactly(1))[0]
    addr = await r.readexactly(n)
    (port,) = struct.unpack("!H", await r.readexactly(2))
    return head[1], atyp, addr, port


async def raw_socks(
    port: int, req: bytes, greeting: bytes = b"\x05\x01\x00"
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, tuple[int, int, bytes, int]]:
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(greeting + req)
    assert await r.readexactly(2) == b"\x05\x00"
    return r, w, await asyncio.wait_for(read_reply(r), 10)


def has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


# --------------------------------------------------------------------------- CONNECT


async def test_connect_ipv4_with_python_socks_and_bnd_address() -> None:
    async with portal() as p, echo_server() as (eport, peers):
        ok = Metric("meshgate_socks5_requests_total", "connect", "succeeded")
        sock = await Proxy.from_url(p.url).connect("127.0.0.1", eport, timeout=10)
        r, w = await asyncio.open_connection(sock=sock)
        w.write(b"ping")
        assert await r.readexactly(4) == b"ping"
        w.close()
        assert ok.delta == 1
        # The BND fields name the portal's own end of the upstream connection.
        req = request(1, 1, socket.inet_aton("127.0.0.1"), eport)
        r, w, (rep, atyp, addr, bport) = await raw_socks(p.port, req)
        assert (rep, atyp, socket.inet_ntoa(addr)) == (0, 1, "127.0.0.1")
        await async_wait_until(lambda: len(peers) == 2, what="second upstream connection")
        assert peers[1][1] == bport
        w.close()


async def test_connect_ipv6_loopback() -> None:
    require(can_bind("::1"), "IPv6 loopback (::1)")
    async with portal() as p, echo_server("::1") as (eport, peers):
        sock = await Proxy.from_url(p.url).connect("::1", eport, timeout=10)
        r, w = await asyncio.open_connection(sock=sock)
        w.write(b"six")
        assert await r.readexactly(3) == b"six"
        assert peers[0][0] == "::1"
        w.close()


async def test_connect_domain_resolved_by_the_portal() -> None:
    # The echo server listens where localhost resolves first here, so the test
    # holds whichever family the resolver prefers.
    first = socket.getaddrinfo("localhost", 0, type=socket.SOCK_STREAM)[0][4][0]
    async with portal() as p, echo_server(first) as (eport, _):
        # rdns: python-socks sends the name (ATYP 3), the portal resolves it.
        sock = await Proxy.from_url(p.url, rdns=True).connect("localhost", eport, timeout=10)
        r, w = await asyncio.open_connection(sock=sock)
        w.write(b"name")
        assert await r.readexactly(4) == b"name"
        w.close()


async def test_auth_ok_and_denied() -> None:
    async with portal(users=(("alice", "s3cret"),)) as p, echo_server() as (eport, _):
        sock = await Proxy.from_url(f"socks5://alice:s3cret@127.0.0.1:{p.port}").connect(
            "127.0.0.1", eport, timeout=10
        )
        r, w = await asyncio.open_connection(sock=sock)
        w.write(b"hi")
        assert await r.readexactly(2) == b"hi"
        w.close()
        failures = Metric("meshgate_socks5_auth_failures_total")
        with pytest.raises(ProxyError):
            bad = Proxy.from_url(f"socks5://alice:wrong@127.0.0.1:{p.port}")
            await bad.connect("127.0.0.1", eport, timeout=10)
        assert failures.delta == 1
        # Raw: status 0x01 then the connection closes.
        r, w = await asyncio.open_connection("127.0.0.1", p.port)
        w.write(b"\x05\x01\x02\x01\x05alice\x03bad")
        assert await asyncio.wait_for(r.read(), 5) == b"\x05\x02\x01\x01"
        w.close()


async def test_no_acceptable_method_gets_ff_and_close() -> None:
    async with portal() as p:
        r, w = await asyncio.open_connection("127.0.0.1", p.port)
        w.write(b"\x05\x01\x02")  # username/password only; no users configured
        assert await asyncio.wait_for(r.read(), 5) == b"\x05\xff"
        w.close()
    async with portal(users=(("alice", "s3cret"),)) as p:
        r, w = await asyncio.open_connection("127.0.0.1", p.port)
        w.write(b"\x05\x01\x00")  # "no auth" only, but users are configured
        assert await asyncio.wait_for(r.read(), 5) == b"\x05\xff"
        w.close()


@pytest.mark.parametrize(
    ("req", "code"),
    [
        (request(2, 1, b"\x7f\0\0\1", 80), 0x07),  # BIND
        (request(9, 1, b"\x7f\0\0\1", 80), 0x07),  # unknown command
        (b"\x05\x01\x00\x05\x01\x02", 0x08),  # unknown address type
    ],
)
async def test_reply_codes_for_unsupported_requests(req: bytes, code: int) -> None:
    async with portal() as p:
        r, w = await asyncio.open_connection("127.0.0.1", p.port)
        w.write(b"\x05\x01\x00" + req)
        assert await r.readexactly(2) == b"\x05\x00"
        rep, atyp, _, _ = await asyncio.wait_for(read_reply(r), 5)
        assert (rep, atyp) == (code, 1)
        assert await asyncio.wait_for(r.read(), 5) == b""  # then closed
        w.close()


async def test_refused_port_replies_05() -> None:
    with socket.socket() as s:  # a port nobody listens on: bound, never listening
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
        async with portal() as p:
            refused = Metric("meshgate_socks5_requests_total", "connect", "connection_refused")
            _, w, (rep, _, _, _) = await raw_socks(p.port, request(1, 1, b"\x7f\0\0\1", dead))
            assert rep == 0x05 and refused.delta == 1
            w.close()
            with pytest.raises(ProxyError) as ei:
                await Proxy.from_url(p.url).connect("127.0.0.1", dead, timeout=10)
            assert ei.value.error_code == 0x05


async def test_unresolvable_name_04_and_slow_resolver_times_out_06() -> None:
    class Resolver:
        async def resolve_host(self, name: str) -> list[str]:
            if name == "slow.test":
                await asyncio.sleep(30)
            raise OSError(f"no such name {name}")

    async with portal(resolver=Resolver(), socks5_connect_timeout=0.3) as p:
        _, w, (rep, _, _, _) = await raw_socks(p.port, request(1, 3, b"nxdomain.test", 80))
        assert rep == 0x04
        w.close()
        _, w, (rep, _, _, _) = await raw_socks(p.port, request(1, 3, b"slow.test", 80))
        assert rep == 0x06
        w.close()


async def test_name_with_a_silent_first_address_still_connects_happy_eyeballs() -> None:
    """The first address drops SYNs (a full accept queue on 127.0.0.2); the
    second answers. Tried one after the other, the first attempt would use up
    the whole connect timeout; staggered attempts connect through the second."""
    async with echo_server() as (eport, peers):
        silent = socket.socket()
        held: list[socket.socket] = []
        try:
            require(can_bind("127.0.0.2"), "loopback address 127.0.0.2")
            silent.bind(("127.0.0.2", eport))
            silent.listen(0)
            filler = socket.socket()  # fills the one-slot accept queue; later SYNs are dropped
            filler.connect(("127.0.0.2", eport))
            held.append(filler)

            class Resolver:
                async def resolve_host(self, name: str) -> list[str]:
                    return ["127.0.0.2", "127.0.0.1"]

            async with portal(resolver=Resolver(), socks5_connect_timeout=5.0) as p:
                r, w, (rep, _, _, _) = await raw_socks(p.port, request(1, 3, b"two.test", eport))
                assert rep == 0
                w.write(b"he")
                assert await r.readexactly(2) == b"he"
                assert len(peers) == 1
                w.close()
        finally:
            for h in held:
                h.close()
            silent.close()


async def test_junk_gets_a_reply_code_or_a_close_and_the_portal_keeps_serving() -> None:
    rng = random.Random(1928)
    async with portal(socks5_handshake_timeout=2.0) as p, echo_server() as (eport, _):
        bad = Metric("meshgate_socks5_bad_requests_total", "version")
        for _ in range(100):
            junk = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 40)))
            if rng.random() < 0.5:
                junk = b"\x05\x01\x00" + junk
            r, w = await asyncio.open_connection("127.0.0.1", p.port)
            w.write(junk)
            w.write_eof()
            out = await asyncio.wait_for(r.read(), 5)  # closes: never hangs, never a traceback
            assert out == b"" or out[0] == 5
            assert b"Traceback" not in out
            w.close()
        assert bad.delta > 0
        sock = await Proxy.from_url(p.url).connect("127.0.0.1", eport, timeout=10)
        sock.close()


class CountingReadBuffer:
    """Stands in for the server's shared ReadBuffer and counts the reads made into it."""

    def __init__(self, size: int = 256 * 1024) -> None:
        self.size = size
        self._view = memoryview(bytearray(size))
        self.reads = 0
        self.renewed = 0

    @property
    def view(self) -> memoryview:
        self.reads += 1
        return self._view

    def renew(self) -> None:
        self._view = memoryview(bytearray(self.size))
        self.renewed += 1


async def test_relay_reads_into_the_shared_buffer_both_directions() -> None:
    """Both sides of a relay take the buffered read path (uvloop only does so for a
    protocol that is not also an asyncio.Protocol), and the bytes arrive intact."""
    async with portal() as p, echo_server() as (eport, _):
        assert p.svc.server is not None
        counting = CountingReadBuffer()
        p.svc.server.read_buffer = counting  # type: ignore[assignment]
        r, w, (rep, _, _, _) = await raw_socks(p.port, request(1, 1, b"\x7f\0\0\1", eport))
        assert rep == 0
        (client,) = p.clients
        assert client.upstream is not None
        up_proto = client.upstream.get_protocol()
        assert type(up_proto).__name__ == "BufferedUpstream"
        # uvloop's rule for the buffered path: a BufferedProtocol that is not an asyncio.Protocol.
        for proto in (client, up_proto):
            assert isinstance(proto, asyncio.BufferedProtocol) and not isinstance(proto, asyncio.Protocol)
        before = counting.reads
        payload = os.urandom(2 * 1024 * 1024)
        w.write(payload)
        got = await asyncio.wait_for(r.readexactly(len(payload)), 10)
        assert got == payload
        # Every read was a get_buffer + a buffer_updated use of the view: at least one
        # read each way went through the shared buffer.
        assert counting.reads - before >= 4
        w.close()


# --------------------------------------------------------------------------- half-close, backpressure


async def test_half_close_client_to_target() -> None:
    """Client sends, shuts down writing; the target sees EOF and can still answer."""
    got = asyncio.get_running_loop().create_future()

    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        data = await r.read()  # until the client's EOF comes through the portal
        got.set_result(data)
        w.write(b"answer:" + hashlib.sha256(data).digest())
        await w.drain()
        w.close()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    tport = srv.sockets[0].getsockname()[1]
    payload = os.urandom(300_000)
    async with portal() as p:
        r, w, (rep, _, _, _) = await raw_socks(p.port, request(1, 1, b"\x7f\0\0\1", tport))
        assert rep == 0
        w.write(payload)
        w.write_eof()
        assert await asyncio.wait_for(got, 10) == payload
        assert await asyncio.wait_for(r.read(), 10) == b"answer:" + hashlib.sha256(payload).digest()
        w.close()
    srv.close()


async def test_half_close_target_to_client() -> None:
    """The target sends and shuts down writing; the client still sends afterwards."""
    got = asyncio.get_running_loop().create_future()

    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(b"banner")
        w.write_eof()
        got.set_result(await r.read())
        w.close()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    tport = srv.sockets[0].getsockname()[1]
    async with portal() as p:
        r, w, (rep, _, _, _) = await raw_socks(p.port, request(1, 1, b"\x7f\0\0\1", tport))
        assert rep == 0
        assert await asyncio.wait_for(r.read(), 10) == b"banner"  # data then EOF
        w.write(b"late words")
        w.write_eof()
        assert await asyncio.wait_for(got, 10) == b"late words"
        w.close()
    srv.close()


async def test_destination_speaks_first_and_closes_reply_comes_before_its_bytes() -> None:
    """A banner sent (and the connection closed) by the destination right at
    accept must reach the client after the SOCKS reply, never before or lost."""

    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(b"220 banner\r\n")
        w.close()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    tport = srv.sockets[0].getsockname()[1]
    async with portal() as p:
        for _ in range(20):
            r, w, (rep, _, _, _) = await raw_socks(p.port, request(1, 1, b"\x7f\0\0\1", tport))
            assert rep == 0
            assert await asyncio.wait_for(r.read(), 5) == b"220 banner\r\n"
            w.close()
    srv.close()


async def test_backpressure_bounds_portal_buffers_both_ways() -> None:
    hw = 64 * 1024
    total = 64 * 1024 * 1024  # more than every kernel socket buffer on the path can absorb
    target_writer: list[asyncio.StreamWriter] = []
    target_reader: list[asyncio.StreamReader] = []
    sent = asyncio.get_running_loop().create_future()

    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        target_writer.append(w)
        target_reader.append(r)
        chunk = bytes(65536)
        for _ in range(total // len(chunk)):
            w.write(chunk)
            await w.drain()
        sent.set_result(True)

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    tport = srv.sockets[0].getsockname()[1]
    async with portal(socks5_write_high_water=hw) as p:
        r, w, (rep, _, _, _) = await raw_socks(p.port, request(1, 1, b"\x7f\0\0\1", tport))
        assert rep == 0
        (client,) = p.clients
        assert client.transport is not None
        await async_wait_until(lambda: client.upstream is not None, what="upstream")
        up = client.upstream
        assert up is not None
        # Target -> client: the client reads nothing; the portal stops reading the target.
        await async_wait_until(lambda: not up.is_reading(), what="portal pauses reading the target")
        buffered = client.transport.get_write_buffer_size()
        assert 0 < buffered <= hw + READ_SIZE  # one read past the mark at most
        assert not sent.done()  # the target is blocked: memory is bounded, not queued
        # Client -> target: the target reads nothing; the portal stops reading the client.
        w.transport.set_write_buffer_limits(high=1 << 30)  # let the test client queue freely
        w.write(bytes(8 * 1024 * 1024))
        ct = client.transport
        await async_wait_until(lambda: not ct.is_reading(), what="portal pauses reading the client")
        assert up.get_write_buffer_size() <= hw + READ_SIZE
        # Drain both ways: everything arrives, nothing lost.
        received = 0
        while received < total:
            data = await asyncio.wait_for(r.read(1 << 20), 10)
            assert data
            received += len(data)
        await asyncio.wait_for(sent, 10)
        got = 0
        while got < 8 * 1024 * 1024:
            got += len(await asyncio.wait_for(target_reader[0].read(1 << 20), 10))
        assert got == 8 * 1024 * 1024
        w.close()
    for tw in target_writer:
        tw.close()
    srv.close()


# --------------------------------------------------------------------------- timeouts and limits


async def test_handshake_timeout_closes_slow_client() -> None:
    async with portal(socks5_handshake_timeout=0.3) as p:
        timeouts = Metric("meshgate_socks5_timeouts_total", "handshake")
        r, w = await asyncio.open_connection("127.0.0.1", p.port)
        w.write(b"\x05\x01")  # half a greeting, then nothing
        with contextlib.suppress(ConnectionResetError):
            assert await asyncio.wait_for(r.read(), 5) == b""
        assert timeouts.delta == 1
        w.close()
        await async_wait_until(lambda: not p.clients, what="client gone")


async def test_idle_timeout_closes_quiet_relay() -> None:
    async with portal(socks5_idle_timeout=0.2) as p, echo_server() as (eport, _):
        idle = Metric("meshgate_socks5_timeouts_total", "idle")
        r, w, (rep, _, _, _) = await raw_socks(p.port, request(1, 1, b"\x7f\0\0\1", eport))
        assert rep == 0
        w.write(b"x")
        assert await r.readexactly(1) == b"x"
        assert await asyncio.wait_for(r.read(), 5) == b""  # closed after 1-2 idle periods
        assert idle.delta == 1
        w.close()


async def test_reading_stops_while_dialing_only_once_the_client_sends_ahead_of_the_reply() -> None:
    """A client that waits for the reply (most do) is never paused and resumed around the dial
    (each is an epoll_ctl); one that sends early has that read kept and reading stopped until
    the reply, and the bytes reach the destination after it."""
    gate = asyncio.Event()

    class Resolver:
        async def resolve_host(self, name: str) -> list[str]:
            await gate.wait()
            return ["127.0.0.1"]

    async with portal(resolver=Resolver()) as p, echo_server() as (eport, _):
        r, w = await asyncio.open_connection("127.0.0.1", p.port)
        w.write(b"\x05\x01\x00" + request(1, 3, b"gated.test", eport))
        assert await r.readexactly(2) == b"\x05\x00"
        await async_wait_until(lambda: any(c._connect_task is not None for c in p.clients), what="dialing")
        (client,) = p.clients
        assert client.transport is not None
        assert client.transport.is_reading()
        w.write(b"early")
        await async_wait_until(lambda: not client.transport.is_reading(),  # type: ignore[union-attr]
                               what="reading stopped")
        gate.set()
        rep, _, _, _ = await asyncio.wait_for(read_reply(r), 10)
        assert rep == 0
        assert await asyncio.wait_for(r.readexactly(5), 10) == b"early"
        assert client.transport.is_reading()
        w.close()


class TimerCount:
    """Stands in for a client's event loop and counts the timers armed on it."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.armed = 0

    def call_at(self, when: float, callback: Any, *args: Any) -> asyncio.TimerHandle:
        self.armed += 1
        return self._loop.call_at(when, callback, *args)

    def call_later(self, delay: float, callback: Any, *args: Any) -> asyncio.TimerHandle:
        self.armed += 1
        return self._loop.call_later(delay, callback, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loop, name)


async def test_a_short_connection_arms_one_timer_for_all_its_phases(monkeypatch: pytest.MonkeyPatch) -> None:
    """Handshake, dial and relay share one timer handle: a connection that is over before its
    handshake timeout would have fired arms exactly one (it was one per phase)."""
    counts: list[TimerCount] = []
    init = ClientProtocol.__init__

    def counted_init(self: ClientProtocol, server: Any) -> None:
        init(self, server)
        self.loop = TimerCount(self.loop)  # type: ignore[assignment]
        counts.append(self.loop)  # type: ignore[arg-type]

    monkeypatch.setattr(ClientProtocol, "__init__", counted_init)
    async with portal() as p, echo_server() as (eport, _):
        r, w, (rep, _, _, _) = await raw_socks(p.port, request(1, 1, b"\x7f\0\0\1", eport))
        assert rep == 0
        w.write(b"ping")
        assert await r.readexactly(4) == b"ping"
        w.close()
        await async_wait_until(lambda: not p.clients, what="client gone")
    assert [c.armed for c in counts] == [1]


async def test_a_dial_slower_than_the_handshake_timeout_but_within_the_connect_timeout_connects() -> None:
    """The one timer, armed for the handshake, fires while the dial is under way: it is the
    connect timeout that decides, so the connection goes through (no 0x06, no handshake timeout)."""
    class Resolver:
        async def resolve_host(self, name: str) -> list[str]:
            await asyncio.sleep(0.5)  # the name resolves after the handshake timeout
            return ["127.0.0.1"]

    async with portal(resolver=Resolver(), socks5_handshake_timeout=0.2,
                      socks5_connect_timeout=10.0) as p, echo_server() as (eport, _):
        handshake = Metric("meshgate_socks5_timeouts_total", "handshake")
        r, w, (rep, _, _, _) = await raw_socks(p.port, request(1, 3, b"late.test", eport))
        assert rep == 0
        w.write(b"ping")
        assert await r.readexactly(4) == b"ping"
        assert handshake.delta == 0
        w.close()


async def test_max_clients_refuses_beyond_the_limit() -> None:
    async with portal(max_clients=2) as p, echo_server() as (eport, _):
        refused = Metric("meshgate_socks5_clients_refused_total")
        held = [await asyncio.open_connection("127.0.0.1", p.port) for _ in range(2)]
        await async_wait_until(lambda: len(p.clients) == 2, what="two clients")
        r, w = await asyncio.open_connection("127.0.0.1", p.port)
        w.write(b"\x05\x01\x00")
        with contextlib.suppress(ConnectionResetError):
            assert await asyncio.wait_for(r.read(), 5) == b""
        assert refused.delta == 1
        w.close()
        held[0][1].close()
        await async_wait_until(lambda: len(p.clients) == 1, what="a slot frees")
        sock = await Proxy.from_url(p.url).connect("127.0.0.1", eport, timeout=10)
        sock.close()
        held[1][1].close()


async def test_one_source_cannot_hold_every_portal_slot() -> None:
    # one address holding slots with idle connections must not lock out every other client
    require(can_bind("127.0.0.2"), "127.0.0.2 on loopback")
    async with portal(socks5_max_clients_per_source=3) as p, echo_server() as (eport, _):
        refused = Metric("meshgate_socks5_clients_refused_per_source_total")
        held = [await asyncio.open_connection("127.0.0.1", p.port) for _ in range(3)]
        await async_wait_until(lambda: len(p.clients) == 3, what="three clients from 127.0.0.1")
        r, w = await asyncio.open_connection("127.0.0.1", p.port)
        w.write(b"\x05\x01\x00")
        with contextlib.suppress(ConnectionResetError):
            assert await asyncio.wait_for(r.read(), 5) == b""
        w.close()
        assert refused.delta == 1
        # another address is served in full while the first holds its share
        r2, w2 = await asyncio.open_connection("127.0.0.1", p.port, local_addr=("127.0.0.2", 0))
        w2.write(b"\x05\x01\x00")
        assert await asyncio.wait_for(r2.readexactly(2), 5) == b"\x05\x00"
        w2.close()
        # a slot freed at the first address is usable again
        held[0][1].close()
        assert p.svc.server is not None
        srv = p.svc.server
        await async_wait_until(lambda: srv.per_source.get("127.0.0.1") == 2, what="a slot frees")
        sock = await Proxy.from_url(p.url).connect("127.0.0.1", eport, timeout=10)
        sock.close()
        for _, hw in held[1:]:
            hw.close()
        await async_wait_until(lambda: not srv.per_source, what="the table empties")


# --------------------------------------------------------------------------- UDP ASSOCIATE




def udp_header(atyp: int, addr: bytes, port: int, frag: int = 0) -> bytes:
    if atyp == 3:
        return struct.pack("!HBBB", 0, frag, 3, len(addr)) + addr + struct.pack("!H", port)
    return struct.pack("!HBB", 0, frag, atyp) + addr + struct.pack("!H", port)


async def udp_exchange(client: socket.socket, relay: tuple[str, int], datagram: bytes) -> bytes:
    loop = asyncio.get_running_loop()
    client.sendto(datagram, relay)
    return await asyncio.wait_for(loop.sock_recv(client, 65536), 5)


async def test_udp_associate_exchange_frag_precedence_and_close() -> None:
    info = socket.getaddrinfo("localhost", 0, type=socket.SOCK_DGRAM)[0]
    echo_host = info[4][0]
    echo = UdpEcho(echo_host, prefix=b"echo:")
    client = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    client.bind(("127.0.0.1", 0))
    client.setblocking(False)
    other = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    other.bind(("127.0.0.1", 0))
    try:
        async with portal() as p:
            assoc_gauge = REGISTRY.value("meshgate_socks5_udp_associations")
            frag = Metric("meshgate_socks5_udp_dropped_total", "fragmented")
            wrong = Metric("meshgate_socks5_udp_dropped_total", "wrong_source")
            _, w, (rep, atyp, addr, rport) = await raw_socks(p.port, request(3, 1, bytes(4), 0))
            assert rep == 0 and atyp == 1
            relay = (socket.inet_ntoa(addr), rport)
            assert relay[0] == "127.0.0.1" and rport != 0

            # Address target (ATYP matching the echo server's family).
            eatyp = 4 if ":" in echo_host else 1
            eaddr = socket.inet_pton(socket.AF_INET6 if eatyp == 4 else socket.AF_INET, echo_host)
            hdr = udp_header(eatyp, eaddr, echo.port)
            reply = await udp_exchange(client, relay, hdr + b"one")
            assert reply == hdr + b"echo:one"

            # FRAG != 0 is dropped and counted; the echo server never sees it.
            client.sendto(udp_header(eatyp, eaddr, echo.port, frag=1) + b"frag", relay)
            await async_wait_until(lambda: frag.delta == 1, what="fragment counted")
            assert b"frag" not in echo.received

            # Another source on the same host is not the pinned client.
            other.sendto(hdr + b"intruder", relay)
            await async_wait_until(lambda: wrong.delta == 1, what="wrong source counted")
            assert b"intruder" not in echo.received

            # An IPv4-mapped IPv6 target goes out over IPv4 and its replies come
            # back under the mapped address the client used.
            if eatyp == 1:
                mapped = udp_header(4, socket.inet_pton(socket.AF_INET6, f"::ffff:{echo_host}"), echo.port)
                assert await udp_exchange(client, relay, mapped + b"mapped") == mapped + b"echo:mapped"

            # A domain target: replies come back under the name, and keep it even
            # when the client also sends to the address the name resolved to.
            name_hdr = udp_header(3, b"localhost", echo.port)
            assert await udp_exchange(client, relay, name_hdr + b"two") == name_hdr + b"echo:two"
            assert await udp_exchange(client, relay, hdr + b"three") == name_hdr + b"echo:three"
            assert [d for d in echo.received if d != b"mapped"] == [b"one", b"two", b"three"]

            # The association ends with its TCP connection.
            assert REGISTRY.value("meshgate_socks5_udp_associations") == assoc_gauge + 1
            w.close()
            await async_wait_until(
                lambda: REGISTRY.value("meshgate_socks5_udp_associations") == assoc_gauge,
                what="association closed",
            )
            client.sendto(hdr + b"after", relay)
            with contextlib.suppress(ConnectionRefusedError), pytest.raises(TimeoutError):
                # No answer: a timeout, or ICMP port unreachable surfacing as refused.
                await asyncio.wait_for(asyncio.get_running_loop().sock_recv(client, 65536), 0.3)
            assert b"after" not in echo.received
    finally:
        echo.close()
        client.close()
        other.close()


async def test_udp_associate_over_ipv6_portal_to_ipv4_target() -> None:
    """A portal on ::1: the relay socket is IPv6, the client's source is pinned
    as the IPv6 peer, and an IPv4 target is reached through the IPv4 egress."""
    require(can_bind("::1"), "IPv6 loopback (::1)")
    echo = UdpEcho("127.0.0.1", prefix=b"echo:")
    client = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
    client.bind(("::1", 0))
    client.setblocking(False)
    try:
        async with portal(listen="::1") as p:
            r, w = await asyncio.open_connection("::1", p.port)
            w.write(b"\x05\x01\x00" + request(3, 4, bytes(16), 0))
            assert await r.readexactly(2) == b"\x05\x00"
            rep, atyp, addr, rport = await asyncio.wait_for(read_reply(r), 5)
            assert (rep, atyp) == (0, 4)
            relay = (socket.inet_ntop(socket.AF_INET6, addr), rport)
            assert relay[0] == "::1"
            hdr = udp_header(1, socket.inet_aton("127.0.0.1"), echo.port)
            assert await udp_exchange(client, relay, hdr + b"v6") == hdr + b"echo:v6"
            w.close()
    finally:
        echo.close()
        client.close()


async def test_udp_associate_disabled_replies_07() -> None:
    async with portal(udp=False) as p:
        _, w, (rep, _, _, _) = await raw_socks(p.port, request(3, 1, bytes(4), 0))
        assert rep == 0x07
        w.close()


# --------------------------------------------------------------------------- burst


@contextlib.contextmanager
def nofile_at_least(need: int) -> Iterator[None]:
    """Raise this process's soft RLIMIT_NOFILE to `need` (up to the hard limit) for a test,
    restoring it after: a held wave costs four descriptors per connection here (the client's,
    the portal's two, the echo server's) and soft limits of 1024 are common."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    require(hard == resource.RLIM_INFINITY or hard >= need, f"RLIMIT_NOFILE hard limit >= {need}")
    if soft != resource.RLIM_INFINITY and soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


BURST_WAVE, BURST_WAVES = 1000, 5


async def test_burst_of_5000_connections_leaves_portal_serving_and_clean() -> None:
    """5,000 connections in five waves of 1,000 that are all open at once: each wave's clients
    finish CONNECT and an echo through the portal, then hold their connections until the whole
    wave is up (asserted on the client, the portal and the echo server at that one moment),
    then each echoes once more (the held relay still works) and closes."""
    echo_open: set[asyncio.StreamWriter] = set()

    async def echo(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        echo_open.add(w)
        try:
            while data := await r.read(65536):
                w.write(data)
                await w.drain()
        except OSError:
            pass
        finally:
            echo_open.discard(w)
            w.close()

    with nofile_at_least(4 * BURST_WAVE + 1024):
        # backlogs above the wave: 1,000 connects at once overflow the default 100 queue, and
        # a dropped SYN costs a 1 s retransmit, not a failure, so it would only slow the test
        echo_srv = await asyncio.start_server(echo, "127.0.0.1", 0, backlog=2 * BURST_WAVE)
        eport = echo_srv.sockets[0].getsockname()[1]
        try:  # every client connects from 127.0.0.1: lift the per-source share
            async with portal(max_clients=4096, socks5_max_clients_per_source=4096) as p:
                await _burst_waves(p, eport, echo_open)
        finally:
            echo_srv.close()
            await echo_srv.wait_closed()


async def _held_wave(p: Portal, req: bytes, echo_open: set[asyncio.StreamWriter], name: str) -> None:
    held: list[int] = []
    failed: list[BaseException] = []
    release = asyncio.Event()

    async def held_open(i: int) -> None:
        try:
            r, w = await asyncio.open_connection("127.0.0.1", p.port)
        except OSError as e:
            failed.append(e)
            return
        try:
            w.write(req + b"!")
            head = await r.readexactly(12)
            assert head[:4] == b"\x05\x00\x05\x00" and await r.readexactly(1) == b"!"
            held.append(i)
            await release.wait()
            w.write(b"?")  # the relay outlived the hold
            assert await r.readexactly(1) == b"?"
        except (OSError, asyncio.IncompleteReadError, AssertionError) as e:
            failed.append(e)
        finally:
            w.close()

    tasks = [asyncio.create_task(held_open(i)) for i in range(BURST_WAVE)]
    try:
        await async_wait_until(lambda: len(held) + len(failed) == BURST_WAVE, timeout=60, what=f"{name} up")
        assert not failed, f"{name}: {len(failed)} of {BURST_WAVE} failed, first: {failed[0]!r}"
        # the same moment, seen from all three places: nothing has been released yet
        assert len(held) == BURST_WAVE
        assert len(p.clients) == BURST_WAVE
        assert len(echo_open) == BURST_WAVE
    finally:
        release.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 60)
    assert not failed, f"{name} after release: {len(failed)} failed, first: {failed[0]!r}"


async def _burst_waves(p: Portal, eport: int, echo_open: set[asyncio.StreamWriter]) -> None:
    req = b"\x05\x01\x00" + request(1, 1, b"\x7f\0\0\1", eport)

    async def one() -> bool:
        r, w = await asyncio.open_connection("127.0.0.1", p.port)
        try:
            w.write(req + b"!")
            head = await r.readexactly(12)
            ok = head[:4] == b"\x05\x00\x05\x00" and await r.readexactly(1) == b"!"
        finally:
            w.close()
        return ok

    assert await one()  # warm-up, so lazily created resources exist before counting
    await async_wait_until(lambda: not p.clients and not echo_open, what="warm-up client gone")
    fds0 = open_fds()
    tasks0 = len(asyncio.all_tasks())

    for wave in range(BURST_WAVES):
        await _held_wave(p, req, echo_open, f"wave {wave}")
        await async_wait_until(lambda: not p.clients, timeout=20, what=f"wave {wave} closed")

    assert await one()  # still serving
    await async_wait_until(lambda: not p.clients, timeout=20, what="all clients closed")
    await async_wait_until(lambda: open_fds() <= fds0, timeout=20, what="file descriptors back")
    await async_wait_until(lambda: len(asyncio.all_tasks()) <= tasks0, timeout=20, what="tasks back")


# --------------------------------------------------------------------------- service


async def test_status_names_the_real_address_and_port_in_use_is_a_startup_error(tmp_path: Path) -> None:
    from meshgate.errors import StartupError

    async with portal() as p:
        st = p.svc.status()
        assert st["listen"] == f"127.0.0.1:{p.port}"
        assert any(f"port {p.port}" in n for n in st["notes"])
        taken = Config(  # a node of its own (own state_dir), on the port the portal holds
            node=NodeConfig(state_dir=str(tmp_path)),
            socks5=Socks5Config(listen=HostPort("127.0.0.1", p.port)), admin=AdminConfig(enable=False),
        )
        with pytest.raises(StartupError) as ei:
            await Node(taken).start()
        assert "socks5.listen" in str(ei.value) and f"127.0.0.1:{p.port}" in str(ei.value)
