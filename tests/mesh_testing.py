"""Helpers to run several mesh nodes in one process (tests and bench/mesh.py).

Nodes made here serve streams with `local_connect`: anything on this host,
no exit policy (the policy is tested through the node, tests/integration/test_portal_mesh.py).
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import secrets
from collections.abc import Iterable
from dataclasses import replace
from typing import Any, cast

from meshgate.config import Config, LimitsConfig, from_dict
from meshgate.egress.connect import local_connect
from meshgate.mesh.identity import Identity
from meshgate.mesh.service import MeshService

_ring_ids = itertools.count(1)


def ring_name(prefix: str = "t") -> str:
    """A ring name unique in this process (the ring registry is module-level)."""
    return f"{prefix}{next(_ring_ids)}"


def node_config(
    name: str,
    ipv4: str | None = None,
    listen: Iterable[str] = (),
    peers: Iterable[str] = (),
    network: str = "testnet",
    secret: str = "correct horse battery",
    limits: dict[str, Any] | None = None,
    **mesh: Any,
) -> Config:
    # NAT traversal off unless a test asks for it: on loopback every pair can reach every
    # other, so relayed topologies (what most mesh tests are about) would punch direct links
    mesh.setdefault("traversal", False)
    raw: dict[str, Any] = {
        "node": {"name": name, "network": network, "secret": secret},
        "mesh": {"listen": list(listen), "peers": list(peers), **mesh},
        "limits": limits or {},
    }
    if ipv4:
        raw["node"]["ipv4"] = ipv4
    return from_dict(raw)


def mesh_node(cfg: Config, identity: Identity | None = None) -> MeshService:
    """A MeshService whose streams leave from this host (its own virtual IPs mean loopback).

    Its id comes from its key, a fresh one unless `identity` is given (a restarted node):
    refer to it as `svc.node_id`."""
    own = {str(i.ip) for i in (cfg.node.ipv4, cfg.node.ipv6) if i is not None}
    egress = local_connect(own, cfg.limits.socks5_connect_timeout)
    return MeshService(cfg, identity=identity or Identity.generate(), egress=egress)


async def start_node(cfg: Config, identity: Identity | None = None) -> MeshService:
    svc = mesh_node(cfg, identity)
    await svc.start()
    return svc


async def ring_line() -> list[MeshService]:
    """a - b - c on ring links (b listens on two rings; a and c share no link), converged:
    traffic between a and c is relayed by b. Stop them with stop_all."""
    from tests.helpers import async_wait_until

    r1, r2 = ring_name(), ring_name()
    b = await start_node(node_config("b", "10.9.0.2/24", listen=[f"ring://{r1}", f"ring://{r2}"]))
    a = await start_node(node_config("a", "10.9.0.1/24", peers=[f"ring://{r1}"]))
    c = await start_node(node_config("c", "10.9.0.3/24", peers=[f"ring://{r2}"]))
    nodes = [a, b, c]
    try:
        await async_wait_until(lambda: converged(nodes), 10, "routes")
    except BaseException:
        await stop_all(nodes)
        raise
    return nodes


def unused_id(nodes: Iterable[MeshService]) -> int:
    """A non-zero 32-bit node id that none of `nodes` has (for "unknown node" tests)."""
    taken = {n.node_id for n in nodes}
    while (x := secrets.randbits(32)) == 0 or x in taken:
        pass
    return x


def fast_limits(**extra: Any) -> LimitsConfig:
    return replace(LimitsConfig(), **extra)


def converged(nodes: Iterable[MeshService]) -> bool:
    """Every node reaches every other node (routes built on both sides)."""
    nodes = list(nodes)
    ids = {n.node_id for n in nodes}
    return all(ids <= set(n.table.hop_paths) for n in nodes)


async def stop_all(nodes: Iterable[MeshService]) -> None:
    await asyncio.gather(*(n.stop() for n in nodes), return_exceptions=True)


class Collector(asyncio.Protocol):
    """Collects what a stream delivers; `done` resolves with the bytes at EOF or close."""

    def __init__(self, pause: bool = False) -> None:
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None
        self.pause = pause
        self.eof = False
        self.lost: Exception | None = None
        self.done: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self.writable = asyncio.Event()
        self.writable.set()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses
        transport = self.transport
        if self.pause:
            transport.pause_reading()

    def data_received(self, data: bytes) -> None:
        self.buf += data

    def eof_received(self) -> bool:
        self.eof = True
        if not self.done.done():
            self.done.set_result(bytes(self.buf))
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = exc
        if not self.done.done():
            self.done.set_result(bytes(self.buf))

    def pause_writing(self) -> None:
        self.writable.clear()

    def resume_writing(self) -> None:
        self.writable.set()


async def write_all(proto: Collector, data: bytes, chunk: int = 256 * 1024) -> None:
    """Write respecting pause_writing, like a well-behaved application."""
    assert proto.transport is not None
    view = memoryview(data)
    for i in range(0, len(data), chunk):
        await proto.writable.wait()
        proto.transport.write(view[i : i + chunk])


async def echo_server() -> tuple[asyncio.Server, int]:
    """A TCP server on loopback that sends back what it reads; (server, port)."""

    async def echo(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while data := await r.read(1 << 16):
            w.write(data)
            await w.drain()
        w.close()

    srv = await asyncio.start_server(echo, "127.0.0.1", 0)
    return srv, srv.sockets[0].getsockname()[1]


async def sha_server() -> tuple[asyncio.Server, int]:
    """A loopback TCP server that answers each connection's sha256 once it ends; its port."""

    async def echo_sha(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        h = hashlib.sha256()
        while chunk := await r.read(1 << 16):
            h.update(chunk)
        w.write(h.digest())
        await w.drain()
        w.close()

    srv = await asyncio.start_server(echo_sha, "127.0.0.1", 0)
    return srv, srv.sockets[0].getsockname()[1]


async def stream_sha(src: MeshService, dst: int, port: int, data: bytes) -> bytes:
    """Send `data` over a mesh stream from `src` to a sha_server behind node `dst`; its digest."""
    transport, proto = await src.open_stream(dst, "127.0.0.1", port, Collector)
    assert isinstance(proto, Collector)
    await write_all(proto, data)
    transport.write_eof()  # type: ignore[attr-defined]
    return await asyncio.wait_for(proto.done, 60)
