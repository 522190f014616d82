"""Split DNS (`[[dns.route]]`) against real authorities on loopback: which upstreams a name goes
to, fail-over inside a route, the cache, a node's udp listener, DNS worker processes and a
route's tcp:// upstream at another node's virtual IP (over the mesh)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import dns.asyncquery
import dns.flags
import dns.message
import dns.rcode
import dns.rdatatype
import dns.rrset
import pytest

from meshgate.config import Config, from_dict
from meshgate.dns.resolver import Pipeline
from meshgate.dns.service import DnsService
from meshgate.metrics import REGISTRY
from meshgate.node import Node
from tests.helpers import async_wait_until
from tests.integration.test_dns_upstream import LocalAuthority, ask

MAIN = "192.0.2.1"
CORP = "198.51.100.1"
CORP2 = "198.51.100.2"
ENG = "198.51.100.3"


class TagAuthority(LocalAuthority):
    """Answers every A question with its own `address` (so an answer says who gave it); `silent`:
    answers nothing (an upstream that times out). Counts questions by name in `queries`."""

    def __init__(self, address: str, silent: bool = False) -> None:
        super().__init__()
        self.address = address
        self.silent = silent

    async def respond(self, data: bytes, tcp: bool) -> bytes | None:
        q = dns.message.from_wire(data)
        name = q.question[0].name.to_text().lower()
        (self.tcp_queries if tcp else self.queries)[name] += 1
        if self.silent:
            return None
        r = dns.message.make_response(q)
        r.flags |= dns.flags.AA
        if q.question[0].rdtype == dns.rdatatype.A:
            r.answer.append(dns.rrset.from_text(name, 300, "IN", "A", self.address))
        out: bytes = r.to_wire()
        return out

    def asked(self) -> int:
        return sum(self.queries.values()) + sum(self.tcp_queries.values())


@pytest.fixture
async def auths() -> AsyncIterator[dict[str, TagAuthority]]:
    started = {"main": await TagAuthority(MAIN).start(), "corp": await TagAuthority(CORP).start(),
               "corp2": await TagAuthority(CORP2).start(), "eng": await TagAuthority(ENG).start(),
               "dead": await TagAuthority("0.0.0.0", silent=True).start()}
    yield started
    for a in started.values():
        await a.stop()


def split_config(auths: dict[str, TagAuthority], routes: list[dict[str, Any]], **dns_keys: Any) -> Config:
    return from_dict({
        "node": {"name": "alpha", "ipv4": "10.144.144.1/24"},
        "dns": {"upstreams": [auths["main"].url], "route": routes, **dns_keys},
        "limits": {"dns_timeout": 0.4},
    })


def address(msg: dns.message.Message) -> str:
    addrs = [rr.address for rrset in msg.answer for rr in rrset]
    return addrs[0] if addrs else dns.rcode.to_text(msg.rcode())


async def test_names_under_a_suffix_go_to_the_routes_upstreams_on_label_boundaries(
        auths: dict[str, TagAuthority]) -> None:
    p = Pipeline(split_config(auths, [{"suffix": "Corp.Example", "upstreams": [auths["corp"].url]}]))
    try:
        assert address(await ask(p, "a.corp.example")) == CORP
        assert address(await ask(p, "corp.example")) == CORP  # the suffix itself
        assert address(await ask(p, "B.CORP.Example.")) == CORP  # case does not matter
        assert address(await ask(p, "deep.er.corp.example")) == CORP
        assert address(await ask(p, "xcorp.example")) == MAIN  # not on a label boundary
        assert address(await ask(p, "example")) == MAIN
        assert address(await ask(p, "corp.example.org")) == MAIN
        assert address(await ask(p, "www.other.test")) == MAIN
        assert sorted(auths["corp"].queries) == ["a.corp.example.", "b.corp.example.", "corp.example.",
                                                 "deep.er.corp.example."]
        assert sorted(auths["main"].queries) == ["corp.example.org.", "example.", "www.other.test.",
                                                 "xcorp.example."]
    finally:
        p.close()


async def test_the_longest_suffix_wins(auths: dict[str, TagAuthority]) -> None:
    # the shorter one first in the file: order does not matter, length does
    p = Pipeline(split_config(auths, [{"suffix": "corp.example.", "upstreams": [auths["corp"].url]},
                                      {"suffix": "eng.corp.example.", "upstreams": [auths["eng"].url]}]))
    try:
        assert address(await ask(p, "build.eng.corp.example")) == ENG
        assert address(await ask(p, "eng.corp.example")) == ENG
        assert address(await ask(p, "xeng.corp.example")) == CORP
        assert address(await ask(p, "hr.corp.example")) == CORP
        assert address(await ask(p, "eng.example")) == MAIN
        assert auths["main"].queries.keys() == {"eng.example."}
    finally:
        p.close()


async def test_a_route_upstream_that_times_out_fails_over_to_the_routes_next_one(
        auths: dict[str, TagAuthority]) -> None:
    dead, corp2 = auths["dead"], auths["corp2"]
    p = Pipeline(split_config(auths, [{"suffix": "corp.example.", "upstreams": [dead.url, corp2.url]}]))
    errors = REGISTRY.counter("meshgate_dns_upstream_errors_total", "", ("upstream", "reason"))
    sent = REGISTRY.counter("meshgate_dns_upstream_queries_total", "", ("upstream",))
    before = errors.labels(dead.url, "timeout").value, sent.labels(corp2.url).value
    try:
        assert address(await ask(p, "a.corp.example")) == CORP2
        assert dead.queries["a.corp.example."] == 1
        assert auths["main"].asked() == 0  # never the main list
        # the per-upstream counters, labelled by the route's upstream URLs
        assert errors.labels(dead.url, "timeout").value == before[0] + 1
        assert sent.labels(corp2.url).value == before[1] + 1
        # the route remembers which of its upstreams answered; the main list keeps its own
        assert address(await ask(p, "b.corp.example")) == CORP2
        assert dead.asked() == 1
        assert address(await ask(p, "www.other.test")) == MAIN
        assert p._preferred == 0
    finally:
        p.close()


async def test_a_question_still_tries_every_upstream_when_another_one_moves_the_preferred(
        auths: dict[str, TagAuthority]) -> None:
    """`first` waits on the dead upstream, then fails over to corp2 and makes it the preferred one
    while `second` (started later) still waits on the dead one: `second` must go on to corp2, not
    back to the dead upstream (the start index is read once per question)."""
    dead, corp2 = auths["dead"], auths["corp2"]
    p = Pipeline(split_config(auths, [{"suffix": "corp.example.", "upstreams": [dead.url, corp2.url]}]))
    try:
        first = asyncio.ensure_future(ask(p, "first.corp.example"))
        # `first` is waiting on the dead upstream (its timeout not yet over): start `second` now
        await async_wait_until(lambda: dead.queries.get("first.corp.example.") == 1, 5, "first asks dead")
        second = asyncio.ensure_future(ask(p, "second.corp.example"))
        assert address(await first) == CORP2
        assert address(await second) == CORP2
        assert dead.queries == {"first.corp.example.": 1, "second.corp.example.": 1}
        assert corp2.queries == {"first.corp.example.": 1, "second.corp.example.": 1}
    finally:
        p.close()


async def test_a_route_whose_upstreams_all_fail_answers_servfail_without_the_main_list(
        auths: dict[str, TagAuthority]) -> None:
    p = Pipeline(split_config(auths, [{"suffix": "corp.example.", "upstreams": [auths["dead"].url]}]))
    try:
        assert address(await ask(p, "a.corp.example")) == "SERVFAIL"
        assert auths["main"].asked() == 0
    finally:
        p.close()


async def test_cache_hits_do_no_routing_and_routes_do_not_share_answers(
        auths: dict[str, TagAuthority], monkeypatch: pytest.MonkeyPatch) -> None:
    p = Pipeline(split_config(auths, [{"suffix": "corp.example.", "upstreams": [auths["corp"].url]}]))
    try:
        assert address(await ask(p, "www.corp.example")) == CORP
        assert address(await ask(p, "www.corp.example.org")) == MAIN
        routed: list[bytes] = []
        table_group = p.routes.group

        def counting(name: bytes) -> Any:
            routed.append(name)
            return table_group(name)

        monkeypatch.setattr(p.routes, "group", counting)
        assert address(await ask(p, "WWW.corp.example")) == CORP  # a cache hit
        assert address(await ask(p, "www.corp.example.org")) == MAIN
        assert routed == []  # the hot path never consulted the table
        assert auths["corp"].queries["www.corp.example."] == 1
        assert address(await ask(p, "new.corp.example")) == CORP  # a miss is routed
        assert routed == [b"\x03new\x04corp\x07example\x00"]
    finally:
        p.close()


async def test_mesh_zone_and_static_records_answer_before_a_route(auths: dict[str, TagAuthority]) -> None:
    p = Pipeline(split_config(auths, [{"suffix": "internal.", "upstreams": [auths["corp"].url]},
                                      {"suffix": "corp.example.", "upstreams": [auths["corp"].url]}],
                              records={"printer.corp.example.": "10.1.2.9"}))
    try:
        assert address(await ask(p, "alpha.mesh.internal")) == "10.144.144.1"
        assert address(await ask(p, "nobody.mesh.internal")) == "NXDOMAIN"
        assert address(await ask(p, "printer.corp.example")) == "10.1.2.9"
        assert auths["corp"].asked() == 0
        assert address(await ask(p, "other.internal")) == CORP
    finally:
        p.close()


# --------------------------------------------------------------------------- a node's listeners


def _node_config(tmp_path: Path, auths: dict[str, TagAuthority], workers: int,
                 routes: list[dict[str, Any]], timeout: float = 0.5) -> Config:
    return from_dict({
        "node": {"name": "alpha", "ipv4": "10.144.144.1/24", "state_dir": str(tmp_path / "state")},
        "socks5": {"enable": False},
        "admin": {"enable": False},
        "dns": {"workers": workers, "upstreams": [auths["main"].url], "route": routes,
                "listener": [{"protocol": "udp", "listen": "127.0.0.1:0"}]},
        "limits": {"dns_timeout": timeout},
    })


def _udp_port(node: Node) -> tuple[DnsService, str, int]:
    svc = next(s for s in node.services if s.name == "dns")
    assert isinstance(svc, DnsService)
    url = next(u for u in svc.urls if u.startswith("udp://"))
    return svc, url, int(url.rsplit(":", 1)[1])


async def _udp(port: int, name: str, timeout: float = 5.0) -> str:
    r = await dns.asyncquery.udp(dns.message.make_query(name, "A"), "127.0.0.1", port=port, timeout=timeout)
    return address(r)


async def test_a_nodes_udp_listener_answers_a_routed_name_from_the_route(
        tmp_path: Path, auths: dict[str, TagAuthority]) -> None:
    routes = [{"suffix": "corp.example.", "upstreams": [auths["corp"].url]}]
    node = Node(_node_config(tmp_path, auths, 1, routes))
    await node.start()
    try:
        _svc, _url, port = _udp_port(node)
        assert await _udp(port, "intranet.corp.example") == CORP
        assert await _udp(port, "www.other.test") == MAIN
        assert auths["corp"].queries.keys() == {"intranet.corp.example."}
    finally:
        await node.stop()


async def test_worker_processes_answer_routed_names_with_the_routes_fail_over(
        tmp_path: Path, auths: dict[str, TagAuthority]) -> None:
    """A worker sends a miss to the main process, which routes it; the route fails over through two
    upstreams (the first times out), so a worker must wait two timeouts, not dns.upstreams' one."""
    dead, corp2 = auths["dead"], auths["corp2"]
    routes = [{"suffix": "corp.example.", "upstreams": [dead.url, corp2.url]}]
    # 1 s: the main process answers after one timeout plus a little, a worker gives up after two
    # (one before the fix): a wide margin on a loaded machine, none without the fix
    node = Node(_node_config(tmp_path, auths, 2, routes, timeout=1.0))
    await node.start()
    try:
        svc, url, port = _udp_port(node)
        # Distinct names and fresh sockets (source ports): the kernel spreads them over both
        # processes; each is a miss that the route answers only after its first upstream timed out.
        # The main process remembers that corp2 answered, so later names skip the dead one: ask the
        # whole batch at once, before any answer is back.
        answers = await asyncio.gather(*(_udp(port, f"h{i}.corp.example") for i in range(24)))
        assert answers == [CORP2] * 24
        assert auths["main"].asked() == 0
        assert dead.asked() >= 1
        assert svc.pool is not None
        merge = svc.pool.workers[0].merge
        # the worker answered some of them itself (its counts reach the node in batches)
        await async_wait_until(lambda: merge.queries.get(url, 0) > 0, 5, "the worker's share counted")
    finally:
        await node.stop()


async def test_a_route_reaches_a_resolver_at_another_nodes_virtual_ip_over_the_mesh(tmp_path: Path) -> None:
    """The route's tcp:// upstream is at node b's virtual IP: reached over a mesh stream (dialled
    directly it has no route and would time out), whichever of the two processes gets a query."""
    from tests.helpers import async_wait_until, free_port
    from tests.integration.test_portal_mesh import cfg, start

    dns_port = free_port()
    b = await start(cfg("b", "10.144.9.2/24", node={"state_dir": str(tmp_path / "b")},
                        mesh={"listen": ["tcp://127.0.0.1:0"]},
                        dns={"records": {f"n{i}.far.example.": CORP for i in range(32)},
                             "listener": [{"protocol": "tcp", "listen": f"127.0.0.1:{dns_port}"}]},
                        serve={str(dns_port): f"127.0.0.1:{dns_port}"}))  # b publishes its resolver
    a = await start(cfg("a", "10.144.9.1/24", node={"state_dir": str(tmp_path / "a")},
                        mesh={"peers": [b.mesh.listen_addrs[0]], "direct_fallback": False},
                        dns={"workers": 2, "upstreams": ["udp://127.0.0.1:9"],
                             "route": [{"suffix": "far.example.",
                                        "upstreams": [f"tcp://10.144.9.2:{dns_port}"]}],
                             "listener": [{"protocol": "udp", "listen": "127.0.0.1:0"}]},
                        limits={"dns_timeout": 2.0}))
    try:
        await async_wait_until(lambda: b.mesh.node_id in a.mesh.table.hop_paths, 15, "a route to b")
        _svc, _url, port = _udp_port(a)
        answers = await asyncio.gather(*(_udp(port, f"n{i}.far.example") for i in range(32)))
        assert answers == [CORP] * 32
    finally:
        await a.stop()
        await b.stop()
