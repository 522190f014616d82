"""SOCKS5 portal benchmark: meshgate (uvloop) vs direct loopback, microsocks, dante, pproxy+uvloop.

Every variant is driven by the same client in the same run, in alternating
order (bench/common.py). Per round and variant:

* bulk: one connection downloads SIZE bytes through the proxy, one uploads
  SIZE bytes (default 1 GiB each way); MB/s each way, and the proxy's CPU
  seconds per GiB moved (both directions) and peak RSS;
* rate: 50 concurrent clients loop CONNECT + one 64-byte request and a 64-byte
  response for a fixed time; completed connections per second. The target
  closes first (dante runs out of local ports otherwise, see
  bench/peers/README.md).

The target servers run in a child process (`--serve`), so the client, the
proxy and the targets are separate processes, as they would be for real.

    .venv/bin/python bench/socks.py [--size MiB] [--rounds N] [--seconds S] [--json FILE]
"""

from __future__ import annotations

import argparse
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

ROOT = Path(__file__).resolve().parent.parent
MIB = 1 << 20
GIB = 1 << 30


# --------------------------------------------------------------------------- proxies


def start_meshgate(port: int, workdir: str) -> Peer:
    conf = Path(workdir, "meshgate.toml")
    conf.write_text(
        f'log_level = "warning"\n[socks5]\nlisten = "127.0.0.1:{port}"\nmax_clients = 4096\n'
        "[admin]\nenable = false\n"
    )
    argv = [sys.executable, "-m", "meshgate", "run", "-c", str(conf), "--loop", "uvloop"]
    return Peer("meshgate", argv, port=port, cwd=str(ROOT)).start()


def start_meshgate_ref(ref: str) -> Callable[[int, str], Peer]:
    """meshgate as of git REF (extracted with `git archive`), for A/B runs of a change."""

    def start(port: int, workdir: str) -> Peer:
        tree = git_tree(ref, workdir)
        conf = Path(workdir, f"meshgate-{port}.toml")
        conf.write_text(
            f'log_level = "warning"\n[socks5]\nlisten = "127.0.0.1:{port}"\nmax_clients = 4096\n'
            "[admin]\nenable = false\n"
        )
        # cwd first on sys.path (-m): the extracted package shadows the working tree's.
        argv = [sys.executable, "-m", "meshgate", "run", "-c", str(conf), "--loop", "uvloop"]
        return Peer(f"meshgate@{ref}", argv, port=port, cwd=str(tree)).start()

    return start


def start_microsocks(port: int, workdir: str) -> Peer:
    exe = shutil.which("microsocks")
    if exe is None:
        raise RuntimeError("microsocks not installed (apt-get install microsocks)")
    return Peer("microsocks", [exe, "-i", "127.0.0.1", "-p", str(port)], port=port).start()


def start_dante(port: int, workdir: str) -> Peer:
    exe = shutil.which("danted") or "/usr/sbin/danted"
    if not os.path.exists(exe):
        raise RuntimeError("danted not installed (apt-get install dante-server)")
    template = (PEERS / "danted.conf.in").read_text()
    conf = Path(workdir, "danted.conf")
    conf.write_text(template.replace("@PORT@", str(port)).replace("@LOG@", str(Path(workdir, "danted.log"))))
    pid_file = str(Path(workdir, "danted.pid"))
    return Peer("dante", [exe, "-f", str(conf), "-p", pid_file], port=port, pid_file=pid_file).start()


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
    return Peer("pproxy+uvloop", [sys.executable, "-c", _PPROXY_UVLOOP, str(port)], port=port).start()


STARTERS: dict[str, Callable[[int, str], Peer]] = {
    "meshgate": start_meshgate,
    "microsocks": start_microsocks,
    "dante": start_dante,
    "pproxy+uvloop": start_pproxy,
}


# --------------------------------------------------------------------------- main


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(p, rounds=3)
    p.add_argument("--size", type=int, default=1024, help="MiB per bulk direction (default 1024 = 1 GiB)")
    p.add_argument("--seconds", type=float, default=5.0, help="duration of each connection-rate run")
    p.add_argument("--clients", type=int, default=50, help="concurrent clients in the rate test")
    p.add_argument("--ab", metavar="REF", help="also run meshgate as of git REF (A/B of a change)")
    args = p.parse_args()

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
        for name, start in starters.items():
            if not selected(args, name):
                continue
            try:
                peers[name] = start(free_port(), workdir)
            except (RuntimeError, OSError) as e:
                print(f"skipping {name}: {e}", file=sys.stderr)

        def variant(name: str) -> Callable[[], Metrics]:
            def run() -> Metrics:
                peer = peers.get(name)
                proxy = (peer.host, peer.port) if peer else None
                cpu0 = peer.cpu_seconds() if peer else 0.0
                down = bulk_down(proxy, bulk_target, size)
                up = bulk_up(proxy, bulk_target, size)
                cpu = (peer.cpu_seconds() - cpu0) if peer else 0.0
                out: Metrics = {
                    "down MB/s": size / down / 1e6,
                    "up MB/s": size / up / 1e6,
                }
                cpu1 = peer.cpu_seconds() if peer else 0.0
                out.update(conn_rate(proxy, rr_target, args.clients, args.seconds))
                if peer:
                    out["cpu s/GiB"] = cpu / (2 * size / GIB)
                    # CPU per connection holds up when other work shares the
                    # machine, where conn/s and MB/s move with the contention.
                    conns = out["conn/s"] * args.seconds
                    out["cpu ms/conn"] = (peer.cpu_seconds() - cpu1) / conns * 1e3 if conns else float("nan")
                    out["rss MiB"] = peer.peak_rss_kib() / 1024
                return out

            return run

        title = f"SOCKS5 portals, {args.size} MiB each way, {args.clients} clients"
        runner = Runner(title, args.rounds, baseline="meshgate" if "meshgate" in peers else None)
        for name in names:
            if (name == "direct" and selected(args, name)) or name in peers:
                runner.add(name, variant(name))
        runner.run()
        ratios = ["down MB/s", "up MB/s", "conn/s", "cpu s/GiB", "cpu ms/conn"]
        report([runner], args.json, ratio_metrics=ratios)
        _targets(runner)
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


if __name__ == "__main__":
    sys.exit(main())
