"""SOCKS5 and HTTP CONNECT portal benchmark: meshgate (uvloop) vs direct loopback, microsocks,
dante, pproxy+uvloop (SOCKS5) and tinyproxy (HTTP CONNECT); and what a config reload costs.

Every variant is driven by the same client in the same run, in alternating
order (bench/common.py): one Python client, speaking SOCKS5 or HTTP CONNECT
(only the handshake differs). Per round and variant:

* bulk: one connection downloads SIZE bytes through the proxy, one uploads
  SIZE bytes (default 1 GiB each way); MB/s each way, and the proxy's CPU
  seconds per GiB moved (both directions) and peak RSS;
* rate: 50 concurrent clients loop CONNECT + one 64-byte request and a 64-byte
  response for a fixed time; completed connections per second, and the proxy's
  CPU ms per connection (`sys ms/conn`: the part of it spent in the kernel, which
  any proxy pays for its accepts, connects, reads and writes). The target
  closes first (dante runs out of local ports otherwise, see
  bench/peers/README.md).

`meshgate workers` is another meshgate, a single node with `socks5.workers =
--workers` (default 2: the node's process and one worker on SO_REUSEPORT; CPU
and RSS summed over the process tree, as for dante's processes). microsocks
(a thread per client) and dante (processes) use both cores too; pproxy and
plain `meshgate` are one process. `--pin` puts them all on one CPU instead.

`meshgate http` is the same meshgate process as `meshgate`, through its
`[http_proxy]` listener. `meshgate +reloads` is that process again, over
SOCKS5, while another thread makes it reload its config every
`--reload-every` seconds during both tests (POST /reload, alternating two
files that differ in `dns.records` and `exit.deny`: each reload applies a
change, bench/reloads.py); its `reload ms` is the median time of those
reloads as that thread sees them.
Before the rounds, `--reloads` reloads of the idle node give the reload time
alone.

`--pin CPU` runs every proxy on that one CPU (taskset), so a proxy with
threads or worker processes (tinyproxy, dante, microsocks) gets the same
core as single-threaded meshgate.

The target servers run in a child process (`--serve`), so the client, the
proxy and the targets are separate processes, as they would be for real.

    .venv/bin/python bench/socks.py [--size MiB] [--rounds N] [--seconds S] [--pin CPU]
                                    [--only a,b] [--json FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import sys
import tempfile
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
    free_port,
    git_tree,
    report,
    selected,
)
from bench.reloads import Reloader, meshgate_conf, reload_once

ROOT = Path(__file__).resolve().parent.parent
MIB = 1 << 20
GIB = 1 << 30


# --------------------------------------------------------------------------- proxies


# meshgate's other listeners: its HTTP proxy and admin API (reloads), by the SOCKS5 port
HTTP_PORT: dict[int, int] = {}
ADMIN_PORT: dict[int, int] = {}
PIN: list[str] = []  # ["taskset", "-c", CPU] with --pin
WORKERS = [2]  # socks5.workers of the "meshgate workers" row (--workers)


def start_meshgate(port: int, workdir: str) -> Peer:
    """One meshgate process: SOCKS5 on `port`, the HTTP proxy and the admin API beside it."""
    HTTP_PORT[port], ADMIN_PORT[port] = free_port(), free_port()
    conf = Path(workdir, "meshgate.toml")
    conf.write_text(meshgate_conf(port, HTTP_PORT[port], ADMIN_PORT[port], 0, conf.parent / "state"))
    argv = [*PIN, sys.executable, "-m", "meshgate", "run", "-c", str(conf), "--loop", "uvloop"]
    return Peer("meshgate", argv, port=port, cwd=str(ROOT)).start()


def start_meshgate_ref(ref: str) -> Callable[[int, str], Peer]:
    """meshgate as of git REF (extracted with `git archive`), for A/B runs of a change."""

    def start(port: int, workdir: str) -> Peer:
        tree = git_tree(ref, workdir)
        conf = Path(workdir, f"meshgate-{port}.toml")
        # the `meshgate` row's config (HTTP proxy, admin API, DNS records, [exit]) on ports of its
        # own, so the A/B compares like with like; its own state_dir: the default one may be
        # held by another node on this machine
        conf.write_text(meshgate_conf(port, free_port(), free_port(), 0, Path(workdir, f"state-{port}")))
        # cwd first on sys.path (-m): the extracted package shadows the working tree's.
        argv = [*PIN, sys.executable, "-m", "meshgate", "run", "-c", str(conf), "--loop", "uvloop"]
        return Peer(f"meshgate@{ref}", argv, port=port, cwd=str(tree)).start()

    return start


def start_meshgate_workers(port: int, workdir: str) -> Peer:
    """meshgate with `socks5.workers = WORKERS` (the node's process and WORKERS-1 workers sharing
    the port with SO_REUSEPORT); a single node, so every connection leaves from this host and
    the worker that accepted it relays it. CPU and RSS are the whole process tree's."""
    conf = Path(workdir, f"meshgate-w{WORKERS[0]}.toml")
    conf.write_text(
        f'log_level = "warning"\n[node]\nstate_dir = "{Path(workdir, "state-workers")}"\n'
        f'[socks5]\nlisten = "127.0.0.1:{port}"\nmax_clients = 4096\n'
        f"workers = {WORKERS[0]}\n[admin]\nenable = false\n"
    )
    argv = [*PIN, sys.executable, "-m", "meshgate", "run", "-c", str(conf), "--loop", "uvloop"]
    return Peer("meshgate workers", argv, port=port, cwd=str(ROOT)).start()


def start_microsocks(port: int, workdir: str) -> Peer:
    exe = shutil.which("microsocks")
    if exe is None:
        raise RuntimeError("microsocks not installed (apt-get install microsocks)")
    return Peer("microsocks", [*PIN, exe, "-i", "127.0.0.1", "-p", str(port)], port=port).start()


def start_dante(port: int, workdir: str) -> Peer:
    exe = shutil.which("danted") or "/usr/sbin/danted"
    if not os.path.exists(exe):
        raise RuntimeError("danted not installed (apt-get install dante-server)")
    template = (PEERS / "danted.conf.in").read_text()
    conf = Path(workdir, "danted.conf")
    conf.write_text(template.replace("@PORT@", str(port)).replace("@LOG@", str(Path(workdir, "danted.log"))))
    pid_file = str(Path(workdir, "danted.pid"))
    return Peer("dante", [*PIN, exe, "-f", str(conf), "-p", pid_file], port=port, pid_file=pid_file).start()


_PPROXY_UVLOOP = """
import asyncio, sys, uvloop
# pproxy calls uvloop.install() then asyncio.get_event_loop(), which has no loop
# under uvloop 0.23: make the loop first and keep pproxy from replacing the policy.
uvloop.install()
asyncio.set_event_loop(uvloop.new_event_loop())
uvloop.install = lambda: None
from pproxy import server
server.main(["-l", "socks5://127.0.0.1:" + sys.argv[1]])
"""


def start_pproxy(port: int, workdir: str) -> Peer:
    return Peer("pproxy+uvloop", [*PIN, sys.executable, "-c", _PPROXY_UVLOOP, str(port)], port=port).start()


_TINYPROXY_CONF = """Port {port}
Listen 127.0.0.1
Timeout 600
MaxClients 4096
LogLevel Critical
DisableViaHeader Yes
Allow 127.0.0.1
"""


def start_tinyproxy(port: int, workdir: str) -> Peer:
    """tinyproxy (Debian's), HTTP CONNECT to any port (no ConnectPort line), in the foreground."""
    exe = shutil.which("tinyproxy") or "/usr/bin/tinyproxy"
    if not os.path.exists(exe):
        raise RuntimeError("tinyproxy not installed (apt-get install tinyproxy)")
    conf = Path(workdir, "tinyproxy.conf")
    text = _TINYPROXY_CONF.format(port=port)
    if os.geteuid() == 0:  # it drops root to this user; the config is read before that
        text += "User nobody\nGroup nogroup\n"
    conf.write_text(text)
    return Peer("tinyproxy", [*PIN, exe, "-d", "-c", str(conf)], port=port).start()


STARTERS: dict[str, Callable[[int, str], Peer]] = {
    "meshgate": start_meshgate,
    "meshgate workers": start_meshgate_workers,
    "microsocks": start_microsocks,
    "dante": start_dante,
    "pproxy+uvloop": start_pproxy,
    "tinyproxy": start_tinyproxy,
}
HTTP_PEERS = frozenset({"tinyproxy"})  # speak HTTP CONNECT, not SOCKS5
# variants served by the meshgate process (no process of their own)
MESHGATE_VIEWS = ("meshgate http", "meshgate +reloads")


# --------------------------------------------------------------------------- main


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(p, rounds=3)
    p.add_argument("--size", type=int, default=1024, help="MiB per bulk direction (default 1024 = 1 GiB)")
    p.add_argument("--seconds", type=float, default=5.0, help="duration of each connection-rate run")
    p.add_argument("--clients", type=int, default=50, help="concurrent clients in the rate test")
    p.add_argument("--ab", metavar="REF", help="also run meshgate as of git REF (A/B of a change)")
    p.add_argument("--pin", metavar="CPU", help="run every proxy on this one CPU (taskset -c CPU)")
    p.add_argument("--reload-every", type=float, default=0.1,
                   help="seconds between reloads in meshgate +reloads")
    p.add_argument("--reloads", type=int, default=30, help="reloads of the idle node timed before the rounds")
    p.add_argument("--workers", type=int, default=2, help="socks5.workers of the 'meshgate workers' row")
    args = p.parse_args()
    WORKERS[0] = args.workers
    if args.pin is not None:
        PIN[:] = ["taskset", "-c", str(args.pin)]

    size = args.size * MIB
    targets = Targets()
    # SIGTERM (timeout, CI) unwinds through `finally` so peers and targets stop too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    workdir = tempfile.mkdtemp(prefix="meshgate-bench-")
    peers: dict[str, Peer] = {}
    try:
        bulk_target, rr_target = ("127.0.0.1", targets.bulk_port), ("127.0.0.1", targets.rr_port)
        starters = dict(STARTERS)
        if args.ab:
            starters = {"meshgate": start_meshgate, f"meshgate@{args.ab}": start_meshgate_ref(args.ab)} | {
                k: v for k, v in STARTERS.items() if k != "meshgate"
            }
        names = ["direct", *starters]
        names[names.index("meshgate") + 1:names.index("meshgate") + 1] = MESHGATE_VIEWS
        for name, start in starters.items():
            if not selected(args, name):
                continue
            try:
                peers[name] = start(free_port(), workdir)
            except (RuntimeError, OSError) as e:
                print(f"skipping {name}: {e}", file=sys.stderr)

        mg = peers.get("meshgate")
        idle_reloads: list[float] = []
        if mg is not None:
            ports = (mg.port, HTTP_PORT[mg.port], ADMIN_PORT[mg.port])
            conf = Path(workdir, "meshgate.toml")
            idle_reloads = [reload_once(conf, ports, (i + 1) % 2) for i in range(args.reloads)]
            if len(idle_reloads) % 2:
                reload_once(conf, ports, 0)  # back to the version it started with

        def variant(name: str) -> Callable[[], Metrics]:
            def run() -> Metrics:
                peer = mg if name in MESHGATE_VIEWS else peers.get(name)
                kind = "http" if name in HTTP_PEERS or name == "meshgate http" else "socks5"
                proxy = (peer.host, peer.port) if peer else None
                if name == "meshgate http" and peer is not None:
                    proxy = (peer.host, HTTP_PORT[peer.port])
                reloader = None
                if name == "meshgate +reloads" and peer is not None:
                    ports = (peer.port, HTTP_PORT[peer.port], ADMIN_PORT[peer.port])
                    reloader = Reloader(Path(workdir, "meshgate.toml"), ports, args.reload_every)
                with reloader or contextlib.nullcontext():  # reloading while both tests run
                    cpu0 = peer.cpu_seconds() if peer else 0.0
                    down = bulk_down(proxy, bulk_target, size, kind)
                    up = bulk_up(proxy, bulk_target, size, kind)
                    cpu = (peer.cpu_seconds() - cpu0) if peer else 0.0
                    out: Metrics = {
                        "down MB/s": size / down / 1e6,
                        "up MB/s": size / up / 1e6,
                    }
                    cpu1 = peer.cpu_seconds() if peer else 0.0
                    kernel1 = peer.kernel_cpu_seconds() if peer else 0.0
                    out.update(conn_rate(proxy, rr_target, args.clients, args.seconds, kind=kind))
                if reloader is not None:
                    out["reloads"] = float(len(reloader.times))
                    out["reload ms"] = reloader.median_ms()
                if peer:
                    out["cpu s/GiB"] = cpu / (2 * size / GIB)
                    # CPU per connection holds up when other work shares the
                    # machine, where conn/s and MB/s move with the contention.
                    conns = out["conn/s"] * args.seconds
                    out["cpu ms/conn"] = (peer.cpu_seconds() - cpu1) / conns * 1e3 if conns else float("nan")
                    # the part of it in the kernel (accept, connect, reads, writes, close): what
                    # a proxy in any language pays; the rest is the proxy's own work
                    out["sys ms/conn"] = (
                        (peer.kernel_cpu_seconds() - kernel1) / conns * 1e3 if conns else float("nan")
                    )
                    out["rss MiB"] = peer.peak_rss_kib() / 1024
                return out

            return run

        title = f"SOCKS5 portals, {args.size} MiB each way, {args.clients} clients"
        runner = Runner(title, args.rounds, baseline="meshgate" if "meshgate" in peers else None)
        for name in names:
            wanted = name in peers or (name in MESHGATE_VIEWS and mg is not None and selected(args, name))
            if (name == "direct" and selected(args, name)) or wanted:
                runner.add(name, variant(name))
        runner.run()
        ratios = ["down MB/s", "up MB/s", "conn/s", "cpu s/GiB", "cpu ms/conn", "sys ms/conn"]
        report([runner], args.json, ratio_metrics=ratios)
        _targets(runner)
        _http_and_reloads(runner, idle_reloads)
    finally:
        for peer in peers.values():
            peer.stop()
        targets.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


def _paired(runner: Runner, a: str, b: str, metric: str) -> float | None:
    import statistics

    ra, rb = runner.results.get(a, []), runner.results.get(b, [])
    ratios = [x[metric] / y[metric] for x, y in zip(ra, rb, strict=False) if y.get(metric)]
    return statistics.median(ratios) if ratios else None


def _targets(runner: Runner) -> None:
    """The issue's targets as paired ratios (median over rounds of meshgate/peer)."""
    checks = [
        ("bulk down >= dante", "dante", "down MB/s", 1.0, True),
        ("bulk up >= dante", "dante", "up MB/s", 1.0, True),
        ("bulk down >= 1.8x pproxy", "pproxy+uvloop", "down MB/s", 1.8, True),
        ("bulk up >= 1.8x pproxy", "pproxy+uvloop", "up MB/s", 1.8, True),
        ("conn/s >= dante", "dante", "conn/s", 1.0, True),
        ("CPU/GiB < pproxy", "pproxy+uvloop", "cpu s/GiB", 1.0, False),
    ]
    lines = ["targets (median of paired ratios meshgate/peer):"]
    for label, peer, metric, bound, higher in checks:
        r = _paired(runner, "meshgate", peer, metric)
        if r is None:
            lines.append(f"  {label:28} n/a")
            continue
        ok = r >= bound if higher else r < bound
        lines.append(f"  {label:28} {r:6.2f}  {'met' if ok else 'NOT met'}")
    print("\n".join(lines))


def _http_and_reloads(runner: Runner, idle_reloads: list[float]) -> None:
    """HTTP CONNECT beside SOCKS5 and tinyproxy, and what reloads cost, as paired ratios."""
    import statistics

    lines = ["HTTP CONNECT and reloads (median of paired ratios):"]
    pairs = [("meshgate http", "tinyproxy"), ("meshgate http", "meshgate"), ("meshgate +reloads", "meshgate")]
    for a, b in pairs:
        for metric in ("down MB/s", "up MB/s", "conn/s", "cpu s/GiB", "cpu ms/conn"):
            r = _paired(runner, a, b, metric)
            if r is not None:
                lines.append(f"  {a} / {b:12} {metric:12} {r:6.2f}")
    if idle_reloads:
        q = sorted(idle_reloads)
        lines.append(f"  reload of the idle node: median {statistics.median(q):.2f} ms, "
                     f"p90 {q[int(len(q) * 0.9)]:.2f} ms over {len(q)} (POST /reload, answer included)")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
