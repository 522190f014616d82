"""Handshake failures, dead links, relays dying, restarts, duplicates, policies."""

from __future__ import annotations

import asyncio
import ipaddress
import time

from meshgate.mesh.frames import RECORD, RECORD_EXTRA
from meshgate.mesh.link_ring import RingTransport
from meshgate.mesh.service import MeshService
from meshgate.metrics import REGISTRY
from meshgate.replies import NETWORK_UNREACHABLE
from tests.helpers import async_wait_until
from tests.mesh_testing import (
    Collector,
    converged,
    node_config,
    ring_line,
    ring_name,
    start_node,
    stop_all,
    write_all,
)

ip = ipaddress.ip_address


async def test_wrong_secret_and_wrong_network_fail_on_both_sides() -> None:
    hub = await start_node(node_config("hub", "10.9.0.1/24", listen=["tcp://127.0.0.1:0"]))
    url = hub.listen_addrs[0]
    good = await start_node(node_config("good", "10.9.0.2/24", peers=[url]))
    bad_secret = await start_node(node_config("bad1", "10.9.0.3/24", peers=[url], secret="wrong secret!"))
    bad_net = await start_node(node_config("bad2", "10.9.0.4/24", peers=[url], network="othernet"))
    nodes = [hub, good, bad_secret, bad_net]
    try:
        await async_wait_until(lambda: converged([hub, good]), 10, "good node")
        await async_wait_until(
            lambda: (
                bad_secret.stats["handshake_failed"] >= 1
                and bad_net.stats["handshake_failed"] >= 1
                and hub.stats["handshake_failed_handshake"] >= 2
            ),
            10,
            "failures counted on both sides",
        )
        assert hub.stats["handshake_ok"] >= 1
        # nothing learned: no routes, names or links either way
        for bad in (bad_secret, bad_net):
            assert set(bad.table.records) == {bad.node_id}
            assert bad.links == {} and bad.name_table() == {
                bad.config.node.name: (bad.config.node.ipv4.ip, None)
            }  # type: ignore[union-attr]
        assert set(hub.table.records) == {hub.node_id, good.node_id} == set(good.table.records)
        assert hub.lookup(ip("10.9.0.3")) is None and good.lookup(ip("10.9.0.4")) is None
        assert REGISTRY.value("meshgate_mesh_handshakes_total", "failed_handshake") >= 2
    finally:
        await stop_all(nodes)


async def test_a_loop_that_ran_late_does_not_close_its_live_links() -> None:
    """Both ends in one process, the loop blocked for longer than dead_after (a busy host, many
    nodes in one interpreter): when it runs again each side's tick comes before anything it has
    not read yet, and neither has pinged. The links stay; only a link silent at two ticks closes."""
    limits = {"mesh_ping_interval": 0.2, "mesh_dead_after": 0.6}
    r = ring_name()
    a = await start_node(node_config("a", "10.9.0.1/24", listen=[f"ring://{r}"], limits=limits))
    b = await start_node(node_config("b", "10.9.0.2/24", peers=[f"ring://{r}"], limits=limits))
    try:
        await async_wait_until(lambda: converged([a, b]), 10, "routes")
        link = a.links[b.node_id][0]
        loop = asyncio.get_running_loop()
        loop.call_soon(time.sleep, 1.5)  # the starvation under test, not a wait
        ticks = a._ticks
        await async_wait_until(lambda: a._ticks >= ticks + 5, 10, "five ticks after the stall")
        assert a.stats["link_dead"] == 0 and b.stats["link_dead"] == 0
        assert a.links[b.node_id] == [link]
    finally:
        await stop_all([a, b])


async def test_stalled_handshake_times_out_and_pending_is_bounded() -> None:
    limits = {"handshake_timeout": 0.3, "max_pending_handshakes": 2}
    hub = await start_node(node_config("hub", listen=["tcp://127.0.0.1:0"], limits=limits))
    host, port = hub.listen_addrs[0].removeprefix("tcp://").rsplit(":", 1)
    conns = [await asyncio.open_connection(host, int(port)) for _ in range(4)]
    try:
        await async_wait_until(
            lambda: hub.stats["handshake_failed_too_many_pending"] >= 2, 5, "pending bound"
        )
        await async_wait_until(lambda: hub.stats["handshake_failed_timeout"] >= 2, 5, "handshake timeout")
        for r, _ in conns:  # every silent client was closed, and got not a single byte
            assert await asyncio.wait_for(r.read(), 5) == b""
        assert not hub.pending
    finally:
        for _, w in conns:
            w.close()
        await stop_all([hub])


async def test_silent_link_is_declared_dead_and_routes_withdrawn_within_10s() -> None:
    r = ring_name()
    a = await start_node(node_config("a", "10.9.0.1/24", listen=[f"ring://{r}"]))
    b = await start_node(node_config("b", "10.9.0.2/24", peers=[f"ring://{r}"]))
    try:
        await async_wait_until(lambda: converged([a, b]), 10, "routes")
        link = a.links[b.node_id][0]
        assert isinstance(link.transport, RingTransport)
        # the wire goes silent both ways (no FIN, no RST): only the ping timeout can notice
        link.transport.blackhole = True
        assert link.transport.peer is not None
        link.transport.peer.blackhole = True
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await async_wait_until(lambda: a.lookup(ip("10.9.0.2")) is None, 10, "route withdrawn")
        assert loop.time() - t0 < 10
        assert a.stats["link_dead"] == 1
        # b keeps reconnecting with backoff and the mesh heals
        await async_wait_until(lambda: converged([a, b]), 10, "reconnect")
    finally:
        await stop_all([a, b])


async def _square() -> tuple[list[MeshService], list[str]]:
    """A-B-C and A-D-C: two equal-hop paths from A to C."""
    rings = [ring_name() for _ in range(4)]
    a = await start_node(
        node_config("a", "10.9.0.1/24", listen=[f"ring://{rings[0]}", f"ring://{rings[1]}"]),
    )
    b = await start_node(
        node_config("b", "10.9.0.2/24", peers=[f"ring://{rings[0]}"], listen=[f"ring://{rings[2]}"]),
    )
    d = await start_node(
        node_config("d", "10.9.0.4/24", peers=[f"ring://{rings[1]}"], listen=[f"ring://{rings[3]}"]),
    )
    c = await start_node(
        node_config("c", "10.9.0.3/24", peers=[f"ring://{rings[2]}", f"ring://{rings[3]}"]),
    )
    nodes = [a, b, c, d]
    await async_wait_until(lambda: converged(nodes), 10, "square")
    return nodes, rings


async def test_killing_a_relay_reroutes() -> None:
    nodes, _ = await _square()
    a, b, c, d = nodes
    try:
        r = a.lookup(ip("10.9.0.3"))
        assert r is not None and r.next_hop in (b.node_id, d.node_id) and r.hops == 2
        relay, other = (b, d) if r.next_hop == b.node_id else (d, b)
        await relay.stop()
        await async_wait_until(
            lambda: (x := a.lookup(ip("10.9.0.3"))) is not None and x.next_hop == other.node_id, 10, "reroute"
        )
        got: list[bytes] = []
        c.on_datagram(1, lambda src, p: got.append(p))
        assert a.send_datagram(c.node_id, 1, b"after reroute")
        await async_wait_until(lambda: got == [b"after reroute"], 5, "datagram via the other relay")
        gone = relay.config.node.ipv4.ip  # type: ignore[union-attr]
        await async_wait_until(lambda: a.lookup(gone) is None, 5, "the stopped relay withdrawn")
    finally:
        await stop_all(nodes)


async def test_restarted_node_resyncs_fully() -> None:
    r = ring_name()
    a = await start_node(node_config("a", "10.9.0.1/24", listen=[f"ring://{r}"]))
    c1 = await start_node(node_config("c", "10.9.0.3/24", peers=[f"ring://{r}"]))
    try:
        await async_wait_until(lambda: converged([a, c1]), 10, "first life")
        old_session = a.table.records[c1.node_id].session
        await c1.stop()
        await async_wait_until(lambda: a.lookup(ip("10.9.0.3")) is None, 10, "c gone")
        # the same node (its key, so its id), a new session and a new address: made directly
        # with c1's identity (start_node would give it a fresh one)
        c2 = await start_node(node_config("c", "10.9.0.33/24", peers=[f"ring://{r}"]), c1.identity)
        try:
            await async_wait_until(lambda: converged([a, c2]), 10, "second life")
            assert c2.node_id == c1.node_id
            assert a.table.records[c2.node_id].session == c2.session != old_session
            await async_wait_until(lambda: a.lookup(ip("10.9.0.33")) is not None, 5, "new record")
            assert a.lookup(ip("10.9.0.3")) is None
            assert c2.table.records[a.node_id] == a.table.local  # c2 started empty and got a's record again
        finally:
            await c2.stop()
    finally:
        await stop_all([a, c1])


async def test_duplicate_virtual_ip_has_one_winner_everywhere() -> None:
    r1, r2 = ring_name(), ring_name()
    hub = await start_node(node_config("hub", "10.9.0.1/24", listen=[f"ring://{r1}", f"ring://{r2}"]))
    x = await start_node(node_config("x", "10.9.0.9/24", peers=[f"ring://{r1}"]))
    y = await start_node(node_config("y", "10.9.0.9/24", peers=[f"ring://{r2}"]))
    nodes = [hub, x, y]
    try:
        await async_wait_until(lambda: converged(nodes), 10, "routes")
        for n in nodes:
            route = n.lookup(ip("10.9.0.9"))
            # the lower node id of the two claimants, on every node
            assert route is not None and route.node_id == min(x.node_id, y.node_id)
        assert REGISTRY.value("meshgate_mesh_duplicate_total", "virtual_ip") >= 1
    finally:
        await stop_all(nodes)


async def test_least_hop_and_least_latency_choose_different_paths() -> None:
    r1, r2, r3 = ring_name(), ring_name(), ring_name()
    a = await start_node(
        node_config("a", "10.9.0.1/24", listen=[f"ring://{r1}", f"ring://{r3}"], policy="least-latency"),
    )
    b = await start_node(node_config("b", "10.9.0.2/24", peers=[f"ring://{r1}"], listen=[f"ring://{r2}"]))
    # the direct a-c link is slow: 25 ms each way
    c = await start_node(
        node_config("c", "10.9.0.3/24", peers=[f"ring://{r2}", f"ring://{r3}?delay=0.025"]),
    )
    nodes = [a, b, c]
    try:
        await async_wait_until(lambda: converged(nodes), 10, "routes")
        # wait for the direct link, then for its measured latency to reach the records
        await async_wait_until(
            lambda: (p := a.table.hop_paths.get(c.node_id)) is not None and p.hops == 1, 10, "a-c"
        )
        await async_wait_until(
            lambda: (p := a.table.lat_paths.get(c.node_id)) is not None and p.next_hop == b.node_id,
            10,
            "latency measured",
        )
        hop = a.table.hop_paths[c.node_id]
        assert (hop.next_hop, hop.hops) == (c.node_id, 1)
        assert a.table.lat_paths[c.node_id].hops == 2
        route = a.lookup(ip("10.9.0.3"))  # a's policy is least-latency
        assert route is not None and route.next_hop == b.node_id and route.hops == 2
        got: list[bytes] = []
        c.on_datagram(2, lambda src, p: got.append(p))
        a.send_datagram(c.node_id, 2, b"fast path")
        await async_wait_until(lambda: got == [b"fast path"], 5, "datagram")
        assert b.stats is not None
    finally:
        await stop_all(nodes)


async def test_forged_records_on_a_live_link_are_dropped_and_counted() -> None:
    r = ring_name()
    a = await start_node(node_config("a", "10.9.0.1/24", listen=[f"ring://{r}"]))
    b = await start_node(node_config("b", "10.9.0.2/24", peers=[f"ring://{r}"]))
    try:
        await async_wait_until(lambda: converged([a, b]), 10, "routes")
        transport = b.links[a.node_id][0].transport
        assert isinstance(transport, RingTransport)
        body = bytes(64)
        for counter in (10_000, 10_001, 10_002):  # well-formed headers, garbage ciphertext
            transport.write(RECORD.pack(len(body) + RECORD_EXTRA, 0, counter) + body)
        await async_wait_until(lambda: a.stats["records_forged"] == 3, 5, "forgeries counted")
        got: list[bytes] = []
        a.on_datagram(9, lambda src, p: got.append(p))
        assert b.send_datagram(a.node_id, 9, b"still up")
        await async_wait_until(lambda: got == [b"still up"], 5, "link survives")
        assert REGISTRY.value("meshgate_mesh_records_dropped_total", "forged") >= 3
    finally:
        await stop_all([a, b])


async def test_max_peers_bounds_links() -> None:
    r = ring_name()
    hub = await start_node(node_config("hub", listen=[f"ring://{r}"], limits={"max_peers": 2}))
    spokes = [await start_node(node_config(f"s{i}", peers=[f"ring://{r}"])) for i in range(3)]
    try:
        await async_wait_until(lambda: hub.stats["too_many_links"] >= 1, 10, "a refused link")
        assert sum(map(len, hub.links.values())) == 2
    finally:
        await stop_all([hub, *spokes])


async def test_two_links_to_one_neighbour_survive_losing_one() -> None:
    r1, r2 = ring_name(), ring_name()
    a = await start_node(node_config("a", "10.9.0.1/24", listen=[f"ring://{r1}", f"ring://{r2}"]))
    # the second link is slower: the faster one carries the traffic
    b = await start_node(
        node_config("b", "10.9.0.2/24", peers=[f"ring://{r1}", f"ring://{r2}?delay=0.01"]),
    )
    try:
        await async_wait_until(lambda: len(b.links.get(a.node_id, ())) == 2, 10, "two links")
        await async_wait_until(lambda: all(lk.latency_us for lk in b.links[a.node_id]), 10, "both measured")
        await async_wait_until(lambda: b.lookup(ip("10.9.0.1")) is not None, 10, "route to a")
        assert len(b.peers()) == 2
        fast = min(b.links[a.node_id], key=lambda lk: lk.latency_us)
        assert b._best_link(a.node_id) is fast
        got: list[bytes] = []
        a.on_datagram(4, lambda src, p: got.append(p))
        assert fast.transport is not None
        fast.transport.close()
        await async_wait_until(lambda: len(b.links.get(a.node_id, ())) == 1, 5, "one link left")
        for _ in range(20):  # the neighbour stays reachable throughout
            assert b.lookup(ip("10.9.0.1")) is not None
            await asyncio.sleep(0.01)
        assert b.send_datagram(a.node_id, 4, b"via the other link")
        await async_wait_until(lambda: got == [b"via the other link"], 5, "datagram")
    finally:
        await stop_all([a, b])


async def test_an_open_is_answered_the_way_it_came_before_the_routes_catch_up() -> None:
    """A node that just (re)started opens a stream as soon as it has a route; the destination
    may not route back to it yet (its new record is still on its way): the ACCEPT goes back
    over the link the OPEN came in on."""
    served: list[bytes] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        served.append(b"x")
        writer.write(b"hello")
        await writer.drain()
        writer.close()

    srv = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    nodes = await ring_line()
    a, _, c = nodes
    try:
        c.table.forget([a.node_id])  # c has not heard of a (yet)
        c.table.build()
        assert c.table.path(a.node_id) is None
        _, proto = await a.open_stream(c.node_id, "127.0.0.1", port, Collector)
        assert await asyncio.wait_for(proto.done, 10) == b"hello"  # type: ignore[attr-defined]
        assert c.stats["sent_way_back"] >= 1
    finally:
        srv.close()
        await stop_all(nodes)


async def test_a_relay_lost_mid_stream_resets_the_stream_rather_than_leave_a_gap() -> None:
    """A-B-C and A-D-C on udp:// links; the relay a bulk stream takes stops mid-transfer. Its
    unacknowledged frames are gone with its link, so the stream is reset at both ends (the
    route moves to the other relay for new streams); before, it went on through the other
    relay with a hole in its bytes, or stalled for the credit that was lost."""
    import hashlib
    import os

    b = await start_node(node_config("b", "10.9.0.2/24", listen=["udp://127.0.0.1:0"]))
    d = await start_node(node_config("d", "10.9.0.4/24", listen=["udp://127.0.0.1:0"]))
    a = await start_node(node_config("a", "10.9.0.1/24", peers=[b.listen_addrs[0], d.listen_addrs[0]]))
    c = await start_node(node_config("c", "10.9.0.3/24", peers=[b.listen_addrs[0], d.listen_addrs[0]]))
    nodes = [a, b, c, d]
    got = hashlib.sha256()
    seen = {"n": 0}

    async def sink(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while chunk := await r.read(1 << 16):
            got.update(chunk)
            seen["n"] += len(chunk)
        w.close()

    srv = await asyncio.start_server(sink, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    try:
        await async_wait_until(lambda: converged(nodes), 15, "square over udp://")
        r = a.lookup(ip("10.9.0.3"))
        assert r is not None and r.hops == 2
        relay = b if r.next_hop == b.node_id else d
        transport, proto = await a.open_stream(c.node_id, "127.0.0.1", port, Collector)
        assert isinstance(proto, Collector)
        data = os.urandom(64 << 20)
        writer = asyncio.ensure_future(write_all(proto, data))
        await async_wait_until(lambda: seen["n"] > 4 << 20, 20, "the stream under way")
        await relay.stop()
        await asyncio.wait_for(proto.done, 30)  # ends one way or another, never hangs
        writer.cancel()
        if proto.lost is None:  # it completed: then every byte, in order
            assert seen["n"] == len(data) and got.digest() == hashlib.sha256(data).digest()
        else:
            from meshgate.mesh.streams import StreamError

            assert isinstance(proto.lost, StreamError) and proto.lost.code == NETWORK_UNREACHABLE, proto.lost
            assert a.stats["streams_reset_link_lost"] >= 1
        # new streams take the other relay
        transport2, _ = await a.open_stream(c.node_id, "127.0.0.1", port, Collector)
        transport.close()
        transport2.close()
    finally:
        srv.close()
        await stop_all(nodes)
