"""Real clients nobody here wrote, through the SOCKS5 portal: curl, headless Chromium, and
PySocks for UDP ASSOCIATE (neither curl nor Chromium sends UDP through SOCKS5)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import tempfile
from collections.abc import AsyncIterator

import pytest
import socks

from meshgate.config import AdminConfig, Config, HostPort, Socks5Config, User
from meshgate.metrics import REGISTRY
from meshgate.node import Node
from tests.helpers import UdpEcho, async_wait_until, require_module, require_tool, sha256

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.filterwarnings("ignore:Overriding the \"event_loop_policy\" fixture"),
]


@pytest.fixture
def event_loop_policy() -> asyncio.AbstractEventLoopPolicy:
    """uvloop, as `meshgate run` uses by default (the integration tests cover both loops)."""
    uvloop = require_module("uvloop")
    return uvloop.EventLoopPolicy()  # type: ignore[no-any-return]


@contextlib.asynccontextmanager
async def portal(users: tuple[User, ...] = ()) -> AsyncIterator[int]:
    cfg = Config(
        socks5=Socks5Config(listen=HostPort("127.0.0.1", 0), users=users),
        admin=AdminConfig(enable=False),
    )
    node = Node(cfg)
    await node.start()
    try:
        addr = node.status()["services"]["socks5"]["listen"]
        yield int(addr.rsplit(":", 1)[1])
    finally:
        await node.stop()


@contextlib.asynccontextmanager
async def http_server(
    body: bytes, content_type: str = "application/octet-stream", host: str = "127.0.0.1"
) -> AsyncIterator[int]:
    """A minimal HTTP/1.1 server on loopback serving `body` for any GET."""

    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await r.readuntil(b"\r\n\r\n")
                if not head.startswith(b"GET "):
                    w.write(b"HTTP/1.1 405 Method Not Allowed\r\nContent-Length: 0\r\n\r\n")
                    break
                path = head.split(b" ", 2)[1]
                if path != b"/":
                    w.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
                else:
                    w.write(
                        b"HTTP/1.1 200 OK\r\nContent-Type: " + content_type.encode()
                        + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n"
                    )
                    w.write(body)
                await w.drain()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError):
            pass
        finally:
            w.close()

    srv = await asyncio.start_server(handle, host, 0)
    try:
        yield srv.sockets[0].getsockname()[1]
    finally:
        srv.close()
        await srv.wait_closed()


async def run(argv: list[str], timeout: float = 60) -> tuple[int, bytes, bytes]:
    proc = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    assert proc.returncode is not None
    return proc.returncode, out, err


def connects() -> float:
    return REGISTRY.value("meshgate_socks5_requests_total", "connect", "succeeded")


async def test_curl_socks5h_fetches_exact_bytes() -> None:
    curl = require_tool("curl")
    body = os.urandom(3 * 1024 * 1024 + 17)
    # Serve on the address "localhost" resolves to first, which is what the portal dials.
    first = socket.getaddrinfo("localhost", 0, type=socket.SOCK_STREAM)[0][4][0]
    async with portal() as sport, http_server(body, host=first) as hport:
        for proxy_args in (
            ["--socks5-hostname", f"127.0.0.1:{sport}"],
            ["--proxy", f"socks5h://127.0.0.1:{sport}"],
        ):
            before = connects()
            # "localhost" travels as a name (socks5h) and resolves in the portal.
            argv = [curl, "-sS", "--max-time", "30", *proxy_args, f"http://localhost:{hport}/"]
            code, out, err = await run(argv)
            assert code == 0, err
            assert sha256(out) == sha256(body)
            assert connects() == before + 1


async def test_curl_with_credentials_and_wrong_password_refused() -> None:
    curl = require_tool("curl")
    body = os.urandom(100_000)
    users = (User("alice", "s3cret"),)
    async with portal(users) as sport, http_server(body) as hport:
        url = f"http://127.0.0.1:{hport}/"
        code, out, err = await run(
            [curl, "-sS", "--max-time", "30", "--proxy", f"socks5h://alice:s3cret@127.0.0.1:{sport}", url]
        )
        assert code == 0, err
        assert sha256(out) == sha256(body)
        failures = REGISTRY.value("meshgate_socks5_auth_failures_total")
        code, out, _ = await run(
            [curl, "-sS", "--max-time", "30", "--proxy", f"socks5h://alice:nope@127.0.0.1:{sport}", url]
        )
        assert code != 0 and out == b""
        assert REGISTRY.value("meshgate_socks5_auth_failures_total") == failures + 1


async def test_headless_chromium_loads_page_through_portal() -> None:
    chromium = require_tool("chromium")
    marker = os.urandom(8).hex()
    page = f"<!doctype html><html><head><title>meshgate</title></head><body><p>{marker}</p></body></html>"
    async with portal() as sport, http_server(page.encode(), "text/html") as hport:
        before = connects()
        with tempfile.TemporaryDirectory(prefix="meshgate-chromium-") as profile:
            code, out, err = await run(
                [
                    chromium,
                    "--headless",
                    "--no-sandbox",
                    "--disable-gpu",
                    "--disable-quic",
                    f"--proxy-server=socks5://127.0.0.1:{sport}",
                    "--proxy-bypass-list=<-loopback>",  # do not bypass the proxy for loopback
                    "--no-first-run",
                    "--disable-background-networking",
                    "--disable-component-update",
                    "--disable-sync",
                    f"--user-data-dir={profile}",
                    "--dump-dom",
                    f"http://127.0.0.1:{hport}/",
                ],
                timeout=90,
            )
        assert code == 0, err[-2000:]
        assert marker.encode() in out
        # Proof the proxy was used, not a direct connection.
        assert connects() >= before + 1




def udp_datagrams(direction: str) -> float:
    return REGISTRY.value("meshgate_socks5_udp_datagrams_total", direction)


def pysocks_udp_round_trips(
    sport: int, target: tuple[str, int], payloads: list[bytes]
) -> tuple[tuple[str, int], list[tuple[bytes, tuple[str, int]]]]:
    """PySocks' own UDP ASSOCIATE (its TCP control connection, its datagram headers), blocking,
    so it runs in a thread beside the portal's loop. Returns the client's UDP address and
    what came back for each payload, with the source PySocks read from the reply header."""
    s = socks.socksocket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.set_proxy(socks.SOCKS5, "127.0.0.1", sport)
        s.settimeout(10)  # bounds every step: the associate, each send and each reply
        s.bind(("127.0.0.1", 0))  # sends UDP ASSOCIATE over a new TCP connection to the portal
        replies = []
        for payload in payloads:
            s.sendto(payload, target)
            replies.append(s.recvfrom(65536))
        return s.getsockname(), replies
    finally:
        s.close()


async def test_pysocks_udp_associate_round_trip_through_portal() -> None:
    payloads = [b"ping", os.urandom(1200), b"", os.urandom(8000)]
    echo = UdpEcho()
    target = echo.address
    try:
        async with portal() as sport:
            to_target, to_client = udp_datagrams("to_target"), udp_datagrams("to_client")
            client, replies = await asyncio.wait_for(
                asyncio.to_thread(pysocks_udp_round_trips, sport, target, payloads), 30
            )
            # every payload came back whole, in a header naming the target it was sent to
            assert replies == [(p, target) for p in payloads]
            # the target heard the portal's relay socket, never the client itself
            assert len(echo.peers) == len(payloads)
            assert client not in echo.peers
            # the portal counted each both ways (its reply count is flushed in batches or when
            # the association ends, which PySocks' close of the control connection starts)
            await async_wait_until(
                lambda: (udp_datagrams("to_target"), udp_datagrams("to_client"))
                == (to_target + len(payloads), to_client + len(payloads)),
                what="the portal's UDP datagram counts",
            )
    finally:
        echo.close()
