"""1 GiB through two relays, byte-identical, while a stalled stream beside it keeps relay memory bounded."""

from __future__ import annotations

import asyncio
import hashlib
import os

from tests.helpers import async_wait_until
from tests.mesh_testing import Collector, converged, node_config, ring_name, start_node, stop_all

SIZE = int(os.environ.get("MESHGATE_BULK_BYTES", str(1 << 30)))
WINDOW = 262144  # pinned: the bound below is in windows, and the default stream_window has changed before
BLOCK = 1 << 20
LIMITS = {"stream_window": WINDOW}


def _block(i: int, base: bytes) -> bytes:
    return i.to_bytes(8, "big") + base[8:]


async def test_one_gib_through_two_relays_with_a_stalled_neighbour() -> None:
    rings = [ring_name() for _ in range(3)]
    a = await start_node(node_config("a", listen=[f"ring://{rings[0]}"], limits=LIMITS))
    r1 = await start_node(
        node_config("r1", peers=[f"ring://{rings[0]}"], listen=[f"ring://{rings[1]}"], limits=LIMITS),
    )
    r2 = await start_node(
        node_config("r2", peers=[f"ring://{rings[1]}"], listen=[f"ring://{rings[2]}"], limits=LIMITS),
    )
    d = await start_node(node_config("d", peers=[f"ring://{rings[2]}"], limits=LIMITS))
    nodes = [a, r1, r2, d]

    async def hasher(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        h = hashlib.sha256()
        while chunk := await r.read(1 << 18):
            h.update(chunk)
        w.write(h.digest())
        await w.drain()
        w.close()

    async def firehose(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        block = bytes(BLOCK)
        while True:
            w.write(block)
            await w.drain()

    hash_srv = await asyncio.start_server(hasher, "127.0.0.1", 0)
    fire_srv = await asyncio.start_server(firehose, "127.0.0.1", 0)
    peak = 0
    sampling = True

    async def sample() -> None:
        nonlocal peak
        while sampling:
            held = max(sum(lk.buffered() for lks in n.links.values() for lk in lks) for n in (r1, r2))
            peak = max(peak, held)
            await asyncio.sleep(0.005)

    try:
        await async_wait_until(lambda: converged(nodes), 10, "routes")
        assert a.table.hop_paths[d.node_id].hops == 3
        stalled_t, stalled = await a.open_stream(
            d.node_id, "127.0.0.1", fire_srv.sockets[0].getsockname()[1], lambda: Collector(pause=True)
        )
        sampler = asyncio.create_task(sample())
        transport, proto = await a.open_stream(
            d.node_id, "127.0.0.1", hash_srv.sockets[0].getsockname()[1], Collector
        )
        assert isinstance(proto, Collector) and isinstance(stalled, Collector)
        base = os.urandom(BLOCK)
        h = hashlib.sha256()
        for i in range(SIZE // BLOCK):
            await proto.writable.wait()
            block = _block(i, base)
            h.update(block)
            transport.write(block)  # type: ignore[attr-defined]
        transport.write_eof()  # type: ignore[attr-defined]
        got = await asyncio.wait_for(proto.done, 300)
        sampling = False
        await sampler
        assert got == h.digest()
        assert stalled.buf == b""  # paused all along
        # both streams cross both relays; each has at most one window in flight
        assert 0 < peak <= 4 * WINDOW, peak
        stalled_t.close()
    finally:
        sampling = False
        hash_srv.close()
        fire_srv.close()
        await stop_all(nodes)
