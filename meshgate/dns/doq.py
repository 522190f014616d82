"""DNS over QUIC (RFC 9250) on aioquic.

Framing is sans-I/O (`DoqStreamState`: bytes in, a complete query or a
protocol error out); the asyncio side is aioquic's QuicConnectionProtocol.

Rules: one client-initiated bidirectional stream per query, 2-byte length +
message, the client FINs, we answer on the same stream and FIN. Message ID
must be 0; a non-zero ID, FIN before the declared length, bytes after the
message, the edns-tcp-keepalive option, or a unidirectional/server-initiated
stream close the connection with DOQ_PROTOCOL_ERROR. Answers are padded
(RFC 8467 blocks) whenever the query has EDNS. In 0-RTT only QUERY is
served; other opcodes get REFUSED with Extended DNS Error 26 (Too Early).

Connections: limits.dns_tcp_max_clients, and limits.dns_tcp_max_clients_per_source from one
client address (dns/clients.py), refused with DOQ_EXCESSIVE_LOAD.

Bounds: every stream has a read deadline (limits.doq_stream_timeout; a
stream that never FINs would otherwise hold an aioquic slot forever, CoreDNS
CVE-2025-47950), streams open at once per connection ≤ limits.doq_max_streams
(advertised as MAX_STREAMS, raised as streams end, and enforced), and the
pipeline's in-flight cap bounds the workers overall (over it: RESET_STREAM with
DOQ_EXCESSIVE_LOAD).
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections import OrderedDict
from typing import Any

from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.asyncio.server import QuicServer, serve
from aioquic.quic import events
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import Limit
from aioquic.tls import SessionTicket

from meshgate.buffers import Buffer
from meshgate.config import HostPort, LimitsConfig
from meshgate.dns import wire
from meshgate.dns.clients import ClientConns, admit_client
from meshgate.dns.listeners import Listener, bound_address
from meshgate.dns.ratelimit import ClientRateLimit
from meshgate.dns.resolver import Frontend, Pipeline, Ready
from meshgate.dns.stats import ListenerStats
from meshgate.logs import RateLimitedLog

log = logging.getLogger("meshgate.dns.doq")
rlog = RateLimitedLog(log)

DOQ_NO_ERROR = 0x0
DOQ_INTERNAL_ERROR = 0x1
DOQ_PROTOCOL_ERROR = 0x2
DOQ_REQUEST_CANCELLED = 0x3
DOQ_EXCESSIVE_LOAD = 0x4
DOQ_UNSPECIFIED_ERROR = 0x5

MAX_TICKETS = 1024


class DoqProtocolError(Exception):
    """Close the connection with DOQ_PROTOCOL_ERROR."""


class DoqStreamState:
    """One query stream's bytes (sans-I/O). `feed` returns the query when the stream is complete."""

    __slots__ = ("data", "deadline")

    def __init__(self, deadline: float) -> None:
        self.data = bytearray()
        self.deadline = deadline

    def feed(self, data: bytes, end_stream: bool) -> bytes | None:
        self.data += data
        if len(self.data) > 2 + wire.MAX_MESSAGE:
            raise DoqProtocolError("more than one message on a stream")
        if len(self.data) >= 2:
            n = (self.data[0] << 8) | self.data[1]
            if len(self.data) > 2 + n:
                raise DoqProtocolError("bytes after the message (more than one query on a stream)")
        if not end_stream:
            return None
        if len(self.data) < 2:
            raise DoqProtocolError("FIN before the length prefix")
        n = (self.data[0] << 8) | self.data[1]
        if len(self.data) != 2 + n:
            raise DoqProtocolError("FIN before the declared length")
        return bytes(self.data[2:])


def too_early(msg: bytes) -> bool:
    """0-RTT data can be replayed: only QUERY and NOTIFY may be served from it."""
    return len(msg) >= 12 and not msg[2] & 0x80 and ((msg[2] >> 3) & 0xF) not in (
        wire.OPCODE_QUERY, wire.OPCODE_NOTIFY)


def check_doq_query(q: wire.Query) -> None:
    if q.id != 0:
        raise DoqProtocolError(f"message ID {q.id} (must be 0)")
    if q.keepalive:
        raise DoqProtocolError("edns-tcp-keepalive option")


class TicketStore:
    """Session tickets for resumption/0-RTT, bounded (oldest forgotten first)."""

    def __init__(self, size: int = MAX_TICKETS) -> None:
        self.size = size
        self.tickets: OrderedDict[bytes, SessionTicket] = OrderedDict()

    def add(self, ticket: SessionTicket) -> None:
        self.tickets[ticket.ticket] = ticket
        while len(self.tickets) > self.size:
            self.tickets.popitem(last=False)

    def pop(self, label: bytes) -> SessionTicket | None:
        return self.tickets.pop(label, None)  # single use (anti-replay)


def cap_bidi_streams(quic: Any, cap: int) -> None:
    """Advertise `cap` bidirectional streams per connection instead of aioquic's fixed 128 (DoQ
    and DoH over HTTP/3 both call this on a new connection).

    aioquic (1.7) has no public setting for it, so this sets its private Limit, and must set
    `sent` with `value`: the initial transport parameter is `value`, each stream that ends raises
    `value` by one, and a MAX_STREAMS frame goes out only once `value` has moved far enough past
    `sent`. With `sent` left at 128 a cap of 64 was never raised (the connection stopped at its
    64th stream, issue 16). As both, the cap bounds the streams open at once, not those over the
    connection's life (RFC 9000 4.6); the callers also enforce it. Pinned by
    tests/integration/test_doq_sessions.py.
    """
    limit = getattr(quic, "_local_max_streams_bidi", None)
    if isinstance(limit, Limit):
        limit.value = limit.sent = min(limit.value, cap)


class DoqProtocol(QuicConnectionProtocol):
    frontend: Frontend
    stats: ListenerStats
    limits: LimitsConfig
    conns: set[DoqProtocol]  # this listener's live connections (≤ limits.dns_tcp_max_clients)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.streams: dict[int, DoqStreamState] = {}
        self.running: set[int] = set()  # answered later; counted against the cap even if reset
        self.cancelled: set[int] = set()  # running streams the client reset or stopped
        self.handshake_done = False
        self.closed = False
        self.deadline_timer: asyncio.TimerHandle | None = None
        cap_bidi_streams(self._quic, self.limits.doq_max_streams)
        # Admitted (limits.dns_tcp_max_clients, and _per_source: dns/clients.py) or refused with a
        # DoQ code once the first packet is processed (a close before that would not reach the
        # client, and the peer's address is known only then).
        self.admitted: bool | None = None

    @property
    def peer(self) -> Any:
        return self._quic._network_paths[0].addr if self._quic._network_paths else None

    def quic_event_received(self, event: events.QuicEvent) -> None:
        if self.admitted is None:
            self.admitted = admit_client(self.conns, self, self.peer, self.limits, self.stats)
        if not self.admitted and not self.closed:
            self.closed = True
            self._quic.close(error_code=DOQ_EXCESSIVE_LOAD, reason_phrase="too many connections")
            return
        if self.closed:
            if isinstance(event, events.ConnectionTerminated):
                self._terminated()
            return
        try:
            if isinstance(event, events.StreamDataReceived):
                self._data(event)
            elif isinstance(event, events.StreamReset | events.StopSendingReceived):
                # The client gave up on this query: forget its bytes; a running worker's
                # answer will be dropped (its slot stays counted until the worker ends).
                self.streams.pop(event.stream_id, None)
                if event.stream_id in self.running:
                    self.cancelled.add(event.stream_id)
                self.stats.error("stream_reset")
            elif isinstance(event, events.HandshakeCompleted):
                self.handshake_done = True
            elif isinstance(event, events.ConnectionTerminated):
                self._terminated()
        except DoqProtocolError as e:
            self._protocol_error(str(e))
        except Exception as e:  # a bug of ours: fail the stream, keep the connection and the listener
            sid = getattr(event, "stream_id", None)
            self.stats.error("internal")
            log.warning("doq %s: %s: internal error on stream %s: %r", self.stats.name, self.peer, sid, e)
            if isinstance(sid, int):
                self.streams.pop(sid, None)
                self._reset(sid, DOQ_INTERNAL_ERROR)

    def _protocol_error(self, reason: str) -> None:
        self.stats.error("doq_protocol")
        rlog.debug(f"{self.stats.name} proto {self.peer}", "doq %s: %s: %s: DOQ_PROTOCOL_ERROR",
                   self.stats.name, self.peer, reason)
        self.closed = True
        self._quic.close(error_code=DOQ_PROTOCOL_ERROR, reason_phrase=reason[:64])
        self._terminated()

    def _terminated(self) -> None:
        self.closed = True
        self.conns.discard(self)
        self.streams.clear()
        if self.deadline_timer is not None:
            self.deadline_timer.cancel()
            self.deadline_timer = None

    def _data(self, ev: events.StreamDataReceived) -> None:
        sid = ev.stream_id
        if sid & 0x3 != 0:
            raise DoqProtocolError(f"stream {sid} is not client-initiated bidirectional")
        st = self.streams.get(sid)
        if st is None:
            if sid in self.running or (not ev.data and not ev.end_stream):
                return
            if len(self.streams) + len(self.running) >= self.limits.doq_max_streams:
                self.stats.drop("max_streams")
                rlog.debug(f"{self.stats.name} streams {self.peer}",
                           "doq %s: %s: %d streams open (limits.doq_max_streams)", self.stats.name,
                           self.peer, len(self.streams) + len(self.running))
                self._reset(sid, DOQ_EXCESSIVE_LOAD)
                return
            st = self.streams[sid] = DoqStreamState(self._loop.time() + self.limits.doq_stream_timeout)
            self._arm_deadline()
        msg = st.feed(ev.data, ev.end_stream)
        if msg is None:
            return
        del self.streams[sid]
        self._query(sid, msg)

    def _query(self, sid: int, msg: bytes) -> None:
        if not self.handshake_done and too_early(msg):
            self._too_early(sid, msg)
            return
        res = self.frontend.query(msg, self._loop.time(), self.peer, pad=True, check=check_doq_query)
        if isinstance(res, Ready):
            self._send(sid, res.buffer)
        elif res is not None:
            self.running.add(sid)
            res.then(lambda ready: self._answer_later(sid, ready))
        else:  # dropped (malformed beyond answering): tell the client, free the slot
            self._reset(sid, DOQ_REQUEST_CANCELLED)

    def _too_early(self, sid: int, msg: bytes) -> None:
        """REFUSED + Extended DNS Error 26 for a non-QUERY/NOTIFY opcode in 0-RTT (replayable)."""
        qid, flags = struct.unpack_from(">HH", msg, 0)
        if qid != 0:
            raise DoqProtocolError(f"message ID {qid} (must be 0)")
        question: bytes | None
        try:
            question = wire.parse_query(msg).question
        except wire.FormError as e:
            question = e.question
        except wire.WireError:
            question = None
        buf = self.frontend.pipeline.buffer(1024)
        wire.pack_error(buf, qid, flags, wire.REFUSED, question, edns=True, pad=True, ede=wire.EDE_TOO_EARLY)
        self.stats.queries.inc()
        self.stats.error("too_early")
        self.stats.response(wire.REFUSED)
        self._send(sid, buf)

    def _answer_later(self, sid: int, ready: Ready | None) -> None:
        buf = ready.buffer if ready is not None else None
        self.running.discard(sid)
        if sid in self.cancelled:
            self.cancelled.discard(sid)
            if buf is not None:
                buf.drop()  # never written: dropped rather than trusted back into the pool
            return
        if self.closed:
            if buf is not None:
                buf.drop()
            return
        if buf is None:
            self._reset(sid, DOQ_EXCESSIVE_LOAD)
        else:
            self._send(sid, buf)
        self.transmit()

    def _send(self, sid: int, buf: Buffer) -> None:
        buf.prepend_length()
        try:
            # aioquic copies into the stream's send buffer: the buffer is free on return.
            self._quic.send_stream_data(sid, buf.view(), end_stream=True)  # type: ignore[arg-type]
        except Exception as e:  # e.g. the client sent STOP_SENDING/RESET_STREAM meanwhile
            buf.drop()
            self.stats.error("send")
            rlog.debug(f"{self.stats.name} send {self.peer}", "doq %s: %s: stream %d: %r",
                       self.stats.name, self.peer, sid, e)
            return
        buf.recycle()

    def _reset(self, sid: int, code: int) -> None:
        try:
            self._quic.reset_stream(sid, code)
            self._quic.stop_stream(sid, code)
        except Exception:  # aioquic refuses a reset on a stream already finished both ways
            self.stats.error("reset")

    def _arm_deadline(self) -> None:
        if self.deadline_timer is None and self.streams:
            first = min(st.deadline for st in self.streams.values())
            self.deadline_timer = self._loop.call_at(first, self._check_deadlines)

    def _check_deadlines(self) -> None:
        self.deadline_timer = None
        if self.closed:
            return
        now = self._loop.time()
        if any(st.deadline <= now for st in self.streams.values()):
            # A stream that never FINs: RFC 9250 4.3.1 treats a missing FIN as a protocol error.
            self._protocol_error("stream read deadline passed without FIN (limits.doq_stream_timeout)")
            self.transmit()
            return
        self._arm_deadline()


async def start_doq(pipeline: Pipeline, stats: ListenerStats, limits: LimitsConfig, host: str, port: int,
                    cert: str, key: str, limiter: ClientRateLimit | None = None
                    ) -> tuple[QuicServer, set[DoqProtocol]]:
    config = QuicConfiguration(is_client=False, alpn_protocols=["doq"],
                               idle_timeout=limits.dns_tcp_idle_timeout)
    config.load_cert_chain(cert, key)
    tickets = TicketStore()
    frontend = Frontend(pipeline, stats, limiter=limiter)
    conns = ClientConns(limits)

    def make(*args: Any, **kwargs: Any) -> DoqProtocol:
        proto = DoqProtocol.__new__(DoqProtocol)
        proto.frontend = frontend
        proto.stats = stats
        proto.limits = limits
        proto.conns = conns
        proto.__init__(*args, **kwargs)  # type: ignore[misc]
        return proto

    server = await serve(host, port, configuration=config, create_protocol=make,
                         session_ticket_fetcher=tickets.pop, session_ticket_handler=tickets.add)
    return server, conns


class DoqListener(Listener):
    """`protocol = "doq"`: DNS over QUIC (RFC 9250). Stays in the main process with dns.workers > 1
    (a QUIC connection's packets must all reach the process holding its state)."""

    scheme = "quic"
    server: QuicServer | None = None
    conns: set[DoqProtocol]

    async def _serve(self) -> HostPort:
        cert, key = self.tls_files()
        hp = self.cfg.listen
        self.server, self.conns = await start_doq(self.pipeline, self.stats, self.limits, hp.host, hp.port,
                                                  cert, key, self.limiter)
        t = self.server._transport
        return bound_address(t.get_extra_info("sockname")) if t is not None else hp

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()  # closes every connection it holds
            self.server = None
