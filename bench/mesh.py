"""Mesh core benchmark: streams, datagrams, convergence, route rebuilds.

Sections (each one table, medians of alternating rounds via bench/common.py):

* **stream**: one mesh stream uploads SIZE MiB (default 512) to a sink on the
  far node's loopback, over TCP links between processes (`mesh-*`) and over
  udp:// links (`udp-*`): this process is the client node A; relay B and far
  node C are `meshgate run` child processes; the sink is a child process too.
  `direct` is plain loopback TCP to the same sink in the same run. Reported:
  MB/s, CPU seconds per GiB for every meshgate process (A, B, C summed, and per node), peak RSS of B and C.
  Also the in-process ring (all nodes in this process, one core).
* **datagram**: 1,400-byte datagrams A->B (one hop) and A->B->C (two hops),
  in-process, over ring, TCP and UDP links: delivered packets/s, loss, and
  tracemalloc blocks/bytes per datagram.
* **routing**: graph rebuild time for 50/200/1,000-node random graphs
  (sans-I/O RouteTable.build), and convergence time of N in-process
  services joined by ring links (50 and 200 nodes).

    .venv/bin/python bench/mesh.py [--size MiB] [--rounds N] [--only SECTIONS] [--json FILE] [--ab REF]

  `--ab REF` (stream section): the tcp:// and udp:// rows also run with every node as of git
  REF (rows NAME@REF: B and C from REF's tree, client node A a child process importing it),
  paired with this tree's, whose A is then a child process too (the same driver for both),
  and NAME-chacha, this tree with `limits.aes_instructions = "no"` on every node. One table
  per link kind and hop count, with paired ratios of MB/s and CPU per GiB against NAME@REF.

* **portal**: the same upload through a SOCKS5 portal on node A into a
  three-node line A-B-C, one and two hops: meshgate (`meshgate run`
  processes) beside the EasyTier core (`easytier_node.py` processes from
  bench/peers), like for like; EasyTier's rows also show the peak RSS of a
  bare interpreter with its import (`easytier_node.py --baseline`, measured
  each round) and the nodes' largest peak RSS less it, the core's own share.
  EasyTier contacts STUN servers, so its rows only run inside a
  loopback-only network namespace:

    bench/peers/isolated .venv/bin/python bench/mesh.py --only portal

  (outside one, the EasyTier rows are skipped with a note).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import ipaddress
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

if os.environ.get("MESHGATE_TREE"):  # an --ab client (--client): meshgate as of another commit
    sys.path.insert(0, os.environ["MESHGATE_TREE"])
sys.path.insert(1 if os.environ.get("MESHGATE_TREE") else 0, str(Path(__file__).resolve().parent.parent))

from bench.common import (
    PEERS,
    Metrics,
    Runner,
    add_args,
    easytier_interpreter_rss_mib,
    free_port,
    git_tree,
    proc_cpu_seconds,
    proc_peak_rss_kib,
    report,
    self_cpu_seconds,
    stop_processes,
    wait_port,
)
from meshgate.mesh.routing import Record, RouteTable, encode_records
from meshgate.mesh.service import MeshService
from tests.mesh_testing import Collector, converged, mesh_node, node_config, ring_name, stop_all

ROOT = Path(__file__).resolve().parent.parent
MIB = 1 << 20
GIB = 1 << 30


def new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop

        return uvloop.new_event_loop()
    except ImportError:
        return asyncio.new_event_loop()


def run(coro: Any) -> Any:
    loop = new_loop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()


# --------------------------------------------------------------------------- sink (child process)


class Sink(asyncio.Protocol):
    """Each connection sends an 8-byte size, then that many bytes; the sink answers
    the count once they are in (no half-close needed: EasyTier's portal loses it)."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.t = transport
        self.n = 0
        self.expect = -1
        self.head = b""
        self.answered = False

    def data_received(self, data: bytes) -> None:
        if self.expect < 0:
            need = 8 - len(self.head)
            self.head += data[:need]
            data = data[need:]
            if len(self.head) < 8:
                return
            self.expect = int.from_bytes(self.head, "big")
        self.n += len(data)
        if self.n >= self.expect:
            self.answer()

    def eof_received(self) -> bool:
        self.answer()
        return True

    def answer(self) -> None:
        if not self.answered:
            self.answered = True
            self.t.write(str(self.n).encode())  # type: ignore[attr-defined]
            self.t.close()


def serve_sink(port: int) -> None:
    loop = new_loop()
    loop.run_until_complete(loop.create_server(Sink, "127.0.0.1", port))
    loop.run_forever()


# --------------------------------------------------------------------------- stream over processes


class Children:
    """Relay B and far node C as `meshgate run` processes, plus the sink; `tree`: run them
    from that extracted git REF (bench.common.git_tree), not this checkout."""

    def __init__(self, scheme: str = "tcp", tree: Path | None = None, aes: str = "") -> None:
        self.scheme = scheme  # the link type: tcp or udp
        self.tree = tree
        self.aes = aes  # limits.aes_instructions for B, C and A ("" leaves the default)
        self.tmp = tempfile.TemporaryDirectory(prefix="meshbench-")
        self.sink_port = free_port()
        self.b_port, self.c_port = free_port(), free_port()  # free for TCP; UDP alike in practice
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def _node(self, name: str, ip: str, port: int, peers: list[int]) -> subprocess.Popen[bytes]:
        state = Path(self.tmp.name) / name
        state.mkdir()
        s = self.scheme
        peer_list = ", ".join(f'"{s}://127.0.0.1:{p}"' for p in peers)
        cfg = Path(self.tmp.name) / f"{name}.toml"
        cfg.write_text(
            f'[node]\nname = "{name}"\nnetwork = "bench"\nsecret = "bench secret"\nipv4 = "{ip}/24"\n'
            f'state_dir = "{state}"\n[mesh]\nlisten = ["{s}://127.0.0.1:{port}"]\npeers = [{peer_list}]\n'
            f"[socks5]\nenable = false\n[admin]\nenable = false\n"
            f'[serve]\n{self.sink_port} = "127.0.0.1:{self.sink_port}"\n'  # the sink, at C's virtual IP
            + (f'[limits]\naes_instructions = "{self.aes}"\n' if self.aes else "")
        )
        return subprocess.Popen(
            [sys.executable, "-m", "meshgate", "run", "-c", str(cfg), "--log-level", "warning"],
            cwd=self.tree or ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )

    def start(self) -> None:
        self.procs["sink"] = subprocess.Popen(
            [sys.executable, __file__, "--sink", str(self.sink_port)], stdout=subprocess.DEVNULL
        )
        self.procs["b"] = self._node("b", "10.99.0.2", self.b_port, [])
        self.procs["c"] = self._node("c", "10.99.0.3", self.c_port, [self.b_port])
        # udp:// listeners have no port to probe: A's route wait (stream_mesh) covers them
        for port in (self.sink_port, self.b_port, self.c_port)[: 1 if self.scheme == "udp" else 3]:
            wait_port("127.0.0.1", port, 20)

    def cpu(self, name: str) -> float:
        return proc_cpu_seconds(self.procs[name].pid)

    def rss_mib(self, name: str) -> float:
        return proc_peak_rss_kib(self.procs[name].pid) / 1024

    def stop(self) -> None:
        stop_processes(self.procs.values())
        self.tmp.cleanup()


async def _upload(transport: Any, proto: Collector, size: int) -> float:
    block = os.urandom(MIB)
    t0 = time.perf_counter()
    sent = 0
    transport.write(size.to_bytes(8, "big"))
    while sent < size:
        await proto.writable.wait()
        transport.write(block)
        sent += len(block)
    got = await asyncio.wait_for(proto.done, 300)
    elapsed = time.perf_counter() - t0
    if int(got or b"0") != size:
        raise RuntimeError(f"sink counted {got!r}, sent {size}")
    return elapsed


def stream_direct(ch: Children, size: int) -> Metrics:
    async def go() -> float:
        loop = asyncio.get_running_loop()
        transport, proto = await loop.create_connection(Collector, "127.0.0.1", ch.sink_port)
        return await _upload(transport, proto, size)

    cpu0 = self_cpu_seconds()
    elapsed = run(go())
    return {"MB/s": size / elapsed / 1e6, "A_cpu_s/GiB": (self_cpu_seconds() - cpu0) / (size / GIB)}


async def _mesh_upload(
    scheme: str, peer: int, sink_port: int, size: int, hops: int, aes: str = ""
) -> tuple[float, float]:
    """Node A (this process) dials `peer`, uploads `size` bytes to the sink at C over a
    `hops`-hop route: (seconds, A's CPU seconds), both from the stream's open to the sink's count."""
    cfg = node_config("a", "10.99.0.1/24", peers=[f"{scheme}://127.0.0.1:{peer}"], network="bench",
                      secret="bench secret", limits={"aes_instructions": aes} if aes else None)
    a = mesh_node(cfg)
    await a.start()
    c_ip = ipaddress.ip_address("10.99.0.3")

    def c_id() -> int | None:
        """c's node id (found by its virtual IP) once a has a `hops`-hop route to it."""
        r = a.lookup(c_ip)
        p = a.table.hop_paths.get(r.node_id) if r is not None else None
        return r.node_id if r is not None and p is not None and p.hops == hops else None

    try:
        deadline = time.monotonic() + 20
        while (c := c_id()) is None:
            if time.monotonic() > deadline:
                raise RuntimeError(f"no {hops}-hop route to c")
            await asyncio.sleep(0.02)
        cpu0 = self_cpu_seconds()
        # c's own virtual IP: its egress policy maps that to its loopback
        transport, proto = await a.open_stream(c, "10.99.0.3", sink_port, Collector)
        assert isinstance(proto, Collector)
        elapsed = await _upload(transport, proto, size)
        return elapsed, self_cpu_seconds() - cpu0
    finally:
        await a.stop()


def stream_client(spec: str) -> None:
    """--client SCHEME,PEER,SINK,SIZE,HOPS,AES: one upload from a child process (an --ab row's
    node A, importing meshgate from MESHGATE_TREE when set); prints seconds and CPU seconds."""
    scheme, peer, sink, size, hops, aes = spec.split(",")
    elapsed, cpu = run(_mesh_upload(scheme, int(peer), int(sink), int(size), int(hops), aes))
    print(json.dumps({"elapsed": elapsed, "cpu": cpu}), flush=True)


def stream_mesh(ch: Children, size: int, hops: int, child_a: bool = False) -> Metrics:
    """One upload A -> C; `child_a`: A in a child process importing `ch.tree`'s meshgate (or this
    tree's), as --ab runs both variants, else in this process."""
    peer = ch.c_port if hops == 1 else ch.b_port
    names = ["b", "c"] if hops == 2 else ["c"]
    cpu0 = {n: ch.cpu(n) for n in names}
    if child_a:
        env = {**os.environ, **({"MESHGATE_TREE": str(ch.tree)} if ch.tree else {})}
        spec = f"{ch.scheme},{peer},{ch.sink_port},{size},{hops},{ch.aes}"
        out_text = subprocess.run(
            [sys.executable, __file__, "--client", spec],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=True,
        ).stdout
        got = json.loads(out_text.strip().splitlines()[-1])
        elapsed, a_cpu = got["elapsed"], got["cpu"]
    else:
        elapsed, a_cpu = run(_mesh_upload(ch.scheme, peer, ch.sink_port, size, hops))
    gib = size / GIB
    out: Metrics = {"MB/s": size / elapsed / 1e6, "A_cpu_s/GiB": a_cpu / gib}
    for n in names:
        out[f"{n.upper()}_cpu_s/GiB"] = (ch.cpu(n) - cpu0[n]) / gib
    out["cpu_s/GiB_total"] = sum(v for k, v in out.items() if k.endswith("_cpu_s/GiB"))
    out["B_rss_MiB" if hops == 2 else "C_rss_MiB"] = ch.rss_mib(names[0])
    return out


def stream_ring(size: int, hops: int) -> Metrics:
    """All nodes and the sink in this process: one core does everything."""

    async def go() -> float:
        loop = asyncio.get_running_loop()
        srv = await loop.create_server(Sink, "127.0.0.1", 0)
        port = srv.sockets[0].getsockname()[1]
        rings = [ring_name("bench") for _ in range(hops)]
        nodes = []
        for i in range(hops + 1):
            cfg = node_config(f"n{i}", listen=[f"ring://{rings[i]}"] if i < hops else [],
                              peers=[f"ring://{rings[i - 1]}"] if i else [])
            n = mesh_node(cfg)
            await n.start()
            nodes.append(n)
        try:
            while not converged(nodes):
                await asyncio.sleep(0.01)
            transport, proto = await nodes[0].open_stream(nodes[-1].node_id, "127.0.0.1", port, Collector)
            assert isinstance(proto, Collector)
            return await _upload(transport, proto, size)
        finally:
            await stop_all(nodes)
            srv.close()

    cpu0 = self_cpu_seconds()
    elapsed = run(go())
    return {"MB/s": size / elapsed / 1e6, "cpu_s/GiB_total": (self_cpu_seconds() - cpu0) / (size / GIB)}


# --------------------------------------------------------------------------- datagrams (in-process)


async def _datagram_mesh(kind: str, hops: int) -> tuple[list[MeshService], int]:
    nodes: list[MeshService] = []
    prev: str | None = None
    for i in range(hops + 1):
        if kind == "ring":
            name = ring_name("dg")
            listen = [f"ring://{name}"]
        else:
            listen = [f"{kind}://127.0.0.1:0"]
        cfg = node_config(f"n{i}", listen=listen, peers=[prev] if prev else [])
        n = mesh_node(cfg)
        await n.start()
        prev = n.listen_addrs[0]
        nodes.append(n)
    while not converged(nodes):
        await asyncio.sleep(0.01)
    return nodes, nodes[-1].node_id


async def _blast(nodes: list[MeshService], dst: int, seconds: float, burst: int = 64) -> tuple[int, int]:
    received = 0

    def on(src: int, payload: bytes) -> None:
        nonlocal received
        received += 1

    nodes[-1].on_datagram(5, on)
    payload = os.urandom(1400)
    sent = 0
    src = nodes[0]
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    while loop.time() < end:
        for _ in range(burst):
            if src.send_datagram(dst, 5, payload):
                sent += 1
        await asyncio.sleep(0)
    await asyncio.sleep(0.2)  # let the last bursts land
    return sent, received


def datagram_rate(kind: str, hops: int, seconds: float) -> Metrics:
    async def go() -> Metrics:
        nodes, dst = await _datagram_mesh(kind, hops)
        try:
            cpu0, t0 = self_cpu_seconds(), time.perf_counter()
            sent, received = await _blast(nodes, dst, seconds)
            elapsed = time.perf_counter() - t0 - 0.2
            cpu = self_cpu_seconds() - cpu0
            # allocations per datagram, in a separate traced burst
            gc.collect()
            tracemalloc.start()
            snap0 = tracemalloc.take_snapshot()
            _s2, r2 = await _blast(nodes, dst, 0.3)
            snap1 = tracemalloc.take_snapshot()
            tracemalloc.stop()
            diff = snap1.compare_to(snap0, "filename")
            n = max(1, r2)
            return {
                "pkts/s": received / elapsed,
                "MB/s": received * 1400 / elapsed / 1e6,
                "loss_%": 100 * (sent - received) / max(1, sent),
                "cpu_us/pkt": cpu / max(1, received) * 1e6,
                "held_B/pkt": sum(d.size_diff for d in diff if d.size_diff > 0) / n,
                "held_blocks/pkt": sum(d.count_diff for d in diff if d.count_diff > 0) / n,
            }
        finally:
            await stop_all(nodes)

    out: Metrics = run(go())
    return out


# --------------------------------------------------------------------------- routing


def random_graph(n: int, degree: int, seed: int = 1) -> dict[int, list[tuple[int, int]]]:
    rng = random.Random(seed)
    adj: dict[int, dict[int, int]] = {i: {} for i in range(n)}
    for i in range(1, n):
        j = rng.randrange(i)
        lat = rng.randint(1, 50) * 1000
        adj[i][j] = adj[j][i] = lat
    extra = n * (degree - 2) // 2
    for _ in range(extra):
        a, b = rng.sample(range(n), 2)
        lat = rng.randint(1, 50) * 1000
        adj[a][b] = adj[b][a] = lat
    return {i: sorted(v.items()) for i, v in adj.items()}


def rebuild_time(n: int) -> Metrics:
    adj = random_graph(n, 4)
    t = RouteTable(Record(0, 1, 1, "n0", neighbours=tuple(adj[0])), max_records=n + 1)
    others = [Record(i, 1, 1, f"n{i}", neighbours=tuple(adj[i])) for i in range(1, n)]
    t.receive_records(adj[0][0][0], others, 0)
    times = []
    for _ in range(5):
        t.dirty = True
        t0 = time.perf_counter()
        t.build()
        times.append(time.perf_counter() - t0)
    assert len(t.hop_paths) == n
    return {"rebuild_ms": statistics.median(times) * 1000}


def sync_simulation(n: int) -> Metrics:
    """Convergence of the sans-I/O sync alone (RouteTables exchanging ROUTES bodies
    round by round, no sockets, no event loop): what 1,000 nodes cost in routing work."""
    adj = random_graph(n, 3, seed=n)
    tables = {
        i: RouteTable(Record(i, 1, 1, f"n{i}", neighbours=tuple(adj[i])), max_records=n + 1) for i in adj
    }
    for i, t in tables.items():
        for j, _ in adj[i]:
            t.neighbour_up(j)
    t0 = time.perf_counter()
    rounds = bodies = 0
    while True:
        moved = 0
        for i, t in tables.items():
            for j, _ in adj[i]:
                recs = t.records_to_send(j, 0.0)
                if recs:
                    for body in encode_records(recs, 60000):
                        bodies += 1
                        t.receive_acks(j, tables[j].receive_body(i, body, 0.0))
                    moved += len(recs)
        rounds += 1
        if not moved:
            break
    for t in tables.values():
        t.build()
    elapsed = time.perf_counter() - t0
    assert all(len(t.hop_paths) == n for t in tables.values())
    return {
        "converge_s": elapsed,
        "rounds": rounds,
        "routes_frames": bodies,
        "cpu_ms_per_node": elapsed / n * 1000,
    }


def convergence_time(n: int) -> Metrics:
    adj = random_graph(n, 3, seed=n)

    async def go() -> Metrics:
        names = {i: ring_name("conv") for i in range(n)}
        nodes = []
        t0 = time.perf_counter()
        cpu0 = self_cpu_seconds()
        for i in range(n):
            peers = [f"ring://{names[j]}" for j, _ in adj[i] if j < i]
            cfg = node_config(f"n{i}", listen=[f"ring://{names[i]}"], peers=peers)
            svc = mesh_node(cfg)
            await svc.start()
            nodes.append(svc)
        started = time.perf_counter()
        ids = {s.node_id for s in nodes}
        try:
            while not all(len(s.table.hop_paths) == n for s in nodes):
                await asyncio.sleep(0.01)
                if time.perf_counter() - started > 120:
                    raise RuntimeError("no convergence in 120 s")
            done = time.perf_counter()
            assert all(ids == set(s.table.hop_paths) for s in nodes)
            return {
                "converge_s": done - t0,
                "after_last_start_s": done - started,
                "cpu_s": self_cpu_seconds() - cpu0,
            }
        finally:
            await stop_all(nodes)

    result: Metrics = run(go())
    return result


# --------------------------------------------------------------------------- SOCKS5 portal vs EasyTier



def loopback_only() -> bool:
    with open("/proc/self/net/dev") as f:
        return [line.split(":")[0].strip() for line in f.readlines()[2:]] == ["lo"]


def socks_upload(proxy: tuple[str, int], host: str, port: int, size: int) -> float:
    """SOCKS5 CONNECT (no auth) to host:port, send `size` bytes, read the count."""
    with socket.create_connection(proxy, timeout=60) as s:
        s.sendall(b"\x05\x01\x00")
        if s.recv(2) != b"\x05\x00":
            raise RuntimeError("SOCKS5 method refused")
        s.sendall(b"\x05\x01\x00\x01" + socket.inet_aton(host) + port.to_bytes(2, "big"))
        reply = b""
        while len(reply) < 10:
            part = s.recv(10 - len(reply))
            if not part:
                raise RuntimeError("SOCKS5 connection closed during CONNECT")
            reply += part
        if reply[1] != 0:
            raise RuntimeError(f"SOCKS5 CONNECT failed with code {reply[1]}")
        block = os.urandom(MIB)
        t0 = time.perf_counter()
        s.sendall(size.to_bytes(8, "big"))
        for _ in range(size // MIB):
            s.sendall(block)
        got = b""
        while chunk := s.recv(64):
            got += chunk
        elapsed = time.perf_counter() - t0
    if int(got or b"0") != size:
        raise RuntimeError(f"sink counted {got!r}, sent {size}")
    return elapsed


class PortalLine:
    """A-B-C line with a SOCKS5 portal on A, as meshgate or EasyTier processes."""

    def __init__(self, kind: str, sink_port: int) -> None:
        self.kind = kind
        self.sink_port = sink_port
        self.tmp = tempfile.TemporaryDirectory(prefix=f"portal-{kind}-")
        self.socks = free_port()
        self.ports = [free_port() for _ in range(3)]
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.ips = {"a": "10.144.144.1", "b": "10.144.144.2", "c": "10.144.144.3"}

    def _meshgate(self, name: str, peers: list[int]) -> subprocess.Popen[bytes]:
        state = Path(self.tmp.name) / name
        state.mkdir()
        peer_list = ", ".join(f'"tcp://127.0.0.1:{p}"' for p in peers)
        socks = f'enable = true\nlisten = "127.0.0.1:{self.socks}"' if name == "a" else "enable = false"
        cfg = Path(self.tmp.name) / f"{name}.toml"
        port = self.ports["abc".index(name)]
        cfg.write_text(
            f'[node]\nname = "{name}"\nnetwork = "bench"\nsecret = "bench secret"\n'
            f'ipv4 = "{self.ips[name]}/24"\nstate_dir = "{state}"\n'
            f'[mesh]\nlisten = ["tcp://127.0.0.1:{port}"]\npeers = [{peer_list}]\n'
            # no direct fallback: before the routes converge, a connect to a virtual IP
            # must fail, not leave this host for an address outside loopback
            "direct_fallback = false\n"
            f"[socks5]\n{socks}\n[admin]\nenable = false\n"
            f'[serve]\n{self.sink_port} = "127.0.0.1:{self.sink_port}"\n'  # the sink, at C's virtual IP
        )
        return subprocess.Popen(
            [sys.executable, "-m", "meshgate", "run", "-c", str(cfg), "--log-level", "warning"],
            cwd=self.tree or ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )

    def _easytier(self, name: str, peers: list[int]) -> subprocess.Popen[bytes]:
        port = self.ports["abc".index(name)]
        argv = [sys.executable, str(PEERS / "easytier_node.py"), "--name", name, "--ip", self.ips[name],
                "--listen", f"tcp://127.0.0.1:{port}", "--expect-routes", "2"]
        for p in peers:
            argv += ["--peer", f"tcp://127.0.0.1:{p}"]
        if name == "a":
            argv += ["--socks5", f"127.0.0.1:{self.socks}"]
        return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)

    def start(self) -> None:
        start = self._meshgate if self.kind == "meshgate" else self._easytier
        self.procs["a"] = start("a", [])
        self.procs["b"] = start("b", [self.ports[0]])
        self.procs["c"] = start("c", [self.ports[1]])
        if self.kind == "easytier":
            for p in self.procs.values():
                assert p.stdout is not None
                if b'"ready": true' not in p.stdout.readline():
                    raise RuntimeError("an EasyTier node did not become ready")
        wait_port("127.0.0.1", self.socks, 30)
        # routes: retry a tiny transfer to c until the line has converged
        deadline = time.monotonic() + 30
        while True:
            try:
                socks_upload(("127.0.0.1", self.socks), self.ips["c"], self.sink_port, MIB)
                break
            except (OSError, RuntimeError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def measure(self, hops: int, size: int) -> Metrics:
        target = self.ips["b" if hops == 1 else "c"]
        cpu0 = {n: proc_cpu_seconds(p.pid) for n, p in self.procs.items()}
        elapsed = socks_upload(("127.0.0.1", self.socks), target, self.sink_port, size)
        gib = size / GIB
        out: Metrics = {"MB/s": size / elapsed / 1e6}
        for n, p in self.procs.items():
            out[f"{n.upper()}_cpu_s/GiB"] = (proc_cpu_seconds(p.pid) - cpu0[n]) / gib
        out["rss_MiB_max"] = max(proc_peak_rss_kib(p.pid) for p in self.procs.values()) / 1024
        if self.kind == "easytier":
            # the Python interpreter hosting the core, measured beside: the core's own share apart
            out["interpreter_rss_MiB"] = easytier_interpreter_rss_mib()[1]
            out["rss_MiB_max - interpreter"] = out["rss_MiB_max"] - out["interpreter_rss_MiB"]
        return out

    def stop(self) -> None:
        stop_processes(self.procs.values())
        self.tmp.cleanup()


def portal_section(rounds: int, size: int) -> list[Runner]:
    sink_port = free_port()
    sink = subprocess.Popen([sys.executable, __file__, "--sink", str(sink_port)], stdout=subprocess.DEVNULL)
    wait_port("127.0.0.1", sink_port, 10)
    kinds = ["meshgate"]
    if loopback_only():
        kinds.append("easytier")
    else:
        print("portal: not in a loopback-only namespace; EasyTier rows skipped "
              "(run under bench/peers/isolated)", file=sys.stderr)
    lines = {k: PortalLine(k, sink_port) for k in kinds}
    try:
        for line in lines.values():
            line.start()
        runners = []
        for hops in (1, 2):
            base = "easytier" if "easytier" in lines else None
            r = Runner(f"SOCKS5 portal upload {size // MIB} MiB, {hops} hop(s), A-B-C line (processes)",
                       rounds, base)
            for k, line in lines.items():
                r.add(k, functools.partial(line.measure, hops, size))
            r.run()
            runners.append(r)
        return runners
    finally:
        for line in lines.values():
            line.stop()
        sink.terminate()
        sink.wait(5)


def stream_ab(ref: str, rounds: int, size: int, size_mib: int, kinds: list[str]) -> list[Runner]:
    """This tree against git REF on the stream rows: per link kind and hop count one table,
    the variants in alternating rounds, every node (A too) a process of its tree. NAME-chacha is
    this tree with limits.aes_instructions = "no" on every node (what the AEAD negotiation
    itself costs, and what AES-256-GCM changed, within one tree)."""
    work = tempfile.TemporaryDirectory(prefix="meshbench-ab-")
    tree = git_tree(ref, work.name)
    variants = {"": (None, ""), "-chacha": (None, "no"), f"@{ref}": (tree, "")}
    children = {(k, v): Children(k, t, aes) for k in kinds for v, (t, aes) in variants.items()}
    runners: list[Runner] = []
    try:
        for ch in children.values():
            ch.start()
        for kind in kinds:
            for hops in (1, 2):
                title = f"stream upload {size_mib} MiB, {kind}:// links, {hops} hop(s), this tree vs {ref}"
                r = Runner(title,
                           rounds, f"{kind}-{hops}hop@{ref}")
                for v in variants:
                    r.add(f"{kind}-{hops}hop{v}",
                          functools.partial(stream_mesh, children[kind, v], size, hops, True))
                r.run()
                runners.append(r)
    finally:
        for ch in children.values():
            ch.stop()
        work.cleanup()
    return runners


# --------------------------------------------------------------------------- main


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(p, rounds=3)
    p.add_argument("--size", type=int, default=512, help="MiB per stream run")
    p.add_argument("--seconds", type=float, default=2.0, help="seconds per datagram run")
    p.add_argument("--sink", type=int, help=argparse.SUPPRESS)
    p.add_argument("--client", help=argparse.SUPPRESS)
    p.add_argument("--ab", metavar="REF", help="stream section: also run every node as of git REF, paired")
    p.add_argument("--links", default="tcp,udp", help="stream section with --ab: link kinds (tcp,udp)")
    args = p.parse_args()
    if args.sink:
        serve_sink(args.sink)
        return
    if args.client:
        stream_client(args.client)
        return
    sections = {s.strip() for s in (args.only or "stream,datagram,routing,portal").split(",")}
    size = args.size * MIB
    runners: list[Runner] = []

    if "stream" in sections and args.ab:
        runners.extend(stream_ab(args.ab, args.rounds, size, args.size, args.links.split(",")))
    elif "stream" in sections:
        ch, chu = Children(), Children("udp")
        try:
            ch.start()
            chu.start()
            r = Runner(f"stream upload {args.size} MiB, TCP and UDP links between processes", args.rounds,
                       "direct")
            r.add("direct", lambda: stream_direct(ch, size))
            r.add("mesh-1hop", lambda: stream_mesh(ch, size, 1))
            r.add("mesh-2hop", lambda: stream_mesh(ch, size, 2))
            r.add("udp-1hop", lambda: stream_mesh(chu, size, 1))
            r.add("udp-2hop", lambda: stream_mesh(chu, size, 2))
            r.run()
            runners.append(r)
        finally:
            ch.stop()
            chu.stop()
        r = Runner(f"stream upload {args.size} MiB, ring links, all nodes in one process", args.rounds)
        r.add("ring-1hop", lambda: stream_ring(size, 1))
        r.add("ring-2hop", lambda: stream_ring(size, 2))
        r.run()
        runners.append(r)

    if "datagram" in sections:
        r = Runner("datagrams of 1,400 bytes, in-process", args.rounds)
        for kind in ("ring", "tcp", "udp"):
            for hops in (1, 2):
                r.add(f"{kind}-{hops}hop", functools.partial(datagram_rate, kind, hops, args.seconds))
        r.run()
        runners.append(r)

    if "portal" in sections:
        runners.extend(portal_section(args.rounds, size))

    if "routing" in sections:
        r = Runner("route rebuild (one graph build, both policies)", args.rounds)
        for n in (50, 200, 1000):
            r.add(f"{n} nodes", functools.partial(rebuild_time, n))
        r.run()
        runners.append(r)
        r = Runner("convergence, sans-I/O sync simulation (every node's RouteTable, no sockets)", 1)
        for n in (50, 200, 1000):
            r.add(f"{n} nodes", functools.partial(sync_simulation, n))
        r.run()
        runners.append(r)
        r = Runner("convergence, N services on ring links in one process", 1)
        for n in (50, 200):
            r.add(f"{n} nodes", functools.partial(convergence_time, n))
        r.run()
        runners.append(r)

    report(runners, json_path=args.json, ratio_metrics=["MB/s", "cpu_s/GiB_total"])


if __name__ == "__main__":
    main()
