"""SOCKS5 portal benchmark: meshgate (uvloop) vs direct loopback, microsocks, dante, pproxy+uvloop.

Every variant is driven by the same client in the same run, in alternating
order (bench/common.py). Per round and variant:

* bulk: one connection downloads SIZE bytes through the proxy, one uploads
  SIZE bytes (default 1 GiB each way); MB/s each way, and the proxy's CPU
  seconds per GiB moved (both directions) and peak RSS;
* rate: 50 concurrent clients loop CONNECT + one 64-byte request and a 64-byte
  response for a fixed time; completed connections per second. The target
  closes first (dante runs out of local ports otherwise, see
  ../shared/peers/README.md).

The target servers run in a child process (`--serve`), so the client, the
proxy and the targets are separate processes, as they would be for real.

    .venv/bin/python bench/socks.py [--size MiB] [--rounds N] [--seconds S] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import Metrics, Peer, Runner, add_args, free_port, report, selected, wait_port

ROOT = Path(__file__).resolve().parent.parent
PEERS = Path(os.environ.get("MESHGATE_PEERS", "/work/shared/peers"))
CHUNK = 1 << 20
REQUEST = b"q" * 64
RESPONSE = b"r" * 64
MIB = 1 << 20
GIB = 1 << 30


# --------------------------------------------------------------------------- targets (child process)


def _bulk_conn(conn: socket.socket) -> None:
    with conn:
        hdr = b""
        while len(hdr) < 9:
            part = conn.recv(9 - len(hdr))
            if not part:
                return
            hdr += part
        op, size = hdr[:1], struct.unpack("!Q", hdr[1:])[0]
        if op == b"D":
            block = memoryview(bytes(CHUNK))
            left = size
            while left:
                n = min(left, CHUNK)
                conn.sendall(block[:n])
                left -= n
            conn.shutdown(socket.SHUT_WR)
            conn.recv(1)
        elif op == b"U":
            buf = bytearray(CHUNK)
            left = size
            while left:
                n = conn.recv_into(buf, min(left, CHUNK))
                if not n:
                    return
                left -= n
            conn.sendall(b"K")


def _bulk_server(sock: socket.socket) -> None:
    while True:
        conn, _ = sock.accept()
        threading.Thread(target=_bulk_conn, args=(conn,), daemon=True).start()


class _Responder(asyncio.Protocol):
    """Reads the 64-byte request, answers and closes first."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.got = 0

    def data_received(self, data: bytes) -> None:
        self.got += len(data)
        if self.got >= len(REQUEST):
            self.transport.write(RESPONSE)  # type: ignore[attr-defined]
            self.transport.close()


def serve(bulk_port: int, rr_port: int) -> None:
    import uvloop

    bulk = socket.create_server(("127.0.0.1", bulk_port), backlog=128)
    threading.Thread(target=_bulk_server, args=(bulk,), daemon=True).start()
    loop = uvloop.new_event_loop()
    asyncio.set_event_loop(loop)
    loop.run_until_complete(loop.create_server(_Responder, "127.0.0.1", rr_port, backlog=4096))
    loop.run_forever()


# --------------------------------------------------------------------------- the client


def socks_connect_blocking(proxy: tuple[str, int] | None, target: tuple[str, int]) -> socket.socket:
    # A bounded wait on every call: a stuck peer fails the round instead of hanging the run.
    if proxy is None:
        return socket.create_connection(target, timeout=60)
    s = socket.create_connection(proxy, timeout=60)
    s.sendall(b"\x05\x01\x00")
    if _recv_exact(s, 2) != b"\x05\x00":
        raise RuntimeError("proxy refused the method")
    s.sendall(b"\x05\x01\x00\x01" + socket.inet_aton(target[0]) + struct.pack("!H", target[1]))
    rep = _recv_exact(s, 10)
    if rep[1] != 0:
        raise RuntimeError(f"proxy replied {rep[1]:#04x}")
    return s


def _recv_exact(s: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        part = s.recv(n - len(out))
        if not part:
            raise RuntimeError("connection closed during the SOCKS handshake")
        out += part
    return out


def bulk_down(proxy: tuple[str, int] | None, target: tuple[str, int], size: int) -> float:
    s = socks_connect_blocking(proxy, target)
    with s:
        buf = bytearray(CHUNK)
        t0 = time.perf_counter()
        s.sendall(b"D" + struct.pack("!Q", size))
        left = size
        while left:
            n = s.recv_into(buf, min(left, CHUNK))
            if not n:
                raise RuntimeError(f"download ended {left} bytes short")
            left -= n
        elapsed = time.perf_counter() - t0
        s.sendall(b"x")
    return elapsed


def bulk_up(proxy: tuple[str, int] | None, target: tuple[str, int], size: int) -> float:
    s = socks_connect_blocking(proxy, target)
    with s:
        block = memoryview(bytes(CHUNK))
        t0 = time.perf_counter()
        s.sendall(b"U" + struct.pack("!Q", size))
        left = size
        while left:
            n = min(left, CHUNK)
            s.sendall(block[:n])
            left -= n
        if _recv_exact(s, 1) != b"K":
            raise RuntimeError("upload not acknowledged")
        elapsed = time.perf_counter() - t0
    return elapsed


async def _recv_exact_async(loop: asyncio.AbstractEventLoop, s: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        part = await loop.sock_recv(s, n - len(out))
        if not part:
            raise ConnectionError("closed early")
        out += part
    return out


async def _rr_worker(
    proxy: tuple[str, int] | None, target: tuple[str, int], deadline: float, counts: list[int]
) -> None:
    loop = asyncio.get_running_loop()
    request = b"\x05\x01\x00\x01" + socket.inet_aton(target[0]) + struct.pack("!H", target[1])
    while loop.time() < deadline:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setblocking(False)
        try:
            async with asyncio.timeout(5):  # a stuck connection counts as an error, not a hang
                await _rr_once(loop, s, proxy, target, request)
            counts[0] += 1
        except (OSError, TimeoutError):
            counts[1] += 1
        finally:
            s.close()


async def _rr_once(
    loop: asyncio.AbstractEventLoop,
    s: socket.socket,
    proxy: tuple[str, int] | None,
    target: tuple[str, int],
    request: bytes,
) -> None:
    await loop.sock_connect(s, proxy or target)
    if proxy is not None:
        await loop.sock_sendall(s, b"\x05\x01\x00")
        await _recv_exact_async(loop, s, 2)
        await loop.sock_sendall(s, request)
        rep = await _recv_exact_async(loop, s, 10)
        if rep[1] != 0:
            raise ConnectionError(f"reply {rep[1]}")
    await loop.sock_sendall(s, REQUEST)
    got = 0
    while True:
        part = await loop.sock_recv(s, 4096)
        if not part:
            break
        got += len(part)
    if got != len(RESPONSE):
        raise ConnectionError("short response")


def conn_rate(
    proxy: tuple[str, int] | None, target: tuple[str, int], clients: int, seconds: float
) -> Metrics:
    import uvloop

    async def main() -> Metrics:
        loop = asyncio.get_running_loop()
        counts = [0, 0]
        t0 = loop.time()
        await asyncio.gather(*(_rr_worker(proxy, target, t0 + seconds, counts) for _ in range(clients)))
        elapsed = loop.time() - t0
        return {"conn/s": counts[0] / elapsed, "errors/s": counts[1] / elapsed}

    return uvloop.run(main())


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
        tree = Path(workdir, f"meshgate-{ref.replace('/', '_')}")
        if not tree.exists():
            tree.mkdir()
            archive = subprocess.run(
                ["git", "-C", str(ROOT), "archive", ref, "meshgate"], check=True, capture_output=True
            ).stdout
            subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
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
    p.add_argument("--serve", nargs=2, type=int, metavar=("BULK", "RR"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        serve(*args.serve)
        return 0

    size = args.size * MIB
    bulk_port, rr_port = free_port(), free_port()
    target_proc = subprocess.Popen(
        [sys.executable, __file__, "--serve", str(bulk_port), str(rr_port)],
        start_new_session=True,
        stdout=subprocess.DEVNULL,
    )
    # SIGTERM (timeout, CI) unwinds through `finally` so peers and targets stop too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    workdir = tempfile.mkdtemp(prefix="meshgate-bench-")
    peers: dict[str, Peer] = {}
    try:
        wait_port("127.0.0.1", bulk_port, 10, target_proc)
        wait_port("127.0.0.1", rr_port, 10, target_proc)
        bulk_target, rr_target = ("127.0.0.1", bulk_port), ("127.0.0.1", rr_port)
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
                out.update(conn_rate(proxy, rr_target, args.clients, args.seconds))
                if peer:
                    out["cpu s/GiB"] = cpu / (2 * size / GIB)
                    out["rss MiB"] = peer.peak_rss_kib() / 1024
                return out

            return run

        title = f"SOCKS5 portals, {args.size} MiB each way, {args.clients} clients"
        runner = Runner(title, args.rounds, baseline="meshgate" if "meshgate" in peers else None)
        for name in names:
            if (name == "direct" and selected(args, name)) or name in peers:
                runner.add(name, variant(name))
        runner.run()
        report([runner], args.json, ratio_metrics=["down MB/s", "up MB/s", "conn/s", "cpu s/GiB"])
        _targets(runner)
    finally:
        for peer in peers.values():
            peer.stop()
        os.killpg(target_proc.pid, signal.SIGTERM)
        target_proc.wait(5)
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
