"""The ODoH proxy role (RFC 9230 section 4.3): forward sealed queries, learn nothing.

The proxy sees who asks but not what. It takes a POST with the ODoH media type
and `?targethost=...&targetpath=...`, and sends the body on as a new request
over a pooled HTTP/2 connection to the target, carrying only the content type
and accept headers: nothing that identifies the client. The target's status
and body come back unmodified, with `Proxy-Status` naming this proxy.

Refused (4xx with `Proxy-Status: meshgate; error=...`): a malformed or missing
targethost/targetpath, a target outside `targets` (when that allow-list is
set), an IP literal target, or a name resolving to a loopback/private/special
address, unless `allow_ip_targets` is set. A name the operator allow-listed
may resolve to a private address (that is how loopback tests and internal
targets are configured). The vetted address is the one connected to, so the
check cannot be raced by a second DNS answer (no rebinding). Redirects are not
followed: a 3xx from the target becomes 502 (the SSRF class of routedns PR 532).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import re
import socket
from dataclasses import dataclass
from urllib.parse import parse_qs

from meshgate.config import DnsListenerConfig, LimitsConfig
from meshgate.dns import odoh
from meshgate.dns.h2client import H2ClientError, H2Pool, client_ssl_context
from meshgate.dns.h2server import current_peer
from meshgate.logs import RateLimitedLog
from meshgate.metrics import REGISTRY
from meshgate.netfmt import authority
from meshgate.policy import BUILTIN_DENY, IPAddress

log = logging.getLogger("meshgate.dns.odoh")
rlog = RateLimitedLog(log)

PROXY_NAME = "meshgate"

_requests = REGISTRY.counter(
    "meshgate_odoh_proxy_requests_total",
    "ODoH proxy requests by outcome and Proxy-Status error type (a fixed set: bounded labels)",
    ("outcome", "error"),
)
_OK = _requests.labels("forwarded", "")


def _count(outcome: str, error: str) -> None:
    _requests.labels(outcome, error).inc()

_HOST_LABEL = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")
_PATH_OK = re.compile(r"^/[!-~]*$")  # printable ASCII, no spaces or controls
MAX_TARGETPATH = 1024
RESOLVED_TTL = 30.0  # seconds a vetted target address is reused before looking the name up again


def proxy_status(error: str | None = None, details: str | None = None, received: int | None = None) -> str:
    """A `Proxy-Status` field value (RFC 9209) for this proxy."""
    out = PROXY_NAME
    if error:
        out += f"; error={error}"
    if received is not None:
        out += f"; received-status={received}"
    if details:
        safe = details.replace("\\", "\\\\").replace('"', '\\"')
        out += f'; details="{safe}"'
    return out.encode("ascii", "replace").decode("ascii")


@dataclass(frozen=True)
class ProxyReply:
    status: int
    headers: list[tuple[str, str]]
    body: bytes

    def response(self) -> tuple[int, list[tuple[str, str]], bytes]:
        """As the h2server handler returns it."""
        return (self.status, self.headers, self.body)


class ProxyRefusal(Exception):
    def __init__(self, status: int, error: str, details: str) -> None:
        super().__init__(details)
        self.status = status
        self.error = error
        self.details = details

    def reply(self) -> ProxyReply:
        return ProxyReply(
            self.status,
            [("proxy-status", proxy_status(self.error, self.details)), ("cache-control", "no-store")],
            b"",
        )


@dataclass(frozen=True)
class TargetRef:
    host: str  # lower-case name or IP literal (no brackets)
    port: int
    path: str
    ip: IPAddress | None  # set when host is an IP literal

    @property
    def authority(self) -> str:
        return authority(self.host, self.port, 443)


def parse_target(query: str) -> TargetRef:
    """`targethost`/`targetpath` from the request's query string, validated."""
    try:
        params = parse_qs(query, keep_blank_values=True, strict_parsing=False, max_num_fields=8)
    except ValueError:
        raise ProxyRefusal(400, "http_request_error", "malformed query string") from None
    hosts, paths = params.get("targethost", []), params.get("targetpath", [])
    if len(hosts) != 1 or len(paths) != 1:
        raise ProxyRefusal(400, "http_request_error", "need exactly one targethost and one targetpath")
    host_text, path = hosts[0], paths[0]
    # No query or fragment: a targetpath carrying "?targethost=..." would turn
    # the target (if it is also a proxy) into a next hop, and chains into loops.
    if not _PATH_OK.match(path) or len(path) > MAX_TARGETPATH or "#" in path or "?" in path:
        raise ProxyRefusal(400, "http_request_error", "targetpath must be an absolute path, no query")
    host, port = _split_host(host_text)
    ip: IPAddress | None
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        ip = _legacy_ipv4(host)
    if ip is None:
        labels = host.rstrip(".").split(".")
        if len(host) > 253 or not all(_HOST_LABEL.match(lb) for lb in labels):
            raise ProxyRefusal(400, "http_request_error", "targethost is not a host name")
        host = host.rstrip(".").lower()
    else:
        host = str(ip)
    return TargetRef(host, port, path, ip)


def _legacy_ipv4(host: str) -> ipaddress.IPv4Address | None:
    """`127.1`, `0x7f.1`, `2130706433`: forms getaddrinfo turns into addresses
    without a lookup. They are IP literals and get the IP-literal rule."""
    try:
        return ipaddress.IPv4Address(socket.inet_aton(host))
    except OSError:
        return None


def _split_host(text: str) -> tuple[str, int]:
    host, port_text = text, None
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            raise ProxyRefusal(400, "http_request_error", "unclosed '[' in targethost")
        host, rest = text[1:end], text[end + 1 :]
        if rest and not rest.startswith(":"):
            raise ProxyRefusal(400, "http_request_error", "garbage after ']' in targethost")
        port_text = rest[1:] if rest else None
    elif text.count(":") == 1:
        host, port_text = text.split(":")
    if not host:
        raise ProxyRefusal(400, "http_request_error", "empty targethost")
    if port_text is None:
        return host, 443
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ProxyRefusal(400, "http_request_error", "bad port in targethost")
    return host, int(port_text)


class OdohProxy:
    def __init__(self, cfg: DnsListenerConfig, limits: LimitsConfig) -> None:
        self.allow_ip_targets = cfg.allow_ip_targets
        self.allowed = {t.lower().rstrip(".") for t in cfg.targets}
        self.timeout = limits.odoh_proxy_timeout
        # Vetted addresses of target names: getaddrinfo runs in a thread and
        # cost more CPU per query than the forwarding itself. As many entries
        # as pooled connections (one target per connection at most).
        self._resolved: dict[tuple[str, int], tuple[str, float]] = {}
        self.max_resolved = limits.odoh_proxy_max_connections
        self.pool = H2Pool(
            client_ssl_context(),
            max_connections=limits.odoh_proxy_max_connections,
            max_streams=limits.doh_max_streams,
            max_body=odoh.MAX_MESSAGE_LEN,
        )
        # What the proxy received and sent on, for tests that check it never
        # saw a query in clear; off unless a test turns it on.
        self.debug_capture: list[bytes] | None = None

    def _listed(self, t: TargetRef) -> bool:
        if not self.allowed:
            return False
        return t.authority.lower() in self.allowed or (t.port == 443 and t.host in self.allowed)

    def check(self, t: TargetRef) -> None:
        """Allow-list and IP-literal rules (before any lookup). A target the
        operator listed by name or address is allowed as listed."""
        if self._listed(t):
            return
        if t.ip is not None and not self.allow_ip_targets:
            raise ProxyRefusal(403, "destination_ip_prohibited", "IP literal targets are not allowed")
        if self.allowed:
            raise ProxyRefusal(403, "http_request_denied", "target is not in this proxy's allow-list")

    async def _address(self, t: TargetRef) -> str:
        if t.ip is not None:
            return str(t.ip)
        loop = asyncio.get_running_loop()
        key = (t.host, t.port)
        hit = self._resolved.get(key)
        if hit is not None and hit[1] > loop.time():
            return hit[0]
        addr = await self._lookup(t)
        if len(self._resolved) >= self.max_resolved:
            self._resolved.clear()  # bounded: forget everything rather than grow
        self._resolved[key] = (addr, loop.time() + RESOLVED_TTL)
        return addr

    async def _lookup(self, t: TargetRef) -> str:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.timeout):
                infos = await loop.getaddrinfo(t.host, t.port, type=socket.SOCK_STREAM)
        except (OSError, TimeoutError):
            raise ProxyRefusal(502, "dns_error", "target name does not resolve") from None
        if not infos:
            raise ProxyRefusal(502, "dns_error", "target name does not resolve")
        vetted = self.allow_ip_targets or self._listed(t)
        for info in infos:
            addr = ipaddress.ip_address(str(info[4][0]).split("%")[0])
            if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
                addr = addr.ipv4_mapped
            if vetted or not any(addr in n for n in BUILTIN_DENY if n.version == addr.version):
                return str(addr)
        raise ProxyRefusal(403, "destination_ip_prohibited", "target resolves to a private address")

    async def forward(self, method: str, content_type: str | None, query: str, body: bytes) -> ProxyReply:
        """One proxied request, from what the HTTP layer parsed to what it answers."""
        try:
            if method != "POST":
                raise ProxyRefusal(405, "http_request_error", "the proxy takes POST only")
            if content_type != odoh.MEDIA_TYPE:
                raise ProxyRefusal(415, "http_request_error", f"content-type must be {odoh.MEDIA_TYPE}")
            if len(body) > odoh.MAX_MESSAGE_LEN:
                raise ProxyRefusal(413, "http_request_error", "body too large")
            target = parse_target(query)
            self.check(target)
            addr = await self._address(target)
        except ProxyRefusal as e:
            _count("refused", e.error)
            peer = current_peer.get()
            rlog.debug(f"refused:{e.error}:{peer}", "odoh proxy: refused a request from %s: %s",
                       peer, e.details)
            reply = e.reply()
            if e.status == 405:
                reply.headers.append(("allow", "POST"))
            return reply
        if self.debug_capture is not None:
            self.debug_capture.append(body)
        headers = [(b"content-type", odoh.MEDIA_TYPE.encode()), (b"accept", odoh.MEDIA_TYPE.encode())]
        try:
            resp = await self.pool.request(
                addr, target.port, target.host, b"POST", target.path.encode(), headers, body, self.timeout
            )
        except H2ClientError as e:
            _count("target_error", e.kind)
            rlog.debug(f"target:{target.authority}", "odoh proxy: target %s failed: %s", target.authority, e)
            return ProxyReply(502, [("proxy-status", proxy_status(e.kind, str(e)))], b"")
        if 300 <= resp.status < 400:
            _count("target_error", "redirect")
            rlog.debug(f"redirect:{target.authority}", "odoh proxy: target %s redirected; not followed",
                       target.authority)
            return ProxyReply(
                502,
                [("proxy-status", proxy_status("http_protocol_error", "redirect not followed",
                                               received=resp.status))],
                b"",
            )
        _OK.inc()
        out = [("proxy-status", proxy_status(received=resp.status))]
        ctype = resp.header(b"content-type")
        if ctype is not None:
            out.append(("content-type", ctype.decode("latin-1")))
        out.append(("cache-control", "no-store"))
        return ProxyReply(resp.status, out, resp.body)

    def close(self) -> None:
        self.pool.close()
