"""The resolver pipeline every DNS listener (and the gateway's own lookups) goes through.

    query -> mesh zone (node names, apex SOA/NS) -> static records -> blocklist -> cache -> upstreams

The upstreams asked are those of the longest `[[dns.route]]` suffix the name is at or under,
else `dns.upstreams` (dns/routes.py); routing happens only on a cache miss. The blocklist
(`[dns.blocklist]`, dns/blocklist.py) is decided before the cache, so a newly blocked name is
never served from it, and only for names that are not local data; its decision is memoised with
the local answers, so with no blocklist configured, or for a name decided in the last second,
a cache hit does no blocklist work.

`lookup()` is synchronous and answers everything that needs no network (the
hot path: no await per query); `resolve()` goes upstream with coalescing of
identical questions, timeouts, failover and a bounded number in flight.
`Frontend` is the per-listener glue: bytes in, a packed pooled Buffer out.

What the pipeline needs from the rest of the node comes in its constructor
(the node, meshgate/node.py, is the one place that builds it):

- `names`: the mesh's name table (`MeshService.name_table`), read when a
  `<name>.<zone>` question is answered; None: only this node's own name;
- `upstream_route`: for a `tcp://` upstream at an address the mesh routes,
  the connect function that reaches it over a mesh stream (dns/upstream.py,
  `MeshRoute`); None: every upstream is dialled directly. Routes' upstreams get it too.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import logging
import secrets
import time
from collections.abc import Callable
from ipaddress import IPv4Address, IPv6Address
from typing import Protocol

from meshgate.buffers import Buffer, BufferPool
from meshgate.config import Config, DnsBlocklistConfig
from meshgate.dns import wire
from meshgate.dns.blocklist import Blocklist
from meshgate.dns.blocklist_url import UrlList
from meshgate.dns.cache import AnswerCache
from meshgate.dns.querylog import QueryLog
from meshgate.dns.ratelimit import DROP, ClientRateLimit
from meshgate.dns.routes import RouteTable, UpstreamGroup
from meshgate.dns.stats import ListenerStats
from meshgate.dns.upstream import MeshRoute, Upstream, parse_upstream, resolv_conf_upstreams
from meshgate.dns.wire import Answer, FormError, Query, WireError
from meshgate.logs import RateLimitedLog
from meshgate.metrics import REGISTRY

log = logging.getLogger("meshgate.dns")
rlog = RateLimitedLog(log)

MESH_TTL = 10  # node addresses change when nodes come and go: keep caches short
RECORD_TTL = 60
NEGATIVE_TTL = 10  # the zone SOA MINIMUM
BLOCKED_TTL = 10  # a name unblocked by a list change is asked again soon
LOCAL_MEMO_SECONDS = 1.0
LOCAL_MEMO_MAX = 4096
BUFFER_CAPACITY = 4096  # pooled buffer size; larger answers get a one-off buffer
BUFFER_HEADROOM = 16

# Mesh node name -> (IPv4, IPv6): what `<name>.<zone>` answers (MeshService.name_table's shape;
# the main process pushes it to DNS workers).
NameTable = dict[str, tuple[IPv4Address | None, IPv6Address | None]]
Names = Callable[[], NameTable]


class MeshRoutes(Protocol):
    """The route table with other nodes' served suffixes added (dns/mesh_dns.MeshDnsRoutes)."""

    def table(self, configured: RouteTable) -> RouteTable: ...

_upstream_errors = REGISTRY.counter(
    "meshgate_dns_upstream_errors_total", "Upstream exchanges that failed", ("upstream", "reason")
)
_upstream_queries = REGISTRY.counter(
    "meshgate_dns_upstream_queries_total", "Queries sent upstream", ("upstream",)
)
_upstream_answers = REGISTRY.counter(
    "meshgate_dns_upstream_answers_total", "Upstream exchanges that returned a valid response (any rcode)",
    ("upstream",),
)
_blocked = REGISTRY.counter(
    "meshgate_dns_blocked_total", "Questions answered by [dns.blocklist] instead of being resolved",
    ("reason",)
)
_blocked_list = _blocked.labels("list")
_blocked_rebinding = _blocked.labels("rebinding")
_overload = REGISTRY.counter(
    "meshgate_dns_inflight_dropped_total", "Queries dropped because dns_max_inflight were in flight"
)


def upstream_urls(config: Config) -> list[str]:
    """The upstreams a pipeline for `config` asks: dns.upstreams, else /etc/resolv.conf's."""
    return list(config.dns.upstreams) or resolv_conf_upstreams()


def configured_upstreams(
    config: Config, route: MeshRoute | None, mesh_odoh: object = None
) -> tuple[list[Upstream], dict[str, list[Upstream]]]:
    """The Upstream objects of dns.upstreams (else resolv.conf's) and of each [[dns.route]]."""
    def one(url: str) -> Upstream:
        return parse_upstream(url, limits=config.limits, route=route, mesh_odoh=mesh_odoh)

    return [one(u) for u in upstream_urls(config)], {r.suffix: [one(u) for u in r.upstreams]
                                                      for r in config.dns.routes}


def upstream_spans(config: Config) -> int:
    """The most upstreams one question may fail over through (dns.upstreams or any route's): a
    DNS worker waits that many timeouts for the main process's answer."""
    return max([len(upstream_urls(config)), *(len(r.upstreams) for r in config.dns.routes)])


class Pipeline:
    def __init__(self, config: Config, *, names: Names | None = None,
                 upstream_route: MeshRoute | None = None, upstreams: list[Upstream] | None = None,
                 routes: dict[str, list[Upstream]] | None = None, pooled: bool = True,
                 mesh_dns: MeshRoutes | None = None, mesh_odoh: object = None) -> None:
        """`mesh_dns` adds routes for the suffixes other nodes serve (dns/mesh_dns.py).
        `upstreams` replaces the configured ones (tests, DNS workers) and then `routes`
        (suffix -> upstreams) replaces dns.route's: none unless given, so a DNS worker sends
        every miss to the main process, which routes it. `pooled` False packs every answer into
        a one-off buffer (the benchmark's baseline)."""
        self.config = config
        self.names = names
        self.zone = wire.encode_name(config.dns.zone)
        self.cache = AnswerCache(config.dns.cache_size)
        self.timeout = config.limits.dns_timeout
        self.max_inflight = config.limits.dns_max_inflight
        self.pooled = pooled
        self.pool = BufferPool(BUFFER_CAPACITY, BUFFER_HEADROOM, config.limits.buffer_pool_size)
        self.upstream_route = upstream_route
        self.mesh_dns = mesh_dns
        self.mesh_odoh = mesh_odoh  # odoh-mesh:// upstreams' hub (dns/mesh_odoh.py), when in a mesh
        self._retired: list[Upstream] = []  # replaced by a reload, closed after a grace time
        if upstreams is None:
            upstreams, configured = configured_upstreams(config, upstream_route, mesh_odoh)
            routes = configured if routes is None else routes
        self._use_upstreams(upstreams, routes or {})
        self._pending: dict[tuple[bytes, int, int, bool], asyncio.Task[tuple[Answer, str]]] = {}
        self.inflight = 0
        self._memo: dict[tuple[bytes, int, int], Answer] = {}
        self._memo_until = 0.0
        self._records: dict[bytes, list[tuple[int, bytes]]] = {}
        self.set_records(config.dns.records)
        self.set_blocklist(config.dns.blocklist)
        me = wire.encode_name(f"{config.node.name}.{config.dns.zone}")
        self._soa = wire.soa_rdata(me, wire.encode_name(f"hostmaster.{config.dns.zone}"), 1,
                                   3600, 600, 86400, NEGATIVE_TTL)
        self._ns = me
        # [dns.query_log]: None when off, so listeners pay one attribute test per question
        ql = config.dns.query_log
        self.query_log = QueryLog(ql.size, client_ip=ql.client_ip, path=ql.path, max_bytes=ql.max_bytes,
                                  keep=ql.keep, queue=ql.queue) if ql.enable else None

    # ------------------------------------------------------------------ local data

    def name_table(self) -> NameTable:
        """Mesh node names -> (IPv4, IPv6): what `<name>.<zone>` answers (pushed to DNS workers)."""
        if self.names is not None:
            return self.names()
        n = self.config.node
        return {n.name: (n.ipv4.ip if n.ipv4 else None, n.ipv6.ip if n.ipv6 else None)}

    def _local(self, q: Query) -> Answer | None:
        name = q.name
        zone = self.zone
        records = self._records.get(name)
        in_zone = name.endswith(zone) and _label_boundary(name, len(name) - len(zone))
        if records is None and not in_zone:
            return None
        if q.qclass != wire.CLASS_IN:
            return wire.build_answer(q.question, wire.REFUSED, aa=False) if in_zone else None
        neg = [(zone, wire.TYPE_SOA, NEGATIVE_TTL, self._soa)] if in_zone else []
        if records is not None:
            rr = [(t, RECORD_TTL, rd) for t, rd in records if t == q.qtype]
            return wire.build_answer(q.question, wire.NOERROR, aa=True, answers=rr,
                                     authority=[] if rr else neg)
        if name == zone:
            if q.qtype == wire.TYPE_SOA:
                return wire.build_answer(q.question, wire.NOERROR, aa=True,
                                         answers=[(wire.TYPE_SOA, NEGATIVE_TTL, self._soa)])
            if q.qtype == wire.TYPE_NS:
                return wire.build_answer(q.question, wire.NOERROR, aa=True,
                                         answers=[(wire.TYPE_NS, MESH_TTL, self._ns)])
            return wire.build_answer(q.question, wire.NOERROR, aa=True, authority=neg)
        label_len = name[0]
        if 1 + label_len + len(zone) == len(name):
            label = name[1 : 1 + label_len].decode("ascii", "replace")
            for node_name, (v4, v6) in self.name_table().items():
                if node_name.lower() != label:
                    continue
                mrr: list[tuple[int, int, bytes]] = []
                if q.qtype == wire.TYPE_A and v4 is not None:
                    mrr.append((wire.TYPE_A, MESH_TTL, v4.packed))
                elif q.qtype == wire.TYPE_AAAA and v6 is not None:
                    mrr.append((wire.TYPE_AAAA, MESH_TTL, v6.packed))
                return wire.build_answer(q.question, wire.NOERROR, aa=True, answers=mrr,
                                         authority=[] if mrr else neg)
        return wire.build_answer(q.question, wire.NXDOMAIN, aa=True, authority=neg)

    def _blocked(self, q: Query) -> Answer | None:
        """The blocklist's answer for `q`, or None when its name is not blocked."""
        assert self.blocklist is not None
        by = self.blocklist.blocked_by(q.name)
        if by is None:
            return None
        return self._block_answer(q, f"blocked {by}")

    def _block_answer(self, q: Query, source: str) -> Answer:
        """What a blocked question gets (`dns.blocklist.answer`); `source` names why (the query
        log's: `blocked LIST`, `blocked rebinding`)."""
        mode = self.block_answer
        if mode == "refused":
            a = wire.build_answer(q.question, wire.REFUSED, aa=False, ttl=BLOCKED_TTL)
        elif mode == "zero":
            rr: list[tuple[int, int, bytes]] = []
            if q.qtype == wire.TYPE_A:
                rr.append((wire.TYPE_A, BLOCKED_TTL, bytes(4)))
            elif q.qtype == wire.TYPE_AAAA:
                rr.append((wire.TYPE_AAAA, BLOCKED_TTL, bytes(16)))
            a = wire.build_answer(q.question, wire.NOERROR, aa=False, answers=rr, ttl=BLOCKED_TTL)
        else:
            a = wire.build_answer(q.question, wire.NXDOMAIN, aa=False, ttl=BLOCKED_TTL)
        blocked = _Blocked(a.wire, a.ttl_offsets, a.ttls, a.ttl, a.rcode, a.stored, aging=False)
        blocked.source = source  # the query log's source, built once per decision
        return blocked

    def names_changed(self) -> None:
        """Forget memoised local answers (a DNS worker got a new name table: answer it now)."""
        self._memo.clear()

    def set_records(self, records: tuple[tuple[str, str], ...]) -> None:
        """The static `dns.records` table (also a reload's): built whole, then swapped in, and the
        local memo dropped so the next question sees it."""
        table: dict[bytes, list[tuple[int, bytes]]] = {}
        for name, addr in records:
            ip = ipaddress.ip_address(addr)
            rtype = wire.TYPE_A if ip.version == 4 else wire.TYPE_AAAA
            table.setdefault(wire.encode_name(name), []).append((rtype, ip.packed))
        self._records = table
        self._memo.clear()

    def set_blocklist(self, bl: DnsBlocklistConfig) -> None:
        """`[dns.blocklist]` (at start, and a reload's): the lists are read now, then swapped in
        with the local memo dropped, so the next question is decided by the new set. None when
        not configured: the pipeline then does no blocklist work at all."""
        old = getattr(self, "blocklist", None)
        urls = functools.partial(UrlList, timeout=bl.fetch_timeout, max_bytes=bl.max_bytes)
        self.blocklist = Blocklist(bl.lists, bl.allow, bl.refresh, time.monotonic(), url_list=urls,
                                   previous=old) if bl.enabled else None
        if self.blocklist is None and old is not None:
            for url in old.urls:  # no lists any more: stop their downloads
                url.cancel()
        self.block_answer = bl.answer
        self.rebinding = bl.rebinding
        self._memo.clear()

    def _use_upstreams(self, upstreams: list[Upstream], routes: dict[str, list[Upstream]]) -> None:
        self.upstreams = upstreams
        self.routes = RouteTable(UpstreamGroup("dns.upstreams", upstreams), {
            wire.encode_name(suffix): UpstreamGroup(suffix, ups) for suffix, ups in routes.items()
        })

    def set_upstreams(self, config: Config) -> None:
        """A reload's `dns.upstreams` and `[[dns.route]]`: questions asked from now on go to the
        new ones and the cache (answers the old ones gave) is emptied. Exchanges already running
        finish on the old upstreams, which close once the longest of them could have timed out."""
        loop = asyncio.get_running_loop()  # first: nothing is swapped if there is none
        old = [up for group in self.routes.groups() for up in group.upstreams]
        grace = self.timeout * max(len(g.upstreams) for g in self.routes.groups()) + 1
        self._use_upstreams(*configured_upstreams(config, self.upstream_route, self.mesh_odoh))
        self.cache.clear()
        self._retired.extend(old)
        loop.call_later(grace, self._close_retired, old)

    def _close_retired(self, old: list[Upstream]) -> None:
        for up in old:
            up.close()
        self._retired = [up for up in self._retired if up not in old]

    def lookup(self, q: Query, now: float) -> Answer | None:
        """Everything answerable without the network; None means ask upstream."""
        key = (q.name, q.qtype, q.qclass)
        if now >= self._memo_until or len(self._memo) >= LOCAL_MEMO_MAX:
            # Local answers are memoised briefly: the mesh's name table is read at most
            # about once a second per name, and a flood of random names stays bounded.
            self._memo.clear()
            self._memo_until = now + LOCAL_MEMO_SECONDS
            if self.blocklist is not None:
                self.blocklist.refresh(now)  # changed files re-read (every dns.blocklist.refresh s)
        ans = self._memo.get(key)
        if ans is None:
            ans = self._local(q)  # local data wins: the mesh zone and dns.records are never blocked
            if ans is None and self.blocklist is not None:
                ans = self._blocked(q)
            # Remember "not ours" too, so cache hits skip the zone/records/blocklist checks.
            self._memo[key] = ans if ans is not None else _NOT_LOCAL
        if ans is _NOT_LOCAL or ans is None:
            return self.cache.get(key, now)
        if type(ans) is _Blocked:
            _blocked_list.inc()
        return ans

    # ------------------------------------------------------------------ upstreams

    def answered_how(self, q: Query) -> str:
        """How lookup() answered `q` just now (the query log's source): `cache`, `blocked LIST`,
        `local` (dns.records, which answer first) or `mesh` (the mesh zone)."""
        memo = self._memo.get((q.name, q.qtype, q.qclass))
        if memo is _NOT_LOCAL or memo is None:
            return "cache"
        if type(memo) is _Blocked:
            return memo.source
        return "local" if q.name in self._records else "mesh"

    async def resolve(self, q: Query) -> Answer | None:
        """Go upstream. None means dropped: too many queries in flight."""
        got = await self.resolve_via(q)
        return None if got is None else got[0]

    async def resolve_via(self, q: Query, mesh: bool = True) -> tuple[Answer, str] | None:
        """resolve() and which upstream answered (the URL, `route SUFFIX URL` or `failed`).
        `mesh` False: no route to another node's served suffix (a query that came over the
        mesh: forwarding it on could loop)."""
        key = (q.name, q.qtype, q.qclass, mesh)
        if self.inflight >= self.max_inflight:
            _overload.inc()
            rlog.debug("inflight", "dns: %d queries in flight (limits.dns_max_inflight), dropping %s",
                        self.inflight, wire.decode_name(q.name))
            return None
        self.inflight += 1
        try:
            fetch = self._pending.get(key)
            if fetch is None:
                # The upstream exchange is its own task: a client that goes away (its
                # listener task cancelled) neither cancels it for the other clients
                # waiting on the same question nor loses the answer for the cache.
                fetch = asyncio.get_running_loop().create_task(self._fetch(q, key, mesh))
                self._pending[key] = fetch
            return await asyncio.shield(fetch)  # coalesce identical questions
        finally:
            self.inflight -= 1

    async def _fetch(self, q: Query, key: tuple[bytes, int, int, bool], mesh: bool) -> tuple[Answer, str]:
        try:
            return await self._ask_upstreams(q, mesh)
        except Exception as e:  # never let one query's failure escape to a listener
            rlog.debug("resolve", "dns: resolving %s failed: %r", wire.decode_name(q.name), e)
            return wire.build_answer(q.question, wire.SERVFAIL, aa=False), "failed"
        finally:
            self._pending.pop(key, None)

    def close(self) -> None:
        """Cancel upstream exchanges still running and close pooled upstream connections (service stop)."""
        for fetch in list(self._pending.values()):
            fetch.cancel()
        for group in self.routes.groups():
            for up in group.upstreams:
                up.close()
        self._close_retired(list(self._retired))
        if self.blocklist is not None:
            self.blocklist.close()
        if self.query_log is not None:
            self.query_log.close()  # what is queued reaches the file; a later answer restarts it

    @property
    def _preferred(self) -> int:
        """Which of dns.upstreams answered last."""
        return self.routes.default.preferred

    async def _ask_upstreams(self, q: Query, mesh: bool = True) -> tuple[Answer, str]:
        key = (q.name, q.qtype, q.qclass)
        loop = asyncio.get_running_loop()
        # The route is a function of q.name alone, which is in the cache key: answers of
        # different routes never share a cache entry (nor a coalesced fetch).
        routes = self.routes
        if mesh and self.mesh_dns is not None:
            routes = self.mesh_dns.table(routes)
        group = routes.group(q.name)
        upstreams = group.upstreams
        n = len(upstreams)
        # Where this question starts, read once: another question that succeeds meanwhile moves
        # `preferred`, and reading it per attempt would ask one upstream twice and skip another.
        start = group.preferred
        for i in range(n):
            idx = (start + i) % n
            up = upstreams[idx]
            qid = secrets.randbits(16)
            query = wire.build_query(qid, q.name, q.qtype, q.qclass, do=q.do)
            _upstream_queries.labels(up.url).inc()
            try:
                resp = await up.exchange(query, self.timeout)
                ans = wire.parse_response(resp, qid, key, loop.time())
            except TimeoutError:
                _upstream_errors.labels(up.url, "timeout").inc()
                rlog.debug(f"up-timeout {up.url}", "dns: upstream %s timed out", up.url)
                continue
            except (OSError, ValueError, Exception) as e:
                reason = "bad_response" if isinstance(e, ValueError) else "error"
                _upstream_errors.labels(up.url, reason).inc()
                rlog.debug(f"up-{reason} {up.url}", "dns: upstream %s failed: %r", up.url, e)
                continue
            _upstream_answers.labels(up.url).inc()
            if ans.rcode in (wire.SERVFAIL, wire.REFUSED) and i + 1 < n:
                continue  # another upstream may do better
            group.preferred = idx
            if self.rebinding and group is routes.default and _points_inside(ans):
                # a public name that answers with a private address: DNS rebinding (a page
                # on the Internet reaching into the LAN); routed names are internal by config
                _blocked_rebinding.inc()
                rlog.debug(f"rebinding {up.url}", "dns: %s from %s answered a private address:"
                           " blocked (dns.blocklist.rebinding)", wire.decode_name(q.name), up.url)
                blocked = self._block_answer(q, "blocked rebinding")
                blocked.stored = loop.time()  # cached (BLOCKED_TTL): asked again only then
                self.cache.put(key, blocked)
                return blocked, "blocked rebinding"
            self.cache.put(key, ans)
            return ans, (up.url if group is routes.default else f"route {group.name} {up.url}")
        return wire.build_answer(q.question, wire.SERVFAIL, aa=False), "failed"

    # ------------------------------------------------------------------ bootstrap adapter

    async def resolve_host(self, name: str) -> list[str]:
        """A and AAAA for `name` through this pipeline (IPv4 first); [] if none."""
        try:
            return [str(ipaddress.ip_address(name.strip("[]")))]
        except ValueError:
            pass
        lowered = name.lower().rstrip(".")
        if lowered == "localhost" or lowered.endswith(".localhost"):
            return ["127.0.0.1", "::1"]  # RFC 6761 6.3: never sent to an upstream
        try:
            qname = wire.encode_name(name)
        except (ValueError, UnicodeError):
            return []
        loop = asyncio.get_running_loop()

        async def one(qtype: int) -> list[str]:
            question = qname + qtype.to_bytes(2, "big") + b"\x00\x01"
            q = Query(0, wire.FLAG_RD, question, qname, qtype, wire.CLASS_IN)
            ans = self.lookup(q, loop.time())
            if ans is None:
                ans = await self.resolve(q)
            if ans is None or ans.rcode != wire.NOERROR:
                return []
            return [str(ipaddress.ip_address(rd)) for _t, rd in wire.answer_addresses(ans)]

        v4, v6 = await asyncio.gather(one(wire.TYPE_A), one(wire.TYPE_AAAA))
        return v4 + v6

    # ------------------------------------------------------------------ packing

    def buffer(self, size: int) -> Buffer:
        if self.pooled and size <= BUFFER_CAPACITY:
            return self.pool.get()
        return Buffer(max(size, 1024), BUFFER_HEADROOM)  # one-off: pool None, recycle is a no-op


_NOT_LOCAL = Answer(b"", (), (), 0, 0)  # memo marker: neither zone nor static record


class _Blocked(Answer):
    """An answer [dns.blocklist] gave (counted each time it is served); `source` names the list."""

    __slots__ = ("source",)
    source: str


# Where a public name must not point (dns.blocklist.rebinding): RFC 1918, loopback, link-local,
# CGNAT (RFC 6598), unique local, unspecified (ipaddress's is_private misses 100.64.0.0/10).
_INSIDE = tuple(ipaddress.ip_network(n) for n in (
    "0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16", "172.16.0.0/12",
    "192.168.0.0/16", "::/128", "::1/128", "fc00::/7", "fe80::/10"))


def _points_inside(ans: Answer) -> bool:
    for _t, rdata in wire.answer_addresses(ans):
        ip = ipaddress.ip_address(bytes(rdata))
        if isinstance(ip, IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        if any(ip.version == net.version and ip in net for net in _INSIDE):
            return True
    return False


def _label_boundary(name: bytes, at: int) -> bool:
    off = 0
    while off < at:
        off += name[off] + 1
    return off == at


# --------------------------------------------------------------------------- listener glue


class Ready:
    """An answer packed now: `buffer` (the caller owns it: recycle it after a successful write,
    drop it otherwise) and `max_age` (its remaining TTL: DoH's cache-control).

    `Frontend.query` hands back the same Ready for every immediate answer, refilled each time (no
    allocation per query on the hot path): read it before the Frontend's next query. The one a
    `Later` finishes with is its own.
    """

    __slots__ = ("buffer", "max_age")

    def __init__(self, buffer: Buffer, max_age: int) -> None:
        self.buffer = buffer
        self.max_age = max_age


class Later:
    """An answer that needs an upstream: `answer` finishes with a Ready, or None when the query
    was dropped (limits.dns_max_inflight in flight). Await it (DoH, ODoH), or `then()` a callback
    (the protocol-style listeners). `Frontend.close()` cancels what is still running."""

    __slots__ = ("answer",)

    def __init__(self, answer: asyncio.Task[Ready | None]) -> None:
        self.answer = answer

    def then(self, callback: Callable[[Ready | None], None]) -> None:
        """Call `callback` with the outcome once it is known; never if the task was cancelled."""
        self.answer.add_done_callback(lambda task: _deliver(task, callback))

    def abandon(self) -> None:
        """The client is gone: stop the work, or drop the answer packed already (never written)."""
        task = self.answer
        if not task.done():
            task.cancel()
        elif not task.cancelled() and task.exception() is None:
            ready = task.result()
            if ready is not None:
                ready.buffer.drop()


def _deliver(task: asyncio.Task[Ready | None], callback: Callable[[Ready | None], None]) -> None:
    if task.cancelled():
        return
    exc = task.exception()
    if exc is not None:  # a bug of ours: the query gets no answer, the listener goes on
        log.error("dns: answering a query failed", exc_info=exc)
        return
    callback(task.result())


# What Frontend.query gives: a Ready, a Later, or None (dropped: not a DNS message at all).
QueryResult = Ready | Later | None


class Frontend:
    """What every listener does with a query: parse, answer now or later, pack, count.

    `query()` returns a `Ready` when the answer is known now (its buffer packed), a `Later` when
    it needs an upstream, or None when the query is dropped without an answer.
    """

    def __init__(self, pipeline: Pipeline, stats: ListenerStats, *, limit: int = wire.MAX_MESSAGE,
                 limiter: ClientRateLimit | None = None, mesh_routes: bool = True) -> None:
        self.pipeline = pipeline
        self.mesh_routes = mesh_routes  # False: answers other nodes' questions (dns/mesh_dns.py)
        self.stats = stats
        self.limit = limit
        self.limiter = limiter  # the listener's per-client rate limit (dns/ratelimit.py), if on
        self.tasks: set[asyncio.Task[Ready | None]] = set()
        self.ready = Ready(Buffer(0, 0), 0)  # the shared result of every immediate answer
        # the query of the last answer lookup() gave (the fast path learns from it: dns/preformed.py)
        self.answered: Query | None = None

    def query(self, data: bytes | bytearray | memoryview, now: float, peer: object, *,
              limit: int | None = None, pad: bool = False,
              check: Callable[[Query], None] | None = None, udp: bool = False) -> QueryResult:
        stats = self.stats
        stats.queries.inc()
        lim = self.limit if limit is None else limit
        try:
            q = wire.parse_query(data)
        except WireError as e:
            stats.drop("malformed")
            rlog.debug(f"{stats.name} drop {peer}", "dns %s: dropped query from %s: %s", stats.name, peer, e)
            return None
        except FormError as e:
            stats.error("formerr" if e.rcode == wire.FORMERR else wire.RCODE_NAMES.get(e.rcode, "error"))
            rlog.debug(f"{stats.name} bad {peer}", "dns %s: bad query from %s: %s", stats.name, peer, e)
            buf = self.pipeline.buffer(1024)
            wire.error_for(buf, e, pad=pad)
            stats.response(e.rcode)
            ready = self.ready
            ready.buffer = buf
            ready.max_age = 0
            return ready
        if check is not None:
            check(q)  # transport rules (DoQ ID 0, ...): raises to reject
        limiter = self.limiter
        if limiter is not None:
            verdict = limiter.check(peer, now)
            if verdict:
                return self._limited(q, verdict, peer, udp, pad)
        if udp:  # the client's EDNS size, capped to avoid fragmentation (DNS flag day 2020)
            lim = min(q.udp_size, wire.OUR_UDP_SIZE) if q.edns else 512
        pad = pad or q.padding
        pipeline = self.pipeline
        ans = pipeline.lookup(q, now)
        if ans is not None:
            self.answered = q
            ready = self._pack(ans, q, now, lim, pad, self.ready)
            if pipeline.query_log is not None:
                loop_now = asyncio.get_running_loop().time()
                pipeline.query_log.add(peer, self.stats.name, q.name, q.qtype, ans, pipeline.answered_how(q),
                                       (loop_now - now) * 1000.0)
            return ready
        task = asyncio.get_running_loop().create_task(self._later(q, lim, pad, peer, now))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return Later(task)

    def _limited(self, q: Query, verdict: int, peer: object, udp: bool, pad: bool) -> Ready | None:
        """Over the client's rate: on UDP drop it, or (a SLIP) answer an empty TC response; on a
        stream transport answer REFUSED. Counted under drops, one rate-limited line per client."""
        stats = self.stats
        rlog.debug(f"{stats.name} ratelimit {peer}", "dns %s: %s over limits.dns_client_qps",
                   stats.name, peer)
        if udp and verdict == DROP:
            stats.drop("rate_limit")
            return None
        buf = self.pipeline.buffer(1024)
        if udp:
            stats.drop("rate_limit_slip")
            wire.pack_error(buf, q.id, q.flags, wire.NOERROR, q.question, edns=q.edns, tc=True)
            stats.response(wire.NOERROR)
        else:
            stats.drop("rate_limit")
            wire.pack_error(buf, q.id, q.flags, wire.REFUSED, q.question, edns=q.edns, pad=pad or q.padding)
            stats.response(wire.REFUSED)
        ready = self.ready
        ready.buffer = buf
        ready.max_age = 0
        return ready

    def _pack(self, ans: Answer, q: Query, now: float, limit: int, pad: bool, ready: Ready) -> Ready:
        buf = self.pipeline.buffer(wire.packed_size(ans, q, pad))
        ready.max_age = wire.pack_answer(buf, ans, q, now, limit=limit, pad=pad)
        ready.buffer = buf
        self.stats.response(ans.rcode)
        return ready

    async def _later(self, q: Query, limit: int, pad: bool, peer: object, start: float) -> Ready | None:
        pipeline = self.pipeline
        got = await pipeline.resolve_via(q, self.mesh_routes)
        if got is None:
            self.stats.drop("overload")
            return None
        ans, via = got
        now = asyncio.get_running_loop().time()
        ready = self._pack(ans, q, now, limit, pad, Ready.__new__(Ready))
        if pipeline.query_log is not None:
            pipeline.query_log.add(peer, self.stats.name, q.name, q.qtype, ans, via, (now - start) * 1000.0)
        return ready

    def close(self) -> None:
        for t in list(self.tasks):
            t.cancel()
