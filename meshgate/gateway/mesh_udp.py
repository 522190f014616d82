"""SOCKS5 UDP ASSOCIATE over the mesh: datagrams to the node where they leave.

Portal side (`PortalUdp`, one per association): the SOCKS relay hands each
datagram with its resolved target to `sendto`; the mesh route table picks the
owner node (virtual IP, proxy CIDR, exit) and the datagram travels as a mesh
datagram on `UDP_CHANNEL`. Replies come back on `UDP_REPLY_CHANNEL` carrying
the address the portal asked for, so the SOCKS NAT table matches them.

Egress side (`UdpEgress`, one per node): a bounded table of associations
keyed by (source node, association id), each with its own UDP sockets (a NAT
binding per association, as a SOCKS server gives each client), the exit rules
(own virtual IP -> loopback, mapped CIDR -> real, `[exit]` policy) applied to
every new target, idle expiry.

Wire (both channels): u32 association id | u16 port | u8 family (4|6) |
address (4 or 16 bytes) | payload.

Per datagram, both sides work on the wire head as bytes: the head for a
target is built once, with the mesh channel in front of it (portal: per
target address; egress: per reply address), and a received head is looked
up as bytes, so no address object is parsed or formatted per datagram. No
payload is copied to put headers in front of it (issue 18 item 6): the
prebuilt head and the payload go into the link's batch as two parts
(`MeshService.send_datagram_prefixed`), a datagram arrives as a view into
the opened record (`on_datagram_view`), the egress sends the target the
payload straight from that view, and the portal sends the client its SOCKS
header and the payload in one `sendmsg` (`PortalUdp.on_view`, set by
gateway/udp.py). bench/portal_udp.py counts the allocations per round trip.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import struct
import time
from collections.abc import Callable

from meshgate.buffers import Buffer, BufferPool
from meshgate.config import Config
from meshgate.egress.acl import source_in
from meshgate.egress.dialer import LocalUdpEgress
from meshgate.egress.rules import ExitRules
from meshgate.logs import RateLimitedLog
from meshgate.mesh import channels
from meshgate.mesh.service import MeshService
from meshgate.metrics import REGISTRY
from meshgate.policy import in_any

log = logging.getLogger("meshgate.mesh.udp")  # the logger name operators filter on
_rlog = RateLimitedLog(log)

UDP_CHANNEL = channels.SOCKS_UDP  # portal -> egress
UDP_REPLY_CHANNEL = channels.SOCKS_UDP_REPLY  # egress -> portal

_HEAD = struct.Struct("!IHB")
_ASSOC = struct.Struct("!I")
_ADDR_LEN = {4: 4, 6: 16}
_DATAGRAMS = REGISTRY.counter(
    "meshgate_mesh_udp_datagrams_total", "SOCKS UDP datagrams carried over the mesh", ("event",)
)
_SENT, _RECEIVED = _DATAGRAMS.labels("sent"), _DATAGRAMS.labels("received")
_DROPPED = REGISTRY.counter(
    "meshgate_mesh_udp_dropped_total", "SOCKS UDP datagrams dropped on the mesh path", ("reason",)
)
_DROP_BAD = _DROPPED.labels("malformed")
_DROP_POLICY = _DROPPED.labels("not_allowed")
_DROP_NO_ROUTE = _DROPPED.labels("no_route")
_DROP_TABLE = _DROPPED.labels("association_table_full")
_DROP_TARGETS = _DROPPED.labels("targets_full")
_DROP_UNKNOWN = _DROPPED.labels("unknown_association")
_DROP_WRONG_NODE = _DROPPED.labels("reply_from_wrong_node")
_DROP_ACL = _DROPPED.labels("acl")

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
OnDatagram = Callable[[Buffer, tuple[str, int]], None]
# a reply's payload, a view valid only during the call, and the address it came from
OnView = Callable[[memoryview, tuple[str, int]], None]


class UdpWireError(ValueError):
    pass


def encode_head(assoc: int, ip: IPAddress, port: int) -> bytes:
    return _HEAD.pack(assoc, port, ip.version) + ip.packed


def head_len(data: bytes | memoryview) -> int:
    """Length of the wire head of `data` (0 when it is malformed)."""
    n = _ADDR_LEN.get(data[_HEAD.size - 1]) if len(data) >= _HEAD.size else None
    if n is None or len(data) < _HEAD.size + n:
        return 0
    return _HEAD.size + n


def decode(data: bytes | memoryview) -> tuple[int, IPAddress, int, memoryview]:
    """(association id, address, port, payload); UdpWireError on anything malformed."""
    view = memoryview(data)
    if len(view) < _HEAD.size:
        raise UdpWireError("short header")
    assoc, port, family = _HEAD.unpack_from(view)
    n = {4: 4, 6: 16}.get(family)
    if n is None or len(view) < _HEAD.size + n:
        raise UdpWireError(f"bad address family {family}")
    raw = bytes(view[_HEAD.size : _HEAD.size + n])
    ip: IPAddress = ipaddress.IPv4Address(raw) if n == 4 else ipaddress.IPv6Address(raw)
    return assoc, ip, port, view[_HEAD.size + n :]


# --------------------------------------------------------------------------- portal side


class PortalUdp:
    """The dialer's UDP egress for one association when the node is in a mesh.

    Same interface as LocalUdpEgress (`sendto`, `close`); destinations with
    no mesh route use a LocalUdpEgress when `mesh.direct_fallback` allows it.
    """

    def __init__(self, hub: UdpHub, on_datagram: OnDatagram, pool: BufferPool, direct: bool) -> None:
        self.hub = hub
        self.assoc = hub.new_id()
        self.sent_to: set[int] = set()  # nodes this association sent to: replies only from them
        self.on_datagram = on_datagram
        self.pool = pool
        # replies as views, written out without a copy (gateway/udp.py sets it); None: each is
        # copied into a pooled buffer for on_datagram
        self.on_view: OnView | None = None
        self.local = LocalUdpEgress(hub.loop, on_datagram, pool) if direct else None
        # target sockaddr -> (address, channel + wire head), and the head -> sockaddr for replies:
        # built once per target, bounded like the NAT table in front of this (cleared when full,
        # rebuilt on use)
        self.heads: dict[tuple[str, int], tuple[IPAddress, bytes]] = {}
        self.replies: dict[bytes, tuple[str, int]] = {}
        self.closed = False
        hub.portals[self.assoc] = self

    def sendto(self, data: bytes | memoryview, sockaddr: tuple[str, int], family: int) -> bool:
        if self.closed:
            return False
        cached = self.heads.get(sockaddr)
        if cached is None:
            cached = self._head(sockaddr)
        ip, prefix = cached
        route = self.hub.mesh.lookup(ip)
        if route is None:
            if self.local is not None and not in_any(ip, self.hub.rules.vnets):
                return self.local.sendto(data, sockaddr, family)
            _DROP_NO_ROUTE.inc()
            return False
        ok: bool = self.hub.mesh.send_datagram_prefixed(route.node_id, prefix, data)
        if ok:
            _SENT.inc()
            if len(self.sent_to) < self.hub.max_targets:
                self.sent_to.add(route.node_id)
        return ok

    def _head(self, sockaddr: tuple[str, int]) -> tuple[IPAddress, bytes]:
        if len(self.heads) >= self.hub.max_targets:
            self.heads.clear()
            self.replies.clear()
        ip = ipaddress.ip_address(sockaddr[0])
        head = encode_head(self.assoc, ip, sockaddr[1])
        cached = self.heads[sockaddr] = (ip, MeshService.datagram_prefix(UDP_CHANNEL, head))
        self.replies[head] = (sockaddr[0], sockaddr[1])
        return cached

    def reply_wire(self, data: memoryview, n: int) -> None:
        """A reply whose wire head is the first `n` bytes of `data` (a view, valid during the call)."""
        addr = self.replies.get(bytes(data[:n]))
        if addr is None:  # not a head we sent (or the table was cleared since): parse it
            _, ip, port, _ = decode(data)
            addr = (str(ip), port)
        view = data[n:]
        try:
            self.reply(addr, view)
        finally:
            view.release()

    def reply(self, addr: tuple[str, int], payload: memoryview) -> None:
        if self.on_view is not None:
            self.on_view(payload, addr)
            return
        buf = self.pool.get()
        try:
            buf.write(payload)
        except ValueError:
            buf.recycle()
            _DROP_BAD.inc()
            return
        self.on_datagram(buf, addr)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.hub.portals.pop(self.assoc, None)
            if self.local is not None:
                self.local.close()


# --------------------------------------------------------------------------- egress side


class _EgressAssoc:
    """One association's NAT state at the egress node.

    Two addresses the portal used may lead to one real target (a node's
    virtual IP and a mapped CIDR can both mean its loopback); replies must go
    back under the address each was sent to, so such a target gets a second
    socket ("slot"): a reply's slot and source say which address it answers.
    """

    __slots__ = ("asked", "by_real", "last", "socks")

    def __init__(self, now: float) -> None:
        self.socks: list[LocalUdpEgress] = []
        # per slot: real source -> the reply's channel and wire head (the address the portal asked for)
        self.by_real: list[dict[tuple[str, int], bytes]] = []
        # the request's wire head after the association id (port, family, address) -> (slot, real, family)
        self.asked: dict[bytes, tuple[int, tuple[str, int], int]] = {}
        self.last = now

    def close(self) -> None:
        for sock in self.socks:
            sock.close()


class UdpHub:
    """Both sides on one node: registered on the mesh's two UDP channels."""

    def __init__(self, config: Config, mesh: MeshService, rules: ExitRules | None = None) -> None:
        self.mesh = mesh
        limits = config.limits
        self.loop: asyncio.AbstractEventLoop = asyncio.get_running_loop()
        # the node's own rules (a reload changes [exit], [serve] and [[acl]] there for both paths)
        self.rules = rules or ExitRules(config)
        self.idle = limits.socks5_udp_idle_timeout
        self.max_assocs = limits.mesh_udp_max_associations
        self.max_targets = limits.socks5_udp_max_targets
        self.pool = BufferPool(capacity=65536, headroom=0, max_free=32)

        self.portals: dict[int, PortalUdp] = {}
        self.egress: dict[tuple[int, int], _EgressAssoc] = {}
        self.mesh.on_datagram_view(UDP_CHANNEL, self._from_portal)
        self.mesh.on_datagram_view(UDP_REPLY_CHANNEL, self._from_egress)
        self._expiry = self.loop.call_later(max(0.05, self.idle / 2), self._expire)

    async def open_portal(self, on_datagram: OnDatagram, pool: BufferPool, direct: bool) -> PortalUdp:
        """One UDP association's egress at the portal (what the mesh dialer's open_udp returns)."""
        return PortalUdp(self, on_datagram, pool, direct)

    # portal -> egress
    def _from_portal(self, src: int, data: memoryview) -> None:
        n = head_len(data)
        if not n:
            _DROP_BAD.inc()
            _rlog.debug("udp-wire", "mesh UDP from %08x: malformed head", src)
            return
        assoc_id = _ASSOC.unpack_from(data)[0]
        now = self.loop.time()
        key = (src, assoc_id)
        entry = self.egress.get(key)
        if entry is None:
            if len(self.egress) >= self.max_assocs:
                _DROP_TABLE.inc()
                _rlog.debug("udp-table", "mesh UDP from %08x: table full (mesh_udp_max_associations)", src)
                return
            entry = self.egress[key] = _EgressAssoc(now)
        entry.last = now
        asked = bytes(data[_ASSOC.size : n])
        target = entry.asked.get(asked) or self._new_target(key, entry, asked, data)
        if target is None:
            return
        slot, real, family = target
        payload = data[n:]
        try:
            if entry.socks[slot].sendto(payload, real, family):
                _RECEIVED.inc()
        finally:
            payload.release()

    def _new_target(
        self, key: tuple[int, int], entry: _EgressAssoc, asked: bytes, data: memoryview
    ) -> tuple[int, tuple[str, int], int] | None:
        _, ip, port, _ = decode(data)  # head_len() checked the head
        asked_port = port
        if ip in self.rules.own_ips:
            served = self.rules.served_target(port)  # only what [serve] publishes
            if served is None:
                _DROP_POLICY.inc()
                _rlog.debug(f"udp-served:{port}", "mesh UDP to %s:%d refused: not published ([serve])",
                            ip, port)
                return None
            real_ip: IPAddress = ipaddress.ip_address(served[0])
            port = served[1]
        else:
            real_ip = self.rules.translate(ip)
            why = self.rules.check(real_ip)
            if why is not None:
                _DROP_POLICY.inc()
                _rlog.debug(f"udp-policy:{real_ip}", "mesh UDP to %s:%d refused: %s", ip, port, why)
                return None
        if self.rules.acl.active:  # [[acl]], by the authenticated source
            dest = None if ip in self.rules.own_ips else real_ip
            src = source_in(self.mesh, key[0], time.time())
            if not self.rules.acl.decide(src, dest, asked_port, "udp").allowed:
                _DROP_ACL.inc()
                _rlog.debug(f"udp-acl:{key[0]}", "access rules: %s (%08x) may not reach %s:%d over udp",
                            src.name or "?", key[0], ip, asked_port)
                return None
        if len(entry.asked) >= self.max_targets:
            _DROP_TARGETS.inc()
            return None
        real = (str(real_ip), port)
        slot = next((i for i, m in enumerate(entry.by_real) if real not in m), len(entry.socks))
        if slot == len(entry.socks):
            entry.socks.append(LocalUdpEgress(self.loop, self._replier(key, slot), self.pool))
            entry.by_real.append({})
        head = encode_head(key[1], ip, port)
        entry.by_real[slot][real] = MeshService.datagram_prefix(UDP_REPLY_CHANNEL, head)
        target = entry.asked[asked] = (slot, real, real_ip.version)
        return target

    def _replier(self, key: tuple[int, int], slot: int) -> OnDatagram:
        return lambda buf, addr: self._reply(key, slot, buf, addr)

    # egress: a reply from a target
    def _reply(self, key: tuple[int, int], slot: int, buf: Buffer, addr: tuple[str, int]) -> None:
        entry = self.egress.get(key)
        prefix = entry.by_real[slot].get(addr) if entry is not None else None
        if prefix is None:
            buf.recycle()
            _DROP_UNKNOWN.inc()
            return
        assert entry is not None
        entry.last = self.loop.time()
        view = buf.view()
        try:
            self.mesh.send_datagram_prefixed(key[0], prefix, view)
        finally:
            view.release()
            buf.recycle()  # the link's batch (or the seal) took its own copy

    # egress -> portal
    def _from_egress(self, src: int, data: memoryview) -> None:
        n = head_len(data)
        if not n:
            _DROP_BAD.inc()
            return
        portal = self.portals.get(_ASSOC.unpack_from(data)[0])
        if portal is None:
            _DROP_UNKNOWN.inc()
            return
        if src not in portal.sent_to:
            # a reply from a node this association never sent to (src is authenticated, the
            # id unguessable): another member injecting into someone's association
            _DROP_WRONG_NODE.inc()
            _rlog.debug(f"udp-wrong:{src}", "mesh UDP reply from %08x for an association that never"
                        " sent to it: dropped", src)
            return
        portal.reply_wire(data, n)

    def new_id(self) -> int:
        """An association id nobody can guess (random, not sequential), unused here."""
        while True:
            i = int.from_bytes(os.urandom(4), "big")
            if i and i not in self.portals:
                return i

    def _expire(self) -> None:
        now = self.loop.time()
        for key, entry in list(self.egress.items()):
            if now - entry.last > self.idle:
                entry.close()
                del self.egress[key]
        self._expiry = self.loop.call_later(max(0.05, self.idle / 2), self._expire)

    def close(self) -> None:
        self._expiry.cancel()
        for entry in self.egress.values():
            entry.close()
        self.egress.clear()
        for portal in list(self.portals.values()):
            portal.close()
