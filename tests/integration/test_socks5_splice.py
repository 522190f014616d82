"""The kernel relay (gateway/splice_relay.py): with limits.socks5_splice on, a bulk relay between
two TCP sockets moves to splice(2) and keeps every rule of the Python relay: all bytes in order
both ways, half-close passed on, the sender held back when the receiver stops reading (bounded
by the pipe), the byte counters, and closing. Off (the default), bulk stays in Python. Real
sockets on loopback, the portal of a node in this process."""

from __future__ import annotations

import asyncio
import hashlib
import os
from typing import Any

from meshgate.gateway.server import READ_SIZE
from meshgate.gateway.splice_relay import PIPE_SIZE
from meshgate.metrics import REGISTRY
from tests.helpers import async_wait_until
from tests.integration.test_socks5_server import portal, raw_socks, request

MIB = 1 << 20


def spliced() -> float:
    return REGISTRY.value("meshgate_socks5_spliced_total")


async def relay_both_ways(p: Any, port: int, up_data: bytes) -> bytes:
    """Through the portal `p` to 127.0.0.1:`port`: `up_data` up, then a half-close (the reply
    direction goes on); returns what came down, once the relay closed."""
    r, w, (rep, *_) = await raw_socks(p.port, request(1, 1, b"\x7f\0\0\1", port))
    assert rep == 0
    w.write(up_data)
    await w.drain()
    w.write_eof()
    down = await asyncio.wait_for(r.read(-1), 30)
    w.close()
    await async_wait_until(lambda: not p.clients, what="the relay closed")
    return down


async def test_bulk_both_ways_is_spliced_whole_and_in_order() -> None:
    """32 MiB each way at once (sha256 checked), then each side half-closes in turn."""
    up_data, down_data = os.urandom(32 * MIB), os.urandom(32 * MIB)
    got_up: list[bytes] = []

    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(down_data)
        got_up.append(await r.read(-1))  # to the client's EOF
        await w.drain()
        w.close()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    before = spliced()
    bytes_in = REGISTRY.value("meshgate_socks5_bytes_total", "in")
    async with portal(socks5_splice=True) as p:
        down = await relay_both_ways(p, port, up_data)
    srv.close()
    assert hashlib.sha256(down).digest() == hashlib.sha256(down_data).digest()
    assert hashlib.sha256(got_up[0]).digest() == hashlib.sha256(up_data).digest()
    assert spliced() == before + 1
    assert REGISTRY.value("meshgate_socks5_bytes_total", "in") - bytes_in == len(up_data)


async def test_a_receiver_that_stops_reading_holds_the_sender_back() -> None:
    """The target reads nothing: the portal stops reading the client once a pipe's worth is
    in flight (the client's writes stop draining), and everything arrives once it reads."""
    reader_box: list[asyncio.StreamReader] = []
    start_reading = asyncio.Event()
    total = 48 * MIB

    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        reader_box.append(r)
        await start_reading.wait()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)  # its reader pauses at 128 KiB
    port = srv.sockets[0].getsockname()[1]
    async with portal(socks5_splice=True) as p:
        _r, w, (rep, *_) = await raw_socks(p.port, request(1, 1, b"\x7f\0\0\1", port))
        assert rep == 0
        (client,) = p.clients
        w.transport.set_write_buffer_limits(high=1 << 30)  # the test client queues freely
        payload = os.urandom(total)
        w.write(payload)
        await async_wait_until(lambda: client._splice is not None, what="relay spliced")
        relay = client._splice
        assert relay is not None
        await async_wait_until(lambda: not relay.dirs[0].reading, what="portal stops reading the client")
        assert relay.dirs[0].pending <= PIPE_SIZE
        assert w.transport.get_write_buffer_size() > 0  # held back, not absorbed
        start_reading.set()
        got = bytearray()
        while len(got) < total:
            part = await asyncio.wait_for(reader_box[0].read(4 * MIB), 10)
            assert part
            got += part
        assert got == payload
        w.close()
    srv.close()


async def test_small_exchanges_stay_in_python() -> None:
    """No bulk, no kernel relay: a request/response smaller than one read."""
    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(await r.read(1024))
        await w.drain()
        w.close()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    before = spliced()
    async with portal(socks5_splice=True) as p:
        r, w, (rep, *_) = await raw_socks(p.port, request(1, 1, b"\x7f\0\0\1", port))
        assert rep == 0
        w.write(b"x" * 100)
        assert await asyncio.wait_for(r.read(-1), 10) == b"x" * 100
        w.close()
    srv.close()
    assert spliced() == before
    assert READ_SIZE > 100


async def test_a_write_high_water_below_a_pipe_keeps_the_python_relay() -> None:
    """limits.socks5_write_high_water under PIPE_SIZE: the kernel relay would hold more than
    that in flight, so the relay stays in Python, whatever it carries."""
    data = os.urandom(8 * MIB)

    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(data)
        await w.drain()
        w.close()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    before = spliced()
    async with portal(socks5_splice=True, socks5_write_high_water=PIPE_SIZE // 2) as p:
        r, w, (rep, *_) = await raw_socks(p.port, request(1, 1, b"\x7f\0\0\1", port))
        assert rep == 0
        assert await asyncio.wait_for(r.read(-1), 30) == data
        w.close()
    srv.close()
    assert spliced() == before


async def test_bulk_stays_in_python_by_default() -> None:
    """limits.socks5_splice off (the default): 32 MiB down and up, reads that fill the read
    buffer, and the relay is never handed to the kernel; every byte arrives, in order."""
    up_data, down_data = os.urandom(32 * MIB), os.urandom(32 * MIB)
    got_up: list[bytes] = []

    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(down_data)
        got_up.append(await r.read(-1))
        await w.drain()
        w.close()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    before = spliced()
    async with portal() as p:
        assert p.svc.server is not None and not p.svc.server.limits.socks5_splice
        down = await relay_both_ways(p, port, up_data)
    srv.close()
    assert hashlib.sha256(down).digest() == hashlib.sha256(down_data).digest()
    assert hashlib.sha256(got_up[0]).digest() == hashlib.sha256(up_data).digest()
    assert spliced() == before
