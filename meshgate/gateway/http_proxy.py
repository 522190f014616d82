"""The HTTP proxy on the portal: CONNECT, plain HTTP forwarding and a PAC file, as the node
service "http_proxy", handed the node's one dialer (the same as the SOCKS5 portal's).

- `CONNECT host:port` dials through the dialer (mesh names, virtual IPs, proxy CIDRs, exits,
  names resolved where traffic leaves), answers `200 Connection established` and relays.
- An absolute-form request (`GET http://host/path HTTP/1.1`) is rewritten to origin-form with
  hop-by-hop headers dropped and `Connection: close`, sent on a fresh upstream connection, and
  the two sides are relayed raw: one request per upstream connection, the client connection
  ends when the origin's does (keep-alive towards the client is not kept).
- `GET /proxy.pac` (origin-form, to the proxy itself) answers a PAC file made from the live
  routes at that moment: the mesh's virtual IPs, proxy CIDRs as advertised and the mesh zone
  go to this listener, the rest DIRECT; everything through it when mesh.exit_nodes is set. It
  follows a reload (proxy CIDRs, exit_nodes, dns.records: the node's current config).

Auth is `Proxy-Authorization: Basic` against `[socks5] users` (407 when required and missing
or wrong). A dial failure's SOCKS reply code picks the status: not allowed 403, TTL expired /
timeout 504, the rest 502. Connection admission (socks5.max_clients and
limits.socks5_max_clients_per_source, counted per listener), the handshake and idle timeouts
and the relay with back-pressure are the SOCKS5 portal's own (gateway/server.py's
ClientProtocol, subclassed here with an HTTP handshake).
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
from collections.abc import Callable, Iterable
from typing import Any

from meshgate import replies
from meshgate.buffers import BufferPool
from meshgate.config import Config, HostPort, IPNetwork, User
from meshgate.egress.dialer import Dialer, DialError
from meshgate.gateway import http1
from meshgate.gateway.server import (
    _CLOSED,
    _CONNECTING,
    _HANDSHAKE,
    _RELAY,
    ClientProtocol,
    Socks5Server,
    UpstreamProtocol,
    peer_text,
)
from meshgate.gateway.service import PortalService
from meshgate.logs import RateLimitedLog
from meshgate.metrics import REGISTRY
from meshgate.netfmt import host_port

log = logging.getLogger("meshgate.gateway.http_proxy")
rlog = RateLimitedLog(log)

Routes = Callable[[], list[dict[str, Any]]]

CLIENTS = REGISTRY.gauge("meshgate_http_proxy_clients", "HTTP proxy client connections open now")
ACCEPTED = REGISTRY.counter("meshgate_http_proxy_clients_total", "HTTP proxy client connections accepted")
REFUSED = REGISTRY.counter(
    "meshgate_http_proxy_clients_refused_total",
    "HTTP proxy connections closed at once: socks5.max_clients reached",
)
REFUSED_PER_SOURCE = REGISTRY.counter(
    "meshgate_http_proxy_clients_refused_per_source_total",
    "HTTP proxy connections closed at once: limits.socks5_max_clients_per_source reached for their address",
)
REQUESTS = REGISTRY.counter(
    "meshgate_http_proxy_requests_total", "HTTP proxy requests answered, by kind and status",
    ("kind", "status"),
)
BYTES = REGISTRY.counter(
    "meshgate_http_proxy_bytes_total", "Bytes relayed: in = from clients, out = to clients", ("direction",)
)
AUTH_FAILURES = REGISTRY.counter(
    "meshgate_http_proxy_auth_failures_total",
    "Requests without valid Proxy-Authorization where it is required",
)
BAD_REQUESTS = REGISTRY.counter(
    "meshgate_http_proxy_bad_requests_total", "Malformed or oversized HTTP proxy requests", ("kind",)
)
TIMEOUTS = REGISTRY.counter(
    "meshgate_http_proxy_timeouts_total", "HTTP proxy connections timed out", ("phase",)
)

PAC_TYPE = "application/x-ns-proxy-autoconfig"
PAC_PATH = "/proxy.pac"


def status_for(code: int) -> int:
    """The HTTP status for a dial failure's SOCKS reply code."""
    if code == replies.NOT_ALLOWED:
        return 403
    if code == replies.TTL_EXPIRED:
        return 504
    return 502


def build_pac(proxy: str, zone: str, networks: Iterable[IPNetwork], names: Iterable[str] = (),
              everything: bool = False) -> str:
    """A PAC file: `proxy` (host:port) for the zone, `names` and `networks`, DIRECT for the rest."""
    zone = zone.rstrip(".").lower()
    lines = [
        "// meshgate: generated from the node's live routes; fetch again when the mesh changes",
        "function FindProxyForURL(url, host) {",
        f'  var mesh = "PROXY {proxy}";',
    ]
    if everything:
        lines += ["  return mesh;  // mesh.exit_nodes is set: the internet leaves through the mesh too",
                  "}", ""]
        return "\n".join(lines)
    lines.append("  host = host.toLowerCase();")
    if zone:
        lines.append(f'  if (dnsDomainIs(host, ".{zone}") || host == "{zone}") return mesh;')
    for name in sorted({n.rstrip(".").lower() for n in names}):
        lines.append(f'  if (host == "{name}") return mesh;')
    nets = list(networks)
    v4 = list(ipaddress.collapse_addresses(n for n in nets if isinstance(n, ipaddress.IPv4Network)))
    v6 = list(ipaddress.collapse_addresses(n for n in nets if isinstance(n, ipaddress.IPv6Network)))
    if v4:
        # isInNet resolves a name: test address literals only, names are decided above
        lines.append("  if (/^[0-9]+\\.[0-9]+\\.[0-9]+\\.[0-9]+$/.test(host)) {")
        for n in v4:
            lines.append(f'    if (isInNet(host, "{n.network_address}", "{n.netmask}")) return mesh;')
        lines.append("  }")
    if v6:
        lines.append('  if (host.indexOf(":") >= 0 && typeof isInNetEx == "function") {')
        lines.append('    var ip = host.replace(/^\\[|\\]$/g, "");')
        for n6 in v6:
            lines.append(f'    if (isInNetEx(ip, "{n6}")) return mesh;')
        lines.append("  }")
    lines += ['  return "DIRECT";', "}", ""]
    return "\n".join(lines)


def pac_networks(config: Config, routes: Routes | None) -> list[IPNetwork]:
    """The mesh's own subnets, this node's advertised proxy CIDRs and, from the live routes,
    every node's virtual IPs and advertised proxy CIDRs."""
    out: list[IPNetwork] = []
    node = config.node
    for iface in (node.ipv4, node.ipv6):
        if iface is not None:
            out.append(iface.network)
    out.extend(c.advertised for c in config.mesh.proxy_cidrs)
    for route in routes() if routes is not None else ():
        for key in ("ipv4", "ipv6"):
            if route.get(key):
                out.append(ipaddress.ip_network(route[key]))
        out.extend(ipaddress.ip_network(c) for c in route.get("proxy_cidrs") or ())
    return out


class HttpProxyServer(Socks5Server):
    """The SOCKS5 server's listener, admission and relay with an HTTP handshake."""

    def __init__(self, config: Config, dialer: Dialer, pac: Callable[[str], str]) -> None:
        # the pool serves SOCKS UDP only, which an HTTP proxy never does: an empty one
        super().__init__(config, dialer, BufferPool(capacity=1, headroom=0, max_free=0))
        self.udp_enabled = False
        self.auth_required = config.http_proxy.auth and bool(self.users)
        self.pac = pac

    def set_users(self, users: tuple[User, ...]) -> None:
        super().set_users(users)
        self.auth_required = self.config.http_proxy.auth and bool(self.users)

    def make_client(self) -> ClientProtocol:
        return HttpClient(self)


class HttpClient(ClientProtocol):
    """One HTTP proxy client connection: request head, then a dial and the shared relay."""

    splice_bulk = False  # plain forwarding reads what passes; CONNECT stays in Python too

    kind = "http_proxy"
    m_clients = CLIENTS.labels()
    m_accepted = ACCEPTED.labels()
    m_refused = REFUSED.labels()
    m_refused_per_source = REFUSED_PER_SOURCE.labels()
    m_handshake_timeouts = TIMEOUTS.labels("handshake")
    m_idle_timeouts = TIMEOUTS.labels("idle")
    m_bytes_in = BYTES.labels("in")
    m_bytes_out = BYTES.labels("out")

    def __init__(self, server: HttpProxyServer) -> None:
        super().__init__(server)
        self.http = server
        self._buf = bytearray()
        # a forwarded request: the body bytes still to send its origin (Content-Length, else 0);
        # None relays what comes (a CONNECT tunnel, a chunked body)
        self._body_left: int | None = None
        self._dial_kind = "connect"  # the REQUESTS kind of the dial under way: connect, forward

    def data_received(self, data: bytes) -> None:
        if self.state == _HANDSHAKE:
            self._buf += data
            self._parse()
        elif self.state == _CONNECTING:
            self._buf += data  # a read delivered while dialing: sent behind the request
            self.hold_while_dialing()
        elif self.state != _RELAY or (n := self._to_origin(len(data))) == len(data):
            super().data_received(data)
        elif n:
            super().data_received(data[:n])

    def buffer_updated(self, nbytes: int) -> None:
        if self._body_left is None or self.state != _RELAY:
            super().buffer_updated(nbytes)
        elif n := self._to_origin(nbytes):
            super().buffer_updated(n)  # the first n bytes of the read buffer

    def _to_origin(self, n: int) -> int:
        """How many of `n` bytes read from a relaying client go on to the origin. Past a forwarded
        request's end they are a next request on this connection, which is never sent to this
        request's origin, whatever host it names. A client reuses a connection whose answer did
        not say close (an origin that ignores our `Connection: close`): the connection closes
        and the client sends it again on a new one. Bytes pipelined behind a body are dropped."""
        left = self._body_left
        if left is None or n <= left:
            if left is not None:
                self._body_left = left - n
            return n
        self._body_left = 0
        BAD_REQUESTS.labels("request_after_forward").inc()
        rlog.debug("http_proxy:next", "http_proxy: %s sent a request behind a forwarded one; not sent",
                   peer_text(self.peer))
        if not left:
            self.close()
        return left

    # ----------------------------------------------------------------- the request

    def _parse(self) -> None:
        try:
            got = http1.parse_head(self._buf)
            if got is None:
                return
            head, rest = got
            self._buf = bytearray(rest)
            self._head(head)
        except http1.HttpError as e:
            BAD_REQUESTS.labels(e.kind).inc()
            rlog.debug(f"http_proxy:bad:{e.kind}", "http_proxy: %s from %s", e, peer_text(self.peer))
            self._respond("invalid", e.status, f"{e}\n")

    def _head(self, head: http1.Head) -> None:
        if head.method == "CONNECT":
            host, port = http1.connect_target(head.target)
            if self._authorized(head):
                self._dial("connect", host, port, b"HTTP/1.1 200 Connection established\r\n\r\n", b"")
            return
        if head.target.startswith("/"):
            path = head.target.split("?", 1)[0]
            if path == PAC_PATH and head.method in ("GET", "HEAD"):
                self._serve_pac(head.method == "HEAD")
            elif path == PAC_PATH:
                self._respond("pac", 405, "GET /proxy.pac\n", (("Allow", "GET, HEAD"),))
            else:
                self._respond("origin", 404, f"this is an HTTP proxy; its PAC file is at {PAC_PATH}\n")
            return
        host, port, path = http1.absolute_target(head.target)
        if self._authorized(head):
            self._body_left = http1.body_length(head)
            self._dial("forward", host, port, b"", http1.forward_head(head, host, port, path))

    def _authorized(self, head: http1.Head) -> bool:
        if not self.http.auth_required:
            return True
        cred = http1.basic_credentials(head.get(b"proxy-authorization"))
        ok = False
        if cred is not None:
            user, password = cred
            expected = self.server.users.get(user)
            # constant time in the password; an unknown user compares against itself and fails
            same = hmac.compare_digest(password, expected if expected is not None else password)
            ok = same and expected is not None
        if not ok:
            AUTH_FAILURES.inc()
            rlog.debug("http_proxy:auth", "http_proxy: %s credentials from %s",
                       "wrong" if cred else "no", peer_text(self.peer))
            self._respond("auth", 407, "proxy authentication required\n",
                          (("Proxy-Authenticate", 'Basic realm="meshgate"'),))
        return ok

    def _serve_pac(self, head_only: bool) -> None:
        assert self.transport is not None
        sock = self.transport.get_extra_info("sockname")
        proxy = host_port(sock[0], sock[1]) if sock else "127.0.0.1:8080"
        try:
            body = self.http.pac(proxy).encode()
        except Exception as e:  # never a traceback to the client
            log.warning("http_proxy: cannot build the PAC file: %r", e)
            self._respond("pac", 500, "cannot build the PAC file\n")
            return
        REQUESTS.labels("pac", "200").inc()
        hdrs = (("Content-Type", PAC_TYPE), ("Cache-Control", "max-age=60"))
        out = http1.response(200, hdrs, body)
        if head_only:
            out = out[: len(out) - len(body)]
        self.transport.write(out)
        self.state = _CLOSED
        self.transport.close()

    def _respond(self, kind: str, status: int, text: str, headers: tuple[tuple[str, str], ...] = ()) -> None:
        REQUESTS.labels(kind, str(status)).inc()
        self.state = _CLOSED
        t = self.transport
        if t is None or t.is_closing():
            return
        t.write(http1.response(status, (("Content-Type", "text/plain"), *headers), text.encode()))
        t.close()

    # ----------------------------------------------------------------- dial and relay

    def _dial(self, kind: str, host: str, port: int, reply: bytes, prefix: bytes) -> None:
        assert self.transport is not None
        self.state = _CONNECTING  # a body behind the head: hold_while_dialing
        self._dial_kind = kind
        self.start_dial(host, port, self._connect_http(kind, host, port, reply, prefix))

    def dial_failed(self, e: DialError) -> None:
        where = host_port(*self._dialing) if self._dialing else "?"
        rlog.debug(f"http_proxy:dial:{e.reply}", "http_proxy: %s to %s for %s", e, where,
                   peer_text(self.peer))
        if self.state == _CONNECTING:
            self._respond(self._dial_kind, status_for(e.reply), f"{where}: {e}\n")

    async def _connect_http(self, kind: str, host: str, port: int, reply: bytes, prefix: bytes) -> None:
        try:
            transport, _, _ = await self.server.dialer.dial(host, port, lambda: UpstreamProtocol(self))
        except DialError as e:
            self.dial_failed(e)
            return
        except Exception as e:  # never a traceback to the client; answer and log
            log.warning("http_proxy: unexpected error connecting to %s: %r", host_port(host, port), e)
            if self.state == _CONNECTING:
                self._respond(kind, 502, "general failure\n")
            return
        finally:
            self._connect_task = None
            self._dialing = None
        if self.state != _CONNECTING:  # the client left while we dialed
            transport.close()
            return
        REQUESTS.labels(kind, "200").inc()
        early, self._buf = bytes(self._buf), bytearray()
        if self._body_left is not None and len(early) > self._body_left:
            # a request pipelined behind the forwarded one: never sent to this origin
            early = early[: self._body_left]
            BAD_REQUESTS.labels("request_after_forward").inc()
        if self._body_left is not None:
            self._body_left -= len(early)
        self.begin_relay(transport, reply, prefix + early)


class HttpProxyService(PortalService):
    name = "http_proxy"
    listen_key = "http_proxy.listen"

    def __init__(self, config: Config, dialer: Dialer, routes: Routes | None = None,
                 current: Callable[[], Config] | None = None) -> None:
        super().__init__(config, dialer)
        self.routes = routes
        # the node's config now (a reload replaces it): the PAC file is made from it
        self.current = current or (lambda: self.config)

    def listen_address(self) -> HostPort:
        return self.config.http_proxy.listen

    def make_server(self) -> HttpProxyServer:
        return HttpProxyServer(self.config, self.dialer, self.pac)

    def pac(self, proxy: str) -> str:
        cfg = self.current()
        return build_pac(proxy, cfg.dns.zone, pac_networks(cfg, self.routes),
                         names=(name for name, _ in cfg.dns.records),
                         everything=bool(cfg.mesh.exit_nodes))

    def status(self) -> dict[str, Any]:
        addr = self.address
        auth = isinstance(self.server, HttpProxyServer) and self.server.auth_required
        out: dict[str, Any] = {
            "listen": str(addr) if addr else None,
            "clients": len(self.server.clients) if self.server else 0,
            "max_clients": self.config.socks5.max_clients,
            "auth": "basic" if auth else "none",
        }
        if addr is not None:
            out["notes"] = [
                f"browser: HTTP proxy {addr.host}:{addr.port}, or PAC http://{addr}{PAC_PATH}",
                f"try: curl -x http://{addr} http://example.com/",
            ]
        return out
