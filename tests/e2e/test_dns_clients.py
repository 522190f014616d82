"""Real DNS clients nobody here wrote against `meshgate run` (uvloop, a separate process):
dig, kdig, dnsperf, curl --doh-url, and the `meshgate dns query` CLI. The upstream is a small
authoritative server on loopback inside the test process; nothing leaves 127.0.0.1."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.helpers import free_port, require_tool
from tests.integration.test_dns_upstream import LocalAuthority

pytestmark = pytest.mark.e2e

RFC_GET = "AAABAAABAAAAAAAAA3d3dwdleGFtcGxlA2NvbQAAAQAB"  # tests/vectors/doh_rfc8484_examples.txt (1)


class Node:
    def __init__(self, proc: asyncio.subprocess.Process, ports: dict[str, int], state: Path) -> None:
        self.proc = proc
        self.ports = ports
        self.state = state


async def run(*argv: str, timeout: float = 30.0) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.STDOUT)
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        proc.kill()
        raise
    assert proc.returncode is not None
    return proc.returncode, out.decode(errors="replace")


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[Node]:
    auth = await LocalAuthority().start()
    plain, tls, doh = _dual_port(), _dual_port(), free_port()
    ports = {"plain": plain, "tls": tls, "doh": doh}
    cfg = tmp_path / "dns.toml"
    cfg.write_text(f"""
[node]
name = "alpha"
state_dir = "{tmp_path / 'state'}"

[socks5]
enable = false

[admin]
enable = false

[dns]
upstreams = ["{auth.url}"]
records = {{ "printer.mesh.internal." = "10.1.2.9", "web.example.test." = "127.0.0.1" }}

[[dns.listener]]
protocol = "udp"
listen = "127.0.0.1:{plain}"

[[dns.listener]]
protocol = "tcp"
listen = "127.0.0.1:{plain}"

[[dns.listener]]
protocol = "dot"
listen = "127.0.0.1:{tls}"

[[dns.listener]]
protocol = "doq"
listen = "127.0.0.1:{tls}"

[[dns.listener]]
protocol = "doh"
listen = "127.0.0.1:{doh}"
""")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "meshgate", "run", "-c", str(cfg), stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT, cwd=str(Path(__file__).resolve().parents[2]),
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    assert proc.stdout is not None
    banner = ""
    try:
        while "TLS certificate" not in banner:
            line = await asyncio.wait_for(proc.stdout.readline(), 60)  # a cold start on a busy CI box
            if not line:
                raise AssertionError(f"meshgate run exited: {banner}")
            banner += line.decode()
        yield Node(proc, ports, tmp_path / "state")
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except TimeoutError:
                proc.kill()
        auth.release.set()
        await auth.stop()
    assert proc.returncode == 0


def _dual_port() -> int:
    """A port free for both TCP and UDP (plain DNS and DoT/DoQ listen on both)."""
    for _ in range(100):
        port = free_port()
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise OSError("no port free for both TCP and UDP")


def answers(out: str) -> list[str]:
    return [line.strip() for line in out.splitlines() if line.strip() and not line.startswith(";")]


@pytest.mark.parametrize("mode", ["+notcp", "+tcp", "+tls", "+https", "+https-get"])
async def test_dig(node: Node, mode: str) -> None:
    dig = require_tool("dig")
    port = {"+notcp": "plain", "+tcp": "plain", "+tls": "tls"}.get(mode, "doh")
    rc, out = await run(dig, mode, "+short", "+tries=1", "+time=5", "@127.0.0.1", "-p", str(node.ports[port]),
                        "five.example.test", "A")
    assert rc == 0, out
    assert sorted(answers(out)) == [f"192.0.2.{i}" for i in range(1, 6)]
    rc, out = await run(dig, mode, "+tries=1", "+time=5", "@127.0.0.1", "-p", str(node.ports[port]),
                        "nobody.mesh.internal", "A")
    assert "status: NXDOMAIN" in out and "mesh.internal.\t\t10\tIN\tSOA" in out.replace(" ", "\t")


@pytest.mark.parametrize("mode", ["+tls", "+https", "+quic"])
async def test_kdig(node: Node, mode: str) -> None:
    kdig = require_tool("kdig")
    port = node.ports["doh" if mode == "+https" else "tls"]
    rc, out = await run(kdig, mode, "+short", "+timeout=5", "+retry=0", "@127.0.0.1", "-p", str(port),
                        "printer.mesh.internal", "A")
    assert rc == 0, out
    assert answers(out) == ["10.1.2.9"]


@pytest.mark.parametrize("mode", ["udp", "tcp", "dot", "doh"])
async def test_dnsperf_loses_nothing(node: Node, mode: str, tmp_path: Path) -> None:
    dnsperf = require_tool("dnsperf")
    data = tmp_path / "queries.txt"
    data.write_text("printer.mesh.internal A\nwww.example.test A\nfive.example.test A\nnx1.example.test A\n"
                    "mesh.internal SOA\nwww.example.test AAAA\n")
    port = node.ports["plain" if mode in ("udp", "tcp") else "tls" if mode == "dot" else "doh"]
    # Bounded: 6 names x 200 runs = 1200 queries, at most 60 s (well under 1 s here; the limits are
    # for a slow CI box, where a cut-off run or a late answer would read as lost), loopback only.
    rc, out = await run(dnsperf, "-m", mode, "-s", "127.0.0.1", "-p", str(port), "-d", str(data),
                        "-n", "200", "-l", "60", "-c", "2", "-q", "50", "-t", "10", timeout=120)
    assert rc == 0, out
    sent = int(re.search(r"Queries sent:\s+(\d+)", out).group(1))  # type: ignore[union-attr]
    completed = int(re.search(r"Queries completed:\s+(\d+)", out).group(1))  # type: ignore[union-attr]
    assert sent == 1200 and completed == sent, out
    assert "NXDOMAIN 200" in out


async def test_curl_resolves_through_doh(node: Node) -> None:
    curl = require_tool("curl")
    hits: list[bytes] = []

    async def http(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        hits.append(await reader.readline())
        writer.write(b"HTTP/1.0 200 OK\r\ncontent-length: 3\r\n\r\nok\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(http, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        # web.example.test is a static record pointing at 127.0.0.1: curl asks our DoH for it.
        rc, out = await run(curl, "-sS", "--max-time", "10", "--doh-insecure", "--doh-url",
                            f"https://127.0.0.1:{node.ports['doh']}/dns-query", f"http://web.example.test:{port}/")
        assert rc == 0 and out == "ok\n", out
        assert hits and hits[0].startswith(b"GET / HTTP")
    finally:
        server.close()


async def test_curl_doh_vectors_and_bad_base64(node: Node) -> None:
    curl = require_tool("curl")
    url = f"https://127.0.0.1:{node.ports['doh']}/dns-query"
    base = [curl, "-sk", "--http2", "-o", "/dev/null", "-w"]
    _rc, out = await run(*base, "%{http_code} %{content_type} %{http_version}", f"{url}?dns={RFC_GET}")
    assert out == "200 application/dns-message 2", out
    _rc, out = await run(*base, "%{http_code}", f"{url}?dns={RFC_GET}==")  # '=' padding
    assert out == "400"
    _rc, out = await run(*base, "%{http_code}", "-X", "POST", "-H", "content-type: text/plain",
                         "--data-binary", "x", url)
    assert out == "415"


@pytest.mark.parametrize("scheme", ["udp", "tcp", "tls", "https", "quic"])
async def test_meshgate_dns_query_cli(node: Node, scheme: str) -> None:
    port = node.ports["plain" if scheme in ("udp", "tcp") else "doh" if scheme == "https" else "tls"]
    server = f"{scheme}://127.0.0.1:{port}" + ("/dns-query" if scheme == "https" else "")
    rc, out = await run(sys.executable, "-m", "meshgate", "dns", "query", "www.example.test", "A",
                        "--server", server, "--cafile", str(node.state / "dns-selfsigned.crt"))
    assert rc == 0, out
    assert "status: NOERROR" in out and "192.0.2.1" in out


async def test_curl_doh_http11_and_http2_on_one_port(node: Node, tmp_path: Path) -> None:
    """DoH over HTTP/1.1 (issue 16 item 1) under `meshgate run` (uvloop: the connection is handed
    to the HTTP/2 core by ALPN with transport.set_protocol), and HTTP/2 still on the same port."""
    import dns.message

    curl = require_tool("curl")
    url = f"https://localhost:{node.ports['doh']}/dns-query"
    ca = ["--cacert", str(node.state / "dns-selfsigned.crt"),
          "--resolve", f"localhost:{node.ports['doh']}:127.0.0.1"]
    qfile, body = tmp_path / "q.bin", tmp_path / "a.bin"
    q = dns.message.make_query("www.example.test", "A")
    qfile.write_bytes(q.to_wire())
    w = "%{http_code} %{http_version} %{content_type}"
    rc, out = await run(curl, "-sS", "--http1.1", *ca, "-o", str(body), "-w", w, f"{url}?dns={RFC_GET}")
    assert (rc, out) == (0, "200 1.1 application/dns-message"), out
    assert dns.message.from_wire(body.read_bytes()).question[0].name.to_text() == "www.example.com."
    for version, flag in (("1.1", "--http1.1"), ("2", "--http2")):
        rc, out = await run(curl, "-sS", flag, *ca, "-o", str(body), "-w", w, "-H",
                            "content-type: application/dns-message", "--data-binary", f"@{qfile}", url)
        assert (rc, out) == (0, f"200 {version} application/dns-message"), out
        answer = dns.message.from_wire(body.read_bytes())
        assert answer.id == q.id and "192.0.2.1" in answer.to_text()
    rc, out = await run(curl, "-sS", "--http1.1", *ca, "-o", "/dev/null", "-w", "%{http_code}", "-X", "POST",
                        url)
    assert (rc, out) == (0, "411"), out
