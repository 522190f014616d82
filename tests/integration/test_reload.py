"""`Node.reload` / POST /reload on a real in-process node while a 32 MiB SOCKS5 upload runs
through it: live keys take effect, the upload finishes byte-identical, a non-live key or an
invalid file changes nothing."""

from __future__ import annotations

import asyncio
import hashlib
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
