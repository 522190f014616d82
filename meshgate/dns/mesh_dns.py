"""Split DNS through the mesh: names under a suffix another node serves are asked there.

A node with `dns.serve_suffixes` carries them in its signed route record (in certificate mode
only suffixes its certificate grants: mesh/trust.py). Every other node then adds a route for
each suffix to its pipeline's split-DNS table (dns/routes.py), longest suffix first as for
`[[dns.route]]`, whose own suffixes win a tie, as do the node's own served suffixes: what a
node is configured to answer it answers itself. Several nodes serving one suffix form one
group, nearest first, with the pipeline's usual fail-over.

The query travels as a mesh datagram (channel DNS_QUERY, sealed end to end when relayed, so a
relay neither reads nor forges it): a 4-byte request id, then the DNS message. The answer
comes back on DNS_ANSWER with the same id, from the node asked or not at all. Like DNS over
UDP it is retried: three sends per timeout. The serving node answers only names under its own
served suffixes (REFUSED otherwise: it is no open resolver for the mesh), only for members its
`[[acl]]` lets reach it on port 53/udp, and resolves them without mesh routes, so two nodes
can never forward a name to each other in a loop.

No sockets here: the node (meshgate/node.py) hands in the mesh's `send` and feeds
`on_answer` / `on_query` from the mesh's datagram handlers.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections.abc import Callable, Mapping

from meshgate.dns import wire
from meshgate.dns.mesh_requests import MeshRequests
from meshgate.dns.resolver import Frontend, Later, Pipeline, Ready
from meshgate.dns.routes import RouteTable, UpstreamGroup
from meshgate.dns.stats import ListenerStats
from meshgate.dns.upstream import Upstream
from meshgate.dns.wire import Query
from meshgate.logs import RateLimitedLog
from meshgate.metrics import REGISTRY

log = logging.getLogger("meshgate.dns.mesh")
_rlog = RateLimitedLog(log)

RID = struct.Struct("!I")

_dropped = REGISTRY.counter(
    "meshgate_dns_mesh_dropped_total", "Mesh DNS datagrams not used", ("reason",)
)

# (node id, channel, payload) -> sent (False: no route, or the link is congested)
Send = Callable[[int, int, bytes], bool]
# suffix (text, trailing dot) -> nodes serving it, nearest first: (node id, name)
Servers = Mapping[str, list[tuple[int, str]]]


class MeshDnsClient:
    """Queries this node sends over the mesh and the answers that come back."""

    def __init__(self, send: Send, channel: int, max_pending: int) -> None:
        self.send = send
        self.channel = channel
        self.requests: MeshRequests[bytes] = MeshRequests(max_pending, _dropped.labels, "mesh DNS")

    async def exchange(self, node_id: int, query: bytes, timeout: float, url: str) -> bytes:
        rid = self.requests.new_id()
        payload = RID.pack(rid) + query
        return await self.requests.ask(node_id, rid, lambda: self.send(node_id, self.channel, payload),
                                       timeout, url)

    def on_answer(self, src: int, payload: bytes) -> None:
        if len(payload) < RID.size + 12:
            _dropped.labels("malformed").inc()
            _rlog.debug(f"mesh-dns-short:{src}", "mesh DNS: short answer from %08x", src)
            return
        self.requests.answer(src, RID.unpack_from(payload)[0], payload[RID.size:])

    def close(self) -> None:
        self.requests.close()


class MeshDnsUpstream(Upstream):
    """One node, as an upstream of the pipeline's route for the suffixes it serves."""

    def __init__(self, client: MeshDnsClient, node_id: int, name: str) -> None:
        self.client = client
        self.node_id = node_id
        self.url = f"mesh://{name or f'{node_id:08x}'}"

    async def exchange(self, wire: bytes, timeout: float) -> bytes:
        return await self.client.exchange(self.node_id, wire, timeout, self.url)


class MeshDnsRoutes:
    """The pipeline's route table with the mesh's served suffixes added (what `Pipeline` asks
    on a cache miss). `servers()` gives (generation, Servers): the table is rebuilt only when
    the generation or the configured table changed."""

    def __init__(self, client: MeshDnsClient, servers: Callable[[], tuple[object, Servers]],
                 own: tuple[str, ...]) -> None:
        self.client = client
        self.servers = servers
        self.own = own
        self._generation: object = None
        self._configured: RouteTable | None = None  # held: an id() of a freed table can recur
        self._table: RouteTable | None = None
        self._upstreams: dict[tuple[int, str], MeshDnsUpstream] = {}

    def table(self, configured: RouteTable) -> RouteTable:
        generation, servers = self.servers()
        if generation == self._generation and configured is self._configured and self._table is not None:
            return self._table
        routes = dict(configured.routes)
        for suffix in self.own:  # served here: answered as this node's config says
            name = wire.encode_name(suffix)
            routes.setdefault(name, configured.group(name))
        used: dict[tuple[int, str], MeshDnsUpstream] = {}
        for suffix, nodes in servers.items():
            name = wire.encode_name(suffix)
            if name in routes or not nodes:
                continue  # [[dns.route]] and the own suffixes win a tie
            ups: list[Upstream] = []
            for node in nodes:
                up = self._upstreams.get(node) or MeshDnsUpstream(self.client, *node)
                used[node] = up
                ups.append(up)
            routes[name] = UpstreamGroup(suffix, ups)
        self._upstreams = used  # nodes gone from the table are dropped with it
        self._table = RouteTable(configured.default, routes)
        self._generation, self._configured = generation, configured
        return self._table


class _Refused(Exception):
    def __init__(self, q: Query, reason: str) -> None:
        super().__init__(reason)
        self.q = q
        self.reason = reason


class MeshDnsServer:
    """Answers other nodes' queries for this node's served suffixes."""

    def __init__(self, pipeline: Pipeline, send: Send, channel: int, suffixes: tuple[str, ...],
                 admit: Callable[[int], bool], room: int) -> None:
        self.send = send
        self.channel = channel
        self.set_suffixes(suffixes)
        self.admit = admit
        self.stats = ListenerStats("mesh")
        # answers as big as a mesh datagram carries (TC beyond); resolved without mesh routes
        self.frontend = Frontend(pipeline, self.stats, limit=min(room - RID.size, wire.MAX_MESSAGE),
                                 mesh_routes=False)

    def set_suffixes(self, suffixes: tuple[str, ...]) -> None:
        """dns.serve_suffixes (at start, and a reload's)."""
        self.suffixes = tuple(wire.encode_name(s) for s in suffixes)

    def _served(self, name: bytes) -> bool:
        starts = wire.label_starts(name)
        return any(name.endswith(s) and len(name) - len(s) in starts for s in self.suffixes)

    def on_query(self, src: int, payload: bytes) -> None:
        if len(payload) < RID.size + 12:
            _dropped.labels("malformed").inc()
            _rlog.debug(f"mesh-dns-q:{src}", "mesh DNS: short query from %08x", src)
            return
        head = payload[: RID.size]
        peer = f"node {src:08x}"

        def check(q: Query) -> None:
            if not self._served(q.name):
                raise _Refused(q, "not_served")
            if not self.admit(src):
                raise _Refused(q, "acl")

        loop = asyncio.get_running_loop()
        try:
            got = self.frontend.query(memoryview(payload)[RID.size:], loop.time(), peer, check=check)
        except _Refused as e:
            _dropped.labels(f"refused_{e.reason}").inc()
            _rlog.debug(f"mesh-dns-refused:{src}", "mesh DNS: refused %s from %s (%s)",
                        wire.decode_name(e.q.name), peer, "not under dns.serve_suffixes"
                        if e.reason == "not_served" else "[[acl]] allows it no port 53/udp here")
            buf = self.frontend.pipeline.buffer(512)
            q = e.q
            wire.pack_error(buf, q.id, q.flags, wire.REFUSED, q.question, edns=q.edns)
            self.stats.response(wire.REFUSED)
            self._reply(src, head, Ready(buf, 0))
            return
        if isinstance(got, Later):
            got.then(lambda ready: self._reply(src, head, ready))
        elif got is not None:
            self._reply(src, head, got)

    def _reply(self, src: int, head: bytes, ready: Ready | None) -> None:
        if ready is None:
            return  # dropped (overload): the asker retries or fails over
        buf = ready.buffer
        data = head + buf.tobytes()
        buf.recycle()  # copied out: the mesh keeps `data`, not the buffer
        if not self.send(src, self.channel, data):
            _dropped.labels("answer_unsent").inc()

    def close(self) -> None:
        self.frontend.close()

