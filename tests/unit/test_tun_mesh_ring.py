"""TunPath over the real mesh: three MeshServices joined by in-process ring links (A — B — C),
each with a datagram socketpair standing in for its TUN device. No root, no namespaces:
the mesh's datagram channel, relaying and the TUN path's routing by `lookup` are all real.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest

from meshgate.mesh import tun_packets as tp
from meshgate.mesh.service import MeshService
from meshgate.mesh.tun import TunPath
from tests.helpers import async_wait_until
from tests.mesh_testing import converged, node_config, ring_name, start_node, stop_all
from tests.unit.test_tun_packets import icmp_echo, ipv4, ref_sum

A, B, C = "a", "b", "c"  # roles (keys of the fixture), not node ids: those are each svc.node_id
IP = {A: "10.144.144.1", B: "10.144.144.2", C: "10.144.144.3"}


def packed(node: str) -> bytes:
    return ipaddress.IPv4Address(IP[node]).packed


@pytest.fixture
async def mesh() -> AsyncIterator[dict[str, tuple[MeshService, TunPath, socket.socket]]]:
    r1, r2 = ring_name(), ring_name()
    b = await start_node(node_config("b", IP[B] + "/24", listen=[f"ring://{r1}", f"ring://{r2}"]))
    a = await start_node(node_config("a", IP[A] + "/24", peers=[f"ring://{r1}"]))
    c = await start_node(node_config("c", IP[C] + "/24", peers=[f"ring://{r2}"],
                                     proxy_cidrs=["10.1.2.0/24"]))
    nodes = {A: a, B: b, C: c}
    out: dict[str, tuple[MeshService, TunPath, socket.socket]] = {}
    socks: list[socket.socket] = []
    loop = asyncio.get_running_loop()
    for role, svc in nodes.items():
        dev, host = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
        host.setblocking(False)
        socks += [dev, host]
        path = TunPath(loop, dev.fileno(), svc, ipaddress.IPv4Address(IP[role]), None, 1380,
                       egress=(role == C))
        path.start()
        out[role] = (svc, path, host)
    try:
        await async_wait_until(lambda: converged(nodes.values()), 10, "routes")
        yield out
    finally:
        for _svc, path, _host in out.values():
            path.stop()
        await stop_all(nodes.values())
        for s in socks:
            s.close()


async def recv(sock: socket.socket, timeout: float = 5.0) -> bytes:
    return await asyncio.wait_for(asyncio.get_running_loop().sock_recv(sock, 65536), timeout)


async def test_packet_crosses_two_hops_to_the_owner_device(mesh: Any) -> None:
    _, _, host_a = mesh[A]
    _, _, host_c = mesh[C]
    pkt = ipv4(packed(A), packed(C), tp.PROTO_ICMP, icmp_echo(), ttl=64)
    host_a.send(pkt)
    got = await recv(host_c)
    assert got[8] == 63 and ref_sum(got[:20]) == 0xFFFF and got[20:] == pkt[20:]
    # the reply finds its way back the same way
    reply = ipv4(packed(C), packed(A), tp.PROTO_ICMP, b"\x00" + icmp_echo()[1:], ttl=64)
    host_c.send(reply)
    back = await recv(host_a)
    assert back[20:] == reply[20:]


async def test_proxy_cidr_goes_to_its_owner_and_only_egress_accepts(mesh: Any) -> None:
    _, _, host_a = mesh[A]
    _, _, host_c = mesh[C]
    lan = ipaddress.IPv4Address("10.1.2.4").packed
    pkt = ipv4(packed(A), lan, tp.PROTO_UDP, b"\x00" * 8 + b"to-the-lan")
    host_a.send(pkt)
    got = await recv(host_c)  # C proxies 10.1.2.0/24 and is an egress node: written to its device
    assert got[16:20] == lan and got[20:] == pkt[20:]


async def test_too_big_at_the_receiver_answers_the_sender_through_the_mesh(mesh: Any) -> None:
    _, path_c, _ = mesh[C]
    _, _, host_a = mesh[A]
    path_c.mtu = 1280  # C's device is smaller than A's
    pkt = ipv4(packed(A), packed(C), tp.PROTO_UDP, b"\x00" * 8 + b"u" * 1320, df=True)
    host_a.send(pkt)
    err = await recv(host_a)  # relayed back from C through B
    p = tp.parse(err)
    assert (p.src, p.dst, err[20], err[21]) == (packed(C), packed(A), 3, 4)
    assert int.from_bytes(err[26:28], "big") == 1280
