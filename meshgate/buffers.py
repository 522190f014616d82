"""Pooled byte buffers with honest lifetimes (docs/ARCHITECTURE.md, "Pooled buffers").

A `Buffer` is a bytearray with `headroom` bytes reserved in front, so a
header (a 2-byte DNS length prefix, a SOCKS UDP header, a mesh frame header)
is written in place instead of copying the payload behind it.

Lifetime rules, enforced here and by the `release_after_*` helpers:

* A buffer returns to the pool only after the write that consumed it
  *succeeded* and nothing else holds it.
* aioquic `send_stream_data` copies its argument: the buffer is free once it
  returns without raising. The DoH server's h2wire (meshgate/dns/h2wire.py)
  copies a body when it joins the frames (`respond()`, or `data_to_send()`
  after `send_data`): free from then on.
* asyncio's `transport.write` may keep a view of the caller's memory (uvloop
  and CPython 3.12+ both can), so for a TCP/TLS transport the buffer is free
  only once `get_write_buffer_size()` is 0; until then it is parked and
  released by `release_when_drained`.
* After a failed, partial or abandoned write the buffer is *dropped*: never
  reused, left to the garbage collector.
* The pool refuses (drops) a buffer that still has live memoryview exports;
  a bytearray with exports cannot be resized, which is how we detect them.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Protocol

from meshgate.metrics import REGISTRY, Counter


class _Transport(Protocol):
    def get_write_buffer_size(self) -> int: ...
    def is_closing(self) -> bool: ...


_reused = REGISTRY.counter("meshgate_buffer_reused_total", "Buffers handed out from the pool")
_allocated = REGISTRY.counter("meshgate_buffer_allocated_total", "Buffers newly allocated")
_dropped = REGISTRY.counter(
    "meshgate_buffer_dropped_total", "Buffers not returned to the pool", ("reason",)
)
_DROP_EXPORTED: Counter = _dropped.labels("exported")
_DROP_FAILED: Counter = _dropped.labels("failed_write")
_DROP_FULL: Counter = _dropped.labels("pool_full")
_DROP_SIZE: Counter = _dropped.labels("wrong_size")
_REUSED: Counter = _reused.labels()


class Buffer:
    """`data[headroom:headroom+length]` is the payload; `data[:headroom]` is for headers."""

    __slots__ = ("data", "free", "headroom", "length", "pool", "start")

    def __init__(self, capacity: int, headroom: int, pool: BufferPool | None = None) -> None:
        self.data = bytearray(capacity + headroom)
        self.headroom = headroom
        self.start = headroom  # moves left when a header is prepended
        self.length = 0
        self.pool = pool
        self.free = False  # True while sitting in the pool's free-list

    @property
    def capacity(self) -> int:
        return len(self.data) - self.headroom

    def write(self, payload: bytes | bytearray | memoryview) -> None:
        """Replace the payload (headroom untouched)."""
        n = len(payload)
        if n > self.capacity:
            raise ValueError(f"payload of {n} bytes exceeds buffer capacity {self.capacity}")
        self.start = self.headroom
        self.data[self.headroom : self.headroom + n] = payload
        self.length = n

    def append(self, payload: bytes | bytearray | memoryview) -> None:
        end = self.start + self.length
        n = len(payload)
        if end + n > len(self.data):
            raise ValueError(f"append of {n} bytes exceeds buffer capacity {self.capacity}")
        self.data[end : end + n] = payload
        self.length += n

    def prepend(self, header: bytes | bytearray | memoryview) -> None:
        """Write `header` into the headroom directly in front of the current view."""
        n = len(header)
        if n > self.start:
            raise ValueError(f"header of {n} bytes exceeds remaining headroom {self.start}")
        self.start -= n
        self.data[self.start : self.start + n] = header
        self.length += n

    def prepend_length(self) -> None:
        """The 2-byte big-endian length prefix of DNS over TCP/DoT/DoQ."""
        n = self.length
        if n > 0xFFFF:
            raise ValueError(f"message of {n} bytes does not fit a 2-byte length prefix")
        self.prepend(n.to_bytes(2, "big"))

    def view(self) -> memoryview:
        """A view of the current payload. Release it (or let it die) before recycling."""
        return memoryview(self.data)[self.start : self.start + self.length]

    def tobytes(self) -> bytes:
        return bytes(self.data[self.start : self.start + self.length])

    def recycle(self) -> None:
        """Return to the pool: call only after the consuming write succeeded. (The pool's side
        of it is here, not in BufferPool.put: one call per answer instead of two.)"""
        pool = self.pool
        if pool is None or self.free:
            return  # dropped, one-off, or already free: never hand out twice
        data = self.data
        if len(data) != pool._size:
            self.pool = None
            _DROP_SIZE.inc()
            return
        # A bytearray with a live memoryview export refuses to resize (BufferError).
        try:
            data.append(0)
        except BufferError:
            self.pool = None  # a later recycle() of the same buffer is a no-op
            _DROP_EXPORTED.inc()
            return
        del data[-1]
        free = pool._free
        if len(free) >= pool.max_free:
            self.pool = None
            _DROP_FULL.inc()
            return
        self.free = True
        free.append(self)

    def drop(self) -> None:
        """Never reuse: the write failed or was abandoned and someone may hold it."""
        if self.pool is not None:
            _DROP_FAILED.inc()
        self.pool = None


class BufferPool:
    """A bounded free-list of equally sized buffers.

    get() and put() are the pooled answer path's whole cost, so they must cost no more than
    the allocation they replace (bench/dns.py's dns-pack rows): the reuse counter is batched
    (one locked increment per event-loop tick instead of one per buffer) and the checks are
    inlined.
    """

    def __init__(self, capacity: int = 4096, headroom: int = 64, max_free: int = 1024) -> None:
        self.buffer_capacity = capacity
        self.headroom = headroom
        self.max_free = max_free
        self._size = capacity + headroom
        self._free: deque[Buffer] = deque()
        self._reused = 0  # handed out again since the last flush into meshgate_buffer_reused_total
        self._flush_armed = False

    def __len__(self) -> int:
        return len(self._free)

    def get(self) -> Buffer:
        free = self._free
        if free:
            buf = free.pop()
            buf.free = False
            buf.start = buf.headroom
            buf.length = 0
            self._reused += 1
            if not self._flush_armed:
                self._arm_flush()
            return buf
        _allocated.inc()
        return Buffer(self.buffer_capacity, self.headroom, self)

    def _arm_flush(self) -> None:
        """Add the reuses counted so far to the counter at the end of this loop tick (outside a
        loop: now), so a reader of /metrics, which runs in a later callback, sees them all."""
        loop = asyncio._get_running_loop()  # None outside a loop (no exception to raise and catch)
        if loop is None:
            self.flush()
            return
        self._flush_armed = True
        loop.call_soon(self.flush)

    def flush(self) -> None:
        self._flush_armed = False
        if self._reused:
            _REUSED.inc(self._reused)
            self._reused = 0

    def put(self, buf: Buffer) -> None:
        """Take `buf` back (Buffer.recycle); a buffer of another pool, or none, is not taken."""
        if buf.pool is self:
            buf.recycle()


# --------------------------------------------------------------------------- write helpers


def release_after_copying_write(buf: Buffer, ok: bool) -> None:
    """For writers that copy (h2wire's frame join, aioquic send_stream_data, sendto)."""
    if ok:
        buf.recycle()
    else:
        buf.drop()


def release_when_drained(
    buf: Buffer, transport: _Transport, waiters: deque[Buffer] | None = None
) -> bool:
    """After `transport.write(buf.view())`: recycle now if the transport holds
    nothing, else park the buffer; `drain_parked` recycles it once drained.

    Returns True if the buffer was recycled immediately.
    """
    if transport.is_closing():
        buf.drop()
        return False
    if transport.get_write_buffer_size() == 0:
        buf.recycle()
        return True
    if waiters is None:
        buf.drop()  # nobody will come back for it: never reuse
        return False
    waiters.append(buf)
    return False


def drain_parked(transport: _Transport, waiters: deque[Buffer]) -> None:
    """Call from `resume_writing` / after writes: recycle parked buffers if the
    transport's buffer is empty; drop them if the connection is gone."""
    if not waiters:
        return
    if transport.is_closing():
        abandon_parked(waiters)
        return
    if transport.get_write_buffer_size() == 0:
        while waiters:
            waiters.popleft().recycle()


def abandon_parked(waiters: deque[Buffer]) -> None:
    """Connection lost with writes pending: the transport may still hold views."""
    while waiters:
        waiters.popleft().drop()
