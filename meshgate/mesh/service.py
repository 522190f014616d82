"""MeshService: links + routing + streams + datagrams, as the rest of meshgate sees them.

The node builds it with the egress connect for streams that end here
(`MeshService(config, egress=...)`). The gateway, DNS and admin code use:
`node_id`, `lookup(ip)`, `open_stream(...)`, `egress_connect`,
`send_datagram` / `on_datagram`, `name_table()`, `peers()`, `routes()`,
`status()`.
"""

from __future__ import annotations

import asyncio
import collections
import ipaddress
import logging
import os
import random
import struct
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from meshgate import replies
from meshgate.config import Config, LimitsConfig, LinkUrl, MeshConfig
from meshgate.errors import StartupError, bind_error
from meshgate.logs import RateLimitedLog
from meshgate.mesh import certs
from meshgate.mesh.certs import CertError
from meshgate.mesh.e2e import SEAL_OVERHEAD, E2e, E2eError
from meshgate.mesh.frames import (
    DATAGRAM,
    DATAGRAM_SEALED,
    DEFAULT_HOP_LIMIT,
    E2E_INIT,
    E2E_RESP,
    FLAG_LATENCY,
    FLAG_OPENER,
    FRAME_NAMES,
    LINK_LOCAL,
    MAX_BODY,
    PING,
    PONG,
    REVOCATION,
    ROUTE_ACK,
    ROUTES,
    SEALED,
    STREAM_OPEN,
    STREAM_RESET,
    TRAVERSAL,
    U64,
    UNREACHABLE,
    UNRELIABLE,
    Hello,
    derive_psk,
    encode_hello,
    hello_signed_data,
)
from meshgate.mesh.identity import Identity, IdentityError, fingerprint, load_or_create
from meshgate.mesh.link_kinds import LINK_KINDS, Listening
from meshgate.mesh.links import Link, LinkBase
from meshgate.mesh.noise import local_caps
from meshgate.mesh.routing import (
    FORGOTTEN,
    Record,
    RecordError,
    Route,
    RouteTable,
    decode_acks,
    encode_acks,
    encode_records,
)
from meshgate.mesh.splice import EgressConnect, SplicePipe
from meshgate.mesh.streams import RESET, SID, MeshStream, StreamError, StreamMux
from meshgate.mesh.trust import PeerIdentity
from meshgate.mesh.trust_files import (
    FileWatch,
    check_own_claims,
    load_trust,
    read_revocation_list,
    store_mesh_revocation_list,
)
from meshgate.metrics import REGISTRY
from meshgate.replies import GENERAL_FAILURE, NETWORK_UNREACHABLE, NOT_ALLOWED, TTL_EXPIRED

if TYPE_CHECKING:
    from meshgate.mesh import link_udp
    from meshgate.mesh.traversal_agent import TraversalAgent

log = logging.getLogger("meshgate.mesh")
_rlog = RateLimitedLog(log)

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
DatagramCallback = Callable[[int, bytes], None]
# a handler that reads the payload in place: the view is valid only during the call
DatagramViewCallback = Callable[[int, memoryview], None]
CHANNEL = struct.Struct("!H")
STREAM_FRAMES = frozenset(range(STREAM_OPEN, STREAM_RESET + 1))  # frames.STREAM_OPEN .. STREAM_RESET
UNREACH = struct.Struct("!IB")  # UNREACHABLE body: the destination a relay could not reach, code

_handshakes = REGISTRY.counter("meshgate_mesh_handshakes_total", "Link handshakes", ("result",))
_links_gauge = REGISTRY.gauge("meshgate_mesh_links", "Established mesh links")
_frames_dropped = REGISTRY.counter("meshgate_mesh_frames_dropped_total", "Mesh frames dropped", ("reason",))
_records_dropped = REGISTRY.counter(
    "meshgate_mesh_records_dropped_total", "Sealed link records dropped", ("reason",)
)
_link_bytes = REGISTRY.counter(
    "meshgate_mesh_link_bytes_total", "Bytes on mesh links", ("peer", "direction")
)
_datagrams = REGISTRY.counter("meshgate_mesh_datagrams_total", "Mesh datagrams", ("result",))
_links_closed = REGISTRY.counter(
    "meshgate_mesh_links_closed_total", "Mesh links this node closed on its own", ("reason",)
)
# the family's one child, bound once; relayed frames are counted in MeshService.relayed and
# added to it once per tick (flush_counts), not with a lock per frame
_forwarded = REGISTRY.counter(
    "meshgate_mesh_frames_forwarded_total", "Frames relayed for other nodes"
).labels()
_e2e_dropped = REGISTRY.counter(
    "meshgate_mesh_e2e_dropped_total", "End-to-end frames and session set-ups dropped", ("reason",)
)
_peer_restarts = REGISTRY.counter(
    "meshgate_mesh_peer_restarts_total",
    "Other nodes heard to run a new process (what was held with the old one ended)", ("heard_by",),
)

OPEN_TIMEOUT = 10.0
DRAIN_GIVE_UP = 1.0  # a stream moving paths waits this long for its peer to return its credit
FORGOTTEN_PER_FRAME = 4096  # (origin, FORGOTTEN) acknowledgements per ROUTE_ACK frame: 48 KiB
EXPIRY_CHECK_TICKS = 10  # ping intervals between checks for certificates that expired
# Received records are checked (signatures) and flooded on at most every SETTLE_INTERVAL:
# each hop of a flood waits for this, never for a route build. Versions of one origin that a
# newer one supersedes within it are never checked. The first records after a quiet spell go
# at once.
SETTLE_INTERVAL = 0.05
# ... at most SETTLE_BATCH origins' records per loop iteration (~3 ms of signature checks), the
# rest in the next one: a full table arriving (a link up in a 1,000-node mesh) does not hold
# the loop, and what it carries for streams and pings, for a tenth of a second
SETTLE_BATCH = 32
# Route builds (Dijkstra, lookup tables): at least MIN_BUILD_INTERVAL apart and 10x the CPU
# the last one took; while records keep changing (a build follows the previous one within
# twice its interval) the interval doubles, up to MAX_BUILD_INTERVAL, so a long flood (a
# large mesh forming on a busy host) costs each node a few builds, not one per 50 ms; a
# quiet spell resets it. A build comes sooner once no record changed for BUILD_QUIET of the
# interval: when a flood ends, the routes follow it within a quarter of the interval.
MIN_BUILD_INTERVAL = 0.05
MAX_BUILD_INTERVAL = 4.0
# Only a flood backs the builds off: more than this many records stored since the last build.
# A node joining, leaving or restarting changes a few (its own and its neighbours'), and a
# standing mesh's latency versions come one at a time: each is routed within the floor.
FLOOD_CHANGES = 8
BUILD_QUIET = 0.25
ORIGINATE_DELAY = 0.05  # coalesce changes of the own record made within this time
# A version that only adds links (or moves latencies) waits, polling every ORIGINATE_DELAY,
# until the new links have their first RTT (at most FIRST_RTT_WAIT after they came up) and
# ORIGINATE_GAP after the previous version: a node whose links come up one by one (a mesh
# forming) makes one or two versions, not one per link plus one per first RTT; each
# costs every node a signature check and a route build. A lost link goes at once.
FIRST_RTT_WAIT = 1.0
ORIGINATE_GAP = 0.5
# A neighbour's latency (its best link's base RTT, links.BASE_RTT_SAMPLES) is re-originated
# when it moved from what the own record says by more than LATENCY_CHANGE of it,
# LATENCY_FLOOR_US and LATENCY_JITTER times the link's own jitter (a version floods to
# every node, each checking its signature and rebuilding its routes: measurement noise
# must not make versions), at most once per LATENCY_HOLD_PINGS ping intervals;
# latency-only versions in a row (a link that keeps swinging) double that hold, up to
# LATENCY_BACKOFF_MAX times. A link that came into the record unmeasured has its first
# measurement in the next version, without the hold.
LATENCY_CHANGE = 0.2
LATENCY_FLOOR_US = 50
LATENCY_JITTER = 3
LATENCY_HOLD_PINGS = 5
LATENCY_BACKOFF_MAX = 64
# Every node checks every version (~0.1 ms each) and every link carries it, so latency-only
# versions are held for at least this many seconds per node in the route table: the whole
# mesh makes about one a second, whatever its size (a 100-node mesh: one per node per 100 s;
# 5 nodes: the 5 s hold). Topology changes (links up or down) are not held.
LATENCY_MESH_SHARE = 1.0
# PING body: token u64 (opaque to the receiver, echoed in the PONG), then the sender's
# smoothed RTT of this link, its base RTT (what records carry) and its jitter, in µs (0:
# not measured). The side that dialed a link pings it; the other side answers and takes
# these as the link's, and pings only while no such PING arrives (a peer before this
# sends an 8-byte token alone).
PING_BODY = struct.Struct("!QIII")


def cidr_claims(mesh: MeshConfig) -> tuple[tuple[certs.IPNetwork, bool], ...]:
    """`mesh.proxy_cidrs` as the own record carries them: (advertised prefix, mapped)."""
    return tuple((c.advertised, c.mapped is not None) for c in mesh.proxy_cidrs)


def rtt_clock_us() -> int:
    """Microseconds on the monotonic clock, for ping tokens and RTTs. Not loop.time():
    uvloop's counts whole milliseconds, so a loopback round trip read 0 or 1 ms."""
    return time.monotonic_ns() // 1000


def latency_moved(now_us: int, recorded_us: int, jitter_us: int = 0) -> bool:
    """Whether a smoothed latency differs enough from the recorded one to re-originate:
    beyond the relative and absolute band and beyond what the link's jitter explains."""
    band = max(LATENCY_FLOOR_US, LATENCY_CHANGE * recorded_us, LATENCY_JITTER * jitter_us)
    return abs(now_us - recorded_us) > band


class MeshService:
    name = "mesh"

    def __init__(
        self, config: Config, identity: Identity | None = None, egress: EgressConnect | None = None
    ) -> None:
        self.config = config
        limits = config.limits
        if identity is None:
            try:
                identity = load_or_create(config.state_path)
            except IdentityError as e:
                raise StartupError(str(e)) from None
        self.identity = identity
        self.node_id = identity.node_id
        self.node_id_text = f"{self.node_id:08x}"
        self.network = config.node.network
        # certificate mode without a secret: the PSK is the empty secret's, public; the
        # certificates are the lock then (a secret, when set, stays a second one)
        self.psk = derive_psk(config.node.network, config.node.secret)
        self.trust = load_trust(config.node, identity, config.state_path, int(time.time()))
        own_cert = self.trust.own_cert
        self.session = int.from_bytes(os.urandom(4), "big")
        start_version = int(time.time() * 1000)  # a restart starts above every version it sent before
        self.name = own_cert.name if own_cert is not None else config.node.name
        cidrs = cidr_claims(config.mesh)
        check_own_claims(self.trust, config.node, cidrs, config.mesh.exit_node, config.dns.serve_suffixes)
        self._own_cert_raw = own_cert.raw if own_cert is not None else b""
        self._revocation_watch = FileWatch(config.node.revocation_list)
        self.peer_identity: dict[LinkBase, PeerIdentity] = {}
        self._dns_servers: tuple[int, dict[str, list[tuple[int, str]]]] | None = None
        # what this node offers when a link or an end-to-end session negotiates its AEAD
        self.aead_caps = local_caps(limits.aes_instructions)
        self.e2e = E2e(
            identity, self.network, self._own_cert_raw, self._check_e2e_peer,
            max_sessions=limits.e2e_sessions, queue_bytes=limits.e2e_queue_bytes,
            caps=self.aead_caps, process=(self.session, start_version), check_process=self._process_current,
        )
        self.handshake_timeout = limits.handshake_timeout
        self.ping_interval = limits.mesh_ping_interval
        self.dead_after = limits.mesh_dead_after
        self.latency_hold = LATENCY_HOLD_PINGS * self.ping_interval
        self.latency_share = LATENCY_MESH_SHARE
        self.link_buffer = limits.mesh_link_buffer
        self.policy_flag = FLAG_LATENCY if config.mesh.policy == "least-latency" else 0
        self.loop: asyncio.AbstractEventLoop = None  # type: ignore[assignment]  # set in start()
        local = Record(
            origin=self.node_id,
            session=self.session,
            version=start_version,
            name=self.name,
            ipv4=config.node.ipv4 or (own_cert.ipv4 if own_cert is not None else None),
            ipv6=config.node.ipv6 or (own_cert.ipv6 if own_cert is not None else None),
            cidrs=cidrs,
            exit=config.mesh.exit_node,
            reads_process=True,
            key=identity.public,
            cert=self._own_cert_raw,
            dns=config.dns.serve_suffixes,
        )
        self.table = RouteTable(
            local, max_records=limits.route_records, expiry=limits.mesh_route_expiry,
            exit_nodes=config.mesh.exit_nodes, sign=identity.sign,
            accept=lambda rec, held: self.trust.check_record(rec, held, time.time()),
        )
        # Streams that end here leave through `egress` (the node hands in the
        # policy-checked connector); a mesh without one serves no streams.
        self.egress_connect: EgressConnect = egress or _refuse_streams
        self.mux: StreamMux | None = None
        self.links: dict[int, list[LinkBase]] = {}  # neighbour id -> established links
        self.pending: set[LinkBase] = set()  # links still in their handshake
        self._datagram_handlers: dict[int, DatagramCallback] = {}
        self._datagram_views: dict[int, DatagramViewCallback] = {}
        self._listening: list[Listening] = []
        self._tasks: set[asyncio.Task[Any]] = set()
        # mesh.peers: the task keeping each one, and the link it dialed (closed when removed)
        self._keepers: dict[LinkUrl, asyncio.Task[Any]] = {}
        self._dialed: dict[LinkUrl, LinkBase] = {}
        self._tick_handle: asyncio.TimerHandle | None = None
        self._sync_scheduled = False
        self._last_build = -1e9
        self._build_interval = MIN_BUILD_INTERVAL
        self._build_timer: asyncio.Handle | None = None
        self._build_at = 0.0  # loop time _build_timer is set for
        self._last_settle = -1e9
        self._last_change = -1e9  # loop time a settle last stored a record that changed routes
        self._changes = 0  # records stored since the last build
        self._build_floor = MIN_BUILD_INTERVAL  # 10x the last build's CPU (at least the minimum)
        self._settle_timer: asyncio.Handle | None = None  # a TimerHandle, or call_soon's
        self._originate_timer: asyncio.TimerHandle | None = None
        self._latency_timer: asyncio.TimerHandle | None = None
        self._last_originated = -1e9  # loop time the own record last changed
        self._latency_backoff = 1  # the latency hold's multiplier (LATENCY_BACKOFF_MAX)
        self._latency_versioned = -1e9  # loop time of the last latency-only re-origination
        self._reachable: set[int] = {self.node_id}
        # node -> (session, version floor): the newest process of it heard of (a HELLO, an
        # end-to-end handshake, a record); a record of another session at or below the floor
        # is from an older process (PROTOCOL.md section 11)
        self._processes: dict[int, tuple[int, int]] = {}
        self._silent: set[LinkBase] = set()  # links silent for dead_after at the last tick
        self._ways_back: dict[int, LinkBase] = {}  # opener -> the link its last OPEN came in on
        self.listen_addrs: list[str] = []
        self.stats: collections.Counter[str] = collections.Counter()  # per-instance, for tests and status
        self.traversal: TraversalAgent | None = None
        self.traversal_off = ""  # why there is no traversal agent (meshgate status)
        # may traversal punch a direct path with this node? The node sets it from [[acl]]
        self.traversal_allowed: Callable[[int], bool] = lambda _nid: True
        # the link each stream's frames go out on, kept while it is up: a new route (a direct
        # link made by traversal) or a second link to the same neighbour would let later bytes
        # overtake earlier ones still on the way: far node -> (sid, opened here) -> link
        self._pinned: dict[int, dict[tuple[int, bool], LinkBase]] = {}
        # _route_link's answers while the routes (table.version) and the links stay as they are:
        # key `_route_key(dst, flags)` -> link. Only a next hop with one link is kept (with more,
        # _best_link weighs write_paused and latency, which move by themselves); cleared on every
        # link added or removed (_links_changed) and on every route build. At most two entries per
        # node with a route: bounded by limits.route_records like the table
        self._route_cache: dict[int, LinkBase] = {}
        self._route_cache_version = -1
        self.relayed = 0  # frames relayed since the last flush_counts (the relay's hot path)
        self._stay: set[tuple[int, int, bool]] = set()  # streams whose peer did not help them move
        self._ticks = 0
        self._running = False

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        limits = self.config.limits
        self.mux = StreamMux(self.loop, self.send, limits.stream_window, limits.max_streams_per_peer)
        self.mux.on_open = self._on_open
        self.mux.drain_gave_up = lambda st: self._stay.add((st.peer, st.sid, st.local_opener))
        urls = (*self.config.mesh.listen, *self.config.mesh.peers)
        if any(u.scheme == "udp" for u in urls) and limits.udp_link_mtu < 576:
            mtu = limits.udp_link_mtu
            raise StartupError(f"limits.udp_link_mtu: at least 576 for udp:// links, not {mtu}")
        if any(u.scheme == "udp" for u in urls) and limits.udp_link_reassembly_bytes < 1 << 17:
            # room for one datagram of the largest size (64 KiB) with what its pieces cost
            n = limits.udp_link_reassembly_bytes
            raise StartupError(f"limits.udp_link_reassembly_bytes: at least 131072 for udp:// links, not {n}")
        self._running = True
        for url in self.config.mesh.listen:
            try:
                listening = await LINK_KINDS[url.scheme].listen(self, url)
            except OSError as e:
                await self.stop()
                raise bind_error("mesh.listen", str(url), e) from None
            self._listening.append(listening)
            self.listen_addrs.extend(listening.addresses)
        await self._start_traversal(urls)
        self.set_peers(self.config.mesh.peers)
        self._tick_handle = self.loop.call_later(self.ping_interval, self._tick)

    async def _start_traversal(self, urls: tuple[LinkUrl, ...]) -> None:
        """NAT traversal on the node's udp:// listener, or on an ephemeral socket of its own
        when it has udp:// peers but listens on none."""
        from meshgate.mesh import link_udp

        if not self.config.mesh.traversal:
            self.traversal_off = "off (mesh.traversal = false)"
            return
        if not any(u.scheme == "udp" for u in urls):
            self.traversal_off = "off: no udp:// link in mesh.listen or mesh.peers"
            return
        from meshgate.mesh.traversal_agent import TraversalAgent

        for listening in self._listening:
            if isinstance(listening.server, link_udp.UdpListener):
                self.traversal = TraversalAgent(self, listening.server, self.config.mesh, own_socket=False)
                return
        try:
            listener = await link_udp.listen("0.0.0.0", 0, self.accept_udp, self.config.limits)
        except OSError as e:
            self.traversal_off = f"off: no traversal socket ({e.strerror})"
            return
        self.traversal = TraversalAgent(self, listener, self.config.mesh, own_socket=True)

    async def stop(self) -> None:
        self._running = False
        self.flush_counts()
        if self._tick_handle is not None:
            self._tick_handle.cancel()
        if self._build_timer is not None:
            self._build_timer.cancel()
        if self._settle_timer is not None:
            self._settle_timer.cancel()
        if self._originate_timer is not None:
            self._originate_timer.cancel()
        if self._latency_timer is not None:
            self._latency_timer.cancel()
        for listening in self._listening:
            listening.close()
        if self.traversal is not None:
            self.traversal.close()
        for task in list(self._tasks):
            task.cancel()
        for links in list(self.links.values()):
            for link in list(links):
                link.close()
        for link in list(self.pending):
            link.abort()
        if self.mux is not None:
            self.mux.close_all()
        for listening in self._listening:
            await listening.wait_closed()
        self._listening.clear()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = self.loop.create_task(coro)
        self.hold(task)
        return task

    # ------------------------------------------------------------------ links

    @property
    def limits(self) -> LimitsConfig:
        return self.config.limits

    def hold(self, task: asyncio.Task[Any]) -> None:
        """Keep a task that belongs to a link (a QUIC connection's) until it ends."""
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def accept_link(self, url: LinkUrl) -> asyncio.Protocol:
        link = Link(self, str(url), initiator=False)
        if len(self.pending) >= self.config.limits.max_pending_handshakes:
            self.link_failed(link, "too_many_pending")
            _rlog.debug("pending", "too many pending mesh handshakes (limits.max_pending_handshakes)")
            self.loop.call_soon(link.abort)
        else:
            self.pending.add(link)
        return link

    def accept_udp(self, sock: link_udp.UdpSocket, addr: Any) -> link_udp.UdpLink | None:
        """A msg1 from a new source on a udp:// listener: a responder link, or None (dropped)."""
        if len(self.pending) >= self.config.limits.max_pending_handshakes:
            # counted like a refused TCP accept, without building a session for it
            self.stats["handshake_failed"] += 1
            self.stats["handshake_failed_too_many_pending"] += 1
            _handshakes.labels("failed_too_many_pending").inc()
            _rlog.debug("pending", "too many pending mesh handshakes (limits.max_pending_handshakes)")
            return None
        link = self.make_udp_link(str(LinkUrl("udp", addr[0], addr[1])), False, sock, addr)
        self.pending.add(link)
        return link

    async def connect(self, url: LinkUrl) -> LinkBase:
        """Open one link (returns once connected; the handshake continues in the background)."""
        return await LINK_KINDS[url.scheme].connect(self, url)

    async def _keep_peer(self, url: LinkUrl) -> None:
        """Keep one configured peer connected; jittered exponential backoff between tries."""
        attempt = 0
        while self._running:
            try:
                link = await self.connect(url)
                self._dialed[url] = link
                began = self.loop.time()
                # back off again unless the link was up for a while: a peer that accepts
                # and then drops us (limits.max_peers, a flapping path) is not hammered
                try:
                    if await link.closed and self.loop.time() - began > 10 * self.ping_interval:
                        attempt = 0
                finally:
                    if self._dialed.get(url) is link:
                        del self._dialed[url]
            except (OSError, TimeoutError) as e:
                _rlog.debug(f"connect:{url}", "mesh peer %s: connect failed: %s", url, e)
            delay = min(30.0, 0.25 * (2 ** min(attempt, 8))) * random.uniform(0.75, 1.25)
            attempt += 1
            await asyncio.sleep(delay)

    def set_peers(self, peers: tuple[LinkUrl, ...]) -> None:
        """Keep these peers (start, or a reload's mesh.peers): a removed one's keeper stops and
        the link it dialed closes; an added one starts being kept; the others are untouched."""
        for url in [u for u in self._keepers if u not in peers]:
            self._keepers.pop(url).cancel()
            link = self._dialed.pop(url, None)
            if link is not None:
                link.close()
        for url in peers:
            if url not in self._keepers and self._running:
                self._keepers[url] = self._spawn(self._keep_peer(url))

    def check_offers(self, mesh: MeshConfig) -> None:
        """StartupError naming what a reload's `mesh.proxy_cidrs` / `mesh.exit_node` claim beyond
        the node's certificate (certificate mode): the node refuses that reload whole."""
        check_own_claims(self.trust, self.config.node, cidr_claims(mesh), mesh.exit_node)

    def check_dns_suffixes(self, suffixes: tuple[str, ...]) -> None:
        """StartupError naming the dns.serve_suffixes of a reload the node's certificate does not
        grant (certificate mode)."""
        check_own_claims(self.trust, self.config.node, (), False, suffixes)

    def set_dns_suffixes(self, suffixes: tuple[str, ...]) -> None:
        """A reload's dns.serve_suffixes: the own record is re-originated and flooded, as for
        set_offers."""
        if self.table.update_local(dns=suffixes):
            self._last_originated = self.loop.time()
        self.table.dirty = True
        self._build(self.loop.time())
        self._schedule_sync()

    def set_offers(self, mesh: MeshConfig) -> None:
        """A reload's `mesh.proxy_cidrs`, `mesh.exit_node` and `mesh.exit_nodes`: the own record is
        re-originated (a new signed version, flooded like any other), so every node routes by it
        once it arrives; this node's routes are rebuilt at once. Links and the streams on them
        are untouched."""
        if self.table.update_local(cidrs=cidr_claims(mesh), exit=mesh.exit_node):
            self._last_originated = self.loop.time()
        self.table.exit_nodes = mesh.exit_nodes
        # rebuilt now, not at the next build interval: that also drops the lookups cached under
        # the old exits, so the next connection already follows the reload
        self.table.dirty = True
        self._build(self.loop.time())
        self._schedule_sync()

    def link_failed(self, link: LinkBase, reason: str) -> None:
        self.pending.discard(link)
        self.stats["handshake_failed"] += 1
        self.stats[f"handshake_failed_{reason}"] += 1
        _handshakes.labels(f"failed_{reason}").inc()
        _rlog.debug(f"hs:{link.url}", "mesh handshake with %s failed: %s", link.url, reason)

    def hello_body(self, handshake_hash: bytes, initiator: bool) -> bytes:
        """Our HELLO for one link: who we are, signed over that link's handshake."""
        ident = self.identity
        return encode_hello(Hello(
            self.node_id, self.session, self.name, ident.public, self._own_cert_raw,
            ident.sign(hello_signed_data(handshake_hash, initiator)),
        ))

    def link_ready(self, link: LinkBase) -> bool:
        self.pending.discard(link)
        peer = link.peer
        assert peer is not None
        checked = self.trust.check_hello(
            peer, link.remote_static, link.handshake_hash, not link.initiator, time.time()
        )
        if isinstance(checked, str):
            self._refuse_peer(link, peer, checked)
            return False
        if peer.node_id == self.node_id:
            self.stats["duplicate_node_id"] += 1
            REGISTRY.counter("meshgate_mesh_duplicate_total", "", ("kind",)).labels("node_id").inc()
            log.warning("link %s: peer has our own key (node id %08x): a copy of this node's"
                        " state_dir runs elsewhere; closing", link.url, peer.node_id)
            return False
        if checked.cert is not None and peer.name != checked.cert.name:
            self._refuse_peer(link, peer, "not_granted")
            return False
        if not self._running:
            return False
        if sum(map(len, self.links.values())) >= self.config.limits.max_peers:
            self.stats["too_many_links"] += 1
            _handshakes.labels("refused_max_peers").inc()
            _rlog.warning(
                "max_peers", "link %s (%s) refused: %d links already (limits.max_peers)",
                link.url, peer.name, self.config.limits.max_peers,
            )
            return False
        _handshakes.labels("ok").inc()
        self.stats["handshake_ok"] += 1
        self.peer_identity[link] = checked
        self._heard_process(peer.node_id, peer.session, None)
        links = self.links.setdefault(peer.node_id, [])
        first = not links
        if self.traversal is not None:
            self.traversal.link_up(link)
        links.append(link)
        self._links_changed()
        link.up_at = self.loop.time()
        _links_gauge.inc()
        log.info("mesh link up: %s (%s %08x)", link.url, peer.name, peer.node_id)
        if first:
            self.table.neighbour_up(peer.node_id)
        self._send_ping(link)
        rl = self.trust.revocation
        if rl is not None:
            link.send_frame(REVOCATION, 0, 1, self.node_id, peer.node_id, rl.raw)
        self._update_neighbours()
        self._schedule_sync()
        return True

    def _refuse_peer(self, link: LinkBase, peer: Hello, reason: str) -> None:
        """A HELLO that does not prove what it claims: counted by reason, one line naming the
        key's fingerprint (what an operator greps their certificates for)."""
        fp = fingerprint(peer.key)[:16] if peer.key else "none"
        self.stats["handshake_refused"] += 1
        self.stats[f"handshake_refused_{reason}"] += 1
        _handshakes.labels(f"refused_{reason}").inc()
        _rlog.warning(
            f"refused:{reason}:{fp}", "link %s refused: peer %r (key %s…, node id %08x): %s",
            link.url, peer.name, fp, peer.node_id, reason,
        )

    def link_lost(self, link: LinkBase) -> None:
        self.pending.discard(link)
        self.peer_identity.pop(link, None)
        peer = link.peer
        if peer is None:
            return
        links = self.links.get(peer.node_id)
        self._link_gone(link)
        if links and link in links:
            links.remove(link)
            self._links_changed()
            _links_gauge.dec()
            log.info("mesh link down: %s (%s %08x)", link.url, peer.name, peer.node_id)
            if not links:
                del self.links[peer.node_id]
                self.table.neighbour_down(peer.node_id)
            else:
                self.table.link_lost(peer.node_id)
            self._update_neighbours()
            self._schedule_sync()

    def _links_changed(self) -> None:
        """A link was added to or removed from `links`: routes cached on the old set go."""
        self._route_cache.clear()

    def _best_link(self, nid: int) -> LinkBase | None:
        links = self.links.get(nid)
        if not links:
            return None
        if len(links) == 1:
            return links[0]
        return min(links, key=lambda k: (k.write_paused, k.latency_us or 1 << 40))

    def _update_neighbours(self) -> None:
        """Re-originate the own record soon: link-ups, first pings and losses that come
        together (a node starting, a flap) make one new version, not one each."""
        if self._originate_timer is None and self.loop is not None:
            self._originate_timer = self.loop.call_later(ORIGINATE_DELAY, self._originate)

    def _originate(self, wait: bool = True) -> None:
        self._originate_timer = None
        now = self.loop.time()
        if wait and not any(nid not in self.links for nid, _ in self.table.local.neighbours):
            unmeasured = any(
                link.rtt_samples == 0 and now - link.up_at < FIRST_RTT_WAIT
                for links in self.links.values() for link in links
            )
            if unmeasured or now - self._last_originated < ORIGINATE_GAP:
                self._originate_timer = self.loop.call_later(ORIGINATE_DELAY, self._originate)
                return
        neighbours = []
        for nid in self.links:
            best = self._best_link(nid)
            neighbours.append((nid, best.base_us if best is not None else 0))
        if self.table.update_local(neighbours=tuple(sorted(neighbours))):
            self._last_originated = self.loop.time()
            self._schedule_sync()

    def _latency_changed(self, nid: int) -> None:
        """A new RTT sample on a link to `nid`: re-originate if the latency the record
        would carry moved enough; latency-only changes at most once per `latency_hold`, and
        per `latency_share` seconds for each node in the table."""
        best = self._best_link(nid)
        recorded = dict(self.table.local.neighbours).get(nid)
        if best is None or recorded is None:
            return  # not in the own record yet: the pending origination takes the latency along
        if recorded == 0:
            self._update_neighbours()  # the first measurement: at once
            return
        if not latency_moved(best.base_us, recorded, best.jitter_us):
            return
        hold = max(self.latency_hold * self._latency_backoff, self.latency_share * len(self.table.records))
        due = self._last_originated + hold
        if self.loop.time() >= due:
            self._latency_version()
        elif self._latency_timer is None:
            self._latency_timer = self.loop.call_at(due, self._latency_due)

    def _latency_due(self) -> None:
        self._latency_timer = None
        recorded = dict(self.table.local.neighbours)
        for nid in self.links:
            best = self._best_link(nid)
            if best is not None and nid in recorded and latency_moved(
                best.base_us, recorded[nid], best.jitter_us
            ):
                self._latency_version()
                return

    def _latency_version(self) -> None:
        """Re-originate for a latency change. One soon after the previous latency-only
        version (within twice the hold) doubles the hold: a link whose latency keeps
        swinging makes ever fewer versions; a quiet spell brings the hold back."""
        now = self.loop.time()
        if now - self._latency_versioned < 2 * self.latency_hold * self._latency_backoff:
            self._latency_backoff = min(2 * self._latency_backoff, LATENCY_BACKOFF_MAX)
        else:
            self._latency_backoff = 1
        self._latency_versioned = now
        self.stats["latency_versions"] += 1
        self._update_neighbours()

    # ------------------------------------------------------------------ revocation, expiry

    def _on_revocation(self, link: LinkBase, body: memoryview) -> None:
        try:
            rl = certs.parse_revocation_list(bytes(body))
        except CertError as e:
            _frames_dropped.labels("bad_revocation").inc()
            _rlog.debug(f"revocation:{link.url}", "bad revocation list from %s: %s", link.url, e)
            return
        self._take_revocation(rl, f"link {link.url}")

    def _take_revocation(self, rl: certs.RevocationList, source: str) -> None:
        if not self.trust.certificate_mode:
            return
        serial = self.trust.revocation.serial if self.trust.revocation is not None else None
        reason = self.trust.adopt(rl)
        if reason is not None:
            if reason != "stale":
                _frames_dropped.labels(f"revocation_{reason}").inc()
                _rlog.warning(f"revocation:{reason}", "revocation list from %s refused: %s", source, reason)
            return
        log.info("revocation list serial %d (was %s) from %s: %d revoked",
                 rl.serial, serial, source, len(rl.revoked))
        self.stats["revocation_lists"] += 1
        store_mesh_revocation_list(self.config.state_path, rl)
        for nid in list(self.links):
            link = self._best_link(nid)
            if link is not None:
                link.send_frame(REVOCATION, 0, 1, self.node_id, nid, rl.raw)
        self._enforce_certificates()

    def _enforce_certificates(self) -> None:
        """Close links to, and delete the records of, nodes whose certificate is revoked or
        expired now (the HELLO and record checks refuse them from then on)."""
        trust = self.trust
        if not trust.certificate_mode:
            return
        now = int(time.time())
        for link, ident in list(self.peer_identity.items()):
            if ident.cert is not None and not trust.usable(ident.cert.raw, now):
                self.stats["links_cut"] += 1
                log.warning("mesh link %s (%s, key %s…) closed: its certificate is revoked or expired",
                            link.url, ident.cert.name, ident.fingerprint[:16])
                self.peer_identity.pop(link, None)
                links = self.links.get(ident.node_id)
                if links and link in links:
                    links.remove(link)
                    self._links_changed()
                    self._forget_link(link)  # before abort: what it still held is counted
                    link.abort()
        gone = [o for o, r in self.table.records.items()
                if o != self.node_id and r.cert and not trust.usable(r.cert, now)]
        if gone:
            self.stats["records_cut"] += len(gone)
            self.table.forget(gone)
            self._build(self.loop.time())

    def _watch_revocation_file(self) -> None:
        if self._revocation_watch.changed():
            rl = read_revocation_list(self.config.node.revocation_list)
            if rl is not None:
                self._take_revocation(rl, f"node.revocation_list {self.config.node.revocation_list}")

    # ------------------------------------------------------------------ liveness

    def _send_ping(self, link: LinkBase) -> None:
        assert link.peer is not None
        top = 0xFFFFFFFF
        body = PING_BODY.pack(
            rtt_clock_us(), min(link.latency_us, top), min(link.base_us, top), min(link.jitter_us, top)
        )
        link.send_frame(PING, 0, 1, self.node_id, link.peer.node_id, body)

    def _pings(self, link: LinkBase, now: float) -> bool:
        """Does this side ping `link` this tick? The dialer does; the other side answers
        its PINGs (which carry the RTT) and pings only when none came for a while (a peer
        before PING_BODY, or pings lost): one ping exchange per interval, not two."""
        return link.initiator or now - link.peer_pinged > 2.5 * self.ping_interval

    def _on_ping(self, link: LinkBase, body: memoryview) -> None:
        assert link.peer is not None
        link.send_frame(PONG, 0, 1, self.node_id, link.peer.node_id, body)
        if len(body) != PING_BODY.size or link.initiator:
            return  # a token alone (a node before PING_BODY), or the dialer, who measures itself
        link.peer_pinged = self.loop.time()
        _, rtt, base, jitter = PING_BODY.unpack(body)
        if rtt:
            link.rtt_reported(rtt, base, jitter)
            self._latency_changed(link.peer.node_id)

    def _tick(self) -> None:
        now = self.loop.time()
        # A link silent for dead_after at two ticks in a row is closed. At the first it is
        # probed: a loop that ran late (a busy host, many nodes in one process) runs its timers
        # before it reads its sockets, so a peer's pings may be waiting unread, and a peer as
        # late as we are (in this process) has not pinged either; by the next tick both are read
        silent, self._silent = self._silent, set()
        for links in list(self.links.values()):
            for link in list(links):
                if now - link.last_rx > self.dead_after:
                    if link not in silent:
                        self._silent.add(link)
                        self._send_ping(link)
                        continue
                    self.stats["link_dead"] += 1
                    log.info("mesh link %s silent for %.1fs; closing", link.url, now - link.last_rx)
                    links.remove(link)  # withdraw now; connection_lost may come later
                    self._links_changed()
                    self._forget_link(link)  # before abort: what it still held is counted
                    link.abort()
                    continue
                if self._stalled(link, now):
                    links.remove(link)
                    self._links_changed()
                    self._forget_link(link)
                    link.abort()
                    continue
                if self._pings(link, now):
                    self._send_ping(link)
                self._report_counters(link)
        gone = self.table.expire(now)
        if gone:
            self._tell_forgotten(gone)
        self._watch_revocation_file()
        if self.traversal is not None:
            self.traversal.tick(now)
        if self._pinned:
            self._unpin_finished()
        self._ticks += 1
        if self._ticks % EXPIRY_CHECK_TICKS == 0:
            self._enforce_certificates()
        self._sync()
        self.flush_counts()
        if self._running:
            self._tick_handle = self.loop.call_later(self.ping_interval, self._tick)

    def flush_counts(self) -> None:
        """Add what the hot path counted in plain ints to the metrics (every tick, and at stop)."""
        if self.relayed:
            _forwarded.inc(self.relayed)
            self.relayed = 0

    def _stalled(self, link: LinkBase, now: float) -> bool:
        """A link whose peer stopped reading: it holds more than limits.mesh_link_buffer and
        nothing left it for limits.mesh_link_stall. Closed, so what was queued for that peer
        (stream frames up to their windows, relayed ones) is freed, not held for ever."""
        drained = link.drained()
        if drained is None or link.buffered() <= self.link_buffer:
            link.stall = (0, 0.0)
            return False
        mark, since = link.stall
        if drained != mark or not since:
            link.stall = (drained, now)
            return False
        if now - since < self.config.limits.mesh_link_stall:
            return False
        self.stats["link_not_reading"] += 1
        _links_closed.labels("not_reading").inc()
        _rlog.warning(f"stall:{link.url}", "mesh link %s: its peer has read nothing for %.0fs with %d bytes"
                      " queued (limits.mesh_link_stall); closing", link.url, now - since, link.buffered())
        return True

    def _forget_link(self, link: LinkBase) -> None:
        assert link.peer is not None
        nid = link.peer.node_id
        self._link_gone(link)
        _links_gauge.dec()
        if not self.links.get(nid):
            self.links.pop(nid, None)
            self.table.neighbour_down(nid)
        else:
            self.table.link_lost(nid)
        link.mark_dead()
        self._update_neighbours()

    def _report_counters(self, link: LinkBase) -> None:
        """Per-link byte counts and the codec's drop counts, flushed once per tick."""
        assert link.peer is not None
        seen = link.drops_reported
        now_drops = link.drop_counts()
        for reason, new, old in zip(("replayed", "forged", "malformed"), now_drops, seen, strict=True):
            if new > old:
                _records_dropped.labels(reason).inc(new - old)
                self.stats[f"records_{reason}"] += new - old
                _rlog.debug(f"{reason}:{link.url}", "%d %s records from %s", new - old, reason, link.url)
        link.drops_reported = now_drops
        bin_, bout = link.bytes_reported
        label = f"{link.peer.node_id:08x}"
        if link.bytes_in > bin_:
            _link_bytes.labels(label, "in").inc(link.bytes_in - bin_)
        if link.bytes_out > bout:
            _link_bytes.labels(label, "out").inc(link.bytes_out - bout)
        link.bytes_reported = (link.bytes_in, link.bytes_out)

    def _on_pong(self, link: LinkBase, body: memoryview) -> None:
        if len(body) not in (U64.size, PING_BODY.size) or link.peer is None:
            return
        rtt = rtt_clock_us() - U64.unpack_from(body)[0]
        if not 0 <= rtt < 1 << 32:
            return  # not a token this process sent
        link.rtt_sample(max(1, rtt))
        self._latency_changed(link.peer.node_id)

    # ------------------------------------------------------------------ routing sync

    def _schedule_sync(self) -> None:
        if not self._sync_scheduled and self.loop is not None:
            self._sync_scheduled = True
            self.loop.call_soon(self._sync)

    def _sync(self) -> None:
        self._sync_scheduled = False
        now = self.loop.time()
        if self.table.unchecked:
            wait = self._last_settle + SETTLE_INTERVAL - now
            if wait <= 0:
                self._settle(now)
            elif self._settle_timer is None:
                self._settle_timer = self.loop.call_later(wait, self._settle_later)
        if self.table.dirty:
            # while records pour in (a mesh forming, a flap) build at most once per interval;
            # the first change after a quiet spell still builds at once
            due = self._build_due()
            if due <= now:
                self._build(now, settle=False)
            elif self._build_timer is None or self._build_at > due:
                if self._build_timer is not None:
                    self._build_timer.cancel()
                self._build_at = due  # (uvloop hands a plain Handle for a delay under 1 ms)
                self._build_timer = self.loop.call_later(due - now, self._build_later)
        self._flood(now)

    def _build_due(self) -> float:
        """When the next build may run: the interval after the last one, or once no record
        changed for BUILD_QUIET of it (a flood that ended), but never before the floor."""
        last = self._last_build
        quiet = self._last_change + BUILD_QUIET * self._build_interval
        return max(last + self._build_floor, min(last + self._build_interval, quiet))

    def _settle(self, now: float) -> None:
        """Check the records held since the last settle and store what passes: stored ones
        are pending for every neighbour, so the flood that follows passes them on now."""
        self._last_settle = now
        stored = self.table.settle(SETTLE_BATCH)
        if stored and self.table.dirty:
            self._last_change = now
            self._changes += stored
        if self.table.unchecked and self._settle_timer is None:
            self._settle_timer = self.loop.call_soon(self._settle_later)

    def _settle_later(self) -> None:
        self._settle_timer = None
        if self.table.unchecked:
            self._settle(self.loop.time())
            self._sync()

    def _build_later(self) -> None:
        self._build_timer = None
        if self.table.dirty:
            now = self.loop.time()
            due = self._build_due()
            if due > now:  # records changed since this was set for a quiet spell
                self._build_at = due
                self._build_timer = self.loop.call_later(due - now, self._build_later)
            else:
                self._build(now, settle=False)

    def _build(self, now: float, settle: bool = True) -> None:
        """Build the routes; with `settle` (a route needed now, a reload) every held record is
        checked first, else only what the settle slices stored so far counts."""
        if settle and (stored := self.table.settle()):
            self._last_settle = now
            self._changes += stored
            self._schedule_sync()  # flood what was stored
        # the CPU the build took, not the wall time: on a busy host a build the scheduler
        # paused would stretch the interval for nothing
        t0 = time.thread_time()
        self.table.build(settle=False)
        took = time.thread_time() - t0
        floor = self._build_floor = min(MAX_BUILD_INTERVAL, max(MIN_BUILD_INTERVAL, 10 * took))
        if self._changes > FLOOD_CHANGES and now - self._last_build <= 2 * self._build_interval:
            # records kept changing through the last interval: back off (bounded)
            self._build_interval = min(MAX_BUILD_INTERVAL, max(floor, 2 * self._build_interval))
        else:
            self._build_interval = floor
        self._changes = 0
        self._last_build = now
        self.table.mark_unreachable(now)
        reachable = set(self.table.hop_paths)
        records = self.table.records
        if self.mux is not None:
            for gone in self._reachable - reachable:
                self.mux.drop_peer(gone)
                self.e2e.drop(gone)
        processes, links, e2e = self._processes, self.links, self.e2e.sessions
        for o in [o for o in processes if o not in reachable and o not in links and o not in e2e]:
            del processes[o]  # bounded by what is reachable, linked or in session
        for o in reachable:
            rec = records[o]
            self._heard_process(o, rec.session, rec.version)
        self._reachable = reachable

    def _process_current(self, node: int, session: int, start: int) -> bool:
        """Whether `node`'s process (`session`, started at record version `start`) is the newest
        heard of, or newer."""
        known = self._processes.get(node)
        return known is None or known[0] == session or start > known[1]

    def _heard_process(self, node: int, session: int, floor: int | None, current_e2e: bool = False) -> None:
        """`node` runs as `session` (a record of that version, a process that started at `floor`,
        or, with None, its HELLO on a link up now). If that is news, a node that restarted (same
        id, new session) lost its streams and end-to-end session: so do we, here, once, at the
        first sign, whichever comes first; what is set up with the new process after it stays.
        `current_e2e`: the end-to-end session is the new process's own (it just told us)."""
        known = self._processes.get(node)
        if known is not None and known[0] == session:
            return
        floor_given = floor
        if floor is None:  # a link is up with it now: its newest process, whatever we held
            floor = max(known[1] if known is not None else -1, self._record_version(node))
        elif known is not None and floor <= known[1]:
            return  # an older process's record (or late message) than the one we know
        if known is None and len(self._processes) >= (
            self.table.max_records + self.e2e.max_sessions + self.config.limits.max_peers
        ):
            return  # (between builds, which prune it) only restarts go unseen, as before
        self._processes[node] = (session, floor)
        if known is None or node == self.node_id or self.mux is None:
            return
        self.stats["peer_restarts"] += 1
        _peer_restarts.labels("hello" if floor_given is None else "e2e" if current_e2e else "record").inc()
        self.mux.drop_peer(node)
        if not current_e2e:
            self.e2e.drop(node)

    def _record_version(self, node: int) -> int:
        rec = self.table.records.get(node)
        return rec.version if rec is not None else -1

    def _flood(self, now: float) -> None:
        for nid in list(self.links):
            records = self.table.records_to_send(nid, now)
            if not records:
                continue
            link = self._best_link(nid)
            if link is None:
                continue
            for body in encode_records(records, MAX_BODY):
                link.send_frame(ROUTES, 0, 1, self.node_id, nid, body)

    def _tell_forgotten(self, gone: list[int]) -> None:
        """Records expired here: each neighbour hears (origin, FORGOTTEN), so one that still
        counts them as acknowledged by us sends them again if it can reach their origin."""
        for nid in list(self.links):
            link = self._best_link(nid)
            if link is None:
                continue
            for i in range(0, len(gone), FORGOTTEN_PER_FRAME):
                acks = encode_acks((o, FORGOTTEN) for o in gone[i:i + FORGOTTEN_PER_FRAME])
                link.send_frame(ROUTE_ACK, 0, 1, self.node_id, nid, acks)

    def _on_routes(self, link: LinkBase, body: memoryview) -> None:
        assert link.peer is not None
        try:
            acks = self.table.receive_body(link.peer.node_id, body, self.loop.time())
        except RecordError as e:
            _frames_dropped.labels("bad_routes").inc()
            _rlog.debug(f"routes:{link.url}", "bad route records from %s: %s", link.url, e)
            return
        if acks:
            link.send_frame(ROUTE_ACK, 0, 1, self.node_id, link.peer.node_id, encode_acks(acks))
        self._schedule_sync()

    # ------------------------------------------------------------------ frames

    def on_frame(
        self, link: LinkBase, ftype: int, flags: int, hop: int, src: int, dst: int, body: memoryview
    ) -> None:
        if ftype in LINK_LOCAL:
            if ftype == PING:
                self._on_ping(link, body)
            elif ftype == PONG:
                self._on_pong(link, body)
            elif ftype == ROUTES:
                self._on_routes(link, body)
            elif ftype == REVOCATION:
                self._on_revocation(link, body)
            elif ftype == ROUTE_ACK:
                try:
                    acks = decode_acks(body)
                except RecordError:
                    _frames_dropped.labels("bad_ack").inc()
                    return
                assert link.peer is not None
                if self.table.receive_acks(link.peer.node_id, acks, self.loop.time()):
                    self._schedule_sync()  # a record the neighbour expired, alive here: again
            else:
                _frames_dropped.labels("unexpected_hello").inc()
            return
        if dst == self.node_id:
            self._deliver(link, ftype, flags, src, body)
            return
        # a frame for another node: relay it
        if hop <= 1:
            _frames_dropped.labels("hop_limit").inc()
            self.stats["hop_limit"] += 1
            _rlog.debug(f"hop:{src}", "frame %08x->%08x hit the hop limit", src, dst)
            self._refuse_relayed_open(ftype, src, dst, body, TTL_EXPIRED)
            return
        # the route cache inline (the relay's hot path; _route_link keeps it)
        out = (self._route_cache.get(dst | (flags & FLAG_LATENCY) << 31)
               if self._route_cache_version == self.table.version else None)
        if out is None:
            out = self._route_link(dst, flags)
        if out is None:
            _frames_dropped.labels("no_route").inc()
            _rlog.debug(f"noroute:{dst}", "no route to %08x for a frame from %08x", dst, src)
            self._refuse_relayed_open(ftype, src, dst, body, NETWORK_UNREACHABLE)
            return
        if ftype in UNRELIABLE and out.buffered() > self.link_buffer:
            _datagrams.labels("dropped_congested").inc()
            return
        self.relayed += 1
        out.send_frame(ftype, flags, hop - 1, src, dst, body)

    def _refuse_relayed_open(self, ftype: int, src: int, dst: int, body: memoryview, code: int) -> None:
        """A relay that cannot deliver a stream frame or a session set-up says so to its
        source, so the opener's streams to `dst` fail now instead of timing out. The relay
        cannot see which frame it was (sealed), so the source fails only streams still
        opening; an unsealed OPEN gets the STREAM_RESET it always did."""
        back = self._route_link(src, 0)
        if back is None:
            return
        if ftype == STREAM_OPEN and len(body) >= 4:
            sid = struct.unpack_from("!I", body)[0]
            back.send_frame(STREAM_RESET, 0, DEFAULT_HOP_LIMIT, dst, src, RESET.pack(sid, code))
        elif ftype in (SEALED, E2E_INIT):
            back.send_frame(UNREACHABLE, 0, DEFAULT_HOP_LIMIT, self.node_id, src, UNREACH.pack(dst, code))

    # ------------------------------------------------------------------ end to end

    def _deliver(self, link: LinkBase, ftype: int, flags: int, src: int, body: memoryview) -> None:
        """A frame for this node. Sealed ones are opened with the session with `src` (so `src`
        is authenticated); unsealed end-to-end frames are taken only from a link to `src`
        itself, whose HELLO proved who it is: a relay cannot speak in another node's name."""
        assert link.peer is not None
        if ftype in (SEALED, DATAGRAM_SEALED):
            try:
                ftype, flags, body = self.e2e.open(src, body, ftype == DATAGRAM_SEALED)
            except E2eError as e:
                self._e2e_drop(e.reason, src, link)
                return
        elif ftype == E2E_INIT:
            self._on_e2e_init(link, src, flags, body)
            return
        elif ftype == E2E_RESP:
            self._on_e2e_resp(link, src, body)
            return
        elif ftype == UNREACHABLE:
            if len(body) == UNREACH.size and self.mux is not None:
                dst, code = UNREACH.unpack(body)
                self.mux.fail_opening(dst, code)
            return
        elif link.peer.node_id != src:
            if ftype == STREAM_RESET and self.mux is not None:
                self.mux.relay_refusal(src, body)  # a relay refusing an OPEN it could not deliver
                return
            self._e2e_drop("unsealed_relayed", src, link)
            return
        if ftype == DATAGRAM:
            self._on_datagram(src, body)
        elif ftype == TRAVERSAL:
            if self.traversal is not None:
                self.traversal.on_call(src, body)
            else:
                _frames_dropped.labels("traversal_off").inc()
        elif ftype in FRAME_NAMES and self.mux is not None:
            if ftype == STREAM_OPEN:
                self._remember_way_back(src, link)
            self.mux.on_frame(ftype, flags, src, body)
        else:
            _frames_dropped.labels("unknown_type").inc()
            _rlog.debug(f"type:{link.url}", "unknown frame type %d from %s", ftype, link.url)

    def _e2e_drop(self, reason: str, src: int, link: LinkBase) -> None:
        _e2e_dropped.labels(reason).inc()
        self.stats[f"e2e_dropped_{reason}"] += 1
        _rlog.debug(f"e2e:{reason}:{src}", "end-to-end frame from %08x (via %s) dropped: %s",
                    src, link.url, reason)

    def _on_e2e_init(self, link: LinkBase, src: int, flags: int, body: memoryview) -> None:
        try:
            resp, flush = self.e2e.on_init(src, bytes(body), self.loop.time(), flags)
        except E2eError as e:
            self._e2e_drop(e.reason, src, link)
            return
        if resp is None:
            return
        self._new_e2e_session(src)
        self._remember_way_back(src, link)
        self._send_e2e(src, [(E2E_RESP, resp), *flush])

    def _on_e2e_resp(self, link: LinkBase, src: int, body: memoryview) -> None:
        try:
            flush = self.e2e.on_resp(src, bytes(body))
        except E2eError as e:
            self._e2e_drop(e.reason, src, link)
            return
        self._new_e2e_session(src)
        self._send_e2e(src, flush)

    def _new_e2e_session(self, src: int) -> None:
        """A session with `src` is up: if its process said which it is, that may be news."""
        s = self.e2e.sessions.get(src)
        if s is not None and s.process is not None:
            self._heard_process(src, s.process[0], s.process[1], current_e2e=True)

    def _send_e2e(self, dst: int, frames: list[tuple[int, bytes]]) -> None:
        out = self._route_link(dst, self.policy_flag) or self._way_back(dst)
        if out is None:
            return
        for otype, obody in frames:
            out.send_frame(otype, self.policy_flag, DEFAULT_HOP_LIMIT, self.node_id, dst, obody)

    def _check_e2e_peer(self, src: int, public: bytes, cert: bytes) -> str | None:
        held = self.table.records.get(src)
        return self.trust.check_e2e_peer(public, cert, held.key if held is not None else b"", time.time())

    def _send_sealed(
        self, link: LinkBase, dst: int, ftype: int, flags: int, body: bytes, datagram: bool
    ) -> bool:
        """Seal a frame for `dst` (relayed: the next hop is not `dst`)."""
        rec = self.table.records.get(dst)
        static = rec.key[32:] if rec is not None and len(rec.key) == 64 else b""
        if not static and dst not in self.e2e.sessions:
            return False
        frames, _ = self.e2e.seal(
            dst, static, ftype, flags, body, self.loop.time(), datagram,
            tell=rec is not None and rec.reads_process,
        )
        outer = flags & FLAG_LATENCY
        for otype, obody in frames:
            oflags = outer | self.e2e.init_flags if otype == E2E_INIT else outer  # the AEAD offer
            link.send_frame(otype, oflags, DEFAULT_HOP_LIMIT, self.node_id, dst, obody)
        return True

    def _next_hop(self, dst: int, flags: int) -> int | None:
        p = (self.table.lat_paths if flags & FLAG_LATENCY else self.table.hop_paths).get(dst)
        return p.next_hop if p is not None and p.hops else None

    def _route_link(self, dst: int, flags: int) -> LinkBase | None:
        """The link a frame to `dst` leaves on (by least latency with FLAG_LATENCY), or None."""
        cache = self._route_cache
        version = self.table.version
        if self._route_cache_version != version:
            cache.clear()
            self._route_cache_version = version
        key = dst | (flags & FLAG_LATENCY) << 31  # FLAG_LATENCY is 2: bit 32, above any node id
        link = cache.get(key)
        if link is not None:
            return link
        link = self._find_route_link(dst, flags)
        # kept only when it is its neighbour's one link, and only for this table version: a
        # build (new routes) or a link added or removed changes the answer
        if (link is not None and link.peer is not None and self._route_cache_version == self.table.version
                and len(self.links.get(link.peer.node_id, ())) == 1):
            cache[key] = link
        return link

    def _find_route_link(self, dst: int, flags: int) -> LinkBase | None:
        nh = self._next_hop(dst, flags)
        if nh is None and (self.table.dirty or self.table.unchecked):
            # a build is being held back (records still arriving), but someone needs
            # this route now (e.g. the reply to an OPEN from a node we just heard of)
            self._build(self.loop.time())
            nh = self._next_hop(dst, flags)
        if nh is None:
            return None
        link = self._best_link(nh)
        if link is None and self._originate_timer is not None:
            # the next hop's last link just went (a direct link closed, a neighbour lost) and
            # the own record still names it: re-originate and rebuild now, so this frame takes
            # the route there is (through a relay) instead of failing for ORIGINATE_DELAY
            self._originate_timer.cancel()
            self._originate(wait=False)
            self._build(self.loop.time())
            nh = self._next_hop(dst, flags)
            link = self._best_link(nh) if nh is not None else None
        return link

    def send(
        self, ftype: int, flags: int, dst: int, head: bytes, data: bytes | bytearray | memoryview = b""
    ) -> bool:
        """Send an end-to-end frame from this node; False if there is no route."""
        flags |= self.policy_flag
        if ftype in STREAM_FRAMES and len(head) >= 4:
            link = self._stream_link(dst, flags, head)
        else:
            link = self._route_link(dst, flags) or self._way_back(dst)
        if link is None:
            return False
        assert link.peer is not None
        if link.peer.node_id != dst:  # relayed: sealed end to end
            if self.traversal is not None and ftype != TRAVERSAL:
                self.traversal.relayed(dst)
            sealed = self.e2e.seal_now(dst, ftype, flags, head, data)
            if sealed is not None:  # the session is up: sealed in place, no queue or set-up
                link.send_frame(SEALED, flags & FLAG_LATENCY, DEFAULT_HOP_LIMIT, self.node_id, dst, *sealed)
                return True
            return self._send_sealed(link, dst, ftype, flags, bytes(head) + bytes(data), False)
        link.send_frame(ftype, flags, DEFAULT_HOP_LIMIT, self.node_id, dst, head, data)
        return True

    def _stream_link(self, dst: int, flags: int, head: bytes | bytearray | memoryview) -> LinkBase | None:
        """The link a stream's frames take: the one its earlier frames took, while it is up
        and some of the stream's data is in flight (`_pinned`: a new route or a second link to
        the same neighbour would let later bytes overtake earlier ones). When the route's next
        hop is another node, the stream drains (MeshStream.drain) and then moves."""
        key = (SID.unpack_from(head)[0], bool(flags & FLAG_OPENER))
        route = self._route_link(dst, flags)
        pins = self._pinned.get(dst)
        if pins is not None:
            link = pins.get(key)
            if link is not None:
                if not link.gone_seen:
                    if (route is None or self.mux is None or route.peer is None or link.peer is None
                            or route.peer.node_id == link.peer.node_id):
                        # no route, or the same next hop (another link to the same neighbour
                        # is no better for long: moving would flap with write-paused links)
                        return link
                    stream = self.mux.streams.get((dst, key[0], key[1]))
                    if stream is None or (dst, key[0], key[1]) in self._stay:
                        return link
                    if not stream.quiet:
                        # a better path: hold the stream's new data until what it sent
                        # arrived, then it moves (the frame in hand still goes the old way)
                        stream.drain(DRAIN_GIVE_UP)
                        return link
                    self.stats["streams_moved"] += 1
                else:
                    del pins[key]
        link = route or self._way_back(dst)
        if link is not None:
            if pins is None:
                pins = self._pinned[dst] = {}
            pins[key] = link
        return link

    def _remember_way_back(self, src: int, link: LinkBase) -> None:
        """The link a stream OPEN from `src` came in on. An OPEN can arrive before this node
        can route to its opener (a node that just (re)started sends it as soon as it has a
        route, while its new record and its relay's are still on their way), so the answer
        goes back the way the OPEN came until the routes catch up."""
        ways = self._ways_back
        ways.pop(src, None)
        ways[src] = link
        if len(ways) > self.config.limits.route_records:
            del ways[next(iter(ways))]  # bounded: the oldest goes

    def _way_back(self, dst: int) -> LinkBase | None:
        link = self._ways_back.get(dst)
        if link is None or link.peer is None or link not in self.links.get(link.peer.node_id, ()):
            return None
        self.stats["sent_way_back"] += 1
        return link

    # ------------------------------------------------------------------ traversal

    def peer_key(self, nid: int) -> bytes | None:
        """A node's public key (signing + X25519) from its signed record, or its link's HELLO."""
        rec = self.table.records.get(nid)
        if rec is not None and rec.key:
            return rec.key
        for link in self.links.get(nid, ()):
            if link.peer is not None and link.peer.key:
                return link.peer.key
        return None

    def inside_mesh(self, host: str) -> bool:
        """An address the mesh carries (virtual IPs, proxy CIDRs): never a traversal endpoint,
        or the direct link would run through the mesh it stands for (a TUN node's own
        meshgate0 address is one of the host's interface addresses)."""
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            return True
        return self.table.inside_mesh(ip)

    def send_traversal(self, dst: int, body: bytes) -> bool:
        return self.send(TRAVERSAL, 0, dst, body)

    def make_udp_link(self, url: str, initiator: bool, sock: Any, addr: Any) -> link_udp.UdpLink:
        from meshgate.mesh import link_udp

        return link_udp.UdpLink(self, url, initiator, sock, addr, self.config.limits)

    def _unpin_finished(self) -> None:
        """Once a tick: forget the pins of streams that ended."""
        assert self.mux is not None
        streams = self.mux.streams
        for peer, pins in list(self._pinned.items()):
            for key in [k for k in pins if (peer, k[0], k[1]) not in streams]:
                del pins[key]
            if not pins:
                del self._pinned[peer]
        self._stay.intersection_update(streams)

    def _link_gone(self, link: LinkBase) -> None:
        """A link went. Frames it still held (not yet sent, or on udp:// not yet acknowledged)
        are lost with it; a stream that had some there would go on with a gap in its bytes, so
        the streams whose frames go out on it (`_pinned`) are reset at both ends rather than
        corrupted. A link that held nothing (an idle
        one) costs no stream: they all take the route there is. (On a byte-pipe link, bytes
        already in the kernel's socket buffer are not seen here.)"""
        if link.gone_seen:
            return
        link.gone_seen = True
        if self.traversal is not None:
            self.traversal.link_down(link)
        lost = link.undelivered()
        if link.peer is None or self.mux is None or not lost:
            return
        reset = 0
        for dst, pins in list(self._pinned.items()):
            keys = {k for k, via in pins.items() if via is link}
            if keys:
                reset += self.mux.reset_streams(dst, NETWORK_UNREACHABLE, keys)
        if reset:
            self.stats["streams_reset_link_lost"] += reset
            log.info("mesh link %s lost with %d bytes not delivered: %d streams reset",
                     link.url, lost, reset)

    # ------------------------------------------------------------------ datagrams

    def send_datagram(self, node_id: int, channel: int, payload: bytes | memoryview) -> bool:
        """Unreliable: False when there is no route or the link is congested (dropped, counted)."""
        return self.send_datagram_prefixed(node_id, CHANNEL.pack(channel), payload)

    @staticmethod
    def datagram_prefix(channel: int, head: bytes = b"") -> bytes:
        """The bytes of a DATAGRAM body before its payload: the channel, then `head` (a
        feature's own header). Built once per destination by a caller that sends many."""
        return CHANNEL.pack(channel) + head

    def send_datagram_prefixed(self, node_id: int, prefix: bytes, payload: bytes | memoryview) -> bool:
        """`send_datagram` with the body's start prebuilt (`datagram_prefix`): prefix and payload
        go into the link's batch as two parts, so the payload is not first joined to its headers
        in a temporary copy (the caller may reuse its buffer as soon as this returns)."""
        if node_id == self.node_id:
            channel = CHANNEL.unpack_from(prefix)[0]
            self.loop.call_soon(self._deliver_datagram, node_id, channel, b"".join((prefix[2:], payload)))
            return True
        flags = self.policy_flag
        link = self._route_link(node_id, flags)
        if link is None:
            _datagrams.labels("dropped_no_route").inc()
            return False
        if link.buffered() > self.link_buffer:
            _datagrams.labels("dropped_congested").inc()
            return False
        assert link.peer is not None
        if link.peer.node_id != node_id:  # relayed: sealed end to end (the seal takes one body)
            if self.traversal is not None:
                self.traversal.relayed(node_id)
            return self._send_sealed(link, node_id, DATAGRAM, flags, b"".join((prefix, payload)), True)
        link.send_frame(DATAGRAM, flags, DEFAULT_HOP_LIMIT, self.node_id, node_id, prefix, payload)
        return True

    def datagram_room(self, node_id: int) -> int:
        """The largest payload a datagram to `node_id` carries whole over the next hop (smaller
        than a frame on a udp:// link, where a bigger one is cut into pieces, each loss losing
        it whole): the TUN path bundles packets up to this."""
        link = self._route_link(node_id, self.policy_flag)
        room = link.datagram_room() if link is not None else MAX_BODY
        if link is not None and link.peer is not None and link.peer.node_id != node_id:
            room -= SEAL_OVERHEAD  # relayed: sealed end to end
        return room - CHANNEL.size

    def on_datagram(self, channel: int, callback: DatagramCallback) -> None:
        """`callback(src, payload)` for each datagram on `channel`, the payload its own bytes."""
        self._datagram_views.pop(channel, None)
        self._datagram_handlers[channel] = callback

    def on_datagram_view(self, channel: int, callback: DatagramViewCallback) -> None:
        """`callback(src, view)` for each datagram on `channel`: the payload read in place in the
        opened record, no copy; the view is released when the callback returns."""
        self._datagram_handlers.pop(channel, None)
        self._datagram_views[channel] = callback

    def _on_datagram(self, src: int, body: memoryview) -> None:
        if len(body) < 2:
            _datagrams.labels("malformed").inc()
            return
        channel = CHANNEL.unpack_from(body)[0]
        if channel in self._datagram_views:
            self._deliver_view(src, channel, body[2:])
            return
        self._deliver_datagram(src, channel, bytes(body[2:]))

    def _deliver_view(self, src: int, channel: int, payload: memoryview) -> None:
        try:
            self._datagram_views[channel](src, payload)
        except Exception:
            log.exception("datagram handler for channel %d failed", channel)
        finally:
            payload.release()  # a handler that kept it fails loudly instead of reading reused memory

    def _deliver_datagram(self, src: int, channel: int, payload: bytes) -> None:
        if channel in self._datagram_views:  # delivered to this node by itself (send_datagram)
            self._deliver_view(src, channel, memoryview(payload))
            return
        handler = self._datagram_handlers.get(channel)
        if handler is None:
            _datagrams.labels("no_handler").inc()
            return
        try:
            handler(src, payload)
        except Exception:
            log.exception("datagram handler for channel %d failed", channel)

    # ------------------------------------------------------------------ streams

    async def open_stream(
        self, node_id: int, host: str, port: int, protocol_factory: Callable[[], asyncio.BaseProtocol]
    ) -> tuple[asyncio.BaseTransport, asyncio.BaseProtocol]:
        """Open a stream to `host:port` leaving the mesh at `node_id`; StreamError on failure."""
        if node_id == self.node_id:
            try:
                return await self.egress_connect(host, port, protocol_factory)
            except StreamError:
                raise
            except Exception as e:
                raise StreamError(replies.for_exception(e), str(e)) from None
        if self.mux is None:
            raise StreamError(GENERAL_FAILURE, "mesh not started")
        stream, fut = self.mux.open(node_id, host, port)
        # when the wait below gives up, the future still fails later (the stream's removal):
        # retrieve that so it is not reported as an unhandled error
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())
        try:
            await asyncio.wait_for(asyncio.shield(fut), OPEN_TIMEOUT)
        except TimeoutError:
            stream.reset(TTL_EXPIRED, local=True)
            raise StreamError(TTL_EXPIRED, "stream open timed out") from None
        except asyncio.CancelledError:
            stream.reset(GENERAL_FAILURE, local=True)
            raise
        protocol = protocol_factory()
        stream.attach(protocol)
        return stream, protocol

    def _on_open(self, stream: MeshStream, host: str, port: int) -> None:
        self._spawn(self._egress(stream, host, port))

    async def _egress(self, stream: MeshStream, host: str, port: int) -> None:
        assert self.mux is not None
        to_mesh = SplicePipe(stream)
        try:
            transport, _ = await self.egress_connect(host, port, lambda: to_mesh, stream.peer)
        except Exception as e:
            code = replies.for_exception(e)
            self.stats[f"egress_failed_{code}"] += 1
            _rlog.debug(f"egress:{host}", "egress to %s:%d for %08x failed: %s", host, port, stream.peer, e)
            self.mux.refuse(stream, code)
            return
        # uvloop's transports are not asyncio.Transport subclasses: cast, don't assert
        transport = cast(asyncio.Transport, transport)
        if stream.closed:
            transport.abort()
            return
        if not self.mux.accept(stream):
            transport.abort()
            return
        stream.attach(SplicePipe(transport))

    # ------------------------------------------------------------------ queries

    def lookup(self, ip: IPAddress) -> Route | None:
        return self.table.lookup(ip, latency=bool(self.policy_flag))

    def dns_servers(self) -> tuple[int, dict[str, list[tuple[int, str]]]]:
        """(generation, suffix -> [(node id, name)] nearest first): the DNS suffixes other
        reachable nodes serve (their records' dns.serve_suffixes). The generation changes with
        every route build, so a caller rebuilds what it derives only then."""
        table = self.table
        cached = self._dns_servers
        if cached is not None and cached[0] == table.version:
            return cached  # asked on every DNS cache miss: walk the records once per build
        out: dict[str, list[tuple[int, str]]] = {}
        paths = table.hop_paths
        for origin in sorted(paths, key=lambda o: (paths[o].hops, paths[o].latency_us, o)):
            rec = table.records.get(origin)
            if origin == self.node_id or rec is None:
                continue
            for suffix in rec.dns:
                out.setdefault(suffix, []).append((origin, rec.name))
        self._dns_servers = (table.version, out)
        return self._dns_servers

    def name_table(self) -> dict[str, tuple[ipaddress.IPv4Address | None, ipaddress.IPv6Address | None]]:
        out: dict[str, tuple[ipaddress.IPv4Address | None, ipaddress.IPv6Address | None]] = {}
        for origin in self.table.reachable():  # sorted: the lowest id keeps a duplicated name
            rec = self.table.records[origin]
            if rec.name and rec.name not in out:
                out[rec.name] = (rec.ipv4.ip if rec.ipv4 else None, rec.ipv6.ip if rec.ipv6 else None)
        return out

    def peers(self) -> list[dict[str, Any]]:
        out = []
        for nid, links in sorted(self.links.items()):
            for link in links:
                ident = self.peer_identity.get(link)
                out.append({
                    "id": f"{nid:08x}",
                    "name": link.peer.name if link.peer else "",
                    "fingerprint": ident.fingerprint[:16] if ident is not None else "",
                    "url": link.url,
                    "path": self._path_word(link),
                    "latency_ms": round(link.latency_us / 1000, 3),
                    "aead": link.aead,
                    "bytes_in": link.bytes_in,
                    "bytes_out": link.bytes_out,
                })
        return out + self._relayed_rows()

    def _path_word(self, link: LinkBase) -> str:
        if link.traversal_kind:
            return "direct (traversal, " + ("local" if link.traversal_kind == 1 else "reflexive") + ")"
        return "configured" if link in self._dialed.values() else "accepted"

    def _relayed_rows(self) -> list[dict[str, Any]]:
        """Nodes this node has traffic with through a relay (punching state), for /peers."""
        if self.traversal is None:
            return []
        out = []
        now = self.loop.time()
        for nid, pair in self.traversal.pairs.table.items():
            if nid in self.links or nid not in self.table.hop_paths:
                continue
            rec = self.table.records.get(nid)
            via = self.table.hop_paths[nid].next_hop
            via_rec = self.table.records.get(via)
            state = ("punching" if pair.started >= 0 else
                     f"next try in {max(0.0, pair.not_before - now):.0f}s" if pair.failures else "idle")
            out.append({
                "id": f"{nid:08x}", "name": rec.name if rec else "", "fingerprint": "",
                "url": "", "path": f"relayed via {via_rec.name if via_rec else f'{via:08x}'} ({state})",
                "latency_ms": round(self.table.hop_paths[nid].latency_us / 1000, 3),
                "aead": "", "bytes_in": 0, "bytes_out": 0,
            })
        return out

    def routes(self) -> list[dict[str, Any]]:
        """Every reachable node. `next_hop`/`hops`/`latency_ms` are the least-hop route,
        the same with `_ll` the least-latency one (flat, so the CLI prints one table)."""
        out = []
        t = self.table
        for origin in t.reachable():
            rec = t.records[origin]
            hop, lat = t.hop_paths[origin], t.lat_paths[origin]
            out.append({
                "id": f"{origin:08x}",
                "name": rec.name,
                "ipv4": str(rec.ipv4.ip) if rec.ipv4 else None,
                "ipv6": str(rec.ipv6.ip) if rec.ipv6 else None,
                "proxy_cidrs": [str(n) for n, _ in rec.cidrs],
                "exit": rec.exit,
                "next_hop": f"{hop.next_hop:08x}",
                "hops": hop.hops,
                "latency_ms": round(hop.latency_us / 1000, 3),
                "next_hop_ll": f"{lat.next_hop:08x}",
                "hops_ll": lat.hops,
                "latency_ms_ll": round(lat.latency_us / 1000, 3),
            })
        return out

    def traversal_text(self) -> str:
        """NAT traversal in words, for `meshgate status`: on (port, endpoints, direct links) or
        off and why."""
        t = self.traversal
        if t is None:
            return self.traversal_off
        st = t.status()
        eps = ", ".join(st["endpoints"]) or "no endpoints known yet"
        return f"on, udp port {st['port']}: {eps}; {st['direct_links']} direct links by traversal"

    def identity_text(self) -> str:
        """The mode in words, for `meshgate status`."""
        own = self.trust.own_cert
        if own is None:
            return "secret mode (no certificate)"
        expires = time.strftime("%Y-%m-%d", time.gmtime(own.not_after))
        rl = self.trust.revocation
        serial = f", revocation list serial {rl.serial}" if rl is not None else ""
        return f"certificate {own.fingerprint[:16]}… (expires {expires}{serial})"

    def status(self) -> dict[str, Any]:
        rl = self.trust.revocation
        return {
            "id": self.node_id_text,
            "fingerprint": self.identity.fingerprint,
            "identity": self.identity_text(),
            "revocation_serial": rl.serial if rl is not None else None,
            "listen": ", ".join(self.listen_addrs),
            "peers": sum(len(v) for v in self.links.values()),
            "nodes": len(self.table.hop_paths),
            "streams": len(self.mux) if self.mux is not None else 0,
            "traversal": self.traversal.status() if self.traversal is not None else self.traversal_off,
            "notes": [],
        }


async def _refuse_streams(
    host: str, port: int, factory: Any, source: int = 0
) -> tuple[asyncio.BaseTransport, Any]:
    raise StreamError(NOT_ALLOWED, f"this node serves no streams ({host}:{port})")
