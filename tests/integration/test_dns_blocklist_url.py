"""[dns.blocklist] lists from http(s) URLs (issue 16 item 5) on a real node: a loopback HTTP
server (http.server in a thread) serves a list and an allowlist with ETag and Last-Modified;
dnspython asks the node's udp listener. The list is downloaded, re-downloaded conditionally
(304), changed (a name becomes blocked, another unblocked), fails (500, then a closed port:
the last good copy stays, counted), and the allowlist (a URL too) wins; subdomains match."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from meshgate.config import from_dict
from meshgate.metrics import REGISTRY
from meshgate.node import Node
from tests.helpers import async_wait_until
from tests.integration.test_dns_blocklist import UP, ask, auth, udp_port
from tests.integration.test_dns_split import TagAuthority

__all__ = ["auth"]  # the fixture, used here


class ListServer:
    """Serves /block.txt and /allow.txt; `fail` answers 500; counts 200s and 304s per path."""

    def __init__(self) -> None:
        self.lists = {"/block.txt": "0.0.0.0 ads.example\n||tracker.example^\n",
                      "/allow.txt": "good.ads.example\n"}
        self.version = 1
        self.fail = False
        self.hits: dict[tuple[str, int], int] = {}
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                etag = f'"v{server.version}"'
                if server.fail:
                    code = 500
                    self.send_response(500)
                    self.end_headers()
                elif self.headers.get("If-None-Match") == etag:
                    code = 304
                    self.send_response(304)
                    self.end_headers()
                else:
                    body = server.lists[self.path].encode()
                    code = 200
                    self.send_response(200)
                    self.send_header("ETag", etag)
                    self.send_header("Last-Modified", formatdate(usegmt=True))
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                key = (self.path, code)
                server.hits[key] = server.hits.get(key, 0) + 1

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def count(self, path: str, code: int) -> int:
        return self.hits.get((path, code), 0)

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def lists() -> Iterator[ListServer]:
    s = ListServer()
    yield s
    s.close()


def failures(url: str) -> int:
    return REGISTRY.counter("meshgate_dns_blocklist_load_failures_total", "", ("list",)).labels(url).value


async def test_url_lists_refresh_change_fail_and_allow(tmp_path: Path, auth: TagAuthority,
                                                       lists: ListServer) -> None:
    block, allow = lists.url("/block.txt"), lists.url("/allow.txt")
    cfg = from_dict({
        "node": {"name": "alpha", "ipv4": "10.144.144.1/24", "state_dir": str(tmp_path / "state")},
        "socks5": {"enable": False}, "admin": {"enable": False},
        "dns": {"upstreams": [auth.url],
                "blocklist": {"lists": [block], "allow": [allow], "refresh": 0.2},
                "listener": [{"protocol": "udp", "listen": "127.0.0.1:0"}]},
        "limits": {"dns_timeout": 2.0},
    })
    node = Node(cfg)
    await node.start()
    try:
        svc, _url, port = udp_port(node)

        async def blocked(name: str) -> bool:
            return (await ask(port, name))[0] == "NXDOMAIN"

        # Downloaded at start; subdomains match; the allowlist URL wins.
        def loaded() -> bool:
            return all(st["loaded"] for st in svc.status()["blocklist"]["lists"].values())

        async def asked_then(cond: Any) -> bool:
            # Lists are refreshed from the query path (due every dns.blocklist.refresh seconds):
            # keep asking while waiting.
            await ask(port, "keepalive.example")
            return bool(cond())

        await async_wait_until(loaded, what="both lists downloaded")
        assert await blocked("ads.example")
        assert await blocked("x.tracker.example")
        assert await ask(port, "good.ads.example") == ("NOERROR", [UP])
        assert await ask(port, "news.example") == ("NOERROR", [UP])
        # Refreshed with If-None-Match: the server answers 304 and nothing changes.
        await async_wait_until(lambda: asked_then(lambda: lists.count("/block.txt", 304) >= 2),
                               what="conditional re-downloads")
        assert lists.count("/block.txt", 200) == 1
        # Changed: news.example becomes blocked, tracker.example is unblocked.
        lists.lists["/block.txt"] = "0.0.0.0 ads.example\nnews.example\n"
        lists.version = 2
        await async_wait_until(lambda: blocked("news.example"), what="the new list in force")
        assert not await blocked("tracker.example")
        # A reload that still names the URLs keeps their copies: no gap while they download again.
        svc.pipeline.set_blocklist(cfg.dns.blocklist)
        assert await blocked("news.example")
        assert await ask(port, "good.ads.example") == ("NOERROR", [UP])
        # A failed download keeps the last good copy and is counted.
        before = failures(block)
        lists.fail = True
        await async_wait_until(lambda: asked_then(lambda: failures(block) >= before + 2),
                               what="failed downloads counted")
        assert await blocked("news.example") and await blocked("a.ads.example")
        status = svc.status()["blocklist"]["lists"][block]
        assert status["loaded"] and status["error"] == "HTTP 500" and status["downloads"] >= 3
        # The server gone altogether: the same.
        lists.close()
        await async_wait_until(lambda: asked_then(lambda: failures(block) >= before + 4),
                               what="more failures counted")
        assert await blocked("news.example")
        assert await ask(port, "good.ads.example") == ("NOERROR", [UP])
    finally:
        await node.stop()
