"""DoH over HTTP/3 (RFC 8484 on RFC 9114) with aioquic's h3: the `doh3` listener kind.

`protocol = "doh3"` is a listener of its own, on UDP; give it the port number of the `doh`
listener (443 over TCP and over UDP) and that listener advertises it with `Alt-Svc: h3=":PORT"`
on its HTTP/1.1 and HTTP/2 answers (`DohListener.linked`). The application is the same DohApp
(or any h2server Handler): GET/POST, status codes, cache-control and buffer rules as HTTP/2.
The listener's name (its stats label and status URL) is `h3://HOST:PORT/PATH`, so it does not
collide with a `doh` listener on the same port number; clients ask `https://HOST:PORT/PATH`.

Bounds, as DoQ's (dns/doq.py) and HTTP/2's:
- streams open at once per connection ≤ limits.doh_max_streams (advertised as MAX_STREAMS with
  doq.cap_bidi_streams, and enforced: H3_REQUEST_REJECTED beyond it), counting requests whose
  handler still runs after the client reset them;
- a request not whole (HEADERS, then DATA up to FIN) limits.doh_request_timeout after its
  HEADERS gets 408 and STOP_SENDING (`errors{reason="request_timeout"}`);
- a connection with no request for limits.dns_tcp_idle_timeout and nothing running closes
  (H3_NO_ERROR): streams that never send a whole HEADERS frame hold nothing longer than that,
  and QUIC PINGs keep nothing open;
- flow control: at most MAX_STREAM_DATA bytes buffered per stream, MAX_DATA per connection;
- connections ≤ limits.dns_tcp_max_clients, ≤ limits.dns_tcp_max_clients_per_source from one
  address (dns/clients.py), refused with H3_EXCESSIVE_LOAD once the first packet names the peer.
Malformed headers close the connection with H3_MESSAGE_ERROR: aioquic's H3Connection checks
them before we see them, and treats them as a connection error where RFC 9114 4.1.2 asks for a
stream error; its framing errors close it too (`errors{reason="h3_protocol"}`). What it lets
through is checked again by request_head() as for HTTP/2 (a stream reset with
H3_MESSAGE_ERROR, `errors{reason="h3_malformed"}`). Each with a rate-limited debug line naming
the peer.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import Any, cast

from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.asyncio.server import QuicServer, serve
from aioquic.h3.connection import ErrorCode, H3Connection
from aioquic.h3.events import DataReceived, H3Event, HeadersReceived
from aioquic.quic import events
from aioquic.quic.configuration import QuicConfiguration

from meshgate.buffers import Buffer
from meshgate.config import HostPort, LimitsConfig
from meshgate.conns import MIN_REARM, IdleTimer
from meshgate.dns.clients import ClientConns
from meshgate.dns.doh import DohApp
from meshgate.dns.doq import cap_bidi_streams
from meshgate.dns.h2server import (
    MAX_BODY,
    MAX_HEADER_LIST,
    Handler,
    Response,
    current_peer,
    handler_response,
    request_head,
)
from meshgate.dns.listeners import Listener, bound_address
from meshgate.dns.stats import ListenerStats
from meshgate.logs import RateLimitedLog

log = logging.getLogger("meshgate.dns.h3")
rlog = RateLimitedLog(log)

ALPN = ["h3"]
MAX_STREAM_DATA = MAX_BODY + MAX_HEADER_LIST + 1024  # one request: its body, its header block, frames
MAX_DATA = 1 << 20
_TEXT = [("content-type", "text/plain; charset=utf-8")]
_TIMEOUT: Response = (408, _TEXT, b"request not received in time\n")


class _Request:
    __slots__ = ("body", "head", "since")

    def __init__(self, head: tuple[str, str, list[tuple[str, str]]], since: float) -> None:
        self.head = head
        self.body = bytearray()
        self.since = since


class Doh3Protocol(QuicConnectionProtocol):
    app: Handler
    stats: ListenerStats
    limits: LimitsConfig
    conns: ClientConns

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        cap_bidi_streams(self._quic, self.limits.doh_max_streams)
        self.h3: H3Connection | None = None
        self.requests: dict[int, _Request] = {}  # request not whole yet
        self.running: set[int] = set()  # handler running (counted against the cap even if reset)
        self.cancelled: set[int] = set()  # running streams the client reset
        self.admitted: bool | None = None  # decided on the first event (the peer is known then)
        self.closed = False
        self.deadline: asyncio.TimerHandle | None = None
        self.timer = IdleTimer(self._loop, self.limits.dns_tcp_idle_timeout, self._idle,
                               busy=self.running.__len__)
        self.tasks: set[asyncio.Task[None]] = set()
        self.transmit_scheduled = False

    def _schedule_transmit(self) -> None:
        # Answers that finish in one loop tick leave in one transmit (shared packets). Answers
        # made while aioquic hands us a datagram's events need none: it transmits after them.
        if not self.transmit_scheduled:
            self.transmit_scheduled = True
            self._loop.call_soon(self._transmit_now)

    def _transmit_now(self) -> None:
        self.transmit_scheduled = False
        if not self.closed:
            self.transmit()

    @property
    def peer(self) -> Any:
        return self._quic._network_paths[0].addr if self._quic._network_paths else None

    # ------------------------------------------------------------------ connection

    def quic_event_received(self, event: events.QuicEvent) -> None:
        if self.admitted is None:
            self.admitted = self.conns.admit(self, self.peer, self.stats)
            if not self.admitted:
                self._close(ErrorCode.H3_EXCESSIVE_LOAD, "too many connections")
                return
            self.timer.start()
        if self.closed:
            return
        if isinstance(event, events.ProtocolNegotiated):
            if event.alpn_protocol in ALPN:
                self.h3 = H3Connection(self._quic)
            return
        if isinstance(event, events.ConnectionTerminated):
            if event.error_code not in (0, ErrorCode.H3_NO_ERROR):
                # aioquic's H3Connection closes the connection itself on a framing or header
                # error (malformed headers included: it checks them before we see them).
                self._error("h3_protocol", "connection closed with 0x%x: %s", event.error_code,
                            event.reason_phrase[:64])
            self._terminated()
            return
        if isinstance(event, events.StreamReset):
            self._on_reset(event.stream_id)
        if self.h3 is None:
            return
        try:
            for ev in self.h3.handle_event(event):
                self._h3_event(ev)
        except Exception as e:  # a bug of ours: fail the connection, keep the listener
            self.stats.error("internal")
            log.warning("doh3 %s: %s: internal error: %r", self.stats.name, self.peer, e)
            self._close(ErrorCode.H3_INTERNAL_ERROR, "internal error")
        if self.requests and self.deadline is None:
            self.deadline = self._loop.call_later(self.limits.doh_request_timeout, self._check_deadlines)

    def _close(self, code: int, reason: str) -> None:
        self._quic.close(error_code=code, reason_phrase=reason)
        self.transmit()
        self._terminated()

    def _terminated(self) -> None:
        self.closed = True
        self.conns.discard(self)
        self.timer.cancel()
        self.requests.clear()
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None
        for task in list(self.tasks):
            task.cancel()

    def _idle(self) -> None:
        if not self.closed:
            self._close(ErrorCode.H3_NO_ERROR, "idle")

    def _error(self, reason: str, msg: str, *args: object) -> None:
        self.stats.error(reason)
        rlog.debug(f"{self.stats.name} {reason} {self.peer}", "doh3 %s: %s: " + msg,
                   self.stats.name, self.peer, *args)

    def _reset(self, sid: int, code: int) -> None:
        try:
            self._quic.reset_stream(sid, code)
            self._quic.stop_stream(sid, code)
        except Exception:  # aioquic refuses a reset on a stream already finished both ways
            self.stats.error("reset")

    def _on_reset(self, sid: int) -> None:
        self.requests.pop(sid, None)
        if sid in self.running:
            self.cancelled.add(sid)
        self.stats.error("stream_reset")

    # ------------------------------------------------------------------ requests

    def _h3_event(self, ev: H3Event) -> None:
        if isinstance(ev, HeadersReceived):
            sid = ev.stream_id
            if sid in self.requests or sid in self.running:
                # Trailers: nothing in them is used, but they may end the request.
                req = self.requests.get(sid)
                if req is not None and ev.stream_ended:
                    self._dispatch(sid, req)
                return
            self._request(sid, ev.headers, ev.stream_ended)
        elif isinstance(ev, DataReceived):
            req = self.requests.get(ev.stream_id)
            if req is None:
                return
            if len(req.body) + len(ev.data) > MAX_BODY:
                self._error("too_large", "request body over %d bytes", MAX_BODY)
                del self.requests[ev.stream_id]
                self._respond(ev.stream_id, (413, _TEXT, b"body over 65535 bytes\n"))
                return
            req.body += ev.data
            if ev.stream_ended:
                self._dispatch(ev.stream_id, req)

    def _request(self, sid: int, raw: list[tuple[bytes, bytes]], ended: bool) -> None:
        self.timer.touch()
        if len(self.requests) + len(self.running) >= self.limits.doh_max_streams:
            self.stats.drop("max_streams")
            rlog.debug(f"{self.stats.name} streams {self.peer}",
                       "doh3 %s: %s: %d requests open (limits.doh_max_streams)", self.stats.name,
                       self.peer, len(self.requests) + len(self.running))
            self._reset(sid, ErrorCode.H3_REQUEST_REJECTED)
            return
        head = request_head(raw)
        if head is None:
            self._error("h3_malformed", "malformed request headers on stream %d", sid)
            self._reset(sid, ErrorCode.H3_MESSAGE_ERROR)
            return
        method, path, clen, headers = head
        if clen > MAX_BODY:
            self._error("too_large", "content-length %d", clen)
            self._respond(sid, (413, _TEXT, b"body over 65535 bytes\n"))
            return
        req = _Request((method, path, headers), self._loop.time())
        if ended:
            self._dispatch(sid, req)
        else:
            self.requests[sid] = req

    def _dispatch(self, sid: int, req: _Request) -> None:
        self.requests.pop(sid, None)
        method, path, headers = req.head
        if current_peer.get() is not self.peer:
            current_peer.set(self.peer)
        try:
            res = self.app(method, path, headers, bytes(req.body))
        except Exception as e:
            self._error("handler", "handler failed: %r", e)
            res = (500, [], b"")
        if type(res) is tuple:
            self._respond(sid, res)
            return
        self.running.add(sid)
        task = self._loop.create_task(self._await(sid, cast(Awaitable[Response], res)))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _await(self, sid: int, pending: Awaitable[Response]) -> None:
        res = await handler_response(pending, self._error)
        self.running.discard(sid)
        if sid in self.cancelled:
            self.cancelled.discard(sid)
            _drop(res[2])
            return
        self._respond(sid, res)
        self.timer.touch()
        self._schedule_transmit()

    def _check_deadlines(self) -> None:
        self.deadline = None
        if self.closed:
            return
        timeout = self.limits.doh_request_timeout
        late = self._loop.time() - timeout
        first: float | None = None
        for sid, req in list(self.requests.items()):
            if req.since <= late:
                self._error("request_timeout", "request on stream %d not finished in %.1f s "
                            "(limits.doh_request_timeout)", sid, timeout)
                del self.requests[sid]
                self._respond(sid, _TIMEOUT)
                try:
                    self._quic.stop_stream(sid, ErrorCode.H3_NO_ERROR)  # RFC 9114 4.1: stop sending
                except Exception:
                    self.stats.error("reset")
            elif first is None or req.since < first:
                first = req.since
        self.transmit()
        if first is not None:
            self.deadline = self._loop.call_later(max(first - late, MIN_REARM), self._check_deadlines)

    # ------------------------------------------------------------------ responses

    def _respond(self, sid: int, res: Response) -> None:
        status, headers, body = res
        h3 = self.h3
        if self.closed or h3 is None:
            _drop(body)
            return
        # A copy: the pooled buffer may go back at once (its view is a temporary, gone here).
        data = bytes(body.view()) if isinstance(body, Buffer) else bytes(body)
        block = [(b":status", str(status).encode()),
                 *[(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers],
                 (b"content-length", str(len(data)).encode())]
        try:
            h3.send_headers(sid, block, end_stream=not data)
            if data:
                h3.send_data(sid, data, end_stream=True)  # copies (frame encoding)
        except Exception as e:  # the stream went meanwhile (reset, stopped)
            _drop(body)
            self.stats.error("send")
            rlog.debug(f"{self.stats.name} send {self.peer}", "doh3 %s: %s: stream %d: %r",
                       self.stats.name, self.peer, sid, e)
            return
        if isinstance(body, Buffer):
            body.recycle()  # copied out above: free


def _drop(body: Any) -> None:
    if isinstance(body, Buffer):
        body.drop()


async def start_doh3(app: Handler, stats: ListenerStats, limits: LimitsConfig, host: str, port: int,
                     cert: str, key: str) -> tuple[QuicServer, ClientConns]:
    config = QuicConfiguration(is_client=False, alpn_protocols=ALPN, idle_timeout=limits.dns_tcp_idle_timeout,
                               max_data=MAX_DATA, max_stream_data=MAX_STREAM_DATA)
    config.load_cert_chain(cert, key)
    conns = ClientConns(limits)

    def make(*args: Any, **kwargs: Any) -> Doh3Protocol:
        proto = Doh3Protocol.__new__(Doh3Protocol)
        proto.app = app
        proto.stats = stats
        proto.limits = limits
        proto.conns = conns
        proto.__init__(*args, **kwargs)  # type: ignore[misc]
        return proto

    server = await serve(host, port, configuration=config, create_protocol=make)
    return server, conns


class Doh3Listener(Listener):
    """`protocol = "doh3"`: DoH over HTTP/3 (QUIC on UDP), answering at `path`. Stays in the main
    process with dns.workers > 1 (a QUIC connection's packets must all reach one process)."""

    scheme = "h3"
    has_path = True
    server: QuicServer | None = None

    async def _serve(self) -> HostPort:
        cert, key = self.tls_files()
        hp = self.cfg.listen
        app = DohApp(self.pipeline, self.stats, self.cfg.path, self.limiter)
        self.server, self.conns = await start_doh3(app, self.stats, self.limits, hp.host, hp.port, cert, key)
        t = self.server._transport
        return bound_address(t.get_extra_info("sockname")) if t is not None else hp

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
