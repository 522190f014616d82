"""NAT traversal in network namespaces (root): time to a direct path, and direct vs relayed.

The topology of tests/system/nat_topology.py: A and B behind their own port-restricted NATs
(nftables masquerade + `ct state new drop`), both with only the public relay R in
mesh.peers, udp:// links. Each round builds it afresh.

- `punch`: seconds from both nodes' links to R being up until A lists a direct link to B,
  with A sending to B from the first moment (traversal starts on relayed traffic);
  `--punch-runs` runs, median. Beside it EasyTier's core (PyPI easytier-pyo3, no TUN) in the
  same topology, `--easytier-runs` runs: seconds from A's first route to B (through R) until
  that route costs 1; EasyTier punches in the background and learns its NAT type from STUN
  servers, here bench/stun_server.py on R's two addresses (the namespaces have no way out).
- `relayed` vs `direct` in alternating paired rounds (bench/common.Runner): the same SOCKS5
  client on A uploads `--mib` MiB to a target on B (published by B's [serve]) and ping-pongs
  64-byte messages; relayed = mesh.traversal off on A and B, direct = on, after the punch.
  MB/s, RTT p50, and R's CPU seconds per GiB moved (what the relay pays).

    sudo .venv/bin/python bench/traversal.py [--rounds 3] [--punch-runs 10] [--mib 64]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import Runner, add_args, proc_cpu_seconds, report
from tests.system.nat_topology import B_PORT, NatTopology

R_URL = "udp://198.51.100.2:7000"
BULK, RR = 9001, 9002
STUN = ["198.51.100.2:3478", "198.51.100.3:3478"]  # bench/stun_server.py on R, for EasyTier


def _topology(workdir: Path, traversal: bool) -> NatTopology:
    topo = NatTopology(prefix=f"mgb{uuid.uuid4().hex[:6]}", workdir=workdir)
    topo.names = ("wan", "r", "n1", "n2", "a", "b")
    topo.build()
    off = "" if traversal else "traversal = false\n"
    topo.node_config("r", 'listen = ["udp://0.0.0.0:7000"]', 'ipv4 = "10.144.0.1/24"')
    serve = f'[serve]\n{BULK} = "127.0.0.1:{BULK}"\n{RR} = "127.0.0.1:{RR}"\n'
    topo.node_config("a", f'{off}peers = ["{R_URL}"]', f'ipv4 = "10.144.0.2/24"\n{serve}')
    topo.node_config("b", f'{off}listen = ["udp://0.0.0.0:{B_PORT}"]\npeers = ["{R_URL}"]',
                     f'ipv4 = "10.144.0.3/24"\n{serve}')
    for role in ("r", "a", "b"):
        topo.start_node(role)
    code = f"from bench.common import serve_targets; serve_targets({BULK}, {RR})"
    topo.spawn("targets", "b", [sys.executable, "-c", code])
    return topo


def _client(topo: NatTopology, what: str, *args: str) -> dict[str, float]:
    r = topo.nsexec("a", sys.executable, "bench/traversal.py", "--client", what, *args, timeout=300)
    try:
        out: dict[str, float] = json.loads(r.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise RuntimeError(f"client {what}: {r.stdout!r} {r.stderr!r}") from None
    return out


def _links_to_r(topo: NatTopology) -> bool:
    try:
        return all(any(p["name"] == "r" for p in topo.peers(h)) for h in ("a", "b"))
    except AssertionError:
        return False


def _routed(topo: NatTopology) -> bool:
    try:
        return any(r["name"] == "b" for r in topo.admin("a", "/routes"))  # type: ignore[union-attr]
    except AssertionError:
        return False


def punch_once(workdir: Path) -> float:
    topo = _topology(workdir, traversal=True)
    try:
        topo.wait(lambda: _links_to_r(topo), 30, "links to r")
        t0 = time.monotonic()
        topo.wait(lambda: _routed(topo), 30, "a routes to b")
        # traffic from the first moment: one short exchange at a time until the link is direct
        while topo.direct_to("a", "b") is None:
            _client(topo, "rtt", "3")
            if time.monotonic() - t0 > 30:
                raise RuntimeError("no direct link within 30 s")
        return time.monotonic() - t0
    finally:
        topo.destroy()


def measure(workdir: Path, traversal: bool, mib: int) -> dict[str, float]:
    topo = _topology(workdir, traversal)
    try:
        topo.wait(lambda: _links_to_r(topo) and _routed(topo), 30, "mesh up")
        _client(topo, "rtt", "20")
        if traversal:
            topo.wait(lambda: topo.direct_to("a", "b") is not None, 15, "direct link")
            _client(topo, "rtt", "20")  # a fresh stream: on the direct link
        elif topo.direct_to("a", "b") is not None:
            raise RuntimeError("a direct link with traversal off")
        r_pid = topo.procs["r"].pid
        cpu0 = proc_cpu_seconds(r_pid)
        up = _client(topo, "up", str(mib))
        cpu_r = proc_cpu_seconds(r_pid) - cpu0
        rtt = _client(topo, "rtt", "2000")
        return {"MB/s": mib * (1 << 20) / up["seconds"] / 1e6, "rtt_us_p50": rtt["rtt_us_p50"],
                "R cpu s/GiB": cpu_r / (mib / 1024)}
    finally:
        topo.destroy()


def et_node(spec: dict[str, object]) -> None:
    """One EasyTier node (PyPI easytier-pyo3, no TUN), run inside a namespace: prints one JSON
    line with the seconds from start until `watch` first had a route (through the relay) and
    until that route cost 1 (direct), then idles until killed."""
    import easytier_pyo3 as et

    cfg = {
        "instance_name": spec["name"], "hostname": spec["name"],
        "network_identity": {"network_name": "bench", "network_secret": "bench-secret"},
        "ipv4": f"{spec['ip']}/24", "listeners": spec.get("listen", []),
        "peer": [{"uri": u} for u in spec.get("peers", [])],  # type: ignore[attr-defined]
        "stun_servers": STUN, "tcp_stun_servers": [], "stun_servers_v6": [],
        "flags": {"no_tun": True, "bind_device": False, "disable_upnp": True},
    }
    node = et.Node(cfg)
    node.start()
    t0 = time.monotonic()
    seen = direct = None
    while spec.get("watch") and time.monotonic() - t0 < 60 and direct is None:
        for r in node.routes():
            if r.get("hostname") == spec["watch"]:
                if seen is None:
                    seen = time.monotonic() - t0
                if r.get("cost") == 1:
                    direct = time.monotonic() - t0
        time.sleep(0.02)
    print(json.dumps({"seen": seen, "direct": direct, "version": et.version()}), flush=True)
    while True:
        time.sleep(3600)


def easytier_punch_once(workdir: Path) -> float:
    """EasyTier in the same topology: it punches in the background (no traffic needed), its
    NAT type from STUN servers on R (bench/stun_server.py; nothing leaves the namespaces)."""
    topo = NatTopology(prefix=f"mge{uuid.uuid4().hex[:6]}", workdir=workdir)
    topo.names = ("wan", "r", "n1", "n2", "a", "b")
    topo.build()
    topo.ip("r", "addr", "add", "198.51.100.3/24", "dev", "to_wan")
    try:
        topo.spawn("stun", "r", [sys.executable, "bench/stun_server.py", "198.51.100.2", "198.51.100.3"])
        me = [sys.executable, "bench/traversal.py", "--et-node"]
        topo.spawn("r", "r", [*me, json.dumps({"name": "r", "ip": "10.144.0.1", "listen": ["udp://0.0.0.0:11010"]})])
        for host, ip, watch in (("a", "10.144.0.2", "b"), ("b", "10.144.0.3", "")):
            spec = {"name": host, "ip": ip, "peers": ["udp://198.51.100.2:11010"], "watch": watch}
            topo.spawn(host, host, [*me, json.dumps(spec)])
        line: dict[str, float | None] = {}

        def reported() -> bool:
            for text in topo.log("a").splitlines():
                if text.startswith("{"):
                    line.update(json.loads(text))
                    return True
            return False

        topo.wait(reported, 70, "EasyTier a's report")
        seen, direct = line.get("seen"), line.get("direct")
        if seen is None or direct is None:
            raise RuntimeError(f"EasyTier found no direct path: {line}")
        return direct - seen
    finally:
        topo.destroy()


def client(what: str, arg: str) -> None:
    from bench.common import bulk_up, echo_rtt

    proxy = ("127.0.0.1", 1080)
    if what == "up":
        print(json.dumps({"seconds": bulk_up(proxy, ("10.144.0.3", BULK), int(arg) << 20)}))
    else:
        print(json.dumps(echo_rtt(proxy, ("10.144.0.3", BULK), int(arg))))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(p)
    p.add_argument("--punch-runs", type=int, default=10)
    p.add_argument("--mib", type=int, default=64)
    p.add_argument("--easytier-runs", type=int, default=10, help="0: no EasyTier row")
    p.add_argument("--client", nargs=2, help=argparse.SUPPRESS)
    p.add_argument("--et-node", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.client:
        client(*args.client)
        return 0
    if args.et_node:
        et_node(json.loads(args.et_node))
        return 0
    if os.geteuid() != 0:
        print("bench/traversal.py needs root (network namespaces)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="mg-trav-") as tmp:
        work = Path(tmp)
        def runs(what: str, n: int, once: Callable[[Path], float]) -> None:
            times = []
            for i in range(n):
                run = work / f"{what.split(':')[0]}{i}"
                run.mkdir()
                times.append(once(run))
            print(f"{what} ({len(times)} runs): median {statistics.median(times):.2f} s,"
                  f" min {min(times):.2f}, max {max(times):.2f}")

        runs("meshgate: time to a direct link, port-restricted NATs", args.punch_runs, punch_once)
        if args.easytier_runs and importlib.util.find_spec("easytier_pyo3") is None:
            print("EasyTier: easytier-pyo3 is not installed (pip install easytier-pyo3); skipped")
        elif args.easytier_runs:
            runs("EasyTier: time to a direct link, same topology, from the relayed route's first"
                 " sight, punching in the background", args.easytier_runs, easytier_punch_once)
        count = iter(range(1000))

        def variant(traversal: bool):  # type: ignore[no-untyped-def]
            def run() -> dict[str, float]:
                d = work / f"v{next(count)}"
                d.mkdir()
                return measure(d, traversal, args.mib)
            return run

        r = Runner("traversal", rounds=args.rounds, baseline="relayed")
        r.add("relayed", variant(False))
        r.add("direct", variant(True))
        r.run()
        report([r], json_path=args.json, ratio_metrics=["MB/s", "rtt_us_p50", "R cpu s/GiB"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
