"""Mesh scale and idle cost: N nodes spread over P processes, tcp:// links on loopback.

Each host process (this script with --host) runs its share of the N nodes as
MeshService instances on one uvloop loop; node i goes to process i % P, so most
links cross processes. The topology is bench/mesh.py's random_graph (a random
tree plus extra links, mean degree 3): node i dials its lower-numbered
neighbours. Per round the coordinator reports:

* **converge_s**: from the moment every host got its peers to the moment the
  last node has a route to all N (hosts report CLOCK_MONOTONIC, shared by the
  processes of one machine); `cpu_s/node` the CPU every host spent meanwhile,
  per node; `records_rx/node` the route records received per node (every copy,
  held or new), `records_rx/s/node` the same per second of convergence,
  `resent/node` records sent again to a neighbour that had not acknowledged them,
  `verified/node` those whose signature was checked, `builds/node` route graph
  builds, and `links_dead_converging` links closed as silent meanwhile (a starved
  loop misses pings; each loss is a version every node checks). A round that has
  not converged after --timeout seconds reports converge_s nan and the fewest
  routes a node had (`least_routes`).
* **idle** (after the mesh stood still for --settle seconds, over --idle
  seconds): `%core/node` (host CPU / nodes / seconds), `B/s/link` the bytes one
  direction of a link carries (the link layer's count: sealed records, no
  TCP/IP headers), `records/s/node` route records received, `versions/s/node`
  own records originated, `builds/s/node` route graph builds; and what made the
  versions: `idle_latency_versions` (latency changes, whole mesh), `idle_links_dead`
  and `idle_links_up` (links that went silent, and came up).
* **join_s**: one more node joins the standing mesh (two links, from host 0):
  until every node routes to it. This is the protocol's propagation, with little
  CPU in it (each node checks one or two new versions).
* **memory**: `rss_MiB/node` (the hosts' RSS after convergence less their RSS
  before any node started, per node) and `table_MiB/node` (a deep size of node
  0's RouteTable in each host, mean over hosts: records, per-neighbour sync
  state, paths, lookup tables).

    .venv/bin/python bench/mesh_scale.py --nodes 100 --procs 4 [--rounds 1] [--ab REF] [--json F]
        [--timeout 600] [--dead-after S]

With `--ab REF` the hosts of a second variant import meshgate as of git REF
(bench/common.git_tree) and the two alternate per round. The machine bounds
what this shows: every node checks every other node's record signature once
per version (~0.1 ms each), so a cold start of N nodes costs ~N^2 x 0.1 ms of
CPU shared by however many cores the machine has.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import ipaddress
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

if os.environ.get("MESHGATE_TREE"):  # an --ab host: meshgate as of another commit
    sys.path.insert(0, os.environ["MESHGATE_TREE"])
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(1 if os.environ.get("MESHGATE_TREE") else 0, str(ROOT))

# --------------------------------------------------------------------------- host (child process)


def deep_size(obj: object) -> int:
    """Bytes of `obj` and everything it holds (containers, dataclass and slotted objects),
    each object once; functions, classes and modules are not followed (shared code)."""
    seen: set[int] = set()
    stack = [obj]
    total = 0
    skip = (type, type(deep_size), type(sys), type(print), type(len.__call__))
    while stack:
        o = stack.pop()
        if id(o) in seen or isinstance(o, skip) or callable(o):
            continue
        seen.add(id(o))
        total += sys.getsizeof(o)
        if isinstance(o, dict):
            stack.extend(o.keys())
            stack.extend(o.values())
        elif isinstance(o, (list, tuple, set, frozenset)):
            stack.extend(o)
        elif isinstance(o, (str, bytes, int, float, bool)) or o is None:
            continue
        else:
            d = getattr(o, "__dict__", None)
            if d is not None:
                stack.append(d)
            for cls in type(o).__mro__:
                for slot in getattr(cls, "__slots__", ()):
                    if hasattr(o, slot):
                        stack.append(getattr(o, slot))
    return total


def table_size(table: Any) -> int:
    """The RouteTable's own data (not the callables it was given, nor the loop)."""
    parts = [v for k, v in vars(table).items() if k not in ("_sign", "_accept")]
    return deep_size(parts)


def rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class Host:
    """One host process: its share of the nodes, driven by JSON lines on stdin."""

    def __init__(self, n: int, indices: list[int], out: IO[str]) -> None:
        self.n = n
        self.indices = indices
        self.out = out
        self.nodes: list[Any] = []
        self.base_rss = rss_kib()
        # --dead-after: the coordinator's limits.mesh_dead_after for every node (else the default)
        dead_after = os.environ.get("MESHSCALE_DEAD_AFTER")
        self.limits = {"mesh_dead_after": float(dead_after)} if dead_after else {}

    def say(self, **msg: Any) -> None:
        self.out.write(json.dumps(msg) + "\n")
        self.out.flush()

    async def add_node(self, i: int) -> Any:
        from meshgate.config import from_dict as config_from_dict
        from meshgate.mesh.identity import Identity
        from meshgate.mesh.service import MeshService

        ip = ipaddress.IPv4Address(0x0A000001 + i)
        cfg = config_from_dict({
            "node": {"name": f"n{i}", "network": "scale", "secret": "scale bench", "ipv4": f"{ip}/8"},
            "mesh": {"listen": ["tcp://127.0.0.1:0"], "peers": [], "traversal": False},
            "limits": {"route_records": max(4096, 2 * self.n), "max_peers": 256, **self.limits},
        })
        svc = MeshService(cfg, identity=Identity.generate())
        await svc.start()
        self.nodes.append(svc)
        return svc

    async def start(self) -> None:
        for i in self.indices:
            await self.add_node(i)
        self.say(ports=[int(s.listen_addrs[0].rsplit(":", 1)[1]) for s in self.nodes])

    def set_peers(self, peers: dict[str, list[int]]) -> None:
        from meshgate.config import LinkUrl

        for svc, i in zip(self.nodes, self.indices, strict=True):
            urls = tuple(LinkUrl("tcp", "127.0.0.1", port) for port in peers.get(str(i), []))
            svc.set_peers(urls)

    def counters(self) -> dict[str, float]:
        links = [link for svc in self.nodes for ls in svc.links.values() for link in ls]
        out = {
            "cpu_s": cpu_s(),
            "bytes_out": float(sum(link.bytes_out for link in links)),
            "links": float(len(links)),
            "versions": float(sum(svc.table.local.version for svc in self.nodes)),
        }
        for key in ("records_rx", "records_verified", "builds", "resent"):
            out[key] = float(sum(getattr(svc.table, key, 0) for svc in self.nodes))
        for key in ("latency_versions", "link_dead", "handshake_ok"):
            out[key] = float(sum(svc.stats[key] for svc in self.nodes))
        return out

    def lagging(self, target: int) -> list[str]:
        """What the nodes short of `target` routes hold (at most 5): to say why a round did not
        converge."""
        out = []
        for svc in self.nodes:  # (after a join, one more than self.indices)
            t = svc.table
            if len(t.hop_paths) >= target or len(out) >= 5:
                continue
            sync = {f"{nid:08x}": (len(s.pending), len(s.sent), len(s.acked))
                    for nid, s in getattr(t, "_sync", {}).items()}
            out.append(
                f"node {t.local.name} ({svc.node_id:08x}): {len(t.hop_paths)} routes,"
                f" {len(t.records)} records,"
                f" {t.unchecked} unchecked, dirty {t.dirty}, own v{t.local.version} listing"
                f" {len(t.local.neighbours)}, links {sorted(f'{n:08x}' for n in svc.links)},"
                f" sync (pending, sent, acked) {sync}, keepers {len(getattr(svc, '_keepers', {}))},"
                f" handshakes ok {svc.stats['handshake_ok']}, failed"
                f" {dict((k[17:], v) for k, v in svc.stats.items() if k.startswith('handshake_failed_'))},"
                f" links dead {svc.stats['link_dead']}"
            )
        return out

    async def watch(self, target: int, deadline: float) -> None:
        """Report once when every node of this host has routes to `target` nodes, or at
        `deadline` (CLOCK_MONOTONIC) with converged_at null and the fewest routes a node has."""
        while True:
            least = min(len(svc.table.hop_paths) for svc in self.nodes)
            if least >= target or time.monotonic() >= deadline:
                at = time.monotonic() if least >= target else None
                self.say(converged_at=at, least_routes=least, lagging=self.lagging(target), **self.counters())
                return
            await asyncio.sleep(0.02)

    async def run(self) -> None:
        from meshgate.config import LinkUrl

        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        await self.start()
        watcher: asyncio.Task[None] | None = None
        while line := await reader.readline():
            cmd = json.loads(line)
            op = cmd["op"]
            if op == "peers":
                self.set_peers(cmd["peers"])
                watcher = asyncio.ensure_future(self.watch(self.n, cmd["deadline"]))
            elif op == "join":  # one more node, dialing the given ports: how fast all learn it
                svc = await self.add_node(cmd["index"])
                urls = tuple(LinkUrl("tcp", "127.0.0.1", port) for port in cmd["peers"])
                svc.set_peers(urls)
                watcher = asyncio.ensure_future(self.watch(self.n + 1, cmd["deadline"]))
            elif op == "watch":
                watcher = asyncio.ensure_future(self.watch(cmd["target"], cmd["deadline"]))
            elif op == "counters":
                self.say(**self.counters())
            elif op == "memory":
                gc.collect()
                self.say(rss_kib=rss_kib() - self.base_rss, table_bytes=table_size(self.nodes[0].table))
            elif op == "stop":
                break
        if watcher is not None:
            watcher.cancel()
        await asyncio.gather(*(s.stop() for s in self.nodes), return_exceptions=True)


def host_main(n: int, indices: list[int]) -> None:
    import logging

    import uvloop

    # the coordinator reads stdout; anything the nodes log goes to stderr, kept quiet
    logging.basicConfig(level=logging.ERROR, stream=sys.stderr)
    uvloop.run(Host(n, indices, sys.stdout).run())


# --------------------------------------------------------------------------- coordinator


class Hosts:
    """P host processes for one N-node mesh of one variant."""

    def __init__(self, n: int, procs: int, tree: Path | None) -> None:
        self.n = n
        self.procs = procs
        env = dict(os.environ)
        if tree is not None:
            env["MESHGATE_TREE"] = str(tree)
        self.children: list[subprocess.Popen[str]] = []
        self.shares = [list(range(p, n, procs)) for p in range(procs)]
        for share in self.shares:
            self.children.append(subprocess.Popen(
                [sys.executable, __file__, "--host", str(n), ",".join(map(str, share))],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT,
            ))
        self.ports: dict[int, int] = {}
        for share, child in zip(self.shares, self.children, strict=True):
            msg = self.read(child)
            self.ports.update(zip(share, msg["ports"], strict=True))

    @staticmethod
    def read(child: subprocess.Popen[str]) -> dict[str, Any]:
        assert child.stdout is not None
        line = child.stdout.readline()  # a host that died reads as EOF: fail, not hang
        if not line:
            raise RuntimeError(f"host process exited ({child.poll()})")
        out: dict[str, Any] = json.loads(line)
        return out

    def send(self, child: subprocess.Popen[str], **cmd: Any) -> None:
        assert child.stdin is not None
        child.stdin.write(json.dumps(cmd) + "\n")
        child.stdin.flush()

    def ask(self, op: str) -> list[dict[str, Any]]:
        for c in self.children:
            self.send(c, op=op)
        return [self.read(c) for c in self.children]

    def stop(self) -> None:
        for c in self.children:
            with contextlib.suppress(OSError):  # a host that already died
                self.send(c, op="stop")
        for c in self.children:
            try:
                c.wait(30)
            except subprocess.TimeoutExpired:
                c.kill()
                c.wait(5)


def totals(rows: list[dict[str, Any]]) -> dict[str, float]:
    keys = ("cpu_s", "bytes_out", "links", "versions", "records_rx", "records_verified", "builds",
            "resent", "latency_versions", "link_dead", "handshake_ok")
    return {k: float(sum(r.get(k, 0.0) for r in rows)) for k in keys}


def one_round(
    n: int, procs: int, tree: Path | None, settle: float, idle: float, seed: int, timeout: float
) -> dict[str, float]:
    from bench.mesh import random_graph

    adj = random_graph(n, 3, seed=seed)
    hosts = Hosts(n, procs, tree)
    try:
        before = totals(hosts.ask("counters"))
        peers = {str(i): [hosts.ports[j] for j, _ in adj[i] if j < i] for i in range(n)}
        t0 = time.monotonic()
        for c in hosts.children:
            hosts.send(c, op="peers", peers=peers, deadline=t0 + timeout)
        done: list[dict[str, Any]] = []
        for c in hosts.children:
            done.append(hosts.read(c))
        conv = totals(done)
        if any(d["converged_at"] is None for d in done):  # bounded: what it reached by then
            least = min(d["least_routes"] for d in done)
            for d in done:
                for line in d.get("lagging", []):
                    print(f"  short of {n} routes: {line}", file=sys.stderr)
            print(f"not converged in {timeout:.0f} s: the fewest routes a node had was {least} of {n}",
                  file=sys.stderr)
            return {"converge_s": float("nan"), "least_routes": float(least),
                    "cpu_s/node": (conv["cpu_s"] - before["cpu_s"]) / n,
                    "records_rx/node": (conv["records_rx"] - before["records_rx"]) / n,
                    "resent/node": (conv["resent"] - before["resent"]) / n,
                    "verified/node": (conv["records_verified"] - before["records_verified"]) / n,
                    "builds/node": (conv["builds"] - before["builds"]) / n,
                    "versions/node": (conv["versions"] - before["versions"]) / n,
                    "links_dead_converging": conv["link_dead"] - before["link_dead"]}
        span = max(d["converged_at"] for d in done) - t0
        out: dict[str, float] = {
            "converge_s": span,
            "cpu_s/node": (conv["cpu_s"] - before["cpu_s"]) / n,
            "records_rx/node": (conv["records_rx"] - before["records_rx"]) / n,
            "records_rx/s/node": (conv["records_rx"] - before["records_rx"]) / n / span,
            "resent/node": (conv["resent"] - before["resent"]) / n,
            "verified/node": (conv["records_verified"] - before["records_verified"]) / n,
            "builds/node": (conv["builds"] - before["builds"]) / n,
            "versions/node": (conv["versions"] - before["versions"]) / n,
            # links whose peer fell silent while converging (a starved loop misses pings)
            "links_dead_converging": conv["link_dead"] - before["link_dead"],
        }
        mem = hosts.ask("memory")
        out["rss_MiB/node"] = sum(m["rss_kib"] for m in mem) / 1024 / n
        out["table_MiB/node"] = sum(m["table_bytes"] for m in mem) / len(mem) / 2**20
        time.sleep(settle)  # what converging left behind (resends, last pings' versions) dies down
        a = totals(hosts.ask("counters"))
        t1 = time.monotonic()
        time.sleep(idle)
        b = totals(hosts.ask("counters"))
        span = time.monotonic() - t1
        links = max(1.0, b["links"])  # link ends = directions of links
        out["idle_%core/node"] = 100 * (b["cpu_s"] - a["cpu_s"]) / n / span
        out["idle_B/s/link"] = (b["bytes_out"] - a["bytes_out"]) / links / span
        out["idle_records/s/node"] = (b["records_rx"] - a["records_rx"]) / n / span
        out["idle_versions/s/node"] = (b["versions"] - a["versions"]) / n / span
        out["idle_builds/s/node"] = (b["builds"] - a["builds"]) / n / span
        # what the versions were: latency changes, or links that went (silent) and came back
        out["idle_latency_versions"] = b["latency_versions"] - a["latency_versions"]
        out["idle_links_dead"] = b["link_dead"] - a["link_dead"]
        out["idle_links_up"] = b["handshake_ok"] - a["handshake_ok"]
        out["links"] = links / 2
        # a node joins the standing mesh (host 0, two links): until every node routes to it
        rng = random.Random(seed)
        joined = [hosts.ports[j] for j in rng.sample(range(n), 2)]
        t2 = time.monotonic()
        hosts.send(hosts.children[0], op="join", index=n, peers=joined, deadline=t2 + timeout)
        for c in hosts.children[1:]:
            hosts.send(c, op="watch", target=n + 1, deadline=t2 + timeout)
        joins = [hosts.read(c)["converged_at"] for c in hosts.children]
        out["join_s"] = float("nan") if None in joins else max(joins) - t2
        return out
    finally:
        hosts.stop()


def table_memory(n: int, seed: int) -> dict[str, float]:
    """One node's RouteTable in an n-node mesh, without the mesh: n signed records of the
    random graph's nodes (real keys and signatures) arrive from each of its 3 neighbours
    (a node of the mean degree) as ROUTES bodies, are checked and stored, and the routes built. The table's
    deep size and what tracemalloc saw it keep; the CPU per record received and checked."""
    import tracemalloc

    from bench.mesh import random_graph
    from meshgate.mesh.frames import MAX_BODY
    from meshgate.mesh.identity import Identity, verify
    from meshgate.mesh.routing import Record, RouteTable, encode_records

    adj = random_graph(n, 3, seed=seed)
    idents = [Identity.generate() for _ in range(n)]
    ids = [i.node_id for i in idents]
    now_ms = int(time.time() * 1000)
    records = []
    for i, ident in enumerate(idents):
        ip = ipaddress.IPv4Interface(f"{ipaddress.IPv4Address(0x0A000001 + i)}/8")
        rec = Record(ids[i], 1, now_ms, f"n{i}", ipv4=ip, key=ident.public,
                     neighbours=tuple(sorted((ids[j], lat) for j, lat in adj[i])))
        records.append(Record(**{**vars(rec), "signature": ident.sign(rec.signed_part)}))
    me = next(i for i in range(n) if len(adj[i]) == 3)  # a node of the mean degree
    bodies = encode_records(records[:me] + records[me + 1 :], MAX_BODY)

    def check(rec: Record, held: Record | None) -> str | None:
        return None if verify(rec.key[:32], rec.signature, rec.signed_part) else "bad_signature"

    neighbours = [ids[j] for j, _ in adj[me]]

    def fill() -> RouteTable:
        table = RouteTable(records[me], max_records=2 * n, sign=idents[me].sign, accept=check)
        for nid in neighbours:
            table.neighbour_up(nid)
            for body in bodies:
                table.receive_body(nid, body, 0.0)
            table.settle()
        table.build()
        for nid in neighbours:  # what a neighbour is sent and acknowledges
            table.receive_acks(nid, [(r.origin, r.version) for r in table.records_to_send(nid, 0.0)])
        return table

    gc.collect()
    cpu0 = cpu_s()
    fill()  # timed untraced; tracemalloc would slow it
    cpu = cpu_s() - cpu0
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    table = fill()
    gc.collect()
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert len(table.hop_paths) == n
    return {
        "table_MiB": table_size(table) / 2**20,
        "traced_MiB": held / 2**20,
        "neighbours": float(len(neighbours)),
        "cpu_ms/node": cpu * 1e3,  # everything above, once: n-1 origins, 3 copies each
        "cpu_us/origin": cpu / (n - 1) * 1e6,
        "checked": float(table.records_verified),
    }


def main() -> None:
    from bench.common import Runner, git_tree, report

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", nargs=2, help=argparse.SUPPRESS)
    p.add_argument("--nodes", type=int, default=100)
    p.add_argument("--procs", type=int, default=4, help="host processes the nodes are spread over")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--settle", type=float, default=10.0, help="seconds after convergence before idle")
    p.add_argument("--idle", type=float, default=20.0, help="seconds the idle figures cover")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--dead-after", type=float,
                   help="limits.mesh_dead_after of every node (default: the node's, 5 s). Dozens of"
                        " nodes share one loop here, and two cores: a loop starved past it closes"
                        " links that are fine, and each loss is a version every node checks")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds a round waits for convergence (and for the join)")
    p.add_argument("--ab", help="also run meshgate as of this git ref, alternating with this tree")
    p.add_argument("--json")
    p.add_argument("--table", help="only one node's route table at these mesh sizes (e.g. 500,1000)")
    args = p.parse_args()
    if args.host:
        host_main(int(args.host[0]), [int(x) for x in args.host[1].split(",") if x])
        return
    if args.dead_after:
        os.environ["MESHSCALE_DEAD_AFTER"] = str(args.dead_after)  # the hosts inherit it
    if args.table:
        r = Runner("one node's route table, n signed records from each neighbour (sans-I/O)", args.rounds)
        for size in (int(x) for x in args.table.split(",")):
            r.add(f"{size} nodes", lambda size=size: table_memory(size, args.seed))  # type: ignore[misc]
        r.run()
        report([r], json_path=args.json)
        return
    with tempfile.TemporaryDirectory(prefix="meshscale-") as tmp:
        title = f"mesh of {args.nodes} nodes in {args.procs} processes, tcp:// on loopback"
        r = Runner(title, args.rounds, f"meshgate@{args.ab}" if args.ab else None)
        r.add("meshgate", lambda: one_round(args.nodes, args.procs, None, args.settle, args.idle, args.seed,
                                                 args.timeout))
        if args.ab:
            tree = git_tree(args.ab, tmp)
            r.add(f"meshgate@{args.ab}",
                  lambda: one_round(args.nodes, args.procs, tree, args.settle, args.idle, args.seed,
                                    args.timeout))
        r.run()
        report([r], json_path=args.json, ratio_metrics=["converge_s", "idle_%core/node", "idle_B/s/link"])


if __name__ == "__main__":
    main()
