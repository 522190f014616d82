"""The TUN device: the mesh at layer 3 (`[tun] enable = true`).

Packets the kernel routes into the device are read in batches (`loop.add_reader`,
read until EAGAIN or `limits.tun_read_batch`), routed by destination with
`node.mesh.lookup(dst)` (virtual IP, proxy CIDR, exit) and sent as mesh
datagrams on channel `L3_CHANNEL` to the owner node. Datagrams arriving on that
channel are queued and written to the device once per loop tick. No per-packet
await anywhere.

Forwarding, NAT and the egress policy beyond the device are the kernel's job,
set up by meshgate/mesh/tun_routes.py (mapped CIDRs: nftables prefix DNAT, so
no per-packet rewriting here). Packet rules (TTL, ICMP errors, MTU,
fragmentation) live in meshgate/mesh/tun_packets.py.

Offloads: the device is opened with IFF_VNET_HDR and TSO/checksum offloads where
the kernel allows, so a local TCP sender hands over ~60 KB "super-packets" that
cross the mesh whole (channel `L3_VNET_CHANNEL`; a mesh frame holds 64 KB) and
are segmented by the receiving kernel: per-packet Python work is paid once per
super-packet instead of once per 1.4 KB segment.

Bundles: packets one wake-up read for the same node leave as one datagram on
`L3_BUNDLE_CHANNEL` (u16 length + packet each, up to 32 KB, order kept), so the
mesh frames, relays and delivers many small packets (UDP, ACKs) at the cost of one.
No added latency: only packets already read together are bundled. A bundle is no
bigger than what the next hop carries whole (`mesh.datagram_room`): over a udp://
link, one packet's room, since a bundle cut into pieces is lost whole with any one
of them (a 32 KB bundle of 1200-byte packets: ~27 packets lost per lost piece).

Access rules (`[[acl]]`): with any rule, a packet from the mesh that ends here (this node's
virtual IP, or its proxy-CIDR / exit egress) passes only as part of a flow a rule allowed or
this node started, decided by the authenticated source node it was delivered from
(meshgate/mesh/tun_firewall.py); a denied packet is answered with ICMP administratively
prohibited through the mesh (rate-limited). With no rules nothing is tracked or checked.

`TunPath` is the data path over any packet file descriptor (a TUN device, or a
datagram socketpair in tests); `TunService` opens the device, configures
addresses and routes, and keeps proxy-CIDR routes in step with the mesh.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import socket
from collections.abc import Callable
from typing import Any

from meshgate.config import Config, IPNetwork
from meshgate.errors import StartupError
from meshgate.logs import RateLimitedLog
from meshgate.mesh import channels
from meshgate.mesh import tun_packets as tp
from meshgate.mesh import tun_routes as tr
from meshgate.mesh.service import MeshService
from meshgate.mesh.tun_firewall import TRACKED, Access, Budget, Firewall
from meshgate.metrics import REGISTRY, LocalCounter

log = logging.getLogger("meshgate.mesh.tun")
_rlog = RateLimitedLog(log)

L3_CHANNEL = channels.L3  # raw IP packets
L3_VNET_CHANNEL = channels.L3_VNET  # IP packets behind a virtio-net header (TUN offloads: GSO super-packets)
L3_BUNDLE_CHANNEL = channels.L3_BUNDLE  # several packets for one node from one read batch, in one datagram
BUNDLE_MAX = 32768  # bytes per bundle; bigger packets (super-packets) travel alone
_BUNDLE_PLAIN, _BUNDLE_VNET = 0, 1  # bundle format byte: what each item is
ROUTE_SYNC_INTERVAL = 1.0  # seconds between checks of the mesh route table for proxy-CIDR changes
READ_SIZE = 65536
# destinations remembered per route build; exit traffic has many, so the cache is cleared
# when full (a lookup costs microseconds; like the mesh's own lookup cache, of the same size)
ROUTE_CACHE = 4096
# ICMP "administratively prohibited" answers to denied packets, per node: a flood of denied
# packets gets this many answers a second (Linux answers ~1000/s, icmp_msgs_per_sec)
DENY_ICMP_RATE = 100.0
DENY_ICMP_BURST = 50.0

_packets = REGISTRY.counter("meshgate_tun_packets_total", "IP packets through the TUN device",
                            ("direction",))
_bytes = REGISTRY.counter("meshgate_tun_bytes_total", "Bytes of IP packets through the TUN device",
                          ("direction",))
_dropped = REGISTRY.counter("meshgate_tun_dropped_total", "IP packets the TUN path dropped", ("reason",))
_fragmented = REGISTRY.counter("meshgate_tun_fragmented_total",
                               "IPv4 packets without DF split to fit the device MTU")
_icmp = REGISTRY.counter("meshgate_tun_icmp_sent_total", "ICMP errors the TUN path generated", ("kind",))
_acl = REGISTRY.counter("meshgate_tun_acl_total",
                        "TUN packets from the mesh decided by [[acl]]: new flows allowed (by rule), denied",
                        ("verdict", "rule", "proto"))
_ct_flows = REGISTRY.gauge("meshgate_tun_conntrack_flows", "Flows the TUN access rules track")
_ct_evicted = REGISTRY.counter("meshgate_tun_conntrack_evicted_total",
                               "Live tracked flows pushed out of a full table (limits.tun_conntrack_max)")
_routes_gauge = REGISTRY.gauge("meshgate_tun_routes", "Proxy-CIDR routes installed via the TUN device")

_KIND_NAMES = {id(tp.TIME_EXCEEDED): "time_exceeded", id(tp.NO_ROUTE): "no_route",
               id(tp.TOO_BIG): "too_big", id(tp.ADMIN_PROHIBITED): "admin_prohibited"}


class TunPath:
    """Device <-> mesh packet forwarding over a packet fd (non-blocking). No clock, no awaits.

    With `vnet` = 10 the device was opened with IFF_VNET_HDR and TSO/checksum offloads:
    every read starts with a virtio-net header and may hold a TCP "super-packet" of up to
    ~64 KB with a partial checksum. Such packets travel whole, header included, on
    `L3_VNET_CHANNEL` (a mesh frame holds 64 KB; nothing is split in Python) and are
    written whole into the receiver's device, whose kernel segments or delivers them.
    Plain packets (channel `L3_CHANNEL`) get a zero header on the way into such a device.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        fd: int,
        mesh: Any,
        own4: ipaddress.IPv4Address | None,
        own6: ipaddress.IPv6Address | None,
        mtu: int,
        egress: bool,
        read_batch: int = 256,
        write_queue: int = 4096,
        vnet: int = 0,
        firewall: Firewall | None = None,
    ) -> None:
        self.loop = loop
        self.fd = fd
        self.mesh = mesh
        self.own_id: int = mesh.node_id
        self.own4 = own4.packed if own4 else None
        self.own6 = own6.packed if own6 else None
        self.mtu = mtu
        self.egress = egress
        self.read_batch = read_batch
        self.write_queue = write_queue
        self.vnet = vnet
        self.channel = L3_VNET_CHANNEL if vnet else L3_CHANNEL
        # each entry: (packet, True if it lacks the device's virtio-net header)
        self._out: list[tuple[bytes | bytearray | memoryview, bool]] = []
        self._flush_scheduled = False
        self._batch: dict[int, list[bytearray]] = {}  # node -> packets read this wake-up, in order
        self._routes: dict[bytes, int] = {}  # dst -> node id (0: no route); cleared on route changes
        self._routes_version: object = None
        # the payload a datagram to a node carries whole over its next hop (None: any size)
        self._room: Callable[[int], int] | None = getattr(mesh, "datagram_room", None)
        self._running = False
        self.firewall = firewall  # [[acl]] on packets that end here; None: no access rules at all
        self._deny_icmp = Budget(DENY_ICMP_RATE, DENY_ICMP_BURST)
        self._now = 0.0  # loop time of the current device read batch (conntrack deadlines)
        self._out_pkts = LocalCounter(_packets.labels("to_mesh"))
        self._out_bytes = LocalCounter(_bytes.labels("to_mesh"))
        self._in_pkts = LocalCounter(_packets.labels("to_device"))
        self._in_bytes = LocalCounter(_bytes.labels("to_device"))

    def start(self) -> None:
        os.set_blocking(self.fd, False)
        self._running = True
        self.mesh.on_datagram(L3_CHANNEL, self.on_datagram)
        self.mesh.on_datagram(L3_VNET_CHANNEL, self.on_vnet_datagram)
        self.mesh.on_datagram(L3_BUNDLE_CHANNEL, self.on_bundle)
        self.loop.add_reader(self.fd, self.on_readable)

    def stop(self) -> None:
        self._running = False
        with contextlib.suppress(Exception):
            self.loop.remove_reader(self.fd)
        self.mesh.on_datagram(L3_CHANNEL, _ignore)
        self.mesh.on_datagram(L3_VNET_CHANNEL, _ignore)
        self.mesh.on_datagram(L3_BUNDLE_CHANNEL, _ignore)
        self._out.clear()
        for c in (self._out_pkts, self._out_bytes, self._in_pkts, self._in_bytes):
            c.flush()

    # ------------------------------------------------------------ device -> mesh

    def _route_cache(self) -> dict[bytes, int]:
        table = getattr(self.mesh, "table", None)
        version = getattr(table, "version", None)
        if version != self._routes_version or len(self._routes) > ROUTE_CACHE:
            self._routes.clear()  # a new route build (or a bounded cache full): look up again
            self._routes_version = version
        return self._routes

    def on_readable(self) -> None:
        routes = self._route_cache()
        fd = self.fd
        size = READ_SIZE + self.vnet
        n = 0
        nbytes = 0
        if self.firewall is not None:
            self._now = self.loop.time()
        for _ in range(self.read_batch):
            try:
                pkt = os.read(fd, size)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as e:
                _dropped.labels("read_error").inc()
                _rlog.debug("read", "tun: read failed: %s", e)
                break
            if not pkt:
                break
            n += 1
            nbytes += len(pkt)
            self._from_device(pkt, routes)
        if self._batch:
            self._send_batch()
        self._out_pkts.add(n)
        self._out_bytes.add(nbytes)

    def _send_batch(self) -> None:
        """Send what one wake-up read, per destination node: a lone packet as it is, several
        as bundles (one mesh frame, one relay decision and one delivery for many packets)."""
        batch, self._batch = self._batch, {}
        send = self.mesh.send_datagram
        room = self._room
        fmt = _BUNDLE_VNET if self.vnet else _BUNDLE_PLAIN
        for node, pkts in batch.items():
            if len(pkts) == 1:
                if not send(node, self.channel, pkts[0]):
                    _dropped.labels("mesh_refused").inc()  # no route or a congested link
                continue
            limit = BUNDLE_MAX if room is None else max(64, min(BUNDLE_MAX, room(node)))
            bundle = bytearray((fmt,))
            count = 0
            for pkt in pkts:
                n = len(pkt)
                if n + 3 > limit:  # a super-packet (or a packet alone fills the room): alone, in order
                    if count:
                        self._send_bundle(node, bundle, count)
                        bundle, count = bytearray((fmt,)), 0
                    if not send(node, self.channel, pkt):
                        _dropped.labels("mesh_refused").inc()
                    continue
                if len(bundle) + 2 + n > limit:
                    self._send_bundle(node, bundle, count)
                    bundle, count = bytearray((fmt,)), 0
                bundle += n.to_bytes(2, "big")
                bundle += pkt
                count += 1
            if count:
                self._send_bundle(node, bundle, count)

    def _send_bundle(self, node: int, bundle: bytearray, count: int) -> None:
        if count == 1:  # (a small room: one packet per bundle) alone, without the bundle's 3 bytes
            ok = self.mesh.send_datagram(node, self.channel, memoryview(bundle)[3:])
        else:
            ok = self.mesh.send_datagram(node, L3_BUNDLE_CHANNEL, bundle)
        if not ok:
            _dropped.labels("mesh_refused").inc(count)

    def _from_device(self, pkt: bytes, routes: dict[bytes, int]) -> None:
        off = self.vnet
        try:
            p = tp.parse(pkt, off)
        except tp.PacketError as e:
            _dropped.labels("malformed_" + e.reason).inc()
            _rlog.debug("malformed-dev", "tun: malformed packet from the device (%s)", e.reason)
            return
        dst = p.dst
        if dst[0] >= 224 if p.version == 4 else dst[0] == 0xFF:
            # multicast/broadcast (router solicitations, mDNS): the mesh carries unicast only
            _dropped.labels("multicast").inc()
            return
        node = routes.get(dst)
        if node is None:
            route = self.mesh.lookup(ipaddress.ip_address(dst))
            node = route.node_id if route is not None else 0
            routes[dst] = node
        if node == 0 or node == self.own_id:
            # nobody serves it, or the kernel handed us a packet only we could deliver: a loop
            reason = "no_route" if node == 0 else "own_destination"
            _dropped.labels(reason).inc()
            _rlog.debug(f"noroute:{dst.hex()}", "tun: no mesh route to %s (%s)",
                        ipaddress.ip_address(dst), reason)
            self._icmp_local(self._ip(pkt), p, tp.NO_ROUTE)
            return
        if p.ttl <= 1:
            _dropped.labels("ttl_expired").inc()
            self._icmp_local(self._ip(pkt), p, tp.TIME_EXCEEDED, node=node)
            return
        fw = self.firewall
        if fw is not None and fw.on():
            fw.outbound(node, pkt, p, off, self._now)  # its answers may come back in
        buf = bytearray(pkt)
        tp.decrement_ttl(buf, off)  # the mesh is one router hop
        # a GSO super-packet is larger than the MTU by design: its segments are not
        if p.length > self.mtu and not (off and pkt[1] != tp.VNET_GSO_NONE):
            self._too_big(self._ip(buf), p, node, to_mesh=True)
            return
        pkts = self._batch.get(node)
        if pkts is None:
            self._batch[node] = [buf]
        else:
            pkts.append(buf)

    def _ip(self, pkt: bytes | bytearray) -> bytes | bytearray | memoryview:
        """The IP packet without the virtio-net header (error paths only)."""
        return memoryview(pkt)[self.vnet :] if self.vnet else pkt

    def _icmp_local(
        self, pkt: bytes | bytearray | memoryview, p: tp.Packet, kind: Any, mtu: int = 0, node: int = 0
    ) -> None:
        """An ICMP error to a sender on this side of the device, written into the device.

        Its source is never this node's own address: the kernel drops a packet arriving on an
        interface from one of its own addresses (martian source). It comes from the virtual IP
        of the node that owns the route (the mesh "router", as traceroute shows it), else from
        the unreachable destination itself.
        """
        src = self._error_source(p, node)
        err = tp.icmp_error(pkt, p, kind, src, mtu)
        if err is not None:
            _icmp.labels(_KIND_NAMES[id(kind)]).inc()
            self._queue_write(err, True)

    def _error_source(self, p: tp.Packet, node: int) -> bytes:
        if node and node != self.own_id:
            want = f"{node:08x}"
            for r in self.mesh.routes():  # error path only: a scan is fine
                if r.get("id") == want:
                    text = r.get("ipv4" if p.version == 4 else "ipv6")
                    if text:
                        return ipaddress.ip_address(text).packed
                    break
        return p.dst

    def _too_big(self, ip: bytes | bytearray | memoryview, p: tp.Packet, node: int, to_mesh: bool) -> None:
        """A packet (`ip`: no virtio header) larger than the device MTU: fragment (IPv4
        without DF) or answer with ICMP."""
        if not p.dont_fragment:
            try:
                frags = tp.fragment_v4(ip, p, self.mtu)
            except tp.PacketError as e:
                _dropped.labels("too_big_" + e.reason).inc()
                return
            _fragmented.inc()
            for f in frags:
                if to_mesh:
                    self.mesh.send_datagram(node, L3_CHANNEL, f)
                else:
                    self._queue_write(f, True)
            return
        _dropped.labels("too_big").inc()
        _rlog.debug(f"toobig:{p.src.hex()}", "tun: %d-byte packet from %s exceeds MTU %d; ICMP sent",
                    p.length, ipaddress.ip_address(p.src), self.mtu)
        if to_mesh:
            self._icmp_local(ip, p, tp.TOO_BIG, self.mtu, node=node)
            return
        # from the mesh: the sender is behind node `node`; answer it there
        src = self.own4 if p.version == 4 else self.own6
        err = tp.icmp_error(ip, p, tp.TOO_BIG, src, self.mtu) if src is not None else None
        if err is not None:
            _icmp.labels("too_big").inc()
            self.mesh.send_datagram(node, L3_CHANNEL, err)

    # ------------------------------------------------------------ mesh -> device

    def on_datagram(self, src_node: int, payload: bytes) -> None:
        """A plain IP packet (channel L3_CHANNEL)."""
        p = self._accept(src_node, payload, 0)
        if p is None:
            return
        if p.length > self.mtu:
            self._too_big(payload, p, src_node, to_mesh=False)
            return
        self._queue_write(payload, True)

    def on_vnet_datagram(self, src_node: int, payload: bytes) -> None:
        """A virtio-net header + IP packet (channel L3_VNET_CHANNEL), possibly a GSO super-packet."""
        if len(payload) < tp.VNET_HDR_LEN:
            _dropped.labels("malformed_short_vnet").inc()
            return
        p = self._accept(src_node, payload, tp.VNET_HDR_LEN)
        if p is None:
            return
        offloaded = payload[1] != tp.VNET_GSO_NONE
        if not offloaded and p.length > self.mtu:
            self._too_big(memoryview(payload)[tp.VNET_HDR_LEN :], p, src_node, to_mesh=False)
            return
        if self.vnet:
            self._queue_write(payload, False)
        elif offloaded or payload[0] & tp.VNET_F_NEEDS_CSUM:
            # this device has no offloads: a super-packet or partial checksum cannot go in as is
            _dropped.labels("offload_unsupported").inc()
            _rlog.debug(f"vnet:{src_node}", "tun: offloaded packet from node %08x, device has no offloads",
                        src_node)
        else:
            self._queue_write(memoryview(payload)[tp.VNET_HDR_LEN :], True)

    def on_bundle(self, src_node: int, payload: bytes) -> None:
        """Several packets in one datagram (L3_BUNDLE_CHANNEL): format byte, then u16 length + packet."""
        if not payload or payload[0] not in (_BUNDLE_PLAIN, _BUNDLE_VNET):
            _dropped.labels("malformed_bundle").inc()
            return
        one = self.on_vnet_datagram if payload[0] == _BUNDLE_VNET else self.on_datagram
        view = memoryview(payload)
        pos, end = 1, len(payload)
        while pos < end:
            if pos + 2 > end:
                _dropped.labels("malformed_bundle").inc()
                return
            n = (payload[pos] << 8) | payload[pos + 1]
            pos += 2
            if pos + n > end:
                _dropped.labels("malformed_bundle").inc()
                _rlog.debug(f"bundle:{src_node}", "tun: truncated bundle from node %08x", src_node)
                return
            one(src_node, view[pos : pos + n])  # type: ignore[arg-type]  # bytes-like is enough
            pos += n

    def _accept(self, src_node: int, payload: bytes, off: int) -> tp.Packet | None:
        try:
            p = tp.parse(payload, off)
        except tp.PacketError as e:
            _dropped.labels("malformed_" + e.reason).inc()
            _rlog.debug(f"malformed:{src_node}", "tun: malformed packet from node %08x (%s)", src_node,
                        e.reason)
            return None
        dst = p.dst
        if not (dst == self.own4 or dst == self.own6 or self.egress):
            # a node that serves no proxy CIDR and no exit forwards nothing for others
            _dropped.labels("not_ours").inc()
            _rlog.debug(f"notours:{src_node}", "tun: node %08x sent a packet for %s, which this node does"
                        " not serve", src_node, ipaddress.ip_address(dst))
            return None
        fw = self.firewall
        if fw is not None and fw.on():
            verdict, proto, port = fw.inbound(src_node, payload, p, off, self.loop.time())
            if verdict is None:
                self._deny(src_node, payload, p, off, proto, port)
                return None
            if verdict != TRACKED:
                _acl.labels("new", str(verdict), proto).inc()
        return p

    def _deny(self, src_node: int, payload: bytes, p: tp.Packet, off: int, proto: str, port: int) -> None:
        """No rule allows it: counted, logged (rate-limited), and answered with ICMP
        administratively prohibited to the sender, through the mesh to the node it came from."""
        _acl.labels("denied", "none", proto).inc()
        rec = getattr(getattr(self.mesh, "table", None), "records", {}).get(src_node)
        _rlog.debug(f"acl:{src_node}", "tun: access rules: node %s (%08x) may not reach %s:%d over %s",
                    getattr(rec, "name", "?") or "?", src_node, ipaddress.ip_address(p.dst), port, proto)
        if not self._deny_icmp.take(self.loop.time()):
            _dropped.labels("acl_icmp_rate").inc()
            return
        ip = memoryview(payload)[off:] if off else payload
        own = self.own4 if p.version == 4 else self.own6
        err = tp.icmp_error(ip, p, tp.ADMIN_PROHIBITED, own if own is not None else p.dst)
        if err is not None:
            _icmp.labels("admin_prohibited").inc()
            self.mesh.send_datagram(src_node, L3_CHANNEL, err)

    def _queue_write(self, pkt: bytes | bytearray | memoryview, plain: bool) -> None:
        if len(self._out) >= self.write_queue:
            _dropped.labels("write_queue_full").inc()
            _rlog.debug("wq", "tun: write queue full (limits.tun_write_queue = %d)", self.write_queue)
            return
        self._out.append((pkt, plain))
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self.loop.call_soon(self._flush)

    def _flush(self) -> None:
        """Write what this loop tick produced (one write per packet: a TUN takes one packet per write)."""
        self._flush_scheduled = False
        out, self._out = self._out, []
        if not self._running:
            return
        fd = self.fd
        zero = (tp.VNET_ZERO,) if self.vnet else ()
        nbytes = 0
        sent = 0
        for pkt, plain in out:
            try:
                if plain and zero:
                    os.writev(fd, (*zero, pkt))  # one packet: header and body gathered by the kernel
                else:
                    os.write(fd, pkt)
            except BlockingIOError:
                _dropped.labels("device_busy").inc()
                continue
            except OSError as e:
                _dropped.labels("write_error").inc()
                _rlog.debug("write", "tun: write failed: %s", e)
                continue
            sent += 1
            nbytes += len(pkt)
        self._in_pkts.add(sent)
        self._in_bytes.add(nbytes)


def _ignore(_src: int, _payload: bytes) -> None:
    _dropped.labels("stopped").inc()


# --------------------------------------------------------------------------- the service


def remote_cidrs(routes: list[dict[str, Any]], own_id: str, own: list[IPNetwork]) -> set[IPNetwork]:
    """Proxy CIDRs of reachable other nodes that deserve an OS route via the TUN."""
    out: set[IPNetwork] = set()
    for r in routes:
        if r.get("id") == own_id:
            continue
        for text in r.get("proxy_cidrs", ()):
            try:
                net = ipaddress.ip_network(text)
            except ValueError:
                continue
            if net.prefixlen == 0:
                continue  # a default route is what exit_nodes is for (its own table and rules)
            if any(net.version == o.version and net.subnet_of(o) for o in own):  # type: ignore[arg-type]
                continue  # our own CIDR serves it
            out.add(net)
    return out


class TunService:
    name = "tun"

    def __init__(
        self, config: Config, mesh: MeshService | None,
        opener: Callable[[str], tuple[Any, int, int]] | None = None,
        access: Access | None = None,
    ) -> None:
        self.mesh = mesh
        self.access = access  # [[acl]] (egress/acl.py PacketAccess); None: no rules ever checked
        self.cfg: Config = config
        self.tun_name = self.cfg.tun.name
        self.net = tr.NetConfig(self.cfg.state_path / f"tun-{self.tun_name}.json")
        self.opener = opener or _open_tun
        self.device: Any = None
        self.vnet = 0
        self.path: TunPath | None = None
        self.routes: dict[IPNetwork, tuple[tr.Command, tr.Command]] = {}
        self.notes: list[str] = []
        self._sync_task: asyncio.Task[None] | None = None
        self._sync_version: object = None
        self._evicted = 0  # conntrack evictions already counted

    async def start(self) -> None:
        cfg = self.cfg
        mesh = self.mesh
        if mesh is None:
            raise StartupError("tun.enable: the TUN device needs the mesh (set node.ipv4 or mesh.peers)")
        if cfg.node.ipv4 is None and cfg.node.ipv6 is None:
            raise StartupError("tun.enable: the TUN device needs node.ipv4 or node.ipv6")
        recovered = await self.net.recover()
        if recovered:
            self.notes.append(f"undid {recovered} route/firewall changes left by a previous run")
        try:
            self.device, fd, self.vnet = self.opener(self.tun_name)
        except Exception as e:  # pytun.Error, OSError: no /dev/net/tun, no CAP_NET_ADMIN, name taken
            raise StartupError(f"tun.name: cannot create TUN device {self.tun_name!r}: {e}") from None
        try:
            await self._configure_device()
            self.path = TunPath(
                asyncio.get_running_loop(), fd, mesh,
                cfg.node.ipv4.ip if cfg.node.ipv4 else None, cfg.node.ipv6.ip if cfg.node.ipv6 else None,
                cfg.tun.mtu, tr.is_egress(cfg), cfg.limits.tun_read_batch, cfg.limits.tun_write_queue,
                self.vnet,
                Firewall(self.access, cfg.limits.tun_conntrack_max) if self.access is not None else None,
            )
            if tr.is_egress(cfg):
                # the policy first, then forwarding on: no moment of forwarding without the policy
                table = tr.nft_table_name(self.tun_name)
                await self.net.nft_load(table, tr.egress_ruleset(self.tun_name, cfg))
                for path, value in tr.egress_sysctls(cfg).items():
                    self.net.set_sysctl(path, value)
            self.path.start()
            if cfg.mesh.exit_nodes:
                for do, undo in tr.exit_plan(self.tun_name, await _peer_addresses(cfg)):
                    await self.net.apply(do, undo)
            await self._sync_routes()
        except BaseException as e:
            await self.stop()
            if isinstance(e, tr.NetConfigError | OSError):
                raise StartupError(f"tun: cannot configure {self.tun_name}: {e}") from None
            raise
        self._sync_task = asyncio.get_running_loop().create_task(self._sync_loop())

    async def _configure_device(self) -> None:
        cfg, t = self.cfg, self.tun_name
        run = self.net.run
        steps: list[tr.Command] = [("ip", "link", "set", "dev", t, "mtu", str(cfg.tun.mtu))]
        if self.vnet:
            steps.append(("ip", "link", "set", "dev", t, "gso_max_size", str(gso_max_size(cfg))))
        if cfg.node.ipv4 is not None:
            steps.append(("ip", "-4", "addr", "add", str(cfg.node.ipv4), "dev", t))
        if cfg.node.ipv6 is not None:
            steps.append(("ip", "-6", "addr", "add", str(cfg.node.ipv6), "dev", t, "nodad"))
        steps.append(("ip", "link", "set", "dev", t, "up"))
        for cmd in steps:
            rc, err = await run(cmd, None)
            if rc != 0:
                raise tr.NetConfigError(f"{' '.join(cmd)}: {err}")

    async def _sync_loop(self) -> None:
        while True:
            await asyncio.sleep(ROUTE_SYNC_INTERVAL)
            try:
                await self._sync_routes()
            except Exception:
                log.exception("tun: route sync failed")
            self._publish_conntrack()

    def _publish_conntrack(self) -> None:
        fw = self.path.firewall if self.path is not None else None
        if fw is None:
            return
        _ct_flows.set(len(fw))
        if fw.evicted > self._evicted:
            _ct_evicted.inc(fw.evicted - self._evicted)
        self._evicted = fw.evicted

    async def _sync_routes(self) -> None:
        mesh = self.mesh
        assert mesh is not None  # start() refused a node without the mesh
        version = getattr(getattr(mesh, "table", None), "version", None)
        if version is not None and version == self._sync_version:
            return
        self._sync_version = version
        own = [c.advertised for c in self.cfg.mesh.proxy_cidrs] + [c.real for c in self.cfg.mesh.proxy_cidrs]
        want = remote_cidrs(mesh.routes(), mesh.node_id_text, own)
        for net in sorted(set(self.routes) - want, key=str):
            _do, undo = self.routes.pop(net)
            await self.net.revert(undo)
            log.info("tun: removed route %s (no longer advertised)", net)
        for net in sorted(want - set(self.routes), key=str):
            do, undo = tr.cidr_route(self.tun_name, net)
            try:
                await self.net.apply(do, undo)
            except tr.NetConfigError as e:
                _rlog.warning(f"route:{net}", "tun: cannot route %s via %s: %s", net, self.tun_name, e)
                continue
            self.routes[net] = (do, undo)
            log.info("tun: route %s via %s", net, self.tun_name)
        _routes_gauge.set(len(self.routes))

    async def stop(self) -> None:
        if self._sync_task is not None:
            self._sync_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sync_task
            self._sync_task = None
        if self.path is not None:
            self.path.stop()
            self.path = None
        await self.net.teardown()
        self.routes.clear()
        _routes_gauge.set(0)
        if self.device is not None:
            with contextlib.suppress(Exception):
                self.device.close()
            self.device = None

    def status(self) -> dict[str, Any]:
        return {
            "device": self.tun_name,
            "mtu": self.cfg.tun.mtu,
            "offload": bool(self.vnet),
            "routes": sorted(str(n) for n in self.routes),
            "exit": bool(self.cfg.mesh.exit_nodes),
            "egress": tr.is_egress(self.cfg),
            "notes": list(self.notes),
            "acl": bool(self.access is not None and self.access.active),
            "conntrack_flows": len(self.path.firewall) if self.path and self.path.firewall else 0,
        }


async def _peer_addresses(cfg: Config) -> list[str]:
    """IP addresses of the configured mesh peers (names resolved once, at start)."""
    loop = asyncio.get_running_loop()
    out: list[str] = []
    for url in cfg.mesh.peers:
        if url.scheme == "ring":
            continue
        try:
            infos = await loop.getaddrinfo(url.host, url.port, type=socket.SOCK_STREAM)
        except OSError as e:
            log.warning("tun: cannot resolve mesh peer %s (%s); it gets no bypass rule", url.host, e)
            continue
        out.extend(str(info[4][0]) for info in infos)
    return out


TUNSETOFFLOAD = 0x400454D0
TUN_F_CSUM, TUN_F_TSO4, TUN_F_TSO6, TUN_F_TSO_ECN = 0x01, 0x02, 0x04, 0x08
GSO_MAX_SIZE = 60000  # a super-packet plus headers must fit one mesh frame (64 KB)
# With udp:// links a super-packet crosses a link in ~1.4 KB pieces and is lost whole when one
# piece is: 32 KB (24 pieces) instead of 60 KB (43) halves that loss amplification. iperf3 over
# udp links, 0.5% random packet loss: 48-49 MB/s at 32 KB, 44-51 at 16 KB, 15-16 at 60 KB; without
# loss the same MB/s within noise (86-92, 81-82, 81-100), 16 KB costing the most CPU per byte.
# TCP links carry a super-packet in one record and lose ~25% MB/s at 16 KB: they keep 60 KB.
UDP_LINK_GSO_MAX_SIZE = 32768


def gso_max_size(cfg: Config) -> int:
    """The device's largest super-packet: smaller when the node has any udp:// link that
    carries big datagrams in pieces (limits.udp_link_fragment_datagrams)."""
    urls = (*cfg.mesh.listen, *cfg.mesh.peers)
    udp = any(u.scheme == "udp" for u in urls) and cfg.limits.udp_link_fragment_datagrams
    return UDP_LINK_GSO_MAX_SIZE if udp else GSO_MAX_SIZE


def _open_tun(name: str) -> tuple[Any, int, int]:
    """Open the device with TSO/checksum offloads (virtio-net header) if the kernel allows,
    else plain. Returns (device, fd, virtio header length: 10 or 0)."""
    import fcntl

    import pytun  # Linux only; imported here so the module loads anywhere

    dev = pytun.TunTapDevice(name=name, flags=pytun.IFF_TUN | pytun.IFF_NO_PI | pytun.IFF_VNET_HDR)
    try:
        fcntl.ioctl(dev.fileno(), TUNSETOFFLOAD, TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO6 | TUN_F_TSO_ECN)
        return dev, dev.fileno(), tp.VNET_HDR_LEN
    except OSError as e:
        log.info("tun: no TSO offload on %s (%s); one packet per read", name, e.strerror)
        dev.close()
    dev = pytun.TunTapDevice(name=name, flags=pytun.IFF_TUN | pytun.IFF_NO_PI)
    return dev, dev.fileno(), 0

