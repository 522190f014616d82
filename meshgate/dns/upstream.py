"""Upstream resolvers: udp:// (TCP retry on TC), tcp://, tls://host#sni, https://, quic://, odoh://.

Each upstream exchanges one wire query for one wire response; validating the
response against the question is the pipeline's job (wire.parse_response).
UDP uses a fresh socket per query so the source port is random (RFC 5452).
TCP, TLS and DoQ keep a small pool of persistent connections with many
queries in flight on each (meshgate/dns/upstream_pool.py); DoH goes through
the pooled HTTP/2 client (meshgate/dns/h2client.py). Bounds:
limits.dns_upstream_max_connections, dns_upstream_max_queries,
dns_upstream_idle_timeout. Queries on encrypted transports are padded to
128-byte blocks (RFC 8467).

`UPSTREAMS` is the one registry of URL schemes: scheme -> "module:Class", an
`Upstream` subclass whose `from_url(url, rest, sni, options)` builds it
(imported when a URL with that scheme is parsed). Adding a scheme: the class
(a module of its own, or here), a line in UPSTREAMS, and the scheme in
config.UPSTREAM_SCHEMES (config validates dns.upstreams without importing
this package; tests/unit/test_dns_registry.py checks both name the same).

Upstreams the mesh routes: a plain tcp:// upstream at an address another node
owns or routes (a resolver on its virtual IP, or behind its proxy CIDR) is
reached over a mesh stream. The node hands parse_upstream a `MeshRoute`: asked
with the upstream's host each time a connection opens, it returns the connect
function to use (the node's dialer's), or None to dial directly. Only plain
TCP goes that way; TLS, DoH, DoQ and UDP upstreams are always dialled directly.
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import socket
import ssl
import struct
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from meshgate.config import LimitsConfig, parse_host_port
from meshgate.dns.kinds import load_class
from meshgate.dns.upstream_pool import (
    ConnectionPool,
    DoqConnection,
    PooledConnection,
    StreamConnection,
    UpstreamError,
    pad_query,
)
from meshgate.dns.wire import FLAG_TC
from meshgate.netfmt import host_port
from meshgate.tls import client_context

__all__ = ["UPSTREAMS", "Dial", "HttpsUpstream", "MeshRoute", "QuicUpstream", "TcpUpstream", "TlsUpstream",
           "UdpUpstream", "Upstream", "UpstreamError", "UpstreamOptions", "parse_upstream",
           "resolv_conf_upstreams"]

DOH_CONTENT_TYPE = b"application/dns-message"

# The dialer's connect: (host, port, protocol factory) -> (transport, protocol, bound address).
Dial = Callable[[str, int, Callable[[], asyncio.Protocol]],
                Awaitable[tuple[asyncio.BaseTransport, asyncio.Protocol, tuple[str, int]]]]
# An upstream host address -> how to reach it over the mesh, or None (not a mesh destination).
MeshRoute = Callable[[str], Dial | None]

UPSTREAMS: dict[str, str] = {
    "udp": "meshgate.dns.upstream:UdpUpstream",
    "tcp": "meshgate.dns.upstream:TcpUpstream",
    "tls": "meshgate.dns.upstream:TlsUpstream",
    "https": "meshgate.dns.upstream:HttpsUpstream",
    "quic": "meshgate.dns.upstream:QuicUpstream",
    "odoh": "meshgate.dns.odoh_client:OdohUpstream",
    "odoh-mesh": "meshgate.dns.mesh_odoh:MeshOdohUpstream",
}


@dataclasses.dataclass(frozen=True)
class UpstreamOptions:
    """What parse_upstream passes every upstream kind besides its URL."""

    verify: bool | str = True  # certificate checks: True (system CAs), a CA file, or False (none)
    limits: LimitsConfig = dataclasses.field(default_factory=LimitsConfig)
    route: MeshRoute | None = None  # only plain tcp:// uses it
    mesh_odoh: object = None  # odoh-mesh:// (dns/mesh_odoh.MeshOdoh): the node's, when in a mesh


def split_host_port(text: str, default_port: int) -> tuple[str, int]:
    """`host`, `host:port`, `[v6]:port` (config's parser, so a bad port is a ValueError naming it)."""
    hp = parse_host_port(text, default_port)
    return hp.host, hp.port


class Upstream:
    url: str

    @classmethod
    def from_url(cls, url: str, rest: str, sni: str, options: UpstreamOptions) -> Upstream:
        """Build one from its URL: `rest` is what follows `scheme://` up to a `#`, `sni` what
        follows the `#` (empty if none)."""
        raise NotImplementedError

    async def exchange(self, wire: bytes, timeout: float) -> bytes:
        raise NotImplementedError

    def close(self) -> None:
        """Close pooled connections (service stop)."""


class _UdpClient(asyncio.DatagramProtocol):
    def __init__(self, qid: bytes, fut: asyncio.Future[bytes]) -> None:
        self.qid = qid
        self.fut = fut

    def datagram_received(self, data: bytes, addr: tuple[str | int, ...]) -> None:
        # The socket is connected, so only the upstream's address reaches us;
        # an answer with another ID is ignored (and the pipeline checks the question).
        if data[:2] == self.qid and not self.fut.done():
            self.fut.set_result(data)

    def error_received(self, exc: Exception) -> None:
        if not self.fut.done():
            self.fut.set_exception(exc)


class UdpUpstream(Upstream):
    def __init__(self, url: str, host: str, port: int, limits: LimitsConfig | None = None) -> None:
        self.url = url
        self.host = host
        self.port = port
        self.tcp = TcpUpstream(url, host, port, None, None, limits)  # the TC retry: always direct

    @classmethod
    def from_url(cls, url: str, rest: str, sni: str, options: UpstreamOptions) -> Upstream:
        host, port = split_host_port(rest, 53)
        return cls(url, host, port, options.limits)

    async def exchange(self, wire: bytes, timeout: float) -> bytes:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[bytes] = loop.create_future()
        transport, _ = await loop.create_datagram_endpoint(
            lambda: _UdpClient(wire[:2], fut), remote_addr=(self.host, self.port)
        )
        try:
            transport.sendto(wire)
            data = await asyncio.wait_for(fut, timeout)
        finally:
            transport.close()
        if len(data) >= 4 and struct.unpack_from(">H", data, 2)[0] & FLAG_TC:
            return await self.tcp.exchange(wire, timeout)  # RFC 7766: retry over TCP
        return data

    def close(self) -> None:
        self.tcp.close()


def _pool(url: str, opener: Any, limits: LimitsConfig) -> ConnectionPool:
    return ConnectionPool(url, opener, max_connections=limits.dns_upstream_max_connections,
                          max_queries=limits.dns_upstream_max_queries,
                          idle_timeout=limits.dns_upstream_idle_timeout, connect_timeout=limits.dns_timeout)


class TcpUpstream(Upstream):
    """tcp:// and tls://: pipelined queries over a few persistent connections.

    `route` (plain TCP only): asked with the host each time a connection opens; a connect
    function it returns reaches the upstream over a mesh stream instead of directly."""

    def __init__(self, url: str, host: str, port: int, ssl_ctx: ssl.SSLContext | None,
                 sni: str | None, limits: LimitsConfig | None = None, *,
                 route: MeshRoute | None = None) -> None:
        self.url = url
        self.host = host
        self.port = port
        self.ssl_ctx = ssl_ctx
        self.sni = sni
        self.limits = limits or LimitsConfig()
        self.route = route if ssl_ctx is None else None
        self.pool = _pool(url, self._open, self.limits)

    @classmethod
    def from_url(cls, url: str, rest: str, sni: str, options: UpstreamOptions) -> Upstream:
        host, port = split_host_port(rest, 53)
        return cls(url, host, port, None, None, options.limits, route=options.route)

    async def exchange(self, wire: bytes, timeout: float) -> bytes:
        if self.ssl_ctx is not None:
            wire = pad_query(wire)
        return await self.pool.exchange(wire, timeout)

    def close(self) -> None:
        self.pool.close()

    async def _open(self) -> PooledConnection:
        max_queries = self.limits.dns_upstream_max_queries

        def factory() -> StreamConnection:
            return StreamConnection(max_queries, self.url)

        dial = self.route(self.host) if self.route is not None else None
        if dial is None:
            loop = asyncio.get_running_loop()
            _, proto = await loop.create_connection(
                factory, self.host, self.port, ssl=self.ssl_ctx,
                server_hostname=self.sni if self.ssl_ctx is not None else None,
            )
            return proto
        try:
            _, mproto, _ = await dial(self.host, self.port, factory)
        except Exception as e:  # DialError carries the SOCKS-style reason
            raise UpstreamError(f"{self.url} via the mesh: {e}") from None
        if not isinstance(mproto, StreamConnection):
            raise UpstreamError(f"{self.url} via the mesh: the dialer returned {type(mproto).__name__}")
        return mproto


class TlsUpstream(TcpUpstream):
    """tls://host[:port][#sni]: DNS over TLS (RFC 7858), never via the mesh."""

    @classmethod
    def from_url(cls, url: str, rest: str, sni: str, options: UpstreamOptions) -> Upstream:
        host, port = split_host_port(rest, 853)
        return cls(url, host, port, client_context(options.verify, ["dot"]), sni or host, options.limits)


class HttpsUpstream(Upstream):
    """DoH (RFC 8484) POSTs over the pooled HTTP/2 client; ID 0 on the wire, ours restored."""

    def __init__(self, url: str, verify: bool | str = True, limits: LimitsConfig | None = None) -> None:
        from meshgate.dns.h2client import H2Pool, client_ssl_context

        self.url = url
        parts = urlsplit(url)
        if not parts.hostname:
            raise ValueError(f"{url!r} has no host")
        self.host = parts.hostname
        self.port = parts.port or 443
        query = b"?" + parts.query.encode() if parts.query else b""
        self.path = (parts.path or "/dns-query").encode() + query
        self.verify = verify
        lim = limits or LimitsConfig()
        ctx = client_ssl_context(insecure=verify is False, cafile=verify if isinstance(verify, str) else None)
        self.pool = H2Pool(ctx, max_connections=lim.dns_upstream_max_connections,
                           max_streams=lim.dns_upstream_max_queries, max_body=65535)
        self._headers = [(b"content-type", DOH_CONTENT_TYPE), (b"accept", DOH_CONTENT_TYPE)]

    @classmethod
    def from_url(cls, url: str, rest: str, sni: str, options: UpstreamOptions) -> Upstream:
        return cls(url, options.verify, options.limits)

    async def exchange(self, wire: bytes, timeout: float) -> bytes:
        from meshgate.dns.h2client import H2ClientError

        body = b"\x00\x00" + pad_query(wire)[2:]  # RFC 8484 4.1: ID 0 (cache-friendly)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        for attempt in (0, 1):
            try:
                resp = await self.pool.request(self.host, self.port, self.host, b"POST", self.path,
                                               self._headers, body, max(deadline - loop.time(), 0.001))
                break
            except H2ClientError as e:
                if e.kind in ("http_response_timeout", "connection_timeout"):
                    raise TimeoutError(f"{self.url}: {e}") from None
                if e.kind == "connection_terminated" and attempt == 0 and loop.time() < deadline:
                    continue  # a pooled connection closed under us: once more on a fresh one
                raise UpstreamError(f"{self.url}: {e}") from None
        if resp.status != 200:
            raise UpstreamError(f"{self.url}: HTTP status {resp.status}")
        ctype = resp.header(b"content-type") or b""
        if ctype.split(b";")[0].strip().lower() != DOH_CONTENT_TYPE:
            raise UpstreamError(f"{self.url}: content-type {ctype!r}")
        if len(resp.body) < 12:
            raise UpstreamError(f"{self.url}: short answer")
        return wire[:2] + resp.body[2:]

    def close(self) -> None:
        self.pool.close()


class QuicUpstream(Upstream):
    """DoQ (RFC 9250): one QUIC connection (a few at most) carrying a stream per query."""

    def __init__(self, url: str, host: str, port: int, verify: bool | str = True,
                 sni: str | None = None, limits: LimitsConfig | None = None) -> None:
        self.url = url
        self.host = host
        self.port = port
        self.verify = verify
        self.sni = sni or host
        self.limits = limits or LimitsConfig()
        self.pool = _pool(url, self._open, self.limits)

    @classmethod
    def from_url(cls, url: str, rest: str, sni: str, options: UpstreamOptions) -> Upstream:
        host, port = split_host_port(rest, 853)
        return cls(url, host, port, options.verify, sni or None, options.limits)

    async def exchange(self, wire: bytes, timeout: float) -> bytes:
        return await self.pool.exchange(pad_query(wire), timeout)

    def close(self) -> None:
        self.pool.close()

    async def _open(self) -> PooledConnection:
        from aioquic.quic.configuration import QuicConfiguration
        from aioquic.quic.connection import QuicConnection

        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(self.host, self.port, type=socket.SOCK_DGRAM)
        if not infos:
            raise UpstreamError(f"cannot resolve {self.host}")
        family, _, _, _, addr = infos[0]
        config = QuicConfiguration(is_client=True, alpn_protocols=["doq"], server_name=self.sni)
        if self.verify is False:
            config.verify_mode = ssl.CERT_NONE
        elif isinstance(self.verify, str):
            config.load_verify_locations(self.verify)
        quic = QuicConnection(configuration=config)
        max_queries = self.limits.dns_upstream_max_queries
        sock = socket.socket(family, socket.SOCK_DGRAM)
        try:
            sock.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", 0))
            transport, proto = await loop.create_datagram_endpoint(
                lambda: DoqConnection(quic, max_queries=max_queries, name=self.url), sock=sock)
        except BaseException:
            sock.close()
            raise
        try:
            proto.connect(addr)
            await proto.wait_connected()
        except BaseException:
            proto.close()
            transport.close()
            raise
        return proto


def upstream_class(scheme: str) -> type[Upstream]:
    """The class registered for `scheme` (imported now); KeyError if none is."""
    return load_class(UPSTREAMS, scheme, Upstream)


def parse_upstream(url: str, verify: bool | str = True, limits: LimitsConfig | None = None,
                   route: MeshRoute | None = None, mesh_odoh: object = None) -> Upstream:
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise ValueError(f"{url!r} is not an upstream URL")
    if scheme not in UPSTREAMS:
        raise ValueError(f"unsupported upstream scheme {scheme!r}")
    rest, _, sni = rest.partition("#")
    options = UpstreamOptions(verify, limits or LimitsConfig(), route, mesh_odoh)
    return upstream_class(scheme).from_url(url, rest.rstrip("/"), sni, options)


def resolv_conf_upstreams(path: str = "/etc/resolv.conf") -> list[str]:
    """`nameserver` lines as udp:// URLs (used when dns.upstreams is empty)."""
    try:
        text = Path(path).read_text()
    except OSError:
        return []
    out: list[str] = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0] == "nameserver":
            addr = parts[1].split("%")[0]
            try:
                ip = ipaddress.ip_address(addr)
            except ValueError:
                continue
            out.append(f"udp://{host_port(ip, 53)}")
    return out
