"""udp:// links: the asyncio adapter of udp_session.UdpSession.

`UdpSocket` owns one non-blocking UDP socket driven by `loop.add_reader` /
`add_writer` (asyncio's datagram transports cannot pass the UDP_SEGMENT control
message). Reads drain the socket into one preallocated buffer (at most
`limits.udp_link_read_batch` datagrams per wake-up); with UDP_GRO on, one read
may hold several coalesced packets, split by the gso_size control message.
Sends: the packets one link produced in one loop tick go out together; runs of
equal-size packets to one address (the last may be shorter) leave in one
`sendmsg` with UDP_SEGMENT (GSO: up to 64 segments / 64 KB per call) where the
kernel supports it, else one `send` per packet. Support is probed once when the
socket is made (setsockopt UDP_SEGMENT) and dropped for good on the first GSO
send failing with EIO/EINVAL/ENOPROTOOPT/EOPNOTSUPP (a device without checksum
offload). EAGAIN parks the rest in a bounded queue drained by `add_writer`.

`UdpListener` answers many peers on one socket: packets are demultiplexed by the
receiver's session id (and must come from that session's address); a new source
gets a session only for a well-formed msg1, one pending handshake per source
address, within `limits.max_peers + limits.max_pending_handshakes` sessions.
An initiator gets its own connected socket (`connect`).

Roaming (WireGuard-style): a data packet for an established session from another
address is opened like any other; if it authenticates and is the newest record seen
(not a replay, not a straggler from the old path), the session's send address moves
to where it came from (a NAT rebinding, a peer that changed networks). Anything else
from another address changes nothing and is counted as `unknown_peer`.

Sockets carry the node's fwmark (tun_routes.mark_socket) like TCP links, so an
exit's default route through the node's own TUN device does not swallow them.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import socket
import struct
import sys
from collections import deque
from collections.abc import Callable
from typing import Any

from meshgate.config import LimitsConfig, LinkUrl
from meshgate.logs import RateLimitedLog
from meshgate.mesh.frames import HELLO, LinkError
from meshgate.mesh.links import LinkBase, LinkOwner
from meshgate.mesh.traversal import KIND_PROBE
from meshgate.mesh.tun_routes import mark_socket
from meshgate.mesh.udp_session import (
    DATA,
    KIND_DATA,
    KIND_INIT,
    KIND_PIECE,
    UdpSession,
    is_init,
    payload_size,
    receiver_id,
)
from meshgate.metrics import REGISTRY, LocalCounter
from meshgate.netfmt import host_port

log = logging.getLogger("meshgate.mesh.udp")
_rlog = RateLimitedLog(log)

SOL_UDP = getattr(socket, "SOL_UDP", 17)
UDP_SEGMENT = getattr(socket, "UDP_SEGMENT", 103)
UDP_GRO = getattr(socket, "UDP_GRO", 104)
SO_SNDBUFFORCE = getattr(socket, "SO_SNDBUFFORCE", 32)
SO_RCVBUFFORCE = getattr(socket, "SO_RCVBUFFORCE", 33)
GSO_MAX_SEGMENTS = 64
GSO_MAX_BYTES = 65000  # below the 64 KB IP datagram limit with headers
READ_SIZE = 65535  # one read may be a GRO super-packet
SOCKET_BUFFER = 8 << 20  # a full window in flight must fit the receiver's socket buffer
GSO_UNSUPPORTED = frozenset((errno.EIO, errno.EINVAL, errno.ENOPROTOOPT, errno.EOPNOTSUPP))
ANC_SIZE = 256  # room for a GRO segment size and a packet-info message
IP_PKTINFO = getattr(socket, "IP_PKTINFO", 8)
IPV6_PKTINFO = getattr(socket, "IPV6_PKTINFO", 50)
IPV6_RECVPKTINFO = getattr(socket, "IPV6_RECVPKTINFO", 49)
IP_TTL = getattr(socket, "IP_TTL", 2)
IPV6_HOPLIMIT = getattr(socket, "IPV6_HOPLIMIT", 52)
Cmsg = tuple[int, int, bytes]
# (read buffer, bytes read, GRO segment size, source address, packet info) -> bytes handled
BatchHandler = Callable[[memoryview, int, int, Any, "Cmsg | None"], int]

_packets = REGISTRY.counter("meshgate_mesh_udp_link_packets_total", "Packets on udp:// links", ("direction",))
_gso_batches = REGISTRY.counter(
    "meshgate_mesh_udp_link_gso_batches_total", "sendmsg calls with UDP_SEGMENT (several packets each)"
)
_retransmits = REGISTRY.counter(
    "meshgate_mesh_udp_link_retransmits_total", "Reliable segments sent again on udp:// links"
)
_dropped = REGISTRY.counter(
    "meshgate_mesh_udp_link_dropped_total", "Packets dropped on udp:// links", ("reason",)
)
_roamed = REGISTRY.counter(
    "meshgate_mesh_udp_link_roamed_total", "udp:// sessions whose peer moved to a new address"
)
_aead = REGISTRY.counter(
    "meshgate_mesh_udp_link_sessions_total", "udp:// sessions established, by negotiated AEAD", ("aead",)
)
_fragmented = REGISTRY.counter(
    "meshgate_mesh_udp_link_fragmented_total",
    "Datagrams too big for one packet: sent in pieces (out), put together again (in)", ("direction",),
)


def _fmt_addr(addr: Any) -> str:
    return host_port(addr[0], addr[1])


def _sock_buffers(sock: socket.socket) -> None:
    for force, plain in ((SO_RCVBUFFORCE, socket.SO_RCVBUF), (SO_SNDBUFFORCE, socket.SO_SNDBUF)):
        try:
            sock.setsockopt(socket.SOL_SOCKET, force, SOCKET_BUFFER)  # root: beyond rmem_max
        except OSError:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, plain, SOCKET_BUFFER)


def gso_supported(sock: socket.socket) -> bool:
    try:
        sock.setsockopt(SOL_UDP, UDP_SEGMENT, 0)  # 0: no default segmentation, just the probe
    except OSError:
        return False
    return True


def gso_run(sizes: list[int], i: int) -> int:
    """The end of the GSO run that starts at packet i: packets of its size, then maybe one
    shorter, at most GSO_MAX_SEGMENTS and GSO_MAX_BYTES. The usual case (a flush's full-size
    packets) costs one C-level count per run, not Python per packet."""
    n, size = len(sizes), sizes[i]
    full = max(i + 1, min(n, i + GSO_MAX_SEGMENTS, i + GSO_MAX_BYTES // size))
    if sizes[i:full].count(size) != full - i:
        full = i + 1  # another size comes first (rare): where
        while sizes[full] == size:
            full += 1
    if (full < n and full - i < GSO_MAX_SEGMENTS and sizes[full] <= size
            and (full - i) * size + sizes[full] <= GSO_MAX_BYTES):
        return full + 1  # a shorter one ends the run
    return full


class UdpSocket:
    """One UDP socket: drained reads (GRO split), per-tick batched sends (GSO)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        sock: socket.socket,
        on_packet: Callable[[memoryview, Any, Cmsg | None], None],
        limits: LimitsConfig,
        connected: bool,
        pktinfo: bool = False,
        on_batch: BatchHandler | None = None,
    ) -> None:
        self.loop = loop
        self.sock = sock
        self.on_packet = on_packet
        # a whole read (a GRO batch) at once: one call for what is nearly always one session's
        # data packets; it returns how far it got, and on_packet takes the rest one by one
        self.on_batch = on_batch
        self.connected = connected
        self.read_batch = limits.udp_link_read_batch
        self.queue_limit = limits.udp_link_send_queue
        self.gso = limits.udp_link_gso and gso_supported(sock)
        self.gro = False
        if limits.udp_link_gso:
            try:
                sock.setsockopt(SOL_UDP, UDP_GRO, 1)
                self.gro = True
            except OSError:
                pass
        # A listener bound to a wildcard address answers from the address each peer sent to
        # (IP_PKTINFO): the kernel would otherwise pick the source by route, and a peer that
        # reached us at another of our addresses (a loopback alias, a second interface)
        # drops the answer on its connected socket.
        self.pktinfo = False
        if pktinfo:
            try:
                if sock.family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, IPV6_RECVPKTINFO, 1)
                else:
                    sock.setsockopt(socket.IPPROTO_IP, IP_PKTINFO, 1)
                self.pktinfo = True
            except OSError:
                pass
        self._buf = bytearray(READ_SIZE)
        self._view = memoryview(self._buf)
        self._queue: deque[tuple[Any, Cmsg | None, bytes]] = deque()  # parked by EAGAIN, in order
        self._writing = False
        self.closed = False
        # per-socket counts (tests, status) and their metrics
        self.gso_batches = 0
        self.gso_segments = 0
        self.sent = 0
        self.received = 0
        self._out = LocalCounter(_packets.labels("out"))
        self._in = LocalCounter(_packets.labels("in"))
        loop.add_reader(sock.fileno(), self._readable)

    @property
    def family(self) -> int:
        return self.sock.family

    # ------------------------------------------------------------------ receive

    def _readable(self) -> None:
        sock, view, buf = self.sock, self._view, self._buf
        on_packet, on_batch = self.on_packet, self.on_batch
        # the bound counts packets, not reads: one GRO read may hold 64 of them
        count, budget, reads = 0, self.read_batch, 0
        while count < budget and reads < budget:
            reads += 1  # errors and empty reads count too, so a storm of them still yields
            try:
                n, anc, _flags, addr = sock.recvmsg_into((buf,), ANC_SIZE)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as e:
                # ICMP errors (port unreachable: the peer is gone) surface on the next read
                _dropped.labels("icmp_error").inc()
                _rlog.debug(f"icmp:{id(self)}", "udp link socket error: %s", e.strerror)
                continue
            if self.closed:
                return
            step = n
            src: Cmsg | None = None
            for level, ctype, data in anc:
                if level == SOL_UDP and ctype == UDP_GRO:
                    step = int.from_bytes(data[:4] if len(data) >= 4 else data[:2], sys.byteorder)
                elif level == socket.IPPROTO_IP and ctype == IP_PKTINFO and len(data) >= 12:
                    # in_pktinfo: ifindex, spec_dst, addr (the header's destination): answer from it
                    src = (socket.IPPROTO_IP, IP_PKTINFO, bytes(4) + data[8:12] + bytes(4))
                elif level == socket.IPPROTO_IPV6 and ctype == IPV6_PKTINFO and len(data) >= 16:
                    src = (socket.IPPROTO_IPV6, IPV6_PKTINFO, data[:16] + bytes(4))
            if step <= 0:
                step = n
            count += (n + step - 1) // step
            off = on_batch(view, n, step, addr, src) if on_batch is not None and n else 0
            if self.closed:
                return
            while off < n:
                end = min(n, off + step)
                on_packet(view[off:end], addr, src)
                off = end
                if self.closed:
                    return
        self.received += count
        self._in.add(count)
        self._in.flush()

    # ------------------------------------------------------------------ send

    def send(self, addr: Any, packets: list[bytes], src: Cmsg | None = None) -> None:
        """Send to `addr` (ignored on a connected socket); `src`: the packet-info control
        message that picks our source address (listeners on a wildcard address)."""
        if self.closed or not packets:
            return
        if self._queue:
            self._park(addr, src, packets, 0)
            return
        self._send(addr, src, packets)

    def _send(self, addr: Any, src: Cmsg | None, packets: list[bytes]) -> None:
        sock = self.sock
        i, n = 0, len(packets)
        sizes = list(map(len, packets)) if self.gso and n > 1 else []
        while i < n:
            size = len(packets[i])
            j = gso_run(sizes, i) if sizes and self.gso else i + 1
            try:
                if j - i > 1:
                    anc = [(SOL_UDP, UDP_SEGMENT, struct.pack("=H", size))]
                    if src is not None:
                        anc.append(src)
                    if self.connected:
                        sock.sendmsg(packets[i:j], anc)
                    else:
                        sock.sendmsg(packets[i:j], anc, 0, addr)
                    self.gso_batches += 1
                    self.gso_segments += j - i
                    _gso_batches.inc()
                elif self.connected:
                    sock.send(packets[i])
                elif src is not None:
                    sock.sendmsg((packets[i],), (src,), 0, addr)
                else:
                    sock.sendto(packets[i], addr)
            except (BlockingIOError, InterruptedError):
                self._park(addr, src, packets, i)
                return
            except OSError as e:
                if j - i > 1 and e.errno in GSO_UNSUPPORTED:
                    log.info("udp links: GSO send failed (%s); one packet per send from now on", e.strerror)
                    self.gso = False
                    continue  # the same packets again, one by one
                _dropped.labels("send_error").inc(j - i)
                _rlog.debug(f"send:{addr}", "udp link send to %s failed: %s", addr, e.strerror)
            self.sent += j - i
            self._out.add(j - i)
            i = j
        self._out.flush()

    def send_probe(self, addr: Any, packet: bytes, ttl: int = 0, src: Cmsg | None = None) -> bool:
        """One NAT traversal probe, now (not queued behind link packets: a probe that waits is
        late for the moment both ends agreed on); `ttl` > 0 sets its IP TTL / hop limit."""
        if self.closed:
            return False
        anc: list[Cmsg] = []
        if ttl > 0:
            if self.sock.family == socket.AF_INET6:
                anc.append((socket.IPPROTO_IPV6, IPV6_HOPLIMIT, struct.pack("=i", ttl)))
            else:
                anc.append((socket.IPPROTO_IP, IP_TTL, struct.pack("=i", ttl)))
        if src is not None:
            anc.append(src)
        try:
            self.sock.sendmsg((packet,), anc, 0, addr)
        except OSError as e:
            _dropped.labels("send_error").inc()
            _rlog.debug(f"probe:{addr}", "udp probe to %s failed: %s", addr, e.strerror)
            return False
        self.sent += 1
        self._out.add(1)
        return True

    def _park(self, addr: Any, src: Cmsg | None, packets: list[bytes], start: int) -> None:
        room = self.queue_limit - len(self._queue)
        take = packets[start : start + max(0, room)]
        for p in take:
            self._queue.append((addr, src, p))
        lost = len(packets) - start - len(take)
        if lost:
            # the reliable channel sends lost segments again; datagrams are lost as on any link
            _dropped.labels("send_queue_full").inc(lost)
            _rlog.debug(f"sendq:{addr}", "udp link send queue full (limits.udp_link_send_queue); "
                        "%d packets to %s dropped", lost, addr)
        if not self._writing and self._queue:
            self._writing = True
            self.loop.add_writer(self.sock.fileno(), self._writable)

    def _writable(self) -> None:
        queue = self._queue
        while queue:
            addr, src = queue[0][0], queue[0][1]
            batch: list[bytes] = []
            while queue and queue[0][0] == addr and queue[0][1] == src and len(batch) < GSO_MAX_SEGMENTS:
                batch.append(queue.popleft()[2])
            before = len(queue)
            self._send(addr, src, batch)
            if len(queue) > before:
                # parked again (EAGAIN): _send appended them at the end; put them first
                tail = [queue.pop() for _ in range(len(queue) - before)]
                queue.extendleft(tail)
                return
        self._writing = False
        self.loop.remove_writer(self.sock.fileno())

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._in.flush()
        self._out.flush()
        self.loop.remove_reader(self.sock.fileno())
        if self._writing:
            self.loop.remove_writer(self.sock.fileno())
        self._queue.clear()
        self.sock.close()


class UdpLink(LinkBase):
    """One udp:// link (one session) on a UdpSocket, to one peer address."""

    def __init__(
        self,
        owner: LinkOwner,
        url: str,
        initiator: bool,
        sock: UdpSocket,
        addr: Any,
        limits: LimitsConfig,
        on_gone: Callable[[UdpLink], None] | None = None,
    ) -> None:
        super().__init__(owner, url, initiator)
        self.sock = sock
        self.addr = addr
        self.src: Cmsg | None = None  # our source address for this peer (wildcard listeners)
        self.on_gone = on_gone
        self.on_up: Callable[[UdpLink], None] | None = None  # the handshake completed
        self.on_roam: Callable[[UdpLink, Any], None] | None = None  # the peer moved (old address)
        self.roams = 0
        # queued reliable bytes above which the link says write_paused, as a TCP transport past
        # its high-water mark does, so the owner prefers another link to the same peer
        self.high_water = limits.mesh_link_buffer
        local_id = int.from_bytes(os.urandom(4), "big") or 1
        self.session = UdpSession(
            initiator, owner.network, owner.psk, self._on_frame, local_id,
            payload=payload_size(limits.udp_link_mtu, sock.family == socket.AF_INET6),
            window=limits.udp_link_window, queue_limit=limits.udp_link_queue,
            max_retransmits=limits.udp_link_retransmits, on_established=self._established,
            reassembly=limits.udp_link_reassembly, reassembly_bytes=limits.udp_link_reassembly_bytes,
            reassembly_timeout=limits.udp_link_reassembly_timeout,
            fragment=limits.udp_link_fragment_datagrams, static=owner.identity.dh_private,
            caps=owner.aead_caps,
        )
        self._flush_scheduled = False
        self._timer_handle: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self._gone = False
        self._reported = (0, 0)  # retransmits, beyond-window drops already counted
        self._frags_reported = (0, 0, 0, 0, 0)  # fragment counts already in the metrics

    @property
    def local_id(self) -> int:
        return self.session.local_id

    @property
    def aead(self) -> str:
        s = self.session
        return s.suite.name if s.established else ""

    def begin(self) -> None:
        self._start_handshake_timer()
        self.session.start(self.loop.time())
        self._flush()

    def _established(self) -> None:
        assert self.session.send is not None
        s = self.session
        self.remote_static, self.handshake_hash = s.remote_static, s.handshake_hash
        _aead.labels(s.suite.name).inc()
        # the HELLO is the first frame on the reliable channel, as on a byte-pipe link
        s.send_frame(HELLO, 0, 1, 0, 0, self.owner.hello_body(s.handshake_hash, self.initiator))
        if self.on_up is not None:
            self.on_up(self)

    # ------------------------------------------------------------------ packets in

    def datagram_received(self, packet: memoryview) -> None:
        if self._gone:
            return
        now = self.loop.time()
        self.bytes_in += len(packet)
        try:
            if self.session.receive(packet, now):
                self.last_rx = now
        except LinkError as e:
            self.fail(e.reason, str(e))
            return
        self._flush_soon()

    def batch_received(self, view: memoryview, n: int, step: int) -> int:
        """A read of `n` bytes, packets of `step` bytes (a GRO batch): this session's data packets
        from the front, all in one session call; returns where they ended (the caller takes the
        rest, if any, one by one: a handshake packet, another session's)."""
        if self._gone:
            return n
        now = self.loop.time()
        try:
            good, used = self.session.receive_batch(view, n, step, now)
        except LinkError as e:
            self.fail(e.reason, str(e))
            return n
        self.bytes_in += used
        if good:
            self.last_rx = now
        if used:
            self._flush_soon()
        return used

    def moved_packet(self, packet: memoryview, addr: Any, src: Cmsg | None) -> bool:
        """A data packet for this session from another address (listeners only): opened like
        any other; if authentic and the newest record so far, the peer moved there. False:
        it changed nothing (forged, replayed, a straggler from the old path)."""
        if self._gone or not self.session.established:
            return False
        now = self.loop.time()
        try:
            authentic = self.session.receive(packet, now)
        except LinkError as e:
            self.fail(e.reason, str(e))
            return True
        if not authentic:
            return False
        self.bytes_in += len(packet)
        self.last_rx = now
        if self.session.newest(packet):
            old = self.addr
            self.addr = addr
            self.src = src
            self.url = str(LinkUrl("udp", addr[0], addr[1]))
            self.roams += 1
            _roamed.inc()
            # rate-limited per session: a peer whose packets alternate between two paths would
            # otherwise log every switch
            _rlog.log(logging.INFO, f"roam:{self.local_id}", "udp link: peer moved from %s to %s",
                      _fmt_addr(old), _fmt_addr(addr))
            if self.on_roam is not None:
                self.on_roam(self, old)
        self._flush_soon()
        return True

    def _flush_soon(self) -> None:
        """After the rest of this read batch: one ACK (and what else is due) for all of it."""
        if not self._flush_scheduled and self.session.wants_flush():
            self._flush_scheduled = True
            self.loop.call_soon(self._flush)

    # ------------------------------------------------------------------ frames out

    def send_frame(
        self, ftype: int, flags: int, hop: int, src: int, dst: int, head: Any, data: Any = b""
    ) -> None:
        if self._gone:
            return
        try:
            self.session.send_frame(ftype, flags, hop, src, dst, head, data)
        except LinkError as e:
            self.fail(e.reason, str(e))
            return
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self.loop.call_soon(self._flush)

    def buffered(self) -> int:
        return self.session.buffered()

    def undelivered(self) -> int:
        return self.session.reliable_outstanding()

    def datagram_room(self) -> int:
        return self.session.datagram_room

    def drop_counts(self) -> tuple[int, int, int]:
        """Also the once-per-tick report of this link's UDP counters into the metrics."""
        s = self.session
        retx, beyond = self._reported
        if s.retransmits > retx:
            _retransmits.inc(s.retransmits - retx)
        if s.beyond_window > beyond:
            _dropped.labels("beyond_window").inc(s.beyond_window - beyond)
        self._reported = (s.retransmits, s.beyond_window)
        frags = (s.fragmented_out, s.reassembled, s.frag_timeout, s.frag_evicted, s.frag_malformed)
        if frags != self._frags_reported:
            self._report_fragments(frags)
        return s.replayed, s.forged, s.malformed

    def _report_fragments(self, frags: tuple[int, int, int, int, int]) -> None:
        old = self._frags_reported
        self._frags_reported = frags
        d_out, d_in, timeout, evicted, malformed = (new - was for new, was in zip(frags, old, strict=True))
        if d_out:
            _fragmented.labels("out").inc(d_out)
        if d_in:
            _fragmented.labels("in").inc(d_in)
        for reason, n in (("reassembly_timeout", timeout), ("reassembly_full", evicted),
                          ("fragment_malformed", malformed)):
            if n:
                _dropped.labels(reason).inc(n)
                _rlog.debug(f"{reason}:{self.addr}", "udp link %s: %d fragmented datagrams from %s lost (%s)",
                            self.url, n, self.addr, reason)

    def _flush(self) -> None:
        self._flush_scheduled = False
        if self._gone:
            return
        s = self.session
        packets = s.packets_to_send(self.loop.time())
        if packets:
            self.bytes_out += sum(map(len, packets))
            self.sock.send(self.addr, packets, self.src)
        queued = s.queued()
        if queued > self.high_water:
            self.write_paused = True
        elif self.write_paused and queued <= self.high_water // 2:
            self.write_paused = False
        self._arm()

    # ------------------------------------------------------------------ timers

    def _arm(self) -> None:
        when = self.session.deadline()
        if when is None:
            return
        h = self._timer_handle
        if h is not None:
            if self._timer_at <= when + 0.001:
                return  # fires first; it re-arms for the later deadline then
            h.cancel()
        self._timer_at = when
        self._timer_handle = self.loop.call_at(when, self._on_timer)

    def _on_timer(self) -> None:
        self._timer_handle = None
        if self._gone:
            return
        try:
            self.session.on_timer(self.loop.time())
        except LinkError as e:
            self.fail(e.reason, str(e))
            return
        self._flush()

    # ------------------------------------------------------------------ closing

    def abort(self) -> None:
        self._release()

    def close(self) -> None:
        if self._gone:
            return
        if self.session.established:
            self.session.close()  # the peer drops the link now instead of at its dead timer
            self._flush()
        self._release()

    def _release(self) -> None:
        if self._gone:
            return
        self._gone = True
        if self._timer_handle is not None:
            self._timer_handle.cancel()
            self._timer_handle = None
        if self.on_gone is not None:
            self.on_gone(self)
        self.drop_counts()
        # like connection_lost after transport.abort(): the owner hears of it on the next tick
        self.loop.call_soon(self._ended)


# ---------------------------------------------------------------------- listen / connect

LinkMaker = Callable[[UdpSocket, Any], "UdpLink | None"]


class UdpListener:
    """One bound socket answering many peers."""

    def __init__(self, loop: asyncio.AbstractEventLoop, sock: socket.socket, make_link: LinkMaker,
                 limits: LimitsConfig) -> None:
        self.make_link = make_link
        self.max_sessions = limits.max_peers + limits.max_pending_handshakes
        self.by_id: dict[int, UdpLink] = {}
        self.by_addr: dict[Any, UdpLink] = {}  # the newest session of each source address
        wildcard = sock.getsockname()[0] in ("0.0.0.0", "::")
        self.usock = UdpSocket(loop, sock, self._on_packet, limits, connected=False, pktinfo=wildcard,
                               on_batch=self._on_batch)
        # NAT traversal probes on this socket (mesh/traversal.py); None: dropped as unknown
        self.on_probe: Callable[[memoryview, Any, Cmsg | None], None] | None = None

    @property
    def sockname(self) -> Any:
        return self.usock.sock.getsockname()

    def _on_batch(self, view: memoryview, n: int, step: int, addr: Any, src: Cmsg | None) -> int:
        """A read whose first packet is a data packet of a session at this address goes to that
        session whole (the usual case: a GRO batch of one peer's packets); else none of it."""
        if n < DATA.size or (view[0] != KIND_DATA and view[0] != KIND_PIECE):
            return 0
        link = self.by_id.get(DATA.unpack_from(view)[1])
        if link is None or link.addr != addr:
            return 0  # unknown, or a peer that moved: _on_packet decides
        return link.batch_received(view, n, step)

    def _on_packet(self, packet: memoryview, addr: Any, src: Cmsg | None) -> None:
        if packet and packet[0] == KIND_INIT:
            self._on_init(packet, addr, src)
            return
        if packet and packet[0] == KIND_PROBE and self.on_probe is not None:
            self.on_probe(packet, addr, src)
            return
        rid = receiver_id(packet)
        link = self.by_id.get(rid) if rid is not None else None
        if link is not None and link.addr == addr:
            link.datagram_received(packet)
            return
        if link is not None and packet[0] in (KIND_DATA, KIND_PIECE) and link.moved_packet(packet, addr, src):
            return
        _dropped.labels("unknown_peer").inc()
        _rlog.debug(f"unknown:{addr}", "udp link: packet from %s for no session of ours", addr)

    def _on_init(self, packet: memoryview, addr: Any, src: Cmsg | None) -> None:
        if not is_init(packet):
            _dropped.labels("malformed").inc()
            _rlog.debug(f"init:{addr}", "udp link: malformed handshake from %s", addr)
            return
        link = self.by_addr.get(addr)
        if link is not None:
            if link.session.peer_init == bytes(packet):
                link.datagram_received(packet)  # a retransmitted msg1: msg2 again (or nothing, if done)
                return
            if not link.session.established:
                link.fail("replaced", "a new handshake from the same address")
        if len(self.by_id) >= self.max_sessions:
            _dropped.labels("table_full").inc()
            _rlog.debug(f"full:{addr}", "udp link: session table full; handshake from %s dropped", addr)
            return
        link = self.make_link(self.usock, addr)
        if link is None:
            return
        link.on_up = self._up
        self._register(link, addr, src)
        self.by_addr[addr] = link
        link.begin()
        link.datagram_received(packet)

    def _register(self, link: UdpLink, addr: Any, src: Cmsg | None) -> None:
        """A new session on this socket, accepted or dialed: demultiplexed by its id."""
        while link.local_id in self.by_id:  # 1 in 2^32: draw again rather than shadow a session
            link.session.local_id = int.from_bytes(os.urandom(4), "big") or 1
        link.on_gone = self._gone
        link.on_roam = self._roamed
        link.src = self._src_for(link, addr, src)
        self.by_id[link.local_id] = link

    def dial(self, addr: Any, make_link: LinkMaker, src: Cmsg | None = None) -> UdpLink | None:
        """An initiator link from this socket (NAT traversal: the socket whose mapping the far
        end answered), demultiplexed like the sessions it accepted; begun."""
        if len(self.by_id) >= self.max_sessions:
            _dropped.labels("table_full").inc()
            return None
        link = make_link(self.usock, addr)
        if link is None:
            return None
        self._register(link, addr, src)
        self.by_addr.setdefault(addr, link)
        link.begin()
        return link

    def _src_for(self, link: UdpLink, addr: Any, src: Cmsg | None) -> Cmsg | None:
        if src is not None and not (link.sock.family == socket.AF_INET6 and addr[0].startswith("::ffff:")):
            return src
        return None  # (a v4-mapped peer on a dual-stack socket: the kernel's choice)

    def _roamed(self, link: UdpLink, old: Any) -> None:
        link.src = self._src_for(link, link.addr, link.src)
        if self.by_addr.get(old) is link:
            del self.by_addr[old]
        self.by_addr[link.addr] = link

    def _up(self, link: UdpLink) -> None:
        """A new session from an address ends the older ones from it: one socket holds one
        session, so the peer behind that address restarted (or redialled) and the old
        session is dead; without this it would linger until the ping timeout."""
        for other in [o for o in self.by_id.values() if o.addr == link.addr and o is not link]:
            _rlog.debug(f"superseded:{link.addr}", "udp link %s: new session replaces the old one", link.url)
            other.close()

    def _gone(self, link: UdpLink) -> None:
        if self.by_id.get(link.local_id) is link:
            del self.by_id[link.local_id]
        if self.by_addr.get(link.addr) is link:
            del self.by_addr[link.addr]

    def close(self) -> None:
        for link in list(self.by_id.values()):
            link.close()
        self.usock.close()


async def listen(host: str, port: int, make_link: LinkMaker, limits: LimitsConfig) -> UdpListener:
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host or None, port, type=socket.SOCK_DGRAM, flags=socket.AI_PASSIVE)
    family, type_, proto, _name, addr = infos[0]
    sock = socket.socket(family, type_, proto)
    try:
        mark_socket(sock)
        _sock_buffers(sock)
        sock.bind(addr)
        sock.setblocking(False)
        return UdpListener(loop, sock, make_link, limits)
    except BaseException:
        sock.close()
        raise


async def connect(
    url: LinkUrl, make_link: Callable[[UdpSocket, Any], UdpLink], limits: LimitsConfig
) -> UdpLink:
    """A link on its own connected socket, not yet begun (call `begin()`)."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(url.host, url.port, type=socket.SOCK_DGRAM)
    family, type_, proto, _name, addr = infos[0]
    sock = socket.socket(family, type_, proto)
    try:
        sock.setblocking(False)
        mark_socket(sock)  # before connect(): the route lookup already honours the mark
        _sock_buffers(sock)
        sock.connect(addr)
        holder: list[UdpLink] = []
        usock = UdpSocket(
            loop, sock, lambda p, _a, _s: holder[0].datagram_received(p), limits, connected=True,
            on_batch=lambda v, n, step, _a, _s: holder[0].batch_received(v, n, step),
        )
    except BaseException:
        sock.close()
        raise
    link = make_link(usock, addr)
    holder.append(link)
    link.on_gone = lambda _link: usock.close()
    return link
