"""Credit-based flow control: a stalled reader bounds memory at the sender, the relay and the receiver."""

from __future__ import annotations

import asyncio
import hashlib

import pytest

from meshgate.mesh.streams import MeshStream
from tests.helpers import async_wait_until
from tests.mesh_testing import Collector, converged, node_config, ring_name, start_node, stop_all

WINDOW = 65536


@pytest.mark.parametrize("kind", ["tcp", "ring"])
async def test_stalled_reader_bounds_relay_memory(kind: str) -> None:
    limits = {"stream_window": WINDOW}
    if kind == "tcp":
        b = await start_node(node_config("b", listen=["tcp://127.0.0.1:0"], limits=limits))
        peer_a = peer_c = b.listen_addrs[0]
    else:
        r1, r2 = ring_name(), ring_name()
        b = await start_node(node_config("b", listen=[f"ring://{r1}", f"ring://{r2}"], limits=limits))
        peer_a, peer_c = f"ring://{r1}", f"ring://{r2}"
    a = await start_node(node_config("a", peers=[peer_a], limits=limits))
    c = await start_node(node_config("c", peers=[peer_c], limits=limits))
    nodes = [a, b, c]
    total = 48 * 1024 * 1024
    block = hashlib.sha256(b"x").digest() * 2048  # 64 KiB
    sent = 0

    async def firehose(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        nonlocal sent
        while sent < total:
            w.write(block)
            sent += len(block)
            await w.drain()
        w.close()

    srv = await asyncio.start_server(firehose, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    try:
        await async_wait_until(lambda: converged(nodes), 10, "routes")
        transport, proto = await a.open_stream(c.node_id, "127.0.0.1", port, lambda: Collector(pause=True))
        assert isinstance(transport, MeshStream) and isinstance(proto, Collector)

        def c_stream() -> MeshStream | None:
            assert c.mux is not None
            return next(iter(c.mux.streams.values()), None)

        # the egress side runs out of credit and stops; the server's writes then block
        await async_wait_until(
            lambda: (s := c_stream()) is not None and s.send_credit == 0, 10, "credit used"
        )
        # the server is back-pressured: what it sends stops growing (what moved after the
        # credit ran out fills the egress stream's buffer up to its high-water mark, then
        # the socket's: how far it gets first depends on the machine's load)
        samples: list[int] = []

        def settled() -> bool:
            samples.append(sent)
            return len(samples) >= 10 and len(set(samples[-10:])) == 1

        await async_wait_until(settled, 10, "the server's writes blocked")
        relay_buffered = sum(link.buffered() for links in b.links.values() for link in links)
        s = c_stream()
        assert s is not None
        assert proto.buf == b""  # the reader is paused: nothing delivered
        assert transport._recv_buffered <= WINDOW  # receiver holds at most one window
        assert relay_buffered <= 2 * WINDOW  # the relay holds at most what is in flight
        assert s.get_write_buffer_size() <= 4 * WINDOW + 4 * 65536  # egress stops reading its socket
        assert sent < total // 4  # blocked far from the end: the window, buffers and sockets only

        transport.resume_reading()
        got = await asyncio.wait_for(proto.done, 60)
        assert len(got) == total
        assert hashlib.sha256(got).digest() == hashlib.sha256(block * (total // len(block))).digest()
    finally:
        srv.close()
        await stop_all(nodes)


async def test_a_peer_that_stops_reading_its_link_is_cut_off() -> None:
    """b opens 48 streams to a firehose behind a, then stops reading its TCP link: a's queue for
    b grows to the streams' windows and no further, and after limits.mesh_link_stall with
    nothing leaving, a closes the link (counted) and frees it. Without this the link stayed
    up (b's pings still arrive) holding everything queued for b."""
    window = 1 << 20  # 48 streams' windows: more than the kernel's socket buffers take
    limits = {"stream_window": window, "mesh_link_buffer": 4 << 20, "mesh_link_stall": 1.5}
    a = await start_node(node_config("a", listen=["tcp://127.0.0.1:0"], limits=limits))
    b = await start_node(node_config("b", peers=[a.listen_addrs[0]], limits=limits))
    nodes = [a, b]
    block = b"y" * 65536

    async def firehose(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            while True:
                w.write(block)
                await w.drain()
        except (ConnectionError, OSError):
            pass

    srv = await asyncio.start_server(firehose, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    try:
        await async_wait_until(lambda: converged(nodes), 10, "a - b")
        b_link = b.links[a.node_id][0]
        a_link = a.links[b.node_id][0]
        streams = await asyncio.gather(*(b.open_stream(a.node_id, "127.0.0.1", port, Collector)
                                         for _ in range(48)))
        b_link.transport.pause_reading()  # type: ignore[attr-defined]
        peak = 0

        def cut() -> bool:
            nonlocal peak
            peak = max(peak, a_link.buffered())
            return a.stats["link_not_reading"] >= 1

        await async_wait_until(cut, 15, "a closing the link b stopped reading")
        assert b.node_id not in a.links or a_link not in a.links[b.node_id]
        # what a held for b never grew past what the streams' windows allow (and the kernel)
        assert 4 << 20 < peak <= 48 * window + 48 * 65536, peak
        for transport, _ in streams:
            transport.close()
    finally:
        srv.close()
        await stop_all(nodes)
