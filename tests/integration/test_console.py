"""The web console on real nodes (a — b — c over loopback TCP; a serves the admin API): the page
and its strict headers, /config with every secret masked, /console/stats built from the live
mesh, DNS and portal, the Host check and the token on the new paths, reload from the console."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import dns.asyncquery
import dns.message
import pytest

from meshgate.config import from_dict, load
from meshgate.node import Node
from tests.helpers import async_wait_until, free_port

NET_SECRET = "console-net-secret-Zq8v3Lr2"  # a's node.secret_file contents
PASSWORD = "console-portal-password-Hx71"
TOKEN = "console-admin-token-Kw5pT0yQ"  # a's admin.token_file contents
SEED = "5eed" * 8  # an ODoH key seed never appears either


async def request(
    port: int, method: str, path: str, host: str = "", token: str = ""
) -> tuple[int, dict[str, str], bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    length = "Content-Length: 0\r\n" if method == "POST" else ""
    writer.write(f"{method} {path} HTTP/1.1\r\nHost: {host or f'127.0.0.1:{port}'}\r\n{auth}{length}"
                 "Connection: close\r\n\r\n".encode())
    data = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    return int(lines[0].split()[1]), headers, body


def peer_cfg(name: str, ipv4: str, state: Path, **mesh: Any) -> Any:
    return from_dict({"node": {"name": name, "network": "console", "secret": NET_SECRET, "ipv4": ipv4,
                               "state_dir": str(state)},
                      "admin": {"enable": False}, "socks5": {"enable": False}, "mesh": mesh})


def a_toml(tmp_path: Path, admin_port: int, dns_port: int, peer: str) -> Path:
    (tmp_path / "secret").write_text(NET_SECRET + "\n")
    (tmp_path / "token").write_text(TOKEN + "\n")
    path = tmp_path / "a.toml"
    path.write_text(f"""log_level = "info"
[node]
name = "alpha"
network = "console"
secret_file = "{tmp_path / 'secret'}"
ipv4 = "10.144.7.1/24"
state_dir = "{tmp_path / 'a'}"
[mesh]
peers = ["{peer}"]
[socks5]
listen = "127.0.0.1:0"
users = [{{ name = "ann", password = "{PASSWORD}" }}]
[dns.records]
"printer.lan" = "192.0.2.7"
[[dns.listener]]
protocol = "udp"
listen = "127.0.0.1:{dns_port}"
[admin]
listen = "127.0.0.1:{admin_port}"
token_file = "{tmp_path / 'token'}"
""")
    return path


@pytest.fixture
async def mesh3(tmp_path: Path) -> AsyncIterator[dict[str, Any]]:
    b = Node(peer_cfg("bravo", "10.144.7.2/24", tmp_path / "b", listen=["tcp://127.0.0.1:0"]))
    await b.start()
    assert b.mesh is not None
    url = b.mesh.listen_addrs[0]
    c = Node(peer_cfg("charlie", "10.144.7.3/24", tmp_path / "c", peers=[url], exit_node=True,
                      proxy_cidrs=["192.168.77.0/24"]))
    await c.start()
    admin_port, dns_port = free_port(), free_port(kind=2)
    path = a_toml(tmp_path, admin_port, dns_port, url)
    a = Node(load(str(path)), config_path=str(path))
    await a.start()
    nodes = [a, b, c]
    ids = {n.mesh.node_id for n in nodes if n.mesh is not None}
    try:
        await async_wait_until(lambda: all(ids <= set(n.mesh.table.hop_paths) for n in nodes if n.mesh),
                               15, "routes to converge")
        yield {"a": a, "port": admin_port, "dns_port": dns_port, "path": path, "peer_url": url}
    finally:
        for n in (a, c, b):
            await n.stop()


async def test_the_page_and_its_files_carry_strict_headers(mesh3: dict[str, Any]) -> None:
    port = mesh3["port"]
    code, headers, body = await request(port, "GET", "/")
    assert code == 200 and headers["content-type"].startswith("text/html")
    assert b'<script src="/console.js"' in body and b'href="/console.css"' in body
    assert b"<script>" not in body and b"<style" not in body  # nothing inline
    assert b"//" not in body.replace(b"http://www.w3.org", b"")  # nothing from elsewhere (no CDN)
    csp = headers["content-security-policy"]
    assert "default-src 'self'" in csp and "script-src 'self'" in csp and "unsafe-inline" not in csp
    assert headers["x-content-type-options"] == "nosniff" and headers["cache-control"] == "no-store"
    code, headers, js = await request(port, "GET", "/console.js")
    assert code == 200 and headers["content-type"].startswith("text/javascript") and b"/console/stats" in js
    code, headers, _ = await request(port, "GET", "/console.css")
    assert code == 200 and headers["content-type"].startswith("text/css")
    # the JSON answers carry them too
    code, headers, _ = await request(port, "GET", "/status")
    assert code == 200 and headers["x-content-type-options"] == "nosniff"
    assert headers["cache-control"] == "no-store"


async def test_config_masks_every_secret(mesh3: dict[str, Any]) -> None:
    port = mesh3["port"]
    code, _, body = await request(port, "GET", "/config")
    assert code == 200
    cfg = json.loads(body)
    assert cfg["node"]["name"] == "alpha" and cfg["node"]["secret"] == "***"
    assert cfg["socks5"]["users"] == [{"name": "ann", "password": "***"}]
    assert cfg["admin"]["token"] == "***"
    assert cfg["mesh"]["peers"] == [mesh3["peer_url"]]
    assert cfg["dns"]["listeners"][0]["listen"] == f"127.0.0.1:{mesh3['dns_port']}"
    # no secret anywhere in what a reader of the API gets
    for path in ("/config", "/console/stats", "/status", "/peers", "/routes", "/metrics", "/"):
        _, _, got = await request(port, "GET", path)
        for secret in (NET_SECRET, PASSWORD, TOKEN):
            assert secret.encode() not in got, (path, secret)


def test_masking_covers_secrets_the_node_above_does_not_set() -> None:
    from meshgate.redact import masked_config

    cfg = from_dict({"dns": {"upstreams": ["https://user:pw-in-url@dns.example/dns-query"],
                             "listener": [{"protocol": "odoh", "listen": "127.0.0.1:8443",
                                            "key_seed": SEED}]}})
    text = json.dumps(masked_config(cfg))
    assert SEED not in text and "pw-in-url" not in text and "user:" not in text
    assert '"key_seed": "***"' in text and "https://***@dns.example/dns-query" in text
    assert '"secret": ""' in text  # unset: shown as unset


async def test_console_stats_show_the_mesh_dns_and_portal(mesh3: dict[str, Any]) -> None:
    port = mesh3["port"]
    q = dns.message.make_query("printer.lan", "A")
    answer = await dns.asyncquery.udp(q, "127.0.0.1", port=mesh3["dns_port"], timeout=5)
    assert "192.0.2.7" in answer.to_text()
    code, _, body = await request(port, "GET", "/console/stats")
    assert code == 200
    stats = json.loads(body)
    assert stats["admin"] == {"token": True}
    mesh = stats["mesh"]
    nodes = {n["name"]: n for n in mesh["nodes"]}
    assert set(nodes) == {"alpha", "bravo", "charlie"}
    assert nodes["alpha"]["self"] and nodes["alpha"]["hops"] == 0
    assert nodes["bravo"]["relay"] and not nodes["charlie"]["relay"]  # charlie is reached through bravo
    assert nodes["charlie"]["exit"] and nodes["charlie"]["proxy_cidrs"] == ["192.168.77.0/24"]
    ids = {n["name"]: n["id"] for n in mesh["nodes"]}
    links = {frozenset((link["a"], link["b"])): link for link in mesh["links"]}
    ab = links[frozenset((ids["alpha"], ids["bravo"]))]
    assert ab["direct"] and ab["kinds"] == ["tcp"]
    bc = links[frozenset((ids["bravo"], ids["charlie"]))]
    assert not bc["direct"]  # known from the link-state records, not a link of this node
    assert frozenset((ids["alpha"], ids["charlie"])) not in links
    assert stats["dns"]["queries"] >= 1
    assert set(stats["portal"]) == {"socks5", "http_proxy"}
    assert stats["portal"]["socks5"]["clients"] >= 0


async def test_the_host_check_guards_the_new_paths(mesh3: dict[str, Any]) -> None:
    port = mesh3["port"]
    for path in ("/", "/console.js", "/console.css", "/config", "/console/stats"):
        assert (await request(port, "GET", path, host=f"attacker.example:{port}"))[0] == 403, path
        assert (await request(port, "GET", path, host=f"localhost:{port}"))[0] == 200, path
    assert (await request(port, "POST", "/config"))[0] == 405  # GETs stay read-only


async def test_reload_from_the_console_needs_the_token(mesh3: dict[str, Any]) -> None:
    port, path = mesh3["port"], mesh3["path"]
    path.write_text(path.read_text().replace('"printer.lan" = "192.0.2.7"',
                                             '"printer.lan" = "192.0.2.7"\n"scanner.lan" = "192.0.2.8"'))

    async def records() -> list[list[str]]:
        return list(json.loads((await request(port, "GET", "/config"))[2])["dns"]["records"])

    assert (await request(port, "POST", "/reload"))[0] == 401
    assert (await request(port, "POST", "/reload", token="wrong-" + TOKEN))[0] == 401
    assert await records() == [["printer.lan.", "192.0.2.7"]]
    code, _, body = await request(port, "POST", "/reload", token=TOKEN)
    assert code == 200 and json.loads(body)["changed"] == ["dns.records"]
    # /config shows the config the node runs now
    assert ["scanner.lan.", "192.0.2.8"] in await records()


async def test_off_loopback_the_page_loads_but_its_data_needs_the_token(tmp_path: Path) -> None:
    port = free_port()
    node = Node(from_dict({"node": {"state_dir": str(tmp_path)}, "socks5": {"enable": False},
                           "admin": {"listen": f"0.0.0.0:{port}", "token": TOKEN}}))
    await node.start()
    try:
        for path in ("/", "/console.js", "/console.css"):
            assert (await request(port, "GET", path))[0] == 200, path
        for path in ("/config", "/console/stats", "/status"):
            assert (await request(port, "GET", path))[0] == 401, path
            code, _, body = await request(port, "GET", path, token=TOKEN)
            assert code == 200 and TOKEN.encode() not in body, path
        stats = json.loads((await request(port, "GET", "/console/stats", token=TOKEN))[2])
        assert stats["mesh"] is None and stats["dns"] is None and stats["admin"] == {"token": True}
    finally:
        await node.stop()


async def test_without_a_token_the_console_says_so(tmp_path: Path) -> None:
    port = free_port()
    node = Node(from_dict({"node": {"state_dir": str(tmp_path)}, "socks5": {"enable": False},
                           "admin": {"listen": f"127.0.0.1:{port}"}}))
    await node.start()
    try:
        stats = json.loads((await request(port, "GET", "/console/stats"))[2])
        assert stats["admin"] == {"token": False}
    finally:
        await node.stop()
