"""SOCKS5 UDP ASSOCIATE over the mesh: datagram round trips through A's portal to a UDP echo one hop away.

Issue 4, "UDP, the way the sing-vmess XUDP change was validated": N datagram
round trips (default 1,000,000; `--udp-count` shrinks it) through A's portal
over one hop (the echo listens on B's 127.0.0.1 and is addressed as B's
virtual IP) with 1 and 4 flows. Each flow is its own UDP ASSOCIATE (its own TCP
control connection and client socket) with at most `--window` datagrams in
flight. Payload sizes are mixed (80% 1,400 B, 10% 512 B, 10% 64 B, a fixed
shuffled cycle); every payload carries its sequence number and a fill derived
from it, and every reply is checked (SOCKS header, sequence, length, fill).
Nothing is retransmitted: when a flow makes no progress for `--stall`
seconds, what it has in flight is counted lost and the window refilled; a
reply that is not in flight any more counts as `late`, a wrong one as `bad`.

The nodes are `meshgate run` processes (bench/portal.py's MeshgateLine, A and B
only) started through a small wrapper (`_NODE`) that answers "snap" on a
loopback control port. Every variant has two lines: a plain one for round
trips/s, loss and CPU s per million round trips (from /proc), and a counted
one that runs `--alloc-count` round trips for the allocation rows. tracemalloc
sees live memory only, so it cannot count what a round trip allocates and frees
again; the counted line runs with PYTHONMALLOC=malloc (every Python object goes
to malloc) and bench/alloc_count.c preloaded, a malloc that counts its calls
and bytes (compiled here with gcc; without gcc the rows are left out, said on
stderr). It counts every allocation of the process: Python objects, uvloop's,
OpenSSL's.

* `alloc blocks/rt`, `alloc B/rt` (counted line): malloc/calloc/realloc calls and
  bytes asked for, on A and on B, per round trip;
* `gc/M rt` (plain line): garbage collections (all generations) per million round trips.

`--traced` adds the tracemalloc rows of before (a third line per variant):
`held B/rt`, `held blocks/rt` (traced heap after the run minus before it, both
after gc.collect(): what the run left behind) and `peak KiB` (traced peak during
the run above the heap before it: what the datagrams in flight need at once).

    .venv/bin/python bench/portal_udp.py [--udp-count N] [--alloc-count N] [--flows 1,4]
        [--window 32] [--rounds R] [--traced] [--ab REF] [--json FILE]

`--ab REF` runs meshgate as of git REF beside the checkout, in alternating
pairs (bench/common.Runner), with paired ratios against REF.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import random
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import Metrics, Peer, Runner, add_args, free_port, git_tree, report, selected
from bench.portal import ROOT, SERVED_PORTS, VIPS, MeshgateLine

SIZE_CYCLE = 1000  # payload sizes repeat with this period (80/10/10 exactly per cycle)
SEQ = struct.Struct("!Q")

# A meshgate node: `python -c _NODE CONF CTL_PORT MODE` with cwd = the tree to run (`-c` puts
# the cwd first on sys.path, so an extracted --ab REF shadows the checkout). A connection to
# CTL_PORT gets the gc collections so far; MODE traced: the traced heap after gc.collect(), MODE
# counted: the allocation counters of bench/alloc_count.c (preloaded).
_NODE = r"""
import ctypes, gc, json, socket, sys, threading, tracemalloc
conf, ctl, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
traced = mode == "traced"
if traced:
    tracemalloc.start()
if mode == "counted":
    _lib = ctypes.CDLL(None)
    _calls = ctypes.c_ulonglong.in_dll(_lib, "mg_alloc_calls")
    _bytes = ctypes.c_ulonglong.in_dll(_lib, "mg_alloc_bytes")
def serve():
    srv = socket.create_server(("127.0.0.1", ctl))
    while True:
        c, _ = srv.accept()
        with c:
            c.recv(16)
            out = {"gc": sum(s["collections"] for s in gc.get_stats())}
            if mode == "counted":
                out |= {"calls": _calls.value, "alloc_bytes": _bytes.value}
            if traced:
                gc.collect()
                _, peak = tracemalloc.get_traced_memory()
                stats = tracemalloc.take_snapshot().statistics("filename")
                out |= {"bytes": sum(s.size for s in stats), "blocks": sum(s.count for s in stats),
                        "peak": peak}
                tracemalloc.reset_peak()
            c.sendall(json.dumps(out).encode())
threading.Thread(target=serve, daemon=True).start()
from meshgate.cli import main
sys.exit(main(["run", "-c", conf, "--loop", "uvloop"]))
"""

# The UDP echo, its own process: blocking recvfrom/sendto (one datagram per syscall each way).
_ECHO = r"""
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 22)
s.bind(("127.0.0.1", int(sys.argv[1])))
print("ready", flush=True)
while True:
    data, addr = s.recvfrom(65536)
    s.sendto(data, addr)
"""


def build_counter(workdir: str) -> str | None:
    """bench/alloc_count.c compiled into WORKDIR; None (and why, on stderr) without gcc."""
    out = str(Path(workdir) / "alloc_count.so")
    try:
        src = str(Path(__file__).parent / "alloc_count.c")
        subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-o", out, src], check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError) as e:
        print(f"no allocation counts: cannot build bench/alloc_count.c ({e})", file=sys.stderr)
        return None
    return out


class UdpLine(MeshgateLine):
    """A - B of bench/portal.py's line (one hop is all the UDP rows need): plain, traced
    (tracemalloc) or counted (the preloaded counting malloc at `counter`)."""

    def __init__(self, name: str, workdir: str, tree: Path, mode: str = "plain", counter: str = "") -> None:
        super().__init__(name, workdir, tree)
        self.mode = mode
        self.counter = counter
        self.ctl = {n: free_port() for n in "ab"}

    def node_peer(self, node: str) -> Peer:
        peer = super().node_peer(node)
        conf = str(self.workdir / f"{node}.toml")
        peer.argv = [sys.executable, "-c", _NODE, conf, str(self.ctl[node]), self.mode]
        if self.mode == "counted":
            peer.env = dict(peer.env or {}, PYTHONMALLOC="malloc", LD_PRELOAD=self.counter)
        return peer

    def start_udp(self, echo_port: int) -> UdpLine:
        try:
            for node in "ba":  # B first: A dials it
                self.nodes[node] = self.node_peer(node).start(timeout=30)
            deadline = time.monotonic() + 60
            while not _one_round_trip(self.socks, (VIPS["b"], echo_port)):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{self.name}: no UDP path A -> B through the portal after 60 s")
                time.sleep(0.2)
        except BaseException:
            self.stop()
            raise
        return self

    def heap(self) -> dict[str, dict[str, float]]:
        """Per node: gc collections so far and the traced heap or the allocation counters."""
        out = {}
        for node, port in self.ctl.items():
            with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
                s.sendall(b"snap")
                s.shutdown(socket.SHUT_WR)
                data = b""
                while part := s.recv(4096):
                    data += part
            out[node] = json.loads(data)
        return out


# --------------------------------------------------------------------------- the SOCKS5 UDP client


def udp_associate(proxy: tuple[str, int]) -> tuple[socket.socket, tuple[str, int]]:
    """Open a UDP ASSOCIATE (client source 0.0.0.0:0); the control connection and the relay address."""
    ctl = socket.create_connection(proxy, timeout=10)
    ctl.sendall(b"\x05\x01\x00")
    if ctl.recv(2) != b"\x05\x00":
        raise RuntimeError("portal refused the method")
    ctl.sendall(b"\x05\x03\x00\x01" + bytes(6))
    rep = b""
    while len(rep) < 10:
        part = ctl.recv(10 - len(rep))
        if not part:
            raise RuntimeError("portal closed the UDP ASSOCIATE")
        rep += part
    if rep[1] != 0 or rep[3] != 1:
        raise RuntimeError(f"UDP ASSOCIATE replied {rep[1]:#04x} (atyp {rep[3]})")
    return ctl, (socket.inet_ntoa(rep[4:8]), struct.unpack("!H", rep[8:10])[0])


def udp_header(target: tuple[str, int]) -> bytes:
    return b"\x00\x00\x00\x01" + socket.inet_aton(target[0]) + struct.pack("!H", target[1])


def _one_round_trip(proxy: tuple[str, int], target: tuple[str, int]) -> bool:
    try:
        ctl, relay = udp_associate(proxy)
    except (OSError, RuntimeError):
        return False
    with ctl, socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(0.5)
        msg = udp_header(target) + b"hello"
        s.sendto(msg, relay)
        try:
            return s.recv(2048) == msg
        except OSError:
            return False


def size_cycle(seed: int = 4) -> list[int]:
    sizes = [1400] * 800 + [512] * 100 + [64] * 100
    random.Random(seed).shuffle(sizes)
    return sizes


class Flow(asyncio.DatagramProtocol):
    """One association's sender and checker: `count` round trips, at most `window` in flight."""

    def __init__(
        self, header: bytes, count: int, window: int, stall: float, done: asyncio.Future[None]
    ) -> None:
        self.header = header
        self.hlen = len(header)
        self.count = count
        self.window = window
        self.stall = stall
        self.done = done
        self.sizes = size_cycle()
        # fill[size][seq & 255]: the payload after the sequence number, so a reply's bytes are checked too
        self.fill = {n: [bytes([b]) * (n - SEQ.size) for b in range(256)] for n in set(self.sizes)}
        self.inflight: set[int] = set()
        self.next = 0
        self.ok = self.lost = self.late = self.bad = 0
        self.progress = 0
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def start(self) -> None:
        self._fill_window()
        self._watch = asyncio.get_running_loop().call_later(self.stall, self._check_stall, -1)

    def _send(self, seq: int) -> None:
        size = self.sizes[seq % SIZE_CYCLE]
        self.inflight.add(seq)
        assert self.transport is not None
        self.transport.sendto(self.header + SEQ.pack(seq) + self.fill[size][seq & 255])

    def _fill_window(self) -> None:
        while len(self.inflight) < self.window and self.next < self.count:
            self._send(self.next)
            self.next += 1
        if not self.inflight and not self.done.done():
            self.done.set_result(None)

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:  # type: ignore[override]
        h = self.hlen
        if len(data) < h + SEQ.size or data[:h] != self.header:
            self.bad += 1
            return
        seq = SEQ.unpack_from(data, h)[0]
        if seq not in self.inflight:
            if seq < self.next:
                self.late += 1
            else:
                self.bad += 1
            return
        self.inflight.discard(seq)
        size = self.sizes[seq % SIZE_CYCLE]
        if len(data) - h != size or data[h + SEQ.size :] != self.fill[size][seq & 255]:
            self.bad += 1
        else:
            self.ok += 1
        self.progress += 1
        if self.next < self.count:
            self._send(self.next)
            self.next += 1
        elif not self.inflight and not self.done.done():
            self.done.set_result(None)

    def _check_stall(self, seen: int) -> None:
        if self.done.done():
            return
        if self.progress == seen and self.inflight:
            self.lost += len(self.inflight)  # no retransmission: what is in flight is lost
            self.inflight.clear()
            self._fill_window()
        self._watch = asyncio.get_running_loop().call_later(self.stall, self._check_stall, self.progress)


async def _run_flows(proxy: tuple[str, int], target: tuple[str, int], count: int, flows: int,
                     window: int, stall: float) -> Metrics:
    loop = asyncio.get_running_loop()
    header = udp_header(target)
    ctls, protos = [], []
    try:
        for i in range(flows):
            ctl, relay = udp_associate(proxy)
            ctls.append(ctl)
            n = count // flows + (1 if i < count % flows else 0)
            _, proto = await loop.create_datagram_endpoint(
                lambda n=n: Flow(header, n, window, stall, loop.create_future()),  # type: ignore[misc]
                local_addr=("127.0.0.1", 0), remote_addr=relay)
            protos.append(proto)
        t0 = time.perf_counter()
        for p in protos:
            p.start()
        await asyncio.gather(*(p.done for p in protos))
        elapsed = time.perf_counter() - t0
    finally:
        for p in protos:
            if p.transport is not None:
                p.transport.close()
        for ctl in ctls:
            ctl.close()
    ok = sum(p.ok for p in protos)
    return {"rt/s": ok / elapsed, "ok": ok, "lost": sum(p.lost for p in protos),
            "late": sum(p.late for p in protos), "bad": sum(p.bad for p in protos)}


def run_flows(proxy: tuple[str, int], target: tuple[str, int], count: int, flows: int, window: int,
              stall: float) -> Metrics:
    import uvloop

    return uvloop.run(_run_flows(proxy, target, count, flows, window, stall))


# --------------------------------------------------------------------------- one round


def udp_round(plain: UdpLine, traced: UdpLine | None, counted: UdpLine | None, echo_port: int,
              args: argparse.Namespace) -> Metrics:
    out: Metrics = {}
    target = (VIPS["b"], echo_port)
    for flows in args.flow_list:
        tag = f"{flows}f"
        cpu0, gc0 = plain.cpu(), plain.heap()
        m = run_flows(plain.socks, target, args.udp_count, flows, args.window, args.stall)
        cpu1, gc1 = plain.cpu(), plain.heap()
        out[f"{tag} rt/s"] = m["rt/s"]
        out[f"{tag} lost"] = m["lost"]
        out[f"{tag} late+bad"] = m["late"] + m["bad"]
        for n in "ab":
            out[f"{tag} {n.upper()} cpu s/M rt"] = (cpu1[n] - cpu0[n]) / max(m["ok"], 1) * 1e6
            out[f"{tag} {n.upper()} gc/M rt"] = (gc1[n]["gc"] - gc0[n]["gc"]) / max(m["ok"], 1) * 1e6
        if counted is not None:
            c0 = counted.heap()
            m = run_flows(counted.socks, target, args.alloc_count, flows, args.window, args.stall)
            c1 = counted.heap()
            rts = max(m["ok"], 1)
            for n in "ab":
                out[f"{tag} {n.upper()} alloc blocks/rt"] = (c1[n]["calls"] - c0[n]["calls"]) / rts
                out[f"{tag} {n.upper()} alloc B/rt"] = (c1[n]["alloc_bytes"] - c0[n]["alloc_bytes"]) / rts
            out[f"{tag} counted lost"] = m["lost"]
        if traced is None:
            continue
        h0 = traced.heap()
        m = run_flows(traced.socks, target, args.alloc_count, flows, args.window, args.stall)
        h1 = traced.heap()
        rts = max(m["ok"], 1)
        for n in "ab":
            out[f"{tag} {n.upper()} held B/rt"] = (h1[n]["bytes"] - h0[n]["bytes"]) / rts
            out[f"{tag} {n.upper()} held blocks/rt"] = (h1[n]["blocks"] - h0[n]["blocks"]) / rts
            out[f"{tag} {n.upper()} peak KiB"] = (h1[n]["peak"] - h0[n]["bytes"]) / 1024
        out[f"{tag} traced lost"] = m["lost"]
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(p, rounds=3)
    p.add_argument("--udp-count", type=int, default=1_000_000, help="round trips per run (all flows)")
    p.add_argument("--alloc-count", type=int, default=100_000,
                   help="round trips per run on the counted (and traced) line (0: no allocation rows)")
    p.add_argument("--traced", action="store_true", help="also the tracemalloc rows (a third line)")
    p.add_argument("--flows", default="1,4", help="associations at once, e.g. 1,4")
    p.add_argument("--window", type=int, default=32, help="datagrams in flight per flow")
    p.add_argument("--stall", type=float, default=1.0,
                   help="seconds without a reply before in-flight is lost")
    p.add_argument("--ab", metavar="REF", help="also run meshgate as of git REF (A/B of a change)")
    args = p.parse_args()
    args.flow_list = [int(f) for f in args.flows.split(",")]

    workdir = tempfile.mkdtemp(prefix="meshgate-udp-bench-")
    trees: dict[str, Path] = {}
    if selected(args, "meshgate"):
        trees["meshgate"] = ROOT
    if args.ab and selected(args, f"meshgate@{args.ab}"):
        trees[f"meshgate@{args.ab}"] = git_tree(args.ab, workdir)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    echo_port = free_port()
    SERVED_PORTS[:] = [echo_port]  # B publishes the echo on its virtual IP ([serve])
    echo = Peer("udp-echo", [sys.executable, "-c", _ECHO, str(echo_port)], ready_text="ready")
    lines: list[UdpLine] = []
    try:
        echo.start()
        r = Runner(f"SOCKS5 UDP over one hop: {args.udp_count:,} round trips per run "
                   f"(allocations: {args.alloc_count:,}), flows {args.flows}, window {args.window}",
                   args.rounds, baseline=f"meshgate@{args.ab}" if args.ab else None)
        counter = build_counter(workdir) if args.alloc_count else None
        for name, tree in trees.items():
            plain = UdpLine(name, workdir, tree).start_udp(echo_port)
            lines.append(plain)
            traced = counted = None
            if args.alloc_count and counter is not None:
                counted = UdpLine(name + "-counted", workdir, tree, "counted", counter).start_udp(echo_port)
                lines.append(counted)
            if args.alloc_count and args.traced:
                traced = UdpLine(name + "-traced", workdir, tree, "traced").start_udp(echo_port)
                lines.append(traced)
            r.add(name, functools.partial(udp_round, plain, traced, counted, echo_port, args))
        r.run()
        report([r], args.json, by_metric=True)
    finally:
        for line in lines:
            line.stop()
        echo.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
