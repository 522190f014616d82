"""The admin API's defences on a real node: DNS rebinding (Host), the token off loopback,
per-source connection caps, and the start-up warnings for listeners open to the network."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from meshgate.admin import fetch
from meshgate.config import from_dict
from meshgate.metrics import REGISTRY
from meshgate.node import Node
from tests.helpers import async_wait_until, can_bind, free_port, require

TOKEN = "admin-token-for-tests-0123456789"


async def ask(port: int, host_header: str, token: str = "", source: str = "127.0.0.1") -> int:
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    writer.write(f"GET /status HTTP/1.1\r\nHost: {host_header}\r\n{auth}Connection: close\r\n\r\n".encode())
    data = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    return int(data.split(b" ", 2)[1])


def node_for(tmp_path: Path, listen: str, **admin: object) -> Node:
    return Node(from_dict({
        "node": {"state_dir": str(tmp_path)}, "socks5": {"enable": False},
        "admin": {"listen": listen, **admin},
        "limits": {"admin_max_clients_per_source": 4},
    }))


@pytest.fixture
async def loopback_admin(tmp_path: Path) -> AsyncIterator[int]:
    port = free_port()
    node = node_for(tmp_path, f"127.0.0.1:{port}", hosts=["node-a.lan"])
    await node.start()
    try:
        yield port
    finally:
        await node.stop()


async def test_a_foreign_host_header_gets_403(loopback_admin: int) -> None:
    port = loopback_admin
    assert await ask(port, f"127.0.0.1:{port}") == 200
    assert await ask(port, f"localhost:{port}") == 200
    assert await ask(port, f"node-a.lan:{port}") == 200  # admin.hosts
    # what a page on attacker.example sees after pointing its name at 127.0.0.1
    assert await ask(port, f"attacker.example:{port}") == 403
    assert REGISTRY.value("meshgate_admin_requests_total", "/status", "403") >= 1


async def test_off_loopback_every_request_needs_the_token(tmp_path: Path) -> None:
    port = free_port()
    node = node_for(tmp_path, f"0.0.0.0:{port}", token=TOKEN)
    await node.start()
    try:
        assert await ask(port, f"127.0.0.1:{port}") == 401
        assert await ask(port, f"127.0.0.1:{port}", token="wrong-" + TOKEN) == 401
        assert await ask(port, f"127.0.0.1:{port}", token=TOKEN) == 200
        # the CLI's client sends it too
        code, body = await fetch(f"127.0.0.1:{port}", "/status", token=TOKEN)
        assert code == 200 and b'"services"' in body
        assert (await fetch(f"127.0.0.1:{port}", "/status"))[0] == 401
    finally:
        await node.stop()


async def test_one_source_cannot_hold_every_admin_slot(tmp_path: Path) -> None:
    require(can_bind("127.0.0.2"), "127.0.0.2 on loopback")
    port = free_port()
    node = node_for(tmp_path, f"0.0.0.0:{port}", token=TOKEN)
    await node.start()
    held: list[asyncio.StreamWriter] = []
    try:
        refused = REGISTRY.value("meshgate_admin_connections_refused_total", "per_source")
        for _ in range(4):  # limits.admin_max_clients_per_source, each idle (no request)
            _, w = await asyncio.open_connection("127.0.0.1", port)
            held.append(w)
        admin = next(s for s in node.services if s.name == "admin")
        await async_wait_until(  # the server holds all four
            lambda: admin._per_source.get("127.0.0.1") == 4, 5, "four idle connections held")  # type: ignore[attr-defined]
        r, w = await asyncio.open_connection("127.0.0.1", port)
        assert await asyncio.wait_for(r.read(), 10) == b""  # the fifth from that source: closed at once
        w.close()
        await async_wait_until(
            lambda: REGISTRY.value("meshgate_admin_connections_refused_total", "per_source") == refused + 1,
            5, "refusal counted")
        # another source is still served while the first holds its share
        assert await ask(port, f"127.0.0.1:{port}", token=TOKEN, source="127.0.0.2") == 200
    finally:
        for w in held:
            w.close()
        await node.stop()


def test_listeners_open_to_the_network_without_auth_are_warned_about(tmp_path: Path) -> None:
    import subprocess
    import sys

    cfg = tmp_path / "open.toml"
    cfg.write_text('[socks5]\nlisten = "0.0.0.0:1080"\n[admin]\nlisten = "0.0.0.0:15888"\n')
    run = subprocess.run([sys.executable, "-m", "meshgate", "check-config", str(cfg)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0
    assert f"{cfg}:admin.listen: warning: 0.0.0.0:15888 is off loopback with no admin.token" in run.stderr
    assert f"{cfg}:socks5.listen: warning: 0.0.0.0:1080 is off loopback with no socks5.users" in run.stderr
    cfg.write_text(f'[socks5]\nlisten = "0.0.0.0:1080"\nusers = [{{ name = "u", password = "p" }}]\n'
                   f'[admin]\nlisten = "0.0.0.0:15888"\ntoken = "{TOKEN}"\n')
    run = subprocess.run([sys.executable, "-m", "meshgate", "check-config", str(cfg)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and "warning" not in run.stderr and TOKEN not in run.stderr + run.stdout


