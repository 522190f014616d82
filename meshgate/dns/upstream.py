"""Upstream resolvers: udp:// (TCP retry on TC), tcp://, tls://host#sni, https://, quic://.

Each upstream exchanges one wire query for one wire response; validating the
response against the question is the pipeline's job (wire.parse_response).
UDP uses a fresh socket per query so the source port is random (RFC 5452);
TCP and TLS open one connection per query. DoH and DoQ go through dnspython.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import ssl
import struct
from pathlib import Path
from typing import Any

from meshgate.dns.wire import FLAG_TC


class UpstreamError(Exception):
    pass


def _split_host_port(text: str, default_port: int) -> tuple[str, int]:
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        return host, int(rest[1:]) if rest.startswith(":") else default_port
    if text.count(":") == 1:
        host, port = text.split(":")
        return host, int(port)
    return text, default_port


class Upstream:
    url: str

    async def exchange(self, wire: bytes, timeout: float) -> bytes:
        raise NotImplementedError


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
    def __init__(self, url: str, host: str, port: int) -> None:
        self.url = url
        self.host = host
        self.port = port
        self.tcp = TcpUpstream(url, host, port, None, None)

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


class TcpUpstream(Upstream):
    def __init__(self, url: str, host: str, port: int, ssl_ctx: ssl.SSLContext | None,
                 sni: str | None) -> None:
        self.url = url
        self.host = host
        self.port = port
        self.ssl_ctx = ssl_ctx
        self.sni = sni
        # Set by the node when it is in a mesh: a plain-TCP upstream at an address
        # the mesh routes (a resolver on another node's virtual IP or behind its
        # proxy CIDR) is reached over a mesh stream through the node's dialer.
        self.node: Any = None

    async def exchange(self, wire: bytes, timeout: float) -> bytes:
        return await asyncio.wait_for(self._exchange(wire), timeout)

    def _via_mesh(self) -> Any:
        node = self.node
        if node is None or node.mesh is None or node.dialer is None or self.ssl_ctx is not None:
            return None
        try:
            route = node.mesh.lookup(ipaddress.ip_address(self.host))
        except ValueError:
            return None
        return node.dialer if route is not None else None

    async def _open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        dialer = self._via_mesh()
        if dialer is None:
            return await asyncio.open_connection(
                self.host, self.port, ssl=self.ssl_ctx,
                server_hostname=self.sni if self.ssl_ctx is not None else None,
            )
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(loop=loop)
        try:
            transport, protocol, _ = await dialer.connect(
                self.host, self.port, lambda: asyncio.StreamReaderProtocol(reader, loop=loop)
            )
        except Exception as e:  # DialError carries the SOCKS-style reason
            raise UpstreamError(f"{self.url} via the mesh: {e}") from None
        return reader, asyncio.StreamWriter(transport, protocol, reader, loop)

    async def _exchange(self, wire: bytes) -> bytes:
        reader, writer = await self._open()
        try:
            writer.write(len(wire).to_bytes(2, "big") + wire)
            while True:
                n = int.from_bytes(await reader.readexactly(2), "big")
                data = await reader.readexactly(n)
                if data[:2] == wire[:2]:
                    return data
        except asyncio.IncompleteReadError:
            raise UpstreamError(f"{self.url} closed the connection") from None
        finally:
            writer.close()


class HttpsUpstream(Upstream):
    def __init__(self, url: str, verify: bool | str = True) -> None:
        self.url = url
        self.verify = verify

    async def exchange(self, wire: bytes, timeout: float) -> bytes:
        import dns.asyncquery
        import dns.message

        q = dns.message.from_wire(wire)
        r = await dns.asyncquery.https(q, self.url, timeout=timeout, verify=self.verify)
        return r.to_wire()


class QuicUpstream(Upstream):
    def __init__(self, url: str, host: str, port: int, verify: bool | str = True,
                 sni: str | None = None) -> None:
        self.url = url
        self.host = host
        self.port = port
        self.verify = verify
        self.sni = sni or host

    async def exchange(self, wire: bytes, timeout: float) -> bytes:
        import dns.asyncquery
        import dns.message

        addr = await _address(self.host, self.port)
        q = dns.message.from_wire(wire)
        qid = q.id
        r = await dns.asyncquery.quic(q, addr, timeout=timeout, port=self.port,
                                      server_hostname=self.sni, verify=self.verify)
        r.id = qid  # DoQ sends ID 0 on the wire (RFC 9250; dnspython zeroes q.id): restore ours
        return r.to_wire()


async def _address(host: str, port: int) -> str:
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    if not infos:
        raise UpstreamError(f"cannot resolve {host}")
    return str(infos[0][4][0])


def parse_upstream(url: str, verify: bool | str = True) -> Upstream:
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise ValueError(f"{url!r} is not an upstream URL")
    if scheme == "https":
        return HttpsUpstream(url, verify)
    if scheme == "odoh":
        from meshgate.dns.odoh_client import OdohUpstream  # imports this module: load late

        return OdohUpstream(url, verify)
    rest, _, sni = rest.partition("#")
    rest = rest.rstrip("/")
    if scheme == "udp":
        host, port = _split_host_port(rest, 53)
        return UdpUpstream(url, host, port)
    if scheme == "tcp":
        host, port = _split_host_port(rest, 53)
        return TcpUpstream(url, host, port, None, None)
    if scheme == "tls":
        host, port = _split_host_port(rest, 853)
        ctx = ssl.create_default_context()
        if verify is False:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        elif isinstance(verify, str):
            ctx.load_verify_locations(verify)
        ctx.set_alpn_protocols(["dot"])
        return TcpUpstream(url, host, port, ctx, sni or host)
    if scheme == "quic":
        host, port = _split_host_port(rest, 853)
        return QuicUpstream(url, host, port, verify, sni or None)
    raise ValueError(f"unsupported upstream scheme {scheme!r}")


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
            out.append(f"udp://[{ip}]:53" if ip.version == 6 else f"udp://{ip}:53")
    return out
