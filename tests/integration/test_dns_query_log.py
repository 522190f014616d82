"""[dns.query_log] on a real node: its udp listener asked with dnspython (a mesh name, an upstream
name, the same name again from the cache, a [[dns.route]] name, a blocked name), then read back
with GET /dns/log?since=N on the admin port and with `meshgate dns log [--follow]` subprocesses."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import dns.asyncquery
import dns.message
import pytest

from meshgate.admin import AdminService, fetch
from meshgate.config import from_dict
from meshgate.dns.service import DnsService
from meshgate.metrics import REGISTRY
from meshgate.node import Node
from tests.helpers import async_wait_until, can_bind
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


def make_node(tmp_path: Path, auths: tuple[LocalAuthority, TagAuthority], *,
              listen: tuple[str, ...] = ("127.0.0.1:0",), **query_log: Any) -> Node:
    (tmp_path / "block.txt").write_text("ads.example.test\n")
    dns: dict[str, Any] = {
        "upstreams": [auths[0].url],
        "route": [{"suffix": "split.test.", "upstreams": [auths[1].url]}],
        "blocklist": {"lists": [str(tmp_path / "block.txt")]},
        "listener": [{"protocol": "udp", "listen": addr} for addr in listen],
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
        rows = [(e["seq"], e["client"], e["name"], e["type"], e["rcode"], e["answers"], e["source"])
                for e in got["entries"]]
        blocked = f"blocked {tmp_path / 'block.txt'}"
        assert rows == [
            (1, "127.0.0.1", "alpha.mesh.internal.", "A", "NOERROR", ["10.144.144.1"], "mesh"),
            (2, "127.0.0.1", "www.example.test.", "A", "NOERROR", ["192.0.2.1"], auths[0].url),
            (3, "127.0.0.1", "www.example.test.", "A", "NOERROR", ["192.0.2.1"], "cache"),
            (4, "127.0.0.1", "host.split.test.", "A", "NOERROR", ["192.0.2.55"],
             f"route split.test. {auths[1].url}"),
            (5, "127.0.0.1", "ads.example.test.", "AAAA", "NXDOMAIN", [], blocked),
        ]
        listener = udp_port(node)[1]
        for e in got["entries"]:
            assert e["listener"] == listener
            assert 0 <= e["latency_ms"] < 5000 and abs(e["time"] - time.time()) < 60
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
        _svc, url, port = udp_port(node)
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
        assert lines[0].split()[1:8] == ["127.0.0.1", url, "alpha.mesh.internal.", "A", "NOERROR",
                                         "10.144.144.1", "mesh"]
        assert lines[1].split()[1:8] == ["127.0.0.1", url, "www.example.test.", "A", "NOERROR",
                                         "192.0.2.1", auths[0].url]
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
            assert b"www.example.test. A NOERROR 192.0.2.1 cache" in third
            follow.send_signal(signal.SIGINT)
            await asyncio.wait_for(follow.wait(), 30)
            assert follow.returncode == 0
        finally:
            if follow.returncode is None:
                follow.kill()
                await follow.wait()
    finally:
        await node.stop()


# --------------------------------------------------------------------------- path: the file


def file_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def text_of(path: Path) -> str:
    """The file's text, "" while it is absent (not written yet, or between rotation's rename and
    the new file)."""
    try:
        return path.read_text()
    except FileNotFoundError:
        return ""


def dropped_total() -> float:
    return REGISTRY.value("meshgate_dns_query_log_dropped_total")


async def test_the_file_gets_one_json_line_per_answer_with_every_field(
        tmp_path: Path, auths: tuple[LocalAuthority, TagAuthority]) -> None:
    path = tmp_path / "queries.jsonl"
    node = make_node(tmp_path, auths, enable=True, path=str(path))
    await node.start()
    try:
        _svc, url, port = udp_port(node)
        assert await ask(port, "alpha.mesh.internal") == ("NOERROR", ["10.144.144.1"])
        assert await ask(port, "www.example.test") == ("NOERROR", ["192.0.2.1"])
        assert await ask(port, "www.example.test") == ("NOERROR", ["192.0.2.1"])
        assert await ask(port, "host.split.test") == ("NOERROR", ["192.0.2.55"])
        assert await ask(port, "x.ads.example.test") == ("NXDOMAIN", [])
        # written by the log's own thread, shortly after the answers
        await async_wait_until(lambda: len(text_of(path).splitlines()) == 5,
                               10, "five lines in the query log file")
    finally:
        await node.stop()
    lines = file_lines(path)
    assert [sorted(e) for e in lines] == [sorted(
        ["time", "client", "listener", "name", "type", "rcode", "answers", "source", "latency_ms"])] * 5
    assert [(e["client"], e["listener"], e["name"], e["type"], e["rcode"], e["answers"], e["source"])
            for e in lines] == [
        ("127.0.0.1", url, "alpha.mesh.internal.", "A", "NOERROR", ["10.144.144.1"], "mesh"),
        ("127.0.0.1", url, "www.example.test.", "A", "NOERROR", ["192.0.2.1"], auths[0].url),
        ("127.0.0.1", url, "www.example.test.", "A", "NOERROR", ["192.0.2.1"], "cache"),
        ("127.0.0.1", url, "host.split.test.", "A", "NOERROR", ["192.0.2.55"],
         f"route split.test. {auths[1].url}"),
        ("127.0.0.1", url, "x.ads.example.test.", "A", "NXDOMAIN", [], f"blocked {tmp_path / 'block.txt'}"),
    ]
    assert all(0 <= e["latency_ms"] < 5000 and abs(e["time"] - time.time()) < 60 for e in lines)

    # `meshgate dns log --file` prints the file's lines (no admin port involved)
    proc = await asyncio.create_subprocess_exec(
        *meshgate_cmd("dns", "log", "--file", str(path)), env=env(),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err
    printed = out.decode().splitlines()
    assert len(printed) == 5
    assert printed[1].split()[1:8] == ["127.0.0.1", url, "www.example.test.", "A", "NOERROR",
                                       "192.0.2.1", auths[0].url]


async def test_the_file_rotates_at_max_bytes_and_keeps_keep_older_files(
        tmp_path: Path, auths: tuple[LocalAuthority, TagAuthority]) -> None:
    path = tmp_path / "q.log"
    node = make_node(tmp_path, auths, enable=True, path=str(path), max_bytes=1000, keep=2)
    await node.start()
    try:
        _svc, _url, port = udp_port(node)
        for i in range(40):  # ~200-byte lines: about 5 to a file, 8 files' worth
            assert (await ask(port, f"n{i}.alpha.mesh.internal"))[0] == "NXDOMAIN"
        await async_wait_until(lambda: "n39.alpha" in text_of(path), 10, "the last line written")
    finally:
        await node.stop()
    files = [path, Path(f"{path}.1"), Path(f"{path}.2")]
    assert all(f.exists() for f in files) and not Path(f"{path}.3").exists()
    sizes = [f.stat().st_size for f in files]
    assert all(s <= 1000 for s in sizes), sizes
    assert all(s > 1000 - 250 for s in sizes[1:]), sizes  # rotated when the next line would not fit
    # oldest first: path.2, path.1, path: the newest consecutive questions, none lost in between
    names = [e["name"] for f in reversed(files) for e in file_lines(f)]
    first = int(names[0].split(".")[0][1:])
    assert names == [f"n{i}.alpha.mesh.internal." for i in range(first, 40)]
    assert first > 0  # the oldest files were dropped


@pytest.mark.skipif(not can_bind("::1"), reason="no IPv6 loopback")
@pytest.mark.parametrize("mode", ["anonymized", "none"])
async def test_client_ip_anonymized_or_none_in_the_file_and_the_ring(
        tmp_path: Path, auths: tuple[LocalAuthority, TagAuthority], mode: str) -> None:
    path = tmp_path / "q.log"
    node = make_node(tmp_path, auths, listen=("127.0.0.1:0", "[::1]:0"), enable=True, path=str(path),
                     client_ip=mode)
    await node.start()
    try:
        svc = next(s for s in node.services if s.name == "dns")
        assert isinstance(svc, DnsService)
        v6 = next(u for u in svc.urls if u.startswith("udp://[::1]"))
        v6_port = int(v6.rsplit(":", 1)[1])
        _svc, _url, port = udp_port(node)
        await ask(port, "alpha.mesh.internal")
        r = await dns.asyncquery.udp(dns.message.make_query("alpha.mesh.internal", "A"), "::1",
                                     port=v6_port, timeout=5.0)
        assert r.answer
        await async_wait_until(lambda: len(text_of(path).splitlines()) == 2,
                               10, "two lines in the query log file")
        ring = [e["client"] for e in (await dns_log(node))["entries"]]
    finally:
        await node.stop()
    want = ["127.0.0.0", "::"] if mode == "anonymized" else ["", ""]
    assert [e["client"] for e in file_lines(path)] == want
    assert ring == want


@pytest.mark.timeout(120)  # a put that waited for the writer would hang the node's event loop
async def test_a_flood_with_a_stuck_writer_drops_and_counts_and_every_answer_comes(
        tmp_path: Path, auths: tuple[LocalAuthority, TagAuthority]) -> None:
    # A FIFO nobody reads: the writer thread blocks opening it, like a disk that stopped.
    fifo = tmp_path / "q.fifo"
    os.mkfifo(fifo)
    node = make_node(tmp_path, auths, enable=True, path=str(fifo), queue=100)
    before = dropped_total()
    reader = -1
    await node.start()
    try:
        _svc, _url, port = udp_port(node)
        total, answered = 5000, 0

        async def one() -> None:
            nonlocal answered
            if (await ask(port, "alpha.mesh.internal"))[0] == "NOERROR":
                answered += 1

        for _ in range(total // 50):
            await asyncio.gather(*(one() for _ in range(50)))
        assert answered == total
        assert node.resolver is not None and node.resolver.query_log is not None
        sink = node.resolver.query_log.sink
        assert sink is not None
        # what the thread took before it blocked, what waits (the bound), what was dropped
        in_hand = total - len(sink.queue) - sink.dropped
        assert len(sink.queue) == 100 and 1 <= in_hand <= 100
        assert dropped_total() - before == sink.dropped == total - 100 - in_hand
        assert (await dns_log(node))["last"] == total  # the ring took every one
        # a reader comes: the queued lines flow
        reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
        got = bytearray()

        def read_some() -> bool:
            with contextlib.suppress(BlockingIOError):  # nothing written yet
                got.extend(os.read(reader, 1 << 20))
            return got.count(b"\n") >= 100 + in_hand

        await async_wait_until(read_some, 10, "the queued lines through the FIFO")
        assert got.count(b"\n") == 100 + in_hand
    finally:
        await node.stop()
        if reader >= 0:
            os.close(reader)


async def test_dns_log_file_follow_goes_on_across_a_rotation(
        tmp_path: Path, auths: tuple[LocalAuthority, TagAuthority]) -> None:
    path = tmp_path / "q.log"
    node = make_node(tmp_path, auths, enable=True, path=str(path), max_bytes=1000, keep=3)
    await node.start()
    follow = None
    try:
        _svc, _url, port = udp_port(node)
        await ask(port, "n0.alpha.mesh.internal")
        await async_wait_until(lambda: "n0.alpha" in text_of(path), 10, "the first line written")
        follow = await asyncio.create_subprocess_exec(
            *meshgate_cmd("dns", "log", "--file", str(path), "--follow"), env=env(),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        assert follow.stdout is not None
        assert b"n0.alpha.mesh.internal." in await asyncio.wait_for(follow.stdout.readline(), 60)
        for i in range(1, 12):  # ~200-byte lines: the file rotates twice on the way
            await ask(port, f"n{i}.alpha.mesh.internal")
        seen = [(await asyncio.wait_for(follow.stdout.readline(), 30)).split()[3] for _ in range(11)]
        assert seen == [f"n{i}.alpha.mesh.internal.".encode() for i in range(1, 12)]
        assert Path(f"{path}.2").exists()  # it did rotate (twice) while being followed
    finally:
        if follow is not None and follow.returncode is None:
            follow.send_signal(signal.SIGINT)
            await asyncio.wait_for(follow.wait(), 30)
        await node.stop()
    assert follow is not None and follow.returncode == 0
