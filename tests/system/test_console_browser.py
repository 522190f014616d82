"""The web console in headless Chromium, against real nodes in this process: `portal` with two
mesh peers (`relay`, `laptop`) and `exit` behind the relay, DNS questions and SOCKS5 traffic
through the mesh running while the page polls. The DOM Chromium dumps must show every node in
the graph and charts with data points.

MESHGATE_UPDATE_SCREENSHOTS=1 also writes the screenshot to docs/console.png (the README's);
without it the picture goes to a temporary directory only, so a CI run leaves the tree clean.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import dns.asyncquery
import dns.message
import pytest
from python_socks.async_.asyncio import Proxy

from meshgate.config import from_dict
from meshgate.node import Node
from tests.helpers import async_wait_until, free_port, require_tool
from tests.system.test_demo import CHROMIUM_FLAGS

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
SECRET = "console-browser-secret-4Jq"
TOKEN = "console-browser-token-9fXz"
PEERS = ("relay", "laptop", "exit")


def cfg(name: str, ipv4: str, state: Path, **sections: Any) -> Any:
    raw: dict[str, Any] = {
        "node": {"name": name, "network": "tour", "secret": SECRET, "ipv4": ipv4,
                 "state_dir": str(state / name)},
        "admin": {"enable": False}, "socks5": {"enable": False},
    }
    for k, v in sections.items():
        raw.setdefault(k, {}).update(v)
    return from_dict(raw)


async def echo(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    with contextlib.suppress(ConnectionError):
        while data := await r.read(65536):
            w.write(data)
            await w.drain()
    w.close()


async def traffic(socks: str, dns_port: int, echo_port: int) -> None:
    """Keep the charts moving: DNS questions to the portal, bytes to `exit` through `relay`."""
    proxy = Proxy.from_url(f"socks5://{socks}", rdns=True)
    i = 0
    while True:
        i += 1
        q = dns.message.make_query(("printer.lan", "exit.mesh.internal", "relay.mesh.internal")[i % 3], "A")
        with contextlib.suppress(Exception):
            await dns.asyncquery.udp(q, "127.0.0.1", port=dns_port, timeout=2)
        if i % 4 == 0:
            with contextlib.suppress(Exception):
                sock = await proxy.connect("10.2.2.1", echo_port, timeout=5)
                r, w = await asyncio.open_connection(sock=sock)
                w.write(os.urandom(16384 * (1 + i % 7)))
                await w.drain()
                await r.read(1)
                w.close()
        await asyncio.sleep(0.05)


@pytest.fixture
async def tour(tmp_path: Path) -> AsyncIterator[dict[str, Any]]:
    echo_srv = await asyncio.start_server(echo, "127.0.0.1", 0)
    echo_port = echo_srv.sockets[0].getsockname()[1]
    relay = Node(cfg("relay", "10.144.0.2/24", tmp_path, mesh={"listen": ["tcp://127.0.0.1:0"]}))
    await relay.start()
    assert relay.mesh is not None
    exit_ = Node(cfg("exit", "10.144.0.3/24", tmp_path,
                     mesh={"peers": relay.mesh.listen_addrs, "exit_node": True,
                           "proxy_cidrs": ["127.0.0.0/24->10.2.2.0/24"]}))
    await exit_.start()
    admin_port, dns_port = free_port(), free_port(kind=2)
    portal = Node(cfg("portal", "10.144.0.1/24", tmp_path,
                      mesh={"peers": relay.mesh.listen_addrs, "listen": ["tcp://127.0.0.1:0"]},
                      socks5={"enable": True, "listen": "127.0.0.1:0"},
                      dns={"records": {"printer.lan": "192.168.1.20"},
                           "listener": [{"protocol": "udp", "listen": f"127.0.0.1:{dns_port}"}]},
                      admin={"enable": True, "listen": f"127.0.0.1:{admin_port}", "token": TOKEN}))
    await portal.start()
    assert portal.mesh is not None and portal.socks5 is not None
    laptop = Node(cfg("laptop", "10.144.0.4/24", tmp_path, mesh={"peers": portal.mesh.listen_addrs}))
    await laptop.start()
    nodes = [portal, relay, exit_, laptop]
    ids = {n.mesh.node_id for n in nodes if n.mesh is not None}
    mover: asyncio.Task[None] | None = None
    try:
        await async_wait_until(lambda: all(ids <= set(n.mesh.table.hop_paths) for n in nodes if n.mesh),
                               15, "routes to converge")
        addr = portal.socks5.address
        assert addr is not None
        mover = asyncio.create_task(traffic(f"{addr.host}:{addr.port}", dns_port, echo_port))
        yield {"url": f"http://127.0.0.1:{admin_port}/"}
    finally:
        if mover is not None:
            mover.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await mover
        for n in (laptop, portal, exit_, relay):
            await n.stop()
        echo_srv.close()


async def chromium(binary: str, *args: str) -> tuple[int, str, str]:
    """Run Chromium without blocking the loop that serves the nodes it looks at."""
    with tempfile.TemporaryDirectory() as profile:
        proc = await asyncio.create_subprocess_exec(
            binary, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        try:
            out, err = await asyncio.wait_for(proc.communicate(), 120)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise
    return proc.returncode or 0, out.decode(errors="replace"), err.decode(errors="replace")


def charted(dom: str, kind: str) -> list[int]:
    """data-points of every chart of `kind` (latency, traffic) in a dumped DOM."""
    return [int(m.group(1)) for m in re.finditer(rf'<svg class="chart {kind}"[^>]*data-points="(\d+)"', dom)]


async def test_the_console_shows_the_mesh_and_live_charts(tour: dict[str, Any]) -> None:
    binary = require_tool("chromium")
    # Virtual time: the page's 2 s polls run back to back, each waiting for its real answers.
    seen: dict[str, str] = {}

    async def page_has_data() -> bool:
        _, dom, err = await chromium(binary, "--virtual-time-budget=12000", "--dump-dom", tour["url"])
        seen["dom"], seen["err"] = dom, err[-2000:]
        names = re.findall(r'<g class="node[^"]*" data-id="[0-9a-f]{8}" data-name="([^"]*)"', dom)
        latency, traffic_ = charted(dom, "latency"), charted(dom, "traffic")
        return (set(names) == {"portal", *PEERS} and len(latency) == 2 and min(latency) >= 2
                and len(traffic_) == 2 and min(traffic_) >= 1)

    try:
        await async_wait_until(page_has_data, 90, "the console's graph and charts")
    except AssertionError:
        raise AssertionError(f"DOM: {seen.get('dom', '')[:4000]}\nstderr: {seen.get('err', '')}") from None
    dom = seen["dom"]
    assert 'class="edge direct"' in dom and 'class="edge"' in dom  # portal's own links, relay—exit
    assert re.search(r'<tr data-peer="relay">', dom) and re.search(r'<tr data-peer="laptop">', dom)
    assert "10.2.2.0/24" in dom and "EXIT" in dom and "RELAY" in dom
    assert 'id="reload" type="button" hidden' in dom  # a token is configured, none typed yet
    assert '"secret": "***"' in dom and SECRET not in dom and TOKEN not in dom
    with tempfile.TemporaryDirectory() as shots:
        shot = Path(shots) / "console.png"
        await chromium(binary, "--virtual-time-budget=20000", "--window-size=1280,1180",
                       f"--screenshot={shot}", tour["url"])
        assert shot.exists() and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        if os.environ.get("MESHGATE_UPDATE_SCREENSHOTS") == "1":  # refresh the README's picture
            shutil.copy(shot, ROOT / "docs" / "console.png")
