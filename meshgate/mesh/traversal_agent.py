"""The asyncio adapter of NAT traversal (mesh/traversal.py): one per node, on its traversal
socket (the node's udp:// listener, or one bound to an ephemeral port when it has udp://
peers but no listener).

- **Discovery.** Every `mesh.traversal_keepalive` seconds (and when a udp:// link comes up)
  the node pings, from its traversal socket, the listener of each udp:// neighbour it dialed;
  each PONG says the address the neighbour saw: a reflexive endpoint. Local endpoints are the
  host's interface addresses with the traversal socket's port. The pings also keep that
  socket's NAT mapping alive.
- **Punching.** Traffic to a node through a relay (`relayed(peer)`, from MeshService.send)
  starts an attempt when the pair is not backing off: a TRAVERSAL call (end to end, sealed)
  with our endpoints; the callee calls back with its own and both probe each other's
  candidates in rounds (the first at a low TTL: it opens our NAT's mapping and dies before
  the far NAT, so that NAT does not pin a conntrack entry that would steal its own host's
  port). A PING from the peer at an address it did not list is probed too (the peer's NAT
  gave it another port: a peer-reflexive candidate). The first answered probe's address is
  dialed (a udp:// link from the traversal socket, the usual handshake and identity checks)
  by the lower node id; the higher dials only if no link came.
- **Keeping it.** Link pings (limits.mesh_ping_interval) hold the mapping; a link made by
  traversal that carried no traffic for `mesh.traversal_idle` closes; a lost one leaves the
  traffic on the relay and the pair punches again when traffic asks (backing off after
  failures: 5 s doubling up to limits.traversal_backoff_max). Probes per pair and minute are
  capped (limits.traversal_probes_per_minute) whatever happens.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import ipaddress
import logging
import os
import socket
import struct
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

from meshgate.config import LimitsConfig, LinkUrl, MeshConfig
from meshgate.logs import RateLimitedLog
from meshgate.mesh.identity import Identity
from meshgate.mesh.links import LinkBase
from meshgate.mesh.noise import NoiseError
from meshgate.mesh.traversal import (
    KIND_NAMES,
    LOCAL,
    MAX_ENDPOINTS,
    PING,
    PONG,
    REFLEXIVE,
    Endpoint,
    Pair,
    Pairs,
    Replays,
    TraversalError,
    decode_call,
    encode_call,
    open_probe,
    probe_key,
    probe_sender,
    seal_probe,
)
from meshgate.metrics import REGISTRY

if TYPE_CHECKING:
    from meshgate.mesh.link_udp import Cmsg, UdpLink, UdpListener

log = logging.getLogger("meshgate.mesh.traversal")
_rlog = RateLimitedLog(log)

_attempts = REGISTRY.counter("meshgate_mesh_traversal_attempts_total", "NAT traversal attempts started")
_results = REGISTRY.counter(
    "meshgate_mesh_traversal_results_total", "NAT traversal attempts by outcome", ("result",)
)
_probes = REGISTRY.counter("meshgate_mesh_traversal_probes_total", "Traversal probes", ("direction",))
_dropped = REGISTRY.counter(
    "meshgate_mesh_traversal_dropped_total", "Traversal probes and calls dropped", ("reason",)
)
_fallbacks = REGISTRY.counter(
    "meshgate_mesh_traversal_fallbacks_total", "Direct links made by traversal that were lost"
)

KEYS = 1024  # probe keys cached (one X25519 per peer and process otherwise)
HIGHER_WAITS = 1.0  # the higher node id dials this long after an answered probe if no link came
IDLE_BYTES = 2048  # bytes a tick above which a link carried traffic (pings and acks stay below)
SIOCGIFADDR = 0x8915


class TraversalHost(Protocol):
    node_id: int
    network: str
    identity: Identity
    loop: asyncio.AbstractEventLoop
    links: dict[int, list[LinkBase]]
    pending: set[LinkBase]

    @property
    def limits(self) -> LimitsConfig: ...

    def peer_key(self, nid: int) -> bytes | None: ...
    def inside_mesh(self, host: str) -> bool: ...
    def send_traversal(self, dst: int, body: bytes) -> bool: ...
    traversal_allowed: Callable[[int], bool]  # [[acl]]: may this node punch with that one?
    def make_udp_link(self, url: str, initiator: bool, sock: Any, addr: Any) -> UdpLink: ...


def interface_addresses() -> list[str]:
    """The host's IPv4 interface addresses but loopback and link-local (SIOCGIFADDR per
    interface: no netlink, no dependency)."""
    out: list[str] = []
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _index, name in socket.if_nameindex():
            try:
                res = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            ip = ipaddress.IPv4Address(res[20:24])
            if not (ip.is_loopback or ip.is_link_local or ip.is_unspecified) and str(ip) not in out:
                out.append(str(ip))
    return out


def _addr(ep: Any) -> Endpoint:
    host = ep[0]
    if host.startswith("::ffff:"):
        host = host[7:]
    return (host, int(ep[1]))


class TraversalAgent:
    def __init__(
        self, host: TraversalHost, listener: UdpListener, mesh: MeshConfig, own_socket: bool
    ) -> None:
        self.host = host
        self.listener = listener
        self.mesh_config = mesh
        self.own_socket = own_socket  # an ephemeral socket made for traversal (closed with us)
        limits = host.limits
        self.per_minute = limits.traversal_probes_per_minute
        self.backoff_max = limits.traversal_backoff_max
        self.first_ttl = limits.traversal_first_ttl
        self.pairs = Pairs(limits.traversal_pairs)
        self.replays = Replays()
        self._keys: OrderedDict[int, ChaCha20Poly1305] = OrderedDict()
        self.reflexive: OrderedDict[int, Endpoint] = OrderedDict()  # neighbour -> what it saw
        self._discovery: OrderedDict[bytes, int] = OrderedDict()  # ping tx -> neighbour asked
        self._pong_budget = 0.0
        self._pong_at = 0.0
        self.traversal_links: dict[LinkBase, tuple[int, float, int]] = {}  # link -> (kind, last used, bytes)
        self.stats: dict[str, int] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self._next_discovery = 0.0
        self._local_cache: tuple[float, list[str]] = (-1e9, [])
        listener.on_probe = self.on_probe

    # ------------------------------------------------------------------ state

    @property
    def port(self) -> int:
        return int(self.listener.sockname[1])

    def _count(self, key: str, n: int = 1) -> None:
        self.stats[key] = self.stats.get(key, 0) + n

    def _drop(self, reason: str, addr: Any) -> None:
        _dropped.labels(reason).inc()
        self._count(f"dropped_{reason}")
        _rlog.debug(f"trav:{reason}:{addr}", "traversal: probe or call from %s dropped: %s", addr, reason)

    def endpoints(self) -> list[tuple[int, Endpoint]]:
        now = self.host.loop.time()
        at, local = self._local_cache
        if now - at > 10.0:
            local = interface_addresses()
            self._local_cache = (now, local)
        bound = self.listener.sockname[0]
        out: list[tuple[int, Endpoint]] = []
        if bound not in ("0.0.0.0", "::"):
            out.append((LOCAL, (_addr((bound, 0))[0], self.port)))
        else:
            out.extend((LOCAL, (ip, self.port)) for ip in local)
        for ep in self.reflexive.values():
            if (REFLEXIVE, ep) not in out and (LOCAL, ep) not in out:
                out.append((REFLEXIVE, ep))
        return [e for e in out if not self.host.inside_mesh(e[1][0])][:MAX_ENDPOINTS]

    def _aead(self, nid: int) -> ChaCha20Poly1305 | None:
        aead = self._keys.get(nid)
        if aead is not None:
            self._keys.move_to_end(nid)
            return aead
        key = self.host.peer_key(nid)
        if key is None or len(key) != 64:
            return None
        try:
            aead = ChaCha20Poly1305(probe_key(self.host.identity.dh_private, key[32:], self.host.network))
        except NoiseError:
            return None
        self._keys[nid] = aead
        if len(self._keys) > KEYS:
            self._keys.popitem(last=False)
        return aead

    def _send_probe(self, nid: int, ptype: int, tx: bytes, addr: Endpoint, ttl: int = 0,
                    observed: Endpoint | None = None, src: Cmsg | None = None) -> bool:
        aead = self._aead(nid)
        if aead is None:
            return False
        packet = seal_probe(aead, self.host.node_id, ptype, tx, int(time.time() * 1000), nid, observed)
        target = self._target(addr)
        if self.listener.usock.send_probe(target, packet, ttl, src):
            _probes.labels("out").inc()
            return True
        return False

    def _target(self, addr: Endpoint) -> Any:
        if self.listener.usock.family == socket.AF_INET6 and ":" not in addr[0]:
            return ("::ffff:" + addr[0], addr[1])
        return addr

    # ------------------------------------------------------------------ discovery

    def discover(self) -> None:
        """Ping the listener of every udp:// neighbour we dialed (reflexive endpoints)."""
        for nid, links in self.host.links.items():
            for link in links:
                addr = getattr(link, "addr", None)
                if addr is None or not link.initiator or link in self.traversal_links:
                    continue  # only udp:// links we dialed: their far end is a listener
                tx = os.urandom(8)
                self._discovery[tx] = nid
                while len(self._discovery) > 4 * MAX_ENDPOINTS:
                    self._discovery.popitem(last=False)
                if self._send_probe(nid, PING, tx, _addr(addr)):
                    self._count("discovery_pings")
                break

    # ------------------------------------------------------------------ punching

    def relayed(self, peer: int) -> None:
        """Traffic for `peer` went through a relay: punch if the pair may try now."""
        pair = self.pairs.get(peer)
        assert pair is not None
        now = self.host.loop.time()
        if not pair.can_start(now) or peer in self.host.links:
            return
        if not self.host.traversal_allowed(peer):
            pair.not_before = now + self.backoff_max
            self._count("refused_acl")
            return
        if self._aead(peer) is None:
            return
        if not self.host.send_traversal(peer, encode_call(self.endpoints(), answer=True)):
            return
        _attempts.inc()
        self._count("attempts")
        pair.start(now)  # nothing to probe until the callee's endpoints arrive
        self._arm(now)

    def on_call(self, src: int, body: memoryview) -> None:
        """A TRAVERSAL call from `src` (authenticated: sealed end to end, or from a link to it)."""
        try:
            endpoints, answer = decode_call(body)
        except TraversalError as e:
            self._drop(e.reason, f"node {src:08x}")
            return
        if src in self.host.links:
            self._count("call_while_direct")
            # the link came first (a ping from an address we had not been told, taken as
            # peer-reflexive), so the call names the kind of the address it runs to now
            kinds = dict((ep, k) for k, ep in endpoints)
            for link in self.host.links[src]:
                addr = getattr(link, "addr", None)
                if link.traversal_kind and addr is not None and _addr(addr) in kinds:
                    link.traversal_kind = kinds[_addr(addr)]
            return
        if not self.host.traversal_allowed(src):
            self._drop("acl", f"node {src:08x}")
            return
        pair = self.pairs.get(src)
        assert pair is not None
        now = self.host.loop.time()
        if answer:
            if pair.started < 0:  # the caller's attempt (the probe budget still caps what we send)
                _attempts.inc()
                self._count("attempts")
                pair.start(now)
            self.host.send_traversal(src, encode_call(self.endpoints(), answer=False))
        elif pair.started < 0:
            self._drop("unexpected_call", f"node {src:08x}")
            return
        inside = [ep for _kind, ep in endpoints if self.host.inside_mesh(ep[0])]
        if inside:
            self._drop("mesh_address", f"node {src:08x}")  # a link there would run inside the mesh
        # added to what the attempt has (a ping from the peer may have come first: its address)
        pair.learn((k, ep) for k, ep in endpoints if ep not in inside)
        # the moment: both ends probe now; the first round at a low TTL, the next ones after
        # one relayed trip, when the far end has opened its own mapping
        pair.rounds_from(now)
        self._probe_rounds(pair, now)
        self._arm(now)

    def _probe_rounds(self, pair: Pair, now: float) -> None:
        rounds = pair.due_rounds(now)
        for r in range(rounds):
            first = pair.next_round - rounds + r == 0
            for ep in list(pair.candidates):
                if pair.budget(now, self.per_minute) <= 0:
                    self._count("probe_budget_spent")
                    return
                tx = os.urandom(8)
                pair.tx[tx] = (ep, now)
                while len(pair.tx) > 8 * MAX_ENDPOINTS:
                    del pair.tx[next(iter(pair.tx))]
                low = first and self.first_ttl < 64 and pair.candidates[ep] == REFLEXIVE
                ttl = self.first_ttl if low else 0
                if self._send_probe(pair.peer, PING, tx, ep, ttl):
                    pair.spend(now)
                    self._count("probes_out")

    def on_probe(self, packet: memoryview, addr: Any, src: Cmsg | None) -> None:
        _probes.labels("in").inc()
        try:
            sender = probe_sender(packet)
        except TraversalError as e:
            self._drop(e.reason, addr)
            return
        aead = self._aead(sender)
        if aead is None:
            self._drop("unknown_sender", addr)
            return
        try:
            probe = open_probe(aead, packet, self.host.node_id, int(time.time() * 1000), self.replays)
        except TraversalError as e:
            self._drop(e.reason, addr)
            return
        seen = _addr(addr)
        now = self.host.loop.time()
        if probe.ptype == PING:
            if not self._pong_allowed(now):
                self._drop("pong_rate", addr)
                return
            if self._send_probe(sender, PONG, probe.tx, seen, observed=seen, src=src):
                self._count("pongs_out")
            pair = self.pairs.get(sender, create=False)
            if pair is not None and pair.started >= 0:
                pair.heard = True
                if seen not in pair.candidates and not self.host.inside_mesh(seen[0]):
                    pair.candidates[seen] = REFLEXIVE  # peer-reflexive: its NAT chose this port for us
            return
        assert probe.observed is not None
        nid = self._discovery.pop(probe.tx, None)
        if nid is not None:
            if nid == sender:
                self.reflexive[sender] = probe.observed
                self.reflexive.move_to_end(sender)
                while len(self.reflexive) > MAX_ENDPOINTS:
                    self.reflexive.popitem(last=False)
            return
        pair = self.pairs.get(sender, create=False)
        sent = pair.tx.pop(probe.tx, None) if pair is not None else None
        if pair is None or sent is None or pair.started < 0:
            self._drop("unexpected_pong", addr)
            return
        if pair.answered is None:
            pair.answered = seen
            pair.answered_kind = pair.candidates.get(sent[0], REFLEXIVE)
            pair.answered_at = now
            if self.host.node_id < sender:
                self._dial(pair, seen, src)
            self._arm(now)

    def _pong_allowed(self, now: float) -> bool:
        """Pongs are a global token bucket (100/s): a flood of valid-looking pings from one
        member cannot make this node a reflector."""
        self._pong_budget = min(100.0, self._pong_budget + (now - self._pong_at) * 100.0)
        self._pong_at = now
        if self._pong_budget < 1.0:
            return False
        self._pong_budget -= 1.0
        return True

    def _dial(self, pair: Pair, addr: Endpoint, src: Cmsg | None = None) -> None:
        if pair.dialed or pair.peer in self.host.links:
            return
        pair.dialed = True
        url = str(LinkUrl("udp", addr[0], addr[1]))
        host = self.host

        def make(sock: Any, a: Any) -> UdpLink:
            link = host.make_udp_link(url, True, sock, a)
            host.pending.add(link)
            return link

        link = self.listener.dial(self._target(addr), make, src)
        if link is not None:
            link.traversal_kind = pair.answered_kind or REFLEXIVE
            log.debug("traversal: dialing %08x at %s", pair.peer, url)

    # ------------------------------------------------------------------ timers

    def _arm(self, now: float) -> None:
        when: float | None = None
        for pair in self.pairs.table.values():
            d = pair.next_deadline()
            if d is not None and pair.answered is not None and not pair.dialed:
                d = min(d, pair.answered_at + HIGHER_WAITS)
            if d is not None and (when is None or d < when):
                when = d
        if when is None:
            return
        if self._timer is not None:
            if self._timer_at <= when:
                return
            self._timer.cancel()
        self._timer_at = when
        self._timer = self.host.loop.call_at(max(when, now), self._wake)

    def _wake(self) -> None:
        self._timer = None
        now = self.host.loop.time()
        for pair in list(self.pairs.table.values()):
            if pair.started < 0:
                continue
            if pair.peer in self.host.links:
                continue  # link_up settles it
            if pair.answered is not None and not pair.dialed and now >= pair.answered_at + HIGHER_WAITS:
                self._dial(pair, pair.answered)
            if pair.expired(now):
                reason = "handshake" if pair.dialed else "no_answer" if not pair.heard else "one_way"
                pair.failed(now, self.backoff_max)
                _results.labels(f"failed_{reason}").inc()
                self._count(f"failed_{reason}")
                _rlog.log(logging.INFO, f"fail:{pair.peer}",
                          "traversal to %08x failed (%s); staying relayed, next try in %.0fs",
                          pair.peer, reason, pair.not_before - now)
                continue
            self._probe_rounds(pair, now)
        self._arm(now)

    def tick(self, now: float) -> None:
        """Once per mesh tick: discovery when due, idle direct links closed."""
        if now >= self._next_discovery:
            self._next_discovery = now + self.mesh_config.traversal_keepalive
            self.discover()
        for link, (kind, used, seen) in list(self.traversal_links.items()):
            total = link.bytes_in + link.bytes_out
            if total - seen > IDLE_BYTES:
                self.traversal_links[link] = (kind, now, total)
            elif now - used > self.mesh_config.traversal_idle:
                self._count("closed_idle")
                log.info("traversal: direct link %s idle for %.0fs; closing", link.url, now - used)
                self.traversal_links.pop(link, None)
                link.close()
            else:
                self.traversal_links[link] = (kind, used, total)

    # ------------------------------------------------------------------ links

    def link_up(self, link: LinkBase) -> str:
        """A link came up: which kind it is ("configured", "accepted", "traversal local", ...)."""
        peer = link.peer
        assert peer is not None
        kind = link.traversal_kind
        pair = self.pairs.get(peer.node_id, create=False)
        addr = getattr(link, "addr", None)
        on_socket = getattr(link, "sock", None) is self.listener.usock
        if not kind and pair is not None and pair.started >= 0 and addr is not None and on_socket:
            kind = pair.candidates.get(_addr(addr), REFLEXIVE)  # the responder side of a punched link
            link.traversal_kind = kind
        if link.url.startswith("udp://") and link.initiator and not kind:
            self.host.loop.call_soon(self.discover)  # a new udp neighbour: ask it where it sees us
        if not kind:
            return ""
        now = self.host.loop.time()
        if pair is not None:
            waited = now - pair.started if pair.started >= 0 else 0.0
            pair.succeeded()
            self._count("succeeded")
            _results.labels("ok").inc()
            log.info("traversal: direct link to %s (%08x) at %s (%s endpoint) after %.2fs",
                     peer.name, peer.node_id, link.url, KIND_NAMES.get(kind, "?"), waited)
        self.traversal_links[link] = (kind, now, link.bytes_in + link.bytes_out)
        return f"traversal {KIND_NAMES.get(kind, '?')}"

    def link_down(self, link: LinkBase) -> bool:
        """True if it was a link made by traversal (the relay carries the traffic again)."""
        if self.traversal_links.pop(link, None) is None:
            return False
        _fallbacks.inc()
        self._count("fallbacks")
        return True

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self.listener.on_probe = None
        if self.own_socket:
            self.listener.close()

    def status(self) -> dict[str, Any]:
        return {
            "port": self.port,
            "endpoints": [f"{KIND_NAMES[k]} {ep[0]}:{ep[1]}" for k, ep in self.endpoints()],
            "direct_links": len(self.traversal_links),
            "counters": dict(sorted(self.stats.items())),
        }
