"""The PAC file per destination, as real browsers follow it: headless Chromium and headless
Firefox, configured with nothing but B's PAC URL, open one page that pulls in a frame from
each kind of destination. The mesh's destinations (a node's virtual IP, a name in the mesh zone,
a proxy CIDR as advertised) must come through B's HTTP proxy; the page itself on loopback and a
frame at this host's own (non-loopback) address must come directly. The A — B — C mesh is
tests/integration/test_http_proxy.py's: C publishes SERVED on its virtual IP and maps
127.0.0.0/24 as 10.2.2.0/24, so every frame ends at the one origin below, which records how each
request arrived."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from pathlib import Path

from meshgate.node import Node
from tests.helpers import Metric, require_tool, write_firefox_prefs
from tests.integration.test_http_proxy import CHROMIUM_FLAGS, SERVED, line, svc_of, url

__all__ = ["line"]  # the fixture, imported to be used here

# destination kind -> (host, whether B's PAC file sends it through the proxy)
THROUGH_PROXY = {"mesh-ip": "10.144.1.3", "mesh-name": "c.mesh.internal", "proxy-cidr": "10.2.2.1"}


def host_address() -> str | None:
    """This host's own non-loopback address (the source of its default route), or None."""
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.1", 9))  # no packet is sent: this only picks a source address
        addr = str(s.getsockname()[0])
        return None if addr.startswith("127.") else addr
    return None


class Origin:
    """Every address of this host at SERVED: `/start` is a page framing `frames`; any other path
    answers its own name. `seen` maps each path to how its requests came: "proxy" when the head
    is what meshgate's forwarding writes (ends in its `Connection: close`), else "direct"."""

    def __init__(self, frames: dict[str, str]) -> None:
        self.frames = frames
        self.seen: dict[str, set[str]] = {}
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> Origin:
        self.server = await asyncio.start_server(self._handle, "0.0.0.0", SERVED)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()

    async def _handle(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            while True:  # a browser keeps its direct connections alive
                head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 30)
                path = head.split(b" ", 2)[1].decode()
                how = "proxy" if head.endswith(b"\r\nConnection: close\r\n\r\n") else "direct"
                self.seen.setdefault(path, set()).add(how)
                if path == "/start":
                    body = "".join(f'<iframe src="{u}"></iframe>' for u in self.frames.values()).encode()
                else:
                    body = f"<p id=got>{path}</p>".encode()
                # as an HTTP/1.1 server must (RFC 9112 9.6): a request saying close is the last
                close = b"\r\nconnection: close\r\n" in head.lower()
                w.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/html\r\nContent-Length: %d\r\n%s\r\n%s"
                        % (len(body), b"Connection: close\r\n" if close else b"", body))
                await w.drain()
                if close:
                    break
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, IndexError):
            pass
        finally:
            w.close()


def destinations() -> tuple[str, dict[str, str], set[str]]:
    """The start page's URL, its frames (kind -> URL) and the kinds that must come directly."""
    frames = {kind: f"http://{host}:{SERVED}/{kind}" for kind, host in THROUGH_PROXY.items()}
    direct = {"start"}
    lan = host_address()
    if lan is not None:  # the start page is on loopback: a browser lets it frame this host's address
        frames["host-address"] = f"http://{lan}:{SERVED}/host-address"
        direct.add("host-address")
    return f"http://127.0.0.1:{SERVED}/start", frames, direct


@contextlib.asynccontextmanager
async def watched(frames: dict[str, str]) -> AsyncIterator[tuple[Origin, Metric]]:
    async with Origin(frames) as origin:
        yield origin, Metric("meshgate_http_proxy_requests_total", "forward", "200")


def check(origin: Origin, forwarded: Metric, frames: dict[str, str], direct: set[str], log: str) -> None:
    for kind in THROUGH_PROXY:
        assert origin.seen.get(f"/{kind}") == {"proxy"}, (kind, origin.seen, log[-2000:])
    for kind in direct:
        assert origin.seen.get(f"/{kind}") == {"direct"}, (kind, origin.seen, log[-2000:])
    assert forwarded.delta >= len(THROUGH_PROXY)


async def test_chromium_follows_the_pac_file_per_destination(line: dict[str, Node], tmp_path: Path) -> None:
    chromium = require_tool("chromium")
    start, frames, direct = destinations()
    pac = f"{url(svc_of(line['b']))}/proxy.pac"
    async with watched(frames) as (origin, forwarded):
        proc = await asyncio.create_subprocess_exec(
            chromium, *CHROMIUM_FLAGS, f"--proxy-pac-url={pac}", f"--user-data-dir={tmp_path / 'profile'}",
            "--dump-dom", start, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(proc.communicate(), 120)
        check(origin, forwarded, frames, direct, out.decode() + err.decode())


FIREFOX_PREFS = {
    "network.proxy.type": 2,  # automatic proxy configuration URL
    # loopback is decided by the PAC file too (Firefox never proxies it otherwise), as
    # Chromium's --proxy-bypass-list=<-loopback>
    "network.proxy.allow_hijacking_localhost": True,
    "browser.shell.checkDefaultBrowser": False,
    "datareporting.policy.dataSubmissionEnabled": False,
    "toolkit.telemetry.reportingpolicy.firstRun": False,
    "app.update.auto": False,
    "extensions.update.enabled": False,
    "network.captive-portal-service.enabled": False,
    "network.connectivity-service.enabled": False,
    "browser.safebrowsing.malware.enabled": False,
    "browser.safebrowsing.phishing.enabled": False,
    "network.dns.disablePrefetch": True,
    "network.prefetch-next": False,
}


def firefox_profile(directory: Path, pac: str) -> Path:
    directory.mkdir()
    write_firefox_prefs(directory, {**FIREFOX_PREFS, "network.proxy.autoconfig_url": pac})
    return directory


async def test_firefox_follows_the_pac_file_per_destination(line: dict[str, Node], tmp_path: Path) -> None:
    firefox = require_tool("firefox-esr")
    start, frames, direct = destinations()
    profile = firefox_profile(tmp_path / "profile", f"{url(svc_of(line['b']))}/proxy.pac")
    async with watched(frames) as (origin, forwarded):
        # --screenshot loads the page, waits for its load event (the frames' too), then exits
        proc = await asyncio.create_subprocess_exec(
            firefox, "--headless", "--no-remote", "--profile", str(profile),
            "--screenshot", str(tmp_path / "page.png"), start,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env={"HOME": str(tmp_path)},
        )
        out, err = await asyncio.wait_for(proc.communicate(), 120)
        check(origin, forwarded, frames, direct, out.decode() + err.decode())
