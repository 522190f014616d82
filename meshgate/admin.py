"""Admin API: a tiny HTTP/1.1 JSON server on 127.0.0.1 (config `[admin] listen`).

GET /status, /peers, /routes, /metrics, /dns/log?since=N (`[dns.query_log]`'s entries newer
than N; with the log off `{"enabled": false, "entries": []}`), /config (the effective config,
secrets masked: redact.py), /console/stats (console/stats.py); POST /reload (re-read the config
file, apply what can change live: docs/OPERATIONS.md). GET / is the web console (console/: one
page, its script and style sheet). One request per connection keeps it simple; the CLI, health
checks and the console are the clients. Every answer carries console.SECURITY_HEADERS (CSP
'self', nosniff, no-store).

Who may ask (`check_request`, pure):
- The Host header must be an IP literal, `localhost` or one of `admin.hosts`;
  any other name is 403. A web page the user opens cannot read the API by
  pointing a name it controls at 127.0.0.1 (DNS rebinding): its requests
  carry that name as Host.
- With `admin.token` set, a request off loopback needs
  `Authorization: Bearer TOKEN` (401 without it). An API listening off
  loopback with a token requires it of every request but the console's
  static files (`PUBLIC`: they hold no data; the page then asks for the token);
  with none, start-up warns (config.warnings).
- A request that changes state (`CHANGING`: POST /reload) needs the token whenever one is
  configured, from loopback too; with no token it is allowed only on an API that listens on
  loopback (403 off loopback). Any other method on it is 405.
- At most `limits.admin_max_clients` connections, and at most
  `limits.admin_max_clients_per_source` from one address.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from meshgate import console
from meshgate.config import Config, parse_host_port
from meshgate.errors import bind_error
from meshgate.metrics import REGISTRY
from meshgate.netfmt import host_port, is_loopback

if TYPE_CHECKING:  # a node without the mesh does not load it
    from meshgate.mesh.service import MeshService

log = logging.getLogger("meshgate.admin")

_MAX_REQUEST = 8192  # request head bytes; a longer one is dropped (LimitOverrunError)
_TIMEOUT = 5.0
_requests = REGISTRY.counter("meshgate_admin_requests_total", "Admin API requests", ("path", "code"))
_refused = REGISTRY.counter(
    "meshgate_admin_connections_refused_total", "Admin API connections closed at once", ("reason",)
)
_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 403: "Forbidden", 404: "Not Found",
            405: "Method Not Allowed"}


def _host_name(value: str) -> str:
    """The host part of a Host header (`[::1]:15888` -> `::1`, `Name:80` -> `name`)."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:].split("]", 1)[0]
    if value.count(":") == 1:
        value = value.split(":", 1)[0]
    return value.rstrip(".")


def host_allowed(host: str | None, names: tuple[str, ...]) -> bool:
    """An absent Host (HTTP/1.0 tools), an IP literal, localhost or a configured name."""
    if host is None:
        return True
    name = _host_name(host)
    if name == "localhost" or name in names:
        return True
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


CHANGING = frozenset({"/reload"})  # POST only: they change the node's state
PUBLIC = frozenset(console.ASSETS)  # GET without the token (the Host check still applies)


def check_request(
    head: bytes, names: tuple[str, ...], token: str, need_token: bool, api_on_loopback: bool = True
) -> tuple[int, str]:
    """(status, path) for a request head: 400/405 for bad requests, 403 for a foreign Host,
    401 without the token where one is needed; else (0, path) to route it. `need_token` is
    the read-only rule (off loopback); a CHANGING path needs the token whenever there is one,
    and with none is 403 unless the API listens on loopback."""
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split()
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        return 400, "-"
    path = parts[1].split("?", 1)[0]
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if sep:
            headers.setdefault(name.strip().lower(), value.strip())
    if not host_allowed(headers.get("host"), names):
        return 403, path
    changing = path in CHANGING
    if changing:
        if not token and not api_on_loopback:
            return 403, path
        need_token = need_token or bool(token)
    if need_token and path not in PUBLIC:
        given = headers.get("authorization", "")
        want = f"Bearer {token}"
        if not hmac.compare_digest(given.encode("latin-1"), want.encode("latin-1")):
            return 401, path
    if parts[0] != ("POST" if changing else "GET"):
        return 405, path
    return 0, path


_SECURITY = "".join(f"{name}: {value}\r\n" for name, value in console.SECURITY_HEADERS)


def _response(code: int, reason: str, body: bytes, ctype: str) -> bytes:
    head = (
        f"HTTP/1.1 {code} {reason}\r\nContent-Type: {ctype}\r\n"
        f"Content-Length: {len(body)}\r\n{_SECURITY}Connection: close\r\n\r\n"
    )
    return head.encode() + body


class AdminService:
    name = "admin"

    def __init__(
        self,
        config: Config,
        node_status: Callable[[], dict[str, Any]],
        mesh: MeshService | None,
        reload: Callable[[], dict[str, Any]] | None = None,
        dns_log: Callable[[int], dict[str, Any]] | None = None,
        current_config: Callable[[], Config] | None = None,
    ) -> None:
        self.config = config
        # GET /config: the node's config now (a reload replaces it), else the one started with
        self.current_config = current_config or (lambda: config)
        self.node_status = node_status
        self.reload = reload  # POST /reload: the node's reload, its answer as JSON
        self.dns_log = dns_log  # GET /dns/log?since=N: the node's [dns.query_log] as JSON
        self.mesh = mesh
        self.server: asyncio.Server | None = None
        self._clients = 0
        self._per_source: dict[str, int] = {}
        cfg = config.admin
        self._everyone_needs_token = bool(cfg.token) and not is_loopback(cfg.listen.host)

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

    def _route(self, path: str, query: str = "") -> tuple[int, bytes, str]:
        mesh = self.mesh
        page = console.asset(path)
        if page is not None:
            return 200, page[0], page[1]
        if path == "/config":
            from meshgate.redact import masked_config

            return 200, json.dumps(masked_config(self.current_config())).encode(), "application/json"
        if path == "/console/stats":
            from meshgate.console.stats import console_stats

            dns = self.node_status().get("services", {}).get("dns")
            upstreams = list(dns.get("upstreams", [])) if isinstance(dns, dict) else None
            got = console_stats(mesh, upstreams, bool(self.config.admin.token))
            return 200, json.dumps(got).encode(), "application/json"
        if path == "/dns/log":
            since = _since(query)
            if since is None:
                return 400, b'{"error": "since: expected a whole number"}', "application/json"
            got = (self.dns_log(since) if self.dns_log is not None
                   else {"enabled": False, "size": 0, "last": 0, "entries": []})
            return 200, json.dumps(got).encode(), "application/json"
        if path == "/status":
            return 200, json.dumps(self.node_status()).encode(), "application/json"
        if path == "/reload" and self.reload is not None:
            return 200, json.dumps(self.reload()).encode(), "application/json"
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
        limits = self.config.limits
        peer = writer.get_extra_info("peername")
        source = str(peer[0]) if isinstance(peer, tuple) else "?"
        if self._clients >= limits.admin_max_clients:
            _refused.labels("max_clients").inc()
            writer.close()
            return
        if self._per_source.get(source, 0) >= limits.admin_max_clients_per_source:
            _refused.labels("per_source").inc()
            log.debug("admin: refusing %s: admin_max_clients_per_source reached", source)
            writer.close()
            return
        self._clients += 1
        self._per_source[source] = self._per_source.get(source, 0) + 1
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), _TIMEOUT)
            token = self.config.admin.token
            need = bool(token) and (self._everyone_needs_token or not is_loopback(source))
            code, path = check_request(head, self.config.admin.hosts, token, need,
                                       is_loopback(self.config.admin.listen.host))
            if code == 0:
                code, body, ctype = self._route(path, _query_string(head))
            else:
                body, ctype = json.dumps({"error": _REASONS[code].lower()}).encode(), "application/json"
                if code in (401, 403):
                    log.debug("admin: %d for %s (%s)", code, source, path)
            writer.write(_response(code, _REASONS[code], body, ctype))
            _requests.labels(path if code not in (400, 404) else "other", str(code)).inc()
            await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ConnectionError):
            log.debug("admin: dropped a malformed or slow request from %s", source)
        finally:
            self._clients -= 1
            left = self._per_source[source] - 1
            if left:
                self._per_source[source] = left
            else:
                del self._per_source[source]
            writer.close()


def _query_string(head: bytes) -> str:
    """The request target's `?...` part (check_request has vetted the request line)."""
    target = head.split(b"\r\n", 1)[0].split(b" ")[1].decode("latin-1")
    return target.partition("?")[2]


def _since(query: str) -> int | None:
    """`since=N` from a query string (0 without it); None when N is not a whole number >= 0."""
    for part in query.split("&"):
        name, _, value = part.partition("=")
        if name == "since":
            return int(value) if value.isdigit() and len(value) <= 20 else None
    return 0


async def fetch(
    address: str, path: str, timeout: float = 5.0, token: str = "", method: str = "GET"
) -> tuple[int, bytes]:
    """Client side for the CLI: GET (or POST, with no body) `path` from the admin API at `address`."""
    hp = parse_host_port(address, 15888)
    reader, writer = await asyncio.wait_for(asyncio.open_connection(hp.host, hp.port), timeout)
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    try:
        length = "Content-Length: 0\r\n" if method == "POST" else ""
        writer.write(f"{method} {path} HTTP/1.1\r\nHost: {hp}\r\n{auth}{length}Connection: close\r\n\r\n"
                     .encode())
        data = await asyncio.wait_for(reader.read(), timeout)
    finally:
        writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, body
