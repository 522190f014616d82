"""A node that restarts (same key, so the same id; a new session) mid-conversation: what its peers
held with its previous process (streams, the end-to-end session) ends once, at the first sign of
the new one, and what they set up with the new one stays, whichever of its HELLO, its end-to-end
handshake or its route record reaches them first.

a - b - c on ring links. b holds a's new record back from c (a relay's settle and flood may lag the
frames it relays at once), so c hears a's new process first through the end-to-end handshake and
only later through the record."""

from __future__ import annotations

import ipaddress
from collections.abc import Callable

from meshgate.mesh.routing import Record
from meshgate.mesh.service import MeshService
from meshgate.metrics import REGISTRY
from tests.helpers import async_wait_until
from tests.mesh_testing import Collector, echo_server, node_config, ring_name, start_node, stop_all


def ip(s: str) -> ipaddress.IPv4Address:
    return ipaddress.IPv4Address(s)


def _hold_records(b: MeshService, to: int, held: Callable[[Record], bool]) -> Callable[[], None]:
    """Make b keep the records `held` picks from `to` until the returned release is called."""
    original = b.table.records_to_send
    holding = True
    kept: set[int] = set()

    def records_to_send(nid: int, now: float) -> list[Record]:
        out = original(nid, now)
        if nid != to or not holding:
            return out
        kept.update(r.origin for r in out if held(r))
        return [r for r in out if not held(r)]

    def release() -> None:
        nonlocal holding
        holding = False
        sync = b.table._sync[to]
        for origin in kept:  # sent in b's next flood, as if they had just arrived
            sync.sent.pop(origin, None)
            sync.pending.add(origin)
        b._schedule_sync()

    b.table.records_to_send = records_to_send  # type: ignore[method-assign]
    return release


async def _line(a_ip: str = "10.9.0.1/24") -> tuple[MeshService, MeshService, MeshService, str]:
    r1, r2 = ring_name(), ring_name()
    b = await start_node(node_config("b", "10.9.0.2/24", listen=[f"ring://{r1}", f"ring://{r2}"]))
    a = await start_node(node_config("a", a_ip, peers=[f"ring://{r1}"]))
    c = await start_node(node_config("c", "10.9.0.3/24", peers=[f"ring://{r2}"]))
    return a, b, c, r1


async def test_state_made_with_the_new_process_before_its_record_arrives_is_kept() -> None:
    a, b, c, r1 = await _line()
    nodes = [a, b, c]
    srv, port = await echo_server()
    try:
        await async_wait_until(lambda: all(n.lookup(ip("10.9.0.3")) for n in (a, b)), 10, "routes")
        await async_wait_until(lambda: c.lookup(ip("10.9.0.1")) is not None, 10, "routes")
        # a conversation with a's first process: an end-to-end session and a stream at c
        t1, p1 = await a.open_stream(c.node_id, "127.0.0.1", port, Collector)
        assert isinstance(p1, Collector)
        t1.write(b"first life")  # type: ignore[attr-defined]
        await async_wait_until(lambda: bytes(p1.buf) == b"first life", 10, "the first echo")
        old_session = a.session
        release = _hold_records(b, c.node_id, lambda r: r.origin == a.node_id and r.session != old_session)
        await a.stop()
        # the same key, a new session, and an address only its new record carries
        a2 = await start_node(node_config("a", "10.9.0.11/24", peers=[f"ring://{r1}"]), a.identity)
        nodes.append(a2)
        assert a2.node_id == a.node_id and a2.session != old_session
        await async_wait_until(lambda: a2.lookup(ip("10.9.0.3")) is not None, 10, "a2 routes to c")
        # a2 talks to c while c still holds a's old record: the handshake is c's first sign of a2
        t2, p2 = await a2.open_stream(c.node_id, "127.0.0.1", port, Collector)
        assert isinstance(p2, Collector)
        t2.write(b"second life")  # type: ignore[attr-defined]
        await async_wait_until(lambda: bytes(p2.buf) == b"second life", 10, "the echo to a2")
        assert c.table.records[a.node_id].session == old_session  # still held back
        got: list[bytes] = []
        c.on_datagram(7, lambda src, p: got.append(p))
        a2.on_datagram(7, lambda src, p: got.append(p))
        # now c gets a2's record and builds with it (the new address is routed)
        release()
        await async_wait_until(lambda: c.lookup(ip("10.9.0.11")) is not None, 10, "c has a2's record")
        # ... and what it set up with a2 before that goes on: the stream, the session, both ways
        t2.write(b" goes on")  # type: ignore[attr-defined]
        await async_wait_until(lambda: bytes(p2.buf) == b"second life goes on", 10, "the stream after")
        assert a2.send_datagram(c.node_id, 7, b"to c")
        assert c.send_datagram(a2.node_id, 7, b"to a2")
        await async_wait_until(lambda: sorted(got) == [b"to a2", b"to c"], 10, "datagrams both ways")
        assert c.stats["e2e_dropped_unknown_session"] == 0 and a2.stats["e2e_dropped_unknown_session"] == 0
        assert c.stats["peer_restarts"] == 1  # once, at the handshake; not again at the record
        t2.close()
    finally:
        srv.close()
        await stop_all(nodes)


async def test_a_session_with_the_old_process_ends_when_the_new_one_is_known() -> None:
    """c set the session up with a's first process; a restarts and says nothing to c. Once c has
    a2's record, what c sends goes through a new session that a2 can open."""
    a, b, c, r1 = await _line()
    nodes = [a, b, c]
    try:
        await async_wait_until(lambda: c.lookup(ip("10.9.0.1")) is not None, 10, "routes")
        got: list[bytes] = []
        a.on_datagram(7, lambda src, p: got.append(p))
        assert c.send_datagram(a.node_id, 7, b"to the first")
        await async_wait_until(lambda: got == [b"to the first"], 10, "the first datagram")
        old = c.e2e.sessions[a.node_id]
        await a.stop()
        a2 = await start_node(node_config("a", "10.9.0.11/24", peers=[f"ring://{r1}"]), a.identity)
        nodes.append(a2)
        got2: list[bytes] = []
        a2.on_datagram(7, lambda src, p: got2.append(p))
        await async_wait_until(lambda: c.lookup(ip("10.9.0.11")) is not None, 10, "c has a2's record")
        assert c.e2e.sessions.get(a.node_id) is not old  # the old process's session is gone
        assert REGISTRY.value("meshgate_mesh_peer_restarts_total", "record") >= 1
        assert c.send_datagram(a2.node_id, 7, b"to the second")
        await async_wait_until(lambda: got2 == [b"to the second"], 10, "the datagram to a2")
    finally:
        await stop_all(nodes)


async def test_a_neighbour_restarting_keeps_what_it_opened_after_its_hello() -> None:
    """a and b are neighbours: b hears a2's HELLO first; a stream a2 opens at once outlives b's
    next route build (which sees a2's record with its new session)."""
    r = ring_name()
    b = await start_node(node_config("b", "10.9.0.2/24", listen=[f"ring://{r}"]))
    a = await start_node(node_config("a", "10.9.0.1/24", peers=[f"ring://{r}"]))
    nodes = [a, b]
    srv, port = await echo_server()
    try:
        await async_wait_until(lambda: b.lookup(ip("10.9.0.1")) is not None, 10, "routes")
        t1, p1 = await a.open_stream(b.node_id, "127.0.0.1", port, Collector)
        t1.write(b"one")  # type: ignore[attr-defined]
        await async_wait_until(lambda: bytes(p1.buf) == b"one", 10, "the first echo")
        await a.stop()
        a2 = await start_node(node_config("a", "10.9.0.11/24", peers=[f"ring://{r}"]), a.identity)
        nodes.append(a2)
        await async_wait_until(lambda: b.node_id in a2.table.hop_paths, 10, "a2 routes to b")
        t2, p2 = await a2.open_stream(b.node_id, "127.0.0.1", port, Collector)
        t2.write(b"two")  # type: ignore[attr-defined]
        await async_wait_until(lambda: bytes(p2.buf) == b"two", 10, "the echo to a2")
        await async_wait_until(lambda: b.lookup(ip("10.9.0.11")) is not None, 10, "b has a2's record")
        t2.write(b" three")  # type: ignore[attr-defined]
        await async_wait_until(lambda: bytes(p2.buf) == b"two three", 10, "the stream after the build")
        t2.close()
    finally:
        srv.close()
        await stop_all(nodes)
