"""Persistent upstream connections (meshgate/dns/upstream_pool.py) against real servers on loopback.

The servers are this file's own (they count the connections they accept and answer
pipelined queries concurrently, so slow ones come back out of order) or meshgate's
DoH server protocol in front of the LocalAuthority.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import struct
from pathlib import Path
from typing import Any

import dns.message
import pytest
from aioquic.asyncio import serve
from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.quic import events as qevents
from aioquic.quic.configuration import QuicConfiguration

from meshgate import tls as certs
from meshgate.dns import wire
from meshgate.dns.doh import DohApp
from meshgate.dns.h2server import H2ServerProtocol
from meshgate.dns.resolver import Pipeline
from meshgate.dns.stats import ListenerStats
from meshgate.dns.upstream import parse_upstream
from meshgate.dns.upstream_pool import StreamCore, UpstreamError, pad_query
from meshgate.metrics import REGISTRY
from tests.helpers import async_wait_until, free_port
from tests.integration.test_dns_upstream import LocalAuthority, ask, make_config, query


class StreamAuthority:
    """DNS over TCP (or TLS) on 127.0.0.1 answering through a LocalAuthority: every query on its
    own task, so a `slow*` name is answered after the ones behind it. Counts accepted connections;
    `drop()` aborts them all; `silent` accepts and reads but never answers."""

    def __init__(self, auth: LocalAuthority, ssl_ctx: ssl.SSLContext | None = None) -> None:
        self.auth = auth
        self.ssl_ctx = ssl_ctx
        self.accepted = 0
        self.silent = False
        self.writers: set[asyncio.StreamWriter] = set()
        self.tasks: set[asyncio.Task[None]] = set()
        self.server: asyncio.Server | None = None
        self.port = 0

    async def start(self) -> StreamAuthority:
        self.server = await asyncio.start_server(self._client, "127.0.0.1", 0, ssl=self.ssl_ctx)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        self.writers.add(writer)
        try:
            while True:
                n = int.from_bytes(await reader.readexactly(2), "big")
                data = await reader.readexactly(n)
                if not self.silent:
                    task = asyncio.create_task(self._answer(writer, data))
                    self.tasks.add(task)
                    task.add_done_callback(self.tasks.discard)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.writers.discard(writer)
            writer.close()

    async def _answer(self, writer: asyncio.StreamWriter, data: bytes) -> None:
        out = await self.auth.respond(data, tcp=True)
        if out is not None and not writer.is_closing():
            writer.write(len(out).to_bytes(2, "big") + out)

    @property
    def open_connections(self) -> int:
        return len(self.writers)

    def drop(self) -> None:
        for w in list(self.writers):
            w.transport.abort()

    async def stop(self) -> None:
        self.drop()
        for t in list(self.tasks):
            t.cancel()
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


@pytest.fixture
async def auth() -> Any:
    a = await LocalAuthority().start()
    yield a
    a.release.set()
    await a.stop()


@pytest.fixture
def tls_files(tmp_path: Path) -> tuple[Path, Path]:
    return certs.ensure_self_signed(tmp_path / "certs")


def pipeline(url: str, verify: bool | str = False, **limits: Any) -> Pipeline:
    cfg = make_config([], **limits)
    up = parse_upstream(url, verify=verify, limits=cfg.limits)
    return Pipeline(cfg, upstreams=[up])


def counter(name: str, url: str) -> float:
    return REGISTRY.value(name, url)


def errors(url: str, reason: str) -> float:
    return REGISTRY.value("meshgate_dns_upstream_errors_total", url, reason)


# --------------------------------------------------------------------------- sans-I/O core


def test_stream_core_matches_out_of_order_answers_by_id_and_restores_ours() -> None:
    core = StreamCore(max_outstanding=4)
    q1, q2 = query("a.example.test", qid=7).question, query("b.example.test", qid=7).question
    w1 = struct.pack(">HHHHHH", 7, 0x100, 1, 0, 0, 0) + q1
    w2 = struct.pack(">HHHHHH", 7, 0x100, 1, 0, 0, 0) + q2  # the same caller ID: told apart
    id1, f1 = core.encode(w1, "one")
    id2, _ = core.encode(w2, "two")
    assert id1 != id2 and f1[:2] == len(w1).to_bytes(2, "big") and f1[2:4] == id1.to_bytes(2, "big")
    # Answers come back second first, split at odd places, with a stray one between them.
    a2 = struct.pack(">HH", id2, 0x8180) + w2[4:]
    a1 = struct.pack(">HH", id1, 0x8180) + w1[4:]
    stray = struct.pack(">HH", (id1 + id2 + 1) & 0xFFFF or 1, 0x8180) + w1[4:]
    stream = b"".join(len(m).to_bytes(2, "big") + m for m in (a2, stray, a1))
    got: list[tuple[object, bytes]] = []
    for i in range(0, len(stream), 5):
        got += core.receive(stream[i : i + 5])
    assert [t for t, _ in got] == ["two", "one"]
    assert got[0][1][:2] == b"\x00\x07" and got[0][1][4:] == w2[4:]
    assert got[1][1][:2] == b"\x00\x07" and got[1][1][4:] == w1[4:]
    assert core.stray == 1 and not core.pending


def test_stream_core_cap_and_forget() -> None:
    core = StreamCore(max_outstanding=2)
    w = struct.pack(">HHHHHH", 1, 0x100, 1, 0, 0, 0) + query("a.example.test").question
    i1, _ = core.encode(w, 1)
    core.encode(w, 2)
    with pytest.raises(UpstreamError):
        core.encode(w, 3)
    core.forget(i1)  # timed out: its late answer is a stray, and its slot is free
    core.encode(w, 3)
    late = struct.pack(">HH", i1, 0x8180) + w[4:]
    assert core.receive(len(late).to_bytes(2, "big") + late) == [] and core.stray == 1


def test_query_padding_to_128_byte_blocks() -> None:
    q = wire.build_query(1, wire.encode_name("www.example.test"), wire.TYPE_A, wire.CLASS_IN)
    padded = pad_query(q)
    assert len(padded) % 128 == 0
    msg = dns.message.from_wire(padded)
    assert msg.question[0].name.to_text() == "www.example.test." and msg.edns == 0
    assert [o.otype for o in msg.options] == [12]
    assert pad_query(b"\x00" * 12) == b"\x00" * 12  # no OPT: unchanged


# --------------------------------------------------------------------------- tcp:// and tls://


@pytest.mark.parametrize("tls", [False, True], ids=["tcp", "tls"])
async def test_many_queries_share_one_connection(auth: LocalAuthority, tls_files: Any, tls: bool) -> None:
    ctx = certs.server_context(*tls_files, alpn=["dot"]) if tls else None
    srv = await StreamAuthority(auth, ctx).start()
    url = f"tls://127.0.0.1:{srv.port}#localhost" if tls else f"tcp://127.0.0.1:{srv.port}"
    p = pipeline(url, verify=str(tls_files[0]))
    try:
        names = [f"n{i}.example.test" for i in range(20)]
        results = await asyncio.gather(*(ask(p, n) for n in names))  # concurrent: pipelined
        assert all(r.rcode() == 0 and r.authority for r in results)
        for n in ("www.example.test", "five.example.test"):  # one after another: reused
            assert (await ask(p, n)).answer
        assert srv.accepted == 1
        assert sum(auth.tcp_queries.values()) == 22
    finally:
        p.close()
        await srv.stop()


async def test_pipelined_answers_out_of_order_are_matched_by_id(auth: LocalAuthority) -> None:
    srv = await StreamAuthority(auth).start()
    p = pipeline(f"tcp://127.0.0.1:{srv.port}")
    try:
        slow = asyncio.create_task(ask(p, "slow1.example.test"))
        await async_wait_until(lambda: auth.tcp_queries["slow1.example.test."] == 1, 5, "slow query sent")
        fast = await ask(p, "www.example.test")  # answered while slow1 is still pending
        assert fast.answer[0][0].address == "192.0.2.1" and not slow.done()
        auth.release.set()
        r = await slow
        assert r.answer[0][0].address == "192.0.2.7"
        assert srv.accepted == 1
    finally:
        p.close()
        await srv.stop()


async def test_a_dropped_connection_is_replaced(auth: LocalAuthority) -> None:
    srv = await StreamAuthority(auth).start()
    p = pipeline(f"tcp://127.0.0.1:{srv.port}")
    up = p.upstreams[0]
    try:
        assert (await ask(p, "www.example.test")).answer
        srv.drop()  # the upstream resets the connection (or its idle timeout closed it)
        await async_wait_until(lambda: len(up.pool) == 0, 5, "the pool forgets the closed connection")  # type: ignore[attr-defined]
        assert (await ask(p, "five.example.test")).answer
        assert srv.accepted == 2
    finally:
        p.close()
        await srv.stop()


async def test_a_query_on_a_connection_closed_under_it_is_retried_once(auth: LocalAuthority) -> None:
    srv = await StreamAuthority(auth).start()
    p = pipeline(f"tcp://127.0.0.1:{srv.port}")
    try:
        assert (await ask(p, "www.example.test")).answer
        task = asyncio.create_task(ask(p, "slow2.example.test"))
        await async_wait_until(lambda: auth.tcp_queries["slow2.example.test."] == 1, 5, "slow query sent")
        srv.drop()  # the answer never comes on this connection
        await async_wait_until(lambda: srv.accepted == 2, 5, "a second connection for the retry")
        auth.release.set()
        assert (await task).answer[0][0].address == "192.0.2.7"
    finally:
        p.close()
        await srv.stop()


async def test_per_connection_cap_opens_more_connections_up_to_the_pool_bound(auth: LocalAuthority) -> None:
    srv = await StreamAuthority(auth).start()
    url = f"tcp://127.0.0.1:{srv.port}"
    p = pipeline(url, dns_upstream_max_queries=2, dns_upstream_max_connections=2)
    up = p.upstreams[0]
    try:
        full0 = counter("meshgate_dns_upstream_pool_full_total", url)
        slow = [wire.build_query(i, wire.encode_name(f"slow{i}.example.test"), 1, 1) for i in range(4)]
        tasks = [asyncio.create_task(up.exchange(q, 2.0)) for q in slow]
        await async_wait_until(lambda: sum(auth.tcp_queries.values()) == 4, 5, "four queries upstream")
        assert srv.accepted == 2  # two connections, two queries each
        with pytest.raises(UpstreamError):  # a fifth has no room: refused at once, counted
            await up.exchange(wire.build_query(9, wire.encode_name("www.example.test"), 1, 1), 2.0)
        assert counter("meshgate_dns_upstream_pool_full_total", url) == full0 + 1
        auth.release.set()
        answers = await asyncio.gather(*tasks)
        assert [int.from_bytes(a[:2], "big") for a in answers] == [0, 1, 2, 3]  # our IDs restored
    finally:
        p.close()
        await srv.stop()


async def test_idle_connections_close(auth: LocalAuthority) -> None:
    srv = await StreamAuthority(auth).start()
    p = pipeline(f"tcp://127.0.0.1:{srv.port}", dns_upstream_idle_timeout=0.2)
    try:
        assert (await ask(p, "www.example.test")).answer
        assert srv.open_connections == 1
        await async_wait_until(lambda: srv.open_connections == 0, 5, "the idle connection closed")
        assert len(p.upstreams[0].pool) == 0  # type: ignore[attr-defined]
        assert (await ask(p, "five.example.test")).answer and srv.accepted == 2
    finally:
        p.close()
        await srv.stop()


async def test_dead_and_silent_upstreams_fail_over_within_the_timeout(auth: LocalAuthority) -> None:
    good = await StreamAuthority(auth).start()
    silent = await StreamAuthority(auth).start()
    silent.silent = True  # accepts, reads, never answers (a peer gone without a FIN looks the same)
    dead = await StreamAuthority(auth).start()
    dead_port = dead.port
    await dead.stop()  # nothing listens there: refused at once
    cfg = make_config([], dns_timeout=0.3)
    urls = [f"tcp://127.0.0.1:{dead_port}", f"tcp://127.0.0.1:{silent.port}", f"tcp://127.0.0.1:{good.port}"]
    ups = [parse_upstream(u, limits=cfg.limits) for u in urls]
    p = Pipeline(cfg, upstreams=ups)
    try:
        retired0 = counter("meshgate_dns_upstream_retired_total", urls[1])
        before = {(u, why): errors(u, why) for u in urls for why in ("timeout", "error")}
        r = await ask(p, "www.example.test")
        assert r.answer[0][0].address == "192.0.2.1"
        # refused: failed at once, no wait; silent: one timeout; good: no error (counted, not clocked)
        assert {k: errors(*k) - v for k, v in before.items()} == {
            (urls[0], "timeout"): 0, (urls[0], "error"): 1, (urls[1], "timeout"): 1, (urls[1], "error"): 0,
            (urls[2], "timeout"): 0, (urls[2], "error"): 0}
        assert p.upstreams[p._preferred].url == urls[2]
        # The silent connection answered nothing before the deadline: out of rotation and closed.
        assert counter("meshgate_dns_upstream_retired_total", urls[1]) == retired0 + 1
        await async_wait_until(lambda: silent.open_connections == 0, 5, "silent connection closed")
    finally:
        p.close()
        await good.stop()
        await silent.stop()


# --------------------------------------------------------------------------- https:// (pooled h2 client)


async def test_https_upstream_reuses_one_http2_connection(auth: LocalAuthority, tls_files: Any) -> None:
    back = Pipeline(make_config([auth.url]))
    stats = ListenerStats("test-doh-reuse")  # its own label: the counters are process-wide
    app = DohApp(back, stats, "/dns-query")
    limits = back.config.limits
    accepted = 0

    def factory() -> H2ServerProtocol:
        nonlocal accepted
        accepted += 1
        return H2ServerProtocol(app, stats, limits, set())

    ctx = certs.server_context(*tls_files, alpn=["h2"])
    server = await asyncio.get_running_loop().create_server(factory, "127.0.0.1", 0, ssl=ctx)
    port = server.sockets[0].getsockname()[1]
    p = pipeline(f"https://localhost:{port}/dns-query", verify=str(tls_files[0]))
    try:
        results = await asyncio.gather(*(ask(p, f"h{i}.example.test") for i in range(20)))
        assert all(r.rcode() == 0 for r in results)
        assert (await ask(p, "www.example.test")).answer[0][0].address == "192.0.2.1"
        assert accepted == 1
        assert stats.snapshot()["queries"] == 21
    finally:
        p.close()
        back.close()
        server.close()
        await server.wait_closed()


# --------------------------------------------------------------------------- quic:// (DoQ)


class DoqTestServer(QuicConnectionProtocol):
    """Answers each DoQ stream through the LocalAuthority; checks RFC 9250's ID 0."""

    accepted = 0
    auth: LocalAuthority
    ids: list[int] = []

    def __init__(self, *a: Any, **k: Any) -> None:
        super().__init__(*a, **k)
        DoqTestServer.accepted += 1
        self.bufs: dict[int, bytearray] = {}

    def quic_event_received(self, event: qevents.QuicEvent) -> None:
        if isinstance(event, qevents.StreamDataReceived):
            buf = self.bufs.setdefault(event.stream_id, bytearray())
            buf += event.data
            if event.end_stream:
                asyncio.get_running_loop().create_task(self._answer(event.stream_id, bytes(buf[2:])))

    async def _answer(self, sid: int, data: bytes) -> None:
        DoqTestServer.ids.append(int.from_bytes(data[:2], "big"))
        out = await self.auth.respond(data, tcp=True)
        assert out is not None
        self._quic.send_stream_data(sid, len(out).to_bytes(2, "big") + out, end_stream=True)
        self.transmit()


async def test_quic_upstream_carries_many_streams_on_one_connection(auth: LocalAuthority,
                                                                   tls_files: Any) -> None:
    DoqTestServer.accepted = 0
    DoqTestServer.auth = auth
    DoqTestServer.ids = []
    config = QuicConfiguration(is_client=False, alpn_protocols=["doq"])
    config.load_cert_chain(str(tls_files[0]), str(tls_files[1]))
    server = await serve("127.0.0.1", 0, configuration=config, create_protocol=DoqTestServer)
    port = server._transport.get_extra_info("sockname")[1]  # type: ignore[union-attr]
    p = pipeline(f"quic://127.0.0.1:{port}#localhost", verify=str(tls_files[0]))
    try:
        results = await asyncio.gather(*(ask(p, f"q{i}.example.test") for i in range(20)))
        assert all(r.rcode() == 0 and r.authority for r in results)  # ID 4660 restored by ask()
        assert (await ask(p, "www.example.test")).answer[0][0].address == "192.0.2.1"
        assert DoqTestServer.accepted == 1
        assert DoqTestServer.ids == [0] * 21  # RFC 9250: ID 0 on the wire
        assert sum(auth.tcp_queries.values()) == 21
    finally:
        p.close()
        server.close()


async def test_https_and_quic_dropped_connections_are_replaced(auth: LocalAuthority, tls_files: Any) -> None:
    back = Pipeline(make_config([auth.url]))
    stats = ListenerStats("test-doh-replaced")
    app = DohApp(back, stats, "/dns-query")
    h2conns: list[H2ServerProtocol] = []

    def factory() -> H2ServerProtocol:
        h2conns.append(H2ServerProtocol(app, stats, back.config.limits, set()))
        return h2conns[-1]

    ctx = certs.server_context(*tls_files, alpn=["h2"])
    h2srv = await asyncio.get_running_loop().create_server(factory, "127.0.0.1", 0, ssl=ctx)
    DoqTestServer.accepted = 0
    DoqTestServer.auth = auth
    DoqTestServer.ids = []
    config = QuicConfiguration(is_client=False, alpn_protocols=["doq"])
    config.load_cert_chain(str(tls_files[0]), str(tls_files[1]))
    quic_protos: list[DoqTestServer] = []

    def make_doq(*a: Any, **k: Any) -> DoqTestServer:
        quic_protos.append(DoqTestServer(*a, **k))
        return quic_protos[-1]

    qsrv = await serve("127.0.0.1", 0, configuration=config, create_protocol=make_doq)
    h2url = f"https://localhost:{h2srv.sockets[0].getsockname()[1]}/dns-query"
    qurl = f"quic://127.0.0.1:{qsrv._transport.get_extra_info('sockname')[1]}#localhost"  # type: ignore[union-attr]
    ph, pq = pipeline(h2url, verify=str(tls_files[0])), pipeline(qurl, verify=str(tls_files[0]))
    try:
        assert (await ask(ph, "www.example.test")).answer and (await ask(pq, "www.example.test")).answer
        for h in h2conns:
            assert h.transport is not None
            h.transport.abort()
        for q in quic_protos:
            q.close()  # CONNECTION_CLOSE to the client
        await async_wait_until(lambda: len(pq.upstreams[0].pool) == 0, 5, "DoQ connection forgotten")  # type: ignore[attr-defined]
        assert (await ask(ph, "five.example.test")).answer and (await ask(pq, "five.example.test")).answer
        assert len(h2conns) == 2 and DoqTestServer.accepted == 2
    finally:
        ph.close()
        pq.close()
        back.close()
        h2srv.close()
        qsrv.close()
        await h2srv.wait_closed()


async def test_dead_https_and_quic_upstreams_fail_over_within_the_timeout(auth: LocalAuthority) -> None:
    good = await StreamAuthority(auth).start()
    cfg = make_config([], dns_timeout=0.3)
    urls = [f"quic://127.0.0.1:{free_port(socket.SOCK_DGRAM)}", f"https://127.0.0.1:{free_port()}/dns-query",
            f"tcp://127.0.0.1:{good.port}"]
    p = Pipeline(cfg,
                 upstreams=[parse_upstream(u, verify=False, limits=cfg.limits) for u in urls])
    try:
        before = {(u, why): errors(u, why) for u in urls for why in ("timeout", "error")}
        r = await ask(p, "www.example.test")
        assert r.answer[0][0].address == "192.0.2.1"
        # DoQ: one timeout (no handshake); DoH: refused at once, no wait (counted, not clocked)
        assert {k: errors(*k) - v for k, v in before.items()} == {
            (urls[0], "timeout"): 1, (urls[0], "error"): 0, (urls[1], "timeout"): 0, (urls[1], "error"): 1,
            (urls[2], "timeout"): 0, (urls[2], "error"): 0}
        assert p.upstreams[p._preferred].url == urls[2]
    finally:
        p.close()
        await good.stop()
