"""DoH and ODoH over HTTP/1.1 (the h1wire sans-I/O parser + asyncio Protocol), and the TLS
server that speaks HTTP/1.1 or HTTP/2 per connection.

`start_https(handler, ...)` serves one handler (meshgate.dns.h2server's Handler: DohApp,
OdohApp) on one listener; TLS offers ALPN `h2` and `http/1.1`. Each connection starts as an
`H1ServerProtocol`: ALPN `h2` hands it at once to an h2server.H2ServerProtocol
(`transport.set_protocol`); `http/1.1` or no ALPN stays HTTP/1.1, except that a client without
ALPN whose first bytes are the HTTP/2 preface (h2 with prior knowledge) is handed over too.

HTTP/1.1 rules: keep-alive; pipelining with answers in request order and at most
limits.doh_max_streams requests in flight per connection (beyond that the parser is not asked
for more and the socket stops being read); the h1wire bounds (head 16 KiB: 431, body 65535: 413,
POST without Content-Length: 411, Transfer-Encoding: 501, malformed: 400, each answered and the
connection closed, counted under the listener's errors with a rate-limited debug line naming
the peer). Connections: limits.dns_tcp_max_clients, limits.dns_tcp_max_clients_per_source and
limits.dns_tcp_idle_timeout, as HTTP/2.

A request that never ends is closed (issue 16 item 8): once bytes of a request are in and the
parser wants more (it is not held back by the in-flight cap), the rest of that request (head and
body) must arrive within limits.doh_request_timeout seconds, or the client gets 408 and the
connection closes (`errors{reason="request_timeout"}`). Each byte resets the idle timer, so
without this a client sending a byte every few seconds held its slot forever. The deadline runs
only while a request is partly in: a pause between requests is the idle timer's business.

Pooled buffers (docs/ARCHITECTURE.md): an answer's Buffer is written as a view after its
header bytes, then released with buffers.release_when_drained: recycled once the transport
holds nothing (get_write_buffer_size() == 0), parked until `resume_writing` drains it, dropped
if the connection goes first.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable
from http import HTTPStatus
from typing import Any, cast

from meshgate.buffers import Buffer, abandon_parked, drain_parked, release_when_drained
from meshgate.config import LimitsConfig
from meshgate.conns import MIN_REARM, IdleTimer
from meshgate.dns.clients import ClientConns, admit_client
from meshgate.dns.h1wire import H1Continue, H1Error, H1Preface, H1Request, H1Wire
from meshgate.dns.h2server import H2ServerProtocol, Handler, Response, current_peer, handler_response
from meshgate.dns.listeners import serve_stream
from meshgate.dns.stats import ListenerStats
from meshgate.logs import RateLimitedLog

log = logging.getLogger("meshgate.dns.h1")
rlog = RateLimitedLog(log)

ALPN = ["h2", "http/1.1"]
_TEXT = [("content-type", "text/plain; charset=utf-8")]
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_HEADS_MAX = 256


def _phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return ""


class _Slot:
    """One request, in arrival order, until its answer is written."""

    __slots__ = ("close", "head_only", "res")

    def __init__(self, close: bool, head_only: bool) -> None:
        self.close = close
        self.head_only = head_only
        self.res: Response | None = None


class H1ServerProtocol(asyncio.Protocol):
    def __init__(self, handler: Handler, stats: ListenerStats, limits: LimitsConfig,
                 conns: set[Any]) -> None:
        self.handler = handler
        self.stats = stats
        self.limits = limits
        self.conns = conns
        self.loop = asyncio.get_running_loop()
        self.max_inflight = limits.doh_max_streams
        self.wire = H1Wire()
        self.transport: asyncio.Transport | None = None
        self.peer: Any = None
        self.alpn: str | None = None
        self.queue: deque[_Slot] = deque()
        self.parked: deque[Buffer] = deque()
        self.closing = False  # a response that closes is queued: read and parse nothing more
        self.write_paused = False
        self.read_paused = False
        self.pump_scheduled = False
        self.tasks: set[asyncio.Task[None]] = set()
        self.heads: dict[tuple[Any, ...], bytes] = {}
        self.partial_since: float | None = None  # when the request partly in began to arrive
        self.deadline: asyncio.TimerHandle | None = None
        self.request_timeout = limits.doh_request_timeout
        self.timer = IdleTimer(self.loop, limits.dns_tcp_idle_timeout, self._idle, busy=self.queue.__len__)

    # ------------------------------------------------------------------ connection

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's TLS transport is no asyncio.Transport subclass (see h2server).
        self.transport = cast(asyncio.Transport, transport)
        ssl_obj = transport.get_extra_info("ssl_object")
        self.alpn = ssl_obj.selected_alpn_protocol() if ssl_obj is not None else None
        if self.alpn == "h2":
            self._to_h2(b"")
            return
        self.peer = transport.get_extra_info("peername")
        if not admit_client(self.conns, self, self.peer, self.limits, self.stats):
            self.transport.abort()
            return
        self.timer.start()

    def _to_h2(self, first: bytes) -> None:
        """Hand the connection to the HTTP/2 server (it admits and counts it itself)."""
        t = self.transport
        assert t is not None
        self.timer.cancel()
        self._cancel_deadline()
        self.conns.discard(self)
        self.transport = None
        h2 = H2ServerProtocol(self.handler, self.stats, self.limits, self.conns)
        t.set_protocol(h2)
        h2.connection_made(t)
        if first and h2.transport is not None:
            h2.data_received(first)

    def _idle(self) -> None:
        t = self.transport
        if t is not None and not t.is_closing():
            t.close()

    def _cancel_deadline(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None

    def _watch_partial(self, pulled: bool) -> None:
        """After a pump: start, keep or end the deadline of a request partly in. `pulled`: a
        request was taken this time (what is buffered now is the start of the next one)."""
        if pulled:
            self.partial_since = None
        if self.wire.partial and not self.closing and len(self.queue) < self.max_inflight:
            if self.partial_since is None:
                self.partial_since = self.loop.time()
                if self.deadline is None:
                    self.deadline = self.loop.call_later(self.request_timeout, self._check_deadline)
        else:
            self.partial_since = None

    def _check_deadline(self) -> None:
        self.deadline = None
        since = self.partial_since
        if since is None or self.transport is None or self.closing:
            return
        left = since + self.request_timeout - self.loop.time()
        if left > 0:
            self.deadline = self.loop.call_later(max(left, MIN_REARM), self._check_deadline)
            return
        self._error("request_timeout", "request not finished in %.1f s (limits.doh_request_timeout)",
                    self.request_timeout)
        slot = _Slot(True, False)
        slot.res = (408, _TEXT, b"408 Request Timeout\n")
        self.queue.append(slot)
        self.closing = True
        self.partial_since = None
        self._pump()

    def connection_lost(self, exc: Exception | None) -> None:
        self.conns.discard(self)
        self.timer.cancel()
        self._cancel_deadline()
        for slot in self.queue:
            if slot.res is not None:
                _drop(slot.res[2])
        self.queue.clear()
        abandon_parked(self.parked)
        for task in list(self.tasks):
            task.cancel()
        self.transport = None

    def pause_writing(self) -> None:
        self.write_paused = True
        self._reading()

    def resume_writing(self) -> None:
        self.write_paused = False
        if self.transport is not None:
            drain_parked(self.transport, self.parked)
        self._reading()

    def _reading(self) -> None:
        t = self.transport
        if t is None or t.is_closing():
            return
        want = not self.write_paused and len(self.queue) < self.max_inflight
        if want and self.read_paused:
            self.read_paused = False
            t.resume_reading()
        elif not want and not self.read_paused:
            self.read_paused = True
            t.pause_reading()

    def _error(self, reason: str, msg: str, *args: object) -> None:
        self.stats.error(reason)
        rlog.debug(f"{self.stats.name} {reason} {self.peer}", "doh %s: %s: " + msg,
                   self.stats.name, self.peer, *args)

    # ------------------------------------------------------------------ requests

    def data_received(self, data: bytes) -> None:
        self.timer.touch()
        if self.closing:
            return
        self.wire.receive(data)
        self._pump()

    def _pump(self) -> None:
        self.pump_scheduled = False
        pulled = False
        while self.transport is not None:
            pulled = self._pull() or pulled
            if not self._flush() or self.closing:
                break
        if self.transport is not None:
            self._watch_partial(pulled)
        self._reading()

    def _schedule_pump(self) -> None:
        # Answers finishing in one loop tick leave in one write.
        if not self.pump_scheduled:
            self.pump_scheduled = True
            self.loop.call_soon(self._pump)

    def _pull(self) -> bool:
        """Take what the parser has, up to the in-flight cap; whether a request came."""
        wire = self.wire
        queue = self.queue
        pulled = False
        while not self.closing and len(queue) < self.max_inflight:
            ev = wire.next_event()
            if ev is None:
                return pulled
            if type(ev) is H1Request:
                pulled = True
                self._request(ev)
            elif type(ev) is H1Continue:
                if not queue and self.transport is not None:  # never ahead of an earlier answer
                    self.transport.write(_CONTINUE)
            elif type(ev) is H1Error:
                self._error(ev.reason, "%s", ev.detail)
                slot = _Slot(True, False)
                slot.res = (ev.status, _TEXT, f"{ev.status} {_phrase(ev.status)}\n".encode())
                queue.append(slot)
                self.closing = True
            elif type(ev) is H1Preface:
                if self.alpn is None and not queue:
                    self._to_h2(wire.rest())
                    return pulled
                self._error("h1_malformed", "HTTP/2 preface after ALPN %r", self.alpn)
                slot = _Slot(True, False)
                slot.res = (400, _TEXT, b"400 Bad Request\n")
                queue.append(slot)
                self.closing = True
        return pulled

    def _request(self, req: H1Request) -> None:
        slot = _Slot(not req.keep_alive, req.method == "HEAD")
        self.queue.append(slot)
        if not req.keep_alive:
            self.closing = True
        if current_peer.get() is not self.peer:
            current_peer.set(self.peer)
        try:
            res = self.handler(req.method, req.target, req.headers, req.body)
        except Exception as e:
            self._error("handler", "handler failed: %r", e)
            res = (500, [], b"")
        if type(res) is tuple:
            slot.res = res
            return
        task = self.loop.create_task(self._await(slot, cast(Awaitable[Response], res)))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _await(self, slot: _Slot, pending: Awaitable[Response]) -> None:
        res = await handler_response(pending, self._error)
        if self.transport is None:
            _drop(res[2])
            return
        slot.res = res
        self._schedule_pump()

    # ------------------------------------------------------------------ responses

    def _head(self, status: int, headers: list[tuple[str, str]], n: int, close: bool) -> bytes:
        key = (status, n, close, *headers)
        head = self.heads.get(key)
        if head is None:
            lines = [f"HTTP/1.1 {status} {_phrase(status)}\r\n"]
            lines += [f"{k}: {v}\r\n" for k, v in headers]
            lines.append(f"content-length: {n}\r\n")
            if close:
                lines.append("connection: close\r\n")
            lines.append("\r\n")
            head = "".join(lines).encode("latin-1")
            if len(self.heads) >= _HEADS_MAX:
                self.heads.clear()
            self.heads[key] = head
        return head

    def _flush(self) -> int:
        """Write the answers ready at the head of the queue (one writelines); how many."""
        t = self.transport
        queue = self.queue
        if t is None or not queue or queue[0].res is None:
            return 0
        drain_parked(t, self.parked)
        pieces: list[bytes | memoryview] = []
        bufs: list[Buffer] = []
        close = False
        count = 0
        while queue and queue[0].res is not None and not close:
            slot = queue.popleft()
            count += 1
            status, headers, body = cast(Response, slot.res)
            slot.res = None
            close = slot.close
            if type(body) is Buffer:
                pieces.append(self._head(status, headers, body.length, close))
                if slot.head_only:
                    body.recycle()  # never written
                else:
                    pieces.append(body.view())
                    bufs.append(body)
            else:
                raw = cast(bytes, body)
                head = self._head(status, headers, len(raw), close)
                pieces.append(head if slot.head_only or not raw else head + raw)
        if t.is_closing():
            del pieces
            for buf in bufs:
                buf.drop()
            return 0
        t.writelines(pieces)
        del pieces  # our views of the buffers: gone before they may go back to the pool
        for buf in bufs:
            release_when_drained(buf, t, self.parked)
        if close:
            self.closing = True
            for slot in queue:  # nothing after a closing answer is sent
                if slot.res is not None:
                    _drop(slot.res[2])
            queue.clear()
            t.close()
        return count


def _drop(body: Any) -> None:
    if isinstance(body, Buffer):
        body.drop()


async def start_https(handler: Handler, stats: ListenerStats, limits: LimitsConfig, host: str, port: int,
                      ssl: Any, *, reuse_port: bool = False) -> tuple[asyncio.Server, set[Any]]:
    """A DoH/ODoH server for `handler`: HTTP/1.1 and HTTP/2 on one port (ALPN, see above). The
    set holds the live connections of either protocol."""
    conns = ClientConns(limits)
    server = await serve_stream(lambda: H1ServerProtocol(handler, stats, limits, conns), limits, host, port,
                                ssl, reuse_port=reuse_port)
    return server, conns
