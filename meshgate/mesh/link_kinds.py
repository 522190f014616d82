"""The registry of link kinds: how a `scheme://` in mesh.listen / mesh.peers
listens and connects.

Every kind has the same two calls, given the link owner (MeshService) and the
URL: `listen` returns a `Listening` (the addresses actually bound, and how to
stop), `connect` returns the link once its transport is up (the Noise
handshake continues in the background). Adding a kind is its adapter module
plus one class and one entry in `LINK_KINDS` here; config.LINK_SCHEMES names
the same keys (a unit test holds them equal, since config is a ground module
and must not import the mesh).

QUIC and UDP adapters are imported when first used: a node that configures
neither never loads aioquic or the UDP session machinery.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from meshgate.config import LimitsConfig, LinkUrl
from meshgate.mesh import link_ring, link_tcp
from meshgate.mesh.links import Link, LinkBase, LinkOwner

if TYPE_CHECKING:
    from meshgate.mesh import link_udp


class LinkHost(LinkOwner, Protocol):
    """What a link kind needs from the mesh that owns its links."""

    pending: set[LinkBase]

    @property
    def limits(self) -> LimitsConfig: ...

    def accept_link(self, url: LinkUrl) -> asyncio.Protocol: ...

    def accept_udp(self, sock: link_udp.UdpSocket, addr: Any) -> link_udp.UdpLink | None: ...

    def hold(self, task: asyncio.Task[Any]) -> None: ...


class Listening:
    """One listener: the URLs it bound (port 0 resolved), how to stop it, and the
    kind's own listener object (`server`) for status and tests."""

    def __init__(self, addresses: list[str], server: Any, close: Callable[[], None],
                 wait_closed: Callable[[], Any] | None = None) -> None:
        self.addresses = addresses
        self.server = server
        self.close = close
        self._wait_closed = wait_closed

    async def wait_closed(self) -> None:
        if self._wait_closed is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wait_closed(), 2)


class LinkKind(Protocol):
    async def listen(self, host: LinkHost, url: LinkUrl) -> Listening: ...

    async def connect(self, host: LinkHost, url: LinkUrl) -> LinkBase: ...


async def _pipe_link(host: LinkHost, url: LinkUrl, open_transport: Callable[[Link], Any]) -> LinkBase:
    """A link over a byte pipe (tcp, ring, quic): pending until its HELLO, dropped if the open fails."""
    link = Link(host, str(url), initiator=True)
    host.pending.add(link)
    try:
        await open_transport(link)
    except BaseException:
        host.pending.discard(link)
        raise
    return link


class TcpKind:
    async def listen(self, host: LinkHost, url: LinkUrl) -> Listening:
        server = await link_tcp.listen(url.host, url.port, functools.partial(host.accept_link, url))
        addrs = [str(LinkUrl("tcp", *s.getsockname()[:2])) for s in server.sockets]
        return Listening(addrs, server, server.close, server.wait_closed)

    async def connect(self, host: LinkHost, url: LinkUrl) -> LinkBase:
        async def open_transport(link: Link) -> None:
            await link_tcp.connect(url.host, url.port, lambda: link, host.handshake_timeout)

        return await _pipe_link(host, url, open_transport)


class RingKind:
    """In-process links (tests, benchmarks): no sockets."""

    async def listen(self, host: LinkHost, url: LinkUrl) -> Listening:
        factory = functools.partial(host.accept_link, url)
        link_ring.listen(url.host, factory)
        return Listening([str(url)], None, lambda: link_ring.unlisten(url.host, factory))

    async def connect(self, host: LinkHost, url: LinkUrl) -> LinkBase:
        async def open_transport(link: Link) -> None:
            link_ring.connect(url.host, lambda: link)

        return await _pipe_link(host, url, open_transport)


class QuicKind:
    async def listen(self, host: LinkHost, url: LinkUrl) -> Listening:
        from meshgate.mesh import link_quic  # aioquic, only when a quic link is configured

        server = await link_quic.listen(url.host, url.port, functools.partial(host.accept_link, url))
        sockname = server._transport.get_extra_info("sockname") if server._transport else None
        port = sockname[1] if sockname else url.port
        return Listening([str(LinkUrl("quic", url.host, port))], server, server.close)

    async def connect(self, host: LinkHost, url: LinkUrl) -> LinkBase:
        from meshgate.mesh import link_quic

        async def open_transport(link: Link) -> None:
            # the task holds the QUIC connection open for as long as the link lives
            host.hold(await link_quic.connect_link(url.host, url.port, lambda: link, host.handshake_timeout))

        return await _pipe_link(host, url, open_transport)


class UdpKind:
    async def listen(self, host: LinkHost, url: LinkUrl) -> Listening:
        from meshgate.mesh import link_udp

        listener = await link_udp.listen(url.host, url.port, host.accept_udp, host.limits)
        # close() says CLOSE to every peer on it
        return Listening([str(LinkUrl("udp", *listener.sockname[:2]))], listener, listener.close)

    async def connect(self, host: LinkHost, url: LinkUrl) -> LinkBase:
        from meshgate.mesh import link_udp

        limits = host.limits
        link = await link_udp.connect(
            url, lambda sock, addr: link_udp.UdpLink(host, str(url), True, sock, addr, limits), limits
        )
        host.pending.add(link)
        link.begin()
        return link


LINK_KINDS: dict[str, LinkKind] = {"tcp": TcpKind(), "quic": QuicKind(), "ring": RingKind(), "udp": UdpKind()}
