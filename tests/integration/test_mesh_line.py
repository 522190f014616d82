"""A—B—C line (A and C share no link) over TCP and ring links, in one process."""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import json
import os
from collections.abc import AsyncIterator

import pytest

from meshgate.mesh.service import MeshService
from meshgate.mesh.streams import StreamError
from meshgate.replies import REFUSED
from tests.helpers import async_wait_until
from tests.mesh_testing import (
    Collector,
    converged,
    node_config,
    ring_name,
    start_node,
    stop_all,
    unused_id,
    write_all,
)


async def _line(kind: str) -> list[MeshService]:
    if kind == "tcp":
        b = await start_node(node_config("b", "10.9.0.2/24", listen=["tcp://127.0.0.1:0"]))
        url = b.listen_addrs[0]
        a = await start_node(node_config("a", "10.9.0.1/24", peers=[url]))
        c = await start_node(node_config("c", "10.9.0.3/24", peers=[url]))
    else:
        r1, r2 = ring_name(), ring_name()
        b = await start_node(node_config("b", "10.9.0.2/24", listen=[f"ring://{r1}", f"ring://{r2}"]))
        a = await start_node(node_config("a", "10.9.0.1/24", peers=[f"ring://{r1}"]))
        c = await start_node(node_config("c", "10.9.0.3/24", peers=[f"ring://{r2}"]))
    nodes = [a, b, c]
    await async_wait_until(lambda: converged(nodes), 10, "routes to converge")
    return nodes


@pytest.fixture(params=["tcp", "ring"])
async def line(request: pytest.FixtureRequest) -> AsyncIterator[list[MeshService]]:
    nodes = await _line(request.param)
    yield nodes
    await stop_all(nodes)


async def _exchange_server() -> tuple[asyncio.Server, int, dict[str, str]]:
    """Reads to EOF, then answers sha256(received) + 3 MiB of its own and closes."""
    seen: dict[str, str] = {}

    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        h = hashlib.sha256()
        while chunk := await r.read(1 << 16):
            h.update(chunk)
        seen["got"] = h.hexdigest()
        reply = hashlib.sha256(b"seed").digest() * (3 * 1024 * 1024 // 32)
        seen["sent"] = hashlib.sha256(reply).hexdigest()
        w.write(h.digest() + reply)
        await w.drain()
        w.close()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    return srv, srv.sockets[0].getsockname()[1], seen


async def test_routes_converge_through_the_relay(line: list[MeshService]) -> None:
    a, b, c = line
    r = a.lookup(ipaddress.ip_address("10.9.0.3"))
    assert r is not None and (r.node_id, r.kind, r.next_hop, r.hops) == (c.node_id, "peer", b.node_id, 2)
    assert r.latency_ms > 0
    assert a.lookup(ipaddress.ip_address("10.9.0.1")).kind == "self"  # type: ignore[union-attr]
    assert set(a.links) == {b.node_id} and set(c.links) == {b.node_id}
    assert a.name_table()["c"] == (ipaddress.IPv4Address("10.9.0.3"), None)
    routes = {x["name"]: x for x in a.routes()}
    assert routes["c"]["next_hop"] == f"{b.node_id:08x}" and routes["c"]["hops"] == 2
    assert routes["c"]["hops_ll"] == 2 and routes["c"]["next_hop_ll"] == f"{b.node_id:08x}"
    json.dumps(a.routes())
    json.dumps(a.peers())
    assert a.peers()[0]["name"] == "b"
    assert a.status()["id"] == f"{a.node_id:08x}"


async def test_stream_both_ways_with_half_close(line: list[MeshService]) -> None:
    a, b, c = line
    srv, port, seen = await _exchange_server()
    async with srv:
        data = os.urandom(5 * 1024 * 1024 + 123)
        transport, proto = await a.open_stream(c.node_id, "127.0.0.1", port, Collector)
        assert isinstance(proto, Collector)
        await write_all(proto, data)
        transport.write_eof()  # type: ignore[attr-defined]
        got = await asyncio.wait_for(proto.done, 30)
        assert seen["got"] == hashlib.sha256(data).hexdigest()
        assert got[:32] == hashlib.sha256(data).digest()
        assert hashlib.sha256(got[32:]).hexdigest() == seen["sent"]
        assert proto.eof  # the server's FIN came through after our own FIN (half-close both ways)
        await async_wait_until(lambda: len(a.mux or ()) == 0 and len(c.mux or ()) == 0, 5, "streams to close")
        assert len(b.mux or ()) == 0  # the relay keeps no stream state


async def test_refused_port_maps_to_socks_code(line: list[MeshService]) -> None:
    a, _, c = line
    srv = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    srv.close()
    await srv.wait_closed()
    with pytest.raises(StreamError) as e:
        await a.open_stream(c.node_id, "127.0.0.1", port, Collector)
    assert e.value.code == REFUSED


async def test_own_virtual_ip_egresses_to_loopback(line: list[MeshService]) -> None:
    a, _, c = line
    srv, port, _seen = await _exchange_server()
    async with srv:
        transport, proto = await a.open_stream(c.node_id, "10.9.0.3", port, Collector)
        assert isinstance(proto, Collector)
        transport.write(b"hello")  # type: ignore[attr-defined]
        transport.write_eof()  # type: ignore[attr-defined]
        got = await asyncio.wait_for(proto.done, 10)
        assert got[:32] == hashlib.sha256(b"hello").digest()


async def test_unknown_node_is_unreachable(line: list[MeshService]) -> None:
    a, _, _ = line
    with pytest.raises(StreamError) as e:
        await a.open_stream(unused_id(line), "127.0.0.1", 1, Collector)
    assert e.value.code == 0x03


async def test_datagrams_through_the_relay(line: list[MeshService]) -> None:
    a, _, c = line
    got: list[tuple[int, bytes]] = []
    c.on_datagram(7, lambda src, payload: got.append((src, payload)))
    payloads = [os.urandom(1400) for _ in range(20)]
    for p in payloads:
        assert a.send_datagram(c.node_id, 7, p)
    await async_wait_until(lambda: len(got) == 20, 5, "datagrams")
    assert got == [(a.node_id, p) for p in payloads]
    assert not a.send_datagram(unused_id(line), 7, b"x")  # no route: refused, counted


async def test_stream_opened_the_moment_a_route_appears() -> None:
    """The far node may still be holding back a route build when the OPEN arrives;
    its ACCEPT must find the way back anyway."""
    r = ring_name()
    c = await start_node(node_config("c", "10.9.0.3/24", listen=[f"ring://{r}"]))
    a = await start_node(node_config("a", "10.9.0.1/24", peers=[f"ring://{r}"]))
    srv, port, _ = await _exchange_server()
    try:
        await async_wait_until(lambda: c.node_id in a.table.hop_paths, 10, "a's route to c")
        transport, proto = await a.open_stream(c.node_id, "127.0.0.1", port, Collector)
        assert isinstance(proto, Collector)
        transport.write(b"x")  # type: ignore[attr-defined]
        transport.write_eof()  # type: ignore[attr-defined]
        got = await asyncio.wait_for(proto.done, 10)
        assert got[:32] == hashlib.sha256(b"x").digest()
    finally:
        srv.close()
        await stop_all([a, c])
