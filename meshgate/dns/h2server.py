"""A small HTTP/2 server (h2 state machine + asyncio Protocol) for DoH and ODoH.

The application is a callable

    handler(method: str, path: str, headers: list[tuple[str, str]], body: bytes)
        -> Response | Awaitable[Response]
    Response = (status: int, headers: list[tuple[str, str]], body: bytes | Buffer)

returning a Response directly when it is known now (no task, no await: the
cache-hit path) or an awaitable. `current_peer` holds the client address
while the handler runs (for log lines). A Buffer body goes back to its pool
once h2 has copied the last chunk into its send buffer (`send_data` copies);
a body still queued when the client resets the stream is dropped.

Bounds: request bodies ≤ 65535 bytes (413), header block ≤ 16 KiB, concurrent
streams ≤ limits.doh_max_streams *counting streams the client reset while
their handler still runs* (HTTP/2 Rapid Reset, CVE-2023-44487, and
MadeYouReset, CVE-2025-8671); a client that keeps hitting the cap is sent
GOAWAY(ENHANCE_YOUR_CALM). Connections ≤ limits.dns_tcp_max_clients.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import logging
from collections.abc import Awaitable, Callable
from typing import Any, cast

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings
import hpack

from meshgate.buffers import Buffer
from meshgate.config import LimitsConfig
from meshgate.dns.stats import ListenerStats
from meshgate.logs import RateLimitedLog

log = logging.getLogger("meshgate.dns.h2")
rlog = RateLimitedLog(log)

Body = bytes | Buffer
Response = tuple[int, list[tuple[str, str]], Body]
Handler = Callable[[str, str, list[tuple[str, str]], bytes], Response | Awaitable[Response]]

MAX_BODY = 65535
MAX_HEADER_LIST = 16384
current_peer: contextvars.ContextVar[Any] = contextvars.ContextVar("current_peer", default=None)


class _MemoEncoder(hpack.Encoder):
    """An HPACK encoder that hands back the block it produced for the same header list, as long
    as the dynamic table is exactly as it was then (DoH answers repeat the same few headers).

    A block is stored only when encoding it left the table untouched: then it is a function of
    (headers, table), byte for byte what hpack would encode again. The table is recognised by
    its first entry (held here, so compared by identity: every addition is a new tuple), its
    length and its maximum size. Only plain tuples are remembered: a NeverIndexedHeaderTuple
    compares equal to a plain tuple but must be encoded differently.
    """

    MEMO_MAX = 256

    def __init__(self) -> None:
        super().__init__()
        self._memo: dict[tuple[Any, ...], tuple[bytes, Any, int, int]] = {}

    def encode(self, headers: Any, huffman: bool = True) -> bytes:
        table = self.header_table
        entries = table.dynamic_entries
        first = entries[0] if entries else None
        size = len(entries)
        maxsize = table.maxsize
        plain = not table.resized and isinstance(headers, list)
        if plain:
            for h in headers:
                if type(h) is not tuple:
                    plain = False
                    break
        if not plain:
            return super().encode(headers, huffman)
        key = tuple(headers)
        hit = self._memo.get(key)
        if hit is not None and hit[1] is first and hit[2] == size and hit[3] == maxsize:
            return hit[0]
        block = super().encode(headers, huffman)
        if (entries[0] if entries else None) is first and len(entries) == size:
            if len(self._memo) >= self.MEMO_MAX:
                self._memo.clear()
            self._memo[key] = (block, first, size, maxsize)
        return block


class _Stream:
    __slots__ = ("body", "headers", "method", "off", "out", "path", "reset", "responded", "running")

    def __init__(self, method: str, path: str, headers: list[tuple[str, str]]) -> None:
        self.method = method
        self.path = path
        self.headers = headers
        self.body = bytearray()
        self.running = False  # the handler has not finished
        self.reset = False  # the client reset the stream
        self.responded = False
        self.out: Body | None = None  # response body not yet handed to h2
        self.off = 0


def _body_len(body: Body) -> int:
    return body.length if isinstance(body, Buffer) else len(body)


class H2ServerProtocol(asyncio.Protocol):
    def __init__(self, handler: Handler, stats: ListenerStats, limits: LimitsConfig,
                 conns: set[H2ServerProtocol]) -> None:
        self.handler = handler
        self.stats = stats
        self.limits = limits
        self.conns = conns
        self.loop = asyncio.get_running_loop()
        self.conn = h2.connection.H2Connection(
            # Inbound headers are validated by h2; outbound ones are ours (fixed names, numbers,
            # a media type), so skipping their validation/normalisation saves ~10% per request.
            # Inbound headers come as bytes (header_encoding=None): h2 still validates them, and we
            # decode the few we hand on in one pass instead of h2's generator per header.
            h2.config.H2Configuration(client_side=False, header_encoding=None,
                                      validate_outbound_headers=False, normalize_outbound_headers=False)
        )
        self.conn.encoder = _MemoEncoder()
        self.transport: asyncio.Transport | None = None
        self.peer: Any = None
        self.streams: dict[int, _Stream] = {}
        self.active = 0  # streams counted against the cap, reset-but-running included
        self.refused = 0
        self.flush_scheduled = False
        self.out: list[bytes] = []  # finished responses waiting for the flush at the end of the read
        self.tasks: set[asyncio.Task[None]] = set()
        self.last_active = self.loop.time()
        self.timer: asyncio.TimerHandle | None = None
        self.max_streams = limits.doh_max_streams

    # ------------------------------------------------------------------ connection

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's TLS transport is no asyncio.Transport subclass: an isinstance
        # assert here killed every TLS connection under `meshgate run` (uvloop).
        self.transport = cast(asyncio.Transport, transport)
        self.peer = transport.get_extra_info("peername")
        if len(self.conns) >= self.limits.dns_tcp_max_clients:
            self.stats.drop("max_clients")
            rlog.debug(f"{self.stats.name} max",
                       "doh %s: refusing %s: %d connections (limits.dns_tcp_max_clients)",
                       self.stats.name, self.peer, len(self.conns))
            self.transport.abort()
            return
        ssl_obj = transport.get_extra_info("ssl_object")
        # We offer only h2; a client without ALPN gets h2 with prior knowledge.
        if ssl_obj is not None and ssl_obj.selected_alpn_protocol() not in ("h2", None):
            self.stats.error("alpn")
            rlog.debug(f"{self.stats.name} alpn {self.peer}", "doh %s: %s did not negotiate h2 (ALPN %r)",
                       self.stats.name, self.peer, ssl_obj.selected_alpn_protocol())
            transport.close()
            return
        self.conns.add(self)
        self.conn.initiate_connection()
        self.conn.update_settings({
            h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: self.max_streams,
            h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: MAX_HEADER_LIST,
        })
        self._flush()
        self.timer = self.loop.call_later(self.limits.dns_tcp_idle_timeout, self._check_idle)

    def _check_idle(self) -> None:
        t = self.transport
        if t is None or t.is_closing():
            return
        idle = self.loop.time() - self.last_active
        timeout = self.limits.dns_tcp_idle_timeout
        if idle >= timeout and not self.streams:
            self.conn.close_connection()
            self._flush()
            t.close()
            return
        self.timer = self.loop.call_later(max(timeout - idle, 0.05), self._check_idle)

    def connection_lost(self, exc: Exception | None) -> None:
        self.conns.discard(self)
        if self.timer is not None:
            self.timer.cancel()
        for st in self.streams.values():
            self._drop_out(st)
        self.streams.clear()
        for task in list(self.tasks):
            task.cancel()
        self.transport = None

    def pause_writing(self) -> None:
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()

    def _flush(self) -> None:
        self.flush_scheduled = False
        data = self.conn.data_to_send()
        out = self.out
        if out:
            if data:
                out.append(data)
            self.out = []
            if self.transport is not None and not self.transport.is_closing():
                self.transport.writelines(out)
        elif data and self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def _schedule_flush(self) -> None:
        # Answers finishing in one loop tick leave in one write.
        if not self.flush_scheduled:
            self.flush_scheduled = True
            self.loop.call_soon(self._flush)

    def _error(self, reason: str, msg: str, *args: object) -> None:
        self.stats.error(reason)
        rlog.debug(f"{self.stats.name} {reason} {self.peer}", "doh %s: %s: " + msg,
                   self.stats.name, self.peer, *args)

    # ------------------------------------------------------------------ events

    def data_received(self, data: bytes) -> None:
        self.last_active = self.loop.time()
        try:
            events = self.conn.receive_data(data)
        except h2.exceptions.ProtocolError as e:
            self._error("h2_protocol", "HTTP/2 protocol error: %s", e)
            self._flush()  # h2 queued a GOAWAY
            if self.transport is not None:
                self.transport.close()
            return
        for ev in events:
            try:
                self._event(ev)
            except h2.exceptions.H2Error as e:  # e.g. a frame for a stream that closed meanwhile
                self._error("h2_state", "%r", e)
        self._flush()

    def _event(self, ev: h2.events.Event) -> None:
        if isinstance(ev, h2.events.RequestReceived):
            self._request(ev)
        elif isinstance(ev, h2.events.DataReceived):
            # Always give the window back, or POST bodies stall at 64 KiB.
            self.conn.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
            st = self.streams.get(ev.stream_id)
            if st is None or st.responded or st.running:
                return
            if len(st.body) + len(ev.data) > MAX_BODY:
                self._error("too_large", "request body over %d bytes", MAX_BODY)
                self._respond(ev.stream_id, st, (413, [], b""))
                return
            st.body += ev.data
        elif isinstance(ev, h2.events.StreamEnded):
            st = self.streams.get(ev.stream_id)
            if st is not None and not st.responded and not st.running:
                self._dispatch(ev.stream_id, st)
        elif isinstance(ev, h2.events.StreamReset):
            self._on_reset(ev.stream_id)
        elif isinstance(ev, h2.events.WindowUpdated):
            if ev.stream_id == 0:
                for sid, st in list(self.streams.items()):
                    if st.out is not None:
                        self._send_body(sid, st)
            else:
                st = self.streams.get(ev.stream_id)
                if st is not None and st.out is not None:
                    self._send_body(ev.stream_id, st)
        elif isinstance(ev, h2.events.RemoteSettingsChanged):
            for sid, st in list(self.streams.items()):  # a bigger initial window may free queued bodies
                if st.out is not None:
                    self._send_body(sid, st)
        elif isinstance(ev, h2.events.ConnectionTerminated) and self.transport is not None:
            self.transport.close()

    def _request(self, ev: h2.events.RequestReceived) -> None:
        sid = ev.stream_id
        if self.active >= self.max_streams:
            self.conn.reset_stream(sid, h2.errors.ErrorCodes.REFUSED_STREAM)
            self.refused += 1
            self.stats.drop("max_streams")
            rlog.debug(f"{self.stats.name} streams {self.peer}",
                       "doh %s: %s: %d streams active (limits.doh_max_streams), refusing stream %d",
                       self.stats.name, self.peer, self.active, sid)
            if self.refused > 2 * self.max_streams:
                self._error("rapid_reset", "kept exceeding the stream cap: GOAWAY")
                self.conn.close_connection(h2.errors.ErrorCodes.ENHANCE_YOUR_CALM)
                self._flush()
                if self.transport is not None:
                    self.transport.close()
            return
        method = path = ""
        clen = 0
        headers: list[tuple[str, str]] = []
        for k, v in ev.headers or ():
            # latin-1 never fails to decode (a non-UTF-8 value is not worth an exception here).
            if k == b":method":
                method = v.decode("latin-1")
            elif k == b":path":
                path = v.decode("latin-1")
            else:
                value = v.decode("latin-1")
                if k == b"content-length":
                    clen = int(value) if value.isdigit() else 0
                headers.append((k.decode("latin-1"), value))
        st = _Stream(method, path, headers)
        self.streams[sid] = st
        self.active += 1
        if clen > MAX_BODY:
            self._error("too_large", "content-length %d", clen)
            self._respond(sid, st, (413, [], b""))
            return
        if ev.stream_ended is not None:
            self._dispatch(sid, st)

    def _dispatch(self, sid: int, st: _Stream) -> None:
        current_peer.set(self.peer)
        try:
            res = self.handler(st.method, st.path, st.headers, bytes(st.body))
        except Exception as e:
            self._error("handler", "handler failed: %r", e)
            res = (500, [], b"")
        if inspect.isawaitable(res):
            st.running = True
            task = self.loop.create_task(self._await(sid, st, res))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
            return
        self._respond(sid, st, res)

    async def _await(self, sid: int, st: _Stream, pending: Awaitable[Response]) -> None:
        try:
            res = await pending
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self._error("handler", "handler failed: %r", e)
            res = (500, [], b"")
        st.running = False
        self._respond(sid, st, res)
        self._schedule_flush()

    def _on_reset(self, sid: int) -> None:
        st = self.streams.get(sid)
        if st is None:
            return
        st.reset = True
        self._drop_out(st)  # queued answer: drop, never reuse
        if not st.running:
            self._finish(sid)
        # A running stream stays counted in `active` until its handler returns.

    # ------------------------------------------------------------------ responses

    def _respond(self, sid: int, st: _Stream, res: Response) -> None:
        status, headers, body = res
        if st.responded:
            _release(body, ok=False)
            return
        st.responded = True
        if st.reset or self.transport is None or self.transport.is_closing():
            _release(body, ok=False)
            self._finish(sid)
            return
        n = _body_len(body)
        hdrs = [(":status", str(status)), *headers, ("content-length", str(n))]
        try:
            self.conn.send_headers(sid, hdrs, end_stream=n == 0)
        except h2.exceptions.H2Error as e:
            _release(body, ok=False)
            self._error("h2_state", "send_headers: %r", e)
            self._finish(sid)
            return
        if n == 0:
            _release(body, ok=True)
            self._finish(sid)
            return
        st.out = body
        st.off = 0
        self._send_body(sid, st)

    def _send_body(self, sid: int, st: _Stream) -> None:
        """Send what the flow-control window and frame size allow; the rest waits for WindowUpdated."""
        body = st.out
        assert body is not None
        conn = self.conn
        n = _body_len(body)
        try:
            while st.off < n:
                window = min(conn.local_flow_control_window(sid), conn.max_outbound_frame_size)
                if window <= 0:
                    return  # queued until WindowUpdated
                chunk = min(n - st.off, window)
                end = st.off + chunk == n
                if isinstance(body, Buffer):
                    a = body.start + st.off
                    conn.send_data(sid, memoryview(body.data)[a : a + chunk], end_stream=end)
                else:
                    conn.send_data(sid, body[st.off : st.off + chunk], end_stream=end)
                st.off += chunk
        except h2.exceptions.H2Error as e:
            self._drop_out(st)
            self._error("h2_state", "send_data: %r", e)
            self._finish(sid)
            return
        # h2 copied every chunk into its own send buffer: the pool may have the buffer back.
        st.out = None
        _release(body, ok=True)
        self._finish(sid)
        # Each finished response is its own buffer, and the buffers of one read leave in one
        # writelines: the TLS transport seals each buffer as its own record, then sends them
        # all in one system call. One record per response, not one for the batch: dnsperf
        # 2.10's DoH client takes one answer per SSL_read (one record) and loses the rest.
        data = self.conn.data_to_send()
        if data:
            self.out.append(data)

    def _drop_out(self, st: _Stream) -> None:
        if st.out is not None:
            _release(st.out, ok=False)
            st.out = None

    def _finish(self, sid: int) -> None:
        if self.streams.pop(sid, None) is not None:
            self.active -= 1


def _release(body: Body, ok: bool) -> None:
    if isinstance(body, Buffer):
        if ok:
            body.recycle()
        else:
            body.drop()


async def start_h2(handler: Handler, stats: ListenerStats, limits: LimitsConfig, host: str, port: int,
                   ssl: Any, *, reuse_port: bool = False) -> tuple[asyncio.Server, set[H2ServerProtocol]]:
    loop = asyncio.get_running_loop()
    conns: set[H2ServerProtocol] = set()
    server = await loop.create_server(
        lambda: H2ServerProtocol(handler, stats, limits, conns), host, port, ssl=ssl, backlog=1024,
        reuse_port=reuse_port or None,
        ssl_handshake_timeout=limits.dns_tcp_idle_timeout if ssl is not None else None,
    )
    return server, conns
