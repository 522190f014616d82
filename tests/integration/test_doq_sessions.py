"""DoQ sessions over real aioquic connections to the node's DoQ listener on loopback: a resumed
connection's queries in 0-RTT early data (RFC 9250 4.5), a client's keepalive PINGs holding
an idle connection open past the listener's idle timeout (limits.dns_tcp_idle_timeout), and a
long-lived connection: far more queries than limits.doq_max_streams over its life (dnspython
reusing one connection), while no more than that many are ever open at once (issue 16)."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import dns.asyncquery
import dns.edns
import dns.message
import dns.opcode
import dns.quic
import dns.rcode
import pytest
from aioquic.asyncio.client import connect as quic_connect
from aioquic.quic import events as qevents
from aioquic.quic.logger import QuicLogger
from aioquic.tls import SessionTicket

from meshgate.config import from_dict
from meshgate.node import Node
from tests.helpers import async_wait_until
from tests.integration.test_dns_listeners import QuicEvents, doq_client, doq_msg, quic_config, start_env
from tests.integration.test_dns_upstream import LocalAuthority


@contextlib.asynccontextmanager
async def doq_node(tmp_path: Path, **limits: Any) -> AsyncIterator[tuple[str, int]]:
    """A node whose only front end is a DoQ listener; mesh names are answered locally."""
    cfg = from_dict({
        "node": {"name": "alpha", "ipv4": "10.144.144.1/24", "state_dir": str(tmp_path / "state")},
        "socks5": {"enable": False},
        "admin": {"enable": False},
        "dns": {"upstreams": [], "listener": [{"protocol": "doq", "listen": "127.0.0.1:0"}]},
        "limits": limits,
    })
    node = Node(cfg)
    await node.start()
    try:
        (url,) = node.status()["services"]["dns"]["listeners"]
        host, port = url.removeprefix("quic://").rsplit(":", 1)
        yield host, int(port)
    finally:
        await node.stop()


def doq_opcode(opcode: dns.opcode.Opcode) -> bytes:
    m = dns.message.make_query("mesh.internal", "SOA")
    m.id = 0
    m.set_opcode(opcode)
    return m.to_wire(prepend_length=True)


def answer(client: QuicEvents, sid: int) -> dns.message.Message:
    data, ended = client.data(sid)
    assert ended and int.from_bytes(data[:2], "big") == len(data) - 2
    return dns.message.from_wire(data[2:])


def handshake(client: QuicEvents) -> qevents.HandshakeCompleted | None:
    return next((e for e in client.events if isinstance(e, qevents.HandshakeCompleted)), None)


async def test_resumed_connection_sends_its_queries_as_0rtt_early_data(tmp_path: Path) -> None:
    """A first connection gets a session ticket; a second resumes with it and sends its queries
    in 0-RTT packets, before the handshake is done. The listener accepts the early data, answers
    the QUERY, and refuses the replayable UPDATE with Extended DNS Error 26 (Too Early), which it
    does only for what arrived before the handshake completed; NOTIFY may come in 0-RTT (we do
    not implement it: NOTIMP). The same UPDATE after the handshake is NOTIMP."""
    async with doq_node(tmp_path) as (host, port):
        tickets: list[SessionTicket] = []
        async with quic_connect(host, port, configuration=quic_config(), create_protocol=QuicEvents,
                                session_ticket_handler=tickets.append) as first:
            assert isinstance(first, QuicEvents)
            hs = handshake(first)
            assert hs is not None and not hs.session_resumed
            await async_wait_until(lambda: bool(tickets), timeout=5, what="a session ticket")
        ticket = tickets[-1]
        assert ticket.max_early_data_size  # the listener offers 0-RTT on this ticket

        cfg = quic_config()
        cfg.session_ticket = ticket
        cfg.quic_logger = QuicLogger()
        async with quic_connect(host, port, configuration=cfg, create_protocol=QuicEvents,
                                wait_connected=False) as client:
            assert isinstance(client, QuicEvents)
            q = client._quic
            # Not even the ClientHello has left yet: the first transmit sends it with these
            # streams in 0-RTT packets, nothing of the server's read in between.
            sids = {}
            for what, msg in (("query", doq_msg("alpha.mesh.internal")),
                              ("update", doq_opcode(dns.opcode.UPDATE)),
                              ("notify", doq_opcode(dns.opcode.NOTIFY))):
                sids[what] = q.get_next_available_stream_id()
                q.send_stream_data(sids[what], msg, end_stream=True)
            client.transmit()
            await async_wait_until(lambda: all(client.data(s)[1] for s in sids.values()), timeout=5,
                                   what="answers to the 0-RTT streams")
            hs = handshake(client)
            assert hs is not None and hs.session_resumed and hs.early_data_accepted

            early = [f["stream_id"] for t in cfg.quic_logger.to_dict()["traces"] for e in t["events"]
                     if e["name"] == "transport:packet_sent" and e["data"]["header"]["packet_type"] == "0RTT"
                     for f in e["data"]["frames"] if f["frame_type"] == "stream"]
            assert set(early) == set(sids.values())  # all three went as early data

            r = answer(client, sids["query"])
            assert r.rcode() == dns.rcode.NOERROR and r.answer[0][0].address == "10.144.144.1"
            r = answer(client, sids["update"])
            ede = [o for o in r.options if o.otype == dns.edns.OptionType.EDE]
            assert r.rcode() == dns.rcode.REFUSED and ede and ede[0].code == 26  # type: ignore[attr-defined]
            assert answer(client, sids["notify"]).rcode() == dns.rcode.NOTIMP

            sid = q.get_next_available_stream_id()  # the handshake is done now (1-RTT)
            q.send_stream_data(sid, doq_opcode(dns.opcode.UPDATE), end_stream=True)
            client.transmit()
            await async_wait_until(lambda: client.data(sid)[1], timeout=5, what="the 1-RTT UPDATE's answer")
            assert answer(client, sid).rcode() == dns.rcode.NOTIMP


IDLE = 1.0  # the listener's idle timeout in these tests (limits.dns_tcp_idle_timeout)


def idle_client_config() -> Any:
    """Our own idle timeout far above the listener's: whichever side closes an idle connection
    here does it on the listener's (QUIC takes the smaller of the two)."""
    cfg = quic_config()
    cfg.idle_timeout = 60.0
    return cfg


async def test_keepalive_pings_hold_an_idle_connection_past_the_idle_timeout(tmp_path: Path) -> None:
    """A connection with no DNS traffic, kept alive by the client's PINGs every IDLE/4, is still up
    and answering after three idle timeouts; the same connection without them is closed at the
    listener's idle timeout (so the first part does not pass merely because nothing times out)."""
    loop = asyncio.get_running_loop()
    async with doq_node(tmp_path, dns_tcp_idle_timeout=IDLE) as (host, port):
        async with quic_connect(host, port, configuration=idle_client_config(),
                                create_protocol=QuicEvents) as client:
            assert isinstance(client, QuicEvents)
            until = loop.time() + 3 * IDLE
            while loop.time() < until:
                # each PING must be acknowledged, within an idle timeout
                await asyncio.wait_for(client.ping(), IDLE)
                assert client.terminated() is None
                # the keepalive interval itself (what is tested), not a wait for a condition
                await asyncio.sleep(IDLE / 4)
            q = client._quic
            sid = q.get_next_available_stream_id()
            q.send_stream_data(sid, doq_msg("alpha.mesh.internal"), end_stream=True)
            client.transmit()
            await async_wait_until(lambda: client.data(sid)[1] or client.terminated() is not None,
                                   timeout=5, what="an answer after three idle timeouts")
            assert client.terminated() is None
            assert answer(client, sid).answer[0][0].address == "10.144.144.1"

        async with quic_connect(host, port, configuration=idle_client_config(),
                                create_protocol=QuicEvents) as idle:
            assert isinstance(idle, QuicEvents)
            start = loop.time()
            await async_wait_until(lambda: idle.terminated() is not None, timeout=10 * IDLE,
                                   what="the idle connection closed at the listener's idle timeout")
            assert loop.time() - start >= IDLE * 0.9  # not before it


@pytest.mark.parametrize("limits", [{}, {"doq_max_streams": 1}], ids=["default", "cap1"])
async def test_one_connection_answers_a_thousand_sequential_queries(tmp_path: Path,
                                                                    limits: dict[str, Any]) -> None:
    """dnspython's DoQ client reusing ONE connection, as RFC 9250 intends, with the default
    limits (doq_max_streams 64) and with a cap of 1: all 1,000 queries are answered, each with
    its own answer. The stream cap bounds the streams open at once, not those over the
    connection's life: each stream that ends lets the client open another (MAX_STREAMS). Before
    the fix the 65th query (the 2nd with cap 1) timed out: the listener never raised its
    MAX_STREAMS past the initial cap."""
    async with doq_node(tmp_path, **limits) as (host, port):
        manager = dns.quic.AsyncioQuicManager(verify_mode=ssl.CERT_NONE)
        conn = manager.connect(host, port)
        try:
            for i in range(1000):
                name = "alpha.mesh.internal" if i % 2 == 0 else f"nobody{i}.mesh.internal"
                q = dns.message.make_query(name, "A")
                r = await dns.asyncquery.quic(q, host, port=port, connection=conn, timeout=5)
                if i % 2 == 0:
                    assert r.rcode() == dns.rcode.NOERROR and r.answer[0][0].address == "10.144.144.1", i
                else:
                    assert r.rcode() == dns.rcode.NXDOMAIN and not r.answer, i
                    assert r.question[0].name.to_text() == name + ".", i
        finally:
            await conn.close()


CAP = 3  # limits.doq_max_streams in the next test
EXTRA = 2  # streams the client opens at once beyond CAP
ROUNDS = 4


async def test_stream_cap_bounds_concurrent_streams_for_the_life_of_a_connection(tmp_path: Path) -> None:
    """doq_max_streams=CAP, one raw aioquic connection, ROUNDS rounds: each opens CAP+EXTRA
    streams at once whose upstream answers are held. Exactly CAP reach the listener (the
    upstream is asked CAP of them, the client holds EXTRA as blocked: the listener has granted it
    no more than CAP streams beyond those finished); once released, all CAP+EXTRA are answered on
    the same connection, the EXTRA as the first ones finish. Before the fix the first round's
    EXTRA streams were never granted, so round 1 already timed out."""
    auth = await LocalAuthority().start()
    env = await start_env(tmp_path, auth, doq_max_streams=CAP)
    try:
        host, port = env.hp("quic")
        async with doq_client(host, port) as client:
            assert isinstance(client, QuicEvents)
            q = client._quic
            assert q._remote_max_streams_bidi == CAP  # the cap as the initial transport parameter
            done = 0  # streams answered so far on this connection
            for r in range(ROUNDS):
                names = [f"slow{r}x{i}.example.test" for i in range(CAP + EXTRA)]
                sids = []
                for name in names:
                    sid = q.get_next_available_stream_id()
                    q.send_stream_data(sid, doq_msg(name), end_stream=True)
                    sids.append(sid)
                client.transmit()
                first = [n + "." for n in names[:CAP]]
                await async_wait_until(
                    lambda f=first: env.svc.pipeline.inflight == CAP and all(auth.queries[n] for n in f),
                    timeout=5, what=f"round {r}: CAP queries in flight, at the upstream")
                # Nothing finishes while the upstream holds its answers, so the listener grants
                # no new stream: the EXTRA stay blocked in the client, never sent.
                assert q._remote_max_streams_bidi <= done + CAP
                assert len(q._streams_blocked_bidi) == EXTRA
                asked = [n for n in names if auth.queries[n + "."]]
                assert asked == names[:CAP], asked
                assert env.svc.pipeline.inflight == CAP
                auth.release.set()
                for sid in sids:
                    await async_wait_until(lambda s=sid: client.data(s)[1] or client.terminated() is not None,
                                           timeout=5, what=f"round {r}: the answer on stream {sid}")
                    assert client.terminated() is None
                    data, _ = client.data(sid)
                    assert int.from_bytes(data[:2], "big") == len(data) - 2
                    assert dns.message.from_wire(data[2:]).answer[0][0].address == "192.0.2.7"
                assert all(auth.queries[n + "."] == 1 for n in names)
                done += len(sids)
                auth.release.clear()  # hold the next round's answers again
            assert env.stat("quic").snapshot()["drops"].get("max_streams", 0) == 0
    finally:
        auth.release.set()
        await env.svc.stop()
        await auth.stop()
