"""udp:// links on real loopback sockets: an A—B—C line converges and carries a bulk stream
and datagrams (big ones in pieces, reassembled at each hop); GSO batching is used where the
kernel has it and the per-packet fallback works when switched off; a restarted peer is
linked again; strays and wrong secrets learn nothing and are counted."""

from __future__ import annotations

import asyncio
import errno
import hashlib
import ipaddress
import logging
import os
import socket
from typing import Any

import pytest

from meshgate.config import LimitsConfig, LinkUrl
from meshgate.mesh import link_udp
from meshgate.mesh.link_udp import UdpLink
from meshgate.mesh.service import MeshService
from meshgate.mesh.udp_session import INIT_MIN, KIND_DATA, KIND_INIT
from meshgate.metrics import REGISTRY
from tests.helpers import async_wait_until, require
from tests.mesh_testing import (
    converged,
    mesh_node,
    node_config,
    sha_server,
    start_node,
    stop_all,
    stream_sha,
)


def _kernel_gso() -> bool:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        return link_udp.gso_supported(s)
    finally:
        s.close()


def _udp_links(node: MeshService) -> list[UdpLink]:
    return [link for links in node.links.values() for link in links if isinstance(link, UdpLink)]


@pytest.mark.parametrize("gso", [True, False], ids=["gso", "per-packet"])
async def test_udp_line_stream_datagrams_and_gso(gso: bool) -> None:
    limits = {"udp_link_gso": gso}
    b = await start_node(node_config("b", "10.9.0.2/24", listen=["udp://127.0.0.1:0"], limits=limits))
    url = b.listen_addrs[0]
    assert url.startswith("udp://127.0.0.1:") and not url.endswith(":0")
    a = await start_node(node_config("a", "10.9.0.1/24", peers=[url], limits=limits))
    c = await start_node(node_config("c", "10.9.0.3/24", peers=[url], limits=limits))
    nodes = [a, b, c]
    srv, port = await sha_server()
    try:
        await async_wait_until(lambda: converged(nodes), 15, "routes over udp:// links")
        route = a.lookup(ipaddress.ip_address("10.9.0.3"))
        assert route is not None and route.next_hop == b.node_id and route.hops == 2
        assert [p["url"].startswith("udp://127.0.0.1:") for p in b.peers()] == [True, True]
        data = os.urandom(16 << 20)
        assert await stream_sha(a, c.node_id, port, data) == hashlib.sha256(data).digest()

        seen: list[bytes] = []
        c.on_datagram(3, lambda src, p: seen.append(p))
        sent = [os.urandom(n) for n in (1, 200, 1300, 1300, 9000)]  # 9000: too big for one packet
        for p in sent:
            assert a.send_datagram(c.node_id, 3, p)
        await async_wait_until(lambda: sorted(seen) == sorted(sent), 5, "datagrams over two hops")

        # big datagrams (TUN bundles are up to 32 KiB) travel in pieces, not on the reliable
        # channel: each hop cuts and reassembles them; all arrive whole, none twice
        links = _udp_links(a) + _udp_links(b) + _udp_links(c)
        assert len(links) == 4
        reliable = [link.session.snd_nxt for link in links]
        frag_in = REGISTRY.value("meshgate_mesh_udp_link_fragmented_total", "in")
        seen.clear()
        big = [i.to_bytes(2, "big") + os.urandom(n) for i, n in enumerate([1500, 4000, 32768, 60000] * 25)]
        for i in range(0, len(big), 20):
            for p in big[i : i + 20]:
                assert a.send_datagram(c.node_id, 3, p)
            await async_wait_until(lambda: len(seen) >= i + 20, 5, "a batch of big datagrams")  # noqa: B023
        assert sorted(seen) == sorted(big)
        # only link-local frames (pings) took the reliable channel meanwhile: far fewer segments
        # than the 2.6 MB of datagrams would have needed
        assert sum(link.session.snd_nxt for link in links) - sum(reliable) < 100
        assert sum(link.session.reassembled for link in links) >= 2 * len(big)  # at b and at c
        assert all(link.session.reassembly_held() == (0, 0) for link in links)
        for link in links:
            link.drop_counts()
        assert REGISTRY.value("meshgate_mesh_udp_link_fragmented_total", "in") >= frag_in + 2 * len(big)
        socks = list({id(link.sock): link.sock for link in links}.values())  # b's two share one
        assert len(socks) == 3
        batches = sum(s.gso_batches for s in socks)
        if gso and _kernel_gso():
            assert all(s.gso for s in socks)
            assert batches > 0  # the bulk stream left in multi-segment sendmsg calls
            assert REGISTRY.value("meshgate_mesh_udp_link_gso_batches_total") >= batches
        else:
            assert batches == 0 and not any(s.gso for s in socks)
        assert sum(s.sent for s in socks) > 2 * (16 << 20) // 1500  # both hops
    finally:
        srv.close()
        await stop_all(nodes)


async def test_udp_link_comes_back_after_the_peer_restarts() -> None:
    limits = {"mesh_ping_interval": 0.2, "mesh_dead_after": 1.0}
    b = await start_node(node_config("b", "10.9.0.2/24", listen=["udp://127.0.0.1:0"], limits=limits))
    url = b.listen_addrs[0]
    port = int(url.rsplit(":", 1)[1])
    a = await start_node(node_config("a", "10.9.0.1/24", peers=[url], limits=limits))
    try:
        await async_wait_until(lambda: converged([a, b]), 10, "first link")
        await b.stop()  # says CLOSE: a drops the link at once, not at its dead timer
        await async_wait_until(lambda: not a.links, 5, "link down on a")
        # the same node again (its identity, so its id), on the same port
        old_id = b.node_id
        again = node_config("b", "10.9.0.2/24", listen=[f"udp://127.0.0.1:{port}"], limits=limits)
        b = await start_node(again, b.identity)
        assert b.node_id == old_id
        await async_wait_until(lambda: converged([a, b]), 15, "link re-established")
        srv, sport = await sha_server()
        try:
            data = os.urandom(1 << 20)
            assert await stream_sha(a, b.node_id, sport, data) == hashlib.sha256(data).digest()
        finally:
            srv.close()
        # the restarted b holds one session for a: the old one ended when b stopped
        assert len(_udp_links(b)) == 1
    finally:
        await stop_all([a, b])


async def test_vanished_peer_is_detected_and_reconnected() -> None:
    """No CLOSE (the peer's packets simply stop): the ping timeout ends the link, and the
    configured peer is dialled again once the other side answers."""
    limits = {"mesh_ping_interval": 0.2, "mesh_dead_after": 1.0}
    b = await start_node(node_config("b", "10.9.0.2/24", listen=["udp://127.0.0.1:0"], limits=limits))
    url = b.listen_addrs[0]
    a = await start_node(node_config("a", "10.9.0.1/24", peers=[url], limits=limits))
    try:
        await async_wait_until(lambda: converged([a, b]), 10, "first link")
        (link,) = _udp_links(a)
        sock = link.sock
        sock.on_packet = lambda p, addr, src: None  # a's side goes deaf: b's pongs never arrive
        sock.on_batch = None
        await async_wait_until(lambda: a.stats["link_dead"] >= 1, 5, "dead link noticed")
        assert sock.closed  # the initiator's socket went with its link
        await async_wait_until(lambda: converged([a, b]) and _udp_links(a) != [link], 15, "new link")
    finally:
        await stop_all([a, b])


async def test_strays_and_wrong_secret_learn_nothing() -> None:
    b = await start_node(
        node_config("b", "10.9.0.2/24", listen=["udp://127.0.0.1:0"], limits={"handshake_timeout": 1.0}),
    )
    url = b.listen_addrs[0]
    host, port = url.removeprefix("udp://").rsplit(":", 1)
    bad_cfg = node_config(
        "bad", "10.9.0.4/24", peers=[url], secret="wrong secret!", limits={"handshake_timeout": 1.0}
    )
    bad = await start_node(bad_cfg)
    stray = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    stray.setblocking(False)
    stray.bind(("127.0.0.1", 0))
    try:
        dropped = REGISTRY.value("meshgate_mesh_udp_link_dropped_total", "unknown_peer")
        malformed = REGISTRY.value("meshgate_mesh_udp_link_dropped_total", "malformed")
        for junk in (b"", b"\x00" * 50, bytes((KIND_DATA,)) + os.urandom(60), os.urandom(1400),
                     bytes((KIND_INIT,)) + b"MGMx\x01" + bytes(20)):
            stray.sendto(junk, (host, int(port)))
        await async_wait_until(
            lambda: REGISTRY.value("meshgate_mesh_udp_link_dropped_total", "unknown_peer") >= dropped + 3
            and REGISTRY.value("meshgate_mesh_udp_link_dropped_total", "malformed") >= malformed + 1,
            5, "strays counted",
        )
        # a well-formed msg1 from a stray gets one msg2, no bigger than what it sent
        from meshgate.mesh.udp_session import INIT_PADDING, UdpSession

        probe = UdpSession(True, "testnet", b"\x00" * 32, lambda *a: None, 7)
        probe.start(0.0)
        (msg1,) = probe.packets_to_send(0.0)
        assert len(msg1) == INIT_MIN and INIT_PADDING > 0
        stray.sendto(msg1, (host, int(port)))
        loop = asyncio.get_running_loop()
        reply = await asyncio.wait_for(loop.sock_recv(stray, 2048), 5)
        assert reply[0] == 2 and len(reply) <= len(msg1)
        await async_wait_until(
            lambda: b.stats["handshake_failed_handshake"] >= 1 and bad.stats["handshake_failed"] >= 1,
            15, "wrong secret refused on both sides",
        )
        await async_wait_until(lambda: b.stats["handshake_failed_timeout"] >= 1, 5, "stray's handshake ended")
        assert set(bad.table.records) == {bad.node_id} and bad.node_id not in b.table.records
        assert b.links == {} and bad.links == {}
    finally:
        stray.close()
        await stop_all([b, bad])


async def test_too_small_mtu_is_a_startup_error() -> None:
    from meshgate.errors import StartupError

    cfg = node_config("a", listen=["udp://127.0.0.1:0"], limits={"udp_link_mtu": 100})
    svc = mesh_node(cfg)
    with pytest.raises(StartupError, match=r"limits\.udp_link_mtu"):
        await svc.start()
    await svc.stop()


async def test_new_session_from_the_same_address_replaces_the_old_one() -> None:
    """A peer that restarts on the same source port (no CLOSE sent): its new session ends the
    old one at once, long before the ping timeout would."""
    limits = {"mesh_dead_after": 30.0}
    b = await start_node(node_config("b", "10.9.0.2/24", listen=["udp://127.0.0.1:0"], limits=limits))
    a = await start_node(node_config("a", "10.9.0.1/24", limits=limits))
    url = b.listen_addrs[0]
    host, port = url.removeprefix("udp://").rsplit(":", 1)
    try:
        first = await a.connect(LinkUrl("udp", host, int(port)))
        assert isinstance(first, UdpLink)
        await async_wait_until(lambda: converged([a, b]), 10, "first session")
        src_port = first.sock.sock.getsockname()[1]
        first.abort()  # gone without a word, like a crash
        await async_wait_until(lambda: not a.links, 5, "a dropped its side")
        # the "restarted" peer: a new session from the same address and port
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.setblocking(False)
        sock.bind(("127.0.0.1", src_port))
        sock.connect((host, int(port)))
        holder: list[UdpLink] = []
        usock = link_udp.UdpSocket(asyncio.get_running_loop(), sock,
                                   lambda p, _a, _s: holder[0].datagram_received(p), a.config.limits, True)
        second = UdpLink(a, url, True, usock, (host, int(port)), a.config.limits, lambda _l: usock.close())
        holder.append(second)
        a.pending.add(second)
        second.begin()
        await async_wait_until(
            lambda: converged([a, b]) and [lk.session.peer_id for lk in _udp_links(b)] == [second.local_id],
            5, "the old session replaced",
        )
        assert b.stats["link_dead"] == 0
    finally:
        await stop_all([a, b])


def _rebind(link: UdpLink, loop: asyncio.AbstractEventLoop) -> tuple[str, int]:
    """The initiator's NAT mapping changes: its packets leave from a new port from now on
    (a new connected socket under the same session). Returns the new source address."""
    old = link.sock
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setblocking(False)
    sock.bind(("127.0.0.1", 0))
    sock.connect(link.addr)
    new = link_udp.UdpSocket(loop, sock, lambda p, _a, _s: link.datagram_received(p),
                             link.owner.config.limits, connected=True)  # type: ignore[attr-defined]
    link.sock = new
    link.on_gone = lambda _l: new.close()
    old.close()
    addr: tuple[str, int] = sock.getsockname()
    return addr


async def test_roaming_peer_keeps_its_session_and_forgeries_move_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="meshgate.mesh.udp")
    limits = {"mesh_ping_interval": 0.2, "mesh_dead_after": 2.0}
    b = await start_node(node_config("b", "10.9.0.2/24", listen=["udp://127.0.0.1:0"], limits=limits))
    url = b.listen_addrs[0]
    host, port = url.removeprefix("udp://").rsplit(":", 1)
    a = await start_node(node_config("a", "10.9.0.1/24", peers=[url], limits=limits))
    stray = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    stray.setblocking(False)
    stray.bind(("127.0.0.1", 0))
    srv, sport = await sha_server()
    try:
        await async_wait_until(lambda: converged([a, b]), 10, "first link")
        (la,) = _udp_links(a)
        (lb,) = _udp_links(b)
        listener = b._listening[0].server
        first_addr = lb.addr
        assert first_addr == la.sock.sock.getsockname()
        # a's packets on the wire, to replay and forge from another address
        sent: list[bytes] = []
        send = la.sock.send

        def record(addr: Any, packets: list[bytes], src: Any = None) -> None:
            sent.extend(packets)
            send(addr, packets, src)

        la.sock.send = record  # type: ignore[method-assign]
        await async_wait_until(lambda: len(sent) >= 3 and lb.session.packets_in >= 3, 5, "traffic")
        unknown = REGISTRY.value("meshgate_mesh_udp_link_dropped_total", "unknown_peer")
        roamed = REGISTRY.value("meshgate_mesh_udp_link_roamed_total")
        replayed, forged = lb.session.replayed, lb.session.forged
        data_pkts = [p for p in sent if p[0] == KIND_DATA]
        replay = data_pkts[-1]
        fake = bytearray(replay)
        fake[13] ^= 0x40  # a counter far ahead: judged by its tag, which no longer verifies
        for p in (replay, bytes(fake), bytes((KIND_DATA,)) + replay[1:5] + os.urandom(60)):
            stray.sendto(p, (host, int(port)))
        await async_wait_until(
            lambda: REGISTRY.value("meshgate_mesh_udp_link_dropped_total", "unknown_peer") >= unknown + 3,
            5, "forgeries refused",
        )
        assert lb.session.replayed >= replayed + 1 and lb.session.forged >= forged + 1
        assert lb.addr == first_addr and lb.roams == 0  # nothing moved
        assert REGISTRY.value("meshgate_mesh_udp_link_roamed_total") == roamed

        # a NAT rebinding: a's packets now come from a new port; b follows the first authentic one
        handshakes = (a.stats["handshake_ok"], b.stats["handshake_ok"])
        new_addr = _rebind(la, asyncio.get_running_loop())
        assert new_addr != first_addr
        await async_wait_until(lambda: lb.addr == new_addr, 5, "b follows a to its new address")
        assert lb.roams == 1 and REGISTRY.value("meshgate_mesh_udp_link_roamed_total") == roamed + 1
        moved = f"peer moved from 127.0.0.1:{first_addr[1]} to 127.0.0.1:{new_addr[1]}"
        assert any(moved in r.getMessage() and r.levelno == logging.INFO for r in caplog.records)
        assert listener.by_addr == {new_addr: lb} and listener.by_id == {lb.local_id: lb}
        data = os.urandom(2 << 20)
        assert await stream_sha(a, b.node_id, sport, data) == hashlib.sha256(data).digest()
        # the same sessions, no new handshake, still hearing each other a dead timer later
        assert _udp_links(a) == [la] and _udp_links(b) == [lb]
        assert (a.stats["handshake_ok"], b.stats["handshake_ok"]) == handshakes == (1, 1)
        later = asyncio.get_running_loop().time() + 2.2
        await async_wait_until(lambda: min(la.last_rx, lb.last_rx) > later, 6, "pings a dead timer later")
        assert _udp_links(a) == [la] and _udp_links(b) == [lb] and b.stats["link_dead"] == 0
        assert a.stats["link_dead"] == 0 and lb.addr == new_addr
    finally:
        stray.close()
        srv.close()
        await stop_all([a, b])


async def test_tun_bundles_fit_one_udp_packet() -> None:
    """The TUN path bundles what one read brought for a node only up to what the next hop
    carries whole: over a udp:// link a bundle cut into pieces would be lost whole with any
    one of them, so each leaves in one packet (small packets still share one)."""
    from meshgate.mesh import tun_packets as tp
    from meshgate.mesh.frames import FRAME
    from meshgate.mesh.tun import TunPath
    from meshgate.mesh.udp_session import ACK, DATA_OVERHEAD, DGRAM
    from tests.unit.test_tun_packets import ipv4

    b = await start_node(node_config("b", "10.9.0.2/24", listen=["udp://127.0.0.1:0"]))
    a = await start_node(node_config("a", "10.9.0.1/24", peers=[b.listen_addrs[0]]))
    loop = asyncio.get_running_loop()
    socks: list[socket.socket] = []
    paths: list[TunPath] = []
    try:
        await async_wait_until(lambda: converged([a, b]), 10, "link")
        assert a.datagram_room(b.node_id) == 1472 - DATA_OVERHEAD - ACK.size - DGRAM.size - FRAME.size - 2
        hosts = {}
        for svc, ip in ((a, "10.9.0.1"), (b, "10.9.0.2")):
            dev, host = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
            host.setblocking(False)
            socks += [dev, host]
            path = TunPath(loop, dev.fileno(), svc, ipaddress.IPv4Address(ip), None, 1380, egress=False)
            path.start()
            paths.append(path)
            hosts[svc.node_id] = host
        src, dst = ipaddress.IPv4Address("10.9.0.1").packed, ipaddress.IPv4Address("10.9.0.2").packed
        sent = [ipv4(src, dst, tp.PROTO_UDP, i.to_bytes(2, "big") + os.urandom(n))
                for i, n in enumerate([1200] * 20 + [40] * 40)]
        (link,) = _udp_links(a)
        before = link.session.packets_out
        for p in sent:  # written before the loop runs: one read batch, one bundle pass
            hosts[a.node_id].send(p)
        got: list[bytes] = []
        while len(got) < len(sent):
            got.append(await asyncio.wait_for(loop.sock_recv(hosts[b.node_id], 65536), 5))
        assert sorted(g[20:] for g in got) == sorted(p[20:] for p in sent)
        assert link.session.fragmented_out == 0  # nothing was cut into pieces
        # the 40 small ones shared packets: far fewer packets than IP packets
        assert link.session.packets_out - before < 20 + 10
    finally:
        for path in paths:
            path.stop()
        await stop_all([a, b])
        for s in socks:
            s.close()


class _GsoRefused(socket.socket):
    """A socket whose UDP_SEGMENT sends fail as on a device without checksum offload (EIO)."""

    calls = 0

    def sendmsg(self, buffers: Any, ancdata: Any = (), flags: int = 0, address: Any = None) -> int:
        type(self).calls += 1
        if type(self).calls > 1000:
            raise RuntimeError("sendmsg called in a loop")
        if any(level == link_udp.SOL_UDP and kind == link_udp.UDP_SEGMENT for level, kind, _ in ancdata):
            raise OSError(errno.EIO, "Input/output error")
        return super().sendmsg(buffers, ancdata, flags) if address is None else super().sendmsg(
            buffers, ancdata, flags, address)


async def test_gso_refused_by_the_device_falls_back_to_one_send_per_packet() -> None:
    """The first UDP_SEGMENT send failing with EIO turns GSO off for the socket; the same
    packets, and later ones, go one by one, in order."""
    rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    rx.bind(("127.0.0.1", 0))
    rx.settimeout(5.0)
    tx = _GsoRefused(socket.AF_INET, socket.SOCK_DGRAM)
    tx.setblocking(False)
    tx.connect(rx.getsockname())
    loop = asyncio.get_running_loop()
    usock = link_udp.UdpSocket(loop, tx, lambda *_: None, LimitsConfig(), connected=True)
    try:
        require(usock.gso, "UDP_SEGMENT (GSO) in this kernel")
        packets = [bytes([i]) * 1400 for i in range(10)] + [b"\xaa" * 300]
        usock.send(None, packets)
        usock.send(None, packets[:3])
        got = [rx.recv(2048) for _ in range(len(packets) + 3)]
        assert got == packets + packets[:3]
        assert not usock.gso and usock.gso_batches == 0 and usock.sent == len(packets) + 3
    finally:
        usock.close()
        rx.close()
