"""A small HTTP/2 client over asyncio (h2 + TLS), and a bounded connection pool.

Used where meshgate itself speaks HTTPS: the ODoH proxy forwarding to targets,
the ODoH client and upstream. One TLS connection carries many requests as h2
streams; the pool keeps one connection per (host, port) and at most
`max_connections` of them.

What it deliberately does not do: follow redirects (a 3xx is returned as is;
the caller decides), accept server push (disabled in SETTINGS, reset if sent
anyway), buffer unbounded bodies (a response over `max_body` resets the stream
and fails the request), or open streams beyond the smaller of our cap and the
server's SETTINGS_MAX_CONCURRENT_STREAMS.

HPACK: h2 decodes response headers with hpack's Decoder. This client does not
rely on meshgate.dns.hpack_speedup and never installs it: the faster Huffman
decoder gives byte-identical results, so where the DoH/ODoH server installed
it in the same process (an ODoH proxy beside its listener) responses decode a
little faster, and elsewhere (`meshgate dns query --odoh`) hpack's own runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import cast

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings
from h2.errors import ErrorCodes

from meshgate.netfmt import authority, host_port


class H2ClientError(Exception):
    """The request did not produce a complete response; `kind` is a Proxy-Status error type."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass
class H2Response:
    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes

    def header(self, name: bytes) -> bytes | None:
        for k, v in self.headers:
            if k == name:
                return v
        return None


@dataclass
class _Stream:
    future: asyncio.Future[H2Response]
    max_body: int
    status: int = 0
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytearray = field(default_factory=bytearray)
    to_send: memoryview | None = None  # request body not yet allowed by flow control


class H2ClientConnection(asyncio.Protocol):
    def __init__(self, max_streams: int = 100, max_body: int = 65535) -> None:
        self.max_streams = max_streams
        self.max_body = max_body
        self.conn = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=True, header_encoding=None)
        )
        self.transport: asyncio.Transport | None = None
        self.streams: dict[int, _Stream] = {}
        self.closed = False
        self.goaway = False
        self.received = 0  # data_received calls: tells a dead connection from a slow answer
        self.suspect = False  # a request timed out in silence; out of rotation until a PING ack
        self.flush_scheduled = False

    # ------------------------------------------------------------ asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's TLS transport is not an asyncio.Transport subclass: no isinstance check.
        self.transport = cast(asyncio.Transport, transport)
        self.conn.initiate_connection()
        self.conn.update_settings({h2.settings.SettingCodes.ENABLE_PUSH: 0})
        self._flush()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._fail_all(H2ClientError("connection_terminated", "connection closed"))

    def data_received(self, data: bytes) -> None:
        self.received += 1
        try:
            events = self.conn.receive_data(data)
        except h2.exceptions.ProtocolError:
            self._fail_all(H2ClientError("http_protocol_error", "HTTP/2 protocol error from server"))
            self._flush()
            self.close()
            return
        for ev in events:
            # e.g. resetting a stream whose END_STREAM arrived in the same read:
            # the stream is finished either way; never let it kill the connection.
            with contextlib.suppress(h2.exceptions.H2Error):
                self._event(ev)
        self._flush()

    # ------------------------------------------------------------ events

    def _event(self, ev: h2.events.Event) -> None:
        if isinstance(ev, h2.events.ResponseReceived):
            st = self.streams.get(ev.stream_id)
            if st is not None:
                st.headers = [(bytes(k), bytes(v)) for k, v in ev.headers or ()]
                for k, v in st.headers:
                    if k == b":status":
                        st.status = int(v) if v.isdigit() else 0
        elif isinstance(ev, h2.events.DataReceived):
            n = ev.flow_controlled_length or 0
            sid = ev.stream_id or 0
            if n:
                self.conn.acknowledge_received_data(n, sid)
            st = self.streams.get(sid)
            if st is not None:
                st.body += ev.data or b""
                if len(st.body) > st.max_body:
                    self._finish(sid, H2ClientError("http_response_body_size", "response body too large"))
                    self.conn.reset_stream(sid, ErrorCodes.CANCEL)
        elif isinstance(ev, h2.events.StreamEnded):
            st = self.streams.pop(ev.stream_id or 0, None)
            if st is not None and not st.future.done():
                st.future.set_result(H2Response(st.status, st.headers, bytes(st.body)))
        elif isinstance(ev, h2.events.StreamReset):
            self._finish(ev.stream_id or 0, H2ClientError("http_response_incomplete", "stream reset"))
        elif isinstance(ev, h2.events.WindowUpdated | h2.events.RemoteSettingsChanged):
            for sid in [s for s, st in self.streams.items() if st.to_send is not None]:
                self._send_body(sid)
        elif isinstance(ev, h2.events.PingAckReceived):
            self.suspect = False
        elif isinstance(ev, h2.events.PushedStreamReceived):
            self.conn.reset_stream(ev.pushed_stream_id or 0, ErrorCodes.REFUSED_STREAM)
        elif isinstance(ev, h2.events.ConnectionTerminated):
            self.goaway = True
            last = ev.last_stream_id or 0
            # Streams above last_stream_id were never processed; the rest may still finish.
            for sid in [s for s in self.streams if s > last]:
                self._finish(sid, H2ClientError("connection_terminated", "server sent GOAWAY"))
            if not self.streams:
                self.close()

    # ------------------------------------------------------------ requests

    @property
    def alive(self) -> bool:
        return not self.closed and not self.goaway and self.transport is not None

    @property
    def usable(self) -> bool:
        return self.alive and not self.suspect

    def probe(self) -> None:
        """A request timed out with not a byte from the server meanwhile: take this
        connection out of rotation and PING; the ack puts it back. A peer that
        vanished without a FIN never acks, and the pool retires it once idle."""
        if self.alive and not self.suspect:
            self.suspect = True
            with contextlib.suppress(h2.exceptions.H2Error):
                self.conn.ping(b"meshgate")
            self._flush()

    @property
    def has_capacity(self) -> bool:
        limit = min(self.max_streams, self.conn.remote_settings.max_concurrent_streams)
        return len(self.streams) < limit

    def request(
        self,
        method: bytes,
        authority: bytes,
        path: bytes,
        headers: list[tuple[bytes, bytes]],
        body: bytes = b"",
        max_body: int | None = None,
    ) -> tuple[int, asyncio.Future[H2Response]]:
        """Start a request; the future resolves with the whole response.

        Raises H2ClientError when this connection cannot take another stream.
        """
        if not self.usable:
            raise H2ClientError("connection_terminated", "connection is closed")
        if not self.has_capacity:
            raise H2ClientError("connection_limit_reached", "too many streams on this connection")
        fut: asyncio.Future[H2Response] = asyncio.get_running_loop().create_future()
        sid = self.conn.get_next_available_stream_id()
        hdrs = [
            (b":method", method),
            (b":scheme", b"https"),
            (b":authority", authority),
            (b":path", path),
            *headers,
        ]
        self.conn.send_headers(sid, hdrs, end_stream=not body)
        st = _Stream(fut, self.max_body if max_body is None else max_body)
        self.streams[sid] = st
        if body:
            st.to_send = memoryview(body)
            self._send_body(sid)
        self._schedule_flush()
        return sid, fut

    def cancel(self, sid: int) -> None:
        """The caller gave up (timeout): reset the stream so its slot frees."""
        if self.streams.pop(sid, None) is not None and not self.closed:
            with contextlib.suppress(h2.exceptions.H2Error):
                self.conn.reset_stream(sid, ErrorCodes.CANCEL)
            self._flush()

    def _send_body(self, sid: int) -> None:
        st = self.streams.get(sid)
        if st is None or st.to_send is None:
            return
        rest = st.to_send
        try:
            while rest:
                room = min(self.conn.local_flow_control_window(sid), self.conn.max_outbound_frame_size)
                if room <= 0:
                    break  # resumes on WindowUpdated
                chunk, rest = rest[:room], rest[room:]
                self.conn.send_data(sid, chunk.tobytes(), end_stream=not rest)
        except h2.exceptions.H2Error:
            self._finish(sid, H2ClientError("http_protocol_error", "cannot send request body"))
            return
        st.to_send = rest if rest else None

    def _finish(self, sid: int, exc: Exception) -> None:
        st = self.streams.pop(sid, None)
        if st is not None and not st.future.done():
            st.future.set_exception(exc)

    def _fail_all(self, exc: Exception) -> None:
        for sid in list(self.streams):
            self._finish(sid, exc)

    def _schedule_flush(self) -> None:
        # Requests started in one loop tick leave in one TLS write.
        if not self.flush_scheduled:
            self.flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self.flush_scheduled = False
        data = self.conn.data_to_send()
        if data and self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def close(self) -> None:
        self.closed = True
        if self.transport is not None and not self.transport.is_closing():
            with contextlib.suppress(h2.exceptions.H2Error):
                self.conn.close_connection()
                self._flush()
            self.transport.close()


def client_ssl_context(insecure: bool = False, cafile: str | None = None) -> ssl.SSLContext:
    """TLS for HTTP/2: ALPN h2, system CAs (or `cafile`), or no checks with `insecure`."""
    ctx = ssl.create_default_context(cafile=cafile)
    if insecure:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    ctx.set_alpn_protocols(["h2"])
    return ctx


async def connect(
    host: str,
    port: int,
    ssl_ctx: ssl.SSLContext,
    server_hostname: str,
    timeout: float,
    max_streams: int = 100,
    max_body: int = 65535,
) -> H2ClientConnection:
    """Open a TLS connection to `host` (a name or an address already vetted by the
    caller) and check the server agreed to HTTP/2."""
    loop = asyncio.get_running_loop()
    where = host_port(host, port)
    try:
        async with asyncio.timeout(timeout):
            _, proto = await loop.create_connection(
                lambda: H2ClientConnection(max_streams, max_body),
                host,
                port,
                ssl=ssl_ctx,
                server_hostname=server_hostname,
            )
    except TimeoutError:
        raise H2ClientError("connection_timeout", f"connecting to {where} timed out") from None
    except ssl.SSLCertVerificationError as e:
        raise H2ClientError("tls_certificate_error", f"{server_hostname}: {e.verify_message}") from None
    except ssl.SSLError as e:
        raise H2ClientError("tls_protocol_error", f"TLS with {where} failed: {e.reason}") from None
    except ConnectionRefusedError:
        raise H2ClientError("connection_refused", f"{where} refused the connection") from None
    except OSError as e:
        raise H2ClientError("destination_unavailable", f"{where}: {e.strerror or e}") from None
    assert proto.transport is not None
    sslobj = proto.transport.get_extra_info("ssl_object")
    if sslobj is None or sslobj.selected_alpn_protocol() != "h2":
        proto.close()
        raise H2ClientError("http_protocol_error", f"{where} does not speak HTTP/2 (ALPN)")
    return proto


class H2Pool:
    """At most `max_connections` HTTP/2 connections, shared by (address, port, name).

    A request reuses a connection to its destination that has a free stream
    and opens another one only when all of them are busy; a connection that
    closed or got GOAWAY is forgotten. When the pool is full the least
    recently used idle connection (to any destination) is closed; if none is
    idle the request fails with `connection_limit_reached`.
    """

    def __init__(
        self,
        ssl_ctx: ssl.SSLContext,
        max_connections: int = 64,
        max_streams: int = 100,
        max_body: int = 65535,
    ) -> None:
        self.ssl_ctx = ssl_ctx
        self.max_connections = max_connections
        self.max_streams = max_streams
        self.max_body = max_body
        # Most recently used last, so eviction takes the oldest idle one.
        self._conns: OrderedDict[H2ClientConnection, tuple[str, int, str]] = OrderedDict()
        self._connecting: dict[tuple[str, int, str], asyncio.Future[H2ClientConnection]] = {}
        self.connects = 0  # how many TLS connections were opened (pool reuse is visible in tests)

    def __len__(self) -> int:
        return len(self._conns)

    def _reusable(self, key: tuple[str, int, str]) -> H2ClientConnection | None:
        for c, k in list(self._conns.items()):
            if not c.alive or (c.suspect and not c.streams):
                del self._conns[c]
                c.close()
            elif k == key and c.usable and c.has_capacity:
                self._conns.move_to_end(c)
                return c
        return None

    async def _get(self, addr: str, port: int, name: str, timeout: float) -> H2ClientConnection:
        key = (addr, port, name)
        conn = self._reusable(key)
        if conn is not None:
            return conn
        pending = self._connecting.get(key)
        if pending is not None:
            # Someone is already connecting there: share that connection if it has room.
            conn = await asyncio.shield(pending)
            if conn.usable and conn.has_capacity:
                return conn
        self._make_room()
        fut: asyncio.Future[H2ClientConnection] = asyncio.get_running_loop().create_future()
        self._connecting[key] = fut
        try:
            conn = await connect(addr, port, self.ssl_ctx, name, timeout, self.max_streams, self.max_body)
        except BaseException as e:
            fut.set_exception(e)
            fut.exception()  # retrieved: no "never retrieved" warning when nobody else waited
            raise
        finally:
            if self._connecting.get(key) is fut:
                del self._connecting[key]
        self.connects += 1
        fut.set_result(conn)
        self._conns[conn] = key
        return conn

    def _make_room(self) -> None:
        while len(self._conns) + len(self._connecting) >= self.max_connections:
            for c in self._conns:
                if not c.streams or not c.alive:
                    del self._conns[c]
                    c.close()
                    break
            else:
                raise H2ClientError("connection_limit_reached", "connection pool is full")

    async def request(
        self,
        addr: str,
        port: int,
        name: str,
        method: bytes,
        path: bytes,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        timeout: float,
    ) -> H2Response:
        """One request to `name` at `addr:port` (addr may be the vetted IP for `name`)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        conn = await self._get(addr, port, name, timeout)
        sid, fut = conn.request(method, authority(name, port, 443).encode(), path, headers, body)
        received = conn.received
        try:
            async with asyncio.timeout_at(deadline):
                return await fut
        except TimeoutError:
            conn.cancel(sid)
            if conn.received == received:
                conn.probe()  # silent the whole wait: maybe gone without a FIN
            raise H2ClientError("http_response_timeout", "no response before the deadline") from None
        except asyncio.CancelledError:
            conn.cancel(sid)
            raise

    def close(self) -> None:
        for c in self._conns:
            c.close()
        self._conns.clear()
