"""TCP links: listen and connect, and the socket options a mesh link wants."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable

ProtocolFactory = Callable[[], asyncio.Protocol]


def tune(transport: asyncio.BaseTransport) -> None:
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        # frames are batched per loop tick already; Nagle would only add latency
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


async def listen(host: str, port: int, factory: ProtocolFactory) -> asyncio.Server:
    loop = asyncio.get_running_loop()
    return await loop.create_server(factory, host or None, port, reuse_address=True)


async def connect(host: str, port: int, factory: ProtocolFactory, timeout: float) -> asyncio.Transport:
    loop = asyncio.get_running_loop()
    transport, _ = await asyncio.wait_for(loop.create_connection(factory, host, port), timeout)
    return transport
