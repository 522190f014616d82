"""Sans-I/O link-state routing: records, anti-entropy sync, graph build, lookup.

Each node originates one `Record` (its addresses, proxy CIDRs, exit offer and
neighbours with measured latency). Records flood to every neighbour; per
neighbour the table remembers which version it acknowledged and sends only
what is newer (anti-entropy). A link coming up resets that neighbour's state,
so a restarted node (new session) gets everything again. Records of nodes no
longer reachable expire after `expiry` seconds.

One graph build (edges only where both ends list each other) walks the least-hop
paths (ties by latency) in hop layers; the least-latency paths (a Dijkstra on the
same adjacency) are walked when first asked for after the build.
A record whose content did not change bumps its version but triggers no build.

No sockets, no clock: callers pass `now` (seconds, monotonic) where time matters.
"""

from __future__ import annotations

import functools
import heapq
import ipaddress
import itertools
import logging
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from meshgate.logs import RateLimitedLog
from meshgate.metrics import REGISTRY

log = logging.getLogger("meshgate.mesh.routing")
_rlog = RateLimitedLog(log)

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

_dropped = REGISTRY.counter(
    "meshgate_mesh_route_records_dropped_total", "Route records not stored", ("reason",)
)
_duplicates = REGISTRY.counter(
    "meshgate_mesh_duplicate_total", "Conflicting claims seen in route records", ("kind",)
)
_builds = REGISTRY.counter("meshgate_mesh_route_builds_total", "Route graph builds")
_expired = REGISTRY.counter(
    "meshgate_mesh_route_records_expired_total",
    "Route records dropped here because their origin stayed unreachable (neighbours are told: FORGOTTEN)",
).labels()
_forgotten = REGISTRY.counter(
    "meshgate_mesh_route_forgotten_total",
    "FORGOTTEN acknowledgements from neighbours, by what this node did: sent_again (it reaches the "
    "origin) or gone_here (it does not either)", ("result",),
)

MAX_CANDIDATES = 4  # received versions of one origin held for checking at once
UNKNOWN_LATENCY_US = 500_000  # an edge whose latency was never measured costs 500 ms
# Links are reliable and in order, so an acknowledgement that is late sits behind a busy peer (a
# mesh forming), and sending again only adds copies it must read. So nothing is sent again while
# acknowledgements of earlier sends keep coming back within the resend interval; past it, the
# interval doubles with every resend, up to this, until the neighbour has acknowledged everything
# sent. Nor is anything sent again sooner than twice the longest an acknowledgement on that link
# took (a neighbour busy once is busy again while the mesh forms). What a closed link may have lost
# is sent again at once (link_lost); a live link loses a frame only when its receiver drops it as
# forged (a byte pipe tampered with): the resend is the net for that. A udp:// link retransmits
# itself and closes when a queue overflows; a restarted neighbour comes up anew (neighbour_up).
RESEND_MAX = 48.0
# An acknowledgement of version 0 (versions start at the origin's clock in ms, so none is 0): "I
# hold no record of this origin", sent when a node expires one. The neighbour would otherwise
# keep it as acknowledged and never send it again, even after the node learns the origin is
# reachable after all (a slow formation brings the record of the origin's link partner after the
# expiry): that node then has no route to it until the origin makes a new version.
FORGOTTEN = 0

_HEAD = struct.Struct("!IIQBB")  # origin, session, version, flags, name length
_NEIGH = struct.Struct("!II")  # neighbour id, latency µs
_F_EXIT = 0x01
_F_V4 = 0x02
_F_V6 = 0x04
_F_DNS = 0x08  # DNS suffixes follow the certificate (dns.serve_suffixes; PROTOCOL.md section 4)
_F_PROCESS = 0x10  # the origin reads a process in end-to-end message 1 (e2e.PROCESS; section 11)
MAX_DNS_SUFFIXES = 16


class RecordError(ValueError):
    pass


@dataclass(frozen=True)
class Record:
    origin: int
    session: int
    version: int
    name: str = ""
    ipv4: ipaddress.IPv4Interface | None = None
    ipv6: ipaddress.IPv6Interface | None = None
    cidrs: tuple[tuple[IPNetwork, bool], ...] = ()  # (advertised network, is mapped)
    exit: bool = False
    neighbours: tuple[tuple[int, int], ...] = ()  # (node id, latency µs), sorted
    key: bytes = b""  # the origin's public key (identity.py), 64 bytes
    cert: bytes = b""  # the origin's node certificate (certificate mode), else empty
    signature: bytes = b""  # the origin's Ed25519 signature of `signed_part`
    dns: tuple[str, ...] = ()  # DNS suffixes the origin answers for (lowercase, trailing dot)
    reads_process: bool = False  # _F_PROCESS: message 1 to it may say which process of ours it is

    def same_content(self, other: Record) -> bool:
        return (
            self.name == other.name and self.ipv4 == other.ipv4 and self.ipv6 == other.ipv6
            and self.cidrs == other.cidrs and self.exit == other.exit and self.neighbours == other.neighbours
            and self.key == other.key and self.cert == other.cert and self.dns == other.dns
            and self.reads_process == other.reads_process
        )

    def encode(self) -> bytes:
        return self.encoded

    @functools.cached_property
    def encoded(self) -> bytes:
        """Encoded once: a record is flooded to every neighbour, unchanged."""
        return self.signed_part + bytes((len(self.signature),)) + self.signature

    @functools.cached_property
    def neighbour_ids(self) -> frozenset[int]:
        """The listed neighbours, made once (every route build asks each record)."""
        return frozenset(n for n, _ in self.neighbours)

    @functools.cached_property
    def addresses(self) -> tuple[IPAddress, ...]:
        """The virtual IPs, made once: `Interface.ip` builds a new address object per call,
        and every route build reads every record's."""
        return tuple(i.ip for i in (self.ipv4, self.ipv6) if i is not None)

    @functools.cached_property
    def signed_part(self) -> bytes:
        """Everything but the signature: what the origin signs."""
        name = self.name.encode()[:255]
        flags = (_F_EXIT if self.exit else 0) | (_F_V4 if self.ipv4 else 0) | (_F_V6 if self.ipv6 else 0)
        if self.dns:
            flags |= _F_DNS
        if self.reads_process:
            flags |= _F_PROCESS  # nodes from before it ignore the bit
        out = bytearray(_HEAD.pack(self.origin, self.session, self.version, flags, len(name)))
        out += name
        if self.ipv4:
            out += self.ipv4.ip.packed + bytes((self.ipv4.network.prefixlen,))
        if self.ipv6:
            out += self.ipv6.ip.packed + bytes((self.ipv6.network.prefixlen,))
        out.append(len(self.cidrs))
        for net, mapped in self.cidrs:
            out.append((net.version == 6) | (0x02 if mapped else 0))
            out.append(net.prefixlen)
            out += net.network_address.packed
        out += len(self.neighbours).to_bytes(2, "big")
        for nid, lat in self.neighbours:
            out += _NEIGH.pack(nid, min(lat, 0xFFFFFFFF))
        out.append(len(self.key))
        out += self.key
        out += len(self.cert).to_bytes(2, "big")
        out += self.cert
        if self.dns:  # behind a flag: a record without suffixes is what nodes before this send
            out.append(len(self.dns))
            for suffix in self.dns:
                raw = suffix.encode("ascii")
                out.append(len(raw))
                out += raw
        return bytes(out)


def decode_record(data: bytes | memoryview, pos: int = 0) -> tuple[Record, int]:
    """Decode one record at `pos`; returns (record, next pos). Raises RecordError."""
    try:
        origin, session, version, flags, n = _HEAD.unpack_from(data, pos)
        pos += _HEAD.size
        if pos + n > len(data):
            raise RecordError("truncated name")
        name = bytes(data[pos : pos + n]).decode("utf-8", "replace")
        pos += n
        ipv4 = ipv6 = None
        if flags & _F_V4:
            ipv4 = _ipv4_interface(bytes(data[pos : pos + 4]), data[pos + 4])
            pos += 5
        if flags & _F_V6:
            ipv6 = _ipv6_interface(bytes(data[pos : pos + 16]), data[pos + 16])
            pos += 17
        cidrs: list[tuple[IPNetwork, bool]] = []
        for _ in range(data[pos]):
            kind, plen = data[pos + 1], data[pos + 2]
            size = 16 if kind & 1 else 4
            raw = bytes(data[pos + 3 : pos + 3 + size])
            if len(raw) != size:
                raise RecordError("truncated cidr")
            net: IPNetwork = (
                ipaddress.IPv6Network((raw, plen)) if size == 16 else ipaddress.IPv4Network((raw, plen))
            )
            cidrs.append((net, bool(kind & 0x02)))
            pos += 2 + size
        pos += 1
        count = int.from_bytes(bytes(data[pos : pos + 2]), "big")
        pos += 2
        neighbours = []
        for _ in range(count):
            neighbours.append(_NEIGH.unpack_from(data, pos))
            pos += _NEIGH.size
        klen = data[pos]
        key = bytes(data[pos + 1 : pos + 1 + klen])
        pos += 1 + klen
        clen = int.from_bytes(bytes(data[pos : pos + 2]), "big")
        cert = bytes(data[pos + 2 : pos + 2 + clen])
        pos += 2 + clen
        if len(cert) != clen:
            raise RecordError("truncated certificate")
        dns: list[str] = []
        if flags & _F_DNS:
            count = data[pos]
            if not 0 < count <= MAX_DNS_SUFFIXES:
                raise RecordError(f"{count} DNS suffixes (1-{MAX_DNS_SUFFIXES})")
            pos += 1
            for _ in range(count):
                n = data[pos]
                raw = bytes(data[pos + 1 : pos + 1 + n])
                if len(raw) != n:
                    raise RecordError("truncated DNS suffix")
                dns.append(_dns_suffix(raw))
                pos += 1 + n
        slen = data[pos]
        signature = bytes(data[pos + 1 : pos + 1 + slen])
        pos += 1 + slen
    except (struct.error, IndexError, ValueError) as e:
        raise RecordError(f"malformed record: {e}") from None
    if pos > len(data):
        raise RecordError("truncated record")
    return (
        Record(origin, session, version, name, ipv4, ipv6, tuple(cidrs), bool(flags & _F_EXIT),
               tuple(sorted(neighbours)), key, cert, signature, tuple(dns), bool(flags & _F_PROCESS)),
        pos,
    )


# An interface object costs ~20 µs to make (ipaddress builds and checks its network too), a
# fifth of a record's signature check, and every version and copy of an origin carries the same
# one: made once per value. Bounded like the table; the objects are immutable values.
@functools.lru_cache(maxsize=4096)
def _ipv4_interface(raw: bytes, prefixlen: int) -> ipaddress.IPv4Interface:
    return ipaddress.IPv4Interface((raw, prefixlen))


@functools.lru_cache(maxsize=4096)
def _ipv6_interface(raw: bytes, prefixlen: int) -> ipaddress.IPv6Interface:
    return ipaddress.IPv6Interface((raw, prefixlen))


def _dns_suffix(raw: bytes) -> str:
    """A suffix as a record carries it: ASCII, lowercase, one trailing dot, labels of 1-63
    bytes (what config accepts for dns.serve_suffixes); RecordError for anything else."""
    try:
        text = raw.decode("ascii")
    except UnicodeDecodeError:
        raise RecordError("DNS suffix not ASCII") from None
    labels = text[:-1].split(".")
    if (not text.endswith(".") or text != text.lower() or len(text) > 254
            or any(not 1 <= len(label) <= 63 or not label.isprintable() or " " in label for label in labels)):
        raise RecordError(f"bad DNS suffix {text!r}")
    return text


def encode_records(records: Iterable[Record], max_size: int) -> list[bytes]:
    """Pack records into bodies of at most `max_size` bytes: u16 count, then
    (u16 length, record) each; the length lets a receiver skip a record it
    already holds after reading only its header."""
    bodies: list[bytes] = []
    cur: list[bytes] = []
    size = 2
    for r in records:
        enc = r.encode()
        if cur and size + 2 + len(enc) > max_size:
            bodies.append(len(cur).to_bytes(2, "big") + b"".join(cur))
            cur, size = [], 2
        cur.append(len(enc).to_bytes(2, "big") + enc)
        size += 2 + len(enc)
    if cur:
        bodies.append(len(cur).to_bytes(2, "big") + b"".join(cur))
    return bodies


def split_records(body: bytes | memoryview) -> list[tuple[int, int, int, bytes | memoryview]]:
    """(origin, session, version, encoded record) per record, headers only."""
    if len(body) < 2:
        raise RecordError("truncated record list")
    count = int.from_bytes(bytes(body[:2]), "big")
    pos, out = 2, []
    end = len(body)
    for _ in range(count):
        if end - pos < 2:
            raise RecordError("truncated record length")
        n = int.from_bytes(bytes(body[pos : pos + 2]), "big")
        pos += 2
        if n < _HEAD.size or end - pos < n:
            raise RecordError("bad record length")
        origin, session, version, _, _ = _HEAD.unpack_from(body, pos)
        out.append((origin, session, version, body[pos : pos + n]))
        pos += n
    if pos != end:
        raise RecordError("trailing bytes after records")
    return out


def decode_one(data: bytes | memoryview) -> Record:
    rec, pos = decode_record(data)
    if pos != len(data):
        raise RecordError("record length mismatch")
    return rec


def decode_records(body: bytes | memoryview) -> list[Record]:
    return [decode_one(enc) for _, _, _, enc in split_records(body)]


_ACK = struct.Struct("!IQ")


def encode_acks(acks: Iterable[tuple[int, int]]) -> bytes:
    return b"".join(_ACK.pack(o, v) for o, v in acks)


def decode_acks(body: bytes | memoryview) -> list[tuple[int, int]]:
    if len(body) % _ACK.size:
        raise RecordError("bad ack length")
    return [_ACK.unpack_from(body, i) for i in range(0, len(body), _ACK.size)]


@dataclass(frozen=True)
class Route:
    node_id: int
    name: str
    kind: str  # "self" | "peer" | "cidr" | "exit"
    next_hop: int
    hops: int
    latency_ms: float


@dataclass(slots=True)
class PathInfo:
    next_hop: int
    hops: int
    latency_us: int


@dataclass
class _NeighbourSync:
    acked: dict[int, int] = field(default_factory=dict)  # origin -> version
    sent: dict[int, tuple[int, float]] = field(default_factory=dict)  # origin -> (version, when), unacked
    pending: set[int] = field(default_factory=set)  # origins changed since we last sent them
    resend: float = 0.0  # this neighbour's resend interval (resend_after, backed off); 0: not yet set
    heard: float = float("-inf")  # when an acknowledgement last cleared a send
    slowest: float = 0.0  # the longest an acknowledgement of a send took since the link came up


class RouteTable:
    """The link-state database of one node plus the routes built from it."""

    def __init__(
        self,
        local: Record,
        max_records: int = 4096,
        expiry: float = 60.0,
        resend_after: float = 3.0,
        exit_nodes: tuple[str, ...] = (),
        max_cache: int = 4096,
        sign: Callable[[bytes], bytes] | None = None,
        accept: Callable[[Record, Record | None], str | None] | None = None,
    ) -> None:
        # `sign` signs the own record's every version; `accept(new, held)` vets a received
        # record before it is stored (None: store; else the reason it is dropped, counted).
        # The mesh gives both (trust.py); the table alone, as unit tests use it, does neither.
        self._sign = sign
        self._accept = accept
        if sign is not None:
            local = replace(local, signature=sign(local.signed_part))
        self.local = local
        self.node_id = local.origin
        self.max_records = max_records
        self.expiry = expiry
        self.resend_after = resend_after
        self.exit_nodes = exit_nodes
        self.records: dict[int, Record] = {local.origin: local}
        self.refused = 0  # records `accept` dropped
        # what this table did, for benchmarks and tests (bench/mesh_scale.py): records received
        # (every copy), records vetted by `accept` (a signature check each), graph builds
        self.records_rx = 0
        self.records_decoded = 0
        self.records_verified = 0
        self.builds = 0
        self.resent = 0  # records sent again to a neighbour that had not acknowledged them
        self._unchecked: dict[int, list[tuple[Record, int]]] = {}  # origin -> [(record, from)], newest first
        self._sync: dict[int, _NeighbourSync] = {}
        self._unreachable_since: dict[int, float] = {}
        self.dirty = True
        self.version = 0  # bumps on every build; lookup caches key on it
        self.hop_paths: dict[int, PathInfo] = {}
        # the least-latency paths are walked when first asked for after a build (a node of the
        # latency policy, a frame that asks for it, /routes), from the adjacency that build made:
        # while a mesh forms nothing asks between most builds, and each walk was a third of one
        self._lat_paths: dict[int, PathInfo] | None = {}
        self._adj: dict[int, list[tuple[int, int]]] = {}
        self._exact: dict[IPAddress, int] = {}
        self._cidrs: list[tuple[IPNetwork, int]] = []  # best first
        self._own_nets: list[IPNetwork] = []
        self._cache: dict[IPAddress, Route | None] = {}
        self._max_cache = max_cache
        self.build()

    # ------------------------------------------------------------ origination

    def update_local(self, **changes: object) -> bool:
        """Change the own record; re-originate (version+1) only if content changed."""
        new = replace(self.local, **changes)  # type: ignore[arg-type]
        if new.same_content(self.local):
            return False
        new = replace(new, version=self.local.version + 1)
        if self._sign is not None:
            new = replace(new, signature=self._sign(new.signed_part))
        self.local = new
        self.records[self.node_id] = new
        self.dirty = True
        self._changed(self.node_id)
        return True

    def _changed(self, origin: int) -> None:
        for sync in self._sync.values():
            sync.pending.add(origin)

    # ------------------------------------------------------------ neighbours

    def neighbour_up(self, nid: int) -> None:
        """A link to `nid` is established: forget what it acknowledged (full resync)."""
        self._sync[nid] = _NeighbourSync(pending=set(self.records))

    def neighbour_down(self, nid: int) -> None:
        self._sync.pop(nid, None)

    def link_lost(self, nid: int) -> None:
        """One of several links to `nid` closed: what it held unsent went with it, and which link
        carried which record is not known, so every send `nid` has not acknowledged goes again
        (over the links that remain) at the next sync."""
        sync = self._sync.get(nid)
        if sync is not None:
            sync.pending.update(sync.sent)
            sync.sent.clear()

    # ------------------------------------------------------------ sync

    def receive_body(self, from_nid: int, body: bytes | memoryview, now: float) -> list[tuple[int, int]]:
        """A ROUTES body: records we already hold are acknowledged without decoding
        (flooding delivers each version once per neighbour). Raises RecordError."""
        acks: list[tuple[int, int]] = []
        fresh: list[Record] = []
        sync = self._sync.get(from_nid)
        split = split_records(body)
        self.records_rx += len(split)
        for origin, session, version, enc in split:
            old = self.records.get(origin)
            held = old is not None and (version, session) <= (old.version, old.session)
            if (held and origin != self.node_id) or self._waiting(origin, session, version, enc):
                acks.append((origin, version))
                if sync is not None and sync.acked.get(origin, -1) < version:
                    sync.acked[origin] = version
                continue
            self.records_decoded += 1
            fresh.append(decode_one(enc))
        if fresh:
            acks.extend(self.receive_records(from_nid, fresh, now))
        return acks

    def _waiting(self, origin: int, session: int, version: int, enc: bytes | memoryview) -> bool:
        """Are these very bytes already waiting for `settle` (the same version from another
        neighbour, as a mesh forming delivers each one from every neighbour)? Then they are
        acknowledged without decoding. Equal headers with other bytes (a forged copy) are
        decoded and checked beside the genuine one."""
        cands = self._unchecked.get(origin)
        return cands is not None and any(
            c.version == version and c.session == session and c.encoded == enc for c, _ in cands
        )

    def receive_records(self, from_nid: int, records: Iterable[Record], now: float) -> list[tuple[int, int]]:
        """Store newer records; returns the acks to send back."""
        acks: list[tuple[int, int]] = []
        sync = self._sync.get(from_nid)
        for rec in records:
            acks.append((rec.origin, rec.version))
            if sync is not None and sync.acked.get(rec.origin, -1) < rec.version:
                sync.acked[rec.origin] = rec.version  # it has this version: never send it back
            if rec.origin == self.node_id:
                if rec.session != self.local.session:
                    _duplicates.labels("node_id").inc()
                    _rlog.warning(
                        f"dup:{rec.origin}", "node id %08x is also claimed by another node (%r, via %08x);"
                        " ignoring its record", rec.origin, rec.name, from_nid,
                    )
                continue
            old = self.records.get(rec.origin)
            if old is None:
                if len(self.records) >= self.max_records:
                    _dropped.labels("table_full").inc()
                    _rlog.debug(
                        "full", "route table full (%d records): dropping record of %08x from %08x",
                        self.max_records, rec.origin, from_nid,
                    )
                    continue
            elif (rec.version, rec.session) <= (old.version, old.session):
                if old.session != rec.session and rec.version == old.version:
                    _duplicates.labels("node_id").inc()
                _dropped.labels("stale").inc()
                continue
            if self._accept is not None:
                self._hold_for_check(rec, from_nid)
                continue
            self._store(rec, old)
        return acks

    def _store(self, rec: Record, old: Record | None) -> None:
        self.records[rec.origin] = rec
        self._changed(rec.origin)
        if old is None or not rec.same_content(old):
            self.dirty = True

    def _hold_for_check(self, rec: Record, from_nid: int) -> None:
        """Keep a received record for `settle`: while records pour in (a mesh forming, a
        flap), an origin's versions that a newer one supersedes before the next settle are
        never checked (a signature check costs more than everything else a record costs).
        Candidates are kept per origin, newest first, so a forged newer version (which fails)
        cannot hide a genuine older one that arrived beside it."""
        cands = self._unchecked.get(rec.origin)
        if cands is None:
            if len(self._unchecked) >= self.max_records:
                _dropped.labels("table_full").inc()
                return
            cands = self._unchecked[rec.origin] = []
        key = (rec.version, rec.session, rec.signature)
        if any((c.version, c.session, c.signature) == key for c, _ in cands):
            return  # the same version from another neighbour
        cands.append((rec, from_nid))
        cands.sort(key=lambda c: (c[0].version, c[0].session), reverse=True)
        del cands[MAX_CANDIDATES:]

    @property
    def unchecked(self) -> int:
        """Origins with received records waiting for `settle`."""
        return len(self._unchecked)

    def settle(self, limit: int | None = None) -> int:
        """Check the held records (newest first per origin) and store the first that passes;
        returns how many were stored. At most `limit` origins (in the order they arrived; each
        at most MAX_CANDIDATES checks), the rest stay held: a caller on an event loop checks a
        full table in slices, with its I/O between them."""
        if not self._unchecked or self._accept is None:
            return 0
        if limit is None or limit >= len(self._unchecked):
            held, self._unchecked = self._unchecked, {}
        else:
            unchecked = self._unchecked
            held = {o: unchecked.pop(o) for o in list(itertools.islice(unchecked, limit))}
        stored = 0
        for origin, cands in held.items():
            for rec, from_nid in cands:
                old = self.records.get(origin)
                if old is not None and (rec.version, rec.session) <= (old.version, old.session):
                    break  # nothing newer than what is stored is left
                if old is None and len(self.records) >= self.max_records:
                    _dropped.labels("table_full").inc()
                    break
                self.records_verified += 1
                reason = self._accept(rec, old)
                if reason is None:
                    self._store(rec, old)
                    stored += 1
                    break
                _dropped.labels(reason).inc()
                self.refused += 1
                _rlog.warning(
                    f"refused:{reason}:{origin}", "route record of %08x (%r, via %08x) dropped: %s",
                    origin, rec.name, from_nid, reason,
                )
        return stored

    def receive_acks(self, from_nid: int, acks: Iterable[tuple[int, int]], now: float) -> int:
        """Acknowledgements from `from_nid`; returns how many records FORGOTTEN ones made to
        send again (0: nothing new to send)."""
        sync = self._sync.get(from_nid)
        if sync is None:
            return 0
        progress = False
        again = gone_here = 0
        oldest = now
        for origin, version in acks:
            if version == FORGOTTEN:
                # it expired this origin: nothing of it counts as held there now. Send it again
                # only if it is reachable here (it was alive to us); an origin gone for both is
                # not bounced back and forth, each expiry sending it again to the other
                sync.acked.pop(origin, None)
                sync.sent.pop(origin, None)
                if origin in self.records and origin in self.hop_paths:
                    sync.pending.add(origin)
                    again += 1
                else:
                    gone_here += 1
                continue
            if sync.acked.get(origin, -1) < version:
                sync.acked[origin] = version
            sent = sync.sent.get(origin)
            if sent is not None and sent[0] <= version:
                del sync.sent[origin]
                progress = True
                oldest = min(oldest, sent[1])
        if progress:
            sync.heard = now
            sync.slowest = min(RESEND_MAX / 2, max(sync.slowest, now - oldest))
        if not sync.sent:
            sync.resend = self.resend_after  # it caught up: its backlog, not its link, was slow
        if again:
            _forgotten.labels("sent_again").inc(again)
        if gone_here:
            _forgotten.labels("gone_here").inc(gone_here)
        return again

    def records_to_send(self, nid: int, now: float) -> list[Record]:
        """Records `nid` has not acknowledged (and not been sent recently)."""
        sync = self._sync.get(nid)
        if sync is None:
            return []
        sync.resend = sync.resend or self.resend_after
        # never sooner than twice the slowest acknowledgement this link has seen: a neighbour
        # that took 10 s to read its way through a flood once will again, and a resend would
        # only be one more copy behind the rest (at 1,000 nodes half the records a node read)
        wait = max(sync.resend, 2 * sync.slowest)
        # only what changed since the last call, plus unacknowledged sends past their time
        # (no scan of the whole table per neighbour per tick). `sent` is in the order of the
        # sends (each send moves its origin to the end), so the scan stops at the first one
        # not yet due: a flood with many sends unacknowledged costs nothing per call
        candidates = sync.pending
        sync.pending = set()
        # a link is reliable and in order: while acknowledgements of what was sent keep coming
        # back, what is not acknowledged yet is queued behind them, not lost
        if now - sync.heard >= wait:
            for origin, (_, when) in sync.sent.items():
                if now - when < wait:
                    break
                candidates.add(origin)
        resent = 0
        out = []
        records = self.records
        me = self.node_id
        for origin in candidates:
            rec = records.get(origin)
            if rec is None or origin == nid or sync.acked.get(origin, -1) >= rec.version:
                continue
            if origin == me and not rec.neighbours:
                # an own record that lists no neighbour adds no edge to anyone's graph: a node
                # starting would have every node check it, then its first version with links
                # (FIRST_RTT_WAIT later) again. The version that lists one is sent (pending)
                continue
            sent = sync.sent.get(origin)
            if sent is not None and sent[0] >= rec.version:
                if now - sent[1] < wait:
                    continue
                resent += 1
            sync.sent.pop(origin, None)
            sync.sent[origin] = (rec.version, now)
            out.append(rec)
        if resent:
            self.resent += resent
            sync.resend = min(RESEND_MAX, 2 * wait)  # late acknowledgements: wait longer next time
        return out

    def forget(self, origins: Iterable[int]) -> None:
        """Delete these records now (revoked or expired origins); their next versions are
        vetted again by `accept` when they arrive."""
        for origin in origins:
            self._unchecked.pop(origin, None)
            if origin == self.node_id or self.records.pop(origin, None) is None:
                continue
            self._unreachable_since.pop(origin, None)
            for sync in self._sync.values():
                sync.acked.pop(origin, None)
                sync.sent.pop(origin, None)
                sync.pending.discard(origin)
            self.dirty = True

    def expire(self, now: float) -> list[int]:
        """Drop records whose origin has been unreachable for `expiry` seconds."""
        gone = [o for o, since in self._unreachable_since.items() if now - since >= self.expiry]
        for origin in gone:
            del self._unreachable_since[origin]
            self.records.pop(origin, None)
            for sync in self._sync.values():
                sync.acked.pop(origin, None)
                sync.sent.pop(origin, None)
        if gone:
            _expired.inc(len(gone))
        return gone

    def mark_unreachable(self, now: float) -> None:
        """Start the expiry clock for records not reachable in the current build."""
        reachable = self.hop_paths
        for origin in self.records:
            if origin in reachable:
                self._unreachable_since.pop(origin, None)
            else:
                self._unreachable_since.setdefault(origin, now)

    # ------------------------------------------------------------ graph

    def build(self, settle: bool = True) -> bool:
        """Rebuild routes if anything changed; returns True if it did. Held records are
        checked first unless `settle` is false (the mesh checks them in slices itself)."""
        if settle:
            self.settle()
        if not self.dirty:
            return False
        self.dirty = False
        _builds.inc()
        self.builds += 1
        recs = self.records
        me = self.node_id
        adj: dict[int, list[tuple[int, int]]] = {}
        for o, r in recs.items():
            edges = []
            for n, lat in r.neighbours:
                back = recs.get(n)
                if back is not None and o in back.neighbour_ids:
                    edges.append((n, lat if lat > 0 else UNKNOWN_LATENCY_US))
            adj[o] = edges
        self.hop_paths = _least_hops(adj, me)
        self._adj, self._lat_paths = adj, None
        self._build_lookup()
        self.version += 1
        self._cache.clear()
        return True

    def _build_lookup(self) -> None:
        exact: dict[IPAddress, int] = {}
        reach = self.hop_paths
        for origin in sorted(reach):  # lowest node id wins a duplicate virtual IP, everywhere
            for addr in self.records[origin].addresses:
                prev = exact.setdefault(addr, origin)
                if prev != origin:
                    _duplicates.labels("virtual_ip").inc()
                    _rlog.warning(
                        f"dupip:{addr}", "virtual IP %s claimed by %08x and %08x; %08x wins (lowest id)",
                        addr, prev, origin, prev,
                    )
        own = [net for net, _ in self.local.cidrs]
        cidrs: list[tuple[tuple[int, int, int, int], IPNetwork, int]] = []
        for origin, path in reach.items():
            for net, _ in self.records[origin].cidrs:
                if origin != self.node_id and any(
                    net.version == o.version and net.subnet_of(o) for o in own  # type: ignore[arg-type]
                ):
                    continue  # a remote CIDR inside an own CIDR: the own one serves it
                # longest prefix first; the own node wins ties, then the nearest, then the lowest id
                key = (-net.prefixlen, 0 if origin == self.node_id else 1, path.hops, origin)
                cidrs.append((key, net, origin))
        cidrs.sort(key=lambda c: c[0])
        self._exact = exact
        self._cidrs = [(net, origin) for _, net, origin in cidrs]
        self._own_nets = [i.network for i in (self.local.ipv4, self.local.ipv6) if i is not None]

    @property
    def lat_paths(self) -> dict[int, PathInfo]:
        """Least-latency paths as of the last build (walked on the first call after it)."""
        if self._lat_paths is None:
            self._lat_paths = _least_latency(self._adj, self.node_id)
            self._adj = {}  # not needed again before the next build
        return self._lat_paths

    # ------------------------------------------------------------ lookup

    def path(self, node_id: int, latency: bool = False) -> PathInfo | None:
        return (self.lat_paths if latency else self.hop_paths).get(node_id)

    def _route(self, origin: int, kind: str, latency: bool = False) -> Route | None:
        p = self.path(origin, latency)
        if p is None:
            return None
        if origin == self.node_id and kind == "peer":
            kind = "self"
        return Route(origin, self.records[origin].name, kind, p.next_hop, p.hops, p.latency_us / 1000.0)

    def lookup(self, ip: IPAddress, latency: bool = False) -> Route | None:
        cache = self._cache
        if not latency and ip in cache:
            return cache[ip]
        route = self._lookup(ip, latency)
        if not latency:
            if len(cache) >= self._max_cache:
                cache.clear()  # bounded: recomputing is cheap
            cache[ip] = route
        return route

    def inside_mesh(self, ip: IPAddress) -> bool:
        """Is `ip` an address the mesh itself carries (a node's virtual IP, the own virtual
        subnets, an advertised proxy CIDR), exits aside? A link to it would run inside the mesh."""
        if ip in self._exact or any(ip.version == n.version and ip in n for n in self._own_nets):
            return True
        return any(ip.version == net.version and ip in net for net, _origin in self._cidrs)

    def _lookup(self, ip: IPAddress, latency: bool) -> Route | None:
        origin = self._exact.get(ip)
        if origin is not None:
            return self._route(origin, "peer", latency)
        if any(ip.version == n.version and ip in n for n in self._own_nets):
            return None  # inside the own virtual subnet but unassigned: nobody serves it
        for net, origin in self._cidrs:
            if ip.version == net.version and ip in net:
                return self._route(origin, "cidr", latency)
        return self.exit_route(latency)

    def exit_route(self, latency: bool = False) -> Route | None:
        paths = self.lat_paths if latency else self.hop_paths
        for ref in self.exit_nodes:
            if ref == "auto":
                offers = [
                    (p.hops, p.latency_us, o) if not latency else (p.latency_us, p.hops, o)
                    for o, p in paths.items() if self.records[o].exit
                ]
                if offers:
                    return self._route(min(offers)[2], "exit", latency)
                continue
            origin = self._exact.get(ipaddress.ip_address(ref))
            if origin is not None and self.records[origin].exit:
                return self._route(origin, "exit", latency)
        return None

    def reachable(self) -> list[int]:
        return sorted(self.hop_paths)


def _least_hops(adj: dict[int, list[tuple[int, int]]], src: int) -> dict[int, PathInfo]:
    """Least-hop paths from `src`, ties by latency, then the lowest first hop: what a Dijkstra
    on (hops, latency, first hop) gives, walked one hop layer at a time without a heap (every
    path of a layer is one hop longer than the layer before; a node's best path comes from the
    previous layer). Route builds were a third of a host's CPU while 500 nodes formed, and
    these walks most of them."""
    out = {src: PathInfo(src, 0, 0)}
    layer: dict[int, tuple[int, int]] = {src: (0, src)}  # node -> (latency, first hop)
    hops = 0
    while layer:
        hops += 1
        nxt: dict[int, tuple[int, int]] = {}
        for node, (lat, nh) in layer.items():
            for n, w in adj.get(node, ()):
                if n in out:
                    continue
                cand = (lat + w, n if node == src else nh)
                best = nxt.get(n)
                if best is None or cand < best:
                    nxt[n] = cand
        for n, (lat, nh) in nxt.items():
            out[n] = PathInfo(nh, hops, lat)
        layer = nxt
    return out


def _least_latency(adj: dict[int, list[tuple[int, int]]], src: int) -> dict[int, PathInfo]:
    """Least-latency paths from `src`, ties by hops, then the lowest first hop (Dijkstra; the
    last element of a cost, the first hop's id, makes equal-cost choices deterministic)."""
    out: dict[int, PathInfo] = {}
    heap: list[tuple[int, int, int, int]] = [(0, 0, src, src)]  # (latency, hops, first hop, node)
    while heap:
        lat, hops, nh, node = heapq.heappop(heap)
        if node in out:
            continue
        out[node] = PathInfo(nh, hops, lat)
        for n, w in adj.get(node, ()):
            if n not in out:
                heapq.heappush(heap, (lat + w, hops + 1, n if node == src else nh, n))
    return out
