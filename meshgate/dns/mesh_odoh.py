"""Oblivious DNS through the mesh: `odoh-mesh://TARGET?proxy=PROXY` upstreams.

RFC 9230's roles, with mesh nodes for the HTTPS servers: the asking node seals each question
to the target node's ODoH key (HPKE, dns/odoh.py) and sends it to a proxy node, which hands it
on to the target without being able to read it; the target opens it, resolves it through its
own pipeline (dns/odoh_target.py: the question is attributed to no peer), seals the answer,
and the proxy carries it back. The target learns the question and the proxy, never the node
that asked; the proxy learns who asked and which target, never the question or the answer.
Every hop is a mesh datagram on channel ODOH, itself sealed end to end between the two nodes
of that hop, so a relay in between learns nothing either. TARGET may be `exit`: the node
this one's traffic leaves the mesh by (`mesh.exit_nodes`), so answers fit where traffic goes.

Messages (docs/PROTOCOL.md section 6, channel 8): u8 type, u32 request id, then

    1 CONFIG_REQ    asker -> target   (nothing)
    2 CONFIG        target -> asker   ObliviousDoHConfigs
    3 PROXY_QUERY   asker -> proxy    u32 target node id, oblivious query
    4 TARGET_QUERY  proxy -> target   oblivious query (the proxy's own request id)
    5 TARGET_ANSWER target -> proxy   oblivious response
    6 TARGET_ERROR  target -> proxy   u8 code
    7 ANSWER        proxy -> asker    oblivious response
    8 ERROR         -> asker          u8 code (from the proxy, or the target for a config)

The roles are opt-in: `dns.mesh_odoh_target` (answers for any member: an open resolver for
the mesh, as an ODoH target is for the Internet) and `dns.mesh_odoh_proxy`. A proxy holds at
most `limits.dns_max_inflight` questions, each for `limits.dns_timeout`; answers are taken
only from the node a question went to.
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import parse_qs

from meshgate.buffers import Buffer
from meshgate.config import DnsListenerConfig, HostPort, LimitsConfig
from meshgate.dns import odoh
from meshgate.dns.mesh_requests import MeshRequests
from meshgate.dns.odoh_client import padding_for
from meshgate.dns.odoh_target import OdohTarget
from meshgate.dns.resolver import Pipeline
from meshgate.dns.stats import ListenerStats
from meshgate.dns.upstream import Upstream, UpstreamOptions
from meshgate.dns.upstream_pool import UpstreamError
from meshgate.logs import RateLimitedLog
from meshgate.metrics import REGISTRY

log = logging.getLogger("meshgate.dns.odoh")
_rlog = RateLimitedLog(log)

HEAD = struct.Struct("!BI")
NODE = struct.Struct("!I")
CODE = struct.Struct("!B")
CONFIG_REQ, CONFIG, PROXY_QUERY, TARGET_QUERY, TARGET_ANSWER, TARGET_ERROR, ANSWER, ERROR = range(1, 9)
# error codes
NOT_TARGET, NOT_PROXY, UNKNOWN_KEY, UNDECRYPTABLE, NO_ROUTE, BUSY, FAILED = range(1, 8)
ERRORS = {NOT_TARGET: "the node is no ODoH target (dns.mesh_odoh_target)",
          NOT_PROXY: "the node is no ODoH proxy (dns.mesh_odoh_proxy)",
          UNKNOWN_KEY: "the target no longer has that key", UNDECRYPTABLE: "the target could not open it",
          NO_ROUTE: "the proxy has no route to the target", BUSY: "too many questions in flight",
          FAILED: "the target failed to answer"}
CONFIG_TTL = 3600.0  # a config is asked again after this (or at once when the target lost its key)

_dropped = REGISTRY.counter(
    "meshgate_dns_mesh_odoh_dropped_total", "Mesh ODoH messages not used", ("reason",)
)
_proxied = REGISTRY.counter("meshgate_dns_mesh_odoh_proxied_total", "Questions this node proxied")

# (node id, payload) -> sent
Send = Callable[[int, bytes], bool]
# "exit", a node name, a virtual IP or a hex node id -> that node's id, or None
FindNode = Callable[[str], int | None]


class _Refused(Exception):
    def __init__(self, code: int) -> None:
        super().__init__(ERRORS.get(code, f"error {code}"))
        self.code = code


class MeshOdoh:
    """This node's side of ODoH through the mesh: the asker, and the proxy and target roles
    when configured. `on_datagram` takes every ODOH message from the mesh."""

    def __init__(self, send: Send, find: FindNode, limits: LimitsConfig, *, proxy: bool = False) -> None:
        self.send = send
        self.find = find
        self.proxy = proxy
        self.limits = limits
        self.timeout = limits.dns_timeout
        self.max_proxied = limits.dns_max_inflight
        self.target: OdohTarget | None = None
        self.requests: MeshRequests[tuple[int, bytes]] = MeshRequests(self.max_proxied, _dropped.labels,
                                                                       "mesh ODoH")
        # the proxy's own request id -> (asker, its request id, target, deadline), oldest first
        self._proxied: OrderedDict[int, tuple[int, int, int, float]] = OrderedDict()
        self._configs: dict[int, tuple[odoh.ObliviousDoHConfigContents, float]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._rotation: asyncio.TimerHandle | None = None

    def serve_target(self, pipeline: Pipeline) -> None:
        """Take the target role, answering through `pipeline` (built after this object: its
        upstreams may be odoh-mesh ones). Keys are fresh and rotated daily (the previous one
        accepted until the next rotation)."""
        listener = DnsListenerConfig("odoh", HostPort("mesh", 0))
        self.target = OdohTarget(listener, self.limits, pipeline, ListenerStats("odoh-mesh"))

    def start(self) -> None:
        if self.target is not None and self.target.rotation is not None:
            self._schedule_rotation(self.target.rotation)

    def _schedule_rotation(self, period: float) -> None:
        def rotate() -> None:
            assert self.target is not None
            self.target.rotate()
            self._schedule_rotation(period)
        self._rotation = asyncio.get_running_loop().call_later(period, rotate)

    # ------------------------------------------------------------ asking

    async def query(self, target_ref: str, proxy_ref: str, wire: bytes, timeout: float, url: str) -> bytes:
        target, proxy = self.find(target_ref), self.find(proxy_ref)
        if target is None:
            raise UpstreamError(f"{url}: no node {target_ref!r} (the target) in the mesh")
        if proxy is None:
            raise UpstreamError(f"{url}: no node {proxy_ref!r} (the proxy) in the mesh")
        if proxy == target:
            raise UpstreamError(f"{url}: the proxy is the target ({target:08x}): that would not be oblivious")
        deadline = asyncio.get_running_loop().time() + timeout
        for attempt in range(2):
            config = await self._config(target, deadline, url, refresh=attempt > 0)
            sealed, ctx = odoh.seal_query(config, wire, padding_for(len(wire)))
            kind, body = await self._request(proxy, PROXY_QUERY, NODE.pack(target) + sealed, deadline, url)
            if kind == ERROR:
                code = body[0] if body else FAILED
                if code == UNKNOWN_KEY and attempt == 0:
                    continue  # the target rotated past our config: ask for it once more
                raise UpstreamError(f"{url}: {ERRORS.get(code, f'error {code}')}")
            try:
                return ctx.open_response(body)
            except odoh.OdohError as e:
                raise UpstreamError(f"{url}: cannot open the target's answer: {e}") from None
        raise UpstreamError(f"{url}: {ERRORS[UNKNOWN_KEY]}")

    async def _config(self, target: int, deadline: float, url: str,
                      refresh: bool) -> odoh.ObliviousDoHConfigContents:
        held = self._configs.get(target)
        if held is not None and not refresh and time.monotonic() < held[1]:
            return held[0]
        kind, body = await self._request(target, CONFIG_REQ, b"", deadline, url)
        if kind == ERROR:
            code = body[0] if body else FAILED
            raise UpstreamError(f"{url}: {ERRORS.get(code, f'error {code}')}")
        try:
            configs = odoh.decode_configs(body)
        except odoh.OdohError as e:
            raise UpstreamError(f"{url}: unusable ODoH configs from {target:08x}: {e}") from None
        if not configs:
            raise UpstreamError(f"{url}: {target:08x} offers no ODoH config this node supports")
        if len(self._configs) >= 256:
            self._configs.clear()  # bounded; every entry is cheap to ask for again
        self._configs[target] = (configs[0], time.monotonic() + CONFIG_TTL)
        return configs[0]

    async def _request(self, node: int, kind: int, body: bytes, deadline: float,
                       url: str) -> tuple[int, bytes]:
        rid = self.requests.new_id(self._proxied)
        payload = HEAD.pack(kind, rid) + body
        left = deadline - asyncio.get_running_loop().time()
        return await self.requests.ask(node, rid, lambda: self.send(node, payload), left, url)

    # ------------------------------------------------------------ the mesh's messages

    def on_datagram(self, src: int, payload: bytes) -> None:
        if len(payload) < HEAD.size:
            _dropped.labels("malformed").inc()
            _rlog.debug(f"odoh-mesh-short:{src}", "mesh ODoH: short message from %08x", src)
            return
        kind, rid = HEAD.unpack_from(payload)
        body = payload[HEAD.size:]
        if kind in (CONFIG, ANSWER, ERROR):
            self._answered(src, kind, rid, body)
        elif kind == CONFIG_REQ:
            if self.target is None:
                self._reply(src, ERROR, rid, CODE.pack(NOT_TARGET))
            else:
                self._reply(src, CONFIG, rid, self.target.keys.configs())
        elif kind == PROXY_QUERY:
            self._proxy_query(src, rid, body)
        elif kind == TARGET_QUERY:
            self._target_query(src, rid, body)
        elif kind in (TARGET_ANSWER, TARGET_ERROR):
            self._target_answered(src, kind, rid, body)
        else:
            _dropped.labels("unknown_type").inc()
            _rlog.debug(f"odoh-mesh-type:{src}", "mesh ODoH: message type %d from %08x", kind, src)

    def _reply(self, node: int, kind: int, rid: int, body: bytes) -> None:
        if not self.send(node, HEAD.pack(kind, rid) + body):
            _dropped.labels("unsent").inc()

    def _answered(self, src: int, kind: int, rid: int, body: bytes) -> None:
        self.requests.answer(src, rid, (kind, body))

    def _proxy_query(self, src: int, rid: int, body: bytes) -> None:
        if not self.proxy:
            self._reply(src, ERROR, rid, CODE.pack(NOT_PROXY))
            return
        if len(body) < NODE.size:
            _dropped.labels("malformed").inc()
            return
        target = NODE.unpack_from(body)[0]
        now = time.monotonic()
        proxied = self._proxied
        while proxied and next(iter(proxied.values()))[3] < now:  # oldest first: drop expired
            proxied.popitem(last=False)
        if len(proxied) >= self.max_proxied:
            _dropped.labels("proxy_full").inc()
            self._reply(src, ERROR, rid, CODE.pack(BUSY))
            return
        pid = self.requests.new_id(self._proxied)
        # The proxy forwards the sealed query as it came: it holds no key to read it.
        if not self.send(target, HEAD.pack(TARGET_QUERY, pid) + body[NODE.size:]):
            self._reply(src, ERROR, rid, CODE.pack(NO_ROUTE))
            return
        proxied[pid] = (src, rid, target, now + self.timeout)
        _proxied.inc()

    def _target_answered(self, src: int, kind: int, pid: int, body: bytes) -> None:
        entry = self._proxied.get(pid)
        if entry is None:
            _dropped.labels("stray").inc()
            return
        asker, rid, target, _ = entry
        if src != target:
            _dropped.labels("wrong_source").inc()
            _rlog.debug(f"odoh-mesh-src:{src}", "mesh ODoH: target answer from %08x, expected %08x",
                        src, target)
            return
        del self._proxied[pid]
        if kind == TARGET_ANSWER:
            self._reply(asker, ANSWER, rid, body)
        else:
            self._reply(asker, ERROR, rid, body[:1] or CODE.pack(FAILED))

    def _target_query(self, src: int, pid: int, body: bytes) -> None:
        target = self.target
        if target is None:
            self._reply(src, TARGET_ERROR, pid, CODE.pack(NOT_TARGET))
            return
        res = target.answer(body)
        if isinstance(res, tuple):
            self._target_reply(src, pid, res)
            return
        task = asyncio.get_running_loop().create_task(self._target_later(src, pid, res))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _target_later(self, src: int, pid: int, res: Awaitable[Any]) -> None:
        self._target_reply(src, pid, await res)

    def _target_reply(self, src: int, pid: int, res: tuple[int, Any, Any]) -> None:
        status, _headers, body = res
        if status == 200:
            data = body.tobytes() if isinstance(body, Buffer) else bytes(body)
            if isinstance(body, Buffer):
                body.recycle()  # copied out
            self._reply(src, TARGET_ANSWER, pid, data)
            return
        code = {401: UNKNOWN_KEY, 400: UNDECRYPTABLE, 503: BUSY}.get(status, FAILED)
        self._reply(src, TARGET_ERROR, pid, CODE.pack(code))

    def close(self) -> None:
        if self._rotation is not None:
            self._rotation.cancel()
        for t in list(self._tasks):
            t.cancel()
        self.requests.close()
        if self.target is not None:
            self.target.close()


class MeshOdohUpstream(Upstream):
    """`odoh-mesh://TARGET?proxy=PROXY`: TARGET and PROXY are node names, virtual IPs or node
    ids; TARGET may be `exit`."""

    def __init__(self, url: str, hub: MeshOdoh, target: str, proxy: str) -> None:
        self.url = url
        self.hub = hub
        self.target = target
        self.proxy = proxy

    @classmethod
    def from_url(cls, url: str, rest: str, sni: str, options: UpstreamOptions) -> Upstream:
        target, _, query = rest.partition("?")
        proxies = parse_qs(query).get("proxy", [])
        if not target or len(proxies) != 1 or not proxies[0]:
            raise ValueError(f"{url!r}: expected odoh-mesh://TARGET?proxy=PROXY (node names)")
        hub = options.mesh_odoh
        if not isinstance(hub, MeshOdoh):
            raise ValueError(f"{url!r}: odoh-mesh upstreams need this node in a mesh")
        return cls(url, hub, target.rstrip("/"), proxies[0])

    async def exchange(self, wire: bytes, timeout: float) -> bytes:
        return await self.hub.query(self.target, self.proxy, wire, timeout, self.url)
