"""QUIC links (aioquic): an A—B—C line converges and carries streams and datagrams."""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import os

import pytest

from meshgate.mesh.streams import StreamError
from meshgate.replies import REFUSED
from tests.helpers import async_wait_until
from tests.mesh_testing import Collector, converged, node_config, start_node, stop_all, write_all


async def test_quic_line() -> None:
    b = await start_node(node_config("b", "10.9.0.2/24", listen=["quic://127.0.0.1:0"]))
    url = b.listen_addrs[0]
    assert url.startswith("quic://127.0.0.1:") and not url.endswith(":0")
    a = await start_node(node_config("a", "10.9.0.1/24", peers=[url]))
    c = await start_node(node_config("c", "10.9.0.3/24", peers=[url]))
    bad = await start_node(node_config("bad", "10.9.0.4/24", peers=[url], secret="wrong secret"))
    nodes = [a, b, c, bad]

    async def echo_sha(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        h = hashlib.sha256()
        while chunk := await r.read(1 << 16):
            h.update(chunk)
        w.write(h.digest() * 1000)
        await w.drain()
        w.close()

    srv = await asyncio.start_server(echo_sha, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    try:
        await async_wait_until(lambda: converged([a, b, c]), 15, "routes over QUIC")
        route = a.lookup(ipaddress.ip_address("10.9.0.3"))
        assert route is not None and route.next_hop == b.node_id and route.hops == 2
        assert all(p["url"].startswith("quic://") for p in b.peers())
        data = os.urandom(1 << 20)
        transport, proto = await a.open_stream(c.node_id, "127.0.0.1", port, Collector)
        assert isinstance(proto, Collector)
        await write_all(proto, data)
        transport.write_eof()  # type: ignore[attr-defined]
        got = await asyncio.wait_for(proto.done, 30)
        assert got == hashlib.sha256(data).digest() * 1000
        with pytest.raises(StreamError) as e:
            await a.open_stream(c.node_id, "127.0.0.1", 1, Collector)
        assert e.value.code == REFUSED
        seen: list[bytes] = []
        c.on_datagram(3, lambda src, p: seen.append(p))
        assert a.send_datagram(c.node_id, 3, b"over quic")
        await async_wait_until(lambda: seen == [b"over quic"], 5, "datagram")
        await async_wait_until(lambda: b.stats["handshake_failed"] >= 1, 10, "wrong secret refused")
        assert bad.node_id not in b.table.records and set(bad.table.records) == {bad.node_id}
    finally:
        srv.close()
        await stop_all(nodes)
