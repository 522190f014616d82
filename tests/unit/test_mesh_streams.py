"""StreamMux and MeshStream without links: two muxes wired back to back."""

from __future__ import annotations

import asyncio

import pytest

from meshgate.mesh import streams
from meshgate.mesh.streams import MeshStream, StreamError, StreamMux
from meshgate.metrics import REGISTRY
from meshgate.replies import GENERAL_FAILURE, REFUSED
from tests.mesh_testing import Collector

A, B = 1, 2


class Wire:
    """Frames from one mux to the other at the next loop tick (like a link would)."""

    def __init__(self, window: int = 65536, max_streams: int = 8) -> None:
        loop = asyncio.get_running_loop()
        self.loop = loop
        self.frames: list[tuple[int, int, int]] = []  # (from, type, size)
        self.a = StreamMux(loop, self._sender(A), window, max_streams)
        self.b = StreamMux(loop, self._sender(B), window, max_streams)
        self.up = True

    def _sender(self, me: int):  # type: ignore[no-untyped-def]
        def send(ftype: int, flags: int, dst: int, head: bytes, data: bytes | bytearray | memoryview) -> bool:
            if not self.up:
                return False
            body = bytes(head) + bytes(data)
            self.frames.append((me, ftype, len(body)))
            target = self.b if dst == B else self.a
            self.loop.call_soon(target.on_frame, ftype, flags, me, memoryview(body))
            return True

        return send


def _accept_with(wire: Wire, factory=Collector):  # type: ignore[no-untyped-def]
    accepted: list[tuple[MeshStream, Collector]] = []

    def on_open(stream: MeshStream, host: str, port: int) -> None:
        proto = factory()
        wire.b.accept(stream)
        stream.attach(proto)
        accepted.append((stream, proto))

    wire.b.on_open = on_open
    return accepted


async def _open(wire: Wire) -> tuple[MeshStream, Collector]:
    stream, fut = wire.a.open(B, "example.org", 80)
    await asyncio.wait_for(fut, 5)
    proto = Collector()
    stream.attach(proto)
    return stream, proto


async def test_open_data_half_close_both_ways() -> None:
    wire = Wire()
    accepted = _accept_with(wire)
    s, p = await _open(wire)
    payload = bytes(range(256)) * 1000  # several windows
    s.write(payload)
    s.write_eof()
    await asyncio.sleep(0)
    for _ in range(200):
        await asyncio.sleep(0)
        if accepted and accepted[0][1].eof:
            break
    bs, bp = accepted[0]
    assert bytes(bp.buf) == payload and bp.eof
    assert not p.done.done()  # half-closed: b can still answer
    bs.write(b"answer")
    bs.write_eof()
    got = await asyncio.wait_for(p.done, 5)
    assert got == b"answer"
    for _ in range(10):
        await asyncio.sleep(0)
    assert len(wire.a) == 0 and len(wire.b) == 0


async def test_reset_code_reaches_opener() -> None:
    wire = Wire()
    wire.b.on_open = lambda stream, host, port: wire.b.refuse(stream, REFUSED)
    _, fut = wire.a.open(B, "10.0.0.1", 22)
    with pytest.raises(StreamError) as e:
        await asyncio.wait_for(fut, 5)
    assert e.value.code == REFUSED
    assert len(wire.a) == 0


async def test_paused_reader_stops_granting_credit() -> None:
    wire = Wire(window=65536)
    accepted = _accept_with(wire, lambda: Collector(pause=True))
    s, p = await _open(wire)
    s.write(b"x" * 1_000_000)
    for _ in range(50):
        await asyncio.sleep(0)
    bs, bp = accepted[0]
    assert bp.buf == b"" and bs._recv_buffered == 65536  # one window, no more
    assert s.send_credit == 0 and s.get_write_buffer_size() == 1_000_000 - 65536
    assert not p.writable.is_set()  # the writer was told to pause
    bs.resume_reading()
    for _ in range(500):
        await asyncio.sleep(0)
        if len(bp.buf) == 1_000_000:
            break
    assert len(bp.buf) == 1_000_000
    assert p.writable.is_set()


async def test_window_overrun_is_reset() -> None:
    wire = Wire(window=1000)
    accepted = _accept_with(wire)
    s, p = await _open(wire)
    s.send_credit = 10**9  # a misbehaving sender ignores its credit
    s.write(b"y" * 5000)
    for _ in range(20):
        await asyncio.sleep(0)
    bs, _bp = accepted[0]
    assert bs.closed and isinstance(p.lost, ConnectionResetError)
    assert REGISTRY.value("meshgate_mesh_stream_frames_dropped_total", "window_overrun") >= 1


async def test_max_streams_per_peer() -> None:
    wire = Wire(max_streams=3)
    _accept_with(wire)
    for _ in range(3):
        await _open(wire)
    with pytest.raises(StreamError) as e:
        wire.a.open(B, "h", 1)
    assert e.value.code == GENERAL_FAILURE
    assert len(wire.a) == 3


async def test_no_route_fails_fast() -> None:
    wire = Wire()
    wire.up = False
    with pytest.raises(StreamError) as e:
        wire.a.open(B, "h", 1)
    assert e.value.code == streams.NETWORK_UNREACHABLE


async def test_abort_resets_peer_and_close_is_graceful() -> None:
    wire = Wire()
    accepted = _accept_with(wire)
    s, _p = await _open(wire)
    s.abort()
    for _ in range(10):
        await asyncio.sleep(0)
    assert isinstance(accepted[0][1].lost, ConnectionResetError)
    s2, p2 = await _open(wire)
    s2.write(b"bye")
    s2.close()
    for _ in range(20):
        await asyncio.sleep(0)
    _bs, bp = accepted[1]
    assert bytes(bp.buf) == b"bye" and bp.eof
    assert p2.lost is None and p2.done.done()


def test_open_codec_rejects_garbage() -> None:
    with pytest.raises(ValueError):
        streams.decode_open(memoryview(b"\x00" * 5))
    sid, window, host, port = streams.decode_open(memoryview(streams.encode_open(7, 100, "example.org", 443)))
    assert (sid, window, host, port) == (7, 100, "example.org", 443)


async def test_a_peer_cannot_grant_more_credit_than_our_window() -> None:
    """A member that opens with window 2^32-1 (or grants that much later) and stops reading
    must not make us send (and buffer on the link) more than limits.stream_window."""
    from meshgate.mesh.frames import STREAM_OPEN, STREAM_WINDOW
    from meshgate.mesh.streams import WINDOW, encode_open

    wire = Wire(window=65536)
    opened: list[MeshStream] = []

    def on_open(stream: MeshStream, host: str, port: int) -> None:
        wire.b.accept(stream)
        opened.append(stream)

    wire.b.on_open = on_open
    wire.b.on_frame(STREAM_OPEN, streams.FLAG_OPENER, A, memoryview(encode_open(7, 0xFFFFFFFF, "x", 1)))
    assert opened and opened[0].send_credit == 65536
    wire.b.on_frame(STREAM_WINDOW, streams.FLAG_OPENER, A, memoryview(WINDOW.pack(7, 0xFFFFFFFF)))
    assert opened[0].send_credit == 65536
