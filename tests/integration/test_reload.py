"""`Node.reload` / POST /reload on a real in-process node while a 32 MiB SOCKS5 upload runs
through it: live keys take effect, the upload finishes byte-identical, a non-live key or an
invalid file changes nothing."""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import json
import logging
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import dns.asyncquery
import dns.message
import pytest
from python_socks import ProxyError
from python_socks.async_.asyncio import Proxy

from meshgate.admin import fetch
from meshgate.config import load
from meshgate.node import Node

TOKEN = "reload-test-token-0123456789abcdef"
TOTAL = 32 << 20
CHUNK = 1 << 16


def toml(tmp: Path, *, users: str = '{ name = "alice", password = "pw-alice" }', records: str = "",
         deny: str = "", log_level: str = "info", socks_listen: str = "127.0.0.1:0",
         extra: str = "") -> str:
    return f"""log_level = "{log_level}"
[node]
name = "r"
network = "reload"
secret = "reload-test-secret"
ipv4 = "10.144.9.1/24"
state_dir = "{tmp / 'state'}"
[mesh]
proxy_cidrs = ["127.0.0.0/8"]
direct_fallback = false
[exit]
allow_private = true
deny = [{deny}]
[socks5]
listen = "{socks_listen}"
users = [{users}]
[dns]
records = {{ {records} }}
[[dns.listener]]
protocol = "udp"
listen = "127.0.0.1:0"
[admin]
listen = "127.0.0.1:0"
token = "{TOKEN}"
{extra}"""


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[tuple[Node, Path]]:
    path = tmp_path / "node.toml"
    path.write_text(toml(tmp_path))
    root_level = logging.getLogger().level
    n = Node(load(path), config_path=str(path))
    await n.start()
    try:
        yield n, path
    finally:
        await n.stop()
        logging.getLogger().setLevel(root_level)


def addr(n: Node, name: str) -> tuple[str, int]:
    st = n.status()["services"][name]
    host, port = str(st["listen"]).split("://")[-1].rsplit(":", 1)
    return host, int(port)


async def sink() -> tuple[asyncio.Server, int]:
    """Reads to EOF and answers the SHA-256 of what it read."""
    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        h = hashlib.sha256()
        while chunk := await r.read(1 << 16):
            h.update(chunk)
        w.write(h.hexdigest().encode())
        await w.drain()
        w.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def socks_open(n: Node, user: str, password: str, port: int) -> tuple[Any, Any]:
    host, sport = addr(n, "socks5")
    proxy = Proxy.from_url(f"socks5://{user}:{password}@{host}:{sport}")
    sock = await proxy.connect(dest_host="127.0.0.1", dest_port=port, timeout=10)
    return await asyncio.open_connection(sock=sock)


async def round_trip(n: Node, user: str, password: str, port: int) -> str:
    r, w = await socks_open(n, user, password, port)
    w.write(b"hello")
    w.write_eof()
    got = await asyncio.wait_for(r.read(), 10)
    w.close()
    return got.decode()


async def ask_a(n: Node, name: str) -> list[str]:
    host, port = addr(n, "dns")
    q = dns.message.make_query(name, "A")
    resp = await dns.asyncquery.udp(q, host, port=port, timeout=5)
    return [rd.to_text() for rrset in resp.answer for rd in rrset]


async def post_reload(n: Node, token: str = TOKEN) -> tuple[int, dict[str, Any]]:
    host, port = addr(n, "admin")
    code, body = await fetch(f"{host}:{port}", "/reload", token=token, method="POST")
    return code, json.loads(body) if code == 200 else {}


async def test_live_reload_during_a_transfer(node: tuple[Node, Path], tmp_path: Path) -> None:
    n, path = node
    server, port = await sink()
    payload = os.urandom(TOTAL)
    half = asyncio.Event()
    resume = asyncio.Event()

    async def upload() -> str:
        r, w = await socks_open(n, "alice", "pw-alice", port)
        for i in range(0, TOTAL, CHUNK):
            if i == TOTAL // 2:
                half.set()
                await resume.wait()
            w.write(payload[i:i + CHUNK])
            await w.drain()
        w.write_eof()
        got = await asyncio.wait_for(r.read(), 60)
        w.close()
        return got.decode()

    transfer = asyncio.create_task(upload())
    try:
        await asyncio.wait_for(half.wait(), 60)
        # before: bob is unknown, added.test has no record
        with pytest.raises(ProxyError):
            await round_trip(n, "bob", "pw-bob", port)
        assert "10.9.9.9" not in await ask_a(n, "added.test.")

        # POST /reload needs the token (configured), also on loopback; GET is not reload
        assert (await post_reload(n, token=""))[0] == 401
        assert (await post_reload(n, token="wrong-" + TOKEN))[0] == 401
        host, aport = addr(n, "admin")
        assert (await fetch(f"{host}:{aport}", "/reload", token=TOKEN))[0] == 405

        bob = '{ name = "alice", password = "pw-alice" }, { name = "bob", password = "pw-bob" }'
        # a non-live key refuses the whole reload: the users change next to it is not applied
        path.write_text(toml(tmp_path, users=bob, socks_listen="127.0.0.1:1"))
        code, ans = await post_reload(n)
        assert code == 200 and ans["applied"] is False
        assert ans["restart"] == ["socks5.listen"]
        assert "restart to change: socks5.listen" in ans["message"]
        assert "pw-bob" not in json.dumps(ans) and "socks5.users" in ans["changed"]
        with pytest.raises(ProxyError):
            await round_trip(n, "bob", "pw-bob", port)

        # an invalid file changes nothing and names the problem like check-config
        path.write_text(toml(tmp_path, users=bob, deny='"not-a-network"'))
        code, ans = await post_reload(n)
        assert code == 200 and ans["applied"] is False
        assert any(p.startswith(f"{path}:exit.deny") for p in ans["problems"]), ans
        with pytest.raises(ProxyError):
            await round_trip(n, "bob", "pw-bob", port)

        # users, records, log level: applied together
        path.write_text(toml(tmp_path, users=bob, records='"added.test" = "10.9.9.9"', log_level="debug"))
        code, ans = await post_reload(n)
        assert code == 200 and ans["applied"] is True, ans
        assert set(ans["changed"]) == {"socks5.users", "dns.records", "log_level"}
        assert "pw-bob" not in json.dumps(ans)
        assert await round_trip(n, "bob", "pw-bob", port) == hashlib.sha256(b"hello").hexdigest()
        assert await ask_a(n, "added.test.") == ["10.9.9.9"]
        assert logging.getLogger().level == logging.DEBUG

        # the exit policy: the sink's address denied for new connections ...
        path.write_text(toml(tmp_path, users=bob, records='"added.test" = "10.9.9.9"', log_level="debug",
                             deny='"127.0.0.1/32"'))
        code, ans = await post_reload(n)
        assert ans["applied"] is True and ans["changed"] == ["exit.deny"], ans
        with pytest.raises(ProxyError) as ei:
            await round_trip(n, "bob", "pw-bob", port)
        assert ei.value.error_code == 0x02  # not allowed by the ruleset: bob authenticated
        # ... and allowed again
        path.write_text(toml(tmp_path, users=bob, records='"added.test" = "10.9.9.9"', log_level="debug"))
        code, ans = await post_reload(n)
        assert ans["applied"] is True and ans["changed"] == ["exit.deny"], ans
        assert await round_trip(n, "alice", "pw-alice", port) == hashlib.sha256(b"hello").hexdigest()

        # nothing changed: applied nothing, refused nothing
        code, ans = await post_reload(n)
        assert ans == {"applied": False, "changed": [], "restart": [], "problems": [],
                       "message": "no changes"}
        assert not transfer.done()
    finally:
        resume.set()
        try:
            digest = await asyncio.wait_for(transfer, 120)
        finally:
            server.close()
    assert digest == hashlib.sha256(payload).hexdigest()


async def test_no_token_on_loopback_is_allowed(tmp_path: Path) -> None:
    path = tmp_path / "node.toml"
    path.write_text(toml(tmp_path).replace(f'token = "{TOKEN}"', ""))
    n = Node(load(path), config_path=str(path))
    await n.start()
    try:
        path.write_text(toml(tmp_path, users="").replace(f'token = "{TOKEN}"', ""))
        code, ans = await post_reload(n, token="")
        assert code == 200 and ans["applied"] is True and ans["changed"] == ["socks5.users"]
        assert n.status()["services"]["socks5"]["auth"] == "none"
    finally:
        await n.stop()


def mesh_toml(tmp: Path, name: str, ipv4: str, listen: str = "", peers: tuple[str, ...] = ()) -> str:
    quoted = ", ".join(f'"{p}"' for p in peers)
    return (f'[node]\nname = "{name}"\nnetwork = "reload-mesh"\nsecret = "reload-mesh-secret"\n'
            f'ipv4 = "{ipv4}"\nstate_dir = "{tmp / name}"\n'
            f'[mesh]\nlisten = [{listen}]\npeers = [{quoted}]\n'
            f'[socks5]\nenable = false\n[admin]\nenable = false\n')


async def test_mesh_peers_added_and_removed(tmp_path: Path) -> None:
    from tests.helpers import async_wait_until

    nodes: list[Node] = []
    try:
        for name, ip in (("b", "10.144.8.2/24"), ("c", "10.144.8.3/24")):
            p = tmp_path / f"{name}.toml"
            p.write_text(mesh_toml(tmp_path, name, ip, listen='"tcp://127.0.0.1:0"'))
            nodes.append(Node(load(p)))
            await nodes[-1].start()
        b, c = nodes
        assert b.mesh is not None and c.mesh is not None
        urls = (str(b.mesh.listen_addrs[0]), str(c.mesh.listen_addrs[0]))
        path = tmp_path / "a.toml"
        path.write_text(mesh_toml(tmp_path, "a", "10.144.8.1/24", peers=urls))
        a = Node(load(path), config_path=str(path))
        nodes.append(a)
        await a.start()
        assert a.mesh is not None
        bid, cid = b.mesh.node_id, c.mesh.node_id
        await async_wait_until(lambda: {bid, cid} <= set(a.mesh.links), 15, "links to b and c")  # type: ignore[union-attr]
        to_c = list(a.mesh.links[cid])

        path.write_text(mesh_toml(tmp_path, "a", "10.144.8.1/24", peers=urls[1:]))
        res = a.reload()
        assert res.applied and res.changed == ("mesh.peers",), res
        await async_wait_until(lambda: bid not in a.mesh.links and a.mesh.node_id not in b.mesh.links,  # type: ignore[union-attr]
                               15, "the removed peer's link to close")
        assert a.mesh.links[cid] == to_c  # the other link untouched: the same link objects

        path.write_text(mesh_toml(tmp_path, "a", "10.144.8.1/24", peers=urls))
        assert a.reload().applied
        await async_wait_until(lambda: bid in a.mesh.links, 15, "the added peer kept")  # type: ignore[union-attr]
        assert a.mesh.links[cid] == to_c
    finally:
        for n in reversed(nodes):
            await n.stop()


# --- offers, exits, DNS upstreams/routes/blocklists and portal limits, on a two-node mesh

def egress_toml(tmp: Path, cidrs: tuple[str, ...], exit_node: bool) -> str:
    """e: offers `cidrs` (loopback ranges, so sinks on 127.0.x.1 are behind them) and maybe
    exit; resolves sink.test itself (names leave the mesh where they resolve)."""
    quoted = ", ".join(f'"{c}"' for c in cidrs)
    return f"""[node]
name = "e"
network = "reload-offers"
secret = "reload-offers-secret"
ipv4 = "10.144.6.2/24"
state_dir = "{tmp / 'e'}"
[mesh]
listen = ["tcp://127.0.0.1:0"]
proxy_cidrs = [{quoted}]
exit_node = {str(exit_node).lower()}
[dns]
records = {{ "sink.test" = "127.0.0.1" }}
[socks5]
enable = false
[admin]
enable = false
"""


def portal_toml(tmp: Path, peers: tuple[str, ...], upstream: str, *, exit_nodes: str = "",
                fallback: bool = False, route: str = "", blocklist: str = "", per_source: int = 0,
                policy: str = "least-hop") -> str:
    """p: the portal (SOCKS5, HTTP proxy with its PAC file, a udp DNS listener), peer of e."""
    quoted = ", ".join(f'"{u}"' for u in peers)
    extra = f"socks5_max_clients_per_source = {per_source}\n" if per_source else ""
    extra += f'[[dns.route]]\nsuffix = "corp.test"\nupstreams = ["{route}"]\n' if route else ""
    extra += f'[dns.blocklist]\nlists = ["{blocklist}"]\n' if blocklist else ""
    return f"""[node]
name = "p"
network = "reload-offers"
secret = "reload-offers-secret"
ipv4 = "10.144.6.1/24"
state_dir = "{tmp / 'p'}"
[mesh]
peers = [{quoted}]
policy = "{policy}"
exit_nodes = [{exit_nodes}]
direct_fallback = {str(fallback).lower()}
[socks5]
listen = "127.0.0.1:0"
[http_proxy]
enable = true
listen = "127.0.0.1:0"
[dns]
upstreams = ["{upstream}"]
[[dns.listener]]
protocol = "udp"
listen = "127.0.0.1:0"
[admin]
enable = false
[limits]
dns_timeout = 0.5
{extra}"""


async def echo_digest(host: str) -> tuple[asyncio.Server, int]:
    """A sink on `host` (any 127.0.x.y is this host's loopback)."""
    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(hashlib.sha256(await r.read()).hexdigest().encode())
        await w.drain()
        w.close()

    server = await asyncio.start_server(handle, host, 0)
    return server, server.sockets[0].getsockname()[1]


async def via_portal(n: Node, host: str, port: int) -> str:
    """hello through the portal to host:port (no SOCKS users); the sink's digest of it."""
    shost, sport = addr(n, "socks5")
    proxy = Proxy.from_url(f"socks5://{shost}:{sport}")
    r, w = await asyncio.open_connection(sock=await proxy.connect(dest_host=host, dest_port=port, timeout=10))
    w.write(b"hello")
    w.write_eof()
    got = await asyncio.wait_for(r.read(), 10)
    w.close()
    return got.decode()


async def refused(n: Node, host: str, port: int) -> int:
    """The SOCKS reply code a CONNECT to host:port gets (the test fails if it connects)."""
    with pytest.raises(ProxyError) as ei:
        await via_portal(n, host, port)
    return int(ei.value.error_code)


async def pac(n: Node) -> str:
    host, port = addr(n, "http_proxy")
    r, w = await asyncio.open_connection(host, port)
    w.write(b"GET /proxy.pac HTTP/1.1\r\nHost: p\r\n\r\n")
    got = await asyncio.wait_for(r.read(), 10)
    w.close()
    return got.decode()


async def pac_sends(n: Node, ip: str) -> bool:
    """Whether p's PAC file sends `ip` to the portal (its isInNet networks, collapsed)."""
    import re

    nets = [ipaddress.ip_network(f"{a}/{m}") for a, m in
            re.findall(r'isInNet\(host, "([0-9.]+)", "([0-9.]+)"\)', await pac(n))]
    return any(ipaddress.ip_address(ip) in net for net in nets)


async def answer(n: Node, name: str) -> str:
    """The first A address p's udp listener answers for `name`, else the rcode's name."""
    import dns.rcode

    host, port = addr(n, "dns")
    resp = await dns.asyncquery.udp(dns.message.make_query(name, "A"), host, port=port, timeout=5)
    addrs = [rd.to_text() for rrset in resp.answer for rd in rrset]
    return addrs[0] if addrs else dns.rcode.to_text(resp.rcode())


async def test_offers_exits_dns_and_limits_change_during_a_mesh_transfer(tmp_path: Path) -> None:
    """A 32 MiB upload from p's portal through the mesh to a sink behind e's proxy CIDR runs while
    e changes its proxy CIDRs and becomes an exit, and p adds a peer and changes direct_fallback,
    exit_nodes, its DNS upstreams, [[dns.route]], [dns.blocklist] and the per-source cap: each seen
    at the portal (SOCKS5, the PAC file) or p's DNS listener; the upload finishes byte-identical."""
    from tests.helpers import async_wait_until
    from tests.integration.test_dns_split import TagAuthority

    one, two, corp = [await TagAuthority(a).start() for a in ("192.0.2.11", "192.0.2.22", "198.51.100.1")]
    servers = [await sink(), await echo_digest("127.0.1.1"), await echo_digest("127.0.2.1")]
    (_, port), (_, port1), (_, port2) = servers
    block = tmp_path / "block.txt"
    block.write_text("blocked.test\n")
    epath, ppath = tmp_path / "e.toml", tmp_path / "p.toml"
    epath.write_text(egress_toml(tmp_path, ("127.0.0.0/24", "127.0.1.0/24"), exit_node=False))
    e = Node(load(epath), config_path=str(epath))
    await e.start()
    fpath = tmp_path / "f.toml"  # a node p is told about by a reload, mid-transfer
    fpath.write_text(mesh_toml(tmp_path, "f", "10.144.6.3/24", listen='"tcp://127.0.0.1:0"')
                     .replace('"reload-mesh', '"reload-offers'))
    f = Node(load(fpath))
    await f.start()
    p: Node | None = None
    transfer: asyncio.Task[str] | None = None
    resume = asyncio.Event()
    payload = os.urandom(TOTAL)
    try:
        assert e.mesh is not None and f.mesh is not None
        peer = (str(e.mesh.listen_addrs[0]),)
        both = (*peer, str(f.mesh.listen_addrs[0]))

        def ptoml(**kw: Any) -> str:
            return portal_toml(tmp_path, peer, one.url, **kw)

        ppath.write_text(ptoml())
        p = Node(load(ppath), config_path=str(ppath))
        await p.start()
        pm = p.mesh
        assert pm is not None
        lo1 = ipaddress.ip_address("127.0.1.1")
        await async_wait_until(lambda: pm.lookup(lo1) is not None, 15, "p to route 127.0.1.0/24 to e")
        hello = hashlib.sha256(b"hello").hexdigest()
        half = asyncio.Event()

        async def upload() -> str:
            host, sport = addr(p, "socks5")  # type: ignore[arg-type]
            sock = await Proxy.from_url(f"socks5://{host}:{sport}").connect(
                dest_host="127.0.0.1", dest_port=port, timeout=10)
            r, w = await asyncio.open_connection(sock=sock)
            for i in range(0, TOTAL, CHUNK):
                if i == TOTAL // 2:
                    half.set()
                    await resume.wait()
                w.write(payload[i:i + CHUNK])
                await w.drain()
            w.write_eof()
            got = await asyncio.wait_for(r.read(), 60)
            w.close()
            return got.decode()

        transfer = asyncio.create_task(upload())
        await asyncio.wait_for(half.wait(), 60)
        # before: 127.0.1.1 behind e; 127.0.2.1 nowhere; no exit; DNS from `one`
        assert await via_portal(p, "127.0.1.1", port1) == hello
        assert await refused(p, "127.0.2.1", port2) == 0x03
        assert await refused(p, "sink.test", port) == 0x03
        assert await pac_sends(p, "127.0.1.1") and not await pac_sends(p, "127.0.2.1")
        assert await answer(p, "www.example.test.") == "192.0.2.11"
        assert await answer(p, "x.corp.test.") == "192.0.2.11"
        assert await answer(p, "blocked.test.") == "192.0.2.11"

        # e: one proxy CIDR removed, one added, and an exit now: its new record reaches p
        epath.write_text(egress_toml(tmp_path, ("127.0.0.0/24", "127.0.2.0/24"), exit_node=True))
        res = e.reload()
        assert res.applied and set(res.changed) == {"mesh.proxy_cidrs", "mesh.exit_node"}, res
        await async_wait_until(lambda: pm.lookup(lo1) is None, 15, "p to see 127.0.1.0/24 withdrawn")
        assert await refused(p, "127.0.1.1", port1) == 0x03  # direct_fallback off: nowhere
        assert await via_portal(p, "127.0.2.1", port2) == hello  # e serves the added CIDR
        assert not await pac_sends(p, "127.0.1.1") and await pac_sends(p, "127.0.2.1")
        assert await refused(p, "sink.test", port) == 0x03  # p uses no exits yet

        # p: a non-live key beside live ones refuses it all (DNS still from `one`, cap unchanged)
        ppath.write_text(ptoml(fallback=True, route=corp.url, policy="least-latency"))
        res = p.reload()
        assert not res.applied and res.restart == ("mesh.policy",), res
        assert await answer(p, "fresh.example.test.") == "192.0.2.11"

        # p: a peer added, direct fallback on, new upstreams, a route and a blocklist
        ppath.write_text(portal_toml(tmp_path, both, two.url, fallback=True, route=corp.url,
                                     blocklist=str(block)))
        res = p.reload()
        assert res.applied and set(res.changed) == {
            "mesh.peers", "mesh.direct_fallback", "dns.upstreams", "dns.routes", "dns.blocklist.lists"}, res
        # the added peer: linked, and its name answered by p's DNS
        fid = f.mesh.node_id
        await async_wait_until(lambda: fid in pm.links, 15, "p to link to f")
        await async_wait_until(lambda: "f" in pm.name_table(), 15, "f's record at p")
        assert await answer(p, "f.mesh.internal.") == "10.144.6.3"
        assert await via_portal(p, "127.0.1.1", port1) == hello  # no route: from p's host now
        assert await answer(p, "www.example.test.") == "192.0.2.22"  # the cache went with `one`
        assert await answer(p, "x.corp.test.") == "198.51.100.1"
        assert await answer(p, "blocked.test.") == "NXDOMAIN"

        # p: e as its exit (auto): names leave there, and loopback beyond e's CIDRs is refused there
        ppath.write_text(portal_toml(tmp_path, both, two.url, fallback=True, route=corp.url,
                                     blocklist=str(block), exit_nodes='"auto"'))
        res = p.reload()
        assert res.applied and res.changed == ("mesh.exit_nodes",), res
        assert await via_portal(p, "sink.test", port) == hello  # resolved at e: its dns.records
        assert await refused(p, "127.0.1.1", port1) == 0x02  # e's [exit] refuses its loopback
        assert 'return "DIRECT"' not in await pac(p)  # everything through the portal now

        # p: one connection per source (the upload holds it) for new ones, then back
        ppath.write_text(portal_toml(tmp_path, both, two.url, fallback=True, route=corp.url,
                                     blocklist=str(block), exit_nodes='"auto"', per_source=1))
        res = p.reload()
        assert res.applied and res.changed == ("limits.socks5_max_clients_per_source",), res
        with pytest.raises((ProxyError, OSError)):
            await via_portal(p, "127.0.0.1", port)
        ppath.write_text(portal_toml(tmp_path, both, two.url, fallback=True, route=corp.url,
                                     blocklist=str(block), exit_nodes='"auto"'))
        assert p.reload().applied
        assert await via_portal(p, "127.0.0.1", port) == hello
        assert not transfer.done()
    finally:
        resume.set()
        try:
            if transfer is not None:
                assert await asyncio.wait_for(transfer, 120) == hashlib.sha256(payload).hexdigest()
        finally:
            if p is not None:
                await p.stop()
            await f.stop()
            await e.stop()
            for server, _ in servers:
                server.close()
            for a in (one, two, corp):
                await a.stop()


async def test_certificate_grants_and_dns_worker_processes(tmp_path: Path) -> None:
    """A node in certificate mode refuses offers its certificate does not grant (the grant named,
    nothing changed) and re-originates one it grants. With DNS worker processes, dns.records
    and [dns.blocklist] reach the workers (questions from fresh sockets, spread over both
    processes, all see them), and upstreams a worker would time out before (more than the
    upstream_spans it started with) are refused, naming dns.upstreams."""
    from meshgate.mesh.identity import load_or_create
    from tests.helpers import async_wait_until
    from tests.identity_testing import TestCA
    from tests.integration.test_dns_split import TagAuthority

    ca = TestCA(tmp_path)
    cert = ca.issue("c", load_or_create(tmp_path / "c"), "10.144.5.1/24", cidrs=("10.1.0.0/16",))
    one, two = [await TagAuthority(a).start() for a in ("192.0.2.11", "192.0.2.22")]
    block = tmp_path / "block.txt"
    block.write_text("blocked.test\n")

    def conf(cidrs: str = '"10.1.0.0/24"', exit_node: bool = False, upstreams: str = f'"{one.url}"',
             blocklist: bool = False, records: str = '"rec.test" = "10.8.8.8"') -> str:
        keys = ca.node_keys(cert)
        return (f'[node]\nname = "c"\nnetwork = "{ca.network}"\nipv4 = "10.144.5.1/24"\n'
                f'state_dir = "{tmp_path / "c"}"\ncertificate = "{keys["certificate"]}"\n'
                f'ca = ["{keys["ca"]}"]\n'
                f'[mesh]\nlisten = ["tcp://127.0.0.1:0"]\nproxy_cidrs = [{cidrs}]\n'
                f'exit_node = {str(exit_node).lower()}\n'
                f'[socks5]\nenable = false\n[admin]\nenable = false\n'
                f'[dns]\nworkers = 2\nupstreams = [{upstreams}]\nrecords = {{ {records} }}\n'
                f'[[dns.listener]]\nprotocol = "udp"\nlisten = "127.0.0.1:0"\n'
                + (f'[dns.blocklist]\nlists = ["{block}"]\n' if blocklist else "")
                + '[limits]\ndns_timeout = 0.5\n')

    path = tmp_path / "c.toml"
    path.write_text(conf())
    n = Node(load(path), config_path=str(path))
    await n.start()
    try:
        assert n.mesh is not None
        before = n.mesh.table.local
        path.write_text(conf(cidrs='"10.1.0.0/24", "10.9.0.0/16"', exit_node=True))
        res = n.reload()
        assert not res.applied and set(res.changed) == {"mesh.proxy_cidrs", "mesh.exit_node"}, res
        text = "\n".join(res.problems)
        assert "does not grant" in text and "10.9.0.0/16" in text and "mesh.exit_node" in text, res
        assert n.mesh.table.local is before and n.config.mesh.proxy_cidrs == load(path).mesh.proxy_cidrs[:1]

        path.write_text(conf(cidrs='"10.1.2.0/24"'))  # inside the grant: applied
        res = n.reload()
        assert res.applied and res.changed == ("mesh.proxy_cidrs",), res
        assert n.mesh.table.local.version == before.version + 1

        dns_svc = n.dns_service
        assert dns_svc is not None and dns_svc.pool is not None
        worker = dns_svc.pool.workers[0]
        before = sum(worker.merge.queries.values())
        names = [f"h{i}.blocked.test." for i in range(32)]
        assert {await answer(n, q) for q in names} == {"192.0.2.11"}
        assert {await answer(n, "rec.test.") for _ in range(32)} == {"10.8.8.8"}
        rec = '"rec.test" = "10.9.9.9"'
        path.write_text(conf(cidrs='"10.1.2.0/24"', blocklist=True, records=rec))
        res = n.reload()
        assert res.applied and set(res.changed) == {"dns.blocklist.lists", "dns.records"}, res
        # fresh sockets: the kernel spreads the questions over the main process and the worker
        assert {await answer(n, q) for q in names} == {"NXDOMAIN"}
        assert {await answer(n, "rec.test.") for _ in range(32)} == {"10.9.9.9"}
        await async_wait_until(lambda: sum(worker.merge.queries.values()) > before + 16, 15,
                               "the worker's report of the questions it answered")

        path.write_text(conf(cidrs='"10.1.2.0/24"', blocklist=True, records=rec,
                             upstreams=f'"{one.url}", "{two.url}"'))
        res = n.reload()  # a worker waits 1 x dns_timeout for this process: 2 could be too many
        assert not res.applied and res.restart == ("dns.upstreams",), res

        path.write_text(conf(cidrs='"10.1.2.0/24"', blocklist=True, records=rec,
                             upstreams=f'"{two.url}"'))  # as many: live
        res = n.reload()
        assert res.applied and res.changed == ("dns.upstreams",), res
        assert await answer(n, "fresh.example.test.") == "192.0.2.22"
    finally:
        await n.stop()
        for a in (one, two):
            await a.stop()
