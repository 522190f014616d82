"""TunPath over a datagram socketpair standing in for the TUN device, with a recording mesh.

A SOCK_DGRAM socketpair keeps packet boundaries exactly like a TUN fd (one read,
one packet), so the real read/write batching code runs without root.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from meshgate.mesh import tun_packets as tp
from meshgate.mesh.routing import Route
from meshgate.mesh.tun import (
    BUNDLE_MAX,
    L3_BUNDLE_CHANNEL,
    L3_CHANNEL,
    L3_VNET_CHANNEL,
    ROUTE_CACHE,
    TunPath,
    remote_cidrs,
)
from meshgate.metrics import REGISTRY
from tests.helpers import async_wait_until
from tests.unit.test_tun_packets import A4, A6, B4, B6, icmp_echo, ipv4, ipv6, ref_sum

ME = 0x0A
PEER = 0x0C
C4 = ipaddress.IPv4Address("10.144.144.4").packed
PEER4, PEER6 = "10.144.144.12", "fd00:144::12"  # the virtual IPs of node PEER
LAN = ipaddress.IPv4Address("10.1.2.4").packed


@dataclass
class Table:
    version: int = 1


@dataclass
class FakeMesh:
    node_id: int = ME
    node_id_text: str = f"{ME:08x}"
    table: Table = field(default_factory=Table)
    routes_by_ip: dict[bytes, int] = field(default_factory=dict)
    sent: list[tuple[int, int, bytes]] = field(default_factory=list)
    handlers: dict[int, Any] = field(default_factory=dict)
    lookups: int = 0
    accept: bool = True

    def lookup(self, ip: Any) -> Route | None:
        self.lookups += 1
        nid = self.routes_by_ip.get(ip.packed)
        return Route(nid, "n", "peer", nid, 1, 0.1) if nid is not None else None

    def send_datagram(self, node_id: int, channel: int, payload: bytes) -> bool:
        self.sent.append((node_id, channel, bytes(payload)))
        return self.accept

    def on_datagram(self, channel: int, cb: Any) -> None:
        self.handlers[channel] = cb

    def routes(self) -> list[dict[str, Any]]:
        return [{"id": f"{PEER:08x}", "ipv4": PEER4, "ipv6": PEER6, "proxy_cidrs": []}]


def dropped(reason: str) -> float:
    return REGISTRY.value("meshgate_tun_dropped_total", reason)


def packets(mesh: FakeMesh) -> list[tuple[int, int, bytes]]:
    """What the path sent, bundles opened: (node, channel the packet would travel on, packet)."""
    out = []
    for node, ch, payload in mesh.sent:
        if ch != L3_BUNDLE_CHANNEL:
            out.append((node, ch, payload))
            continue
        inner = L3_VNET_CHANNEL if payload[0] == 1 else L3_CHANNEL
        pos = 1
        while pos < len(payload):
            n = int.from_bytes(payload[pos : pos + 2], "big")
            out.append((node, inner, payload[pos + 2 : pos + 2 + n]))
            pos += 2 + n
    return out


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    b.setblocking(False)
    yield a, b
    a.close()
    b.close()


def make_path(dev: socket.socket, mesh: FakeMesh, egress: bool = False, mtu: int = 1380,
              **kw: Any) -> TunPath:
    path = TunPath(asyncio.get_running_loop(), dev.fileno(), mesh, ipaddress.IPv4Address(B4),
                   ipaddress.IPv6Address(B6), mtu, egress, **kw)
    path.start()
    return path


async def recv(sock: socket.socket, timeout: float = 2.0) -> bytes:
    loop = asyncio.get_running_loop()
    return await asyncio.wait_for(loop.sock_recv(sock, 65536), timeout)


async def test_device_to_mesh_routes_by_destination_and_decrements_ttl(pair: Any) -> None:
    dev, host = pair
    mesh = FakeMesh(routes_by_ip={C4: PEER, A6: PEER})
    path = make_path(dev, mesh)
    pkt = ipv4(B4, C4, tp.PROTO_ICMP, icmp_echo(), ttl=64)
    host.send(pkt)
    pkt6 = ipv6(B6, A6, tp.PROTO_UDP, b"\x00" * 12, hop=9)
    host.send(pkt6)
    await async_wait_until(lambda: len(packets(mesh)) == 2, what="two packets")
    (n1, ch1, out1), (n2, ch2, out2) = packets(mesh)
    assert (n1, ch1, n2, ch2) == (PEER, L3_CHANNEL, PEER, L3_CHANNEL)
    assert out1[8] == 63 and ref_sum(out1[:20]) == 0xFFFF and out1[20:] == pkt[20:]
    assert out2[7] == 8 and out2[8:] == pkt6[8:]
    path.stop()


async def test_mesh_refusal_is_counted(pair: Any) -> None:
    dev, host = pair
    mesh = FakeMesh(routes_by_ip={C4: PEER}, accept=False)  # no route / congested link
    before = dropped("mesh_refused")
    path = make_path(dev, mesh)
    host.send(ipv4(B4, C4, tp.PROTO_UDP, b"\x00" * 8))
    await async_wait_until(lambda: dropped("mesh_refused") == before + 1)
    path.stop()


async def test_route_cache_follows_table_version(pair: Any) -> None:
    dev, host = pair
    mesh = FakeMesh(routes_by_ip={C4: PEER})
    path = make_path(dev, mesh)
    for _ in range(3):
        host.send(ipv4(B4, C4, tp.PROTO_UDP, b"\x00" * 8))
    await async_wait_until(lambda: len(packets(mesh)) == 3)
    assert mesh.lookups == 1  # one lookup per destination per route build
    mesh.routes_by_ip[C4] = 0x0D
    mesh.table.version += 1
    host.send(ipv4(B4, C4, tp.PROTO_UDP, b"\x00" * 8))
    await async_wait_until(lambda: len(packets(mesh)) == 4)
    assert packets(mesh)[-1][0] == 0x0D
    path.stop()


async def test_route_cache_is_bounded(pair: Any) -> None:
    dev, _host = pair
    mesh = FakeMesh()
    path = make_path(dev, mesh)
    path.stop()
    for i in range(ROUTE_CACHE + 500):  # exit traffic: a new destination per packet
        path._from_device(ipv4(B4, (0x0B000000 + i).to_bytes(4, "big"), tp.PROTO_UDP, b"\x00" * 8),
                          path._route_cache())
        assert len(path._routes) <= ROUTE_CACHE + 1


async def test_no_route_answers_icmp_unreachable(pair: Any) -> None:
    dev, host = pair
    mesh = FakeMesh()
    before = dropped("no_route")
    path = make_path(dev, mesh)
    pkt = ipv4(A4, C4, tp.PROTO_ICMP, icmp_echo())
    host.send(pkt)
    err = await recv(host)
    p = tp.parse(err)
    # from the unreachable destination: our own address would be a martian source on our device
    assert (p.src, p.dst, err[20], err[21]) == (C4, A4, 3, 0)
    assert err[28:] == pkt
    assert dropped("no_route") == before + 1
    assert mesh.sent == []
    path.stop()


async def test_ttl_one_answers_time_exceeded(pair: Any) -> None:
    dev, host = pair
    mesh = FakeMesh(routes_by_ip={A6: PEER})
    path = make_path(dev, mesh)
    host.send(ipv6(B6, A6, tp.PROTO_ICMPV6, icmp_echo(v6=True), hop=1))
    err = await recv(host)
    p = tp.parse(err)
    assert (p.src, p.dst, err[40], err[41]) == (ipaddress.IPv6Address(PEER6).packed, B6, 3, 0)  # "router"
    assert mesh.sent == []
    path.stop()


async def test_multicast_and_malformed_are_counted_not_sent(pair: Any) -> None:
    dev, host = pair
    mesh = FakeMesh()
    m0, b0 = dropped("multicast"), dropped("malformed_bad_version")
    path = make_path(dev, mesh)
    host.send(ipv6(B6, bytes([0xFF, 2]) + bytes(13) + b"\x02", 58, b"\x85\x00\x00\x00\x00\x00\x00\x00"))
    host.send(b"\x70" + b"\x00" * 40)
    await async_wait_until(lambda: dropped("malformed_bad_version") == b0 + 1)
    assert dropped("multicast") == m0 + 1
    assert mesh.sent == [] and mesh.lookups == 0
    path.stop()


async def test_read_batch_bounds_one_wakeup(pair: Any) -> None:
    dev, host = pair
    mesh = FakeMesh(routes_by_ip={C4: PEER})
    path = make_path(dev, mesh, read_batch=4)
    path.stop()  # drive on_readable by hand
    for i in range(10):
        host.send(ipv4(B4, C4, tp.PROTO_UDP, bytes([i]) * 8))
    path.on_readable()
    assert len(packets(mesh)) == 4
    assert [ch for _, ch, _ in mesh.sent] == [L3_BUNDLE_CHANNEL]  # one wake-up, one node: one bundle
    path.on_readable()
    path.on_readable()
    assert len(packets(mesh)) == 10
    assert [s[2][-1] for s in packets(mesh)] == list(range(10))  # order kept


async def test_mesh_to_device_batches_one_tick(pair: Any) -> None:
    dev, host = pair
    mesh = FakeMesh()
    path = make_path(dev, mesh)
    cb = mesh.handlers[L3_CHANNEL]
    pkts = [ipv4(C4, B4, tp.PROTO_UDP, bytes([i]) * 20) for i in range(5)]
    for p in pkts:
        cb(PEER, p)
    assert path._flush_scheduled and len(path._out) == 5  # queued, written once this tick ends
    got = [await recv(host) for _ in pkts]
    assert got == pkts
    path.stop()


async def test_mesh_to_device_only_own_addresses_unless_egress(pair: Any) -> None:
    dev, host = pair
    before = dropped("not_ours")
    mesh = FakeMesh()
    path = make_path(dev, mesh, egress=False)
    mesh.handlers[L3_CHANNEL](PEER, ipv4(C4, LAN, tp.PROTO_UDP, b"\x00" * 8))
    assert dropped("not_ours") == before + 1
    path.stop()
    mesh2 = FakeMesh()
    path2 = make_path(dev, mesh2, egress=True)
    pkt = ipv4(C4, LAN, tp.PROTO_UDP, b"\x00" * 8)
    mesh2.handlers[L3_CHANNEL](PEER, pkt)
    assert await recv(host) == pkt
    path2.stop()


async def test_too_big_from_mesh_answers_sender_node(pair: Any) -> None:
    dev, host = pair
    mesh = FakeMesh()
    path = make_path(dev, mesh, mtu=1280)
    big = ipv4(C4, B4, tp.PROTO_TCP, b"T" * 1400, df=True)
    mesh.handlers[L3_CHANNEL](PEER, big)
    assert len(mesh.sent) == 1
    node, ch, err = mesh.sent[0]
    assert (node, ch) == (PEER, L3_CHANNEL)
    p = tp.parse(err)
    assert (p.src, p.dst) == (B4, C4)
    assert struct.unpack_from("!BBHHH", err, 20)[0:2] == (3, 4)
    assert struct.unpack_from("!H", err, 26)[0] == 1280
    # IPv4 without DF is fragmented instead and written to the device
    nodf = ipv4(C4, B4, tp.PROTO_UDP, bytes(range(256)) * 6, df=False)
    frag0 = REGISTRY.value("meshgate_tun_fragmented_total")
    mesh.handlers[L3_CHANNEL](PEER, nodf)
    assert REGISTRY.value("meshgate_tun_fragmented_total") == frag0 + 1
    frags = [await recv(host), await recv(host)]
    assert all(len(f) <= 1280 for f in frags)
    assert b"".join(f[20:] for f in frags) == nodf[20:]
    path.stop()


async def test_too_big_from_device_answers_locally(pair: Any) -> None:
    dev, host = pair
    mesh = FakeMesh(routes_by_ip={A6: PEER})
    path = make_path(dev, mesh, mtu=1280)
    host.send(ipv6(B6, A6, tp.PROTO_UDP, b"u" * 1300))
    err = await recv(host)
    assert (err[40], err[41]) == (2, 0) and struct.unpack_from("!I", err, 44)[0] == 1280
    assert tp.parse(err).src == ipaddress.IPv6Address(PEER6).packed
    assert mesh.sent == []
    path.stop()


async def test_write_queue_is_bounded(pair: Any) -> None:
    dev, _host = pair
    before = dropped("write_queue_full")
    mesh = FakeMesh()
    path = make_path(dev, mesh, write_queue=3)
    for _ in range(5):
        mesh.handlers[L3_CHANNEL](PEER, ipv4(C4, B4, tp.PROTO_UDP, b"\x00" * 8))
    assert len(path._out) == 3
    assert dropped("write_queue_full") == before + 2
    path.stop()


def test_remote_cidrs() -> None:
    routes = [
        {"id": "0000000a", "proxy_cidrs": ["10.9.0.0/16"]},
        {"id": "0000000c", "proxy_cidrs": ["10.2.2.0/24", "0.0.0.0/0", "10.9.1.0/24", "fd00:2::/64", "junk"]},
    ]
    own = [ipaddress.ip_network("10.9.0.0/16")]
    got = remote_cidrs(routes, "0000000a", own)
    assert got == {ipaddress.ip_network("10.2.2.0/24"), ipaddress.ip_network("fd00:2::/64")}


# --------------------------------------------------------------------------- TUN offloads (virtio-net header)

GSO_TCPV4 = 1


def vnet_hdr(gso: int = 0, flags: int = 0, gso_size: int = 0) -> bytes:
    return struct.pack("<BBHHHH", flags, gso, 40, gso_size, 20, 16)


async def test_offload_super_packet_travels_whole(pair: Any) -> None:
    dev, host = pair
    mesh = FakeMesh(routes_by_ip={C4: PEER})
    path = make_path(dev, mesh, vnet=tp.VNET_HDR_LEN)
    hdr = vnet_hdr(GSO_TCPV4, tp.VNET_F_NEEDS_CSUM, 1340)
    big = ipv4(B4, C4, tp.PROTO_TCP, b"s" * 20000)  # far above the MTU: the kernel segments it later
    host.send(hdr + big)
    await async_wait_until(lambda: len(packets(mesh)) == 1)
    node, ch, out = packets(mesh)[0]
    assert (node, ch) == (PEER, L3_VNET_CHANNEL)
    assert out[:10] == hdr and out[10 + 8] == 63 and out[10 + 20:] == big[20:]
    assert ref_sum(out[10:30]) == 0xFFFF
    # a non-GSO packet above the MTU is still answered with ICMP, behind a zero header
    host.send(vnet_hdr() + ipv4(B4, C4, tp.PROTO_UDP, b"u" * 1400, df=True))
    err = await recv(host)
    assert err[:10] == tp.VNET_ZERO and (err[30], err[31]) == (3, 4)
    path.stop()


async def test_offload_device_receives_both_channels(pair: Any) -> None:
    dev, host = pair
    mesh = FakeMesh()
    path = make_path(dev, mesh, vnet=tp.VNET_HDR_LEN)
    plain = ipv4(C4, B4, tp.PROTO_UDP, b"p" * 8)
    mesh.handlers[L3_CHANNEL](PEER, plain)
    assert await recv(host) == tp.VNET_ZERO + plain  # zero header gathered in by writev
    sup = vnet_hdr(GSO_TCPV4, tp.VNET_F_NEEDS_CSUM, 1340) + ipv4(C4, B4, tp.PROTO_TCP, b"t" * 9000)
    mesh.handlers[L3_VNET_CHANNEL](PEER, sup)
    assert await recv(host) == sup
    path.stop()


async def test_plain_device_strips_or_refuses_offloaded_packets(pair: Any) -> None:
    dev, host = pair
    before = dropped("offload_unsupported")
    mesh = FakeMesh()
    path = make_path(dev, mesh, vnet=0)
    plain = ipv4(C4, B4, tp.PROTO_UDP, b"p" * 8)
    mesh.handlers[L3_VNET_CHANNEL](PEER, vnet_hdr() + plain)
    assert await recv(host) == plain
    mesh.handlers[L3_VNET_CHANNEL](PEER, vnet_hdr(GSO_TCPV4, 1, 1340) + ipv4(C4, B4, 6, b"t" * 3000))
    assert dropped("offload_unsupported") == before + 1
    mesh.handlers[L3_VNET_CHANNEL](PEER, b"\x00" * 5)
    assert dropped("malformed_short_vnet") >= 1
    path.stop()


# --------------------------------------------------------------------------- bundles


async def test_bundles_split_by_node_and_size_and_round_trip(pair: Any) -> None:
    dev, host = pair
    mesh = FakeMesh(routes_by_ip={C4: PEER, A4: 0x0D})
    path = make_path(dev, mesh, vnet=tp.VNET_HDR_LEN)
    path.stop()
    sent = []
    for i in range(40):  # 40 x ~1.2 KB to PEER, interleaved with 3 to node 0x0D
        pkt = vnet_hdr() + ipv4(B4, C4, tp.PROTO_UDP, bytes([i]) * 1200)
        sent.append(pkt)
        host.send(pkt)
        if i % 15 == 0:
            host.send(vnet_hdr() + ipv4(B4, A4, tp.PROTO_UDP, b"other"))
    super_pkt = vnet_hdr(GSO_TCPV4, 1, 1340) + ipv4(B4, C4, tp.PROTO_TCP, b"s" * 40000)
    host.send(super_pkt)
    path.on_readable()
    to_peer = [(ch, len(p)) for n, ch, p in mesh.sent if n == PEER]
    assert all(size <= BUNDLE_MAX for ch, size in to_peer if ch == L3_BUNDLE_CHANNEL)
    assert [ch for ch, _ in to_peer] == [L3_BUNDLE_CHANNEL, L3_BUNDLE_CHANNEL, L3_VNET_CHANNEL]
    got = [p for n, _, p in packets(mesh) if n == PEER]
    assert [p[10 + 20:] for p in got[:40]] == [p[10 + 20:] for p in sent]  # all there, in order
    assert got[40][10 + 20:] == super_pkt[10 + 20:]  # the super-packet travelled alone
    assert len([1 for n, _, _ in packets(mesh) if n == 0x0D]) == 3
    # the receiving side writes every packet of a bundle, in order
    rx = make_path(dev, FakeMesh(), egress=True, vnet=tp.VNET_HDR_LEN)
    for n, ch, payload in mesh.sent:
        if n == PEER and ch == L3_BUNDLE_CHANNEL:
            rx.on_bundle(PEER, payload)
    written = [await recv(host) for _ in range(40)]
    assert [w[30:] for w in written] == [p[30:] for p in sent]
    rx.stop()


async def test_malformed_bundles_are_counted(pair: Any) -> None:
    dev, _host = pair
    before = dropped("malformed_bundle")
    path = make_path(dev, FakeMesh(), egress=True)
    path.on_bundle(PEER, b"")
    path.on_bundle(PEER, b"\x07\x00\x01x")  # unknown format
    path.on_bundle(PEER, b"\x00\x05\x00abc")  # item longer than the bundle
    path.on_bundle(PEER, b"\x00\x00")  # half a length
    assert dropped("malformed_bundle") == before + 4
    assert path._out == []
    path.stop()
