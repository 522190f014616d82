"""Joining a mesh stream to a real transport, and the seam the mesh is handed.

`EgressConnect` is what a MeshService is given to serve the streams that end
on this node (the policy-checked `meshgate.egress.connect.connector`): the
signature of `loop.create_connection` minus the keywords. `SplicePipe` is the
protocol on one side that writes into the other, with back-pressure both
ways (a full side pauses reading on the other).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, cast

ProtocolFactory = Callable[[], asyncio.BaseProtocol]


class EgressConnect(Protocol):
    """Connect `host:port` for a stream that ends here; `source` is the node that opened it
    (authenticated by the mesh), 0 for this node's own users (its access rules skip those)."""

    def __call__(
        self, host: str, port: int, factory: ProtocolFactory, source: int = 0
    ) -> Awaitable[tuple[asyncio.BaseTransport, Any]]: ...


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
