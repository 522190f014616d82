"""DoQ sessions over real aioquic connections to the node's DoQ listener on loopback: a resumed
connection's queries in 0-RTT early data (RFC 9250 4.5), and a client's keepalive PINGs holding
an idle connection open past the listener's idle timeout (limits.dns_tcp_idle_timeout)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import dns.edns
import dns.message
import dns.opcode
import dns.rcode
from aioquic.asyncio.client import connect as quic_connect
from aioquic.quic import events as qevents
from aioquic.quic.logger import QuicLogger
from aioquic.tls import SessionTicket

from meshgate.config import from_dict
from meshgate.node import Node
from tests.helpers import async_wait_until
from tests.integration.test_dns_listeners import QuicEvents, doq_msg, quic_config


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
