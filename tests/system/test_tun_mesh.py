"""TUN data path end to end: three `meshgate run` processes in network namespaces A — B — C.

C proxies a LAN (plain 10.1.2.0/24 and fd12::/64, mapped as 10.2.2.0/24 and fd22::/64), is an exit to an
"internet" namespace (documentation addresses that exist only in these
namespaces; 198.51.100.99 is in C's exit.deny), and its TUN MTU (1280) is
smaller than A's (1380), so A's large packets get ICMP "too big" from C. A
uses C as its exit. See tun_topology.py for addresses.

The tests share one topology (module fixture) and run in file order; the last
one stops, kills and restarts nodes to check that routes, rules, nftables and
sysctls are gone after a clean stop and after kill -9 plus a restart.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import require_root, require_tool, wait_until
from tests.system.tun_topology import Topology

pytestmark = pytest.mark.system

LOOP = os.environ.get("MESHGATE_TEST_LOOP", "uvloop")
PORT = "7000"

A_CONF = """ipv4 = "10.144.144.1/24"
ipv6 = "fd00:144::1/64"
[mesh]
peers = ["tcp://172.31.9.2:11010"]
exit_nodes = ["10.144.144.3"]
[tun]
enable = true
mtu = 1380
"""
B_CONF = """ipv4 = "10.144.144.2/24"
[mesh]
listen = ["tcp://0.0.0.0:11010"]
peers = ["tcp://172.31.2.3:11010"]
"""
C_CONF = """ipv4 = "10.144.144.3/24"
ipv6 = "fd00:144::3/64"
[mesh]
listen = ["tcp://0.0.0.0:11010"]
proxy_cidrs = ["10.1.2.0/24", "10.1.2.0/24->10.2.2.0/24", "fd12::/64", "fd12::/64->fd22::/64"]
exit_node = true
[exit]
allow_private = true          # the test "internet" uses documentation ranges
deny = ["198.51.100.99/32"]
[tun]
enable = true
mtu = 1280
"""


@pytest.fixture(scope="module")
def topo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Topology]:
    require_root()
    require_tool("ip")
    require_tool("nft")
    require_tool("ss")
    t = Topology(f"mgt{os.getpid() % 100000}", Path(tmp_path_factory.mktemp("tun")), loop=LOOP)
    try:
        t.build()
        t.config("a", A_CONF)
        t.config("b", B_CONF)
        t.config("c", C_CONF)
        t.spawn("lan-echo", "lan", [sys.executable, "-m", "tests.system.tun_tools", "echo-server",
                                    "--tcp", f"0.0.0.0:{PORT},[::]:{PORT}",
                                    "--udp", f"0.0.0.0:{PORT},[::]:{PORT}"])
        t.spawn("inet-echo", "inet", [sys.executable, "-m", "tests.system.tun_tools", "echo-server",
                                      "--tcp", f"0.0.0.0:{PORT},[::]:{PORT}", "--udp", f"0.0.0.0:{PORT}"])
        t.start_line()
        yield t
    finally:
        t.destroy()


def rules(t: Topology, role: str, fam: str = "-4") -> list[str]:
    ours = ("5200", "5210", "5220")
    return [ln for ln in t.ip(role, fam, "rule").stdout.splitlines() if ln.split(":")[0] in ours]


def test_ping_virtual_ip_through_relay(topo: Topology) -> None:
    # each reply may take up to 3 s: on a loaded host (load 17 in CI once) 1 s was not always enough
    r = topo.tool("a", "ping", "10.144.144.3", "--count", "3", "--timeout", "3")
    assert r["replies"] == 3, r
    r6 = topo.wait_ping("a", "fd00:144::3", timeout=10)
    assert r6["replies"] == 1
    # A and C share no link: the only way is through B
    assert "10.144.144.0/24 dev meshgate0" in topo.ip("a", "route").stdout


def test_mesh_is_one_router_hop(topo: Topology) -> None:
    # TTL/hop limit 1 expires entering the mesh: ICMP Time Exceeded, as from a router whose
    # address is the owner node's virtual IP (traceroute shows the mesh as one hop; A's own
    # address would be a martian source on A's device); TTL 2 gets through.
    r = topo.tool("a", "ping", "10.144.144.3", "--count", "1", "--ttl", "1")
    assert r["replies"] == 0 and r["errors"] == ["icmp:11/0:10.144.144.3"], r
    r6 = topo.tool("a", "ping", "fd00:144::3", "--count", "1", "--ttl", "1")
    assert r6["replies"] == 0 and r6["errors"] == ["icmp:3/0:fd00:144::3"], r6
    # no route (an unassigned virtual IP): host unreachable, not silence
    r = topo.tool("a", "ping", "10.144.144.77", "--count", "1")
    assert r["replies"] == 0 and r["errors"] == ["icmp:3/0:10.144.144.77"], r
    assert topo.tool("a", "ping", "10.144.144.3", "--count", "1", "--ttl", "2")["replies"] == 1


def test_lan_through_proxy_cidr_plain_and_mapped(topo: Topology) -> None:
    wait_until(lambda: "10.2.2.0/24" in topo.ip("a", "route", "show", "proto", "77").stdout, timeout=10,
               what="proxy-CIDR routes on A")
    routes = topo.ip("a", "route", "show", "proto", "77").stdout
    assert "10.1.2.0/24 dev meshgate0" in routes and "metric 4096" in routes
    for dst in ("10.1.2.10", "10.2.2.10"):  # plain, then mapped (C translates 10.2.2.x -> 10.1.2.x)
        r = topo.tool("a", "tcp", dst, PORT, f"tcp-{dst}-" + "x" * 3000)
        assert r["ok"], r
        assert r["reply"] == f"10.1.2.1|tcp-{dst}-" + "x" * 3000  # masqueraded to C's LAN address
        u = topo.tool("a", "udp", dst, PORT, f"udp-{dst}")
        assert u == {"ok": True, "reply": f"10.1.2.1|udp-{dst}"}
    wait_until(lambda: "fd22::/64" in topo.ip("a", "-6", "route", "show", "proto", "77").stdout, timeout=10,
               what="IPv6 proxy-CIDR routes on A")
    for dst in ("fd12::10", "fd22::10"):  # IPv6, plain and mapped
        r = topo.tool("a", "tcp", dst, PORT, f"tcp6-{dst}-" + "y" * 5000)
        assert r["ok"] and r["reply"] == f"fd12::1|tcp6-{dst}-" + "y" * 5000, r
        u = topo.tool("a", "udp", dst, PORT, f"udp6-{dst}")
        assert u == {"ok": True, "reply": f"fd12::1|udp6-{dst}"}


def test_large_packets_get_icmp_too_big_from_smaller_mtu(topo: Topology) -> None:
    # A's TUN MTU is 1380, C's 1280: C answers a 1380-byte DF packet with ICMP frag-needed /
    # packet-too-big, which A's kernel accepts (checksums valid) and caches as the path MTU.
    for dst, fam in (("10.144.144.3", "-4"), ("fd00:144::3", "-6")):
        r = topo.tool("a", "df-udp", dst, "9", "1380")
        assert r == {"sent": True, "mtu": 1280}, r
        assert "mtu 1280" in topo.ip("a", fam, "route", "get", dst).stdout  # cached for every socket


def test_exit_v4_v6_while_own_link_keeps_working(topo: Topology) -> None:
    assert len(rules(topo, "a", "-4")) == 3  # + the bypass rule for the configured peer 172.31.9.2
    assert len(rules(topo, "a", "-6")) == 2
    for fam in ("-4", "-6"):
        assert "default dev meshgate0" in topo.ip("a", fam, "route", "show", "table", "19783").stdout
    link_before = topo.nsexec("a", "ss", "-Htn", "state", "established", "dst", "172.31.9.2").stdout
    assert link_before.strip(), "A has no mesh link to B"
    r = topo.tool("a", "tcp", "198.51.100.10", PORT, "via-exit")
    assert r == {"ok": True, "reply": "198.51.100.1|via-exit", "seconds": r.get("seconds")}, r
    r6 = topo.tool("a", "tcp", "2001:db8:100::10", PORT, "via-exit-v6")
    assert r6["ok"] and r6["reply"] == "2001:db8:100::1|via-exit-v6", r6
    # only SO_MARK protects the link from here on: without the per-peer bypass rule, an unmarked
    # link socket's packets to 172.31.9.2 (via A's default route) would enter the tunnel.
    topo.ip("a", "rule", "del", "priority", "5200")
    # longer than mesh_dead_after (5 s): a link that fell into its own tunnel would be dead by now
    deadline = time.monotonic() + 7
    while time.monotonic() < deadline:
        # 3 s per ping: a loaded CI box may be slow, but a link that fell into its own tunnel never answers
        assert topo.tool("a", "ping", "10.144.144.3", "--count", "1", "--timeout", "3")["replies"] == 1
        time.sleep(0.5)
    link_after = topo.nsexec("a", "ss", "-Htn", "state", "established", "dst", "172.31.9.2").stdout
    assert link_after.split()[2:4] == link_before.split()[2:4]  # the same TCP connection


def test_mesh_link_sockets_are_marked(topo: Topology) -> None:  # meshgate/mesh/link_tcp.py
    # SO_MARK is the general guard (any peer, inbound links too); the per-peer bypass rule
    # (priority 5200) only covers the configured peers of this node.
    out = topo.nsexec("a", "ss", "-Htnie", "state", "established", "dst", "172.31.9.2").stdout
    assert "fwmark:0x4d47" in out, f"A's mesh link socket is not marked (SO_MARK): {out}"
    listener = topo.nsexec("c", "ss", "-Htlnie", "sport", "11010").stdout
    assert "fwmark:0x4d47" in listener, listener


def test_exit_policy_rejects_denied_destination(topo: Topology) -> None:
    r = topo.tool("a", "tcp", "198.51.100.99", PORT, "nope", "--timeout", "5")
    assert not r["ok"], r
    # rejected, not lost: a dropped SYN would end in the tool's 5 s TimeoutError instead
    assert r["error"] in ("OSError", "ConnectionRefusedError"), r
    assert topo.tool("a", "tcp", "198.51.100.10", PORT, "yes")["ok"]


def test_link_down_10s_then_pings_resume(topo: Topology) -> None:
    topo.ip("b", "link", "set", "to_c", "down")
    try:
        time.sleep(10)  # the scenario itself: the B-C link stays down for 10 s
        assert topo.tool("a", "ping", "10.144.144.3", "--count", "1", "--timeout", "1")["replies"] == 0
    finally:
        topo.ip("b", "link", "set", "to_c", "up")
    topo.wait_ping("a", "10.144.144.3", timeout=45)
    assert topo.tool("a", "tcp", "10.1.2.10", PORT, "again")["ok"]


def _stop_clean(t: Topology, role: str) -> None:
    rc = t.stop(role)
    assert rc == 0, f"{role} exited with {rc}:\n{t.log(role)}"


def _clean(t: Topology) -> None:
    for fam in ("-4", "-6"):
        assert rules(t, "a", fam) == []
        assert t.ip("a", fam, "route", "show", "table", "19783", check=False).stdout.strip() == ""
        assert t.ip("a", fam, "route", "show", "proto", "77").stdout.strip() == ""
    assert "meshgate" not in t.nsexec("c", "nft", "list", "tables").stdout
    assert t.nsexec("c", "sysctl", "-n", "net.ipv4.ip_forward").stdout.strip() == "0"
    assert t.nsexec("c", "sysctl", "-n", "net.ipv6.conf.all.forwarding").stdout.strip() == "0"
    assert "meshgate0" not in t.ip("a", "link").stdout + t.ip("c", "link").stdout
    assert not list(t.workdir.glob("state-*/tun-*.json"))


def test_cleanup_after_stop_and_after_kill9_restart(topo: Topology) -> None:
    assert "meshgate_meshgate0" in topo.nsexec("c", "nft", "list", "tables").stdout
    assert topo.nsexec("c", "sysctl", "-n", "net.ipv4.ip_forward").stdout.strip() == "1"
    _stop_clean(topo, "a")
    _stop_clean(topo, "c")
    _clean(topo)

    topo.start_node("c")
    topo.start_node("a")
    topo.wait_ping("a", "10.144.144.3")
    wait_until(lambda: len(rules(topo, "a", "-6")) == 2, timeout=10, what="exit rules")
    topo.stop("a", signal.SIGKILL)
    topo.stop("c", signal.SIGKILL)
    # a crash leaves the rules, the nftables table and the sysctls behind ...
    assert len(rules(topo, "a")) == 3
    assert "meshgate_meshgate0" in topo.nsexec("c", "nft", "list", "tables").stdout

    topo.start_node("c")
    topo.start_node("a")
    topo.wait_ping("a", "10.144.144.3")
    # ... which the next start undoes before installing its own: one of each, not two
    wait_until(lambda: len(rules(topo, "a", "-6")) == 2, timeout=10, what="exit rules")
    assert len(rules(topo, "a")) == 3
    assert topo.nsexec("c", "nft", "list", "tables").stdout.count("meshgate_meshgate0") == 1
    assert "left by a previous run" in topo.log("a") and "left by a previous run" in topo.log("c")
    assert topo.tool("a", "tcp", "198.51.100.10", PORT, "after-crash")["ok"]
    _stop_clean(topo, "a")
    _stop_clean(topo, "c")
    _clean(topo)


def test_tun_over_udp_links(tmp_path: Path) -> None:
    """The same line over udp:// links (meshgate/mesh/link_udp.py): ping and TCP A→C through B,
    A's exit default route through C does not swallow A's own (marked) UDP link socket."""
    require_root()
    t = Topology(f"mgu{os.getpid() % 100000}", tmp_path, loop=LOOP)
    udp = {"tcp://": "udp://"}
    confs = {role: conf for role, conf in (("a", A_CONF), ("b", B_CONF), ("c", C_CONF))}
    try:
        t.build()
        for role, conf in confs.items():
            for old, new in udp.items():
                conf = conf.replace(old, new)
            t.config(role, conf)
        t.spawn("lan-echo", "lan", [sys.executable, "-m", "tests.system.tun_tools", "echo-server",
                                    "--tcp", f"0.0.0.0:{PORT}", "--udp", f"0.0.0.0:{PORT}"])
        t.start_line("udp mesh")
        assert t.tool("a", "ping", "10.144.144.3", "--count", "3", "--timeout", "3")["replies"] == 3
        links = t.nsexec("a", "ss", "-Huanie", "dst", "172.31.9.2").stdout
        assert "fwmark:0x4d47" in links, f"A's udp link socket is not marked: {links}"
        wait_until(lambda: "10.1.2.0/24" in t.ip("a", "route", "show", "proto", "77").stdout, timeout=10,
                   what="proxy-CIDR routes on A")
        r = t.tool("a", "tcp", "10.1.2.10", PORT, "over-udp-" + "z" * 20000)
        assert r["ok"] and r["reply"] == "10.1.2.1|over-udp-" + "z" * 20000, r
        # super-packets of at most 32 KB on a node with udp:// links: a lost piece loses less
        dev = t.nsexec("a", "ip", "-d", "link", "show", "dev", "meshgate0").stdout
        assert "gso_max_size 32768 " in dev, dev
        assert t.tool("a", "udp", "10.1.2.10", PORT, "dgram") == {"ok": True, "reply": "10.1.2.1|dgram"}
        # longer than mesh_dead_after with the exit default route in place: the link stays up
        deadline = time.monotonic() + 6
        while time.monotonic() < deadline:
            assert t.tool("a", "ping", "10.144.144.3", "--count", "1", "--timeout", "1")["replies"] == 1
            time.sleep(0.5)
        assert "mesh link down" not in t.log("a")
        assert "udp://" in t.log("a") and "not implemented" not in t.log("a")
    finally:
        t.destroy()
