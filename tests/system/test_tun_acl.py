"""Access rules on TUN packets, end to end: `meshgate run` processes in network namespaces
A — B — C (tun_topology.py), certificate mode, TUN on every node.

C has [[acl]] rules: the laptops group (A's certificate) may reach C's own virtual IP and its
proxied LAN at TCP port 7000, and ping C; only A's virtual IP (by CIDR) may reach port 7002.
B holds the network secret and a valid certificate of another group ("servers"): a member,
but none of the rules is for it. A's packets to C are relayed by B (sealed end to end), B's
go over B's own link to C: C decides both by the node the mesh authenticated.

What the user sees: a denied TCP connect fails at once with "No route to host" (ICMP
administratively prohibited, EHOSTUNREACH; over IPv6 EACCES), a denied ping shows "packet
filtered" (ICMP 3/13), and flows C itself starts work although no rule lets their answers in
(connection tracking).
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from meshgate.mesh import identity
from tests.helpers import require_root, require_tool, wait_until
from tests.identity_testing import TestCA
from tests.system.tun_topology import REPO, Topology

pytestmark = pytest.mark.system

LOOP = os.environ.get("MESHGATE_TEST_LOOP", "uvloop")
PORTS = ("7000", "7001", "7002")

A_CONF = """ipv4 = "10.144.144.1/24"
ipv6 = "fd00:144::1/64"
[mesh]
peers = ["tcp://172.31.1.2:11010"]
[tun]
enable = true
"""
B_CONF = """ipv4 = "10.144.144.2/24"
[mesh]
listen = ["tcp://0.0.0.0:11010"]
peers = ["tcp://172.31.2.3:11010"]
[tun]
enable = true
"""
C_CONF = """ipv4 = "10.144.144.3/24"
ipv6 = "fd00:144::3/64"
[mesh]
listen = ["tcp://0.0.0.0:11010"]
proxy_cidrs = ["10.1.2.0/24"]
[tun]
enable = true

[[acl]]
from = ["group:laptops"]
to = ["self:7000", "10.1.2.0/24:7000"]
proto = "tcp"

[[acl]]
from = ["group:laptops"]
to = ["self"]
proto = "icmp"

[[acl]]
from = ["10.144.144.1/32"]
to = ["self:7002"]
proto = "tcp"
"""
GRANTS = {
    "a": ("10.144.144.1/24", {"ip6": "fd00:144::1/64", "groups": ("laptops",)}),
    "b": ("10.144.144.2/24", {"groups": ("servers",)}),
    "c": ("10.144.144.3/24", {"ip6": "fd00:144::3/64", "cidrs": ("10.1.2.0/24",), "groups": ("servers",)}),
}


@pytest.fixture(scope="module")
def topo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Topology]:
    require_root()
    require_tool("ip")
    require_tool("nft")
    work = Path(tmp_path_factory.mktemp("tunacl"))
    t = Topology(f"mga{os.getpid() % 100000}", work, loop=LOOP)
    ca = TestCA(work, network="tuntest")
    try:
        t.build()
        for role, conf in (("a", A_CONF), ("b", B_CONF), ("c", C_CONF)):
            ident = identity.load_or_create(work / f"state-{role}")
            ip, grants = GRANTS[role]
            cert = ca.issue(role, ident, ip, **grants)
            t.config(role, f'certificate = "{cert}"\nca = ["{ca.ca_file}"]\n{conf}')
        servers = ",".join(f"0.0.0.0:{p},[::]:{p}" for p in PORTS)
        for key, role in (("c-echo", "c"), ("lan-echo", "lan"), ("a-echo", "a")):
            t.spawn(key, role, [sys.executable, "-m", "tests.system.tun_tools", "echo-server",
                                "--tcp", servers, "--udp", "0.0.0.0:7000"])
        t.start_line("certificate mesh with [[acl]] on C")  # A pings C: the icmp rule
        wait_until(lambda: "10.1.2.0/24" in t.ip("b", "route", "show", "proto", "77").stdout
                   and "10.1.2.0/24" in t.ip("a", "route", "show", "proto", "77").stdout,
                   timeout=20, what="C's proxy-CIDR route on A and B")
        yield t
    finally:
        t.destroy()


def connect(t: Topology, role: str, dst: str, port: str) -> dict[str, object]:
    # 5 s: a packet dropped without an answer would end in the tool's TimeoutError
    return t.tool(role, "tcp", dst, port, f"{role}->{dst}:{port}", "--timeout", "5")


def refused(r: dict[str, object], code: int = errno.EHOSTUNREACH) -> bool:
    return r["ok"] is False and r.get("errno") == code


def metric(t: Topology, role: str, name: str, *labels: str) -> float:
    """A counter on a node, summed over the series whose labels include every `k="v"` given."""
    code = ("import urllib.request,sys;"
            "sys.stdout.write(urllib.request.urlopen('http://127.0.0.1:15888/metrics',timeout=5).read().decode())")
    text = t.nsexec(role, sys.executable, "-c", code, check=True).stdout
    total = 0.0
    for line in text.splitlines():
        if line.startswith((name + "{", name + " ")) and all(lab in line for lab in labels):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_an_allowed_member_connects(topo: Topology) -> None:
    for dst in ("10.144.144.3", "fd00:144::3"):
        r = connect(topo, "a", dst, "7000")
        assert r["ok"] and str(r["reply"]).endswith(f"|a->{dst}:7000"), r
    r = connect(topo, "a", "10.1.2.10", "7000")  # the proxied LAN behind C (egress, masqueraded)
    assert r["ok"] and r["reply"] == "10.1.2.1|a->10.1.2.10:7000", r
    r = connect(topo, "a", "10.144.144.3", "7002")  # by the CIDR of A's own virtual IP
    assert r["ok"], r


def test_denied_by_port_and_protocol_fail_at_once(topo: Topology) -> None:
    before = metric(topo, "c", "meshgate_tun_acl_total", 'verdict="denied"', 'proto="tcp"')
    assert refused(connect(topo, "a", "10.144.144.3", "7001"))
    assert refused(connect(topo, "a", "fd00:144::3", "7001"), errno.EACCES)  # ICMPv6 1/1
    assert refused(connect(topo, "a", "10.1.2.10", "7001"))
    assert metric(topo, "c", "meshgate_tun_acl_total", 'verdict="denied"', 'proto="tcp"') >= before + 3
    # UDP is not in the tcp rule: nothing comes back (an unconnected UDP socket ignores the ICMP)
    assert topo.tool("a", "udp", "10.144.144.3", "7000", "dgram", "--timeout", "1") == \
        {"ok": False, "error": "timeout"}


def test_a_member_of_another_group_is_refused(topo: Topology) -> None:
    # B: the network secret and a valid certificate, of the "servers" group
    for dst in ("10.144.144.3", "10.1.2.10"):
        assert refused(connect(topo, "b", dst, "7000")), dst
    r = topo.tool("b", "ping", "10.144.144.3", "--count", "1", "--timeout", "3")
    assert r["replies"] == 0 and r["errors"] == ["icmp:3/13:10.144.144.3"], r  # "Packet filtered"
    assert refused(connect(topo, "b", "10.144.144.3", "7002"))


def test_a_forged_source_address_is_still_its_sender(topo: Topology) -> None:
    # B writes A's virtual IP into a SYN for the port only A's address may reach: C decides
    # by the node the packet came from (B), not by the address in it
    before = metric(topo, "c", "meshgate_tun_acl_total", 'verdict="denied"', 'proto="tcp"')
    assert topo.tool("b", "raw-syn", "10.144.144.1", "10.144.144.3", "7002") == {"sent": True}
    wait_until(lambda: metric(topo, "c", "meshgate_tun_acl_total", 'verdict="denied"', 'proto="tcp"')
               > before, timeout=10, what="C denying B's forged SYN")


def test_replies_to_flows_the_node_started_pass(topo: Topology) -> None:
    # no rule lets anything from A in except TCP 7000/7002 and ICMP to C's address; C's own
    # connections to A (answers from A's port 7001, UDP from 7000) pass by connection tracking
    r = connect(topo, "c", "10.144.144.1", "7001")
    assert r["ok"] and r["reply"] == "10.144.144.3|c->10.144.144.1:7001", r
    u = topo.tool("c", "udp", "10.144.144.1", "7000", "dgram")
    assert u == {"ok": True, "reply": "10.144.144.3|dgram"}, u
    assert topo.tool("c", "ping", "10.144.144.2", "--count", "1", "--timeout", "3")["replies"] == 1  # B too
    wait_until(lambda: metric(topo, "c", "meshgate_tun_conntrack_flows") >= 3, timeout=5,
               what="C's tracked flows in its metrics (published each second)")


def test_acl_test_agrees(topo: Topology) -> None:
    def decide(*argv: str) -> str:
        r = subprocess.run([sys.executable, "-m", "meshgate", "acl", "test", *argv,
                            "-c", str(topo.workdir / "c.toml")], cwd=REPO, capture_output=True, text=True)
        return r.stdout.strip()

    assert decide("group:laptops", "self", "7000").startswith("allowed by acl[0]")
    assert decide("group:laptops", "10.1.2.10", "7000").startswith("allowed by acl[0]")
    assert decide("group:laptops", "self", "7001").startswith("denied")
    assert decide("group:servers", "self", "7000").startswith("denied")
    assert decide("10.144.144.2", "self", "7002").startswith("denied")
    assert decide("10.144.144.1", "self", "7002").startswith("allowed by acl[2]")


def test_a_reload_applies_new_rules_to_tun(topo: Topology) -> None:
    # last: changes C's rules. Without the laptops' tcp rule A's connect to 7000 is refused,
    # while C's own flows still get their answers
    conf = topo.workdir / "c.toml"
    conf.write_text(conf.read_text().replace('to = ["self:7000", "10.1.2.0/24:7000"]', 'to = ["self:7009"]'))
    r = topo.nsexec("c", sys.executable, "-m", "meshgate", "reload", check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    assert refused(connect(topo, "a", "10.144.144.3", "7000"))
    assert refused(connect(topo, "a", "10.1.2.10", "7000"))
    assert connect(topo, "c", "10.144.144.1", "7000")["ok"]
