"""End-to-end sealing through a relay that is an attacker: a-b-c on ring links, b relays.

b holds the network secret and a valid place in the mesh; the test replaces its frame handler
with one that records, alters, replays or forges what it relays."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from meshgate.mesh.frames import (
    DATAGRAM,
    DATAGRAM_SEALED,
    DEFAULT_HOP_LIMIT,
    E2E_INIT,
    E2E_RESP,
    SEALED,
    STREAM_OPEN,
)
from meshgate.mesh.service import CHANNEL, MeshService
from meshgate.mesh.streams import encode_open
from tests.helpers import async_wait_until
from tests.mesh_testing import Collector, echo_server, ring_line, stop_all

Frame = tuple[int, int, int, int, int, bytes]  # type, flags, hop, src, dst, body


@pytest.fixture
async def line() -> AsyncIterator[list[MeshService]]:
    nodes = await ring_line()
    try:
        yield nodes
    finally:
        await stop_all(nodes)


def _relay_hook(b: MeshService, change: Callable[[Frame], list[Frame]]) -> list[Frame]:
    """Make b pass every frame it relays through `change` (which returns what to forward);
    returns the list of frames b saw for others."""
    seen: list[Frame] = []
    original = MeshService.on_frame.__get__(b, MeshService)  # the real one, not an earlier hook

    def on_frame(link: Any, ftype: int, flags: int, hop: int, src: int, dst: int, body: memoryview) -> None:
        if dst in (0, b.node_id) or src == b.node_id:
            original(link, ftype, flags, hop, src, dst, body)
            return
        frame = (ftype, flags, hop, src, dst, bytes(body))
        seen.append(frame)
        for t, f, h, s, d, bd in change(frame):
            original(link, t, f, h, s, d, memoryview(bd))

    b.on_frame = on_frame  # type: ignore[method-assign]
    return seen


async def test_a_relay_sees_only_sealed_frames(line: list[MeshService]) -> None:
    a, b, c = line
    seen = _relay_hook(b, lambda f: [f])
    marker = b"TOP-SECRET-" + os.urandom(8).hex().encode()
    got: list[tuple[int, bytes]] = []
    c.on_datagram(7, lambda src, p: got.append((src, p)))
    srv, port = await echo_server()
    async with srv:
        transport, proto = await a.open_stream(c.node_id, "127.0.0.1", port, Collector)
        assert isinstance(proto, Collector)
        transport.write(marker * 100)  # type: ignore[attr-defined]
        await async_wait_until(lambda: len(proto.buf) >= len(marker) * 100, 10, "the echo")
        assert bytes(proto.buf) == marker * 100
        transport.close()
        assert a.send_datagram(c.node_id, 7, marker)
        await async_wait_until(lambda: bool(got), 5, "the datagram")
    # c knows who sent it: the authenticated source
    assert got == [(a.node_id, marker)]
    types = {f[0] for f in seen}
    assert types <= {E2E_INIT, E2E_RESP, SEALED, DATAGRAM_SEALED}, types
    assert SEALED in types and DATAGRAM_SEALED in types
    assert not any(marker in f[5] for f in seen)
    assert not any(b"127.0.0.1" in f[5] for f in seen)  # the stream's target travels sealed too
    assert a.e2e.counts["initiated"] + c.e2e.counts["initiated"] == 1  # one session per pair


async def test_between_neighbours_nothing_is_sealed_twice(line: list[MeshService]) -> None:
    a, b, _ = line
    got: list[bytes] = []
    b.on_datagram(7, lambda src, p: got.append(p))
    assert a.send_datagram(b.node_id, 7, b"direct")
    await async_wait_until(lambda: got == [b"direct"], 5, "the datagram")
    assert not a.e2e.sessions and not b.e2e.sessions


async def test_a_relay_that_alters_or_replays_is_caught(line: list[MeshService]) -> None:
    a, b, c = line
    got: list[bytes] = []
    c.on_datagram(7, lambda src, p: got.append(p))
    # set the session up, untouched
    assert a.send_datagram(c.node_id, 7, b"first")
    await async_wait_until(lambda: got == [b"first"], 5, "the first datagram")

    def flip(f: Frame) -> list[Frame]:
        t, fl, h, s, d, body = f
        if t == DATAGRAM_SEALED:
            body = body[:-1] + bytes((body[-1] ^ 1,))
        return [(t, fl, h, s, d, body)]

    _relay_hook(b, flip)
    assert a.send_datagram(c.node_id, 7, b"altered")
    await async_wait_until(lambda: c.stats["e2e_dropped_forged_or_replayed"] >= 1, 5, "the alteration caught")
    _relay_hook(b, lambda f: [f, f])  # every frame twice
    assert a.send_datagram(c.node_id, 7, b"once")
    await async_wait_until(lambda: c.stats["e2e_dropped_forged_or_replayed"] >= 2, 5, "the replay caught")
    assert got == [b"first", b"once"]


async def test_a_relay_cannot_speak_in_another_nodes_name(line: list[MeshService]) -> None:
    a, b, c = line
    got: list[tuple[int, bytes]] = []
    c.on_datagram(7, lambda src, p: got.append((src, p)))
    opened: list[str] = []
    original = c.egress_connect

    async def egress(host: str, port: int, factory: Any, source: int = 0) -> Any:
        opened.append(host)
        return await original(host, port, factory, source)

    c.egress_connect = egress
    link = c.links[b.node_id][0]
    # b, a member with a valid link, sends frames to c claiming to come from a
    b_link_to_c = b.links[c.node_id][0]
    b_link_to_c.send_frame(DATAGRAM, 0, DEFAULT_HOP_LIMIT, a.node_id, c.node_id, CHANNEL.pack(7), b"forged")
    b_link_to_c.send_frame(STREAM_OPEN, 0, DEFAULT_HOP_LIMIT, a.node_id, c.node_id,
                           encode_open(99, 1 << 20, "127.0.0.1", 22))
    await async_wait_until(lambda: c.stats["e2e_dropped_unsealed_relayed"] >= 2, 5, "the forgeries dropped")
    assert got == [] and opened == []
    assert link.peer is not None and link.peer.node_id == b.node_id
