"""A small HTTP/2 server (the h2wire sans-I/O core + asyncio Protocol) for DoH and ODoH.

The application is a callable

    handler(method: str, path: str, headers: list[tuple[str, str]], body: bytes)
        -> Response | Awaitable[Response]
    Response = (status: int, headers: list[tuple[str, str]], body: bytes | Buffer)

returning a Response directly when it is known now (no task, no await: the
cache-hit path) or an awaitable. `current_peer` holds the client address
while the handler runs (for log lines). A Buffer body goes back to its pool
once its last chunk has been copied into frames (at once when the answer fits
one DATA frame and the windows: h2wire.respond(); else by `data_to_send()`);
a body still queued when the client resets the stream is dropped.

HTTP/1.1 on the same listener: meshgate.dns.h1server (start_https picks per connection).

Bounds: request bodies ≤ 65535 bytes (413), header block ≤ 16 KiB, concurrent
streams ≤ limits.doh_max_streams *counting streams the client reset while
their handler still runs* (HTTP/2 Rapid Reset, CVE-2023-44487, and
MadeYouReset, CVE-2025-8671); a client that keeps hitting the cap is sent
GOAWAY(ENHANCE_YOUR_CALM). Connections ≤ limits.dns_tcp_max_clients, and ≤
limits.dns_tcp_max_clients_per_source from one client address (meshgate.dns.clients).

A request that never ends is closed (issue 16 item 8): a stream whose request (HEADERS, then
DATA up to END_STREAM) is not all in limits.doh_request_timeout seconds after its HEADERS gets
408 and a RST_STREAM(NO_ERROR) (h2wire does that for any answer before the request's end); a
header block left open (HEADERS without END_HEADERS, CONTINUATIONs that stop) that long closes
the connection with GOAWAY(ENHANCE_YOUR_CALM), since nothing else may be sent on it meanwhile.
Both count `errors{reason="request_timeout"}`. One timer per connection, armed only while
something waits for the client (a GET with END_STREAM arms none). The idle timer
(limits.dns_tcp_idle_timeout) counts a connection whose only streams wait for their client as
idle, and is reset by requests only: PINGs and SETTINGS keep nothing open.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import re
from collections.abc import Awaitable, Callable
from typing import Any, cast

import hpack

from meshgate.buffers import Buffer
from meshgate.config import LimitsConfig
from meshgate.conns import MIN_REARM, IdleTimer
from meshgate.dns import h2wire, hpack_speedup
from meshgate.dns.clients import ClientConns, admit_client
from meshgate.dns.h2wire import H2ConnectionError, H2Wire
from meshgate.dns.listeners import serve_stream
from meshgate.dns.stats import ListenerStats
from meshgate.logs import RateLimitedLog

log = logging.getLogger("meshgate.dns.h2")
rlog = RateLimitedLog(log)

Body = bytes | Buffer
Response = tuple[int, list[tuple[str, str]], Body]
Handler = Callable[[str, str, list[tuple[str, str]], bytes], Response | Awaitable[Response]]

MAX_BODY = 65535
MAX_HEADER_LIST = 16384
_TIMEOUT = (408, [("content-type", "text/plain; charset=utf-8")], b"request not received in time\n")
current_peer: contextvars.ContextVar[Any] = contextvars.ContextVar("current_peer", default=None)

# The server decodes every request's header block with hpack: Huffman decoding a byte per step
# (meshgate/dns/hpack_speedup.py) is ~3x faster than hpack's own for the GET paths DoH clients send.
hpack_speedup.install()


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
        self._responses: dict[tuple[Any, ...], tuple[bytes, Any, int, int]] = {}

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

    def encode_response(self, status: int, headers: list[tuple[str, str]], n: int) -> bytes:
        """The block for `:status`, `headers`, `content-length: n`, memoized by (status, n,
        headers) and the table state as in encode(): the repeated answer skips building the
        list, the type checks and the outer memo's tuple."""
        table = self.header_table
        entries = table.dynamic_entries
        first = entries[0] if entries else None
        size = len(entries)
        key = (status, n, *headers)
        # A pending table-size update goes into the next block: never served from, nor stored in,
        # the memo.
        resized = table.resized
        hit = self._responses.get(key)
        if (hit is not None and hit[1] is first and hit[2] == size and hit[3] == table.maxsize
                and not resized):
            return hit[0]
        full = [(":status", str(status)), *headers, ("content-length", str(n))]
        block = self.encode(full)
        if (not resized and (entries[0] if entries else None) is first and len(entries) == size
                and all(type(h) is tuple for h in headers)):
            if len(self._responses) >= self.MEMO_MAX:
                self._responses.clear()
            self._responses[key] = (block, first, size, table.maxsize)
        return block


class _MemoDecoder(hpack.Decoder):
    """An HPACK decoder that hands back the header list it decoded from the same block bytes, as
    long as the dynamic table and the limits are exactly as they were then (clients repeat header
    blocks: every POST of one length, every GET of one URL, once the table holds their fields).

    A result is stored only when decoding left the table untouched (indexed fields and literals
    without indexing only): then it is a function of (block, table), what hpack would decode
    again. The table is recognised as in _MemoEncoder: its first entry (by identity; every
    addition is a new tuple), its length, its maximum size; the header-list and table-size limits
    are part of the key too, so a block stays refused after a limit shrinks. Small blocks only.
    """

    MEMO_MAX = 256
    MEMO_BLOCK_MAX = 512

    def __init__(self, max_header_list_size: int = hpack.hpack.DEFAULT_MAX_HEADER_LIST_SIZE) -> None:
        super().__init__(max_header_list_size)
        self._memo: dict[bytes, tuple[list[Any], Any, int, int, int, int]] = {}

    def decode(self, data: bytes, raw: bool = False) -> Any:
        if not raw or len(data) > self.MEMO_BLOCK_MAX:
            return super().decode(data, raw)
        table = self.header_table
        entries = table.dynamic_entries
        first = entries[0] if entries else None
        size = len(entries)
        key = bytes(data)
        hit = self._memo.get(key)
        if (hit is not None and hit[1] is first and hit[2] == size and hit[3] == table.maxsize
                and hit[4] == self.max_header_list_size and hit[5] == self.max_allowed_table_size):
            return list(hit[0])
        headers = super().decode(data, raw)
        if (entries[0] if entries else None) is first and len(entries) == size:
            if len(self._memo) >= self.MEMO_MAX:
                self._memo.clear()
            self._memo[key] = (list(headers), first, size, table.maxsize, self.max_header_list_size,
                               self.max_allowed_table_size)
        return headers


# RFC 9113 8.2-8.3: what makes a request malformed (h2wire leaves header semantics to us: this
# checks the rules in one pass over the few headers a DoH request has).
_PSEUDO = frozenset((b":method", b":path", b":scheme", b":authority"))
_CONNECTION_SPECIFIC = frozenset((b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding",
                                  b"upgrade"))
_BAD_NAME = re.compile(rb"[^a-z0-9!#$%&'*+.^_`|~-]")
_BAD_VALUE = re.compile(rb"[\x00\r\n]|^[ \t]|[ \t]$")


Head = tuple[str, str, int, list[tuple[str, str]]]
_HEADS: dict[tuple[Any, ...], Head | None] = {}
_HEADS_MAX = 256
_HEAD_BYTES_MAX = 1024


def memo_request_head(headers: list[tuple[bytes, bytes]]) -> Head | None:
    """request_head() through a small memo: clients repeat header lists (every POST of one
    length, every GET of one URL), and the checks cost more than hashing the list. The result is
    a function of the list alone; the handler gets its own copy of the header list."""
    key = tuple(headers)
    try:
        head = _HEADS[key]
    except KeyError:
        head = request_head(headers)
        if sum(len(k) + len(v) for k, v in headers) <= _HEAD_BYTES_MAX:  # bounded memory
            if len(_HEADS) >= _HEADS_MAX:
                _HEADS.clear()
            _HEADS[key] = head
    except TypeError:  # not hashable: not from the HPACK decoder
        return request_head(headers)
    if head is None:
        return None
    return head[0], head[1], head[2], list(head[3])


def request_head(headers: Any) -> Head | None:
    """(method, path, content-length or -1, other headers decoded) of a request's header list
    (bytes pairs), or None if it is malformed: unknown, repeated, missing or late pseudo-headers,
    an empty :path, upper-case or illegal names, connection-specific fields, NUL/CR/LF or edge
    whitespace in a value."""
    method = path = b""
    scheme = False
    regular = False
    clen = -1
    out: list[tuple[str, str]] = []
    for k, v in headers:
        if _BAD_VALUE.search(v) is not None:
            return None
        if k[:1] == b":":
            if regular or k not in _PSEUDO:
                return None
            if k == b":method":
                if method:
                    return None
                method = v
            elif k == b":path":
                if path:
                    return None
                path = v
            elif k == b":scheme":
                if scheme:
                    return None
                scheme = True
            continue
        regular = True
        if not k or _BAD_NAME.search(k) is not None or k in _CONNECTION_SPECIFIC or (
                k == b"te" and v != b"trailers"):
            return None
        # latin-1 never fails to decode (a non-UTF-8 value is not worth an exception here).
        value = v.decode("latin-1")
        if k == b"content-length":
            clen = int(value) if value.isdigit() else 0
        out.append((k.decode("latin-1"), value))
    if not method or not path or not scheme:
        return None
    return method.decode("latin-1"), path.decode("latin-1"), clen, out


class _Stream:
    __slots__ = ("body", "headers", "method", "off", "out", "path", "reset", "responded", "running", "since",
                 "waiting")

    def __init__(self, method: str, path: str, headers: list[tuple[str, str]]) -> None:
        self.method = method
        self.path = path
        self.headers = headers
        self.body = bytearray()
        self.running = False  # the handler has not finished
        self.reset = False  # the client reset the stream
        self.responded = False
        self.out: Body | None = None  # response body not yet all framed (waits for window)
        self.off = 0
        self.waiting = False  # the request has not ended (its body is still to come)
        self.since = 0.0  # when its HEADERS came (for limits.doh_request_timeout)


async def handler_response(pending: Awaitable[Response], on_error: Callable[..., None]) -> Response:
    """A handler's answer that had to be awaited (the HTTP/1.1, HTTP/2 and HTTP/3 servers all
    take it this way): a handler that raises answers 500, counted and logged by `on_error`
    (reason, message, args)."""
    try:
        return await pending
    except asyncio.CancelledError:
        raise
    except Exception as e:
        on_error("handler", "handler failed: %r", e)
        return (500, [], b"")


def _body_len(body: Body) -> int:
    return body.length if isinstance(body, Buffer) else len(body)


class H2ServerProtocol(asyncio.Protocol):
    def __init__(self, handler: Handler, stats: ListenerStats, limits: LimitsConfig,
                 conns: set[Any]) -> None:
        self.handler = handler
        self.stats = stats
        self.limits = limits
        self.conns = conns
        self.loop = asyncio.get_running_loop()
        self.max_streams = limits.doh_max_streams
        # Inbound headers come as bytes and request_head() checks RFC 9113's rules in the one
        # pass that also picks out what we use; outbound headers are ours (fixed names, numbers).
        self.encoder = _MemoEncoder()
        self.conn = H2Wire(max_streams=self.max_streams, max_header_list=MAX_HEADER_LIST,
                           encoder=self.encoder, decoder=_MemoDecoder(MAX_HEADER_LIST))
        self.transport: asyncio.Transport | None = None
        self.peer: Any = None
        self.streams: dict[int, _Stream] = {}
        self.active = 0  # streams counted against the cap, reset-but-running included
        self.refused = 0
        self.flush_scheduled = False
        self.out: list[bytes] = []  # finished responses waiting for the flush at the end of the read
        self.tasks: set[asyncio.Task[None]] = set()
        self.waiting = 0  # streams whose request has not ended: the client owes them bytes
        self.block_since: float | None = None  # when the open header block began
        self.deadline: asyncio.TimerHandle | None = None
        self.request_timeout = limits.doh_request_timeout
        self.timer = IdleTimer(self.loop, limits.dns_tcp_idle_timeout, self._idle, busy=self._busy)

    # ------------------------------------------------------------------ connection

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's TLS transport is no asyncio.Transport subclass: an isinstance
        # assert here killed every TLS connection under `meshgate run` (uvloop).
        self.transport = cast(asyncio.Transport, transport)
        self.peer = transport.get_extra_info("peername")
        if not admit_client(self.conns, self, self.peer, self.limits, self.stats):
            self.transport.abort()
            return
        ssl_obj = transport.get_extra_info("ssl_object")
        # h1server.start_https hands over ALPN h2, or no ALPN with the h2 preface; start_h2 offers
        # only h2 and a client without ALPN gets h2 with prior knowledge.
        if ssl_obj is not None and ssl_obj.selected_alpn_protocol() not in ("h2", None):
            self.stats.error("alpn")
            rlog.debug(f"{self.stats.name} alpn {self.peer}", "doh %s: %s did not negotiate h2 (ALPN %r)",
                       self.stats.name, self.peer, ssl_obj.selected_alpn_protocol())
            transport.close()  # connection_lost takes it out of `conns`
            return
        self.conn.initiate()
        self._flush()
        self.timer.start()

    def _busy(self) -> bool:
        # Streams waiting for their client do not keep the connection open; ours (a handler
        # running, an answer waiting for window) do.
        return len(self.streams) > self.waiting

    def _idle(self) -> None:
        t = self.transport
        if t is not None and not t.is_closing():
            self.conn.goaway(h2wire.NO_ERROR)
            self._flush()
            t.close()

    def _arm_deadline(self) -> None:
        """After a read: watch what waits for the client (streams, an open header block)."""
        if self.conn.header_block_open:
            if self.block_since is None:
                self.block_since = self.loop.time()
        else:
            self.block_since = None
        if self.deadline is None and (self.waiting or self.block_since is not None):
            self.deadline = self.loop.call_later(self.request_timeout, self._check_deadlines)

    def _check_deadlines(self) -> None:
        self.deadline = None
        if self.transport is None or self.transport.is_closing():
            return
        now = self.loop.time()
        late = now - self.request_timeout
        if self.block_since is not None and self.block_since <= late:
            self._error("request_timeout", "header block not finished in %.1f s (limits.doh_request_timeout)",
                        self.request_timeout)
            self._close(h2wire.ENHANCE_YOUR_CALM)
            return
        first = self.block_since
        for sid, st in list(self.streams.items()):
            if not st.waiting:
                continue
            if st.since <= late:
                self._error("request_timeout", "request on stream %d not finished in %.1f s "
                            "(limits.doh_request_timeout)", sid, self.request_timeout)
                self._respond(sid, st, _TIMEOUT)
            elif first is None or st.since < first:
                first = st.since
        self._flush()
        if first is not None:
            self.deadline = self.loop.call_later(max(first - late, MIN_REARM), self._check_deadlines)

    def _not_waiting(self, st: _Stream) -> None:
        if st.waiting:
            st.waiting = False
            self.waiting -= 1

    def connection_lost(self, exc: Exception | None) -> None:
        self.conns.discard(self)
        self.timer.cancel()
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None
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

    def _close(self, code: int) -> None:
        self.conn.goaway(code)
        self._flush()
        if self.transport is not None:
            self.transport.close()

    # ------------------------------------------------------------------ events

    def data_received(self, data: bytes) -> None:
        try:
            events = self.conn.receive(data)
        except H2ConnectionError as e:
            self._error("h2_protocol", "HTTP/2 protocol error: %s (code %d)", e, e.code)
            self._close(e.code)  # the GOAWAY is queued already
            return
        for kind, sid, a, b in events:
            if kind == h2wire.REQUEST:
                self._request(sid, a, b)
            elif kind == h2wire.DATA:
                st = self.streams.get(sid)
                if st is None or st.responded or st.running:
                    continue
                if len(st.body) + len(a) > MAX_BODY:
                    self._error("too_large", "request body over %d bytes", MAX_BODY)
                    self._respond(sid, st, (413, [], b""))
                    continue
                st.body += a
                if b:
                    self._dispatch(sid, st)
            elif kind == h2wire.RESET:
                self._on_reset(sid)
            elif kind == h2wire.WINDOW:
                if sid == 0:
                    for osid, st in list(self.streams.items()):
                        if st.out is not None:
                            self._send_body(osid, st)
                else:
                    st = self.streams.get(sid)
                    if st is not None and st.out is not None:
                        self._send_body(sid, st)
            elif kind == h2wire.GOAWAY and self.transport is not None:
                self._flush()
                self.transport.close()
                return
            if self.conn.closed:  # we sent GOAWAY (rapid reset)
                return
        self._flush()
        if self.waiting or self.conn.header_block_open or self.block_since is not None:
            self._arm_deadline()

    def _request(self, sid: int, raw_headers: Any, ended: bool) -> None:
        self.timer.touch()
        if self.active >= self.max_streams:
            self.conn.reset(sid, h2wire.REFUSED_STREAM)
            self.refused += 1
            self.stats.drop("max_streams")
            rlog.debug(f"{self.stats.name} streams {self.peer}",
                       "doh %s: %s: %d streams active (limits.doh_max_streams), refusing stream %d",
                       self.stats.name, self.peer, self.active, sid)
            if self.refused > 2 * self.max_streams:
                self._error("rapid_reset", "kept exceeding the stream cap: GOAWAY")
                self._close(h2wire.ENHANCE_YOUR_CALM)
            return
        head = memo_request_head(raw_headers)
        if head is None:
            # Malformed (RFC 9113 8.1.1): a stream error, the connection's other streams go on.
            self._error("h2_malformed", "malformed request headers on stream %d", sid)
            self.conn.reset(sid, h2wire.PROTOCOL_ERROR)
            return
        method, path, clen, headers = head
        st = _Stream(method, path, headers)
        self.streams[sid] = st
        self.active += 1
        if clen > MAX_BODY:
            self._error("too_large", "content-length %d", clen)
            self._respond(sid, st, (413, [], b""))
            return
        if ended:
            self._dispatch(sid, st)
        else:
            st.waiting = True
            st.since = self.loop.time()
            self.waiting += 1

    def _dispatch(self, sid: int, st: _Stream) -> None:
        self._not_waiting(st)
        if current_peer.get() is not self.peer:  # a set() costs a new context mapping each time
            current_peer.set(self.peer)
        try:
            res = self.handler(st.method, st.path, st.headers, bytes(st.body) if st.body else b"")
        except Exception as e:
            self._error("handler", "handler failed: %r", e)
            res = (500, [], b"")
        # A Response is a tuple; anything else is the awaitable of one (cheaper than isawaitable).
        if type(res) is not tuple:
            st.running = True
            task = self.loop.create_task(self._await(sid, st, cast(Awaitable[Response], res)))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
            return
        self._respond(sid, st, res)

    async def _await(self, sid: int, st: _Stream, pending: Awaitable[Response]) -> None:
        res = await handler_response(pending, self._error)
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
        self._not_waiting(st)
        if st.reset or self.transport is None or self.transport.is_closing() or sid not in self.conn.streams:
            _release(body, ok=False)
            self._finish(sid)
            return
        conn = self.conn
        if type(body) is Buffer:
            n = body.length
            start = body.start
            block = self.encoder.encode_response(status, headers, n)
            # One HEADERS+DATA piece, copied out of the pool buffer by the join: recycle now.
            # (The view is a temporary: released before the buffer goes back to its pool.)
            if conn.respond(sid, block, memoryview(body.data)[start : start + n]):
                body.recycle()
                self._finish(sid)
                self.out.append(conn.data_to_send())
                return
        else:
            n = _body_len(body)
            block = self.encoder.encode_response(status, headers, n)
            if n and conn.respond(sid, block, body):  # type: ignore[arg-type]
                self._finish(sid)
                self.out.append(conn.data_to_send())
                return
        # Empty, or bigger than a frame or the windows allow now: HEADERS, then DATA as room appears.
        conn.send_block(sid, block, end_stream=n == 0)
        if n == 0:
            _release(body, ok=True)
            self._finish(sid)
            self.out.append(self.conn.data_to_send())
            return
        st.out = body
        st.off = 0
        self._send_body(sid, st)

    def _send_body(self, sid: int, st: _Stream) -> None:
        """Send what the flow-control windows and frame size allow; the rest waits for WINDOW."""
        body = st.out
        assert body is not None
        n = _body_len(body)
        if isinstance(body, Buffer):
            view = memoryview(body.data)[body.start + st.off : body.start + n]
        else:
            view = memoryview(body)[st.off :]
        st.off += self.conn.send_data(sid, view, end_stream=True)
        # A live view of a pooled buffer would make the pool refuse it (it could not resize).
        del view
        if st.off < n:
            return  # queued until a WINDOW_UPDATE
        # Each finished response is its own buffer (data_to_send copies the frames out of the
        # pool buffer: the pool may have it back now), and the buffers of one read leave in one
        # writelines: the TLS transport seals each buffer as its own record, then sends them
        # all in one system call. One record per response, not one for the batch: dnsperf
        # 2.10's DoH client takes one answer per SSL_read (one record) and loses the rest.
        data = self.conn.data_to_send()
        st.out = None
        _release(body, ok=True)
        self._finish(sid)
        if data:
            self.out.append(data)

    def _drop_out(self, st: _Stream) -> None:
        if st.out is not None:
            _release(st.out, ok=False)
            st.out = None

    def _finish(self, sid: int) -> None:
        st = self.streams.pop(sid, None)
        if st is not None:
            self.active -= 1
            self._not_waiting(st)


def _release(body: Body, ok: bool) -> None:
    if isinstance(body, Buffer):
        if ok:
            body.recycle()
        else:
            body.drop()


async def start_h2(handler: Handler, stats: ListenerStats, limits: LimitsConfig, host: str, port: int,
                   ssl: Any, *, reuse_port: bool = False) -> tuple[asyncio.Server, set[H2ServerProtocol]]:
    conns = ClientConns(limits)
    server = await serve_stream(lambda: H2ServerProtocol(handler, stats, limits, conns), limits, host, port,
                                ssl, reuse_port=reuse_port)
    return server, conns
