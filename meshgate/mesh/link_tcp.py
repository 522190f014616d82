"""TCP links: listen and connect, and the socket options a mesh link wants."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable

from meshgate.mesh.tun_routes import mark_socket

ProtocolFactory = Callable[[], asyncio.Protocol]


def tune(transport: asyncio.BaseTransport) -> None:
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        # frames are batched per loop tick already; Nagle would only add latency
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


async def listen(host: str, port: int, factory: ProtocolFactory) -> asyncio.Server:
    """Listen for links; the listening socket is marked (accepted sockets inherit
    the mark), so replies on inbound links also bypass an exit default route."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, type_, proto, _name, addr = infos[0]
    sock = socket.socket(family, type_, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        mark_socket(sock)
        sock.bind(addr)
        sock.setblocking(False)
        return await loop.create_server(factory, sock=sock)
    except BaseException:
        sock.close()
        raise


async def connect(host: str, port: int, factory: ProtocolFactory, timeout: float) -> asyncio.Transport:
    """Connect a link, marking the socket *before* connect() so that with an exit
    default route installed (TUN) the SYN already takes the physical interface
    instead of the node's own tunnel."""
    return await asyncio.wait_for(_connect_marked(host, port, factory), timeout)


async def _connect_marked(host: str, port: int, factory: ProtocolFactory) -> asyncio.Transport:
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    last: OSError | None = None
    for family, type_, proto, _name, addr in infos:
        sock = socket.socket(family, type_, proto)
        try:
            sock.setblocking(False)
            mark_socket(sock)  # best effort: needs CAP_NET_ADMIN, a no-op without it
            await loop.sock_connect(sock, addr)
        except OSError as e:
            sock.close()
            last = e
            continue
        except BaseException:
            sock.close()
            raise
        transport, _ = await loop.create_connection(factory, sock=sock)
        return transport
    raise last or OSError(f"no address for {host}")
