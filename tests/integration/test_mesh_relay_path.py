"""The relay's per-frame path (MeshService.on_frame with its route cache) and the end node's
sealed send (E2e.seal_now): a - b - c on ring links, b relays.

A relayed frame leaves b with its hop count one lower and its body byte for byte as it came;
what b refused before the route cache (a frame at the hop limit, one for a node it has no route
to, one whose header lies about its length) it still refuses, warm cache or not; and a link
that goes is not used for the next frame even before the routes are rebuilt."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from meshgate.config import LinkUrl, parse_link_url
from meshgate.mesh.frames import (
    DEFAULT_HOP_LIMIT,
    FLAG_OPENER,
    FRAME,
    MAX_RECORD,
    PING,
    RECORD,
    SEALED,
    STREAM_OPEN,
    STREAM_RESET,
    U64,
    UNREACHABLE,
)
from meshgate.mesh.links import Link
from meshgate.mesh.service import UNREACH, MeshService
from meshgate.mesh.streams import RESET, encode_open
from meshgate.metrics import REGISTRY
from meshgate.replies import NETWORK_UNREACHABLE, TTL_EXPIRED
from tests.helpers import async_wait_until
from tests.mesh_testing import node_config, ring_name, start_node, stop_all, unused_id

Seen = tuple[int, int, int, int, int, bytes]  # type, flags, hop, src, dst, body
SPARE: dict[int, LinkUrl] = {}  # c's node id -> a third ring of b's, for a second link


@pytest.fixture
async def line() -> AsyncIterator[list[MeshService]]:
    r1, r2, r3 = ring_name(), ring_name(), ring_name()
    b = await start_node(node_config("b", "10.9.0.2/24", listen=[f"ring://{r}" for r in (r1, r2, r3)]))
    a = await start_node(node_config("a", "10.9.0.1/24", peers=[f"ring://{r1}"]))
    c = await start_node(node_config("c", "10.9.0.3/24", peers=[f"ring://{r2}"]))
    nodes = [a, b, c]
    SPARE[c.node_id] = parse_link_url(f"ring://{r3}")
    try:
        # b's routes too, built: a frame b relays while its build is held back builds first, and
        # a route found across a build is not cached (the tests below start from a warm cache)
        await async_wait_until(
            lambda: c.node_id in a.table.hop_paths and a.node_id in c.table.hop_paths
            and {a.node_id, c.node_id} <= set(b.table.hop_paths) and not b.table.dirty, 10, "routes"
        )
        yield nodes
    finally:
        await stop_all(nodes)


def _record(node: MeshService) -> list[Seen]:
    """Every end-to-end frame `node` receives (link-local ones pass unrecorded)."""
    seen: list[Seen] = []
    original = MeshService.on_frame.__get__(node, MeshService)

    def on_frame(link: Any, ftype: int, flags: int, hop: int, src: int, dst: int, body: memoryview) -> None:
        if src != dst and src and dst:
            seen.append((ftype, flags, hop, src, dst, bytes(body)))
        original(link, ftype, flags, hop, src, dst, body)

    node.on_frame = on_frame  # type: ignore[method-assign]
    return seen


def _link(frm: MeshService, to: MeshService) -> Link:
    link = frm.links[to.node_id][0]
    assert isinstance(link, Link)
    return link


def _forged(seen: list[Seen], body: bytes) -> list[Seen]:
    return [f for f in seen if f[5] == body]


async def test_relayed_frames_lose_one_hop_and_keep_their_bytes(line: list[MeshService]) -> None:
    a, b, c = line
    at_c = _record(c)
    to_b = _link(a, b)
    b.flush_counts()
    counted = REGISTRY.value("meshgate_mesh_frames_forwarded_total")
    bodies = [os.urandom(100) for _ in range(3)]
    for i, body in enumerate(bodies):  # the first fills b's route cache, the others use it
        to_b.send_frame(SEALED, 0, 5 + i, a.node_id, c.node_id, body)
        await async_wait_until(lambda body=body: bool(_forged(at_c, body)), 5, "the relayed frame")
    got = [_forged(at_c, body)[0] for body in bodies]
    want = [(SEALED, 4 + i, a.node_id, c.node_id) for i in range(3)]
    assert [(f[0], f[2], f[3], f[4]) for f in got] == want
    assert b._route_cache, "the relay answered from its route cache"
    # c dropped them (not sealed by a): the relay passed them on without reading them
    assert c.stats["e2e_dropped_unknown_session"] >= 3
    # counted in a plain int on the hot path, in the metric once flushed (every tick)
    b.flush_counts()
    assert REGISTRY.value("meshgate_mesh_frames_forwarded_total") - counted == 3 and b.relayed == 0


def _one_record(frm: Link, ftype: int, hop: int, src: int, dst: int, body: bytes) -> bytes:
    """What `frm` would write for this one frame (its codec's next record), not written."""
    frm.codec.send_frame(ftype, 0, hop, src, dst, body)
    return b"".join(frm.codec.data_to_send())


async def test_a_relayed_frame_is_written_before_the_read_that_brought_it_returns(
    line: list[MeshService],
) -> None:
    """b writes what a read made (the relayed frame) within that data_received call: no loop
    turn in between, and no flush left scheduled for later."""
    a, b, c = line
    at_c = _record(c)
    from_a, to_c = _link(b, a), _link(b, c)
    for _ in range(2):  # cold route cache, then warm
        body = os.urandom(64)
        record = _one_record(_link(a, b), SEALED, DEFAULT_HOP_LIMIT, a.node_id, c.node_id, body)
        sent = to_c.bytes_out
        from_a.data_received(record)
        assert to_c.bytes_out > sent and not to_c.codec.pending_bytes() and not to_c._flush_scheduled
        await async_wait_until(lambda body=body: bool(_forged(at_c, body)), 5, "the relayed frame")
        assert _forged(at_c, body)[0][2] == DEFAULT_HOP_LIMIT - 1


async def test_answers_on_the_link_read_from_wait_for_the_end_of_the_loop_tick(
    line: list[MeshService],
) -> None:
    """What a read makes for the link it came on (here b's PONG to a's PING) is not written
    within data_received but at the end of the loop tick, with whatever else that tick sends
    on the link (one record for many streams' frames under load)."""
    a, b, _c = line
    from_a = _link(b, a)
    record = _one_record(_link(a, b), PING, 1, a.node_id, b.node_id, U64.pack(12345))
    sent = from_a.bytes_out
    from_a.data_received(record)
    assert from_a._flush_scheduled and from_a.codec.pending_bytes() and from_a.bytes_out == sent
    await asyncio.sleep(0)
    assert not from_a.codec.pending_bytes() and from_a.bytes_out > sent


async def test_a_read_that_breaks_its_link_still_writes_what_it_relayed(line: list[MeshService]) -> None:
    """A read whose second record is broken (a length out of range) closes the link it came on;
    the frame its first record held was already handed to b's link to c and is written."""
    a, b, c = line
    at_c = _record(c)
    from_a, to_c = _link(b, a), _link(b, c)
    body = os.urandom(64)
    record = _one_record(_link(a, b), SEALED, DEFAULT_HOP_LIMIT, a.node_id, c.node_id, body)
    sent = to_c.bytes_out
    from_a.data_received(record + RECORD.pack(MAX_RECORD + 1, 0, 0))
    assert from_a.transport is not None and from_a.transport.is_closing()
    assert to_c.bytes_out > sent and not to_c._flush_scheduled
    await async_wait_until(lambda: bool(_forged(at_c, body)), 5, "the frame of the first record")


async def test_a_warm_relay_still_refuses_a_frame_at_the_hop_limit(line: list[MeshService]) -> None:
    a, b, c = line
    at_a, at_c = _record(a), _record(c)
    to_b = _link(a, b)
    warm = os.urandom(40)
    to_b.send_frame(SEALED, 0, DEFAULT_HOP_LIMIT, a.node_id, c.node_id, warm)
    await async_wait_until(lambda: bool(_forged(at_c, warm)), 5, "a frame through the warm cache")
    assert b._route_cache
    spent = os.urandom(40)
    to_b.send_frame(SEALED, 0, 1, a.node_id, c.node_id, spent)
    await async_wait_until(lambda: b.stats["hop_limit"] == 1, 5, "the hop limit")
    # the relay says so to the source (a sealed frame: UNREACHABLE with TTL_EXPIRED), and c
    # never sees the frame
    await async_wait_until(lambda: any(f[0] == UNREACHABLE for f in at_a), 5, "the refusal")
    refusal = next(f for f in at_a if f[0] == UNREACHABLE)
    assert refusal[3] == b.node_id and UNREACH.unpack(refusal[5]) == (c.node_id, TTL_EXPIRED)
    # an unsealed OPEN at the hop limit gets the STREAM_RESET it always did
    to_b.send_frame(STREAM_OPEN, FLAG_OPENER, 1, a.node_id, c.node_id, encode_open(77, 1 << 16, "x", 1))
    await async_wait_until(lambda: any(f[0] == STREAM_RESET for f in at_a), 5, "the reset")
    reset = next(f for f in at_a if f[0] == STREAM_RESET)
    assert reset[3] == c.node_id and RESET.unpack(reset[5]) == (77, TTL_EXPIRED)
    # a marker behind them on the same link and relay: once it is at c, anything b had passed
    # on before it would be there too (one ordered path), so absence now means refused
    marker = os.urandom(40)
    to_b.send_frame(SEALED, 0, DEFAULT_HOP_LIMIT, a.node_id, c.node_id, marker)
    await async_wait_until(lambda: bool(_forged(at_c, marker)), 5, "the marker behind them")
    assert not _forged(at_c, spent) and not any(f[0] == STREAM_OPEN for f in at_c)


async def test_a_warm_relay_refuses_an_unknown_destination(line: list[MeshService]) -> None:
    a, b, c = line
    at_a = _record(a)
    to_b = _link(a, b)
    to_b.send_frame(SEALED, 0, DEFAULT_HOP_LIMIT, a.node_id, c.node_id, os.urandom(40))
    await async_wait_until(lambda: bool(b._route_cache), 5, "the cache warm")
    nobody = unused_id(line)
    to_b.send_frame(SEALED, 0, DEFAULT_HOP_LIMIT, a.node_id, nobody, os.urandom(40))
    await async_wait_until(lambda: any(f[0] == UNREACHABLE for f in at_a), 5, "the refusal")
    refusal = next(f for f in at_a if f[0] == UNREACHABLE)
    assert UNREACH.unpack(refusal[5]) == (nobody, NETWORK_UNREACHABLE)
    assert all(key & 0xFFFFFFFF != nobody for key in b._route_cache)  # a miss is not kept


async def test_a_frame_whose_header_lies_is_not_relayed(line: list[MeshService]) -> None:
    a, b, c = line
    at_c = _record(c)
    to_b = _link(a, b)
    from_a = _link(b, a)
    before = from_a.codec.malformed
    body = os.urandom(30)
    # one record whose only frame claims 200 body bytes and carries 30
    to_b.codec._pending += FRAME.pack(SEALED, 0, DEFAULT_HOP_LIMIT, 200, a.node_id, c.node_id) + body
    to_b._flush()
    await async_wait_until(lambda: from_a.codec.malformed == before + 1, 5, "the malformed record")
    ok = os.urandom(30)  # the link goes on relaying what is well formed
    to_b.send_frame(SEALED, 0, DEFAULT_HOP_LIMIT, a.node_id, c.node_id, ok)
    await async_wait_until(lambda: bool(_forged(at_c, ok)), 5, "the next frame")
    assert not any(body in f[5] for f in at_c)


async def test_a_link_that_goes_is_not_used_before_the_routes_are_rebuilt(line: list[MeshService]) -> None:
    """c dials a second link to b, and b's first one to c goes before b re-originates or
    rebuilds (within ORIGINATE_DELAY): a frame b relays then takes the link there is, not the
    one its cache held."""
    a, b, c = line
    at_c = _record(c)
    from_a = _link(b, a)
    b.on_frame(from_a, SEALED, 0, DEFAULT_HOP_LIMIT, a.node_id, c.node_id, memoryview(os.urandom(40)))
    old = _link(b, c)
    assert old in b._route_cache.values()
    await async_wait_until(lambda: b._originate_timer is None and not b.table.dirty, 5, "quiet routes")
    version = b.table.version
    c.set_peers((*c.config.mesh.peers, SPARE[c.node_id]))
    await _turns_until(b, lambda: len(b.links.get(c.node_id, ())) == 2)
    assert old.transport is not None
    old.transport.close()
    await _turns_until(b, lambda: old not in b.links.get(c.node_id, ()))
    assert b.table.version == version  # no build since: only the cache's clearing decides
    then = os.urandom(40)
    b.on_frame(from_a, SEALED, 0, DEFAULT_HOP_LIMIT, a.node_id, c.node_id, memoryview(then))
    await async_wait_until(lambda: bool(_forged(at_c, then)), 5, "through the second link")
    assert old not in b._route_cache.values()


async def test_a_lost_last_link_is_refused_not_used(line: list[MeshService]) -> None:
    """b's only link to c goes: the next frame for c is refused to its source (b re-originates
    and finds no route), not written to the link that went."""
    a, b, c = line
    at_a = _record(a)
    from_a = _link(b, a)
    b.on_frame(from_a, SEALED, 0, DEFAULT_HOP_LIMIT, a.node_id, c.node_id, memoryview(os.urandom(40)))
    old = _link(b, c)
    assert old in b._route_cache.values()
    await _take_down(b, old)
    sent = old.bytes_out
    b.on_frame(from_a, SEALED, 0, DEFAULT_HOP_LIMIT, a.node_id, c.node_id, memoryview(os.urandom(40)))
    await async_wait_until(lambda: any(f[0] == UNREACHABLE for f in at_a), 5, "the refusal")
    refusal = next(f for f in at_a if f[0] == UNREACHABLE)
    assert UNREACH.unpack(refusal[5]) == (c.node_id, NETWORK_UNREACHABLE)
    assert old.bytes_out == sent and not old.codec.pending_bytes()


async def _take_down(node: MeshService, link: Link) -> None:
    """Close `link` and return as soon as `node` has taken it out of its links, checking that
    it has not rebuilt its routes meanwhile (the cache, not a new table version, must forget
    the link: the case under test)."""
    assert link.transport is not None and link.peer is not None
    peer = link.peer.node_id
    await async_wait_until(lambda: node._originate_timer is None and not node.table.dirty, 5, "quiet routes")
    version = node.table.version
    link.transport.close()
    await _turns_until(node, lambda: link not in node.links.get(peer, ()))
    assert node.table.version == version


async def _turns_until(node: MeshService, cond: Callable[[], bool]) -> None:
    """Wait for `cond` checking it every loop turn (well within ORIGINATE_DELAY), 5 s at most."""
    deadline = node.loop.time() + 5
    while not cond():
        assert node.loop.time() < deadline, "timed out"
        await asyncio.sleep(0)
