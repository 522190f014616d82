"""The pool never hands out a buffer that a transport may still read from."""

import asyncio
import socket
from collections import deque
from typing import cast

import pytest

from meshgate.buffers import (
    Buffer,
    BufferPool,
    abandon_parked,
    drain_parked,
    release_after_copying_write,
    release_when_drained,
)
from meshgate.metrics import REGISTRY
from tests.helpers import async_wait_until

# Larger than what loopback socket buffers absorb, so asyncio must keep a part.
PAYLOAD = 32 << 20


def dropped(reason: str) -> float:
    return REGISTRY.value("meshgate_buffer_dropped_total", reason)


def test_headroom_prepend_in_place() -> None:
    pool = BufferPool(capacity=512, headroom=8)
    buf = pool.get()
    buf.write(b"\x12\x34payload")
    before = id(buf.data)
    buf.prepend_length()
    assert buf.tobytes() == b"\x00\x09\x12\x34payload"
    assert id(buf.data) == before  # no second allocation
    with pytest.raises(ValueError):
        buf.prepend(b"x" * 7)  # only 6 bytes of headroom left


def test_recycle_and_reuse() -> None:
    pool = BufferPool(capacity=64, headroom=4)
    a = pool.get()
    a.write(b"abc")
    release_after_copying_write(a, ok=True)
    b = pool.get()
    assert b is a and b.length == 0 and b.start == b.headroom


def test_failed_write_drops_forever() -> None:
    pool = BufferPool(capacity=64, headroom=4)
    a = pool.get()
    release_after_copying_write(a, ok=False)
    a.recycle()  # a later accidental recycle must not bring it back
    assert pool.get() is not a


def test_live_memoryview_export_is_refused() -> None:
    pool = BufferPool(capacity=64, headroom=4)
    a = pool.get()
    a.write(b"xyz")
    before = dropped("exported")
    view = a.view()  # someone still holds a view
    a.recycle()
    assert dropped("exported") == before + 1
    assert pool.get() is not a
    view.release()


def test_double_recycle_does_not_duplicate() -> None:
    pool = BufferPool(capacity=16, headroom=0)
    a = pool.get()
    a.recycle()
    a.recycle()
    assert len(pool) == 1


def test_pool_is_bounded() -> None:
    pool = BufferPool(capacity=16, headroom=0, max_free=2)
    bufs = [pool.get() for _ in range(5)]
    for b in bufs:
        b.recycle()
    assert len(pool) == 2


def test_foreign_buffer_not_adopted() -> None:
    pool = BufferPool(capacity=16, headroom=0)
    pool.put(Buffer(16, 0, None))
    assert len(pool) == 0


class _Sink(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.paused = asyncio.Event()
        self.resumed = asyncio.Event()
        self.lost = asyncio.Event()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def pause_writing(self) -> None:
        self.paused.set()

    def resume_writing(self) -> None:
        self.resumed.set()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost.set()


async def _stalled_connection() -> tuple[asyncio.Transport, _Sink, socket.socket]:
    """A real loopback TCP connection whose peer does not read, so writes stay queued."""
    loop = asyncio.get_running_loop()
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    sink = _Sink()
    task = loop.create_task(loop.create_connection(lambda: sink, *listener.getsockname()))
    peer, _ = await loop.sock_accept(listener)
    listener.close()
    transport, _ = await task
    return transport, sink, peer


async def test_partial_write_parks_buffer_until_drained() -> None:
    pool = BufferPool(capacity=PAYLOAD, headroom=2)
    transport, _sink, peer = await _stalled_connection()
    buf = pool.get()
    buf.write(b"\xab" * (PAYLOAD))
    transport.write(buf.view())  # the kernel takes a little; asyncio keeps the rest
    assert transport.get_write_buffer_size() > 0
    parked: deque[Buffer] = deque()
    assert release_when_drained(buf, transport, parked) is False
    assert pool.get() is not buf  # still held by the transport: never handed out

    # The peer reads everything; the transport drains and the buffer comes back.
    loop = asyncio.get_running_loop()
    got = 0
    peer.setblocking(False)
    while got < (PAYLOAD):
        chunk = await loop.sock_recv(peer, 1 << 16)
        assert chunk
        got += len(chunk)
    await async_wait_until(lambda: transport.get_write_buffer_size() == 0, what="transport drained")
    drain_parked(transport, parked)
    assert not parked
    assert pool.get() is buf
    transport.close()
    peer.close()


async def test_write_after_connection_lost_never_reuses() -> None:
    pool = BufferPool(capacity=PAYLOAD, headroom=2)
    transport, sink, peer = await _stalled_connection()
    buf = pool.get()
    buf.write(b"\xcd" * (PAYLOAD))
    transport.write(buf.view())
    parked: deque[Buffer] = deque()
    release_when_drained(buf, transport, parked)
    before = dropped("failed_write")
    # The peer vanishes with our data unread.
    peer.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    peer.close()
    await asyncio.wait_for(sink.lost.wait(), 10)
    abandon_parked(parked)
    assert dropped("failed_write") == before + 1
    # A write on the dead transport: the buffer goes nowhere near the pool.
    late = pool.get()
    assert late is not buf
    late.write(b"late")
    try:
        transport.write(late.view())
    except RuntimeError:  # uvloop refuses a write on a closed transport outright
        late.drop()
    else:  # asyncio accepts it silently; the closing transport makes release drop it
        assert release_when_drained(late, transport, parked) is False
    assert pool.get() is not buf and pool.get() is not late
