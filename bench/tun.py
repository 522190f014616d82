"""TUN data path throughput: iperf3 between network namespaces through the mesh (root only).

    sudo .venv/bin/python bench/tun.py [--rounds 3] [--seconds 5] [--only NAMES] [--json FILE]
                                       [--ab REF] [--loss PCT] [--baseline NAME]

Topology (tests/system/tun_topology.py): A — B — C, every node with a TUN device;
"1 hop" is A -> B's virtual IP, "2 hops" is A -> C's virtual IP relayed by B.
Variants, each in its own set of namespaces, alternating per round (bench/common.py):

* `kernel`        iperf3 over the veth pairs themselves, no mesh: the ceiling.
* `meshgate`      `meshgate run` with the default event loop (uvloop), tcp:// links.
* `meshgate-asyncio` the same with `--loop asyncio`.
* `meshgate-udp`  udp:// links (meshgate/mesh/link_udp.py), GSO batching on where the
                  kernel has it; `meshgate-udp-nogso` the same with `limits.udp_link_gso =
                  false` (one send per packet): the two alternate in every round, so
                  their paired ratio is the GSO gain. `meshgate-udp-reliable`: big
                  datagrams (super-packets, bundles) on the links' reliable channel
                  (`limits.udp_link_fragment_datagrams = false`) instead of in pieces.
                  `meshgate-udp-gso60k`: meshgate-udp with every TUN device's gso_max_size
                  set to 60000 once the nodes are up (`ip link set`, from this script; meshgate
                  itself uses 32768 on a node with udp:// links and 60000 with tcp:// only), so
                  the size of the super-packets that cross udp links in pieces is the one
                  difference: with `--loss` it shows what the smaller size saves.
* `meshgate-acl`  `meshgate` with `[[acl]]` rules on every node that allow iperf3's port
                  (mesh/tun_firewall.py): every packet a node's TUN sends or receives goes
                  through connection tracking, the first of each flow through the rules.
                  `--only meshgate,meshgate-acl --baseline meshgate`: their paired ratio is
                  the cost of access rules on the TUN path.
* `easytier`      the EasyTier core (PyPI `easytier-pyo3`) in TUN mode, TCP links, same
                  addresses; its STUN lists point at loopback (the namespaces have no
                  way out anyway). Skipped if the package is missing. `easytier-udp`:
                  the same over its UDP links.

`--baseline NAME` picks the variant the ratio columns are against (default: easytier if it
runs, else kernel; meshgate-udp@REF with --ab), e.g. `--only meshgate-udp,meshgate-udp-nogso
--baseline meshgate-udp-nogso` for the GSO gain as a paired ratio.

A/B of a change: `--ab REF` adds `meshgate-udp@REF` (and `meshgate@REF`), meshgate as of
git REF on the same links, alternating with the checkout in every round; the ratio
columns are then against `meshgate-udp@REF` (paired per round).

Random packet loss: `--loss PCT` drops PCT% of the packets A and B send to a link port
(nftables `numgen random`, output hook: tcp and udp port 11010, every variant alike). A GSO
batch would be dropped whole there, so the meshgate udp rows send one packet per syscall
under --loss (`udp_link_gso = false`, for the @REF rows too).

`--firewall` (no root): the per-packet cost of the access rules alone (mesh/tun_firewall.py),
in microseconds per call over 1200-byte UDP packets: parsing a packet (what every packet
costs anyway), a tracked packet in, a packet out, a new flow decided by the real [[acl]]
rules (egress/acl.py). Alternating rounds, medians.

Metrics: TCP MB/s (iperf3 receiver), UDP packets/s received (1200-byte datagrams,
unlimited rate, loss reported), CPU seconds per GiB moved for each node's
process (utime+stime from /proc), and each node process's peak RSS so far (VmHWM, MiB:
the most it held through that row and the rows before it).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (
    Metrics,
    Runner,
    add_args,
    git_tree,
    proc_cpu_seconds,
    proc_peak_rss_kib,
    report,
    selected,
)
from tests.system.tun_topology import Topology

GIB = 1 << 30
NODE_CONF = {
    "a": 'ipv4 = "10.144.144.1/24"\n[mesh]\npeers = ["tcp://172.31.9.2:11010"]\n[tun]\nenable = true\n',
    "b": 'ipv4 = "10.144.144.2/24"\n[mesh]\nlisten = ["tcp://0.0.0.0:11010"]\npeers = ["tcp://172.31.2.3:11010"]\n'
         '[tun]\nenable = true\n',
    "c": 'ipv4 = "10.144.144.3/24"\n[mesh]\nlisten = ["tcp://0.0.0.0:11010"]\n[tun]\nenable = true\n',
}
# kernel-only targets: B's and C's veth addresses (A routes C's via B with forwarding on)
KERNEL_DST = {"b": "172.31.1.2", "c": "172.31.2.3"}
MESH_DST = {"b": "10.144.144.2", "c": "10.144.144.3"}


NOGSO = "udp_link_gso = false\n"
# access rules that let iperf3 (control and data, TCP and UDP, port 5201) in and nothing else
# (and ping, which the set-up waits on)
ACL = ('[[acl]]\nfrom = ["*"]\nto = ["self:5201"]\nproto = "any"\n'
       '[[acl]]\nfrom = ["*"]\nto = ["self"]\nproto = "icmp"\n')

RELIABLE = "udp_link_fragment_datagrams = false\n"


def node_conf(links: str, limits: str = "", acl: str = "") -> dict[str, str]:
    """The node configs with `links` (tcp or udp) for every link URL, `limits` lines and
    `acl` ([[acl]] tables) for every node."""
    extra = acl + (f"[limits]\n{limits}" if limits else "")
    return {role: text.replace("tcp://", f"{links}://") + extra for role, text in NODE_CONF.items()}


def et_conf(links: str) -> dict[str, dict[str, Any]]:
    return {role: {k: [u.replace("tcp://", f"{links}://") for u in v] if isinstance(v, list) else v
                   for k, v in spec.items()} for role, spec in ET_CONF.items()}


ET_CONF: dict[str, dict[str, Any]] = {
    "a": {"ip": "10.144.144.1", "peers": ["tcp://172.31.9.2:11010"], "expect": 2},
    "b": {"ip": "10.144.144.2", "listen": ["tcp://0.0.0.0:11010"], "peers": ["tcp://172.31.2.3:11010"]},
    "c": {"ip": "10.144.144.3", "listen": ["tcp://0.0.0.0:11010"]},
}


def easytier_node(spec: dict[str, Any]) -> int:
    """One EasyTier node in TUN mode, in the foreground until SIGTERM (run inside a namespace)."""
    import signal
    import threading

    import easytier_pyo3 as et

    cfg = {
        "instance_name": spec["name"], "hostname": spec["name"],
        "network_identity": {"network_name": "bench", "network_secret": "bench-secret"},
        "ipv4": spec["ip"] + "/24",
        "listeners": spec.get("listen", []),
        "peer": [{"uri": u} for u in spec.get("peers", [])],
        "stun_servers": ["127.0.0.1:3478"], "tcp_stun_servers": ["127.0.0.1:3478"],
        "stun_servers_v6": ["[::1]:3478"],
        "flags": {"no_tun": False, "dev_name": "et0", "bind_device": False, "disable_upnp": True},
    }
    node = et.Node(cfg)
    node.start()
    deadline = time.monotonic() + 60
    while len(node.routes()) < spec.get("expect", 0) and time.monotonic() < deadline:
        time.sleep(0.05)
    print(json.dumps({"ready": True, "version": et.version(), "routes": len(node.routes())}), flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    node.stop()
    return 0


@dataclass
class Setup:
    name: str
    mesh: bool
    loop: str = "uvloop"
    easytier: bool = False
    links: str = "tcp"
    limits: str = ""  # [limits] lines for every node's config
    tree: Path | None = None  # run meshgate from this extracted git REF (--ab), not the checkout
    loss: float = 0.0  # percent of link packets A and B drop on output (--loss)
    gso_max: int = 0  # set the TUN devices' gso_max_size to this once up (0: meshgate's own)
    acl: str = ""  # [[acl]] tables for every node's config
    topo: Topology | None = None
    pids: dict[str, int] = field(default_factory=dict)

    def up(self, workdir: Path, index: int) -> None:
        t = Topology(f"mgb{index}", workdir / self.name, loop=self.loop)
        t.workdir.mkdir(parents=True, exist_ok=True)
        self.topo = t
        t.build()
        for role in ("b", "c"):
            t.spawn(f"iperf-{role}", role, ["iperf3", "-s"])
        if not self.mesh:
            t.nsexec("b", "sysctl", "-q", "-w", "net.ipv4.ip_forward=1")
            t.ip("c", "route", "add", "172.31.1.0/24", "via", "172.31.2.2")
            return
        if self.easytier:
            conf = et_conf(self.links)
            for role in ("c", "b", "a"):
                spec = json.dumps({"name": role, **conf[role]})
                self.pids[role] = t.spawn(role, role, [sys.executable, __file__, "--easytier-node", spec]).pid
        else:
            for role, text in node_conf(self.links, self.limits, self.acl).items():
                t.config(role, text)
            for role in ("c", "b", "a"):
                if self.tree is None:
                    self.pids[role] = t.start_node(role).pid
                    continue
                # the REF's package first on sys.path (the topology puts the checkout on PYTHONPATH)
                boot = (f"import sys, runpy; sys.path.insert(0, {str(self.tree)!r}); "
                        "runpy.run_module('meshgate', run_name='__main__', alter_sys=True)")
                argv = [sys.executable, "-c", boot, "run", "-c", str(t.workdir / f"{role}.toml"),
                        "--loop", self.loop]
                self.pids[role] = t.spawn(role, role, argv).pid
        t.wait_ping("a", MESH_DST["c"], timeout=30)
        if self.acl:  # the rules are in force on the TUN path of every node
            for role in ("a", "b", "c"):
                code = ("import json, urllib.request; print(json.dumps(json.load(urllib.request.urlopen("
                        "'http://127.0.0.1:15888/status', timeout=5))['services']['tun']['acl']))")
                if t.nsexec(role, sys.executable, "-c", code).stdout.strip() != "true":
                    raise RuntimeError(f"{role}: [[acl]] not active on the TUN path")
        if self.gso_max:
            for role in ("a", "b", "c"):
                t.ip(role, "link", "set", "dev", "meshgate0", "gso_max_size", str(self.gso_max))
                shown = t.ip(role, "-d", "link", "show", "dev", "meshgate0").stdout
                if f"gso_max_size {self.gso_max} " not in shown:
                    raise RuntimeError(f"{role}: gso_max_size not {self.gso_max}: {shown}")
        if self.loss:
            permille = round(self.loss * 10)
            rules = workdir / f"{self.name}-loss.nft"
            rules.write_text(
                "table inet bench_loss {\n chain out {\n  type filter hook output priority 0;\n"
                f"  meta l4proto {{ tcp, udp }} th dport 11010 numgen random mod 1000 < {permille} drop\n"
                " }\n}\n"
            )
            for role in ("a", "b"):
                t.nsexec(role, "nft", "-f", str(rules), check=True)

    def down(self) -> None:
        if self.topo is not None:
            self.topo.destroy()

    def cpu(self) -> dict[str, float]:
        out = {}
        for role, pid in self.pids.items():
            try:
                out[role] = proc_cpu_seconds(pid, children=False)
            except OSError:
                out[role] = float("nan")
        return out

    def peak_rss(self) -> dict[str, float]:
        """Each node process's peak RSS so far (VmHWM), MiB."""
        out = {}
        for role, pid in self.pids.items():
            try:
                out[role] = proc_peak_rss_kib(pid) / 1024
            except OSError:
                out[role] = float("nan")
        return out

    def iperf(self, dst_role: str, udp: bool, seconds: float) -> Metrics:
        assert self.topo is not None
        dst = (MESH_DST if self.mesh else KERNEL_DST)[dst_role]
        argv = ["iperf3", "-c", dst, "-t", str(seconds), "-J"]
        if udp:
            argv += ["-u", "-b", "0", "-l", "1200"]
        before = self.cpu()
        t0 = time.monotonic()
        r = self.topo.nsexec("a", *argv, timeout=seconds + 30)
        wall = time.monotonic() - t0
        after = self.cpu()
        try:
            data: dict[str, Any] = json.loads(r.stdout)
        except ValueError:
            raise RuntimeError(f"iperf3 failed: {r.stdout[-500:]} {r.stderr[-500:]}") from None
        if "error" in data:
            raise RuntimeError(f"iperf3: {data['error']}")
        end = data["end"]
        out: Metrics = {}
        if udp:
            s = end["sum"]
            received = s["packets"] - s["lost_packets"]
            out["pkt/s"] = received / s["seconds"]
            out["loss%"] = s["lost_percent"]
            moved = received * 1200
        else:
            s = end["sum_received"]
            out["MB/s"] = s["bytes"] / s["seconds"] / 1e6
            moved = s["bytes"]
        for role in before:
            out[f"cpu_s/GiB {role.upper()}"] = (after[role] - before[role]) / (moved / GIB) if moved else 0.0
        for role, peak in self.peak_rss().items():
            out[f"peak_MiB {role.upper()}"] = peak
        out["wall_s"] = wall
        return out


def firewall_micro(rounds: int, n: int = 200_000) -> list[Runner]:
    """Per-call cost of the TUN access checks, without a device or a network."""
    import ipaddress
    import struct
    import timeit

    from meshgate.config import from_dict
    from meshgate.egress.acl import Acl, Source
    from meshgate.mesh import tun_firewall as fw
    from meshgate.mesh import tun_packets as tp

    here, there = ipaddress.ip_address("10.144.144.3").packed, ipaddress.ip_address("10.144.144.1").packed
    acl = Acl(from_dict({"acl": [{"from": ["group:laptops"], "to": ["self:5201"], "proto": "udp"},
                                 {"from": ["*"], "to": ["self"], "proto": "icmp"}]}).acl)
    who = Source(7, "a", ("laptops",), ipaddress.ip_address("10.144.144.1"))

    class Rules:  # egress/acl.py PacketAccess, with the source known (no mesh here)
        active = True
        version = acl

        def decide(self, node: int, dst: bytes, port: int, proto: str) -> int | None:
            d = acl.decide(who, None, port, proto)
            return (d.rule if d.rule is not None else fw.NO_RULES) if d.allowed else None

    def udp(src: bytes, dst: bytes, sport: int, dport: int) -> bytes:
        body = struct.pack("!HHHH", sport, dport, 1208, 0) + bytes(1200)
        hdr = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(body), 0, 0x4000, 64, 17, 0, src, dst)
        return hdr + body

    inp, out = udp(there, here, 40000, 5201), udp(here, there, 5201, 40000)
    pin = tp.parse(inp)
    f = fw.Firewall(Rules(), 16384)
    f.inbound(7, inp, pin, 0, 0.0)
    flows = iter(range(1 << 30))

    def per_call(fn: Any) -> Metrics:
        return {"us/call": timeit.timeit(fn, number=n) / n * 1e6}

    def new_flow() -> None:  # a fresh source port each time: the rules decide, the flow is added
        pkt = udp(there, here, next(flows) & 0xFFFF, 5201)
        f.inbound(7, pkt, tp.parse(pkt), 0, 1.0)

    r = Runner("TUN access rules, per packet (in-process)", rounds=rounds, baseline="parse")
    r.add("parse", lambda: per_call(lambda: tp.parse(inp)))
    r.add("parse+on+inbound (tracked)", lambda: per_call(lambda: f.on() and f.inbound(7, inp, tp.parse(inp),
                                                                                      0, 1.0)))
    r.add("parse+on+outbound", lambda: per_call(lambda: f.on() and f.outbound(7, out, tp.parse(out), 0, 1.0)))
    r.add("new flow (build+parse+decide)", lambda: {"us/call": timeit.timeit(new_flow, number=n // 10)
                                                    / (n // 10) * 1e6})
    r.run()
    return [r]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(ap)
    ap.add_argument("--seconds", type=float, default=5.0, help="iperf3 duration per measurement")
    ap.add_argument("--ab", metavar="REF", help="also run meshgate as of git REF (rows NAME@REF)")
    ap.add_argument("--loss", type=float, default=0.0, metavar="PCT",
                    help="drop PCT%% of the link packets A and B send (udp rows then run without GSO)")
    ap.add_argument("--baseline", metavar="NAME", help="the variant the ratio columns are against")
    ap.add_argument("--firewall", action="store_true", help="only the in-process cost of the access rules")
    ap.add_argument("--easytier-node", metavar="JSON", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.easytier_node:
        return easytier_node(json.loads(args.easytier_node))
    if args.firewall:
        report(firewall_micro(args.rounds), json_path=args.json, ratio_metrics=["us/call"])
        return 0
    candidates = [Setup("kernel", mesh=False), Setup("meshgate", mesh=True),
                  Setup("meshgate-acl", mesh=True, acl=ACL),
                  Setup("meshgate-asyncio", mesh=True, loop="asyncio"),
                  Setup("meshgate-udp", mesh=True, links="udp"),
                  Setup("meshgate-udp-nogso", mesh=True, links="udp", limits=NOGSO),
                  Setup("meshgate-udp-reliable", mesh=True, links="udp", limits=RELIABLE),
                  Setup("meshgate-udp-gso60k", mesh=True, links="udp", gso_max=60000),
                  Setup("easytier", mesh=True, easytier=True),
                  Setup("easytier-udp", mesh=True, easytier=True, links="udp")]
    workdir = Path(tempfile.mkdtemp(prefix="meshgate-bench-tun-"))
    if args.ab:
        tree = git_tree(args.ab, str(workdir))
        candidates += [Setup(f"meshgate@{args.ab}", mesh=True, tree=tree),
                       Setup(f"meshgate-udp@{args.ab}", mesh=True, links="udp", tree=tree)]
    if importlib.util.find_spec("easytier_pyo3") is None:
        print("  easytier: easytier-pyo3 is not installed (pip install easytier-pyo3); skipped",
              file=sys.stderr)
        candidates = [s for s in candidates if not s.easytier]
    setups = [s for s in candidates if selected(args, s.name)]
    for s in setups:
        s.loss = args.loss
        if args.loss and s.mesh and not s.easytier and s.links == "udp" and NOGSO not in s.limits:
            s.limits += NOGSO
    runners: list[Runner] = []
    try:
        live: list[Setup] = []
        for i, s in enumerate(setups):
            try:
                s.up(workdir, i)
                live.append(s)
            except Exception as e:  # a variant that cannot start is reported, the others still run
                print(f"  {s.name} did not start: {e}", file=sys.stderr)
                s.down()
        for title, dst, udp in (("TCP 1 hop", "b", False), ("TCP 2 hops", "c", False),
                                ("UDP 1 hop", "b", True), ("UDP 2 hops", "c", True)):
            names = [s.name for s in live]
            # the target is relative to EasyTier's TUN mode: ratios against it when it runs
            baseline = "easytier" if "easytier" in names else "kernel" if "kernel" in names else None
            if args.ab and f"meshgate-udp@{args.ab}" in names:
                baseline = f"meshgate-udp@{args.ab}"
            if args.baseline:
                baseline = args.baseline if args.baseline in names else None
            r = Runner(title, rounds=args.rounds, baseline=baseline)
            for s in live:
                r.add(s.name, functools.partial(s.iperf, dst, udp, args.seconds))
            r.run()
            runners.append(r)
    finally:
        for s in setups:
            s.down()
        subprocess.run(["rm", "-rf", str(workdir)], check=False)
    report(runners, json_path=args.json, ratio_metrics=["MB/s", "pkt/s"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
