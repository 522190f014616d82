"""Access rules on TUN packets: flow keys, connection tracking, an ICMP budget. Sans-I/O.

The node that terminates a TUN packet from the mesh (its own virtual IP, or the
proxy-CIDR / exit egress) decides by the *authenticated source node* the mesh
delivered it from (a relayed datagram is opened with the end-to-end session of
its source, a direct one came over a link whose HELLO proved the peer: see
MeshService._deliver), never by the packet's source address alone: a member
writing another member's virtual IP into its packets is still itself.

Nebula's firewall model: rules allow *new* flows; a flow once allowed, and every
flow this node itself started (a packet it sent into the mesh), is remembered in
a bounded connection-tracking table so its packets in the other direction pass
without the rules. Keys are the inbound 5-tuple *and the node*, so a reply is
accepted only from the node the flow was with:

    (node, proto, remote addr, remote port, local addr, local port)

TCP and UDP use their ports; ICMP echo uses its identifier as both ports (an
echo reply matches the request that went out); an ICMP error is "related" and
passes when the packet it quotes belongs to a tracked flow. A non-first IPv4
fragment has no ports (0): it passes only a rule without a port list, as in
Nebula. IPv6 extension headers are not walked (the first next-header counts).

Two tables, each half of `max_flows`: the flows this node started, and the flows a rule
let in. A flood of new flows from a member some rule allows cannot push the node's own flows
out, and when the rules change (a reload) the second table is emptied, so every flow a rule
let in is decided again by the new rules at its next packet from the mesh (Nebula re-checks
its conntrack on reload too); the node's own flows stay. A forgotten flow whose local end
sends first is taken as the node's own, as any untracked packet going out is.

Timeouts are Nebula's defaults: TCP 12 minutes, UDP 3 minutes, ICMP (and any
other protocol) 10 seconds, refreshed by traffic in either direction (at most
once a second per flow). The hot path: a packet of the same flow as the previous one
each way is a tuple compare, any other one or two dict lookups. Each table is an LRU;
a full one evicts its least recently refreshed flow (counted), so a flood of new flows
costs old idle ones their entry, never memory.

What a packet is decided with (`Access.decide`) is injected: the rules and the
identity of nodes live above the mesh (meshgate/egress/acl.py, PacketAccess).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Protocol

from meshgate.mesh import tun_packets as tp

TCP_TIMEOUT = 12 * 60.0
UDP_TIMEOUT = 3 * 60.0
ICMP_TIMEOUT = 10.0
REFRESH = 1.0  # a flow's deadline moves (and it becomes most recent) at most this often
PURGE_PER_INSERT = 4  # expired entries at the LRU end dropped per new entry (amortised clean-up)

TRACKED = -2  # `Firewall.inbound`: allowed as part of a tracked flow (no rule consulted)
NO_RULES = -1  # `Access.decide`: allowed because the node has no rules at all

_ICMP4_ECHO = (0, 8)
_ICMP6_ECHO = (128, 129)
_ICMP4_ERRORS = frozenset((3, 4, 5, 11, 12))
_ICMP6_ERRORS = frozenset((1, 2, 3, 4))
_TIMEOUTS = {tp.PROTO_TCP: TCP_TIMEOUT, tp.PROTO_UDP: UDP_TIMEOUT}

FlowKey = tuple[int, int, bytes, int, bytes, int]  # node, proto, remote, rport, local, lport


class Access(Protocol):
    """The node's rules, by authenticated source (egress/acl.py PacketAccess)."""

    @property
    def active(self) -> bool:
        """False with no [[acl]] at all: every packet passes, nothing is tracked."""
        ...

    @property
    def version(self) -> object:
        """Another object once the rules changed: flows they let in are decided again."""
        ...

    def decide(self, node: int, dst: bytes, port: int, proto: str) -> int | None:
        """The index of the rule that lets `node` reach `dst` (4/16 bytes) at `port` over
        `proto` ("tcp", "udp", "icmp" or "other"), NO_RULES, or None: denied."""
        ...


def proto_name(proto: int) -> str:
    if proto == tp.PROTO_TCP:
        return "tcp"
    if proto == tp.PROTO_UDP:
        return "udp"
    if proto in (tp.PROTO_ICMP, tp.PROTO_ICMPV6):
        return "icmp"
    return "other"


def ports(pkt: bytes | bytearray | memoryview, p: tp.Packet, off: int = 0) -> tuple[int, int] | None:
    """(source port, destination port) of the packet at `pkt[off:]`: TCP/UDP ports, the echo
    identifier twice for ICMP echo, (0, 0) for anything without ports (a non-first fragment,
    a truncated header, other protocols). None for an ICMP error (see `quoted_key`)."""
    if not p.first_fragment:
        return (0, 0)
    t = off + p.header_len
    proto = p.proto
    if proto == tp.PROTO_TCP or proto == tp.PROTO_UDP:
        if p.length - p.header_len < 4:
            return (0, 0)
        return ((pkt[t] << 8) | pkt[t + 1], (pkt[t + 2] << 8) | pkt[t + 3])
    if proto == tp.PROTO_ICMP or proto == tp.PROTO_ICMPV6:
        if p.length - p.header_len < 8:
            return (0, 0)
        kind = pkt[t]
        if kind in (_ICMP4_ERRORS if proto == tp.PROTO_ICMP else _ICMP6_ERRORS):
            return None
        if kind in (_ICMP4_ECHO if proto == tp.PROTO_ICMP else _ICMP6_ECHO):
            ident = (pkt[t + 4] << 8) | pkt[t + 5]
            return (ident, ident)
    return (0, 0)


def inbound_key(node: int, pkt: bytes | bytearray | memoryview, p: tp.Packet, off: int = 0
                ) -> FlowKey | None:
    """The flow a packet from the mesh belongs to (None: an ICMP error, see `quoted_key`)."""
    pp = ports(pkt, p, off)
    if pp is None:
        return None
    return (node, p.proto, p.src, pp[0], p.dst, pp[1])


def outbound_key(node: int, pkt: bytes | bytearray | memoryview, p: tp.Packet, off: int = 0
                 ) -> FlowKey | None:
    """The key the *answers* to a packet this node sends to `node` will have."""
    pp = ports(pkt, p, off)
    if pp is None:
        return None  # an ICMP error this node sends starts no flow
    return (node, p.proto, p.dst, pp[1], p.src, pp[0])


def quoted_key(node: int, pkt: bytes | bytearray | memoryview, p: tp.Packet, off: int = 0
               ) -> FlowKey | None:
    """For an ICMP error from the mesh: the key of the flow of the packet it quotes (which
    this node sent), or None when the quote is not a whole IP header plus 8 bytes."""
    inner_off = off + p.header_len + 8
    try:
        q = tp.parse_quote(pkt, inner_off, off + p.length)
    except tp.PacketError:
        return None
    pp = ports(pkt, q, inner_off)
    if pp is None:
        return None  # an error about an error: never sent (RFC 1122), never related
    return (node, q.proto, q.dst, pp[1], q.src, pp[0])


class ConnTrack:
    """Bounded LRU of flows -> deadline (loop time). `now` is passed in: no clock here."""

    def __init__(self, max_flows: int) -> None:
        self.max_flows = max(1, max_flows)
        self._flows: OrderedDict[FlowKey, float] = OrderedDict()
        self.evicted = 0  # live flows pushed out by a full table
        self.expired = 0

    def __len__(self) -> int:
        return len(self._flows)

    def hit(self, key: FlowKey, now: float) -> bool:
        """Whether `key` is a live flow; refreshes it."""
        deadline = self._flows.get(key)
        if deadline is None:
            return False
        if deadline < now:
            del self._flows[key]
            self.expired += 1
            return False
        timeout = _TIMEOUTS.get(key[1], ICMP_TIMEOUT)
        if deadline - now < timeout - REFRESH:
            self._flows[key] = now + timeout
            self._flows.move_to_end(key)
        return True

    def add(self, key: FlowKey, now: float) -> None:
        """Remember (or refresh) a flow."""
        flows = self._flows
        if key in flows:
            self.hit(key, now)
            if key in flows:
                return
        for _ in range(PURGE_PER_INSERT):
            if not flows:
                break
            oldest = next(iter(flows))
            if flows[oldest] >= now:
                break
            del flows[oldest]
            self.expired += 1
        if len(flows) >= self.max_flows:
            flows.popitem(last=False)
            self.evicted += 1
        flows[key] = now + _TIMEOUTS.get(key[1], ICMP_TIMEOUT)

    def clear(self) -> None:
        self._flows.clear()


class Budget:
    """A token bucket: `rate` events a second, bursts of `burst` (ICMP errors this node sends)."""

    def __init__(self, rate: float, burst: float) -> None:
        self.rate = rate
        self.burst = burst
        self._tokens = burst
        self._at: float | None = None

    def take(self, now: float) -> bool:
        if self._at is not None:
            self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
        self._at = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        return False


class Firewall:
    """The rules plus connection tracking, for one TUN path."""

    def __init__(self, access: Access, max_flows: int) -> None:
        self.access = access
        self.own = ConnTrack(max(1, max_flows // 2))  # flows this node started
        self.allowed = ConnTrack(max(1, max_flows // 2))  # flows a rule let in
        self._rules = access.version
        self._active = access.active
        self.rechecks = 0  # rule changes that emptied `allowed`
        # The flow of the last packet each way, live until the time beside it: a bulk flow's
        # packets skip both tables (a tuple compare instead of dict work; REFRESH is far
        # shorter than any timeout, so a flow seen here is still alive)
        self._last_out: FlowKey | None = None
        self._last_out_until = 0.0
        self._last_in: FlowKey | None = None
        self._last_in_until = 0.0

    def __len__(self) -> int:
        return len(self.own) + len(self.allowed)

    @property
    def evicted(self) -> int:
        return self.own.evicted + self.allowed.evicted

    def on(self) -> bool:
        """Whether the node has rules (ask before `inbound`/`outbound`, once per packet): a
        rule change is noticed here, and forgets the flows old rules let in."""
        version = self.access.version
        if version is not self._rules:
            self._rules = version
            self._active = self.access.active
            self.allowed.clear()
            self._last_in = self._last_out = None
            self.rechecks += 1
        return self._active

    def outbound(self, node: int, pkt: bytes | bytearray | memoryview, p: tp.Packet, off: int,
                 now: float) -> None:
        """A packet this node sends into the mesh to `node`: its answers may come back (an
        answer within a flow a rule let in refreshes that flow, and stays subject to the rules)."""
        proto = p.proto
        if (proto == tp.PROTO_TCP or proto == tp.PROTO_UDP) and p.first_fragment \
                and p.length >= p.header_len + 4:
            # the common case inline (as `outbound_key`): ~0.2 us a packet less (timeit)
            t = off + p.header_len
            key: FlowKey | None = (node, proto, p.dst, (pkt[t + 2] << 8) | pkt[t + 3], p.src,
                                   (pkt[t] << 8) | pkt[t + 1])
        else:
            key = outbound_key(node, pkt, p, off)
        if key is not None:
            if key == self._last_out and now < self._last_out_until:
                return
            if not self.allowed.hit(key, now):
                self.own.add(key, now)
            self._last_out, self._last_out_until = key, now + REFRESH

    def inbound(self, node: int, pkt: bytes | bytearray | memoryview, p: tp.Packet, off: int,
                now: float) -> tuple[int | None, str, int]:
        """A packet from `node` (authenticated) that ends here: (verdict, proto, port). The
        verdict is TRACKED, a rule index (a new flow, now tracked), NO_RULES, or None (denied)."""
        proto = p.proto
        if (proto == tp.PROTO_TCP or proto == tp.PROTO_UDP) and p.first_fragment \
                and p.length >= p.header_len + 4:
            # the common case inline (as `inbound_key`): ~0.2 us a packet less (timeit)
            t = off + p.header_len
            key: FlowKey | None = (node, proto, p.src, (pkt[t] << 8) | pkt[t + 1], p.dst,
                                   (pkt[t + 2] << 8) | pkt[t + 3])
        else:
            key = inbound_key(node, pkt, p, off)
        if key is None:  # an ICMP error: only about a flow this node has
            related = quoted_key(node, pkt, p, off)
            ok = related is not None and (self.own.hit(related, now) or self.allowed.hit(related, now))
            return (TRACKED if ok else None), "icmp", 0
        if key == self._last_in and now < self._last_in_until:
            return TRACKED, "", 0
        if self.own.hit(key, now) or self.allowed.hit(key, now):
            self._last_in, self._last_in_until = key, now + REFRESH
            return TRACKED, "", 0
        name = proto_name(proto)
        port = key[5] if name != "icmp" else 0
        verdict = self.access.decide(node, p.dst, port, name)
        if verdict is not None:
            self.allowed.add(key, now)
        return verdict, name, port
