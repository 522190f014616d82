"""In-process "ring" links: two transports joined in memory, for tests and benchmarks.

`ring://NAME` in `[mesh] listen` registers NAME in a module-level registry;
`ring://NAME` in `peers` connects to it. Bytes still go through the full link
protocol (handshake, AEAD), only the socket is replaced. `delay` injects
one-way latency; `blackhole` silently drops everything (a dead link that
only the liveness timeout can detect).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

ProtocolFactory = Callable[[], asyncio.Protocol]

_LISTENERS: dict[str, ProtocolFactory] = {}
HIGH_WATER = 1 << 20
LOW_WATER = 1 << 18


class RingError(OSError):
    pass


def listen(name: str, factory: ProtocolFactory) -> None:
    if name in _LISTENERS:
        raise RingError(98, f"ring://{name} is already listening")
    _LISTENERS[name] = factory


def unlisten(name: str, factory: ProtocolFactory | None = None) -> None:
    if factory is None or _LISTENERS.get(name) is factory:
        _LISTENERS.pop(name, None)


class RingTransport(asyncio.Transport):
    def __init__(self, loop: asyncio.AbstractEventLoop, name: str, side: str) -> None:
        super().__init__()
        self.loop = loop
        self.name = name
        self.side = side
        self.peer: RingTransport | None = None
        self.protocol: asyncio.Protocol | None = None
        self.delay = 0.0
        self.blackhole = False
        self.in_flight = 0
        self._paused = False
        self._reading = True
        self._held: list[bytes] = []
        self._closed = False
        self._eof = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        if name in ("peername", "sockname"):
            return f"ring://{self.name}#{self.side}"
        return default

    def is_closing(self) -> bool:
        return self._closed

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        assert isinstance(protocol, asyncio.Protocol)
        self.protocol = protocol

    def get_protocol(self) -> asyncio.BaseProtocol:
        assert self.protocol is not None
        return self.protocol

    def is_reading(self) -> bool:
        return self._reading

    def pause_reading(self) -> None:
        self._reading = False

    def resume_reading(self) -> None:
        if self._reading:
            return
        self._reading = True
        held, self._held = self._held, []
        for data in held:
            self._deliver(data, 0)

    def get_write_buffer_size(self) -> int:
        return self.in_flight

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.writelines((data,))

    def writelines(self, list_of_data: Any) -> None:
        if self._closed or self.peer is None:
            return
        data = b"".join(list_of_data)
        if not data or self.blackhole:
            return
        n = len(data)
        self.in_flight += n
        if self.delay > 0:
            self.loop.call_later(self.delay, self.peer._deliver, data, n)
        else:
            self.loop.call_soon(self.peer._deliver, data, n)
        if not self._paused and self.in_flight > HIGH_WATER and self.protocol is not None:
            self._paused = True
            self.protocol.pause_writing()

    def _deliver(self, data: bytes, n: int) -> None:
        sender = self.peer
        if sender is not None and n:
            sender.in_flight -= n
            if sender._paused and sender.in_flight <= LOW_WATER and sender.protocol is not None:
                sender._paused = False
                if not sender._closed:
                    sender.protocol.resume_writing()
        if self._closed or self.protocol is None:
            return
        if not self._reading:
            self._held.append(data)
            return
        self.protocol.data_received(data)

    def can_write_eof(self) -> bool:
        return False

    def write_eof(self) -> None:
        raise NotImplementedError("ring links do not half-close")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.protocol is not None:
            self.loop.call_soon(self.protocol.connection_lost, None)
        peer = self.peer
        if peer is not None and not peer._closed:
            # after data already in flight, like a FIN behind the last segment
            if self.delay > 0:
                self.loop.call_later(self.delay, peer.close)
            else:
                self.loop.call_soon(peer.close)

    def abort(self) -> None:
        self.close()


def connect(name: str, factory: ProtocolFactory) -> tuple[RingTransport, asyncio.Protocol]:
    """Join `factory()`'s protocol to the listener on ring://name (synchronous).

    `ring://NAME?delay=SECONDS` (peers only) delays delivery both ways: tests use
    it to inject latency on one link."""
    delay = 0.0
    name, _, query = name.partition("?")
    if query.startswith("delay="):
        try:
            delay = float(query[6:])
        except ValueError:
            raise RingError(22, f"bad ring delay in {query!r}") from None
    server_factory = _LISTENERS.get(name)
    if server_factory is None:
        raise RingError(111, f"nothing listens on ring://{name}")
    loop = asyncio.get_running_loop()
    a, b = RingTransport(loop, name, "client"), RingTransport(loop, name, "server")
    a.peer, b.peer = b, a
    a.delay = b.delay = delay
    client, server = factory(), server_factory()
    a.protocol, b.protocol = client, server
    server.connection_made(b)
    client.connection_made(a)
    return a, client
