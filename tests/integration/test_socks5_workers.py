"""`socks5.workers`: SO_REUSEPORT worker processes take the portal's connections (issue 18 item 3).

A - B in one process (A has the portal with two processes: its own and one
worker; B publishes a TCP and a UDP echo on its virtual IP). The kernel spreads
connections over the two processes, so each test makes enough of them that
both take some (all 40 in one process: 2 in 2^40). What a worker relays it
counts as "local" (meshgate_socks5_worker_requests_total, merged into the node's
metrics); what needs the mesh it hands to the node's process, which routes it.
tests/integration/test_portal_workers.py runs the whole portal suite in this
mode.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest

from meshgate.metrics import REGISTRY
from meshgate.node import Node
from tests.helpers import UdpEcho, async_wait_until, free_port
from tests.integration.test_portal_mesh import cfg, start
from tests.integration.test_socks5_server import read_reply, request, udp_exchange, udp_header

PORT = free_port()  # B publishes it on its virtual IP, TCP and UDP
CONNECTIONS = 40


@pytest.fixture
async def pair(tmp_path: Any) -> AsyncIterator[dict[str, Any]]:
    # the local target: reached from A's host directly (no mesh route to 127.0.0.1)
    server = await asyncio.start_server(_echo, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    serve = {str(PORT): f"127.0.0.1:{PORT}"}
    b = await start(cfg("b", "10.144.9.2/24", node={"state_dir": str(tmp_path / "b")}, serve=serve,
                        mesh={"listen": ["tcp://127.0.0.1:0"]}))
    a = await start(cfg("a", "10.144.9.1/24", node={"state_dir": str(tmp_path / "a")},
                        mesh={"peers": [b.mesh.listen_addrs[0]], "direct_fallback": True},
                        socks5={"enable": True, "listen": "127.0.0.1:0", "workers": 2}))
    await async_wait_until(lambda: b.mesh.node_id in a.mesh.table.hop_paths
                           and a.mesh.node_id in b.mesh.table.hop_paths, 15, "routes to converge")
    mesh_target, mesh_port = await asyncio.start_server(_echo, "127.0.0.1", PORT), PORT
    yield {"a": a, "b": b, "local": port, "mesh": mesh_port}
    mesh_target.close()
    await a.stop()
    await b.stop()
    server.close()


async def _echo(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    try:
        while data := await r.read(65536):
            w.write(data)
            await w.drain()
    finally:
        w.close()


def portal_addr(node: Node) -> tuple[str, int]:
    svc = next(s for s in node.services if s.name == "socks5")
    addr = svc.address  # type: ignore[attr-defined]
    return addr.host, addr.port


async def connect_echo(portal: tuple[str, int], host: str, port: int, payload: bytes) -> bytes:
    reader, writer = await asyncio.open_connection(*portal)
    try:
        writer.write(b"\x05\x01\x00")
        assert await reader.readexactly(2) == b"\x05\x00"
        writer.write(request(1, 1, socket.inet_aton(host), port) + payload)  # data behind the request
        rep, *_ = await read_reply(reader)
        assert rep == 0, rep
        return await asyncio.wait_for(reader.readexactly(len(payload)), 10)
    finally:
        writer.close()


def routed(answer: str) -> float:
    return REGISTRY.value("meshgate_socks5_worker_requests_total", "1", answer)


async def test_local_connections_relayed_by_the_worker_mesh_ones_handed_over(pair: dict[str, Any]) -> None:
    a = pair["a"]
    portal = portal_addr(a)
    assert a.socks5.workers is not None and len(a.socks5.workers.pids()) == 1
    local0, mesh0 = routed("local"), routed("mesh")
    handed0 = REGISTRY.value("meshgate_socks5_handed_over_total", "ok")
    streams0 = REGISTRY.value("meshgate_mesh_streams_total", "open", "ok")

    for i in range(CONNECTIONS):  # no mesh route: leaves from this host, the worker's to relay
        payload = b"local %d " % i * 50
        assert await connect_echo(portal, "127.0.0.1", pair["local"], payload) == payload
    # B's virtual IP: a mesh stream, which only the node's process can open
    for i in range(CONNECTIONS):
        payload = b"mesh %d " % i * 50
        assert await connect_echo(portal, "10.144.9.2", pair["mesh"], payload) == payload

    # the worker reports its counters every second (merged into the node's metrics)
    await async_wait_until(lambda: routed("local") > local0 and routed("mesh") > mesh0, 10,
                           "the worker's counts merged")
    took = routed("local") - local0
    assert 0 < took < CONNECTIONS  # both processes took some of the local connections
    handed = routed("mesh") - mesh0
    assert REGISTRY.value("meshgate_socks5_handed_over_total", "ok") - handed0 == handed
    # every mesh connection, whichever process accepted it, went through a mesh stream
    assert REGISTRY.value("meshgate_mesh_streams_total", "open", "ok") - streams0 == CONNECTIONS


async def test_udp_associate_through_a_worker_is_handed_over(pair: dict[str, Any]) -> None:
    """UDP ASSOCIATE needs the node's UDP paths: wherever it is accepted, it works."""
    portal = portal_addr(pair["a"])
    echo = UdpEcho("127.0.0.1", prefix=b"echo:", port=PORT)
    try:
        for i in range(12):
            reader, writer = await asyncio.open_connection(*portal)
            client = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            client.bind(("127.0.0.1", 0))
            client.setblocking(False)
            try:
                writer.write(b"\x05\x01\x00")
                assert await reader.readexactly(2) == b"\x05\x00"
                writer.write(request(3, 1, bytes(4), 0))
                rep, _atyp, bnd, port = await read_reply(reader)
                assert rep == 0
                hdr = udp_header(1, socket.inet_aton("10.144.9.2"), PORT)
                got = await udp_exchange(client, (socket.inet_ntoa(bnd), port), hdr + b"dgram %d" % i)
                assert got == hdr + b"echo:dgram %d" % i
            finally:
                writer.close()
                client.close()
    finally:
        echo.close()


async def test_refusals_keep_their_reply_code_in_a_worker(pair: dict[str, Any]) -> None:
    """A destination nobody listens on: 0x05 (connection refused) from either process."""
    portal = portal_addr(pair["a"])
    dead = free_port()
    for _ in range(16):
        reader, writer = await asyncio.open_connection(*portal)
        try:
            writer.write(b"\x05\x01\x00")
            assert await reader.readexactly(2) == b"\x05\x00"
            writer.write(request(1, 1, socket.inet_aton("127.0.0.1"), dead))
            rep, *_ = await read_reply(reader)
            assert rep == 5
        finally:
            writer.close()


async def test_workers_stop_with_the_node(tmp_path: Any) -> None:
    a = await start(cfg("solo", "10.144.9.5/24", node={"state_dir": str(tmp_path / "solo")},
                        socks5={"enable": True, "listen": "127.0.0.1:0", "workers": 3}))
    assert a.socks5 is not None and a.socks5.workers is not None
    pool = a.socks5.workers
    procs = [w.proc for w in pool.workers]
    assert len(pool.pids()) == 2
    await a.stop()
    assert all(p is not None and p.returncode is not None for p in procs)


async def test_a_node_without_a_mesh_lets_workers_dial_literals_and_asks_for_names(tmp_path: Any) -> None:
    """No mesh, no egress policy: a worker connects address literals itself and has the node
    resolve names (its DNS pipeline, or the host's resolver), then connects those too."""
    raw = cfg("solo", "10.144.9.6/24", node={"state_dir": str(tmp_path / "solo")},
              socks5={"enable": True, "listen": "127.0.0.1:0", "workers": 2})
    import dataclasses

    raw = dataclasses.replace(raw, node=dataclasses.replace(raw.node, ipv4=None))  # no mesh at all
    a = await start(raw)
    server = await asyncio.start_server(_echo, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        assert a.mesh is None
        local0 = routed("local")
        portal = portal_addr(a)
        for i in range(CONNECTIONS):
            payload = b"solo %d" % i
            assert await connect_echo(portal, "127.0.0.1", port, payload) == payload
        for i in range(8):  # a name: asked, resolved by the node, connected by whoever took it
            reader, writer = await asyncio.open_connection(*portal)
            try:
                writer.write(b"\x05\x01\x00")
                assert await reader.readexactly(2) == b"\x05\x00"
                name = b"localhost"
                writer.write(b"\x05\x01\x00\x03" + bytes((len(name),)) + name + port.to_bytes(2, "big"))
                rep, *_ = await read_reply(reader)
                assert rep == 0
                writer.write(b"named %d" % i)
                assert await reader.readexactly(len(b"named %d" % i)) == b"named %d" % i
            finally:
                writer.close()
        await async_wait_until(lambda: routed("local") > local0, 10, "the worker's counts merged")
        assert routed("local") - local0 < CONNECTIONS + 8
    finally:
        server.close()
        await a.stop()
