"""SOCKS5 portal over the mesh, three full nodes in one process (A — B — C on loopback TCP links).

Everything shares one loopback here, so where a connection left the mesh is
proven by counters on the node that egressed, not by the source address;
tests/system/test_portal_netns.py checks sources in real namespaces.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import ipaddress
from collections.abc import AsyncIterator
from typing import Any

import pytest
from python_socks import ProxyError
from python_socks.async_.asyncio import Proxy

from meshgate.config import from_dict
from meshgate.metrics import REGISTRY
from meshgate.node import Node
from tests.helpers import async_wait_until, free_port

SECRET = "portal-mesh-test-secret"
# the one port a and c publish on their virtual IPs ([serve]), TCP and UDP: the echo servers'
SERVED = free_port()
SERVE = {str(SERVED): f"127.0.0.1:{SERVED}"}


def cfg(name: str, ipv4: str, **sections: Any) -> Any:
    raw: dict[str, Any] = {
        "node": {"name": name, "network": "pm", "secret": SECRET, "ipv4": ipv4, "state_dir": "/nonexistent"},
        "admin": {"enable": False},
        "socks5": {"enable": False},
    }
    for k, v in sections.items():
        if isinstance(v, list):  # [[acl]]
            raw[k] = v
        else:
            raw.setdefault(k, {}).update(v)
    return from_dict(raw)


async def start(config: Any) -> Node:
    node = Node(config)
    await node.start()
    return node


@pytest.fixture
async def line(tmp_path: Any) -> AsyncIterator[dict[str, Node]]:
    state = {k: str(tmp_path / k) for k in "abc"}
    b = await start(cfg("b", "10.144.1.2/24", node={"state_dir": state["b"]},
                        mesh={"listen": ["tcp://127.0.0.1:0"]}))
    url = b.mesh.listen_addrs[0]
    c = await start(cfg("c", "10.144.1.3/24", node={"state_dir": state["c"]}, serve=SERVE,
                        mesh={"peers": [url], "exit_node": True,
                              "proxy_cidrs": ["127.0.0.0/24->10.2.2.0/24"]}))
    a = await start(cfg("a", "10.144.1.1/24", node={"state_dir": state["a"]}, serve=SERVE,
                        mesh={"peers": [url], "exit_nodes": ["auto"], "direct_fallback": False},
                        socks5={"enable": True, "listen": "127.0.0.1:0"}))
    nodes = {"a": a, "b": b, "c": c}
    ids = {n.mesh.node_id for n in nodes.values()}
    await async_wait_until(lambda: all(ids <= set(n.mesh.table.hop_paths) for n in nodes.values()),
                           15, "routes to converge")
    yield nodes
    for n in (a, c, b):
        await n.stop()


def portal(nodes: dict[str, Node]) -> Proxy:
    svc = next(s for s in nodes["a"].services if s.name == "socks5")
    addr = svc.address  # type: ignore[attr-defined]
    return Proxy.from_url(f"socks5://{addr.host}:{addr.port}", rdns=True)


async def echo_server() -> tuple[asyncio.Server, int]:
    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        data = await r.read(1 << 16)
        w.write(b"echo:" + data)
        await w.drain()
        w.close()

    server = await asyncio.start_server(handle, "127.0.0.1", SERVED)
    return server, server.sockets[0].getsockname()[1]


async def roundtrip(proxy: Proxy, host: str, port: int, payload: bytes = b"hello") -> bytes:
    sock = await proxy.connect(dest_host=host, dest_port=port, timeout=10)
    reader, writer = await asyncio.open_connection(sock=sock)
    writer.write(payload)
    await writer.drain()
    data = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    return data


def egress_ok() -> float:
    return REGISTRY.value("meshgate_egress_connects_total", "ok")


def routed(via: str) -> float:
    return REGISTRY.value("meshgate_socks5_routed_total", via)


async def test_destinations_reach_the_right_node(line: dict[str, Node]) -> None:
    server, port = await echo_server()
    proxy = portal(line)
    try:
        before = routed("self"), routed("peer"), routed("cidr")
        # A's own virtual IP: A's loopback, no mesh hop
        assert await roundtrip(proxy, "10.144.1.1", port) == b"echo:hello"
        assert routed("self") == before[0] + 1
        # C's virtual IP, relayed by B
        egress_before = egress_ok()
        assert await roundtrip(proxy, "10.144.1.3", port, b"via-b") == b"echo:via-b"
        assert routed("peer") == before[1] + 1
        assert egress_ok() == egress_before + 1  # C's policy-checked egress made the connection
        # C's node name resolves to its virtual IP on A
        assert await roundtrip(proxy, "c.mesh.internal", port, b"byname") == b"echo:byname"
        # the mapped proxy CIDR: 10.2.2.1 on A is 127.0.0.1 at C (host bits kept)
        assert await roundtrip(proxy, "10.2.2.1", port, b"mapped") == b"echo:mapped"
        assert routed("cidr") == before[2] + 1
    finally:
        server.close()


async def test_bulk_both_ways_through_relay(line: dict[str, Node]) -> None:
    payload = hashlib.sha256(b"x").digest() * (4 << 15)  # 4 MiB

    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        h = hashlib.sha256()
        while chunk := await r.read(1 << 16):
            h.update(chunk)
        w.write(h.hexdigest().encode() + payload)
        await w.drain()
        w.close()

    server = await asyncio.start_server(handle, "127.0.0.1", SERVED)  # the port c publishes
    port = server.sockets[0].getsockname()[1]
    try:
        sock = await portal(line).connect(dest_host="10.144.1.3", dest_port=port, timeout=10)
        reader, writer = await asyncio.open_connection(sock=sock)
        writer.write(payload)
        await writer.drain()
        writer.write_eof()  # half-close travels through the mesh; the answer still comes back
        got = await asyncio.wait_for(reader.read(), 30)
        writer.close()
        assert got[:64].decode() == hashlib.sha256(payload).hexdigest()
        assert got[64:] == payload
    finally:
        server.close()


@pytest.mark.parametrize(
    "host,code",
    [
        ("10.144.1.99", 0x03),       # unassigned address in the mesh subnet: nobody serves it
        ("nosuch.mesh.internal", 0x04),
        ("127.0.1.1", 0x02),          # loopback outside C's proxy CIDR: refused without allow_private
        ("10.1.5.5", 0x02),           # private, not C's own proxy CIDR: refused at the exit
    ],
)
async def test_refusals_map_to_reply_codes(line: dict[str, Node], host: str, code: int) -> None:
    with pytest.raises(ProxyError) as ei:
        await portal(line).connect(dest_host=host, dest_port=80, timeout=10)
    assert ei.value.error_code == code


async def test_refused_port_at_far_end_is_0x05(line: dict[str, Node]) -> None:
    server, port = await echo_server()
    server.close()
    await server.wait_closed()
    with pytest.raises(ProxyError) as ei:
        await portal(line).connect(dest_host="10.144.1.3", dest_port=port, timeout=10)
    assert ei.value.error_code == 0x05


async def test_dns_upstream_on_another_node_is_reached_over_the_mesh(tmp_path: Any) -> None:
    """A node with no route of its own to a resolver at a peer's virtual IP asks it over a mesh
    stream (the demo portal forwards non-mesh names to the exit this way)."""
    from tests.helpers import free_port

    dns_port = free_port()
    b = await start(cfg("b", "10.144.2.2/24", node={"state_dir": str(tmp_path / "b")},
                        mesh={"listen": ["tcp://127.0.0.1:0"]},
                        dns={"records": {"far.example.": "192.0.2.7"},
                             "listener": [{"protocol": "tcp", "listen": f"127.0.0.1:{dns_port}"}]},
                        serve={str(dns_port): f"127.0.0.1:{dns_port}"}))  # b publishes its resolver
    a = await start(cfg("a", "10.144.2.1/24", node={"state_dir": str(tmp_path / "a")},
                        mesh={"peers": [b.mesh.listen_addrs[0]]},
                        dns={"upstreams": [f"tcp://10.144.2.2:{dns_port}"]}))
    try:
        await async_wait_until(lambda: b.mesh.node_id in a.mesh.table.hop_paths, 15, "a route to b")
        before = routed("peer")
        assert await a.resolver.resolve_host("far.example") == ["192.0.2.7"]
        # The A and AAAA queries went to b over one pooled mesh stream (the upstream pipelines them).
        assert routed("peer") == before + 1
    finally:
        await a.stop()
        await b.stop()


# --------------------------------------------------------------------------- UDP ASSOCIATE over the mesh


async def test_udp_associate_over_the_mesh(line: dict[str, Node]) -> None:
    import socket

    from tests.helpers import UdpEcho
    from tests.integration.test_socks5_server import read_reply, request, udp_exchange, udp_header

    svc = next(s for s in line["a"].services if s.name == "socks5")
    addr = svc.address  # type: ignore[attr-defined]
    echo = UdpEcho("127.0.0.1", prefix=b"echo:", port=SERVED)
    client = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    client.bind(("127.0.0.1", 0))
    client.setblocking(False)
    reader, writer = await asyncio.open_connection(addr.host, addr.port)
    try:
        writer.write(b"\x05\x01\x00")
        assert await reader.readexactly(2) == b"\x05\x00"
        writer.write(request(3, 1, bytes(4), 0))
        rep, _atyp, bnd, port = await read_reply(reader)
        assert rep == 0
        relay = (socket.inet_ntoa(bnd), port)
        egress_before = REGISTRY.value("meshgate_mesh_udp_datagrams_total", "received")

        # C's virtual IP: the datagram leaves at C (its loopback), the reply comes back via B
        hdr = udp_header(1, socket.inet_aton("10.144.1.3"), echo.port)
        assert await udp_exchange(client, relay, hdr + b"to-c") == hdr + b"echo:to-c"
        # the mapped proxy CIDR on C: 10.2.2.1 -> 127.0.0.1, the reply under the mapped address
        mapped = udp_header(1, socket.inet_aton("10.2.2.1"), echo.port)
        assert await udp_exchange(client, relay, mapped + b"mapped") == mapped + b"echo:mapped"
        # a mesh name resolves to C's virtual IP; the reply keeps the name
        named = udp_header(3, b"c.mesh.internal", echo.port)
        assert await udp_exchange(client, relay, named + b"named") == named + b"echo:named"
        assert REGISTRY.value("meshgate_mesh_udp_datagrams_total", "received") == egress_before + 3

        # a private address outside C's proxy CIDR is refused by C's exit policy and counted
        refused = REGISTRY.value("meshgate_mesh_udp_dropped_total", "not_allowed")
        client.sendto(udp_header(1, socket.inet_aton("10.1.5.5"), 53) + b"nope", relay)
        await async_wait_until(
            lambda: REGISTRY.value("meshgate_mesh_udp_dropped_total", "not_allowed") == refused + 1,
            what="policy drop counted at the exit")
        assert len(echo.received) == 3

        # b, a member that relays but was never sent to, injects a reply into a's association
        from meshgate.gateway.mesh_udp import UDP_REPLY_CHANNEL, encode_head

        hub = line["a"].udp_hub
        assoc = next(iter(hub.portals))
        wrong = REGISTRY.value("meshgate_mesh_udp_dropped_total", "reply_from_wrong_node")
        fake = encode_head(assoc, ipaddress.ip_address("10.144.1.3"), echo.port) + b"injected"
        assert line["b"].mesh.send_datagram(line["a"].mesh.node_id, UDP_REPLY_CHANNEL, fake)
        await async_wait_until(
            lambda: REGISTRY.value("meshgate_mesh_udp_dropped_total", "reply_from_wrong_node") == wrong + 1,
            what="the injected reply dropped")
        client_got = []
        with contextlib.suppress(BlockingIOError):
            client_got.append(client.recv(65536))
        assert client_got == []
    finally:
        writer.close()
        client.close()
        echo.close()
    # the association ends with its TCP connection: A forgets it
    hub = line["a"].udp_hub
    await async_wait_until(lambda: not hub.portals, what="association closed on A")


async def test_direct_fallback_never_takes_the_mesh_subnet(tmp_path: Any) -> None:
    """With direct_fallback on, an unrouted address in the node's own virtual subnet is refused
    (0x03), not connected from the host. The subnet is on loopback here so that a regression
    would only ever reach 127.77.0.99 (and show up as 0x05 from the kernel)."""
    a = await start(cfg("solo", "127.77.0.1/24", node={"state_dir": str(tmp_path / "solo")},
                        mesh={"direct_fallback": True}, socks5={"enable": True, "listen": "127.0.0.1:0"}))
    try:
        svc = next(s for s in a.services if s.name == "socks5")
        addr = svc.address  # type: ignore[attr-defined]
        proxy = Proxy.from_url(f"socks5://{addr.host}:{addr.port}")
        with pytest.raises(ProxyError) as ei:
            await proxy.connect(dest_host="127.77.0.99", dest_port=9, timeout=10)
        assert ei.value.error_code == 0x03
        # outside the mesh subnet the fallback still works
        server, port = await echo_server()
        try:
            assert await roundtrip(proxy, "127.0.0.1", port) == b"echo:hello"
        finally:
            server.close()
    finally:
        await a.stop()


async def test_a_virtual_ip_reaches_only_what_its_node_publishes(line: dict[str, Node]) -> None:
    """[serve]: c's virtual IP is not c's loopback. A service c keeps on loopback on purpose
    (here a plain listener on another port, as c's admin API or a database would be) is refused
    (0x02) through the mesh; the published port works."""
    hidden = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    hidden_port = hidden.sockets[0].getsockname()[1]
    server, port = await echo_server()
    refused = REGISTRY.value("meshgate_egress_refused_total", "not_served")
    try:
        with pytest.raises(ProxyError) as e:
            await portal(line).connect(dest_host="10.144.1.3", dest_port=hidden_port, timeout=10)
        assert e.value.error_code == 0x02
        assert REGISTRY.value("meshgate_egress_refused_total", "not_served") == refused + 1
        # the own node's virtual IP likewise, for its own portal's users
        with pytest.raises(ProxyError) as e:
            await portal(line).connect(dest_host="10.144.1.1", dest_port=hidden_port, timeout=10)
        assert e.value.error_code == 0x02
        assert await roundtrip(portal(line), "10.144.1.3", port, b"published") == b"echo:published"
    finally:
        hidden.close()
        server.close()


async def test_with_exit_nodes_set_no_reachable_exit_means_refused_not_direct(tmp_path: Any) -> None:
    """mesh.exit_nodes names where traffic leaves; with none reachable the portal refuses
    (0x03) even with direct_fallback on, instead of leaving (and resolving) from its host."""
    a = await start(cfg("lonely", "10.144.9.1/24", node={"state_dir": str(tmp_path / "lonely")},
                        mesh={"direct_fallback": True, "exit_nodes": ["auto"],
                              "peers": ["tcp://127.0.0.1:9"]},
                        socks5={"enable": True, "listen": "127.0.0.1:0"}))
    server, port = await echo_server()
    try:
        svc = next(s for s in a.services if s.name == "socks5")
        addr = svc.address  # type: ignore[attr-defined]
        proxy = Proxy.from_url(f"socks5://{addr.host}:{addr.port}", rdns=True)
        for host in ("127.0.0.1", "localhost"):
            with pytest.raises(ProxyError) as ei:
                await proxy.connect(dest_host=host, dest_port=port, timeout=10)
            assert ei.value.error_code == 0x03, host
    finally:
        server.close()
        await a.stop()


async def test_access_rules_at_the_node_where_traffic_ends(tmp_path: Any) -> None:
    """c allows node a to reach its published port over TCP only; nothing else (the mapped
    proxy CIDR, UDP) passes once a rule exists: 0x02 for CONNECT, a counted drop for UDP."""
    import socket

    from tests.helpers import UdpEcho
    from tests.integration.test_socks5_server import read_reply, request, udp_header

    b = await start(cfg("b", "10.144.3.2/24", node={"state_dir": str(tmp_path / "b")},
                        mesh={"listen": ["tcp://127.0.0.1:0"]}))
    url = b.mesh.listen_addrs[0]
    c = await start(cfg("c", "10.144.3.3/24", node={"state_dir": str(tmp_path / "c")}, serve=SERVE,
                        mesh={"peers": [url], "exit_node": True,
                              "proxy_cidrs": ["127.0.0.0/24->10.2.2.0/24"]},
                        acl=[{"from": ["node:a"], "to": [f"self:{SERVED}"], "proto": "tcp"}]))
    a = await start(cfg("a", "10.144.3.1/24", node={"state_dir": str(tmp_path / "a")},
                        mesh={"peers": [url], "exit_nodes": ["auto"], "direct_fallback": False},
                        socks5={"enable": True, "listen": "127.0.0.1:0"}))
    nodes = {"a": a, "b": b, "c": c}
    server, port = await echo_server()
    echo = UdpEcho("127.0.0.1", prefix=b"echo:", port=SERVED)
    try:
        ids = {n.mesh.node_id for n in nodes.values()}
        await async_wait_until(lambda: all(ids <= set(n.mesh.table.hop_paths) for n in nodes.values()),
                               15, "routes to converge")
        proxy = portal(nodes)
        denied = REGISTRY.value("meshgate_acl_denied_total", "tcp")
        assert await roundtrip(proxy, "10.144.3.3", port, b"allowed") == b"echo:allowed"
        with pytest.raises(ProxyError) as ei:  # c's mapped CIDR: no rule allows it
            await proxy.connect(dest_host="10.2.2.1", dest_port=port, timeout=10)
        assert ei.value.error_code == 0x02
        assert REGISTRY.value("meshgate_acl_denied_total", "tcp") == denied + 1
        # UDP to the published port: the rule is for tcp
        svc = next(s for s in a.services if s.name == "socks5")
        addr = svc.address  # type: ignore[attr-defined]
        client = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        client.bind(("127.0.0.1", 0))
        reader, writer = await asyncio.open_connection(addr.host, addr.port)
        writer.write(b"\x05\x01\x00")
        assert await reader.readexactly(2) == b"\x05\x00"
        writer.write(request(3, 1, bytes(4), 0))
        rep, _atyp, bnd, rport = await read_reply(reader)
        assert rep == 0
        dropped = REGISTRY.value("meshgate_mesh_udp_dropped_total", "acl")
        hdr = udp_header(1, socket.inet_aton("10.144.3.3"), SERVED)
        client.sendto(hdr + b"udp", (socket.inet_ntoa(bnd), rport))
        await async_wait_until(
            lambda: REGISTRY.value("meshgate_mesh_udp_dropped_total", "acl") == dropped + 1,
            what="the UDP datagram refused by c's rules")
        assert echo.received == []
        writer.close()
        client.close()
    finally:
        server.close()
        echo.close()
        for n in (a, c, b):
            await n.stop()


async def test_serve_and_acl_are_reloaded_into_the_rules_both_paths_use() -> None:
    """[serve] and [[acl]] change by reload (no restart): the plan applies them, and the one
    ExitRules the CONNECT and UDP paths share takes the new ones."""
    from meshgate.egress.acl import Source
    from meshgate.egress.rules import ExitRules
    from meshgate.reload import diff

    old = cfg("c", "10.144.4.3/24")
    new = cfg("c", "10.144.4.3/24", serve=SERVE, acl=[{"from": ["node:a"], "to": [f"self:{SERVED}"]}])
    plan = diff(old, new)
    assert set(plan.changed) == {"serve", "acl"} and not plan.restart
    rules = ExitRules(old)
    assert rules.served_target(SERVED) is None and not rules.acl.active
    rules.set_access(new)
    assert rules.served_target(SERVED) == ("127.0.0.1", SERVED)
    assert rules.acl.decide(Source(1, "a"), None, SERVED, "tcp").allowed
    assert not rules.acl.decide(Source(2, "b"), None, SERVED, "tcp").allowed


async def test_an_exit_stopped_mid_session_means_refused_not_direct(tmp_path: Any) -> None:
    """The exit goes away while the portal runs (exit_nodes = auto, direct_fallback on): new
    connections get 0x03 once the route is withdrawn, none leaves from the portal's host."""
    b = await start(cfg("b", "10.144.5.2/24", node={"state_dir": str(tmp_path / "b")},
                        mesh={"listen": ["tcp://127.0.0.1:0"]}))
    url = b.mesh.listen_addrs[0]
    c = await start(cfg("c", "10.144.5.3/24", node={"state_dir": str(tmp_path / "c")},
                        mesh={"peers": [url], "exit_node": True}, exit={"allow_private": True}))
    a = await start(cfg("a", "10.144.5.1/24", node={"state_dir": str(tmp_path / "a")},
                        mesh={"peers": [url], "exit_nodes": ["auto"], "direct_fallback": True},
                        socks5={"enable": True, "listen": "127.0.0.1:0"}))
    server, port = await echo_server()
    try:
        await async_wait_until(lambda: a.mesh.table.exit_route() is not None, 15, "a to see c's exit")
        proxy = portal({"a": a})
        direct_before = routed("direct")
        await c.stop()
        await async_wait_until(lambda: a.mesh.table.exit_route() is None, 15, "the exit withdrawn")
        with pytest.raises(ProxyError) as ei:
            await proxy.connect(dest_host="127.0.0.1", dest_port=port, timeout=10)
        assert ei.value.error_code == 0x03
        assert routed("direct") == direct_before  # nothing left from a's host
    finally:
        server.close()
        for n in (a, b):
            await n.stop()
