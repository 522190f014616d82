"""UDP ASSOCIATE (RFC 1928 section 7): one relay socket per association.

The relay socket is bound on the portal's own address (port chosen by the
kernel) and reported in the reply. Only the client may use it: datagrams must
come from the address the client named in its request, or, if it named
0.0.0.0:0 (most do), from its TCP peer IP; the first datagram pins the source
port when the client did not give one. Datagrams are read with
`recvfrom_into` into pooled buffers: a request's payload goes to the target
straight from the buffer, and a reply is read at the buffer's headroom so its
SOCKS header is prepended in place. Fragmented datagrams (FRAG != 0) are
dropped and counted, as RFC 1928 allows for a server that does not reassemble.

Targets go through the `NatTable` (bounded, idle expiry) and out through the
dialer's UDP egress, so the mesh can later carry them instead. A reply that
comes over the mesh arrives as a view into the opened mesh record; it goes to
the client with its SOCKS header in one `sendmsg` (header and payload as two
parts), never copied into a buffer first. The association ends with its TCP
control connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
from typing import TYPE_CHECKING

from meshgate.buffers import Buffer
from meshgate.egress.dialer import DialError, UdpEgress
from meshgate.gateway import socks5
from meshgate.gateway.mesh_udp import PortalUdp
from meshgate.gateway.nat import NatTable, TargetKey
from meshgate.logs import RateLimitedLog
from meshgate.metrics import REGISTRY

if TYPE_CHECKING:
    from meshgate.gateway.server import ClientProtocol

# the portal's logger (gateway/server.py logs under the same name)
rlog = RateLimitedLog(logging.getLogger("meshgate.gateway"))

ASSOCIATIONS = REGISTRY.gauge("meshgate_socks5_udp_associations", "UDP associations open now")
DATAGRAMS = REGISTRY.counter(
    "meshgate_socks5_udp_datagrams_total", "UDP datagrams relayed", ("direction",)
)
DROPPED = REGISTRY.counter(
    "meshgate_socks5_udp_dropped_total", "UDP datagrams dropped, by reason", ("reason",)
)
NAT_EVICTED = REGISTRY.counter(
    "meshgate_socks5_udp_nat_evicted_total", "NAT entries pushed out by udp_max_targets"
)
_TO_TARGET = DATAGRAMS.labels("to_target")
_TO_CLIENT = DATAGRAMS.labels("to_client")
_DROP_FRAG = DROPPED.labels("fragmented")
_DROP_SOURCE = DROPPED.labels("wrong_source")
_DROP_HEADER = DROPPED.labels("bad_header")
_DROP_UNSOLICITED = DROPPED.labels("unsolicited")
_DROP_RESOLVING = DROPPED.labels("resolve_backlog")
_DROP_RESOLVE_FAILED = DROPPED.labels("resolve_failed")
_DROP_NOT_ALLOWED = DROPPED.labels("not_allowed")
_DROP_SEND = DROPPED.labels("send_failed")

_BATCH = 64  # datagrams read per wake-up before yielding to the loop
_MAX_RESOLVING = 16  # names being resolved at once per association
_MAX_QUEUED_PER_NAME = 8  # datagrams held while their name resolves


class UdpAssociation:
    def __init__(
        self, client: ClientProtocol, sock: socket.socket, expected_ip: str, expected_port: int
    ) -> None:
        self.client = client
        self.loop = client.loop
        self.server = client.server
        limits = self.server.limits
        self.pool = self.server.pool
        self.sock = sock
        s = sock.getsockname()
        self.bound: tuple[str, int] = (str(s[0]), int(s[1]))
        self.expected_ip = expected_ip
        self.expected_port = expected_port  # 0: pinned by the first datagram
        self.client_addr: tuple[str, int] | None = None
        self.nat = NatTable(limits.socks5_udp_max_targets, limits.socks5_udp_idle_timeout)
        self.egress: UdpEgress | None = None
        self._resolving: dict[TargetKey, list[tuple[Buffer, int]]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._activity = False
        self._evicted_seen = 0
        self._to_target = 0
        self._to_client = 0
        self.closed = False
        self.rlog = rlog
        self._expiry = self.loop.call_later(self._expiry_period(), self._expire)
        self.loop.add_reader(sock.fileno(), self._client_readable)
        ASSOCIATIONS.inc()

    @classmethod
    async def open(cls, client: ClientProtocol, request: socks5.Request) -> UdpAssociation:
        assert client.transport is not None
        local = client.transport.get_extra_info("sockname")
        peer = client.transport.get_extra_info("peername")
        family = socket.AF_INET6 if ":" in local[0] else socket.AF_INET
        expected_ip, expected_port = _expected_source(request, str(peer[0]), family)
        sock = socket.socket(family, socket.SOCK_DGRAM)
        try:
            sock.setblocking(False)
            sock.bind((local[0], 0))
            assoc = cls(client, sock, expected_ip, expected_port)
        except BaseException:
            sock.close()
            raise
        try:
            assoc.egress = await client.server.dialer.open_udp(assoc._target_datagram, client.server.pool)
        except BaseException:
            assoc.close()
            raise
        if isinstance(assoc.egress, PortalUdp):
            assoc.egress.on_view = assoc._target_view  # mesh replies: no copy into a buffer
        return assoc

    def _expiry_period(self) -> float:
        return max(0.05, min(self.nat.idle_timeout / 2, 5.0))

    def take_activity(self) -> bool:
        """True if datagrams moved since the last call (keeps the TCP control alive)."""
        active, self._activity = self._activity, False
        return active

    # ----------------------------------------------------------------- client -> target

    def _client_readable(self) -> None:
        sock, pool = self.sock, self.pool
        now = self.loop.time()
        for _ in range(_BATCH):
            buf = pool.get()
            try:
                n, addr = sock.recvfrom_into(memoryview(buf.data)[buf.headroom :])
            except (BlockingIOError, InterruptedError):
                buf.recycle()
                break
            except OSError:
                buf.recycle()
                continue
            if not self._source_ok(addr):
                buf.recycle()
                continue
            self._from_client(buf, n, now)
        self._flush_counters()

    def _source_ok(self, addr: tuple[str, int] | tuple[str, int, int, int]) -> bool:
        if addr[0] == self.expected_ip:
            if self.client_addr is not None:
                if addr[1] == self.client_addr[1]:
                    return True
            elif self.expected_port in (0, addr[1]):
                self.client_addr = (addr[0], addr[1])
                return True
        _DROP_SOURCE.inc()
        self.rlog.debug(
            "udp-source", "socks5: UDP datagram from %s:%s on association of %s dropped",
            addr[0], addr[1], self.expected_ip,
        )
        return False

    def _from_client(self, buf: Buffer, n: int, now: float) -> None:
        view = memoryview(buf.data)[buf.headroom : buf.headroom + n]
        try:
            header = socks5.parse_udp_header(view)
        except socks5.Socks5Error as e:
            view.release()
            buf.recycle()
            _DROP_HEADER.inc()
            self.rlog.debug("udp-header", "socks5: %s from %s", e, self.expected_ip)
            return
        if header.frag:
            view.release()
            buf.recycle()
            _DROP_FRAG.inc()
            self.rlog.debug("udp-frag", "socks5: fragmented UDP datagram from %s dropped", self.expected_ip)
            return
        self._activity = True
        key = (header.atyp, header.addr, header.port)
        entry = self.nat.lookup(key, now)
        if entry is None:
            if header.atyp == socks5.ATYP_DOMAIN:
                view.release()
                buf.start, buf.length = buf.headroom, n
                self._queue_for_name(key, buf, header.offset)
                return
            if not self._allowed(key):
                view.release()
                buf.recycle()
                return
            entry = self.nat.add_address(key, now)
            self._count_evictions()
        assert self.egress is not None
        ok = self.egress.sendto(view[header.offset :], entry.sockaddr, entry.family)
        view.release()
        buf.recycle()  # sendto copied into the kernel (or failed and dropped the datagram)
        if ok:
            self._to_target += 1
        else:
            _DROP_SEND.inc()

    def _allowed(self, key: TargetKey) -> bool:
        policy = self.server.dialer.policy
        if policy is None:
            return True
        ip = ipaddress.ip_address(key[1])
        if policy(ip, key[2]):
            return True
        _DROP_NOT_ALLOWED.inc()
        return False

    def _queue_for_name(self, key: TargetKey, buf: Buffer, offset: int) -> None:
        queue = self._resolving.get(key)
        if queue is None:
            if len(self._resolving) >= _MAX_RESOLVING:
                buf.recycle()
                _DROP_RESOLVING.inc()
                return
            queue = self._resolving[key] = []
            task = self.loop.create_task(self._resolve(key))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        if len(queue) >= _MAX_QUEUED_PER_NAME:
            buf.recycle()
            _DROP_RESOLVING.inc()
            return
        queue.append((buf, offset))

    async def _resolve(self, key: TargetKey) -> None:
        name = key[1].decode("ascii")
        try:
            addrs = await self.server.dialer.resolve(name, key[2])
        except DialError as e:
            addrs = []
            self.rlog.debug("udp-resolve", "socks5: UDP target %s: %s", name, e)
        queue = self._resolving.pop(key, [])
        policy = self.server.dialer.policy
        allowed = [a for a in addrs if policy is None or policy(a, key[2])]
        if self.closed or not allowed:
            for buf, _ in queue:
                buf.recycle()
            if not self.closed:
                (_DROP_NOT_ALLOWED if addrs else _DROP_RESOLVE_FAILED).inc(len(queue))
            return
        ip = allowed[0]
        if ip.version == 6 and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        entry = self.nat.add(key, (str(ip), key[2]), ip.version, self.loop.time())
        self._count_evictions()
        assert self.egress is not None
        for buf, offset in queue:
            view = memoryview(buf.data)[buf.start + offset : buf.start + buf.length]
            ok = self.egress.sendto(view, entry.sockaddr, entry.family)
            view.release()
            buf.recycle()
            if ok:
                self._to_target += 1
            else:
                _DROP_SEND.inc()
        self._flush_counters()

    def _count_evictions(self) -> None:
        if self.nat.evicted != self._evicted_seen:
            NAT_EVICTED.inc(self.nat.evicted - self._evicted_seen)
            self._evicted_seen = self.nat.evicted

    # ----------------------------------------------------------------- target -> client

    def _target_datagram(self, buf: Buffer, addr: tuple[str, int]) -> None:
        """A reply from a target, its payload at the buffer's headroom."""
        entry = self.nat.reply_entry(addr, self.loop.time())
        if entry is None or self.client_addr is None or self.closed:
            buf.recycle()
            _DROP_UNSOLICITED.inc()
            return
        self._activity = True
        buf.prepend(entry.header)
        view = buf.view()
        try:
            self.sock.sendto(view, self.client_addr)
            self._to_client += 1
        except OSError:
            _DROP_SEND.inc()
        finally:
            view.release()
            buf.recycle()  # sendto copied it, or the datagram is dropped
        if self._to_client >= _BATCH:
            self._flush_counters()

    def _target_view(self, payload: memoryview, addr: tuple[str, int]) -> None:
        """A reply from a target over the mesh, `payload` a view valid during this call: the
        SOCKS header and the payload leave in one datagram (sendmsg gathers both parts)."""
        entry = self.nat.reply_entry(addr, self.loop.time())
        if entry is None or self.client_addr is None or self.closed:
            _DROP_UNSOLICITED.inc()
            return
        self._activity = True
        try:
            self.sock.sendmsg((entry.header, payload), (), 0, self.client_addr)
            self._to_client += 1
        except OSError:
            _DROP_SEND.inc()
        if self._to_client >= _BATCH:
            self._flush_counters()

    def _flush_counters(self) -> None:
        if self._to_target:
            _TO_TARGET.inc(self._to_target)
            self._to_target = 0
        if self._to_client:
            _TO_CLIENT.inc(self._to_client)
            self._to_client = 0

    # ----------------------------------------------------------------- lifetime

    def _expire(self) -> None:
        if self.closed:
            return
        self.nat.expire(self.loop.time())
        self._flush_counters()
        self._expiry = self.loop.call_later(self._expiry_period(), self._expire)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        ASSOCIATIONS.dec()
        self._flush_counters()
        self._expiry.cancel()
        with contextlib.suppress(Exception):
            self.loop.remove_reader(self.sock.fileno())
        self.sock.close()
        if self.egress is not None:
            self.egress.close()
        for task in list(self._tasks):
            task.cancel()
        for queue in self._resolving.values():
            for buf, _ in queue:
                buf.recycle()
        self._resolving.clear()
        self.nat.clear()


def _expected_source(request: socks5.Request, peer_ip: str, family: int) -> tuple[str, int]:
    """The client's UDP source as the relay socket will report it."""
    ip: ipaddress.IPv4Address | ipaddress.IPv6Address
    if request.atyp == socks5.ATYP_DOMAIN:
        ip = ipaddress.ip_address(peer_ip)  # a name here tells us nothing; use the TCP peer
    else:
        ip = ipaddress.ip_address(request.addr)
        if ip.is_unspecified:
            ip = ipaddress.ip_address(peer_ip)
    if family == socket.AF_INET6 and ip.version == 4:
        ip = ipaddress.IPv6Address(f"::ffff:{ip}")
    elif family == socket.AF_INET and isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped:
        ip = ip.ipv4_mapped
    return str(ip), request.port
