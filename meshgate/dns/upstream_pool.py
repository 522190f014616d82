"""Persistent upstream connections: pipelined DNS over TCP/TLS, many DoQ streams on one QUIC connection.

Three layers, from the wire up:

* `StreamCore` (sans-I/O): RFC 7766 framing for one TCP/TLS connection. It
  gives every query a message ID unique on that connection (the caller's ID
  may collide with another query in flight there), frames it with the 2-byte
  length, and matches answers arriving in any order back by that ID,
  restoring the caller's ID. Bytes in, (token, answer) out; no sockets.
* Connection adapters: `StreamConnection` (asyncio.Protocol over TCP, TLS or
  a mesh stream) and `DoqConnection` (aioquic; RFC 9250: one bidirectional
  stream per query, ID 0 on the wire, the caller's ID restored in the answer).
* `ConnectionPool`: at most `limits.dns_upstream_max_connections` connections
  per upstream, at most `limits.dns_upstream_max_queries` queries in flight on
  each (the dnsdist CVE-2025-30193 class of bug is the unbounded version of
  this). A query goes to the least loaded open connection with room; a new
  connection opens only when every one is full, and queries arriving while it
  connects wait for it instead of opening their own. A connection with nothing
  in flight for `limits.dns_upstream_idle_timeout` closes. A connection that
  closes (the upstream's idle timeout, a reset) is forgotten and its queries
  fail at once, so the pipeline fails over without waiting for the timeout; a
  query on a reused connection that closed under it is retried once on a fresh
  one (RFC 7766 6.2.1: servers may close idle connections at any time). A query
  that times out with not a byte from its connection meanwhile retires that
  connection (no new queries; closed when the last one ends): a peer that
  vanished without a FIN would otherwise swallow every query sent to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import struct
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, cast

from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.quic import events as qevents

from meshgate.conns import IdleTimer
from meshgate.logs import RateLimitedLog
from meshgate.metrics import REGISTRY

log = logging.getLogger("meshgate.dns.upstream")
rlog = RateLimitedLog(log)

MAX_MESSAGE = 65535
HEADER = 12
OPT_RR = 11  # root name, type, class, TTL, RDLENGTH
QUERY_PAD_BLOCK = 128  # RFC 8467: queries padded to 128-byte blocks on encrypted transports

_connects = REGISTRY.counter(
    "meshgate_dns_upstream_connections_total", "Upstream connections opened", ("upstream",)
)
_pool_full = REGISTRY.counter(
    "meshgate_dns_upstream_pool_full_total",
    "Upstream queries refused: every pooled connection had dns_upstream_max_queries in flight",
    ("upstream",),
)
_stray = REGISTRY.counter(
    "meshgate_dns_upstream_stray_answers_total",
    "Upstream answers matching no query in flight (late after a timeout, or malformed)",
    ("upstream",),
)
_retired = REGISTRY.counter(
    "meshgate_dns_upstream_retired_total",
    "Upstream connections taken out of use after a query timed out in silence",
    ("upstream",),
)


class UpstreamError(Exception):
    pass


class ConnectionClosed(UpstreamError):
    """The connection went away with the query unanswered. `reused`: the connection existed
    before the query (the upstream may have closed it as idle), so one retry is worth it."""

    def __init__(self, message: str, reused: bool = False) -> None:
        super().__init__(message)
        self.reused = reused


def pad_query(wire: bytes, block: int = QUERY_PAD_BLOCK) -> bytes:
    """EDNS(0) padding (RFC 7830) to a multiple of `block` (RFC 8467), for a query whose last
    record is an OPT with no options (what wire.build_query makes); anything else unchanged."""
    n = len(wire)
    if n < HEADER + OPT_RR or wire[n - OPT_RR] != 0 or wire[n - 10 : n - 8] != b"\x00\x29":
        return wire
    if wire[n - 2 :] != b"\x00\x00":
        return wire
    pad = -(n + 4) % block
    return wire[:-2] + struct.pack(">HHH", 4 + pad, 12, pad) + bytes(pad)


# --------------------------------------------------------------------------- sans-I/O framing core


class StreamCore:
    """Pipelined DNS over one byte stream (RFC 7766): framing, per-connection IDs, matching.

    `encode(wire, token)` returns the framed query to write (its ID replaced by one free on
    this connection); `receive(data)` returns (token, answer) for each complete answer, with
    the caller's ID put back. Answers with no query in flight are counted in `stray`.
    """

    def __init__(self, max_outstanding: int) -> None:
        self.max_outstanding = max_outstanding
        self.pending: dict[int, tuple[bytes, object]] = {}  # wire ID -> (caller's ID bytes, token)
        self.stray = 0
        self._buf = bytearray()

    @property
    def full(self) -> bool:
        return len(self.pending) >= self.max_outstanding

    def encode(self, wire: bytes, token: object) -> tuple[int, bytes]:
        if len(wire) < HEADER or len(wire) > MAX_MESSAGE:
            raise ValueError("not a DNS message")
        if self.full:
            raise UpstreamError("too many queries in flight on this connection")
        while True:
            wid = secrets.randbits(16)
            if wid not in self.pending:
                break
        self.pending[wid] = (wire[:2], token)
        return wid, struct.pack(">HH", len(wire), wid) + wire[2:]

    def forget(self, wid: int) -> None:
        """The query was abandoned (timeout): a late answer for it becomes a stray."""
        self.pending.pop(wid, None)

    def receive(self, data: bytes) -> list[tuple[object, bytes]]:
        buf = self._buf
        buf += data
        out: list[tuple[object, bytes]] = []
        off = 0
        end = len(buf)
        while end - off >= 2:
            n = (buf[off] << 8) | buf[off + 1]
            if end - off - 2 < n:
                break
            start = off + 2
            off = start + n
            if n < HEADER:
                self.stray += 1
                continue
            wid = (buf[start] << 8) | buf[start + 1]
            entry = self.pending.pop(wid, None)
            if entry is None:
                self.stray += 1
                continue
            out.append((entry[1], entry[0] + bytes(buf[start + 2 : off])))
        del buf[:off]
        return out


# --------------------------------------------------------------------------- connections


class PooledConnection(Protocol):
    """What the pool needs from one upstream connection."""

    received: int  # reads so far: tells a silent peer from a slow answer
    on_close: Callable[[], None] | None

    @property
    def alive(self) -> bool: ...

    def send(self, wire: bytes) -> tuple[int, asyncio.Future[bytes]]: ...

    def forget(self, key: int) -> None: ...

    def close(self) -> None: ...


class StreamConnection(asyncio.Protocol):
    """DNS over TCP/TLS (or a mesh stream): many queries pipelined on one connection."""

    def __init__(self, max_queries: int, name: str) -> None:
        self.core = StreamCore(max_queries)
        self.name = name
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.received = 0
        self.on_close: Callable[[], None] | None = None
        self._out: list[bytes] = []
        self._flush_scheduled = False

    @property
    def alive(self) -> bool:
        return not self.closed and self.transport is not None and not self.transport.is_closing()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's TLS transport and mesh streams are no asyncio.Transport subclasses.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.received += 1
        stray = self.core.stray
        for fut, answer in self.core.receive(data):
            f = cast("asyncio.Future[bytes]", fut)
            if not f.done():
                f.set_result(answer)
        if self.core.stray != stray:
            _stray.labels(self.name).inc(self.core.stray - stray)
            rlog.debug(f"stray {self.name}", "dns upstream %s: %d answers matched no query in flight",
                       self.name, self.core.stray - stray)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        pending = list(self.core.pending.values())
        self.core.pending.clear()
        err = ConnectionClosed(f"{self.name} closed the connection")
        for _qid, fut in pending:
            f = cast("asyncio.Future[bytes]", fut)
            if not f.done():
                f.set_exception(err)
        if self.on_close is not None:
            self.on_close()

    def send(self, wire: bytes) -> tuple[int, asyncio.Future[bytes]]:
        if not self.alive:
            raise ConnectionClosed(f"{self.name}: connection is closed")
        fut: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        wid, frame = self.core.encode(wire, fut)
        # Queries started in one loop tick leave in one writelines.
        self._out.append(frame)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)
        return wid, fut

    def _flush(self) -> None:
        self._flush_scheduled = False
        out, self._out = self._out, []
        if out and self.alive:
            assert self.transport is not None
            self.transport.writelines(out)

    def forget(self, key: int) -> None:
        self.core.forget(key)

    def close(self) -> None:
        self.closed = True
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()


class DoqConnection(QuicConnectionProtocol):
    """DoQ (RFC 9250) client: each query on its own bidirectional stream of one QUIC connection,
    ID 0 on the wire, the caller's ID restored in the answer."""

    def __init__(self, *args: Any, max_queries: int = 64, name: str = "", **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.max_queries = max_queries
        self.name = name
        self.streams: dict[int, tuple[bytes, asyncio.Future[bytes], bytearray]] = {}
        self.closed = False
        self.received = 0
        self.on_close: Callable[[], None] | None = None

    @property
    def alive(self) -> bool:
        return not self.closed

    def datagram_received(self, data: bytes | str, addr: Any) -> None:
        self.received += 1
        super().datagram_received(data, addr)

    def send(self, wire: bytes) -> tuple[int, asyncio.Future[bytes]]:
        if self.closed:
            raise ConnectionClosed(f"{self.name}: connection is closed")
        if len(self.streams) >= self.max_queries:
            raise UpstreamError("too many queries in flight on this connection")
        if len(wire) < HEADER or len(wire) > MAX_MESSAGE:
            raise ValueError("not a DNS message")
        fut: asyncio.Future[bytes] = self._loop.create_future()
        sid = self._quic.get_next_available_stream_id()
        self.streams[sid] = (wire[:2], fut, bytearray())
        self._quic.send_stream_data(sid, struct.pack(">HH", len(wire), 0) + wire[2:], end_stream=True)
        self._transmit_soon()  # queries of one tick leave in the same datagrams
        return sid, fut

    def forget(self, key: int) -> None:
        if self.streams.pop(key, None) is not None and not self.closed:
            # REQUEST_CANCELLED (RFC 9250 4.3): we gave up on this query.
            with contextlib.suppress(Exception):
                self._quic.reset_stream(key, 0x3)
                self._quic.stop_stream(key, 0x3)
            self._transmit_soon()

    def quic_event_received(self, event: qevents.QuicEvent) -> None:
        if isinstance(event, qevents.StreamDataReceived):
            entry = self.streams.get(event.stream_id)
            if entry is None:
                return  # a stream we gave up on, or one the server opened (not DoQ): ignored
            qid, fut, buf = entry
            buf += event.data
            if len(buf) > MAX_MESSAGE + 2:
                self._fail(event.stream_id, UpstreamError(f"{self.name}: answer too long"))
            elif event.end_stream:
                del self.streams[event.stream_id]
                n = int.from_bytes(buf[:2], "big") if len(buf) >= 2 else -1
                if fut.done():
                    pass
                elif n != len(buf) - 2 or n < HEADER:
                    fut.set_exception(UpstreamError(f"{self.name}: bad DoQ answer framing"))
                else:
                    fut.set_result(qid + bytes(buf[4:]))
        elif isinstance(event, qevents.StreamReset):
            self._fail(event.stream_id, UpstreamError(f"{self.name}: stream reset ({event.error_code})"))
        elif isinstance(event, qevents.ConnectionTerminated):
            self._terminated()

    def _fail(self, sid: int, exc: Exception) -> None:
        entry = self.streams.pop(sid, None)
        if entry is not None and not entry[1].done():
            entry[1].set_exception(exc)

    def _terminated(self) -> None:
        if self.closed:
            return
        self.closed = True
        err = ConnectionClosed(f"{self.name} closed the connection")
        for sid in list(self.streams):
            self._fail(sid, err)
        if self.on_close is not None:
            self.on_close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._terminated()

    def close(self, error_code: int = 0, reason_phrase: str = "") -> None:
        if not self.closed:
            super().close(error_code, reason_phrase)
        self._terminated()
        if self._transport is not None:
            # The CONNECTION_CLOSE went out in close()'s transmit; the socket is ours alone.
            self._loop.call_soon(self._transport.close)


# --------------------------------------------------------------------------- the pool


class _Slot:
    __slots__ = ("conn", "connecting", "load", "retired", "timer", "uses")

    def __init__(self, timer: IdleTimer) -> None:
        self.conn: PooledConnection | None = None
        self.connecting: asyncio.Future[PooledConnection] | None = None
        self.load = 0  # queries in flight or waiting for the connection
        self.uses = 0  # queries ever sent on it
        self.retired = False
        self.timer = timer  # armed once connected: closes it idle_timeout after its last query


Opener = Callable[[], Awaitable[PooledConnection]]


class ConnectionPool:
    """Bounded persistent connections to one upstream (see the module docstring)."""

    def __init__(self, name: str, opener: Opener, *, max_connections: int, max_queries: int,
                 idle_timeout: float, connect_timeout: float) -> None:
        self.name = name
        self.opener = opener
        self.max_connections = max_connections
        self.max_queries = max_queries
        self.idle_timeout = idle_timeout
        self.connect_timeout = connect_timeout
        self.slots: list[_Slot] = []
        self.connects = 0  # connections opened (tests and status see reuse)

    def __len__(self) -> int:
        return len(self.slots)

    async def exchange(self, wire: bytes, timeout: float) -> bytes:
        """One query over a pooled connection; TimeoutError after `timeout` seconds."""
        loop = asyncio.get_running_loop()
        async with asyncio.timeout_at(loop.time() + timeout):
            try:
                return await self._once(wire)
            except ConnectionClosed as e:
                if not e.reused:
                    raise
            # The reused connection closed under us (e.g. the upstream's idle timeout):
            # once more on a fresh one, within the same deadline.
            return await self._once(wire)

    async def _once(self, wire: bytes) -> bytes:
        slot = self._pick()
        slot.load += 1
        reused = slot.conn is not None  # it existed before this query: the upstream may have closed it
        slot.uses += 1
        key = -1
        conn: PooledConnection | None = None
        received = 0
        try:
            if slot.conn is not None:
                conn = slot.conn
            else:
                assert slot.connecting is not None
                conn = await asyncio.shield(slot.connecting)
            received = conn.received
            key, fut = conn.send(wire)
            return await fut
        except ConnectionClosed as e:
            raise ConnectionClosed(str(e), reused) from None
        except (TimeoutError, asyncio.CancelledError):
            if conn is not None and key >= 0:
                conn.forget(key)
                if conn.received == received and not slot.retired and conn.alive:
                    slot.retired = True  # silent the whole wait: maybe gone without a FIN
                    _retired.labels(self.name).inc()
                    rlog.debug(f"retire {self.name}", "dns upstream %s: no answer and no data "
                               "before the deadline: retiring the connection", self.name)
            raise
        finally:
            slot.load -= 1
            slot.timer.touch()
            if slot.retired and slot.load == 0:
                self._discard(slot)

    def _pick(self) -> _Slot:
        best: _Slot | None = None
        for s in self.slots:
            if s.retired or s.load >= self.max_queries or (s.conn is not None and not s.conn.alive):
                continue
            if best is None or s.load < best.load:
                best = s
                if s.load == 0:
                    break
        if best is not None:
            return best
        if len(self.slots) >= self.max_connections:
            _pool_full.labels(self.name).inc()
            rlog.debug(f"full {self.name}", "dns upstream %s: %d connections with %d queries each in "
                       "flight (limits.dns_upstream_max_connections, dns_upstream_max_queries)",
                       self.name, len(self.slots), self.max_queries)
            raise UpstreamError(f"{self.name}: every pooled connection is busy")
        return self._open()

    def _open(self) -> _Slot:
        loop = asyncio.get_running_loop()
        slot = _Slot(IdleTimer(loop, self.idle_timeout, lambda: self._discard(slot), busy=lambda: slot.load))
        self.slots.append(slot)
        fut: asyncio.Future[PooledConnection] = loop.create_future()
        slot.connecting = fut
        task = loop.create_task(self._connect(slot, fut))
        task.add_done_callback(lambda t: None if t.cancelled() else t.exception())
        return slot

    async def _connect(self, slot: _Slot, fut: asyncio.Future[PooledConnection]) -> None:
        # Its own task and deadline: a query that gives up does not abort the connect
        # the other waiting queries share.
        try:
            async with asyncio.timeout(self.connect_timeout):
                conn = await self.opener()
        except BaseException as e:
            self._discard(slot)
            fut.set_exception(e if isinstance(e, Exception) else UpstreamError("connect cancelled"))
            fut.exception()  # retrieved: nobody may be waiting any more
            if not isinstance(e, Exception):
                raise
            return
        self.connects += 1
        _connects.labels(self.name).inc()
        if slot not in self.slots:  # the pool closed meanwhile
            conn.close()
            fut.set_exception(UpstreamError(f"{self.name}: upstream closed"))
            fut.exception()
            return
        conn.on_close = lambda: self._discard(slot)
        slot.conn = conn
        slot.connecting = None
        fut.set_result(conn)
        slot.timer.start()

    def _discard(self, slot: _Slot) -> None:
        with contextlib.suppress(ValueError):
            self.slots.remove(slot)
        slot.timer.cancel()
        conn, slot.conn = slot.conn, None
        if conn is not None:
            conn.on_close = None
            if conn.alive:
                conn.close()

    def close(self) -> None:
        for slot in list(self.slots):
            self._discard(slot)
