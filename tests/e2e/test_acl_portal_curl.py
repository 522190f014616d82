"""A CONNECT that the far node's [[acl]] refuses, seen by curl (a client nobody here wrote).

The portal node cannot check the destination's rules itself: a node's [[acl]] is not
published (docs/OPERATIONS.md "Access rules"), so the far node decides and answers the
stream open at once; the portal turns that into SOCKS5 reply 0x02, which curl reports as
exit status 97 ("Can't complete SOCKS5 connection to ... (2)", curl 7.88). The portal's
connect timeout is set to a minute and curl's own limit to 20 s: a refusal that waited on
any timeout would end in curl's exit 28 instead.

a — b — c in one process (real TCP links on loopback). c publishes two ports ([serve]) and
allows only node a, only on the first. a's requests are relayed by b (sealed end to end);
b's go over its own link to c.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from meshgate.metrics import REGISTRY
from meshgate.node import Node
from tests.e2e.test_socks5_clients import http_server
from tests.helpers import async_wait_until, require_tool
from tests.integration.test_portal_mesh import cfg, start

pytestmark = pytest.mark.e2e

OPEN, CLOSED = 8000, 8001  # both published on c's virtual IP; only OPEN is in c's rules
C_IP = "10.144.7.3"
LIMITS = {"socks5_connect_timeout": 60.0}


@pytest.fixture
async def line(tmp_path: Any) -> AsyncIterator[tuple[dict[str, Node], dict[str, int]]]:
    async with http_server(b"served by c\n") as http_port:
        serve = {str(OPEN): f"127.0.0.1:{http_port}", str(CLOSED): f"127.0.0.1:{http_port}"}
        portal = {"enable": True, "listen": "127.0.0.1:0"}
        b = await start(cfg("b", "10.144.7.2/24", node={"state_dir": str(tmp_path / "b")},
                            mesh={"listen": ["tcp://127.0.0.1:0"]}, socks5=portal, limits=LIMITS))
        url = b.mesh.listen_addrs[0]
        c = await start(cfg("c", f"{C_IP}/24", node={"state_dir": str(tmp_path / "c")}, serve=serve,
                            mesh={"peers": [url]},
                            acl=[{"from": ["node:a"], "to": [f"self:{OPEN}"], "proto": "tcp"}]))
        a = await start(cfg("a", "10.144.7.1/24", node={"state_dir": str(tmp_path / "a")},
                            mesh={"peers": [url], "direct_fallback": False}, socks5=portal, limits=LIMITS))
        nodes = {"a": a, "b": b, "c": c}
        try:
            ids = {n.mesh.node_id for n in nodes.values()}
            await async_wait_until(lambda: all(ids <= set(n.mesh.table.hop_paths) for n in nodes.values()),
                                   15, "routes to converge")
            ports = {}
            for name in ("a", "b"):
                svc = next(s for s in nodes[name].services if s.name == "socks5")
                ports[name] = svc.address.port  # type: ignore[attr-defined]
            yield nodes, ports
        finally:
            for n in (a, c, b):
                await n.stop()


async def curl(portal_port: int, url: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        require_tool("curl"), "-sS", "--max-time", "20", "--socks5-hostname", f"127.0.0.1:{portal_port}", url,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate()
    assert proc.returncode is not None
    return proc.returncode, (out + err).decode(errors="replace")


async def test_a_remote_acl_denial_is_socks_reply_2_at_once(line: tuple[dict[str, Node], dict[str, int]]
                                                           ) -> None:
    _nodes, ports = line
    rc, text = await curl(ports["a"], f"http://{C_IP}:{OPEN}/")
    assert (rc, text) == (0, "served by c\n")
    denied = REGISTRY.value("meshgate_acl_denied_total", "tcp")
    # by port: a, relayed through b, to the port no rule opens
    rc, text = await curl(ports["a"], f"http://{C_IP}:{CLOSED}/")
    assert rc == 97 and text.rstrip().endswith("(2)"), (rc, text)
    # by node: b, over its own link, to the port only a may reach
    rc, text = await curl(ports["b"], f"http://{C_IP}:{OPEN}/")
    assert rc == 97 and text.rstrip().endswith("(2)"), (rc, text)
    assert REGISTRY.value("meshgate_acl_denied_total", "tcp") == denied + 2
