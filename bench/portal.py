"""SOCKS5 portal over the mesh: meshgate beside the EasyTier core, A - B - C on loopback.

Topology (issue 4, "Performance"): three nodes as separate processes joined
by TCP links in a line, A - B - C (only B listens; A and C dial it, so A and C
share no link). A runs the SOCKS5 portal. The targets (bench/common.Targets,
one child process) listen on 127.0.0.1; through A's portal they are reached as
B's virtual IP (one hop: the mesh carries the stream to B, which connects to
its own 127.0.0.1) and as C's virtual IP (two hops, relayed by B). meshgate
nodes are `meshgate run -c` processes (uvloop); EasyTier nodes are
bench/peers/easytier_node.py processes (the Rust core from PyPI
`easytier-pyo3`, no TUN), which in no-TUN mode map a node's own virtual IP to
127.0.0.1 the same way. The client is the same for every row
(bench/common.py: blocking sockets for bulk and RTT, uvloop for the rest).

Sections:

* **main** (alternating paired rounds, bench/common.Runner): bulk MB/s
  download and upload of SIZE MiB through A's portal to the one-hop and the
  two-hop target; CPU seconds per GiB moved for A, B and C (from /proc);
  64-byte ping-pong RTT on one connection (p50, p99) and the CPU microseconds
  A, B and C spent per round trip of it (from /proc, 10 ms ticks: read the
  medians over rounds); connections per second of CONNECT
  + one 64-byte request/response with 20 and 50 concurrent clients; peak RSS
  of each node. EasyTier's core runs inside a Python interpreter
  (easytier_node.py), so its rows also show that interpreter apart: every
  round starts `easytier_node.py --baseline` (the same interpreter and
  `import easytier_pyo3`, no node), reads its peak RSS after a second idle,
  and prints each node's peak RSS minus it; the memory target compares
  meshgate with EasyTier less its interpreter (and prints the raw ratio too).
* **churn** (once per implementation, on a fresh line): idle RSS; fresh
  bulk download and RTT (medians of three each), and RSS after them
  ("warm"); then CHURN short
  connections (50 clients; stops at CHURN or after --churn-seconds,
  whichever comes first; the table says how many ran); then bulk, RTT and
  RSS again, and RSS after the nodes sat idle for --settle seconds (EasyTier:
  also less a bare interpreter's idle RSS, measured at the start). Then, on
  another fresh line (the portal's first CONNECTs), a burst of BURST
  simultaneous CONNECTs: answers counted by reply code, hung = no reply
  within 10 s, completed = the request/response after the reply worked. All
  of it to the two-hop target, so every node (portal, relay, egress) sees
  every connection.

EasyTier contacts STUN servers, so its rows run only inside a loopback-only
network namespace; run the whole benchmark in one:

    bench/peers/isolated .venv/bin/python bench/portal.py [--size MiB] [--rounds N]
        [--churn N] [--churn-seconds S] [--burst K] [--sections main,churn] [--only meshgate,easytier]
        [--ab REF] [--variant NAME=TOML] [--socks-workers N] [--baseline NAME] [--json FILE]

Outside one, the EasyTier rows are skipped with a note. `--ab REF` adds
meshgate as of git REF as a third line (A/B of a change, in alternating pairs).
"""

from __future__ import annotations

import argparse
import functools
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (
    PEERS,
    Metrics,
    Peer,
    Runner,
    Targets,
    add_args,
    bulk_down,
    bulk_up,
    conn_rate,
    connect_burst,
    easytier_interpreter_rss_mib,
    echo_rtt,
    free_port,
    git_tree,
    loopback_only,
    proc_peak_rss_kib,
    proc_rss_kib,
    report,
    selected,
)

ROOT = Path(__file__).resolve().parent.parent
MIB = 1 << 20
GIB = 1 << 30
VIPS = {"a": "10.144.144.1", "b": "10.144.144.2", "c": "10.144.144.3"}
HOP_NODE = {1: "b", 2: "c"}


class Line:
    """A - B - C as three processes, the portal on A."""

    def __init__(self, name: str, workdir: str) -> None:
        self.name = name
        # one directory per start: the churn section starts fresh lines of the same name
        self.workdir = Path(tempfile.mkdtemp(prefix=name.replace("/", "_") + "-", dir=workdir))
        self.socks = ("127.0.0.1", free_port())
        self.b_port = free_port()
        self.nodes: dict[str, Peer] = {}

    def node_peer(self, node: str) -> Peer:
        raise NotImplementedError

    def start(self, rr_port: int) -> Line:
        try:
            # B first: A and C dial it.
            for node in "bac":
                self.nodes[node] = self.node_peer(node).start(timeout=30)
            self._converge(rr_port)
        except BaseException:
            self.stop()
            raise
        return self

    def _converge(self, rr_port: int, timeout: float = 60.0) -> None:
        """Retry one request/response to C's virtual IP until the line carries it."""
        deadline = time.monotonic() + timeout
        while True:
            m = conn_rate(self.socks, (VIPS["c"], rr_port), 1, 2.0, limit=1)
            if m["conn/s"] > 0:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name}: no path A -> C through the portal after {timeout}s")
            time.sleep(0.2)

    def target(self, hops: int, port: int) -> tuple[str, int]:
        return VIPS[HOP_NODE[hops]], port

    def cpu(self) -> dict[str, float]:
        return {n: p.cpu_seconds() for n, p in self.nodes.items()}

    def rss_mib(self) -> dict[str, float]:
        return {n: proc_rss_kib(p.pid) / 1024 for n, p in self.nodes.items()}

    def peak_rss_mib(self) -> dict[str, float]:
        return {n: proc_peak_rss_kib(p.pid) / 1024 for n, p in self.nodes.items()}

    def interpreter_rss_mib(self) -> tuple[float, float] | None:
        """(RSS, peak RSS) of what hosts a node but is not the implementation, if anything."""
        return None

    def stop(self) -> None:
        for p in self.nodes.values():
            p.stop()
        self.nodes.clear()


class MeshgateLine(Line):
    def __init__(self, name: str, workdir: str, tree: Path = ROOT, extra_toml: str = "",
                 socks_workers: int = 1) -> None:
        super().__init__(name, workdir)
        self.tree = tree  # the checkout to run (an extracted git REF for --ab)
        self.extra_toml = extra_toml  # appended to every node's config (--variant)
        self.socks_workers = socks_workers  # node A's socks5.workers (--socks-workers)
        self.ports = {"a": free_port(), "b": self.b_port, "c": free_port()}

    def node_peer(self, node: str) -> Peer:
        state = self.workdir / f"state-{node}"
        state.mkdir(exist_ok=True)
        peers = "" if node == "b" else f'"tcp://127.0.0.1:{self.b_port}"'
        if node == "a":
            socks = f'listen = "{self.socks[0]}:{self.socks[1]}"\nmax_clients = 4096'
            if self.socks_workers > 1:
                socks += f"\nworkers = {self.socks_workers}"
        else:
            socks = "enable = false"
        conf = self.workdir / f"{node}.toml"
        conf.write_text(
            f'log_level = "warning"\n'
            f'[node]\nname = "{node}"\nnetwork = "bench"\nsecret = "bench portal secret"\n'
            f'ipv4 = "{VIPS[node]}/24"\nstate_dir = "{state}"\n'
            f'[mesh]\nlisten = ["tcp://127.0.0.1:{self.ports[node]}"]\npeers = [{peers}]\n'
            f"[socks5]\n{socks}\n[admin]\nenable = false\n{self.extra_toml}\n{_serve_toml(self.tree)}"
        )
        # cwd first on sys.path (-m): an extracted REF's package shadows the working tree's.
        argv = [sys.executable, "-m", "meshgate", "run", "-c", str(conf), "--loop", "uvloop"]
        port = self.socks[1] if node == "a" else self.ports[node]
        return Peer(f"{self.name}-{node}", argv, port=port, cwd=str(self.tree))


SERVED_PORTS: list[int] = []  # the targets' ports: every meshgate node publishes them ([serve])


def _serve_toml(tree: Path) -> str:
    """[serve] for the targets on each node's virtual IP (EasyTier maps its own virtual IP to
    its loopback whole; meshgate publishes port by port since [serve]). An older tree (--ab
    REF) from before [serve] maps the whole loopback and would refuse the unknown table."""
    if "_read_serve" not in (tree / "meshgate" / "config.py").read_text():
        return ""
    return "[serve]\n" + "".join(f'{p} = "127.0.0.1:{p}"\n' for p in SERVED_PORTS)


class EasyTierLine(Line):
    """EasyTier's Rust core runs inside a Python interpreter (easytier_node.py), so its nodes'
    RSS includes that interpreter: `interpreter_rss_mib` measures a bare one with the same
    import, idle (easytier_node.py --baseline), so the core's own share can be shown apart."""

    def interpreter_rss_mib(self) -> tuple[float, float]:
        return easytier_interpreter_rss_mib()

    def node_peer(self, node: str) -> Peer:
        argv = [sys.executable, str(PEERS / "easytier_node.py"), "--name", node, "--ip", VIPS[node],
                "--network", "bench", "--secret", "bench portal secret", "--expect-routes", "0"]
        if node == "b":
            argv += ["--listen", f"tcp://127.0.0.1:{self.b_port}"]
        else:
            argv += ["--peer", f"tcp://127.0.0.1:{self.b_port}"]
        if node == "a":
            argv += ["--socks5", f"{self.socks[0]}:{self.socks[1]}"]
        return Peer(f"{self.name}-{node}", argv, ready_text='"ready": true')


# --------------------------------------------------------------------------- main section


def main_round(line: Line, targets: Targets, size: int, seconds: float, clients: list[int],
               rtt_count: int) -> Metrics:
    out: Metrics = {}
    for hops in (1, 2):
        bulk = line.target(hops, targets.bulk_port)
        rr = line.target(hops, targets.rr_port)
        cpu0 = line.cpu()
        down = bulk_down(line.socks, bulk, size)
        up = bulk_up(line.socks, bulk, size)
        cpu1 = line.cpu()
        out[f"{hops}hop down MB/s"] = size / down / 1e6
        out[f"{hops}hop up MB/s"] = size / up / 1e6
        for n in "abc":
            out[f"{hops}hop {n.upper()} cpu s/GiB"] = (cpu1[n] - cpu0[n]) / (2 * size / GIB)
        cpu0 = line.cpu()
        rtt = echo_rtt(line.socks, bulk, rtt_count)
        cpu1 = line.cpu()
        out[f"{hops}hop rtt us p50"] = rtt["rtt_us_p50"]
        out[f"{hops}hop rtt us p99"] = rtt["rtt_us_p99"]
        for n in "abc":  # what one small request and its answer cost each node (a relay: B at 2 hops)
            out[f"{hops}hop {n.upper()} cpu us/rtt"] = (cpu1[n] - cpu0[n]) / rtt_count * 1e6
        errors = 0.0
        for c in clients:
            m = conn_rate(line.socks, rr, c, seconds)
            out[f"{hops}hop conn/s {c}c"] = m["conn/s"]
            errors += m["errors/s"] * seconds
        out[f"{hops}hop conn errors"] = errors
    peak = line.peak_rss_mib()
    for n, v in peak.items():
        out[f"{n.upper()} peak RSS MiB"] = v
    interp = line.interpreter_rss_mib()
    if interp is not None:
        # the hosting interpreter's peak, measured beside (not a constant): the core's own share
        out["interpreter peak RSS MiB"] = interp[1]
        for n, v in peak.items():
            out[f"{n.upper()} peak RSS - interpreter MiB"] = v - interp[1]
    return out


# --------------------------------------------------------------------------- churn section


def settled_rss(line: Line, seconds: float) -> dict[str, float]:
    """RSS after the nodes sat idle for `seconds` (what they give back, they give back by then)."""
    time.sleep(seconds)
    return line.rss_mib()


def churn_run(start: Callable[[], Line], targets: Targets, size: int, churn: int, churn_seconds: float,
              burst: int, rtt_count: int, settle: float) -> Metrics:
    out: Metrics = {}
    line = start().start(targets.rr_port)
    try:
        bulk = line.target(2, targets.bulk_port)
        rr = line.target(2, targets.rr_port)
        idle = line.rss_mib()
        for n in "abc":
            out[f"{n.upper()} idle RSS MiB"] = idle[n]
        interp = line.interpreter_rss_mib()
        if interp is not None:
            out["interpreter idle RSS MiB"] = interp[0]
            for n in "abc":
                out[f"{n.upper()} idle RSS - interpreter MiB"] = idle[n] - interp[0]
        # medians of three: one transfer on a shared 2-core machine swings by 10-20%
        fresh_mb = statistics.median(size / bulk_down(line.socks, bulk, size) / 1e6 for _ in range(3))
        fresh_rtt = statistics.median(echo_rtt(line.socks, bulk, rtt_count)["rtt_us_p50"] for _ in range(3))
        warm = settled_rss(line, settle)
        out["fresh 2hop down MB/s"] = fresh_mb
        out["fresh 2hop rtt us p50"] = fresh_rtt
        for n in "abc":
            out[f"{n.upper()} warm RSS MiB"] = warm[n]

        m = conn_rate(line.socks, rr, 50, churn_seconds, limit=churn, detail=True)
        out["churn conns ok"] = m["conns"]
        out["churn errors"] = m["errors"]
        out["churn conn/s"] = m["conn/s"]
        after = line.rss_mib()
        # A portal may come out of the churn broken: record that (and how often the
        # bulk CONNECT failed) instead of losing the row.
        after_mb = after_rtt = 0.0
        failures = 0
        for _ in range(3):
            try:
                after_mb = statistics.median(size / bulk_down(line.socks, bulk, size) / 1e6 for _ in range(3))
                after_rtt = statistics.median(
                    echo_rtt(line.socks, bulk, rtt_count)["rtt_us_p50"] for _ in range(3))
                break
            except (RuntimeError, OSError) as e:
                failures += 1
                print(f"  [{line.name}] after churn: {e}", file=sys.stderr)
        settled = settled_rss(line, settle)
        out["after: failed bulk/rtt tries"] = failures
        out["after 2hop down MB/s"] = after_mb
        out["after 2hop rtt us p50"] = after_rtt
        out["after/fresh MB/s"] = after_mb / fresh_mb
        out["after/fresh rtt"] = after_rtt / fresh_rtt
        for n in "abc":
            out[f"{n.upper()} RSS after churn MiB"] = after[n]
            out[f"{n.upper()} RSS settled MiB"] = settled[n]
            if interp is not None:
                out[f"{n.upper()} RSS settled - interpreter MiB"] = settled[n] - interp[0]
            out[f"{n.upper()} settled/warm RSS"] = settled[n] / warm[n]
            out[f"{n.upper()} settled/idle RSS"] = settled[n] / idle[n]
    finally:
        line.stop()
    # The burst on another fresh line: these are the portal's first CONNECTs.
    line = start().start(targets.rr_port)
    try:
        b = connect_burst(line.socks, line.target(2, targets.rr_port), burst)
        out |= {f"burst {k}": v for k, v in b.items()}
        rss = line.rss_mib()
        for n in "abc":
            out[f"{n.upper()} RSS after burst MiB"] = rss[n]
    finally:
        line.stop()
    return out


# --------------------------------------------------------------------------- main


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(p, rounds=3)
    p.add_argument("--size", type=int, default=256, help="MiB per bulk direction (default 256)")
    p.add_argument("--seconds", type=float, default=4.0, help="duration of each connection-rate run")
    p.add_argument("--clients", default="20,50", help="concurrent clients of the rate runs")
    p.add_argument("--rtt-count", type=int, default=2000, help="ping-pongs per RTT measurement")
    p.add_argument("--churn", type=int, default=100_000, help="short connections in the churn run")
    p.add_argument("--churn-seconds", type=float, default=150.0, help="time cap of the churn run")
    p.add_argument("--burst", type=int, default=1000, help="simultaneous CONNECTs in the burst")
    p.add_argument("--settle", type=float, default=12.0,
                   help="idle seconds before an RSS reading (longer than limits.memory_trim_interval)")
    p.add_argument("--sections", default="main,churn", help="main, churn or both")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=TOML",
                   help="also run meshgate with TOML appended to every node's config (\\n for newlines), "
                   "e.g. 'window1m=[limits]\\nstream_window = 1048576'")
    p.add_argument("--ab", metavar="REF", help="also run meshgate as of git REF (A/B of a change)")
    p.add_argument("--socks-workers", type=int, default=0, metavar="N",
                   help="also run meshgate with socks5.workers = N on node A ('meshgate workersN': "
                   "every CONNECT is mesh-bound, so each is handed over to A's node process)")
    p.add_argument("--baseline", metavar="NAME",
                   help="the variant the ratios are against (default: easytier if it runs, else "
                   "meshgate@REF with --ab, else meshgate), e.g. meshgate for a --variant's effect")
    args = p.parse_args()
    sections = {s.strip() for s in args.sections.split(",")}
    clients = [int(c) for c in args.clients.split(",")]
    size = args.size * MIB

    workdir = tempfile.mkdtemp(prefix="meshgate-portal-bench-")
    starters: dict[str, Callable[[], Line]] = {}
    if selected(args, "meshgate"):
        starters["meshgate"] = lambda: MeshgateLine("meshgate", workdir)
    if args.ab and selected(args, f"meshgate@{args.ab}"):
        tree = git_tree(args.ab, workdir)
        starters[f"meshgate@{args.ab}"] = lambda: MeshgateLine(f"meshgate@{args.ab}", workdir, tree)
    if args.socks_workers > 1:
        wname = f"meshgate workers{args.socks_workers}"
        starters[wname] = functools.partial(MeshgateLine, wname, workdir, ROOT,
                                            socks_workers=args.socks_workers)
    for spec in args.variant:
        vname, _, toml = spec.partition("=")
        starters[vname] = functools.partial(MeshgateLine, vname, workdir, ROOT, toml.replace("\\n", "\n"))
    if selected(args, "easytier"):
        if loopback_only():
            starters["easytier"] = lambda: EasyTierLine("easytier", workdir)
        else:
            print("easytier: not in a loopback-only network namespace, its rows are skipped "
                  "(run under bench/peers/isolated)", file=sys.stderr)
    # ratios against EasyTier when it runs; else an A/B: the change against REF, a --variant against meshgate
    baseline = next((b for b in ("easytier", f"meshgate@{args.ab}", "meshgate") if b in starters), None)
    if args.baseline:
        baseline = args.baseline if args.baseline in starters else None

    # SIGTERM (timeout, CI) unwinds through `finally` so nodes and targets stop too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    targets = Targets()
    SERVED_PORTS[:] = [targets.bulk_port, targets.rr_port]
    lines: dict[str, Line] = {}
    runners: list[Runner] = []
    try:
        if "main" in sections:
            for name, start in starters.items():
                try:
                    lines[name] = start().start(targets.rr_port)
                except (RuntimeError, OSError) as e:
                    print(f"skipping {name}: {e}", file=sys.stderr)
            title = (f"portal A-B-C: bulk {args.size} MiB each way, conn/s with {args.clients} clients "
                     f"for {args.seconds:g} s")
            r = Runner(title, args.rounds, baseline=baseline if baseline in lines else None)
            for name, line in lines.items():
                r.add(name, functools.partial(main_round, line, targets, size, args.seconds, clients,
                                              args.rtt_count))
            r.run()
            runners.append(r)
            for line in lines.values():
                line.stop()
            lines.clear()
        if "churn" in sections:
            title = (f"portal churn: fresh line, burst of {args.burst}, then up to {args.churn} connections "
                     f"(cap {args.churn_seconds:g} s), to the two-hop target")
            r = Runner(title, 1, baseline=baseline)
            for name, start in starters.items():
                r.add(name, functools.partial(churn_run, start, targets, size, args.churn,
                                              args.churn_seconds, args.burst, args.rtt_count, args.settle))
            r.run()
            runners.append(r)
        report(runners, args.json, by_metric=True)
        for r in runners:
            _targets(r, starters)
    finally:
        for line in lines.values():
            line.stop()
        targets.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


def _targets(r: Runner, starters: dict[str, Callable[[], Line]]) -> None:
    """The issue's targets as medians of paired ratios meshgate/EasyTier, when EasyTier ran here
    (nothing otherwise: no figure from elsewhere stands in for a measurement). Memory is
    compared with EasyTier's RSS less the interpreter hosting its core, measured in the same
    round (and the raw ratio beside it)."""
    if "meshgate" not in r.results or not r.results["meshgate"]:
        return
    if not r.results.get("easytier"):
        print(f"targets for {r.title.split(':')[0]}: EasyTier did not run here "
              "(run under bench/peers/isolated), no ratio")
        return
    checks = [
        ("1hop down MB/s", "1hop down MB/s", 4.0, True), ("1hop up MB/s", "1hop up MB/s", 4.0, True),
        ("2hop down MB/s", "2hop down MB/s", 4.0, True), ("2hop up MB/s", "2hop up MB/s", 4.0, True),
        ("1hop conn/s 20c", "1hop conn/s 20c", 2.0, True), ("2hop conn/s 20c", "2hop conn/s 20c", 2.0, True),
        ("A peak RSS MiB", "A peak RSS - interpreter MiB", 0.25, False),
        ("A peak RSS MiB", "A peak RSS MiB", 0.25, False),
    ]
    lines = [f"targets for {r.title.split(':')[0]} (meshgate/EasyTier, median of paired ratios, "
             "measured here):"]
    pairs = list(zip(r.results["meshgate"], r.results["easytier"], strict=False))
    for mg_metric, et_metric, bound, higher in checks:
        ratios = [m[mg_metric] / e[et_metric] for m, e in pairs
                  if mg_metric in m and et_metric in e and e[et_metric] > 0]
        if not ratios:
            continue
        ratio = statistics.median(ratios)
        ok = ratio >= bound if higher else ratio <= bound
        want = f"{'>=' if higher else '<='} {bound:g}"
        label = mg_metric if mg_metric == et_metric else f"{mg_metric} / EasyTier {et_metric}"
        lines.append(f"  {label:52} {ratio:7.2f}  (want {want})  {'met' if ok else 'NOT met'}")
    if len(lines) > 1:
        print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
