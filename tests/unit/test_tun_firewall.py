"""Access rules on TUN packets (meshgate/mesh/tun_firewall.py, egress/acl.py PacketAccess):
flow keys, connection tracking, the ICMP budget, and the TUN path's answers, without a network."""

from __future__ import annotations

import asyncio
import ipaddress
import struct
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshgate.config import from_dict
from meshgate.egress.acl import Acl, PacketAccess, Source
from meshgate.egress.rules import ExitRules
from meshgate.mesh import tun_firewall as fw
from meshgate.mesh import tun_packets as tp
from meshgate.mesh.tun import DENY_ICMP_BURST, L3_CHANNEL
from meshgate.metrics import REGISTRY
from tests.unit.test_tun_packets import A4, A6, B4, B6, icmp_echo, ipv4, ipv6
from tests.unit.test_tun_path import PEER, FakeMesh, dropped, make_path, pair, recv

__all__ = ["pair"]  # the socketpair fixture, shared with test_tun_path

OTHER = 0x0D  # a second member
LAN = ipaddress.IPv4Address("10.1.2.7").packed


def tcp(sport: int, dport: int, flags: int = 0x02) -> bytes:
    return struct.pack("!HHIIBBHHH", sport, dport, 1, 0, 0x50, flags, 65535, 0, 0)


def udp(sport: int, dport: int, data: bytes = b"d") -> bytes:
    return struct.pack("!HHHH", sport, dport, 8 + len(data), 0) + data


def echo_reply(ident: int = 7, v6: bool = False) -> bytes:
    return struct.pack("!BBHHH", 129 if v6 else 0, 0, 0, ident, 1) + b"x" * 8


@dataclass
class RuleAccess:
    """The real [[acl]] decision over a fixed table of who each node is."""

    acl: Acl
    who: dict[int, Source] = field(default_factory=dict)
    asked: int = 0

    @property
    def active(self) -> bool:
        return self.acl.active

    @property
    def version(self) -> object:
        return self.acl

    def decide(self, node: int, dst: bytes, port: int, proto: str) -> int | None:
        self.asked += 1
        d = self.acl.decide(self.who.get(node, Source(node)), None if dst in (B4, B6) else
                            ipaddress.ip_address(dst), port, proto)
        return (d.rule if d.rule is not None else fw.NO_RULES) if d.allowed else None


def access(*rules: dict[str, object]) -> RuleAccess:
    acl = Acl(from_dict({"acl": list(rules)}).acl, (ipaddress.ip_network("10.1.2.0/24"),))
    return RuleAccess(acl, {PEER: Source(PEER, "alice", ("laptops",)), OTHER: Source(OTHER, "mallory")})


SSH_ONLY = {"from": ["group:laptops"], "to": ["self:22"], "proto": "tcp"}


# --------------------------------------------------------------------------- flow keys


def test_ports_and_keys() -> None:
    pkt = ipv4(A4, B4, tp.PROTO_TCP, tcp(40000, 22))
    p = tp.parse(pkt)
    assert fw.ports(pkt, p) == (40000, 22)
    assert fw.inbound_key(PEER, pkt, p) == (PEER, 6, A4, 40000, B4, 22)
    # what B sends back to A carries the same key as A's packets to B
    back = ipv4(B4, A4, tp.PROTO_TCP, tcp(22, 40000, 0x12))
    assert fw.outbound_key(PEER, back, tp.parse(back)) == fw.inbound_key(PEER, pkt, p)
    u6 = ipv6(A6, B6, tp.PROTO_UDP, udp(5353, 53))
    assert fw.ports(u6, tp.parse(u6)) == (5353, 53)
    # echo: the identifier both ways, so a reply matches the request that went out
    req = ipv4(B4, A4, tp.PROTO_ICMP, icmp_echo())
    rep = ipv4(A4, B4, tp.PROTO_ICMP, echo_reply())
    assert fw.outbound_key(PEER, req, tp.parse(req)) == fw.inbound_key(PEER, rep, tp.parse(rep))
    req6 = ipv6(B6, A6, tp.PROTO_ICMPV6, icmp_echo(v6=True))
    rep6 = ipv6(A6, B6, tp.PROTO_ICMPV6, echo_reply(v6=True))
    assert fw.outbound_key(PEER, req6, tp.parse(req6)) == fw.inbound_key(PEER, rep6, tp.parse(rep6))
    # no ports: a non-first fragment, a truncated header, another protocol
    frag = bytearray(ipv4(A4, B4, tp.PROTO_UDP, b"z" * 16, df=False))
    struct.pack_into("!H", frag, 6, 4)  # offset 32 bytes
    assert fw.ports(frag, tp.parse(frag)) == (0, 0)
    short = ipv4(A4, B4, tp.PROTO_TCP, b"\x01")
    assert fw.ports(short, tp.parse(short)) == (0, 0)
    gre = ipv4(A4, B4, 47, b"g" * 8)
    assert fw.ports(gre, tp.parse(gre)) == (0, 0) and fw.proto_name(47) == "other"


@pytest.mark.parametrize("v6", [False, True])
def test_an_icmp_error_is_keyed_by_the_packet_it_quotes(v6: bool) -> None:
    # B sent a SYN to A; A (or a router behind it) answers with an ICMP error built by the
    # project's own builder: the quote leads back to the flow B started
    syn = ipv6(B6, A6, tp.PROTO_TCP, tcp(40000, 22)) if v6 else ipv4(B4, A4, tp.PROTO_TCP, tcp(40000, 22))
    ps = tp.parse(syn)
    err = tp.icmp_error(syn, ps, tp.ADMIN_PROHIBITED, A6 if v6 else A4)
    assert err is not None
    pe = tp.parse(err)
    assert fw.ports(err, pe) is None and fw.inbound_key(PEER, err, pe) is None
    assert fw.quoted_key(PEER, err, pe) == fw.outbound_key(PEER, syn, ps)
    # a quote cut short of 8 bytes after its header relates to nothing
    cut = err[: pe.header_len + 8 + ps.header_len + 4]
    cut = (ipv6(A6, B6, tp.PROTO_ICMPV6, cut[40:]) if v6 else ipv4(A4, B4, tp.PROTO_ICMP, cut[20:]))
    assert fw.quoted_key(PEER, cut, tp.parse(cut)) is None


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=120), st.sampled_from([tp.PROTO_TCP, tp.PROTO_UDP, tp.PROTO_ICMP, 47]),
       st.booleans())
def test_any_payload_is_decided_without_raising(body: bytes, proto: int, v6: bool) -> None:
    if v6:
        proto = tp.PROTO_ICMPV6 if proto == tp.PROTO_ICMP else proto
        pkt = ipv6(A6, B6, proto, body)
    else:
        pkt = ipv4(A4, B4, proto, body)
    f = fw.Firewall(access(SSH_ONLY), 8)
    verdict, name, port = f.inbound(OTHER, pkt, tp.parse(pkt), 0, 0.0)
    assert verdict is None or verdict == fw.TRACKED or verdict >= 0
    assert name in ("tcp", "udp", "icmp", "other", "") and 0 <= port <= 65535


# --------------------------------------------------------------------------- conntrack


@pytest.mark.parametrize(("proto", "timeout"), [(tp.PROTO_TCP, 720.0), (tp.PROTO_UDP, 180.0),
                                                (tp.PROTO_ICMP, 10.0), (47, 10.0)])
def test_flows_live_as_long_as_nebulas(proto: int, timeout: float) -> None:
    ct = fw.ConnTrack(16)
    key = (PEER, proto, A4, 1, B4, 2)
    ct.add(key, 100.0)
    assert ct.hit(key, 100.0 + timeout - 0.5)  # refreshes: a flow with traffic lives on
    assert ct.hit(key, 100.0 + 2 * timeout - 1.0)
    assert not ct.hit(key, 100.0 + 3 * timeout + 1.0) and len(ct) == 0 and ct.expired == 1


def test_the_table_is_a_bounded_lru() -> None:
    ct = fw.ConnTrack(3)
    keys = [(PEER, 17, A4, i, B4, 53) for i in range(5)]
    for i, k in enumerate(keys[:3]):
        ct.add(k, float(i))
    assert ct.hit(keys[0], 5.0)  # now the most recent
    ct.add(keys[3], 6.0)
    assert len(ct) == 3 and ct.evicted == 1
    assert not ct.hit(keys[1], 6.0) and ct.hit(keys[0], 6.0) and ct.hit(keys[2], 6.0)
    # expired entries at the old end go first, and are not counted as evictions
    ct.add(keys[4], 1000.0)
    assert ct.evicted == 1 and len(ct) == 1


def test_budget() -> None:
    b = fw.Budget(rate=10.0, burst=3.0)
    assert [b.take(0.0) for _ in range(4)] == [True, True, True, False]
    assert not b.take(0.05) and b.take(0.2)  # 10 a second refills
    assert [b.take(100.0) for _ in range(4)] == [True, True, True, False]  # no more than the burst


# --------------------------------------------------------------------------- the firewall


def test_rules_allow_new_flows_and_replies_pass_only_from_the_node_they_are_with() -> None:
    acc = access(SSH_ONLY)
    f = fw.Firewall(acc, 64)
    ssh = ipv4(A4, B4, tp.PROTO_TCP, tcp(40000, 22))
    assert f.inbound(PEER, ssh, tp.parse(ssh), 0, 0.0) == (0, "tcp", 22)  # rule 0, now tracked
    assert f.inbound(PEER, ssh, tp.parse(ssh), 0, 1.0)[0] == fw.TRACKED
    assert acc.asked == 1
    # the same 5-tuple from another member is a new flow, decided by who that member is
    assert f.inbound(OTHER, ssh, tp.parse(ssh), 0, 1.0) == (None, "tcp", 22)
    web = ipv4(A4, B4, tp.PROTO_TCP, tcp(40001, 80))
    assert f.inbound(PEER, web, tp.parse(web), 0, 1.0) == (None, "tcp", 80)  # by port
    dns = ipv4(A4, B4, tp.PROTO_UDP, udp(40001, 22))
    assert f.inbound(PEER, dns, tp.parse(dns), 0, 1.0)[0] is None  # by protocol
    ping = ipv4(A4, B4, tp.PROTO_ICMP, icmp_echo())
    assert f.inbound(PEER, ping, tp.parse(ping), 0, 1.0) == (None, "icmp", 0)

    # B starts flows to A: the answers pass (no rule allows them), from A's node only
    out = ipv4(B4, A4, tp.PROTO_TCP, tcp(50000, 8080))
    f.outbound(PEER, out, tp.parse(out), 0, 2.0)
    back = ipv4(A4, B4, tp.PROTO_TCP, tcp(8080, 50000, 0x12))
    assert f.inbound(PEER, back, tp.parse(back), 0, 2.1)[0] == fw.TRACKED
    assert f.inbound(OTHER, back, tp.parse(back), 0, 2.1)[0] is None  # a member forging A's reply
    req = ipv4(B4, A4, tp.PROTO_ICMP, icmp_echo())
    f.outbound(PEER, req, tp.parse(req), 0, 3.0)
    rep = ipv4(A4, B4, tp.PROTO_ICMP, echo_reply())
    assert f.inbound(PEER, rep, tp.parse(rep), 0, 3.5)[0] == fw.TRACKED
    assert f.inbound(PEER, rep, tp.parse(rep), 0, 14.0)[0] is None  # ICMP flows last 10 s

    # an ICMP error passes when it is about a flow B has (its own, or one a rule let in)
    refused = tp.icmp_error(out, tp.parse(out), tp.ADMIN_PROHIBITED, A4)
    assert refused is not None
    assert f.inbound(PEER, refused, tp.parse(refused), 0, 4.0) == (fw.TRACKED, "icmp", 0)
    stray = ipv4(B4, A4, tp.PROTO_TCP, tcp(50001, 8080))
    unrelated = tp.icmp_error(stray, tp.parse(stray), tp.NO_ROUTE, A4)
    assert unrelated is not None
    assert f.inbound(PEER, unrelated, tp.parse(unrelated), 0, 4.0) == (None, "icmp", 0)


def test_new_rules_decide_again_what_old_rules_let_in_but_not_the_nodes_own_flows() -> None:
    acc = access(SSH_ONLY, {"from": ["*"], "to": ["self:80"], "proto": "tcp"})
    f = fw.Firewall(acc, 64)
    web = ipv4(A4, B4, tp.PROTO_TCP, tcp(40001, 80))
    assert f.inbound(OTHER, web, tp.parse(web), 0, 0.0)[0] == 1
    answer = ipv4(B4, A4, tp.PROTO_TCP, tcp(80, 40001, 0x12))
    f.outbound(OTHER, answer, tp.parse(answer), 0, 0.1)  # the answer: the same flow, still a rule's
    own = ipv4(B4, A4, tp.PROTO_TCP, tcp(50000, 8080))
    f.outbound(PEER, own, tp.parse(own), 0, 0.1)
    assert (len(f.allowed), len(f.own)) == (1, 1)
    acc.acl = Acl(from_dict({"acl": [SSH_ONLY]}).acl)  # a reload: port 80 is no longer open
    assert f.on()  # noticed here, as the TUN path asks before every packet
    assert f.inbound(OTHER, web, tp.parse(web), 0, 1.0)[0] is None and f.rechecks == 1
    back = ipv4(A4, B4, tp.PROTO_TCP, tcp(8080, 50000, 0x12))
    assert f.inbound(PEER, back, tp.parse(back), 0, 1.0)[0] == fw.TRACKED


def test_a_flood_of_allowed_flows_does_not_push_out_the_nodes_own() -> None:
    f = fw.Firewall(access({"from": ["*"], "to": ["self"]}), 8)
    own = ipv4(B4, A4, tp.PROTO_UDP, udp(50000, 53))
    f.outbound(PEER, own, tp.parse(own), 0, 0.0)
    for i in range(100):
        pkt = ipv4(A4, B4, tp.PROTO_UDP, udp(1000 + i, 9))
        assert f.inbound(OTHER, pkt, tp.parse(pkt), 0, 0.0)[0] == 0
    assert len(f) == 5 and f.evicted == 96  # bounded: 4 + 4
    back = ipv4(A4, B4, tp.PROTO_UDP, udp(53, 50000))
    assert f.inbound(PEER, back, tp.parse(back), 0, 0.5)[0] == fw.TRACKED


# --------------------------------------------------------------------------- the TUN path


async def test_a_denied_packet_gets_admin_prohibited_through_the_mesh(pair: Any) -> None:
    dev, host = pair
    mesh = FakeMesh()
    path = make_path(dev, mesh, firewall=fw.Firewall(access(SSH_ONLY), 64))
    denied0 = REGISTRY.value("meshgate_tun_acl_total", "denied", "none", "tcp")
    syn = ipv4(A4, B4, tp.PROTO_TCP, tcp(40000, 80))
    mesh.handlers[L3_CHANNEL](PEER, syn)
    assert REGISTRY.value("meshgate_tun_acl_total", "denied", "none", "tcp") == denied0 + 1
    [(node, ch, err)] = mesh.sent
    assert (node, ch) == (PEER, L3_CHANNEL)
    pe = tp.parse(err)
    assert (pe.src, pe.dst, pe.proto) == (B4, A4, tp.PROTO_ICMP)
    assert (err[20], err[21]) == (3, 13) and err[28:] == syn  # quoting what was refused
    # IPv6: ICMPv6 destination unreachable, administratively prohibited (type 1, code 1)
    syn6 = ipv6(A6, B6, tp.PROTO_TCP, tcp(40000, 80))
    mesh.handlers[L3_CHANNEL](PEER, syn6)
    err6 = mesh.sent[-1][2]
    assert tp.parse(err6).dst == A6 and (err6[40], err6[41]) == (1, 1)
    # allowed: to the device, counted by the rule that allowed it
    new0 = REGISTRY.value("meshgate_tun_acl_total", "new", "0", "tcp")
    ssh = ipv4(A4, B4, tp.PROTO_TCP, tcp(40000, 22))
    mesh.handlers[L3_CHANNEL](PEER, ssh)
    assert await recv(host) == ssh
    assert REGISTRY.value("meshgate_tun_acl_total", "new", "0", "tcp") == new0 + 1
    path.stop()


async def test_answers_to_denials_are_rate_limited(pair: Any) -> None:
    dev, _host = pair
    mesh = FakeMesh()
    path = make_path(dev, mesh, firewall=fw.Firewall(access(SSH_ONLY), 64))
    limited0 = dropped("acl_icmp_rate")
    for i in range(int(DENY_ICMP_BURST) + 30):
        mesh.handlers[L3_CHANNEL](OTHER, ipv4(A4, B4, tp.PROTO_UDP, udp(1000 + i, 9)))
    # a burst's worth of answers (plus what refilled while the loop ran), the rest counted
    assert int(DENY_ICMP_BURST) <= len(mesh.sent) < int(DENY_ICMP_BURST) + 30
    assert dropped("acl_icmp_rate") - limited0 == int(DENY_ICMP_BURST) + 30 - len(mesh.sent)
    path.stop()


async def test_replies_to_flows_this_node_started_pass(pair: Any) -> None:
    dev, host = pair
    mesh = FakeMesh(routes_by_ip={A4: PEER})
    path = make_path(dev, mesh, firewall=fw.Firewall(access(SSH_ONLY), 64))
    host.send(ipv4(B4, A4, tp.PROTO_UDP, udp(50000, 53)))  # a local program asks A something
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 2
    while not mesh.sent and loop.time() < deadline:
        await asyncio.sleep(0.01)
    assert mesh.sent and mesh.sent[0][0] == PEER
    answer = ipv4(A4, B4, tp.PROTO_UDP, udp(53, 50000, b"answer"))
    mesh.handlers[L3_CHANNEL](PEER, answer)
    assert await recv(host) == answer
    mesh.handlers[L3_CHANNEL](OTHER, answer)  # the same answer from another member: refused
    assert mesh.sent[-1][0] == OTHER and mesh.sent[-1][2][20:22] == b"\x03\x0d"
    path.stop()


async def test_without_rules_nothing_is_tracked(pair: Any) -> None:
    dev, host = pair
    mesh = FakeMesh(routes_by_ip={A4: PEER})
    f = fw.Firewall(access(), 64)
    path = make_path(dev, mesh, firewall=f)
    pkt = ipv4(A4, B4, tp.PROTO_TCP, tcp(40000, 80))
    mesh.handlers[L3_CHANNEL](OTHER, pkt)
    assert await recv(host) == pkt
    host.send(ipv4(B4, A4, tp.PROTO_UDP, udp(50000, 53)))
    await recv_mesh(mesh)
    assert len(f) == 0
    path.stop()


async def recv_mesh(mesh: FakeMesh) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 2
    while not mesh.sent and loop.time() < deadline:
        await asyncio.sleep(0.01)
    assert mesh.sent


# --------------------------------------------------------------------------- PacketAccess


def test_packet_access_decides_by_the_authenticated_node_and_the_real_destination() -> None:
    cfg = from_dict({
        "node": {"ipv4": "10.144.144.3/24"},
        "mesh": {"proxy_cidrs": ["10.1.2.0/24->10.2.2.0/24"]},
        "acl": [{"from": ["node:alice"], "to": ["self:22", "10.1.2.0/24:80"], "proto": "tcp"},
                {"from": ["10.144.144.0/24"], "to": ["self"], "proto": "icmp"}],
    })
    vip = SimpleNamespace(ip=ipaddress.ip_address("10.144.144.1"))
    rec = SimpleNamespace(name="alice", cert=b"", ipv4=vip)
    mesh: Any = SimpleNamespace(table=SimpleNamespace(records={PEER: rec}),
                                trust=SimpleNamespace(certificate_mode=False))
    pa = PacketAccess(ExitRules(cfg), mesh)
    own = ipaddress.ip_address("10.144.144.3").packed
    assert pa.active
    assert pa.decide(PEER, own, 22, "tcp") == 0
    assert pa.decide(PEER, own, 23, "tcp") is None
    assert pa.decide(OTHER, own, 22, "tcp") is None  # not alice: no record, no name
    # the mapped address is its real network to the rules
    assert pa.decide(PEER, ipaddress.ip_address("10.2.2.9").packed, 80, "tcp") == 0
    assert pa.decide(PEER, ipaddress.ip_address("10.1.3.9").packed, 80, "tcp") is None
    assert pa.decide(PEER, own, 0, "icmp") == 1
    assert not PacketAccess(ExitRules(from_dict({})), mesh).active
