"""[dns.query_log] on a real node: its udp listener asked with dnspython (a mesh name, an upstream
name, the same name again from the cache, a [[dns.route]] name, a blocked name), then read back
with GET /dns/log?since=N on the admin port and with `meshgate dns log [--follow]` subprocesses."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from meshgate.admin import AdminService, fetch
from meshgate.config import from_dict
from meshgate.node import Node
from tests.integration.test_dns_blocklist import ask, udp_port
from tests.integration.test_dns_split import TagAuthority
from tests.integration.test_dns_upstream import LocalAuthority

ROOT = str(Path(__file__).resolve().parents[2])


@pytest.fixture
async def auths() -> AsyncIterator[tuple[LocalAuthority, TagAuthority]]:
    a = await LocalAuthority().start()
    t = await TagAuthority("192.0.2.55").start()
    yield a, t
    await t.stop()
    await a.stop()


def make_node(tmp_path: Path, auths: tuple[LocalAuthority, TagAuthority], **query_log: Any) -> Node:
    (tmp_path / "block.txt").write_text("ads.example.test\n")
    dns: dict[str, Any] = {
        "upstreams": [auths[0].url],
        "route": [{"suffix": "split.test.", "upstreams": [auths[1].url]}],
        "blocklist": {"lists": [str(tmp_path / "block.txt")]},
        "listener": [{"protocol": "udp", "listen": "127.0.0.1:0"}],
    }
    if query_log:
        dns["query_log"] = query_log
    return Node(from_dict({
        "node": {"name": "alpha", "ipv4": "10.144.144.1/24", "state_dir": str(tmp_path / "state")},
        "socks5": {"enable": False},
        "admin": {"listen": "127.0.0.1:0"},
        "dns": dns,
        "limits": {"dns_timeout": 2.0},
    }))


def admin_addr(node: Node) -> str:
    svc = next(s for s in node.services if s.name == "admin")
    assert isinstance(svc, AdminService)
    return svc.address


async def dns_log(node: Node, since: int | None = None) -> dict[str, Any]:
    path = "/dns/log" if since is None else f"/dns/log?since={since}"
    code, body = await fetch(admin_addr(node), path)
    assert code == 200, body
    got: dict[str, Any] = json.loads(body)
    return got


def meshgate_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "meshgate", *args]


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": ROOT, "MESHGATE_ADMIN_TOKEN": ""}


async def test_answered_questions_appear_with_their_fields_and_since_returns_newer_ones(
        tmp_path: Path, auths: tuple[LocalAuthority, TagAuthority]) -> None:
    node = make_node(tmp_path, auths, enable=True)
    await node.start()
    try:
        _svc, _url, port = udp_port(node)
        assert await ask(port, "alpha.mesh.internal") == ("NOERROR", ["10.144.144.1"])
        assert await ask(port, "www.example.test") == ("NOERROR", ["192.0.2.1"])
        assert await ask(port, "www.example.test") == ("NOERROR", ["192.0.2.1"])
        assert await ask(port, "host.split.test") == ("NOERROR", ["192.0.2.55"])
        assert await ask(port, "ads.example.test", "AAAA") == ("NXDOMAIN", [])
        got = await dns_log(node)
        assert got["enabled"] is True and got["size"] == 1000 and got["last"] == 5
        rows = [(e["seq"], e["client"], e["name"], e["type"], e["rcode"], e["via"])
                for e in got["entries"]]
        assert rows == [
            (1, "127.0.0.1", "alpha.mesh.internal.", "A", "NOERROR", "local"),
            (2, "127.0.0.1", "www.example.test.", "A", "NOERROR", auths[0].url),
            (3, "127.0.0.1", "www.example.test.", "A", "NOERROR", "cache"),
            (4, "127.0.0.1", "host.split.test.", "A", "NOERROR", f"route split.test. {auths[1].url}"),
            (5, "127.0.0.1", "ads.example.test.", "AAAA", "NXDOMAIN", "blocked"),
        ]
        for e in got["entries"]:
            assert 0 <= e["ms"] < 5000 and abs(e["time"] - time.time()) < 60
        newer = await dns_log(node, since=3)
        assert [e["seq"] for e in newer["entries"]] == [4, 5]
        assert (await dns_log(node, since=5))["entries"] == []
        code, _ = await fetch(admin_addr(node), "/dns/log?since=x")
        assert code == 400
    finally:
        await node.stop()


async def test_the_ring_keeps_only_size_entries(
        tmp_path: Path, auths: tuple[LocalAuthority, TagAuthority]) -> None:
    node = make_node(tmp_path, auths, enable=True, size=3)
    await node.start()
    try:
        _svc, _url, port = udp_port(node)
        for _ in range(5):
            await ask(port, "alpha.mesh.internal")
        got = await dns_log(node)
        assert got["last"] == 5 and [e["seq"] for e in got["entries"]] == [3, 4, 5]
        assert [e["seq"] for e in (await dns_log(node, since=1))["entries"]] == [3, 4, 5]
    finally:
        await node.stop()


async def test_with_the_log_off_nothing_is_recorded_and_the_endpoint_says_so(
        tmp_path: Path, auths: tuple[LocalAuthority, TagAuthority]) -> None:
    node = make_node(tmp_path, auths)
    await node.start()
    try:
        _svc, _url, port = udp_port(node)
        assert await ask(port, "alpha.mesh.internal") == ("NOERROR", ["10.144.144.1"])
        assert await dns_log(node) == {"enabled": False, "size": 0, "last": 0, "entries": []}
        assert node.resolver is not None and node.resolver.query_log is None
        proc = await asyncio.create_subprocess_exec(
            *meshgate_cmd("dns", "log", "--admin", admin_addr(node)), env=env(),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 1 and out == b"" and b"query log is off" in err
    finally:
        await node.stop()


async def test_meshgate_dns_log_prints_the_lines_and_follow_prints_new_ones(
        tmp_path: Path, auths: tuple[LocalAuthority, TagAuthority]) -> None:
    node = make_node(tmp_path, auths, enable=True)
    await node.start()
    try:
        _svc, _url, port = udp_port(node)
        await ask(port, "alpha.mesh.internal")
        await ask(port, "www.example.test")
        addr = admin_addr(node)
        proc = await asyncio.create_subprocess_exec(
            *meshgate_cmd("dns", "log", "--admin", addr), env=env(),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0, err
        lines = out.decode().splitlines()
        assert len(lines) == 2
        assert lines[0].split()[1:6] == ["127.0.0.1", "alpha.mesh.internal.", "A", "NOERROR", "local"]
        assert lines[1].split()[1:6] == ["127.0.0.1", "www.example.test.", "A", "NOERROR", auths[0].url]
        assert lines[1].endswith("ms")

        follow = await asyncio.create_subprocess_exec(
            *meshgate_cmd("dns", "log", "--follow", "--admin", addr), env=env(),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        try:
            assert follow.stdout is not None
            first = [await asyncio.wait_for(follow.stdout.readline(), 60) for _ in range(2)]
            assert b"alpha.mesh.internal." in first[0] and b"www.example.test." in first[1]
            await ask(port, "www.example.test")  # from the cache now
            third = await asyncio.wait_for(follow.stdout.readline(), 30)
            assert b"www.example.test. A NOERROR cache" in third
            follow.send_signal(signal.SIGINT)
            await asyncio.wait_for(follow.wait(), 30)
            assert follow.returncode == 0
        finally:
            if follow.returncode is None:
                follow.kill()
                await follow.wait()
    finally:
        await node.stop()
