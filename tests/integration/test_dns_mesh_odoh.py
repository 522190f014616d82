"""Oblivious DNS through the mesh (`odoh-mesh://TARGET?proxy=PROXY`): three real nodes on
loopback in a line a - b - c; a asks, b proxies, c is the target and resolves through a real
authority on loopback. Hooks on b's and c's mesh datagram handlers show what each one saw."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from meshgate.dns import wire
from meshgate.dns.mesh_odoh import HEAD, PROXY_QUERY, TARGET_QUERY
from meshgate.mesh.channels import ODOH
from meshgate.node import Node
from tests.helpers import async_wait_until
from tests.integration.test_dns_split import CORP, TagAuthority, address, auths
from tests.integration.test_dns_upstream import ask
from tests.integration.test_portal_mesh import cfg, start

__all__ = ["auths"]  # the fixture, imported for pytest


async def _line(tmp_path: Path, auths: dict[str, TagAuthority], upstream: str, *, proxy: bool = True,
                target: bool = True, c_exit: bool = False) -> dict[str, Node]:
    b = await start(cfg("b", "10.144.8.2/24", node={"state_dir": str(tmp_path / "b")},
                        mesh={"listen": ["tcp://127.0.0.1:0"]},
                        dns={"mesh_odoh_proxy": proxy, "upstreams": [auths["main"].url]}))
    url = b.mesh.listen_addrs[0] if b.mesh is not None else ""
    c = await start(cfg("c", "10.144.8.3/24", node={"state_dir": str(tmp_path / "c")},
                        mesh={"peers": [url], "exit_node": c_exit},
                        dns={"mesh_odoh_target": target, "upstreams": [auths["corp"].url]}))
    a = await start(cfg("a", "10.144.8.1/24", node={"state_dir": str(tmp_path / "a")},
                        mesh={"peers": [url], "direct_fallback": False,
                              "exit_nodes": ["auto"] if c_exit else []},
                        dns={"upstreams": [upstream]}, limits={"dns_timeout": 2.0}))
    nodes = {"a": a, "b": b, "c": c}
    ids = {n.mesh.node_id for n in nodes.values() if n.mesh is not None}
    await async_wait_until(lambda: all(n.mesh is not None and ids <= set(n.mesh.table.hop_paths)
                                       for n in nodes.values()), 15, "routes to converge")
    return nodes


def _tap(node: Node) -> list[tuple[int, bytes]]:
    """Every ODOH message the node's mesh hands it: (source node, payload)."""
    assert node.mesh is not None
    seen: list[tuple[int, bytes]] = []
    handler: Callable[[int, bytes], None] = node.mesh._datagram_handlers[ODOH]

    def tapped(src: int, payload: bytes) -> None:
        seen.append((src, payload))
        handler(src, payload)

    node.mesh.on_datagram(ODOH, tapped)
    return seen


@pytest.fixture
async def line(tmp_path: Path, auths: dict[str, TagAuthority]) -> AsyncIterator[dict[str, Node]]:
    nodes = await _line(tmp_path, auths, "odoh-mesh://c?proxy=b")
    yield nodes
    for n in nodes.values():
        await n.stop()


async def test_the_proxy_never_sees_the_question_and_the_target_never_sees_the_asker(
        line: dict[str, Node], auths: dict[str, TagAuthority]) -> None:
    a, b, c = line["a"], line["b"], line["c"]
    assert a.resolver is not None and a.mesh is not None and b.mesh is not None and c.mesh is not None
    at_b, at_c = _tap(b), _tap(c)
    names = [f"secret-host-{i}.corp.example" for i in range(5)]
    for name in names:
        assert address(await ask(a.resolver, name)) == CORP
        assert auths["corp"].queries[name + "."] == 1  # c resolved it, through its own upstream
    assert auths["main"].asked() == 0  # b never resolved anything itself
    # b carried every question (sealed) and never held one in clear
    proxied = [p for _, p in at_b if HEAD.unpack_from(p)[0] == PROXY_QUERY]
    assert len(proxied) >= len(names) and {src for src, _ in at_b} == {a.mesh.node_id, c.mesh.node_id}
    for _, payload in at_b:
        for name in names:
            assert name.encode() not in payload and wire.encode_name(name + ".") not in payload
    # c got every question from b, none from a
    asked_c = [src for src, p in at_c if HEAD.unpack_from(p)[0] == TARGET_QUERY]
    assert len(asked_c) >= len(names) and set(asked_c) == {b.mesh.node_id}


async def test_a_node_that_is_no_proxy_or_no_target_refuses_and_says_which(
        tmp_path: Path, auths: dict[str, TagAuthority]) -> None:
    for kw, word in (({"proxy": False}, "no ODoH proxy"), ({"target": False}, "no ODoH target")):
        nodes = await _line(tmp_path / word.replace(" ", "-"), auths, "odoh-mesh://c?proxy=b", **kw)
        try:
            a = nodes["a"]
            assert a.resolver is not None
            up = a.resolver.upstreams[0]
            q = wire.build_query(7, wire.encode_name("x.corp.example."), wire.TYPE_A, wire.CLASS_IN)
            with pytest.raises(Exception, match=word):
                await up.exchange(q, 2.0)
            assert auths["corp"].asked() == 0
        finally:
            for n in nodes.values():
                await n.stop()


async def test_the_target_can_be_the_exit_and_the_proxy_may_not_be_the_target(
        tmp_path: Path, auths: dict[str, TagAuthority]) -> None:
    nodes = await _line(tmp_path, auths, "odoh-mesh://exit?proxy=b", c_exit=True)
    try:
        a = nodes["a"]
        assert a.resolver is not None
        assert address(await ask(a.resolver, "via-exit.corp.example")) == CORP
        from meshgate.dns.upstream import parse_upstream
        same = parse_upstream("odoh-mesh://c?proxy=c", mesh_odoh=a.mesh_odoh)
        q = wire.build_query(8, wire.encode_name("y.corp.example."), wire.TYPE_A, wire.CLASS_IN)
        with pytest.raises(Exception, match="not be oblivious"):
            await same.exchange(q, 2.0)
    finally:
        for n in nodes.values():
            await n.stop()


async def test_a_rotated_target_key_is_fetched_again_once(
        line: dict[str, Node], auths: dict[str, TagAuthority]) -> None:
    a, c = line["a"], line["c"]
    assert a.resolver is not None and c.mesh_odoh is not None and c.mesh_odoh.target is not None
    assert address(await ask(a.resolver, "before.corp.example")) == CORP
    c.mesh_odoh.target.rotate()
    c.mesh_odoh.target.rotate()  # twice: a's cached config's key is gone, not just previous
    assert address(await ask(a.resolver, "after.corp.example")) == CORP


def test_odoh_mesh_urls_are_checked() -> None:
    from meshgate.config import ConfigError, from_dict
    from meshgate.dns.upstream import parse_upstream

    assert from_dict({"dns": {"upstreams": ["odoh-mesh://c?proxy=b"]}}).dns.upstreams
    for bad in ("odoh-mesh://c", "odoh-mesh://?proxy=b", "odoh-mesh://c?proxy=b&proxy=d"):
        with pytest.raises(ValueError, match="odoh-mesh://TARGET"):
            parse_upstream(bad, mesh_odoh=object())
    with pytest.raises(ValueError, match="in a mesh"):
        parse_upstream("odoh-mesh://c?proxy=b")
    with pytest.raises(ConfigError):
        from_dict({"dns": {"mesh_odoh_proxy": "yes"}})


async def test_garbage_on_the_odoh_channel_is_answered_or_counted_never_a_crash(
        line: dict[str, Node], auths: dict[str, TagAuthority]) -> None:
    from meshgate.dns.mesh_odoh import ERROR, TARGET_ERROR, UNDECRYPTABLE
    from meshgate.metrics import REGISTRY

    a, b, c = line["a"], line["b"], line["c"]
    assert a.mesh is not None and b.mesh is not None and c.mesh is not None and a.resolver is not None
    dropped = REGISTRY.counter("meshgate_dns_mesh_odoh_dropped_total", "", ("reason",))
    short, unknown = dropped.labels("malformed").value, dropped.labels("unknown_type").value
    at_a = _tap(a)
    send = a.mesh.send_datagram
    assert send(c.mesh.node_id, ODOH, b"\x04")  # shorter than a header
    assert send(c.mesh.node_id, ODOH, HEAD.pack(99, 1))  # no such type
    assert send(b.mesh.node_id, ODOH, HEAD.pack(PROXY_QUERY, 2) + b"\x01")  # no target id
    assert send(c.mesh.node_id, ODOH, HEAD.pack(TARGET_QUERY, 3) + b"\x00" * 80)  # not sealed to c
    await async_wait_until(lambda: dropped.labels("malformed").value >= short + 2
                           and dropped.labels("unknown_type").value >= unknown + 1, 5, "counted")
    # the target answers what it cannot open with an error, as it would to a proxy
    await async_wait_until(lambda: any(HEAD.unpack_from(p) == (TARGET_ERROR, 3) for _, p in at_a), 5,
                           "c's error")
    reply = next(p for _, p in at_a if HEAD.unpack_from(p) == (TARGET_ERROR, 3))
    assert reply[HEAD.size] == UNDECRYPTABLE and ERROR != TARGET_ERROR
    assert address(await ask(a.resolver, "still-fine.corp.example")) == CORP
