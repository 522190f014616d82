"""Plain DNS over UDP and over TCP (RFC 7766), and DoT (RFC 7858, the same framing in TLS).

asyncio Protocols, no streams: a cached or local answer is packed into a
pooled buffer and written in the same loop tick the query arrived in.
Buffers: UDP recycles once `sendto` sent the answer or it was copied into the
read batch's send slots (meshgate/udpbatch.py);
TCP/TLS park a written buffer until the transport's buffer is empty
(`release_when_drained`) and drop everything parked when the peer vanishes.

The listener kinds `udp`, `tcp` and `dot` (meshgate.dns.listeners) are at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections import deque
from typing import Any, ClassVar, cast

from meshgate.buffers import Buffer, abandon_parked, drain_parked, release_when_drained
from meshgate.config import HostPort, LimitsConfig
from meshgate.conns import IdleTimer, admit
from meshgate.dns import wire
from meshgate.dns.listeners import Listener, bound_address, serve_stream
from meshgate.dns.preformed import PreformedAnswers
from meshgate.dns.ratelimit import ClientRateLimit
from meshgate.dns.resolver import Frontend, Pipeline, Ready
from meshgate.dns.stats import ListenerStats
from meshgate.logs import RateLimitedLog
from meshgate.udpbatch import DatagramBatch

log = logging.getLogger("meshgate.dns")
rlog = RateLimitedLog(log)

MAX_PARKED = 64  # buffers parked per connection before we stop tracking (drop) them
# The UDP listener's receive buffer: the kernel's default (~208 KiB) holds only about 200 queries
# on loopback (each datagram costs ~1 KiB of buffer), so a burst from a client with a few hundred
# queries outstanding was dropped by the kernel before we could read it (UdpRcvbufErrors). The
# kernel caps SO_RCVBUF at net.core.rmem_max (often that same default), so as root we force it.
UDP_RCVBUF = 4 << 20
SO_RCVBUFFORCE = getattr(socket, "SO_RCVBUFFORCE", 33)
READ_BATCH = 64  # datagrams answered per wake-up of a UDP listener before the loop runs others
RECV_SIZE = 65535  # a UDP query may be as large as a datagram; what is read is what it is


class UdpDnsServer:
    """One UDP socket read in a tight loop: at most `READ_BATCH` datagrams per wake-up, with no
    event-loop callback per datagram. Where the C library has recvmmsg/sendmmsg (udpbatch.py)
    one call reads the wake-up's datagrams and one sends every answer known by the end of it;
    elsewhere (or `batched` False) each datagram is read with recvfrom and answered with sendto
    before the next is read. The answers and counts are the same either way.

    A repeat of a query already answered from the cache or local data is answered from
    dns/preformed.py's table (a dictionary look-up, the ID and aged TTLs patched in, nothing
    parsed); anything else goes through the general path (resolver.Frontend), whose immediate
    answers teach the table. Counters for table hits are added once per wake-up. The batch
    bound keeps the node's own process responsive (the mesh shares its loop): a full batch
    takes well under a millisecond of fast hits, and the next wake-up comes after every other
    ready callback has run.

    Sends: UDP sends each datagram whole or not at all; one the kernel refuses (EAGAIN: the
    socket's send buffer is full) is dropped and counted (`errors{reason="send"}`), as a full
    network would drop it, and the rest of the batch is still sent. Pooled buffers go back to
    the pool once sent or copied into the batch. Answers that wait for an upstream go out with
    sendto when they come.
    """

    def __init__(self, sock: socket.socket, pipeline: Pipeline, stats: ListenerStats,
                 limiter: ClientRateLimit | None, fast_entries: int, *, batched: bool = True) -> None:
        self.sock = sock
        self.loop = asyncio.get_running_loop()
        self.clock = self.loop.time  # the `now` of a wake-up (tests fix it)
        self.frontend = Frontend(pipeline, stats, limiter=limiter)
        self.pipeline = pipeline
        self.stats = stats
        self.limiter = limiter
        self.fast = PreformedAnswers(pipeline, fast_entries) if fast_entries > 0 else None
        self.closed = False
        # recvmmsg/sendmmsg where the C library has them (udpbatch.py), else a call per datagram
        self.batch = DatagramBatch.open(sock, READ_BATCH, RECV_SIZE) if batched else None
        self.loop.add_reader(sock.fileno(), self._readable if self.batch is None else self._readable_batch)

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        if name == "socket":
            return self.sock
        if name == "sockname":
            return self.sock.getsockname()
        return default

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.loop.remove_reader(self.sock.fileno())
            self.sock.close()
            self.frontend.close()
            if self.batch is not None:
                self.batch.close()
                self.batch = None

    def _readable(self) -> None:
        recv = self.sock.recvfrom
        send = self.sock.sendto
        fast = self.fast if self.pipeline.query_log is None else None  # the log sees every question
        limiter = self.limiter
        now = self.clock()
        for _ in range(READ_BATCH):
            try:
                data, addr = recv(RECV_SIZE)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:  # an ICMP error reported on the socket (not a datagram)
                self.stats.error("icmp")
                continue
            if fast is not None:
                out = fast.answer(data, now)
                if out is not None:
                    verdict = limiter.check(addr, now) if limiter is not None else 0
                    if verdict:
                        fast.unanswered()
                        self._limited(data, addr, verdict)
                        continue
                    try:
                        send(out, addr)
                    except OSError as e:
                        self._send_failed(addr, e)
                    continue
            self._general(data, addr, now)
            if self.closed:
                return
        if fast is not None:
            fast.flush_counts(self.stats)

    def _readable_batch(self) -> None:
        """`_readable` with one recvmmsg for the batch and one sendmmsg for the answers known
        at once (those from the table and the general path's immediate ones); the rest is the
        same, query by query."""
        batch = self.batch
        assert batch is not None
        for _ in range(READ_BATCH):
            try:
                keys = batch.recv(2)  # each query after its ID: the table's key
                break
            except OSError:  # an ICMP error reported on the socket (not a datagram)
                self.stats.error("icmp")
        else:
            return
        fast = self.fast if self.pipeline.query_log is None else None  # the log sees every question
        limiter = self.limiter
        now = self.clock()
        for i, key in enumerate(keys):
            if fast is not None:
                hit = fast.entry(key, now)
                if hit is not None:
                    if limiter is not None:
                        addr = batch.address(i)
                        verdict = limiter.check(addr, now)
                        if verdict:
                            fast.unanswered()
                            self._limited(batch.datagram(i), addr, verdict, i)
                            continue
                    batch.reply_pinned(i, hit.tail)  # the query's ID and the stored bytes, not copied
                    continue
            self._general(batch.datagram(i), batch.address(i), now, i)
            if self.closed:  # stopped meanwhile: the socket is gone, and the queued answers with it
                return
        for addr, e in batch.send():
            self._send_failed(addr, e)
        if fast is not None:
            fast.flush_counts(self.stats)

    def _general(self, data: bytes, addr: tuple[Any, ...], now: float, slot: int = -1) -> None:
        """The general path for one datagram; `slot`: its index in the batch being read, whose
        sendmmsg takes an answer known at once (-1: sendto now)."""
        fe = self.frontend
        fe.answered = None
        res = fe.query(data, now, addr, udp=True)
        if isinstance(res, Ready):
            if self.fast is not None and fe.answered is not None:
                self.fast.learn(data, now, fe.answered, res.buffer.view())
            self._send(res.buffer, addr, slot)
        elif res is not None:
            res.then(lambda ready: self._send(ready.buffer, addr) if ready is not None else None)

    def _limited(self, data: bytes, addr: tuple[Any, ...], verdict: int, slot: int = -1) -> None:
        """A learned query from a client over its rate: what Frontend.query answers then (its
        check already made: a second one would take a second token)."""
        self.stats.queries.inc()
        q = wire.parse_query(data)  # it parsed when it was learned: the same bytes parse again
        ready = self.frontend._limited(q, verdict, addr, True, q.padding)
        if ready is not None:
            self._send(ready.buffer, addr, slot)

    def _send(self, buf: Buffer, addr: tuple[Any, ...], slot: int = -1) -> None:
        if self.closed:
            buf.drop()
            return
        batch = self.batch
        if slot >= 0 and batch is not None and batch.reply(slot, buf.view()):
            buf.recycle()  # copied into the batch
            return
        if self._sendto(buf.view(), addr):
            buf.recycle()  # sendto copied the whole datagram
        else:
            buf.drop()

    def _sendto(self, data: bytes | memoryview, addr: tuple[Any, ...]) -> bool:
        try:
            self.sock.sendto(data, addr)
        except OSError as e:
            self._send_failed(addr, e)
            return False
        return True

    def _send_failed(self, addr: tuple[Any, ...], e: OSError) -> None:
        self.stats.error("send")
        rlog.debug(f"udp send {addr}", "dns %s: sendto %s failed: %s", self.stats.name, addr, e)


class StreamDnsProtocol(asyncio.Protocol):
    """DNS over TCP or TLS: 2-byte length frames, pipelined, answered out of order."""

    def __init__(self, pipeline: Pipeline, stats: ListenerStats, limits: LimitsConfig,
                 conns: set[StreamDnsProtocol], limiter: ClientRateLimit | None = None) -> None:
        self.frontend = Frontend(pipeline, stats, limiter=limiter)
        self.stats = stats
        self.limits = limits
        self.conns = conns
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.inbuf = bytearray()
        self.parked: deque[Buffer] = deque()
        self.pending = 0
        self.reading = True
        self.writing = True
        self.peer: Any = None
        self.timer = IdleTimer(self.loop, limits.dns_tcp_idle_timeout, self._idle, busy=self._busy)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)  # uvloop's transports are not subclasses
        self.transport = transport
        self.peer = transport.get_extra_info("peername")
        if not admit(self.conns, self, self.limits.dns_tcp_max_clients):
            self.stats.refused_connection(self.peer, len(self.conns))
            transport.abort()
            return
        self.timer.start()

    def _busy(self) -> bool:
        return self.pending > 0

    def _idle(self) -> None:
        t = self.transport
        if t is not None and not t.is_closing():
            t.close()

    def data_received(self, data: bytes) -> None:
        self.inbuf += data
        self.timer.touch()
        self._process()

    def _process(self) -> None:
        buf = self.inbuf
        t = self.transport
        while len(buf) >= 2 and t is not None and not t.is_closing():
            if self.pending >= self.limits.dns_tcp_max_queries:
                # Pipelining is bounded (dnsdist CVE-2025-30193 class): stop reading
                # until answers go out; what is already buffered waits.
                self._pause_reading()
                return
            n = (buf[0] << 8) | buf[1]
            if len(buf) < 2 + n:
                return
            msg = bytes(buf[2 : 2 + n])
            del buf[: 2 + n]
            res = self.frontend.query(msg, self.loop.time(), self.peer)
            if isinstance(res, Ready):
                self._write(res.buffer)
            elif res is not None:
                self.pending += 1
                res.then(self._done)
        self._flush_parked()

    def _done(self, ready: Ready | None) -> None:
        self.pending -= 1
        if ready is not None:
            self._write(ready.buffer)
        if self.reading is False and self.writing and self.pending < self.limits.dns_tcp_max_queries:
            self._resume_reading()
            self._process()

    def _write(self, buf: Buffer) -> None:
        t = self.transport
        if t is None or t.is_closing():
            buf.drop()
            return
        buf.prepend_length()
        try:
            t.write(buf.view())
        except Exception as e:  # a transport that failed mid-write may hold part of it
            buf.drop()
            self.stats.error("write")
            rlog.debug(f"{self.stats.name} write {self.peer}", "dns %s: write to %s failed: %r",
                       self.stats.name, self.peer, e)
            return
        if len(self.parked) >= MAX_PARKED:
            buf.drop()
            return
        release_when_drained(buf, t, self.parked)

    def _flush_parked(self) -> None:
        if self.transport is not None and self.parked:
            drain_parked(self.transport, self.parked)

    def _pause_reading(self) -> None:
        if self.reading and self.transport is not None:
            self.reading = False
            self.transport.pause_reading()

    def _resume_reading(self) -> None:
        if not self.reading and self.transport is not None and not self.transport.is_closing():
            self.reading = True
            self.transport.resume_reading()

    def pause_writing(self) -> None:
        self.writing = False
        self._pause_reading()

    def resume_writing(self) -> None:
        self.writing = True
        self._flush_parked()
        if self.pending < self.limits.dns_tcp_max_queries:
            self._resume_reading()
            self._process()

    def eof_received(self) -> bool | None:
        if self.inbuf:
            self.stats.error("truncated_frame")
            rlog.debug(f"{self.stats.name} trunc {self.peer}", "dns %s: %s closed mid-frame (%d bytes)",
                       self.stats.name, self.peer, len(self.inbuf))
            self.inbuf.clear()
        # Keep the connection half-open while answers are pending (RFC 7766 6.2.3).
        return self.pending > 0

    def connection_lost(self, exc: Exception | None) -> None:
        self.conns.discard(self)
        self.timer.cancel()
        if self.inbuf:
            self.stats.error("truncated_frame")
            self.inbuf.clear()
        abandon_parked(self.parked)  # the transport may still hold views of them
        self.frontend.close()
        self.transport = None


async def start_udp(pipeline: Pipeline, stats: ListenerStats, host: str, port: int, *,
                    reuse_port: bool = False, limiter: ClientRateLimit | None = None,
                    fast_entries: int = 4096, batched: bool = True) -> UdpDnsServer:
    """A UDP DNS server on (host, port); `fast_entries` bounds its preformed-answer table (0: every
    query takes the general path); `batched` False: a system call per datagram even where
    recvmmsg/sendmmsg exist (the tests compare the two)."""
    info = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(info[0], socket.SOCK_DGRAM)
    try:
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, UDP_RCVBUF)  # root: beyond rmem_max
        except OSError:
            with contextlib.suppress(OSError):  # best effort: the default still works
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, UDP_RCVBUF)
        sock.bind(info[4])
        sock.setblocking(False)
        return UdpDnsServer(sock, pipeline, stats, limiter, fast_entries, batched=batched)
    except BaseException:
        sock.close()
        raise


async def start_stream(pipeline: Pipeline, stats: ListenerStats, limits: LimitsConfig, host: str, port: int,
                       ssl: Any = None, *, reuse_port: bool = False, limiter: ClientRateLimit | None = None
                       ) -> tuple[asyncio.Server, set[StreamDnsProtocol]]:
    conns: set[StreamDnsProtocol] = set()
    server = await serve_stream(lambda: StreamDnsProtocol(pipeline, stats, limits, conns, limiter), limits,
                                host, port, ssl, reuse_port=reuse_port)
    return server, conns


# --------------------------------------------------------------------------- listeners


class UdpListener(Listener):
    """`protocol = "udp"`: plain DNS over UDP."""

    scheme = "udp"
    shared = True
    transport: UdpDnsServer | None = None

    async def _serve(self) -> HostPort:
        hp = self.cfg.listen
        self.transport = await start_udp(self.pipeline, self.stats, hp.host, hp.port,
                                         reuse_port=self.reuse_port, limiter=self.limiter,
                                         fast_entries=self.limits.dns_fast_path_entries
                                         if self.limits.dns_fast_path else 0)
        return bound_address(self.transport.get_extra_info("sockname"))

    async def stop(self) -> None:
        if self.transport is not None:
            self.transport.close()
            self.transport = None


class TcpListener(Listener):
    """`protocol = "tcp"`: DNS over TCP (RFC 7766)."""

    scheme = "tcp"
    shared = True
    alpn: ClassVar[list[str] | None] = None  # TLS with this ALPN (DoT); None: plain TCP
    server: asyncio.Server | None = None

    async def _serve(self) -> HostPort:
        ssl = self.ssl_context(self.alpn) if self.alpn is not None else None
        hp = self.cfg.listen
        self.server, self.conns = await start_stream(self.pipeline, self.stats, self.limits, hp.host, hp.port,
                                                     ssl, reuse_port=self.reuse_port, limiter=self.limiter)
        return bound_address(self.server.sockets[0].getsockname())

    async def stop(self) -> None:
        await self._close_server(self.server)
        self.server = None


class DotListener(TcpListener):
    """`protocol = "dot"`: DNS over TLS (RFC 7858), the TCP framing inside TLS."""

    scheme = "tls"
    alpn = ["dot"]
