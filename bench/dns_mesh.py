"""DNS through the mesh: what split DNS to another node's served suffix and oblivious DNS
through two other nodes cost, beside a route straight to the same authority.

Three `meshgate run` processes in a line a - b - c (tcp:// links on loopback; a reaches c
only through b) and one authority process answering every A question. The load generator
(this process, dnspython, `--concurrency` in flight) asks a's UDP listener for fresh names
(every question a cache miss, so each goes the whole way):

* direct     a `[[dns.route]]` at a straight to the authority (the baseline);
* mesh       a name under c's `dns.serve_suffixes`: a -> b -> c (sealed end to end) -> authority;
* odoh-mesh  an `odoh-mesh://c?proxy=b` route at a: sealed to c's key, carried by b, c resolves.

Per round: queries/s, p50/p99 latency seen by the client, and CPU microseconds per query in
each node process (from /proc). No peer offers either feature between its members (Tailscale's
split DNS forwards to a resolver address over its tunnel; nothing offers ODoH between nodes).

    .venv/bin/python bench/dns_mesh.py [--queries N] [--concurrency C] [--rounds R] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import multiprocessing
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]  # bench/dns.py shadows dnspython
sys.path.insert(0, str(_HERE.parent))

from bench.common import Metrics, Peer, Runner, add_args, free_port, report, selected  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SECRET = "bench-dns-mesh-secret-0123456789"


def _authority(port: int) -> None:
    """Answers every A question with 192.0.2.1, TTL 300 (a process of its own)."""
    import dns.message
    import dns.rrset

    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", port))
    while True:
        data, addr = sock.recvfrom(4096)
        try:
            q = dns.message.from_wire(data)
        except Exception:
            continue
        r = dns.message.make_response(q)
        r.answer.append(dns.rrset.from_text(q.question[0].name, 300, "IN", "A", "192.0.2.1"))
        sock.sendto(r.to_wire(), addr)


def _config(tmp: Path, role: str, admin: int, body: str) -> Path:
    """A node's config; its admin API's port is what the bench waits for at start."""
    path = tmp / f"{role}.toml"
    path.write_text(f'log_level = "warning"\n[node]\nname = "{role}"\nnetwork = "bench"\n'
                    f'secret = "{SECRET}"\nstate_dir = "{tmp / role}"\n'
                    f'[socks5]\nenable = false\n[admin]\nlisten = "127.0.0.1:{admin}"\n{body}')
    return path


async def _drive(port: int, suffix: str, n: int, concurrency: int, serial: itertools.count[int]
                 ) -> tuple[float, list[float]]:
    import dns.asyncquery
    import dns.message

    lat: list[float] = []

    async def worker() -> None:
        for _ in range(n // concurrency):
            q = dns.message.make_query(f"q{next(serial)}.{suffix}", "A")
            t0 = time.perf_counter()
            r = await dns.asyncquery.udp(q, "127.0.0.1", port=port, timeout=10)
            lat.append(time.perf_counter() - t0)
            if not r.answer:
                raise RuntimeError(f"no answer for {q.question[0].name}: rcode {r.rcode()}")

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.perf_counter() - t0, lat


def _variant(port: int, suffix: str, n: int, conc: int, nodes: dict[str, Peer],
             serial: itertools.count[int]) -> Callable[[], Metrics]:
    def run() -> Metrics:
        cpu0 = {k: p.cpu_seconds() for k, p in nodes.items()}
        wall, lat = asyncio.run(_drive(port, suffix, n, conc, serial))
        done = len(lat)
        lat.sort()
        out: Metrics = {"q/s": done / wall, "p50_ms": statistics.median(lat) * 1e3,
                        "p99_ms": lat[min(done - 1, int(done * 0.99))] * 1e3}
        for k, p in nodes.items():
            out[f"{k}_cpu_us/q"] = (p.cpu_seconds() - cpu0[k]) / done * 1e6
        return out

    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(p)
    p.add_argument("--queries", type=int, default=2000, help="queries per round and variant")
    p.add_argument("--concurrency", type=int, default=16, help="queries in flight")
    args = p.parse_args()
    auth_port, dns_port, b_port = free_port(), free_port(), free_port()
    auth = multiprocessing.Process(target=_authority, args=(auth_port,), daemon=True)
    auth.start()
    up = f'"udp://127.0.0.1:{auth_port}"'
    try:
        with tempfile.TemporaryDirectory(prefix="meshgate-bench-dns-mesh-") as td:
            tmp = Path(td)
            admin = {k: free_port() for k in "abc"}
            b = _config(tmp, "b", admin["b"], f'[mesh]\nlisten = ["tcp://127.0.0.1:{b_port}"]\n'
                                  '[dns]\nmesh_odoh_proxy = true\nupstreams = ["udp://127.0.0.1:9"]\n')
            c = _config(tmp, "c", admin["c"], f'[mesh]\npeers = ["tcp://127.0.0.1:{b_port}"]\n'
                                  f'[dns]\nupstreams = [{up}]\nserve_suffixes = ["lan.bench."]\n'
                                  'mesh_odoh_target = true\n')
            a = _config(tmp, "a", admin["a"], f'[mesh]\npeers = ["tcp://127.0.0.1:{b_port}"]\n'
                                  '[dns]\nupstreams = ["udp://127.0.0.1:9"]\n'
                                  f'[[dns.listener]]\nprotocol = "udp"\nlisten = "127.0.0.1:{dns_port}"\n'
                                  f'[[dns.route]]\nsuffix = "direct.bench."\nupstreams = [{up}]\n'
                                  '[[dns.route]]\nsuffix = "obl.bench."\n'
                                  'upstreams = ["odoh-mesh://c?proxy=b"]\n')
            exe = [sys.executable, "-m", "meshgate", "run", "-c"]
            env = {"PYTHONPATH": str(ROOT)}
            nb = Peer("b", [*exe, str(b)], port=admin["b"], env=env, cwd=str(ROOT))
            nc = Peer("c", [*exe, str(c)], port=admin["c"], env=env, cwd=str(ROOT))
            na = Peer("a", [*exe, str(a)], port=admin["a"], env=env, cwd=str(ROOT))
            with nb, nc, na:
                nodes = {"a": na, "b": nb, "c": nc}
                serial = itertools.count()
                n, conc = args.queries, args.concurrency
                # until a has c's record (and its suffix): the mesh variant answers
                deadline = time.monotonic() + 30
                while True:
                    try:
                        asyncio.run(_drive(dns_port, "lan.bench", conc, conc, serial))
                        asyncio.run(_drive(dns_port, "obl.bench", conc, conc, serial))
                        break
                    except Exception:
                        if time.monotonic() > deadline:
                            raise
                        time.sleep(0.5)
                r = Runner(f"DNS through the mesh, cache misses ({n} queries x {conc} in flight per round)",
                           rounds=args.rounds, baseline="direct")
                for name, suffix in (("direct", "direct.bench"), ("mesh", "lan.bench"),
                                     ("odoh-mesh", "obl.bench")):
                    if selected(args, name):
                        r.add(name, _variant(dns_port, suffix, n, conc, nodes, serial))
                r.run()
                rss = {k: v.peak_rss_kib() / 1024 for k, v in nodes.items()}
        report([r], json_path=args.json, ratio_metrics=["q/s", "p50_ms", "a_cpu_us/q"])
        print("peak RSS MiB: " + ", ".join(f"{k} {v:.1f}" for k, v in rss.items()))
    finally:
        auth.kill()


if __name__ == "__main__":
    main()
