"""SOCKS5 portal over the mesh in real network namespaces (issue: portal over the mesh).

    A ══ B ══ C ══ lan (10.1.2.10)          A and C share no link; only C reaches
                 ╚═ inet (198.51.100.10)    the lan and the "internet" namespace.

Each node is a separate `meshgate run` process in its namespace. curl (and
headless Chromium) run inside A's namespace against A's portal; the servers
answer "NAME|SOURCE" so the test sees who served and from which address.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from meshgate.mesh.identity import load_or_create
from tests.helpers import require_root, require_tool, wait_until
from tests.identity_testing import TestCA
from tests.system.tun_topology import SECRET, Topology

PORT = 8080
C_VIP = "10.144.7.3"


# certificate mode: what each node's certificate grants (C: the CIDRs and the exit of
# C_MESH_EXIT, and the catch-all the catch-all test advertises)
GRANTS: dict[str, dict[str, Any]] = {
    "c": {"cidrs": ("10.1.2.0/24", "10.1.2.0/24->10.2.2.0/24", "0.0.0.0/0"), "exit": True,
          "dns": ("lan.test.",)},
}
CAS: dict[Path, TestCA] = {}  # workdir -> the network's CA, in certificate mode


def node_toml(role: str, workdir: Path, vip: str, mesh: str, extra: str = "") -> None:
    state = workdir / ("state-" + role)
    ca = CAS.get(workdir)
    if ca is None:
        who = f'secret = "{SECRET}"\n'
    else:  # no secret at all: the certificates are the only lock
        path = ca.issue(role, load_or_create(state), f"{vip}/24", **GRANTS.get(role, {}))
        keys = ca.node_keys(path)
        who = f'certificate = "{keys["certificate"]}"\nca = "{keys["ca"]}"\n'
    (workdir / f"{role}.toml").write_text(
        f'[node]\nname = "{role}"\nnetwork = "portaltest"\n{who}ipv4 = "{vip}/24"\n'
        f'state_dir = "{state}"\n[mesh]\n{mesh}\n'
        f'[admin]\nlisten = "127.0.0.1:15888"\n{extra}\n'
    )


# the portal, and the web server each node publishes on its virtual IP ([serve]): nothing else
# on its loopback (the admin API on 15888, the portal on 1080) is reachable through the mesh
PORTAL = '[socks5]\nlisten = "127.0.0.1:1080"\n[serve]\n8080 = "127.0.0.1:8080"\n'
NO_PORTAL = "[socks5]\nenable = false\n"
C_MESH_EXIT = ('peers = ["tcp://172.31.2.2:11010"]\nexit_node = true\n'
               'proxy_cidrs = ["10.1.2.0/24", "10.1.2.0/24->10.2.2.0/24"]')
# C answers lan.test. for the whole mesh (dns.serve_suffixes) from the lan's resolver, which
# only C reaches; A asks its own DNS listener and gets the lan's answer over the mesh
C_EXTRA = PORTAL + ('[dns]\nrecords = { "inet.test." = "198.51.100.10", "sneaky.test." = "172.31.2.2" }\n'
                    'serve_suffixes = ["lan.test."]\n'
                    '[[dns.route]]\nsuffix = "lan.test."\nupstreams = ["udp://10.1.2.10:5353"]\n')
A_DNS = '[dns]\n[[dns.listener]]\nprotocol = "udp"\nlisten = "127.0.0.1:5353"\n'


@pytest.fixture(scope="module", params=["secret", "certificate"])
def topo(request: pytest.FixtureRequest) -> Iterator[Topology]:
    """The topology, once with a network secret and once in certificate mode (every node with
    a certificate of one CA and no secret): the portal reaches the same things either way."""
    require_root()
    require_tool("ip")
    require_tool("curl")
    require_tool("ss")
    require_tool("sysctl")  # Topology.build runs it in each namespace
    workdir = Path(tempfile.mkdtemp(prefix="portal-netns-"))
    if request.param == "certificate":
        CAS[workdir] = TestCA(workdir, network="portaltest")
    t = Topology(prefix=f"mgp{int(time.time()) % 100000}", workdir=workdir)
    try:
        t.build()
        py = sys.executable
        t.spawn("srv-a", "a", [py, "-m", "tests.system.http_probe", "127.0.0.1", str(PORT), "A-local"])
        t.spawn("srv-c", "c", [py, "-m", "tests.system.http_probe", "127.0.0.1", str(PORT), "C-local"])
        t.spawn("srv-lan", "lan", [py, "-m", "tests.system.http_probe", "10.1.2.10", str(PORT), "lan"])
        t.spawn("srv-inet", "inet", [py, "-m", "tests.system.http_probe", "198.51.100.10", str(PORT), "inet"])
        # a resolver on the lan, answering one name: the UDP-over-mesh test asks it
        (workdir / "lan-dns.toml").write_text(
            f'[node]\nname = "landns"\nstate_dir = "{workdir / "state-landns"}"\n{NO_PORTAL}'
            '[dns]\nrecords = { "printer.lan.test." = "10.1.2.99" }\n'
            '[[dns.listener]]\nprotocol = "udp"\nlisten = "10.1.2.10:5353"\n'
            '[admin]\nlisten = "127.0.0.1:15888"\n')
        t.spawn("lan-dns", "lan", [py, "-m", "meshgate", "run", "-c", str(workdir / "lan-dns.toml")])
        node_toml("b", workdir, "10.144.7.2", 'listen = ["tcp://0.0.0.0:11010"]', NO_PORTAL)
        node_toml("c", workdir, C_VIP, C_MESH_EXIT, C_EXTRA)
        for role in ("b", "c"):
            t.start_node(role)
        # the servers are separate processes: a test must not race their start-up
        for role, host in (("a", "127.0.0.1"), ("c", "127.0.0.1"), ("lan", "10.1.2.10"),
                           ("inet", "198.51.100.10")):
            wait_listening(t, role, f"{host}:{PORT}")
        wait_listening(t, "lan", "10.1.2.10:5353", udp=True)
        yield t
    finally:
        t.destroy()


def wait_listening(t: Topology, role: str, addr: str, udp: bool = False, timeout: float = 30) -> None:
    """Until a socket in `role`'s namespace listens on `addr` (ss filters by local address:port)."""

    def listening() -> bool:
        r = t.nsexec(role, "ss", "-Hnul" if udp else "-Hntl", "src", addr)
        return bool(r.stdout.strip())

    wait_until(listening, timeout, f"{role} listening on {addr}")


# Text only C's usual record (C_MESH_EXIT) shows in /routes: its mapped proxy CIDR. A route to C's
# address alone can come from B's copy of a record C had before its last restart.
C_USUAL = '"10.2.2.0/24"'


def start_c(t: Topology, mesh: str) -> None:
    """(Re)start C with `mesh` and wait until its portal listens and B holds C's record of this
    config (B keeps C's previous record until the new one arrives)."""
    t.stop("c")
    node_toml("c", t.workdir, C_VIP, mesh, C_EXTRA)
    t.start_node("c")
    wait_listening(t, "c", "127.0.0.1:1080")
    wait_route(t, "b", C_VIP, needs=C_USUAL if mesh == C_MESH_EXIT else '"0.0.0.0/0"')


A_EXIT: dict[str, str] = {}  # per topology: the exit_nodes A runs with now


def start_a(t: Topology, exit_nodes: str, needs: str = C_USUAL) -> None:
    A_EXIT.pop(t.prefix, None)
    t.stop("a")
    mesh = f'peers = ["tcp://172.31.1.2:11010"]\nexit_nodes = {exit_nodes}\ndirect_fallback = false'
    node_toml("a", t.workdir, "10.144.7.1", mesh, PORTAL + A_DNS)
    t.start_node("a")
    wait_route(t, "a", C_VIP, needs=needs)
    wait_listening(t, "a", "127.0.0.1:1080")
    A_EXIT[t.prefix] = exit_nodes


def wait_route(t: Topology, role: str, vip: str, timeout: float = 30, needs: str = "") -> None:
    """Until `role` routes to `vip` (its record has arrived) and, with `needs`, the routes also show
    that text: a node just restarted with a new config is known to its neighbours by its old
    record until the new one arrives, so a route to its address alone can be the old one."""

    def routed() -> bool:
        r = t.nsexec(role, "curl", "-s", "--max-time", "2", "http://127.0.0.1:15888/routes")
        return f'"{vip}"' in r.stdout and needs in r.stdout

    try:
        wait_until(routed, timeout, f"{role} to route to {vip}")
    except AssertionError as e:
        raise AssertionError(f"{e}: {t.log(role)}") from None


def curl(t: Topology, url: str, role: str = "a") -> subprocess.CompletedProcess[str]:
    return t.nsexec(role, "curl", "-sS", "--max-time", "15", "--proxy", "socks5h://127.0.0.1:1080", url)


@pytest.fixture
def a_auto(topo: Topology) -> Topology:
    """A with exit_nodes = ["auto"]; restarted only if a test left it with another exit list, so
    the tests that use it pass in any order."""
    if A_EXIT.get(topo.prefix) != '["auto"]':
        start_a(topo, '["auto"]')
    return topo


@pytest.mark.parametrize(
    "url,expect",
    [
        ("http://10.144.7.1:8080/", "A-local|127.0.0.1"),   # A's own virtual IP -> A's loopback
        ("http://10.144.7.3:8080/", "C-local|127.0.0.1"),   # C's virtual IP, relayed by B
        ("http://c.mesh.internal:8080/", "C-local|127.0.0.1"),
        ("http://10.1.2.10:8080/", "lan|10.1.2.1"),          # proxy CIDR: the lan sees C's address
        ("http://10.2.2.10:8080/", "lan|10.1.2.1"),          # mapped: host bits kept
        ("http://198.51.100.10:8080/", "inet|198.51.100.1"),  # internet through the auto exit
        ("http://inet.test:8080/", "inet|198.51.100.1"),      # name resolved on the exit
    ],
)
def test_destinations(a_auto: Topology, url: str, expect: str) -> None:
    r = curl(a_auto, url)
    assert r.returncode == 0, f"{r.stderr}\n{a_auto.log('a')}\n{a_auto.log('c')}"
    assert f">{expect}<" in r.stdout


@pytest.mark.parametrize(
    "url,code",
    [
        ("http://172.31.2.2:8080/", 2),    # private address on the exit's own side, no allow_private
        ("http://sneaky.test:8080/", 2),   # a name that resolves to one on the exit: same answer
        ("http://10.1.2.10:9/", 5),        # refused at the far end
    ],
)
def test_refusals_reach_curl_as_reply_codes(a_auto: Topology, url: str, code: int) -> None:
    r = curl(a_auto, url)
    assert r.returncode == 97, r.stderr  # curl: "proxy handshake error"
    assert f"error code: {code}" in r.stderr or f"({code})" in r.stderr, r.stderr


def test_exit_by_address(topo: Topology) -> None:
    start_a(topo, f'["{C_VIP}"]')
    r = curl(topo, "http://198.51.100.10:8080/")
    assert ">inet|198.51.100.1<" in r.stdout, r.stderr


def test_exit_node_is_self_on_cs_own_portal(topo: Topology) -> None:
    r = curl(topo, "http://198.51.100.10:8080/", role="c")
    assert ">inet|198.51.100.1<" in r.stdout, r.stderr + topo.log("c")


def test_catch_all_proxy_cidr_acts_as_exit(topo: Topology) -> None:
    start_c(topo, 'peers = ["tcp://172.31.2.2:11010"]\nproxy_cidrs = ["10.1.2.0/24", "0.0.0.0/0"]')
    start_a(topo, "[]", needs='"0.0.0.0/0"')  # C's new record, not the one B still held
    try:
        r = curl(topo, "http://198.51.100.10:8080/")
        assert ">inet|198.51.100.1<" in r.stdout, r.stderr + topo.log("c")
        # still an exit under the exit policy, not an owner of everything
        assert curl(topo, "http://172.31.2.2:8080/").returncode == 97
    finally:  # the later tests expect C's usual record, and C's own portal up
        start_c(topo, C_MESH_EXIT)


def test_chromium_in_as_namespace(a_auto: Topology) -> None:
    chromium = require_tool("chromium")
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             "--proxy-server=socks5://127.0.0.1:1080", "--proxy-bypass-list=<-loopback>"]
    for url, expect in (("http://10.2.2.10:8080/", "lan|10.1.2.1"), ("http://inet.test:8080/", "inet|")):
        with tempfile.TemporaryDirectory() as profile:
            r = a_auto.nsexec("a", chromium, *flags, f"--user-data-dir={profile}", "--dump-dom", url,
                              timeout=120)
        assert expect in r.stdout, r.stderr[-1500:]


@pytest.mark.parametrize("server", ["10.1.2.10", "10.2.2.10"])
def test_dns_over_socks_udp_to_a_lan_resolver(a_auto: Topology, server: str) -> None:
    import json

    r = a_auto.nsexec("a", sys.executable, "-m", "tests.system.socks_udp_dns", "127.0.0.1", "1080", server,
                      "5353", "printer.lan.test")
    assert r.returncode == 0, r.stderr + a_auto.log("lan-dns")
    assert json.loads(r.stdout.strip().splitlines()[-1]) == {"rcode": 0, "addresses": ["10.1.2.99"]}


@pytest.mark.parametrize("port", [15888, 1080])
def test_what_a_node_does_not_publish_is_unreachable(a_auto: Topology, port: int) -> None:
    """C's admin API and C's own portal listen on C's loopback; through A's portal and C's
    virtual IP they are refused (0x02). Before [serve], C's portal on its virtual IP, with its
    direct fallback, took anyone anywhere past A's exit policy."""
    r = curl(a_auto, f"http://{C_VIP}:{port}/status")
    assert r.returncode == 97 and "(2)" in r.stderr, r.stderr


def test_a_name_under_cs_served_suffix_is_answered_by_the_lan_resolver_over_the_mesh(
        a_auto: Topology) -> None:
    """Split DNS through the mesh: A has no route of its own for lan.test. and no path to the lan
    (dig straight at the lan resolver gets nothing); A's DNS listener answers from it anyway,
    because C's signed record says C serves lan.test. (in certificate mode: C's certificate
    grants it)."""
    dig = require_tool("dig")
    wait_listening(a_auto, "a", "127.0.0.1:5353", udp=True)
    direct = a_auto.nsexec("a", dig, "+short", "+time=1", "+tries=1", "@10.1.2.10", "-p", "5353",
                           "printer.lan.test")
    assert "10.1.2.99" not in direct.stdout
    r = a_auto.nsexec("a", dig, "+short", "+time=3", "+tries=2", "@127.0.0.1", "-p", "5353",
                      "printer.lan.test")
    assert r.stdout.split() == ["10.1.2.99"], r.stdout + r.stderr + a_auto.log("a") + a_auto.log("c")
