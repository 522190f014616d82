"""Connect from this host: the one seam between a portal and where traffic leaves.

`Dialer.connect(host, port, protocol_factory)` returns a connected
(transport, protocol, bound address). The relay in `server.py` talks to the
upstream only through the asyncio Transport/Protocol interface, so the mesh
can later return a stream whose transport behaves like an asyncio transport.
On this node the dialer egresses from its own host.

`Dialer.open_udp(on_datagram)` is the same seam for UDP ASSOCIATE: it
returns an egress that sends datagrams to targets and hands replies back.

What really happened maps to a SOCKS reply code (`DialError.reply`):
refused 0x05, network unreachable 0x03, host unreachable or no address (DNS
failure) 0x04, timed out 0x06, refused by policy 0x02, anything else 0x01.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Protocol, cast

from meshgate import replies
from meshgate.buffers import Buffer, BufferPool
from meshgate.metrics import REGISTRY
from meshgate.policy import parse_ip

log = logging.getLogger("meshgate.egress.dialer")

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Policy = Callable[[IPAddress, int], bool]
OnDatagram = Callable[[Buffer, tuple[str, int]], None]

# RFC 8305's recommended "Connection Attempt Delay".
HAPPY_EYEBALLS_DELAY = 0.25

_udp_send_dropped = REGISTRY.counter(
    "meshgate_socks5_udp_egress_dropped_total",
    "UDP datagrams to targets not sent (socket buffer full or send error)",
)


class DialError(replies.ReplyError):
    """Could not reach a destination; `reply` is the SOCKS reply code to send."""

    @property
    def reply(self) -> int:
        return self.code


class UdpEgress(Protocol):
    """Where one UDP association's datagrams go (LocalUdpEgress, or the portal's mesh UDP)."""

    def sendto(self, data: bytes | memoryview, sockaddr: tuple[str, int], family: int) -> bool: ...

    def close(self) -> None: ...


UdpOpener = Callable[[OnDatagram, BufferPool], Awaitable[UdpEgress]]


class HostResolver(Protocol):
    """What the dialer resolves names through: the node's DNS pipeline."""

    def resolve_host(self, name: str) -> Awaitable[list[str]]: ...



def _is_ip_literal(host: str) -> bool:
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            socket.inet_pton(family, host)
        except OSError:
            continue
        return True
    return False


class Dialer:
    """Local egress: resolve (through the node's DNS pipeline if there is one) and connect.

    `policy(ip, port) -> bool` refuses destinations (reply 0x02); None allows
    all, which is right for a single node egressing from its own host.
    """

    def __init__(
        self,
        connect_timeout: float = 10.0,
        resolver: HostResolver | None = None,
        policy: Policy | None = None,
        write_high_water: int = 1 << 20,
    ) -> None:
        self.connect_timeout = connect_timeout
        self.resolver = resolver
        self.policy = policy
        self.write_high_water = write_high_water

    async def resolve(self, host: str, port: int) -> list[IPAddress]:
        """Addresses for `host` in the order to try them; DialError(0x04) if none."""
        ip = parse_ip(host)
        if ip is not None:
            return [ip]
        try:
            if self.resolver is not None:
                found = await self.resolver.resolve_host(host)
                addrs = [a if not isinstance(a, str) else ipaddress.ip_address(a) for a in found]
            else:
                loop = asyncio.get_running_loop()
                infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
                addrs = list(dict.fromkeys(ipaddress.ip_address(i[4][0]) for i in infos))
        except (OSError, ValueError) as e:
            raise DialError(replies.HOST_UNREACHABLE, f"cannot resolve {host!r}: {e}") from None
        if not addrs:
            raise DialError(replies.HOST_UNREACHABLE, f"no address for {host!r}")
        return addrs

    def _allowed(self, ip: IPAddress, port: int) -> bool:
        return self.policy is None or self.policy(ip, port)

    async def connect(
        self, host: str, port: int, protocol_factory: Callable[[], asyncio.Protocol]
    ) -> tuple[asyncio.Transport, asyncio.Protocol, tuple[str, int]]:
        """Connect within connect_timeout (resolution included); addresses tried in order.

        `dial` without the timeout: a caller that already keeps a timer per connection (the
        portals' ClientProtocol) bounds the dial with that instead of a second one."""
        try:
            async with asyncio.timeout(self.connect_timeout):
                transport, protocol, bound = await self.dial(host, port, protocol_factory)
                return transport, cast(asyncio.Protocol, protocol), bound  # the factory's
        except TimeoutError:
            raise self.timed_out(host, port) from None

    def timed_out(self, host: str, port: int) -> DialError:
        """What a dial that outlived connect_timeout fails with (reply 0x06)."""
        return DialError(replies.TTL_EXPIRED,
                         f"connect to {host}:{port} timed out after {self.connect_timeout}s")

    async def dial(
        self, host: str, port: int, protocol_factory: Callable[[], asyncio.BaseProtocol]
    ) -> tuple[asyncio.Transport, asyncio.BaseProtocol, tuple[str, int]]:
        """Resolve, check the policy and connect, with no time limit of its own (see `connect`)."""
        allowed: list[IPAddress] | list[str]
        if self.policy is None and _is_ip_literal(host):
            # An address literal with no egress rules to check: connect at once,
            # without building ipaddress objects on the per-connection path.
            allowed = [host]
        else:
            addrs = await self.resolve(host, port)
            allowed = [a for a in addrs if self._allowed(a, port)]
            if not allowed:
                raise DialError(replies.NOT_ALLOWED, f"{host}:{port} is not allowed by the egress rules")
        loop = asyncio.get_running_loop()
        try:
            if len(allowed) == 1:
                transport, protocol = await loop.create_connection(protocol_factory, str(allowed[0]), port)
            else:
                sock = await self._first_connected([str(a) for a in allowed], port)
                transport, protocol = await loop.create_connection(protocol_factory, sock=sock)
        except OSError as e:
            reason = e.strerror or str(e)
            raise DialError(replies.for_exception(e), f"connect to {host}:{port} failed: {reason}") from None
        sock_name = transport.get_extra_info("sockname")
        bound = (str(sock_name[0]), int(sock_name[1])) if sock_name else ("0.0.0.0", 0)
        return transport, protocol, bound

    async def _first_connected(self, addrs: list[str], port: int) -> socket.socket:
        """Happy-eyeballs-style (RFC 8305, simplified): start on the first address,
        start the next one when an attempt fails or HAPPY_EYEBALLS_DELAY passes
        without an answer, and keep the first socket that connects. Raw sockets
        until then, so only the winner ever gets a protocol."""
        loop = asyncio.get_running_loop()

        async def attempt(ip: str) -> socket.socket:
            s = socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.setblocking(False)
                await loop.sock_connect(s, (ip, port))
            except BaseException:
                s.close()
                raise
            return s

        errors: list[OSError] = []
        pending: set[asyncio.Task[socket.socket]] = set()
        winner: socket.socket | None = None
        todo = iter(addrs)
        try:
            while winner is None:
                nxt = next(todo, None)
                if nxt is not None:
                    pending.add(loop.create_task(attempt(nxt)))
                if not pending:
                    break
                done, pending = await asyncio.wait(
                    pending,
                    timeout=HAPPY_EYEBALLS_DELAY if nxt is not None else None,
                    return_when=asyncio.FIRST_COMPLETED,
                )
                for t in done:
                    exc = t.exception()
                    if exc is None:
                        if winner is None:
                            winner = t.result()
                        else:
                            t.result().close()
                    elif isinstance(exc, OSError):
                        errors.append(exc)
                    else:
                        raise exc
        finally:
            for t in pending:
                t.cancel()
            if pending:
                await asyncio.wait(pending)
                for t in pending:  # one may have connected just before its cancel
                    if not t.cancelled() and t.exception() is None:
                        t.result().close()
        if winner is not None:
            return winner
        # Report the most telling failure: anything beats "unreachable", which an
        # address family without routes produces for every name.
        unreachable = (replies.NETWORK_UNREACHABLE, replies.HOST_UNREACHABLE)
        telling = (e for e in errors if replies.for_exception(e) not in unreachable)
        best = next(telling, errors[0] if errors else None)
        raise best if best is not None else OSError(errno.EHOSTUNREACH, "no address to try")

    async def open_udp(self, on_datagram: OnDatagram, pool: BufferPool) -> UdpEgress:
        """An egress for one UDP association: replies land in pooled buffers
        (payload at the headroom, so the SOCKS header is prepended in place)."""
        return LocalUdpEgress(asyncio.get_running_loop(), on_datagram, pool)


class LocalUdpEgress:
    """One unconnected UDP socket per address family for one association.

    Raw non-blocking sockets driven by `loop.add_reader`: replies are read with
    `recvfrom_into` straight into a pooled buffer, and `sendto` copies into the
    kernel synchronously, so buffer lifetimes stay simple (a full socket
    buffer drops the datagram, which UDP allows, and counts it).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, on_datagram: OnDatagram, pool: BufferPool) -> None:
        self.loop = loop
        self.on_datagram = on_datagram
        self.pool = pool
        self._socks: dict[int, socket.socket] = {}
        self.closed = False

    def _sock(self, family: int) -> socket.socket:
        s = self._socks.get(family)
        if s is None:
            af = socket.AF_INET if family == 4 else socket.AF_INET6
            s = socket.socket(af, socket.SOCK_DGRAM)
            s.setblocking(False)
            try:
                s.bind(("0.0.0.0", 0) if family == 4 else ("::", 0))
            except OSError:
                s.close()
                raise
            self._socks[family] = s
            self.loop.add_reader(s.fileno(), self._readable, s)
        return s

    def sendto(self, data: bytes | memoryview, sockaddr: tuple[str, int], family: int) -> bool:
        if self.closed:
            return False
        try:
            self._sock(family).sendto(data, sockaddr)
        except OSError:
            _udp_send_dropped.inc()
            return False
        return True

    def _readable(self, s: socket.socket) -> None:
        # Drain a bounded batch per wake-up so one busy target cannot starve the loop.
        for _ in range(64):
            buf = self.pool.get()
            try:
                n, addr = s.recvfrom_into(memoryview(buf.data)[buf.headroom :])
            except (BlockingIOError, InterruptedError):
                buf.recycle()
                return
            except OSError:
                buf.recycle()  # an ICMP error surfaced on the socket; nothing was read
                continue
            buf.start = buf.headroom
            buf.length = n
            self.on_datagram(buf, addr if len(addr) == 2 else (addr[0], addr[1]))

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for s in self._socks.values():
            with contextlib.suppress(Exception):
                self.loop.remove_reader(s.fileno())
            s.close()
        self._socks.clear()
