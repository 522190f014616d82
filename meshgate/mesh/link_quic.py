"""QUIC links (aioquic): the same link protocol on one bidirectional QUIC stream.

QUIC's own TLS here only provides the transport; it is not authenticated
(self-signed certificate made in memory at start, clients do not verify it).
Membership and keys come from the Noise handshake inside the stream, exactly
as on TCP, so a QUIC link is as strong as a TCP one and no key is written to
disk. `QuicStreamTransport` makes the stream look like an asyncio transport
to `Link`.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable
from typing import Any

from aioquic.asyncio.client import connect
from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.asyncio.server import QuicServer, serve
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.events import ConnectionTerminated, QuicEvent, StreamDataReceived, StreamReset

from meshgate.tls import make_self_signed

ALPN = "meshgate-mesh/1"
ProtocolFactory = Callable[[], asyncio.Protocol]


class QuicStreamTransport(asyncio.Transport):
    """One QUIC stream as the byte pipe under a `Link`."""

    def __init__(self, proto: MeshQuicProtocol, stream_id: int) -> None:
        super().__init__()
        self._proto = proto
        self.stream_id = stream_id
        self._closing = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        if name == "peername":
            paths = self._proto._quic._network_paths  # a server-side protocol has no connected socket
            return paths[0].addr if paths else self._proto.peername
        return default

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.writelines((data,))

    def writelines(self, list_of_data: Any) -> None:
        if self._closing:
            return
        quic = self._proto._quic
        for data in list_of_data:
            quic.send_stream_data(self.stream_id, bytes(data))
        self._proto.transmit()

    def get_write_buffer_size(self) -> int:
        return 0  # aioquic buffers stream data itself; flow control bounds it

    def is_closing(self) -> bool:
        return self._closing

    def can_write_eof(self) -> bool:
        return False

    def close(self) -> None:
        if not self._closing:
            self._closing = True
            self._proto.close()

    def abort(self) -> None:
        self.close()

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


class MeshQuicProtocol(QuicConnectionProtocol):
    """A QUIC connection carrying one link on its first bidirectional stream."""

    link_factory: ProtocolFactory | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.link: asyncio.Protocol | None = None
        self.stream: QuicStreamTransport | None = None
        self.peername: Any = None
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.peername = transport.get_extra_info("peername")

    def open_link(self, factory: ProtocolFactory) -> asyncio.Protocol:
        sid = self._quic.get_next_available_stream_id()
        self.stream = QuicStreamTransport(self, sid)
        self.link = factory()
        self.link.connection_made(self.stream)
        return self.link

    def quic_event_received(self, event: QuicEvent) -> None:
        if isinstance(event, StreamDataReceived):
            if self.link is None and self.link_factory is not None:
                self.stream = QuicStreamTransport(self, event.stream_id)
                self.link = self.link_factory()
                self.link.connection_made(self.stream)
            if self.link is not None and self.stream is not None and event.stream_id == self.stream.stream_id:
                if event.data:
                    self.link.data_received(event.data)
                if event.end_stream:
                    self.close()
        elif isinstance(event, StreamReset):
            self.close()
        elif isinstance(event, ConnectionTerminated):
            if self.stream is not None:
                self.stream._closing = True
            if self.link is not None:
                link, self.link = self.link, None
                link.connection_lost(None)
            if not self.closed.done():
                self.closed.set_result(None)


def _config(is_client: bool) -> QuicConfiguration:
    cfg = QuicConfiguration(
        is_client=is_client, alpn_protocols=[ALPN], idle_timeout=30.0,
        max_data=8 << 20, max_stream_data=4 << 20,
    )
    if is_client:
        cfg.verify_mode = ssl.CERT_NONE  # authentication is the Noise handshake inside
    else:
        cfg.certificate, cfg.private_key = make_self_signed("meshgate-mesh", ["meshgate-mesh"], 365)
    return cfg


async def listen(host: str, port: int, factory: ProtocolFactory) -> QuicServer:
    def create(*args: Any, **kwargs: Any) -> MeshQuicProtocol:
        proto = MeshQuicProtocol(*args, **kwargs)
        proto.link_factory = factory
        return proto

    return await serve(host or "::", port, configuration=_config(False), create_protocol=create)


async def connect_link(host: str, port: int, factory: ProtocolFactory, timeout: float) -> asyncio.Task[None]:
    """Connect and open the link; returns the task that holds the connection open
    until the link ends (cancel it to close)."""
    ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def hold() -> None:
        try:
            cfg = _config(True)
            async with connect(host, port, configuration=cfg, create_protocol=MeshQuicProtocol) as proto:
                assert isinstance(proto, MeshQuicProtocol)
                proto.open_link(factory)
                if not ready.done():
                    ready.set_result(None)
                await proto.closed
        except BaseException as e:
            if not ready.done():
                ready.set_exception(e if isinstance(e, Exception) else ConnectionError("cancelled"))
            raise

    task = asyncio.get_running_loop().create_task(hold())
    try:
        await asyncio.wait_for(asyncio.shield(ready), timeout)
    except BaseException:
        task.cancel()
        raise
    return task
