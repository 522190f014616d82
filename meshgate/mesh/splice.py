"""Where a mesh stream leaves the mesh: connect a real TCP socket and splice.

`connect(host, port, protocol_factory)` is the default `MeshService.egress_connect`:
the lead's exit/CIDR policy wraps or replaces it (same signature as
`loop.create_connection` minus the keywords). `splice_factory(stream)` builds
the protocol that joins a real transport to a mesh stream, with back-pressure
both ways (a full side pauses reading on the other).
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import socket
from collections.abc import Awaitable, Callable
from typing import Any, cast

from meshgate.mesh.streams import (
    GENERAL_FAILURE,
    HOST_UNREACHABLE,
    NETWORK_UNREACHABLE,
    REFUSED,
    TTL_EXPIRED,
    StreamError,
)

ProtocolFactory = Callable[[], asyncio.BaseProtocol]
EgressConnect = Callable[[str, int, ProtocolFactory], Awaitable[tuple[asyncio.BaseTransport, Any]]]


def error_code(exc: BaseException) -> int:
    """Map a connect failure to a SOCKS5 reply code."""
    if isinstance(exc, StreamError):
        return exc.code
    if isinstance(exc, ConnectionRefusedError):
        return REFUSED
    if isinstance(exc, TimeoutError | asyncio.TimeoutError):
        return TTL_EXPIRED
    if isinstance(exc, socket.gaierror):
        return HOST_UNREACHABLE
    if isinstance(exc, OSError):
        if exc.errno in (errno.ENETUNREACH, errno.ENETDOWN):
            return NETWORK_UNREACHABLE
        if exc.errno in (errno.EHOSTUNREACH, errno.EHOSTDOWN, errno.EADDRNOTAVAIL):
            return HOST_UNREACHABLE
        if exc.errno == errno.ECONNREFUSED:
            return REFUSED
        if exc.errno == errno.ETIMEDOUT:
            return TTL_EXPIRED
    return GENERAL_FAILURE


def local_connector(
    own_ips: set[str], timeout: float = 10.0
) -> EgressConnect:
    """Connect from this host; the node's own virtual IPs mean 127.0.0.1 / ::1."""

    async def connect(
        host: str, port: int, protocol_factory: ProtocolFactory
    ) -> tuple[asyncio.BaseTransport, Any]:
        target = host
        if host in own_ips:
            target = "::1" if ipaddress.ip_address(host).version == 6 else "127.0.0.1"
        loop = asyncio.get_running_loop()
        try:
            return await asyncio.wait_for(loop.create_connection(protocol_factory, target, port), timeout)
        except (OSError, TimeoutError) as e:
            raise StreamError(error_code(e), f"connect to {host}:{port} failed: {e}") from None

    return connect


class SplicePipe(asyncio.Protocol):
    """Protocol on one transport that writes everything into `other`."""

    def __init__(self, other: asyncio.Transport | None = None) -> None:
        self.other = other
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses: cast, don't assert
        transport = cast(asyncio.Transport, transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self.other is not None:
            self.other.write(data)

    def eof_received(self) -> bool:
        if self.other is not None and self.other.can_write_eof() and not self.other.is_closing():
            self.other.write_eof()
        return True  # keep the other direction open (half-close)

    def connection_lost(self, exc: Exception | None) -> None:
        other = self.other
        if other is not None and not other.is_closing():
            if exc is None:
                other.close()
            else:
                other.abort()

    def pause_writing(self) -> None:
        if self.other is not None:
            self.other.pause_reading()

    def resume_writing(self) -> None:
        if self.other is not None and not self.other.is_closing():
            self.other.resume_reading()
