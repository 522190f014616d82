"""NAT traversal on loopback (no NAT): two nodes that only know a relay find a direct
udp:// link by themselves, traffic takes it, and what an attacker sends is dropped.
The NAT cases (port-restricted, symmetric, one LAN, a flushed mapping) are in
tests/system/test_traversal_netns.py."""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import os
import socket
import time

from meshgate.mesh.frames import TRAVERSAL
from meshgate.mesh.identity import Identity
from meshgate.mesh.service import MeshService
from meshgate.mesh.traversal import LOCAL, PING, REFLEXIVE, encode_call, probe_key, seal_probe
from meshgate.metrics import REGISTRY
from tests.helpers import async_wait_until
from tests.mesh_testing import Collector, converged, node_config, sha_server, start_node, stop_all, stream_sha


async def _line(traversal_a: bool = True, traversal_c: bool = True, **mesh: object) -> list[MeshService]:
    b = await start_node(node_config("b", "10.9.0.2/24", listen=["udp://127.0.0.1:0"], traversal=True))
    url = b.listen_addrs[0]
    a = await start_node(node_config("a", "10.9.0.1/24", peers=[url], traversal=traversal_a, **mesh))
    c = await start_node(node_config("c", "10.9.0.3/24", peers=[url], traversal=traversal_c, **mesh))
    await async_wait_until(lambda: converged([a, b, c]), 15, "a - b - c over udp://")
    return [a, b, c]


def _direct(x: MeshService, y: MeshService) -> bool:
    return y.node_id in x.links and x.node_id in y.links


def _forwarded(nodes: list[MeshService]) -> float:
    """Frames relayed so far, as the metric counts them once the nodes' counts are flushed."""
    for n in nodes:
        n.flush_counts()
    return REGISTRY.value("meshgate_mesh_frames_forwarded_total")


async def _sha(src: MeshService, dst: MeshService, port: int, data: bytes) -> bytes:
    return await stream_sha(src, dst.node_id, port, data)


async def test_relayed_traffic_punches_a_direct_link_and_takes_it() -> None:
    nodes = await _line()
    a, _b, c = nodes
    srv, port = await sha_server()
    try:
        assert not _direct(a, c)
        # the first stream goes through b and asks for a direct path
        data = os.urandom(1 << 20)
        assert await _sha(a, c, port, data) == hashlib.sha256(data).digest()
        await async_wait_until(lambda: _direct(a, c), 10, "a direct link a - c by traversal")

        def one_hop() -> bool:  # both ways: a stream keeps the link its first frame took, each end
            there = a.lookup(ipaddress.ip_address("10.9.0.3"))
            back = c.lookup(ipaddress.ip_address("10.9.0.1"))
            return (there is not None and there.hops == 1 and there.next_hop == c.node_id
                    and back is not None and back.hops == 1)

        await async_wait_until(one_hop, 10, "a's and c's routes over the direct link")
        paths = {p["name"]: p["path"] for p in a.peers()}
        assert paths["b"] == "configured" and paths["c"].startswith("direct (traversal, ")
        assert a.traversal is not None and a.traversal.stats.get("succeeded", 0) >= 1

        relayed_before = _forwarded(nodes)
        big = os.urandom(8 << 20)
        assert await _sha(a, c, port, big) == hashlib.sha256(big).digest()
        # nothing of it went through b
        assert _forwarded(nodes) - relayed_before < 20
        status = a.status()["traversal"]
        assert isinstance(status, dict)
        assert any(e.startswith("reflexive 127.0.0.1:") for e in status["endpoints"])
    finally:
        srv.close()
        await stop_all(nodes)


async def test_a_call_that_comes_after_the_link_names_the_kind_of_its_address() -> None:
    """A link can come up from the peer's first ping, from an address not yet heard of (taken as
    peer-reflexive), before the peer's relayed call arrives. The call, when it comes, says what
    that address is: `/peers` shows it (here: the call names it local)."""
    nodes = await _line()
    a, _b, c = nodes
    srv, port = await sha_server()
    try:
        data = os.urandom(1 << 16)
        assert await _sha(a, c, port, data) == hashlib.sha256(data).digest()
        await async_wait_until(lambda: _direct(a, c), 10, "a direct link a - c by traversal")
        (link,) = [k for k in a.links[c.node_id] if k.traversal_kind]
        link.traversal_kind = REFLEXIVE  # as if it had come from c's first ping
        host, lport = link.addr[:2]  # type: ignore[attr-defined]
        assert c.send_traversal(a.node_id, encode_call([(LOCAL, (host, lport))], answer=False))

        def path() -> str:
            return str({p["name"]: p["path"] for p in a.peers()}["c"])

        await async_wait_until(lambda: path() == "direct (traversal, local)", 10, "the label from c's call")
        assert a.traversal is not None and a.traversal.stats.get("call_while_direct", 0) >= 1
    finally:
        srv.close()
        await stop_all(nodes)


async def test_a_stream_running_when_the_direct_link_comes_moves_to_it_in_order() -> None:
    """A bulk stream that started through the relay: when the direct link's route appears it
    holds its new bytes until all it sent through b arrived (STREAM_WINDOW 0 asks c for its
    credit back), then goes on over the direct link. sha256 intact; most bytes went direct."""
    nodes = await _line()
    a, _b, c = nodes
    srv, port = await sha_server()
    try:
        data = os.urandom(48 << 20)
        task = asyncio.ensure_future(_sha(a, c, port, data))
        await async_wait_until(lambda: _direct(a, c) or task.done(), 20, "direct link during the transfer")
        assert not task.done()
        # the route takes the direct link once both ends' records list it (up to
        # FIRST_RTT_WAIT + ORIGINATE_GAP later, by design): then the stream moves
        await async_wait_until(lambda: a.stats["streams_moved"] >= 1 or task.done(), 10, "the move")
        assert not task.done(), "the transfer ended before its stream moved"
        forwarded = _forwarded(nodes)
        assert await task == hashlib.sha256(data).digest()
        # after the move b carries at most what was in flight (one 1 MiB window: 16 frames),
        # not the rest of the data (the 48 MiB are ~770 frames; a bound on the whole run, < 600,
        # failed at 623 when the direct route came late beside a fast transfer)
        assert _forwarded(nodes) - forwarded < 32
    finally:
        srv.close()
        await stop_all(nodes)


async def test_a_quiet_stream_moves_to_the_direct_link() -> None:
    """A long-lived stream (an SSH session, a kept-alive HTTP connection) that started through
    the relay takes the direct link: its next frame, once its bytes arrived, goes direct."""

    async def echo(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while line := await r.readline():
            w.write(line)
            await w.drain()
        w.close()

    nodes = await _line()
    a, b, c = nodes
    srv = await asyncio.start_server(echo, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    try:
        transport, proto = await a.open_stream(c.node_id, "127.0.0.1", port, Collector)
        assert isinstance(proto, Collector) and proto.transport is not None
        proto.transport.write(b"one\n")
        await async_wait_until(lambda: bytes(proto.buf) == b"one\n", 5, "the first echo (relayed)")
        key = next(iter(a._pinned[c.node_id]))

        def pinned_to(nid: int) -> bool:
            link = a._pinned[c.node_id].get(key)
            return link is not None and link.peer is not None and link.peer.node_id == nid

        assert pinned_to(b.node_id)
        await async_wait_until(lambda: _direct(a, c) and (r := a.lookup(ipaddress.ip_address("10.9.0.3")))
                               is not None and r.hops == 1, 10, "the direct link and route")
        for i in range(2, 6):  # each write may first drain (the peer returns its credit), then move
            proto.transport.write(b"%d\n" % i)
            await async_wait_until(lambda i=i: bytes(proto.buf).endswith(b"%d\n" % i), 5, f"echo {i}")
        assert bytes(proto.buf) == b"one\n2\n3\n4\n5\n"
        assert pinned_to(c.node_id) and a.stats["streams_moved"] >= 1
        transport.close()
    finally:
        srv.close()
        await stop_all(nodes)


async def test_traversal_off_never_probes() -> None:
    nodes = await _line(traversal_a=False)
    a, b, c = nodes
    srv, port = await sha_server()
    try:
        assert a.traversal is None and "mesh.traversal = false" in a.status()["traversal"]
        assert b.traversal is not None and c.traversal is not None

        def sent_by_others() -> int:  # probes b and c sent (one process: the metric is shared)
            assert b.traversal is not None and c.traversal is not None
            return sum(t.stats.get(k, 0) for t in (b.traversal, c.traversal)
                       for k in ("discovery_pings", "pongs_out", "probes_out"))

        before = REGISTRY.value("meshgate_mesh_traversal_probes_total", "out") - sent_by_others()
        calls_dropped = REGISTRY.value("meshgate_mesh_frames_dropped_total", "traversal_off")
        data = os.urandom(1 << 20)
        for _ in range(3):
            assert await _sha(a, c, port, data) == hashlib.sha256(data).digest()
            assert await _sha(c, a, port, data) == hashlib.sha256(data).digest()
        # c calls a (its traffic is relayed); a drops the call, and neither answers nor probes
        await async_wait_until(
            lambda: REGISTRY.value("meshgate_mesh_frames_dropped_total", "traversal_off") > calls_dropped,
            5, "a dropping c's call")
        assert not _direct(a, c)
        assert c.traversal.stats.get("attempts", 0) >= 1 and c.traversal.stats.get("probes_out", 0) == 0
        assert REGISTRY.value("meshgate_mesh_traversal_probes_total", "out") - sent_by_others() == before
    finally:
        srv.close()
        await stop_all(nodes)


async def test_forged_probes_and_calls_are_dropped_and_counted() -> None:
    nodes = await _line()
    a, b, c = nodes
    try:
        assert c.traversal is not None
        port = c.traversal.port
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.bind(("127.0.0.1", 0))
        now_ms = int(time.time() * 1000)

        def dropped(reason: str) -> int:
            return c.traversal.stats.get(f"dropped_{reason}", 0) if c.traversal else 0

        # a stranger's key (not a member): no record to open it with
        stranger = Identity.generate()
        from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

        key = probe_key(stranger.dh_private, c.identity.public[32:], "testnet")
        sock.sendto(seal_probe(ChaCha20Poly1305(key), stranger.node_id, PING, b"x" * 8, now_ms, c.node_id),
                    ("127.0.0.1", port))
        # a member's id, sealed with the wrong key (an attacker who knows a's id, not its key)
        sock.sendto(seal_probe(ChaCha20Poly1305(key), a.node_id, PING, b"y" * 8, now_ms, c.node_id),
                    ("127.0.0.1", port))
        # a's real key: answered once, the same packet again is a replay
        real = ChaCha20Poly1305(probe_key(a.identity.dh_private, c.identity.public[32:], "testnet"))
        good = seal_probe(real, a.node_id, PING, b"z" * 8, now_ms, c.node_id)
        sock.sendto(good, ("127.0.0.1", port))
        sock.sendto(good, ("127.0.0.1", port))
        # an old one (captured a minute ago)
        old = seal_probe(real, a.node_id, PING, b"w" * 8, now_ms - 60_000, c.node_id)
        sock.sendto(old, ("127.0.0.1", port))
        await async_wait_until(
            lambda: dropped("unknown_sender") >= 1 and dropped("bad_seal") >= 1 and dropped("replayed") >= 1
            and dropped("stale") >= 1, 5, "each forged probe counted",
        )
        sock.settimeout(2)
        answer, _ = sock.recvfrom(2048)  # the one genuine ping got its pong
        assert answer[0] == 0x20
        # and it was the only pong: nothing answered the forged, replayed or stale ones
        assert c.traversal.stats.get("pongs_out", 0) == 1

        # a relay forging a call in a's name: unsealed, so dropped as such; nothing learned
        before = c.stats["e2e_dropped_unsealed_relayed"]
        link = b.links[c.node_id][0]
        link.send_frame(TRAVERSAL, 0, 8, a.node_id, c.node_id, encode_call([(2, ("192.0.2.1", 9))], True))
        await async_wait_until(lambda: c.stats["e2e_dropped_unsealed_relayed"] > before, 5,
                               "forged call dropped")
        pair = c.traversal.pairs.get(a.node_id, create=False)
        assert pair is None or ("192.0.2.1", 9) not in pair.candidates
        # and a malformed call from a genuine neighbour is counted, not a crash
        link.send_frame(TRAVERSAL, 0, 8, b.node_id, c.node_id, b"\x01\x01\x09")
        await async_wait_until(lambda: dropped("malformed") >= 1, 5, "malformed call counted")
        sock.close()
    finally:
        await stop_all(nodes)


async def test_an_idle_direct_link_closes_and_the_relay_carries_on() -> None:
    nodes = await _line(traversal_idle=1.5)
    a, _b, c = nodes
    srv, port = await sha_server()
    try:
        data = os.urandom(1 << 20)
        assert await _sha(a, c, port, data) == hashlib.sha256(data).digest()
        await async_wait_until(lambda: _direct(a, c), 10, "a direct link a - c")
        await async_wait_until(lambda: not _direct(a, c), 10, "the idle direct link closed")
        assert a.traversal is not None and c.traversal is not None
        assert a.traversal.stats.get("closed_idle", 0) + c.traversal.stats.get("closed_idle", 0) >= 1
        # traffic still flows (through b), and asks for a direct link again
        assert await _sha(a, c, port, data) == hashlib.sha256(data).digest()
        await async_wait_until(lambda: _direct(a, c), 15, "direct again once there is traffic")
    finally:
        srv.close()
        await stop_all(nodes)


async def test_no_punching_for_a_node_the_access_rules_keep_out() -> None:
    from meshgate.config import from_dict
    from meshgate.egress.acl import Acl, Source

    nodes = await _line()
    a, _b, c = nodes
    srv, port = await sha_server()
    try:
        rules = from_dict({"acl": [{"from": ["node:b"], "to": ["self:22"]}]}).acl
        acl = Acl(rules)
        assert acl.admits(Source(2, "b")) and not acl.admits(Source(1, "a"))
        # c's rules let only b in: a's call is dropped, no probe goes to a, no link
        c.traversal_allowed = lambda nid: acl.admits(
            Source(nid, c.table.records[nid].name if nid in c.table.records else ""))
        data = os.urandom(256 << 10)
        for _ in range(3):
            assert await _sha(a, c, port, data) == hashlib.sha256(data).digest()
        assert c.traversal is not None and a.traversal is not None
        await async_wait_until(lambda: c.traversal is not None
                               and c.traversal.stats.get("dropped_acl", 0) >= 1, 5, "a's call refused by c")
        assert c.traversal.stats.get("probes_out", 0) == 0 and not _direct(a, c)
    finally:
        srv.close()
        await stop_all(nodes)


async def test_status_says_why_traversal_is_off_without_udp_links() -> None:
    b = await start_node(node_config("b", "10.9.0.2/24", listen=["tcp://127.0.0.1:0"], traversal=True))
    try:
        assert b.traversal is None
        assert b.traversal_text() == "off: no udp:// link in mesh.listen or mesh.peers"
    finally:
        await stop_all([b])


async def test_mesh_addresses_are_never_endpoints() -> None:
    """A TUN node's meshgate0 address is one of its interface addresses: a direct link to it
    would run inside the mesh (found by tests/system/test_tun_mesh.py: the links collapsed)."""
    nodes = await _line()
    a, _b, c = nodes
    try:
        assert a.traversal is not None and c.traversal is not None
        a.traversal._local_cache = (a.loop.time(), ["10.9.0.1", "10.9.0.77", "192.0.2.55"])
        eps = [ep for _kind, ep in a.traversal.endpoints()]
        assert ("192.0.2.55", a.traversal.port) in eps
        assert all(not h.startswith("10.9.0.") for h, _ in eps)  # own and other virtual IPs
        # and a call that lists one: that endpoint is dropped, counted, never probed
        call = encode_call([(1, ("10.9.0.1", 4000)), (2, ("192.0.2.9", 5))], True)
        c.traversal.on_call(a.node_id, memoryview(call))
        pair = c.traversal.pairs.get(a.node_id, create=False)
        assert pair is not None and list(pair.candidates) == [("192.0.2.9", 5)]
        assert c.traversal.stats.get("dropped_mesh_address", 0) == 1
    finally:
        await stop_all(nodes)
