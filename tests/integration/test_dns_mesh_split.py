"""Split DNS through the mesh (`dns.serve_suffixes`): a node serves a suffix, every other node
forwards names under it there over the mesh with no config of its own.

Three real nodes on loopback in a line a - b - c (tcp:// links; a reaches c only through b, so
the queries travel sealed end to end through a relay), real authorities on loopback behind c.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import dns.message
import dns.rcode
import dns.rrset
import pytest

from meshgate.dns import wire
from meshgate.dns.mesh_dns import MeshDnsUpstream
from meshgate.mesh.channels import DNS_ANSWER
from meshgate.metrics import REGISTRY
from meshgate.node import Node
from tests.helpers import async_wait_until
from tests.integration.test_dns_split import CORP, ENG, MAIN, TagAuthority, _udp, _udp_port, address, auths
from tests.integration.test_dns_upstream import ask
from tests.integration.test_portal_mesh import cfg, start

__all__ = ["auths"]  # the fixture, imported for pytest

CORP_ROUTE = "lan.example."


def _dropped(reason: str) -> float:
    return REGISTRY.counter("meshgate_dns_mesh_dropped_total", "", ("reason",)).labels(reason).value


async def _line(tmp_path: Path, auths: dict[str, TagAuthority], *, a_dns: dict[str, Any] | None = None,
                b_dns: dict[str, Any] | None = None, c_extra: dict[str, Any] | None = None,
                c_serves: str = CORP_ROUTE) -> dict[str, Node]:
    b = await start(cfg("b", "10.144.7.2/24", node={"state_dir": str(tmp_path / "b")},
                        mesh={"listen": ["tcp://127.0.0.1:0"]},
                        **({"dns": b_dns} if b_dns else {})))
    url = b.mesh.listen_addrs[0]
    c = await start(cfg("c", "10.144.7.3/24", node={"state_dir": str(tmp_path / "c")},
                        mesh={"peers": [url]},
                        dns={"serve_suffixes": [c_serves], "upstreams": [auths["dead"].url],
                             "route": [{"suffix": CORP_ROUTE, "upstreams": [auths["corp"].url]}]},
                        limits={"dns_timeout": 0.5}, **(c_extra or {})))
    a = await start(cfg("a", "10.144.7.1/24", node={"state_dir": str(tmp_path / "a")},
                        mesh={"peers": [url], "direct_fallback": False},
                        dns={"upstreams": [auths["main"].url],
                             "listener": [{"protocol": "udp", "listen": "127.0.0.1:0"}], **(a_dns or {})},
                        limits={"dns_timeout": 1.5}))
    nodes = {"a": a, "b": b, "c": c}
    ids = {n.mesh.node_id for n in nodes.values() if n.mesh is not None}
    await async_wait_until(lambda: all(n.mesh is not None and ids <= set(n.mesh.table.hop_paths)
                                       for n in nodes.values()), 15, "routes to converge")
    return nodes


@pytest.fixture
async def line(tmp_path: Path, auths: dict[str, TagAuthority]) -> AsyncIterator[dict[str, Node]]:
    nodes = await _line(tmp_path, auths)
    yield nodes
    for n in nodes.values():
        await n.stop()


async def test_a_name_under_a_suffix_c_serves_is_answered_by_cs_resolver_over_the_mesh(
        line: dict[str, Node], auths: dict[str, TagAuthority]) -> None:
    a, c = line["a"], line["c"]
    assert a.mesh is not None and c.mesh is not None
    # a has no route of its own: its udp listener answers from c's LAN resolver, through b
    _svc, _url, port = _udp_port(a)
    assert await _udp(port, "printer.lan.example") == CORP
    assert auths["corp"].queries["printer.lan.example."] == 1
    assert auths["main"].queries["printer.lan.example."] == 0
    assert a.mesh.table.hop_paths[c.mesh.node_id].hops == 2  # relayed: sealed end to end
    # `meshgate status` says where the names go, and what c serves
    assert a.status()["dns_mesh"] == "lan.example. -> c"
    assert c.status()["dns_mesh"] == "serves lan.example."
    # every other name still goes to a's own upstreams
    assert await _udp(port, "www.other.test") == MAIN
    assert auths["corp"].queries["www.other.test."] == 0


async def test_the_serving_node_refuses_names_outside_its_suffixes(
        line: dict[str, Node], auths: dict[str, TagAuthority]) -> None:
    """A member asking c directly for another name gets REFUSED: c is no open resolver."""
    a, c = line["a"], line["c"]
    assert a.mesh_dns_client is not None and c.mesh is not None
    before = _dropped("refused_not_served")
    up = MeshDnsUpstream(a.mesh_dns_client, c.mesh.node_id, "c")
    query = wire.build_query(0x4242, wire.encode_name("www.example.com."), wire.TYPE_A, wire.CLASS_IN)
    reply = dns.message.from_wire(await up.exchange(query, 2.0))
    assert reply.id == 0x4242 and reply.rcode() == dns.rcode.REFUSED
    assert _dropped("refused_not_served") == before + 1
    assert auths["dead"].asked() == 0 and auths["corp"].asked() == 0


async def test_a_local_route_for_the_same_suffix_wins_and_a_longer_one_too(
        tmp_path: Path, auths: dict[str, TagAuthority]) -> None:
    nodes = await _line(tmp_path, auths, a_dns={"route": [
        {"suffix": CORP_ROUTE, "upstreams": [auths["eng"].url]},  # the same suffix: a's own wins
    ]})
    try:
        a = nodes["a"]
        assert a.resolver is not None
        assert address(await ask(a.resolver, "x.lan.example")) == ENG
        assert auths["corp"].asked() == 0
    finally:
        for n in nodes.values():
            await n.stop()
    nodes = await _line(tmp_path, auths, a_dns={"route": [
        {"suffix": "example.", "upstreams": [auths["eng"].url]},  # shorter: c's suffix is longer
    ]})
    try:
        a = nodes["a"]
        assert a.resolver is not None
        assert address(await ask(a.resolver, "y.lan.example")) == CORP
        assert address(await ask(a.resolver, "y.example")) == ENG
    finally:
        for n in nodes.values():
            await n.stop()


async def test_a_node_serving_a_suffix_answers_it_itself_and_never_forwards_a_mesh_question(
        tmp_path: Path, auths: dict[str, TagAuthority]) -> None:
    """b serves the same suffix with a dead upstream. b's own clients are answered by b's config
    (SERVFAIL), never by c; a question a sends to b is resolved by b without mesh routes (no
    loop through c), and a fails over from b's SERVFAIL to c, the next nearest."""
    nodes = await _line(tmp_path, auths, b_dns={
        "serve_suffixes": [CORP_ROUTE], "upstreams": [auths["dead"].url],
        "listener": [{"protocol": "udp", "listen": "127.0.0.1:0"}]})
    try:
        a, b = nodes["a"], nodes["b"]
        assert b.resolver is not None and a.resolver is not None
        assert address(await ask(b.resolver, "nas.lan.example")) == "SERVFAIL"
        assert auths["corp"].asked() == 0  # b did not hand its own suffix to c
        dead_before = auths["dead"].asked()
        assert address(await ask(a.resolver, "nas2.lan.example")) == CORP
        assert auths["dead"].asked() > dead_before  # b was asked first (nearest), failed
        assert auths["corp"].queries["nas2.lan.example."] == 1  # then c, once: no loop
    finally:
        for n in nodes.values():
            await n.stop()


async def test_a_question_that_came_over_the_mesh_is_not_forwarded_again(
        tmp_path: Path, auths: dict[str, TagAuthority]) -> None:
    """b serves lan.example. (an upstream that fails), c the longer x.lan.example.: a question for a name
    under c's suffix sent to b is answered by b's own config, never handed on to c."""
    # b's upstream refuses at once (nothing listens on port 9): SERVFAIL without a timeout
    nodes = await _line(tmp_path, auths, c_serves="x.lan.example.",
                        b_dns={"serve_suffixes": ["lan.example."], "upstreams": ["udp://127.0.0.1:9"]})
    try:
        a, b, c = nodes["a"], nodes["b"], nodes["c"]
        assert a.mesh_dns_client is not None and b.mesh is not None and c.mesh is not None
        assert b.resolver is not None and a.resolver is not None
        assert "x.lan.example." in b.mesh.dns_servers()[1]
        up = MeshDnsUpstream(a.mesh_dns_client, b.mesh.node_id, "b")
        query = wire.build_query(0x2222, wire.encode_name("h.x.lan.example."), wire.TYPE_A, wire.CLASS_IN)
        reply = dns.message.from_wire(await up.exchange(query, 3.0))
        assert reply.rcode() == dns.rcode.SERVFAIL
        assert auths["corp"].asked() == 0
        # b's own clients do go to c for it: the longer suffix
        assert address(await ask(b.resolver, "h2.x.lan.example")) == CORP
    finally:
        for n in nodes.values():
            await n.stop()


async def test_access_rules_keep_a_member_out_of_the_served_suffix(
        tmp_path: Path, auths: dict[str, TagAuthority]) -> None:
    """c's [[acl]] lets a reach only port 22: its mesh DNS questions are REFUSED and counted."""
    before = _dropped("refused_acl")
    nodes = await _line(tmp_path, auths, c_extra={"acl": [{"from": ["node:a"], "to": ["self:22"]}]})
    try:
        a = nodes["a"]
        assert a.resolver is not None
        assert address(await ask(a.resolver, "printer.lan.example")) == "REFUSED"
        assert auths["corp"].asked() == 0
        assert _dropped("refused_acl") == before + 1
    finally:
        for n in nodes.values():
            await n.stop()


async def test_a_serving_node_that_goes_away_takes_its_route_with_it(
        line: dict[str, Node], auths: dict[str, TagAuthority]) -> None:
    a, c = line["a"], line["c"]
    assert a.mesh is not None and c.mesh is not None and a.resolver is not None
    assert address(await ask(a.resolver, "one.lan.example")) == CORP
    cid = c.mesh.node_id
    await c.stop()
    await async_wait_until(lambda: cid not in a.mesh.table.hop_paths, 15, "c's routes withdrawn")
    assert address(await ask(a.resolver, "two.lan.example")) == MAIN  # a's own upstreams again
    assert auths["corp"].queries["two.lan.example."] == 0


async def test_a_forged_answer_from_another_node_is_dropped(
        line: dict[str, Node], auths: dict[str, TagAuthority]) -> None:
    """b (a member holding the network secret, and the relay) answers a's pending request id
    itself: a drops it (counted) and takes c's real answer."""
    a, b, c = line["a"], line["b"], line["c"]
    assert a.mesh_dns_client is not None and a.mesh is not None and b.mesh is not None
    assert c.mesh is not None
    client = a.mesh_dns_client
    real_send = client.send
    before = _dropped("wrong_source")

    def send_and_forge(node_id: int, channel: int, payload: bytes) -> bool:
        ok = real_send(node_id, channel, payload)
        forged = dns.message.make_response(dns.message.from_wire(payload[4:]))
        forged.answer.append(dns.rrset.from_text(forged.question[0].name, 60, "IN", "A", "203.0.113.66"))
        assert b.mesh is not None and a.mesh is not None
        b.mesh.send_datagram(a.mesh.node_id, DNS_ANSWER, payload[:4] + forged.to_wire())
        return ok

    client.send = send_and_forge
    try:
        up = MeshDnsUpstream(client, c.mesh.node_id, "c")
        query = wire.build_query(0x1111, wire.encode_name("cam.lan.example."), wire.TYPE_A, wire.CLASS_IN)
        reply = dns.message.from_wire(await up.exchange(query, 3.0))
        assert address(reply) == CORP
        await async_wait_until(lambda: _dropped("wrong_source") >= before + 1, 5, "the forgery counted")
    finally:
        client.send = real_send


async def test_certificate_mode_serves_a_granted_suffix_and_refuses_to_start_with_one_not_granted(
        tmp_path: Path, auths: dict[str, TagAuthority]) -> None:
    from meshgate.errors import StartupError
    from meshgate.mesh.identity import load_or_create
    from tests.identity_testing import TestCA

    ca = TestCA(tmp_path)

    def node_cfg(name: str, ip: str, grants: dict[str, Any], **sections: Any) -> Any:
        cert = ca.issue(name, load_or_create(tmp_path / name), ip, **grants)
        return cfg(name, ip, node={"state_dir": str(tmp_path / name), "network": "testnet", "secret": "",
                                   **ca.node_keys(cert)}, **sections)

    c_dns = {"serve_suffixes": [CORP_ROUTE],
             "route": [{"suffix": CORP_ROUTE, "upstreams": [auths["corp"].url]}]}
    with pytest.raises(StartupError, match=r"dns.serve_suffixes lan.example."):
        await start(node_cfg("c", "10.144.7.3/24", {}, mesh={"listen": ["tcp://127.0.0.1:0"]}, dns=c_dns))
    c = await start(node_cfg("c", "10.144.7.3/24", {"dns": (CORP_ROUTE,)},
                             mesh={"listen": ["tcp://127.0.0.1:0"]}, dns=c_dns))
    assert c.mesh is not None
    a = await start(node_cfg("a", "10.144.7.1/24", {}, mesh={"peers": [c.mesh.listen_addrs[0]]},
                             dns={"upstreams": [auths["main"].url]}))
    try:
        assert a.mesh is not None and a.resolver is not None
        cid = c.mesh.node_id
        await async_wait_until(lambda: cid in a.mesh.table.hop_paths, 15, "a route to c")
        assert address(await ask(a.resolver, "printer.lan.example")) == CORP
        # a reload may not claim what the certificate does not grant (Node._check refuses it)
        with pytest.raises(StartupError, match=r"dns\.serve_suffixes other\.example\."):
            c.mesh.check_dns_suffixes(("lan.example.", "other.example."))
        c.mesh.check_dns_suffixes(("a.lan.example.",))
    finally:
        await a.stop()
        await c.stop()


async def test_garbage_on_the_mesh_dns_channels_is_counted_and_dropped(
        line: dict[str, Node], auths: dict[str, TagAuthority]) -> None:
    """A member sends c short, truncated and non-DNS questions and a stray answer: each is
    dropped and counted (no reply, no crash), and c goes on answering."""
    from meshgate.mesh.channels import DNS_QUERY

    a, b, c = line["a"], line["b"], line["c"]
    assert b.mesh is not None and c.mesh is not None and a.mesh is not None and a.resolver is not None
    short, stray = _dropped("malformed"), _dropped("stray")
    before_q = REGISTRY.counter("meshgate_dns_dropped_total", "", ("listener", "reason")).labels(
        "mesh", "malformed").value
    for junk in (b"", b"\x00\x00\x00\x01", b"\x00\x00\x00\x01" + b"\xff" * 40):
        assert b.mesh.send_datagram(c.mesh.node_id, DNS_QUERY, junk)
    # an answer to a question nobody asked
    assert b.mesh.send_datagram(a.mesh.node_id, DNS_ANSWER, b"\x00\x00\x99\x99" + bytes(12))
    await async_wait_until(lambda: _dropped("malformed") >= short + 2 and _dropped("stray") >= stray + 1,
                           5, "the garbage counted")
    await async_wait_until(
        lambda: REGISTRY.counter("meshgate_dns_dropped_total", "", ("listener", "reason")).labels(
            "mesh", "malformed").value >= before_q + 1, 5, "the non-DNS question counted")
    assert address(await ask(a.resolver, "after-garbage.lan.example")) == CORP


async def test_a_reload_changes_the_served_suffixes_and_every_node_follows(
        tmp_path: Path, auths: dict[str, TagAuthority]) -> None:
    from tests.integration.test_portal_mesh import SECRET

    path = tmp_path / "c.toml"

    def write(suffixes: list[str]) -> None:
        listed = ", ".join(f'"{s}"' for s in suffixes)
        path.write_text(
            f'[node]\nname = "c"\nnetwork = "pm"\nsecret = "{SECRET}"\nipv4 = "10.144.7.3/24"\n'
            f'state_dir = "{tmp_path / "c"}"\n[admin]\nenable = false\n[socks5]\nenable = false\n'
            '[mesh]\nlisten = ["tcp://127.0.0.1:0"]\n'
            f'[dns]\nupstreams = ["{auths["corp"].url}"]\nserve_suffixes = [{listed}]\n')

    from meshgate.config import load

    write(["lan.example."])
    c = Node(load(str(path)), config_path=str(path))
    await c.start()
    assert c.mesh is not None
    a = await start(cfg("a", "10.144.7.1/24", node={"state_dir": str(tmp_path / "a")},
                        mesh={"peers": [c.mesh.listen_addrs[0]]},
                        dns={"upstreams": [auths["main"].url]}, limits={"dns_timeout": 1.5}))
    try:
        assert a.mesh is not None and a.resolver is not None
        await async_wait_until(lambda: "lan.example." in a.mesh.dns_servers()[1], 15, "c's suffix at a")
        assert address(await ask(a.resolver, "one.new.example")) == MAIN
        write(["lan.example.", "new.example."])
        res = c.reload()
        assert res.applied and res.changed == ("dns.serve_suffixes",), res.message
        await async_wait_until(lambda: "new.example." in a.mesh.dns_servers()[1], 15, "the new suffix at a")
        assert address(await ask(a.resolver, "two.new.example")) == CORP
        write([])
        assert c.reload().applied
        await async_wait_until(lambda: not a.mesh.dns_servers()[1], 15, "c serving nothing")
        assert address(await ask(a.resolver, "three.lan.example")) == MAIN
    finally:
        await a.stop()
        await c.stop()
