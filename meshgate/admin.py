"""Admin API: a tiny HTTP/1.1 JSON server on 127.0.0.1 (config `[admin] listen`).

GET /status, /peers, /routes, /metrics. One request per connection keeps it
simple; the CLI and health checks are the clients.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from meshgate.config import Config
from meshgate.errors import bind_error
from meshgate.metrics import REGISTRY
from meshgate.netfmt import host_port

if TYPE_CHECKING:  # a node without the mesh does not load it
    from meshgate.mesh.service import MeshService

log = logging.getLogger("meshgate.admin")

_MAX_REQUEST = 8192  # request head bytes; a longer one is dropped (LimitOverrunError)
_TIMEOUT = 5.0
_requests = REGISTRY.counter("meshgate_admin_requests_total", "Admin API requests", ("path", "code"))


def _response(code: int, reason: str, body: bytes, ctype: str) -> bytes:
    head = (
        f"HTTP/1.1 {code} {reason}\r\nContent-Type: {ctype}\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


class AdminService:
    name = "admin"

    def __init__(
        self, config: Config, node_status: Callable[[], dict[str, Any]], mesh: MeshService | None
    ) -> None:
        self.config = config
        self.node_status = node_status
        self.mesh = mesh
        self.server: asyncio.Server | None = None
        self._clients = 0

    async def start(self) -> None:
        addr = self.config.admin.listen
        try:
            self.server = await asyncio.start_server(self._handle, addr.host, addr.port, limit=_MAX_REQUEST)
        except OSError as e:
            raise bind_error("admin.listen", addr, e) from None
        log.info("admin API on http://%s", self.address)

    @property
    def address(self) -> str:
        assert self.server is not None
        host, port = self.server.sockets[0].getsockname()[:2]
        return host_port(host, port)

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()
            self.server = None

    def status(self) -> dict[str, Any]:
        return {"listen": self.address if self.server else None}

    def _route(self, path: str) -> tuple[int, bytes, str]:
        mesh = self.mesh
        if path == "/status":
            return 200, json.dumps(self.node_status()).encode(), "application/json"
        if path == "/metrics":
            return 200, REGISTRY.expose().encode(), "text/plain; version=0.0.4"
        if path == "/peers":
            peers = mesh.peers() if mesh is not None else []
            return 200, json.dumps(peers).encode(), "application/json"
        if path == "/routes":
            routes = mesh.routes() if mesh is not None else []
            return 200, json.dumps(routes).encode(), "application/json"
        return 404, b'{"error": "not found"}', "application/json"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        limit = self.config.limits.admin_max_clients
        if self._clients >= limit:
            writer.close()
            return
        self._clients += 1
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), _TIMEOUT)
            request_line = head.split(b"\r\n", 1)[0].decode("latin-1")
            parts = request_line.split()
            if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
                code, body, ctype = 400, b'{"error": "bad request"}', "application/json"
                path = "-"
            elif parts[0] != "GET":
                code, body, ctype = 405, b'{"error": "only GET"}', "application/json"
                path = parts[1]
            else:
                path = parts[1].split("?", 1)[0]
                code, body, ctype = self._route(path)
            reason = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed"}
            writer.write(_response(code, reason[code], body, ctype))
            _requests.labels(path if code != 404 else "other", str(code)).inc()
            await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ConnectionError):
            log.debug("admin: dropped a malformed or slow request")
        finally:
            self._clients -= 1
            writer.close()



async def fetch(address: str, path: str, timeout: float = 5.0) -> tuple[int, bytes]:
    """Client side for the CLI: GET `path` from the admin API at `address`."""
    from meshgate.config import parse_host_port

    hp = parse_host_port(address, 15888)
    reader, writer = await asyncio.wait_for(asyncio.open_connection(hp.host, hp.port), timeout)
    try:
        writer.write(f"GET {path} HTTP/1.1\r\nHost: {hp}\r\nConnection: close\r\n\r\n".encode())
        data = await asyncio.wait_for(reader.read(), timeout)
    finally:
        writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, body
