"""SOCKS UDP over the mesh without a temporary copy per datagram (issue 18 item 6).

Two full nodes in one process (A with the portal, B publishing a UDP echo on
its virtual IP, one TCP link). Mixed payloads (1,400 / 512 / 64 bytes, each
carrying its sequence number and a fill derived from it) go through A's portal
and back, every reply checked. Beside the behaviour, the tests look at what
the datagram path hands the link and the handlers: the payload travels as a
view of the buffer it was read into, its headers as one prebuilt prefix (so
nothing joined them in a copy), and a received datagram reaches its handler as
a view that is released when the handler returns. The allocation counts per
round trip are bench/portal_udp.py's.
"""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import AsyncIterator
from typing import Any

import pytest

from meshgate.gateway.mesh_udp import UDP_CHANNEL, UDP_REPLY_CHANNEL
from meshgate.mesh import links
from meshgate.mesh.frames import DATAGRAM
from meshgate.node import Node
from tests.helpers import UdpEcho, async_wait_until, free_port
from tests.integration.test_portal_mesh import cfg, start
from tests.integration.test_socks5_server import read_reply, request, udp_header

PORT = free_port()
SEQ = struct.Struct("!Q")
SIZES = [1400] * 8 + [512, 64]  # 80% / 10% / 10%


def payload(seq: int) -> bytes:
    size = SIZES[seq % len(SIZES)]
    return SEQ.pack(seq) + bytes((seq + i) & 0xFF for i in range(size - SEQ.size))


@pytest.fixture
async def pair(tmp_path: Any) -> AsyncIterator[dict[str, Node]]:
    serve = {str(PORT): f"127.0.0.1:{PORT}"}
    b = await start(cfg("b", "10.144.7.2/24", node={"state_dir": str(tmp_path / "b")}, serve=serve,
                        mesh={"listen": ["tcp://127.0.0.1:0"]}))
    a = await start(cfg("a", "10.144.7.1/24", node={"state_dir": str(tmp_path / "a")},
                        mesh={"peers": [b.mesh.listen_addrs[0]], "direct_fallback": False},
                        socks5={"enable": True, "listen": "127.0.0.1:0"}))
    await async_wait_until(lambda: b.mesh.node_id in a.mesh.table.hop_paths
                           and a.mesh.node_id in b.mesh.table.hop_paths, 15, "routes to converge")
    yield {"a": a, "b": b}
    await a.stop()
    await b.stop()


async def associate(node: Node) -> tuple[asyncio.StreamWriter, socket.socket, tuple[str, int]]:
    svc = next(s for s in node.services if s.name == "socks5")
    addr = svc.address  # type: ignore[attr-defined]
    reader, writer = await asyncio.open_connection(addr.host, addr.port)
    writer.write(b"\x05\x01\x00")
    assert await reader.readexactly(2) == b"\x05\x00"
    writer.write(request(3, 1, bytes(4), 0))
    rep, _atyp, bnd, port = await read_reply(reader)
    assert rep == 0
    client = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    client.bind(("127.0.0.1", 0))
    client.setblocking(False)
    return writer, client, (socket.inet_ntoa(bnd), port)


async def round_trips(client: socket.socket, relay: tuple[str, int], count: int, window: int = 8) -> None:
    """`count` round trips, at most `window` in flight; every reply's header, sequence and
    payload checked (loopback in one process loses nothing, so none may be missing)."""
    loop = asyncio.get_running_loop()
    hdr = udp_header(1, socket.inet_aton("10.144.7.2"), PORT)
    sent = got = 0
    while got < count:
        while sent < count and sent - got < window:
            client.sendto(hdr + payload(sent), relay)
            sent += 1
        data = await asyncio.wait_for(loop.sock_recv(client, 65536), 5)
        assert data[: len(hdr)] == hdr
        seq = SEQ.unpack_from(data, len(hdr))[0]
        assert data[len(hdr):] == payload(seq)
        got += 1


async def test_mixed_payloads_round_trip_checked(pair: dict[str, Node]) -> None:
    echo = UdpEcho("127.0.0.1", port=PORT)
    writer, client, relay = await associate(pair["a"])
    try:
        await round_trips(client, relay, 600)
        assert len(echo.received) == 600
    finally:
        writer.close()
        client.close()
        echo.close()


async def test_payload_reaches_the_link_as_a_view_behind_one_prebuilt_prefix(
    pair: dict[str, Node], monkeypatch: pytest.MonkeyPatch
) -> None:
    """What each node's datagram path gives the link: the prefix (channel + wire head) built
    once per target (the same object every time), and the payload as a view of the receive
    buffer, not a bytes object that joined them."""
    seen: list[tuple[int, bytes, Any, int]] = []  # channel, prefix, payload, its length then
    real = links.Link.send_frame

    def spy(self: links.Link, ftype: int, flags: int, hop: int, src: int, dst: int, head: Any,
            data: Any = b"") -> None:
        if ftype == DATAGRAM:
            seen.append((struct.unpack_from("!H", head)[0], head, data, len(data)))
        real(self, ftype, flags, hop, src, dst, head, data)

    monkeypatch.setattr(links.Link, "send_frame", spy)
    echo = UdpEcho("127.0.0.1", port=PORT)
    writer, client, relay = await associate(pair["a"])
    try:
        await round_trips(client, relay, 20, window=1)
    finally:
        writer.close()
        client.close()
        echo.close()
    out = [s for s in seen if s[0] == UDP_CHANNEL]
    back = [s for s in seen if s[0] == UDP_REPLY_CHANNEL]
    assert len(out) == len(back) == 20
    for kind in (out, back):
        assert all(isinstance(data, memoryview) for _, _, data, _ in kind)
        assert len({id(head) for _, head, _, _ in kind}) == 1  # one prefix object per target
        assert [n for *_, n in kind] == [len(payload(i)) for i in range(20)]


async def test_received_datagram_is_a_view_released_after_the_handler(pair: dict[str, Node]) -> None:
    """The receiving side reads the payload in place: the handler's view is of the opened
    record (no bytes copy), and it is released once the handler returns."""
    a, b = pair["a"], pair["b"]
    kept: list[memoryview] = []
    done = asyncio.Event()

    def handler(src: int, view: memoryview) -> None:
        assert src == a.mesh.node_id
        assert bytes(view) == b"x" * 1400
        kept.append(view)
        done.set()

    b.mesh.on_datagram_view(40, handler)
    assert a.mesh.send_datagram(b.mesh.node_id, 40, memoryview(b"x" * 1400))
    await asyncio.wait_for(done.wait(), 5)
    assert isinstance(kept[0], memoryview)
    with pytest.raises(ValueError):
        bytes(kept[0])  # released: the record's memory is not the handler's to keep
