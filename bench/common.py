"""Shared benchmark runner: paired, alternating rounds; medians; one table; optional JSON.

Method (bench/README.md, "The method"): every variant runs once per round, the order
alternates between rounds (forward, then reversed) so drift and warm-up hit
every variant alike; we quote the median of each metric and, against the
baseline, the median of the per-round ratios (paired), not a ratio of medians.

A variant is a callable returning a dict of metric name -> number for one
round. Helpers below measure the usual things:

* `proc_cpu_seconds(pid)` / `proc_peak_rss_kib(pid)` for an external process
  (a peer such as microsocks, dante, or a meshgate node started as a child),
  read from /proc so no psutil is needed;
* `measure_in_process(fn, ops)` for an in-process variant: wall and CPU time,
  tracemalloc bytes and blocks per op, and gc collections during the run;
* `Peer` starts a command, waits for its port (or a line of its output),
  reports its CPU and RSS, and stops it (and its process group) afterwards;
* the one SOCKS5 client every SOCKS benchmark uses (`bulk_down`, `bulk_up`,
  `echo_rtt`, `conn_rate`, `connect_burst`) and its targets (`Targets`: a
  child process serving download/upload/echo and request/response);
* `git_tree(REF)` for A/B runs of a change against an older commit.

Bench scripts run as `python bench/NAME.py`; put the repository root on
sys.path first (`sys.path.insert(0, str(Path(__file__).resolve().parent.parent))`)
so `from bench.common import ...` works. Usage::

    from bench.common import Runner, add_args
    p = argparse.ArgumentParser(); add_args(p); args = p.parse_args()
    r = Runner("socks", rounds=args.rounds, baseline="direct")
    r.add("direct", run_direct)
    r.add("meshgate", run_meshgate)
    r.run()
    report([r], json_path=args.json, ratio_metrics=["MB/s"])
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# bench/peers in this checkout (templates, launchers; its README says how to run each peer);
# MESHGATE_PEERS points elsewhere.
PEERS = Path(os.environ.get("MESHGATE_PEERS", Path(__file__).resolve().parent / "peers"))

Metrics = dict[str, float]

_CLK_TCK = os.sysconf("SC_CLK_TCK")


# --------------------------------------------------------------------------- /proc readers


def proc_cpu_seconds(pid: int, children: bool = True, kernel: bool = False) -> float:
    """utime+stime of `pid` (plus its reaped children's, if `children`) in seconds; with
    `kernel` stime alone (the CPU spent in system calls and the network stack)."""
    with open(f"/proc/{pid}/stat") as f:
        text = f.read()
    # The command name (field 2) may contain spaces; the rest follows its ')'.
    fields = text[text.rindex(")") + 2 :].split()
    utime, stime, cutime, cstime = (int(x) for x in fields[11:15])
    if kernel:
        utime = cutime = 0
    ticks = utime + stime + ((cutime + cstime) if children else 0)
    return ticks / _CLK_TCK


def proc_tree_pids(pid: int) -> list[int]:
    """`pid` and its live descendants (dante forks workers; their CPU counts too)."""
    out = [pid]
    try:
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return out
    for k in kids:
        out.extend(proc_tree_pids(int(k)))
    return out


def proc_tree_cpu_seconds(pid: int, kernel: bool = False) -> float:
    total = 0.0
    for p in proc_tree_pids(pid):
        with contextlib.suppress(OSError):  # exited between listing and reading
            total += proc_cpu_seconds(p, children=(p == pid), kernel=kernel)
    return total


def proc_peak_rss_kib(pid: int) -> int:
    """VmHWM (peak resident set) of one process, in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return 0


def proc_rss_kib(pid: int) -> int:
    """VmRSS (resident set now) of one process, in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def proc_tree_peak_rss_kib(pid: int) -> int:
    """Sum of VmHWM over a process tree (a multi-process server's footprint)."""
    total = 0
    for p in proc_tree_pids(pid):
        with contextlib.suppress(OSError):
            total += proc_peak_rss_kib(p)
    return total


def self_cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


# --------------------------------------------------------------------------- in-process measuring


def measure_in_process(fn: Callable[[], Any], ops: int, trace_allocations: bool = True) -> Metrics:
    """Run `fn()` once (it performs `ops` operations) and measure it.

    tracemalloc slows the code under it, so wall/CPU time come from a first,
    untraced run and allocations from a second, traced one (so `fn` must be
    repeatable).
    """
    gc.collect()
    before = [s["collections"] for s in gc.get_stats()]
    cpu0, t0 = time.process_time(), time.perf_counter()
    fn()
    wall = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    after = [s["collections"] for s in gc.get_stats()]
    out: Metrics = {
        "ops/s": ops / wall if wall > 0 else float("inf"),
        "us/op": wall / ops * 1e6,
        "cpu_us/op": cpu / ops * 1e6,
        "gc": float(sum(after) - sum(before)),
    }
    if trace_allocations:
        # Two views: the peak of traced memory above the starting point (what a
        # burst of ops needs at once) and what is still held afterwards (leaks,
        # caches) in bytes and blocks. `fn` may return what it built to make
        # "held" count its per-op allocations.
        tracemalloc.start()
        snap0 = tracemalloc.take_snapshot()
        base, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        kept = fn()
        _, peak = tracemalloc.get_traced_memory()
        snap1 = tracemalloc.take_snapshot()
        tracemalloc.stop()
        del kept
        stats = snap1.compare_to(snap0, "filename")
        out["peak_B/op"] = max(0, peak - base) / ops
        out["held_B/op"] = sum(s.size_diff for s in stats if s.size_diff > 0) / ops
        out["held_blocks/op"] = sum(s.count_diff for s in stats if s.count_diff > 0) / ops
    return out


# --------------------------------------------------------------------------- external peers


def wait_port(
    host: str, port: int, timeout: float = 10.0, proc: subprocess.Popen[Any] | None = None
) -> None:
    deadline = time.monotonic() + timeout
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode} before listening")
        try:
            with socket.socket(fam, socket.SOCK_STREAM) as s:
                s.settimeout(0.5)
                s.connect((host, port))
                return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"nothing listening on {host}:{port} after {timeout}s") from None
            time.sleep(0.02)


def free_port(host: str = "127.0.0.1") -> int:
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(fam, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class Peer:
    """An external server for one benchmark run: started, measured, stopped."""

    name: str
    argv: Sequence[str]
    host: str = "127.0.0.1"
    port: int = 0
    env: dict[str, str] | None = None
    cwd: str | None = None
    pid_file: str | None = None  # daemons that fork (dante) tell us their real pid here
    ready_text: str | None = None  # wait for this in the output instead of the port (no listener)
    proc: subprocess.Popen[bytes] | None = field(default=None, init=False)
    _cpu0: float = field(default=0.0, init=False)
    _kernel0: float = field(default=0.0, init=False)
    _log: Any = field(default=None, init=False)

    def start(self, timeout: float = 15.0) -> Peer:
        env = dict(os.environ, **(self.env or {}))
        # Output goes to a file, never an undrained pipe: a chatty peer (microsocks
        # logs every connection) would block on a full pipe and stall the benchmark.
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 - lives as long as the peer
        self.proc = subprocess.Popen(
            list(self.argv),
            env=env,
            cwd=self.cwd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, so stop() reaches its workers
        )
        try:
            if self.ready_text is not None:
                self._wait_output(self.ready_text, timeout)
            else:
                wait_port(self.host, self.port, timeout, self.proc)
        except RuntimeError:
            err = self._stderr_tail()
            self.stop()
            raise RuntimeError(f"peer {self.name} did not start: {err}") from None
        self._cpu0 = self.cpu_seconds()
        self._kernel0 = self.kernel_cpu_seconds()
        return self

    def _wait_output(self, text: str, timeout: float) -> None:
        assert self.proc is not None and self._log is not None
        deadline = time.monotonic() + timeout
        fd = self._log.fileno()
        while True:
            # pread, not seek+read: the child shares this file's offset and keeps writing at it
            if text.encode() in os.pread(fd, os.fstat(fd).st_size, 0):
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.proc.args!r} exited with {self.proc.returncode}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"no {text!r} in the output after {timeout}s")
            time.sleep(0.02)

    def _stderr_tail(self) -> str:
        if self._log is None:
            return ""
        self._log.seek(0)
        return bytes(self._log.read()).decode(errors="replace")[-2000:] or "(no output)"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        if self.pid_file and os.path.exists(self.pid_file):
            text = Path(self.pid_file).read_text().strip()
            if text.isdigit():
                return int(text)
        return self.proc.pid

    def cpu_seconds(self) -> float:
        """CPU used by the whole process tree since start() returned."""
        return proc_tree_cpu_seconds(self.pid) - self._cpu0

    def kernel_cpu_seconds(self) -> float:
        """The part of cpu_seconds() spent in the kernel (system calls, the network stack)."""
        return proc_tree_cpu_seconds(self.pid, kernel=True) - self._kernel0

    def peak_rss_kib(self) -> int:
        return proc_tree_peak_rss_kib(self.pid)

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        if self._log is not None:
            self._log.close()
            self._log = None
        self.proc = None

    def __enter__(self) -> Peer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def git_tree(ref: str, workdir: str, paths: Sequence[str] = ("meshgate",)) -> Path:
    """`paths` as of git `ref`, extracted (git archive) under `workdir`, for A/B runs of a change.
    Run it with cwd = the returned directory so `python -m meshgate` imports this copy."""
    tree = Path(workdir, f"tree-{ref.replace('/', '_')}")
    if not tree.exists():
        tree.mkdir()
        root = Path(__file__).resolve().parent.parent
        archive = subprocess.run(
            ["git", "-C", str(root), "archive", ref, *paths], check=True, capture_output=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    return tree


# --------------------------------------------------------------------------- SOCKS5 targets and client
# One client for every SOCKS5 benchmark (bench/socks.py, bench/portal.py), so every
# row of every table is driven the same way. The targets run in a child process
# (`Targets`), so client, proxy and targets are separate processes, as they would be.

CHUNK = 1 << 20
REQUEST = b"q" * 64
RESPONSE = b"r" * 64


def _bulk_conn(conn: socket.socket) -> None:
    """One target connection: 'D'+size downloads, 'U'+size uploads, 'E'+0 echoes until EOF."""
    with conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
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
        elif op == b"E":
            while data := conn.recv(65536):
                conn.sendall(data)


def _bulk_server(sock: socket.socket) -> None:
    while True:
        conn, _ = sock.accept()
        threading.Thread(target=_bulk_conn, args=(conn,), daemon=True).start()


class _Responder(asyncio.Protocol):
    """Reads the 64-byte request, answers and closes first (dante runs out of local
    ports when the client closes first, bench/peers/README.md)."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.got = 0

    def data_received(self, data: bytes) -> None:
        self.got += len(data)
        if self.got >= len(REQUEST):
            self.transport.write(RESPONSE)  # type: ignore[attr-defined]
            self.transport.close()


def serve_targets(bulk_port: int, rr_port: int) -> None:
    """Run the bulk/echo target (threads) and the request/response target (uvloop) forever."""
    import uvloop

    bulk = socket.create_server(("127.0.0.1", bulk_port), backlog=128)
    threading.Thread(target=_bulk_server, args=(bulk,), daemon=True).start()
    loop = uvloop.new_event_loop()
    asyncio.set_event_loop(loop)
    loop.run_until_complete(loop.create_server(_Responder, "127.0.0.1", rr_port, backlog=4096))
    loop.run_forever()


class Targets:
    """The target servers as a child process: `bulk` (download/upload/echo) and `rr` ports."""

    def __init__(self) -> None:
        self.bulk_port, self.rr_port = free_port(), free_port()
        code = f"from bench.common import serve_targets; serve_targets({self.bulk_port}, {self.rr_port})"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code],
            cwd=str(Path(__file__).resolve().parent.parent),
            start_new_session=True,
            stdout=subprocess.DEVNULL,
        )
        try:
            wait_port("127.0.0.1", self.bulk_port, 10, self.proc)
            wait_port("127.0.0.1", self.rr_port, 10, self.proc)
        except RuntimeError:
            self.stop()
            raise

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(5)


def stop_processes(procs: Iterable[subprocess.Popen[Any]], timeout: float = 10) -> None:
    """SIGTERM all first (they shut down in parallel), then wait for each; SIGKILL a straggler."""
    procs = list(procs)
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()


def connect_request(host: str, port: int) -> bytes:
    """SOCKS5 CONNECT request for an IPv4 address or a name (ATYP 1 or 3)."""
    try:
        addr = b"\x01" + socket.inet_aton(host)
    except OSError:
        addr = b"\x03" + bytes([len(host)]) + host.encode()
    return b"\x05\x01\x00" + addr + struct.pack("!H", port)


def recv_exact(s: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        part = s.recv(n - len(out))
        if not part:
            raise RuntimeError("connection closed early")
        out += part
    return out


def _reply_rest(head: bytes) -> int:
    """Bytes of a SOCKS5 reply after its first 5 (VER REP RSV ATYP + 1), by ATYP."""
    atyp = head[3]
    if atyp == 1:
        return 4 + 2 - 1
    if atyp == 4:
        return 16 + 2 - 1
    if atyp == 3:
        return head[4] + 2
    raise RuntimeError(f"bad SOCKS5 reply ATYP {atyp}")


def http_connect_request(host: str, port: int) -> bytes:
    """HTTP/1.1 CONNECT for host:port (what curl -p sends, without User-Agent)."""
    return f"CONNECT {host}:{port} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode()


def http_reply_code(head: bytes) -> int:
    """The status of a proxy's CONNECT answer head (`HTTP/1.x 200 ...`)."""
    parts = head.split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/") or not parts[1].isdigit():
        raise RuntimeError(f"bad HTTP proxy reply {head[:40]!r}")
    return int(parts[1])


def _recv_head(s: socket.socket) -> bytes:
    """A CONNECT answer head. Read in blocks: the targets never speak first, so nothing past the
    head's blank line can arrive before the client's first bytes (checked)."""
    head = b""
    while b"\r\n\r\n" not in head:
        part = s.recv(4096)
        if not part or len(head) > 8192:
            raise RuntimeError("connection closed early or head too long")
        head += part
    if not head.endswith(b"\r\n\r\n"):
        raise RuntimeError("bytes after the CONNECT answer head")
    return head


def socks_connect_blocking(
    proxy: tuple[str, int] | None, target: tuple[str, int], kind: str = "socks5"
) -> socket.socket:
    """A connection to `target` through `proxy` (`kind` socks5, or http: HTTP CONNECT)."""
    # A bounded wait on every call: a stuck peer fails the round instead of hanging the run.
    if proxy is None:
        s = socket.create_connection(target, timeout=60)
    elif kind == "http":
        s = socket.create_connection(proxy, timeout=60)
        s.sendall(http_connect_request(*target))
        code = http_reply_code(_recv_head(s))
        if code != 200:
            s.close()
            raise RuntimeError(f"proxy answered {code}")
    else:
        s = socket.create_connection(proxy, timeout=60)
        s.sendall(b"\x05\x01\x00")
        if recv_exact(s, 2) != b"\x05\x00":
            raise RuntimeError("proxy refused the method")
        s.sendall(connect_request(*target))
        head = recv_exact(s, 5)
        recv_exact(s, _reply_rest(head))
        if head[1] != 0:
            s.close()
            raise RuntimeError(f"proxy replied {head[1]:#04x}")
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def bulk_down(
    proxy: tuple[str, int] | None, target: tuple[str, int], size: int, kind: str = "socks5"
) -> float:
    """Seconds to download `size` bytes from the bulk target."""
    s = socks_connect_blocking(proxy, target, kind)
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


def bulk_up(
    proxy: tuple[str, int] | None, target: tuple[str, int], size: int, kind: str = "socks5"
) -> float:
    """Seconds to upload `size` bytes to the bulk target (until it acknowledges the last byte)."""
    s = socks_connect_blocking(proxy, target, kind)
    with s:
        block = memoryview(bytes(CHUNK))
        t0 = time.perf_counter()
        s.sendall(b"U" + struct.pack("!Q", size))
        left = size
        while left:
            n = min(left, CHUNK)
            s.sendall(block[:n])
            left -= n
        if recv_exact(s, 1) != b"K":
            raise RuntimeError("upload not acknowledged")
        elapsed = time.perf_counter() - t0
    return elapsed


def echo_rtt(proxy: tuple[str, int] | None, target: tuple[str, int], count: int, size: int = 64) -> Metrics:
    """Ping-pong `count` messages of `size` bytes on one connection to the bulk target's echo."""
    s = socks_connect_blocking(proxy, target)
    with s:
        s.sendall(b"E" + struct.pack("!Q", 0))
        msg = b"p" * size
        times = []
        for _ in range(count):
            t0 = time.perf_counter()
            s.sendall(msg)
            recv_exact(s, size)
            times.append(time.perf_counter() - t0)
    times.sort()
    return {"rtt_us_p50": times[len(times) // 2] * 1e6, "rtt_us_p99": times[int(len(times) * 0.99)] * 1e6}


async def _recv_exact_async(loop: asyncio.AbstractEventLoop, s: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        part = await loop.sock_recv(s, n - len(out))
        if not part:
            raise ConnectionError("closed early")
        out += part
    return out


async def _socks_handshake_async(
    loop: asyncio.AbstractEventLoop, s: socket.socket, request: bytes
) -> int:
    """Greeting + CONNECT on a connected socket; the reply code."""
    await loop.sock_sendall(s, b"\x05\x01\x00")
    await _recv_exact_async(loop, s, 2)
    await loop.sock_sendall(s, request)
    head = await _recv_exact_async(loop, s, 5)
    await _recv_exact_async(loop, s, _reply_rest(head))
    return head[1]


async def _http_handshake_async(loop: asyncio.AbstractEventLoop, s: socket.socket, request: bytes) -> int:
    """CONNECT on a connected socket; the status."""
    await loop.sock_sendall(s, request)
    head = b""
    while b"\r\n\r\n" not in head:  # as _recv_head
        part = await loop.sock_recv(s, 4096)
        if not part or len(head) > 8192:
            raise ConnectionError("closed early or head too long")
        head += part
    if not head.endswith(b"\r\n\r\n"):
        raise ConnectionError("bytes after the CONNECT answer head")
    return http_reply_code(head)


async def _rr_once(
    loop: asyncio.AbstractEventLoop,
    s: socket.socket,
    proxy: tuple[str, int] | None,
    target: tuple[str, int],
    request: bytes,
    kind: str = "socks5",
) -> None:
    await loop.sock_connect(s, proxy or target)
    if proxy is not None and kind == "http":
        code = await _http_handshake_async(loop, s, request)
        if code != 200:
            raise ConnectionError(f"status {code}")
    elif proxy is not None:
        code = await _socks_handshake_async(loop, s, request)
        if code != 0:
            raise ConnectionError(f"reply {code}")
    await loop.sock_sendall(s, REQUEST)
    got = 0
    while True:
        part = await loop.sock_recv(s, 4096)
        if not part:
            break
        got += len(part)
    if got != len(RESPONSE):
        raise ConnectionError("short response")


async def _rr_worker(
    proxy: tuple[str, int] | None, target: tuple[str, int], deadline: float, counts: list[int], limit: int,
    kind: str = "socks5",
) -> None:
    loop = asyncio.get_running_loop()
    request = http_connect_request(*target) if kind == "http" else connect_request(*target)
    while loop.time() < deadline and counts[0] + counts[1] < limit:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setblocking(False)
        try:
            async with asyncio.timeout(5):  # a stuck connection counts as an error, not a hang
                await _rr_once(loop, s, proxy, target, request, kind)
            counts[0] += 1
        except (OSError, TimeoutError):
            counts[1] += 1
        finally:
            s.close()


def conn_rate(
    proxy: tuple[str, int] | None,
    target: tuple[str, int],
    clients: int,
    seconds: float,
    limit: int = 1 << 62,
    detail: bool = False,
    kind: str = "socks5",
) -> Metrics:
    """`clients` concurrent loops of CONNECT (SOCKS5, or `kind` http: HTTP CONNECT) + one 64-byte
    request and response, for `seconds` or until `limit` connections were tried; completed
    connections (and errors) per second, with `detail` also the counts and the elapsed time."""
    import uvloop

    async def main() -> Metrics:
        loop = asyncio.get_running_loop()
        counts = [0, 0]
        t0 = loop.time()
        end = t0 + seconds
        await asyncio.gather(*(_rr_worker(proxy, target, end, counts, limit, kind) for _ in range(clients)))
        elapsed = max(loop.time() - t0, 1e-6)  # a fast refusal can take under the clock's tick
        out = {"conn/s": counts[0] / elapsed, "errors/s": counts[1] / elapsed}
        if detail:
            out |= {"conns": float(counts[0]), "errors": float(counts[1]), "seconds": elapsed}
        return out

    return uvloop.run(main())


def connect_burst(proxy: tuple[str, int], target: tuple[str, int], n: int, timeout: float = 10.0) -> Metrics:
    """`n` clients open and send CONNECT at once; every one waits up to `timeout` for its reply,
    then does one request/response. Counts replies by code, hangs, failures and completions."""
    import uvloop

    async def one(loop: asyncio.AbstractEventLoop, start: asyncio.Event, out: dict[str, float]) -> None:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setblocking(False)
        request = connect_request(*target)
        try:
            await start.wait()
            t0 = loop.time()
            try:
                async with asyncio.timeout(timeout):
                    await loop.sock_connect(s, proxy)
                    code = await _socks_handshake_async(loop, s, request)
            except TimeoutError:
                out["hung"] += 1
                return
            except (OSError, ConnectionError, RuntimeError):
                out["failed"] += 1
                return
            out["answered"] += 1
            out[f"rep_{code:#04x}"] = out.get(f"rep_{code:#04x}", 0) + 1
            out["last_answer_s"] = max(out["last_answer_s"], loop.time() - t0)
            if code != 0:
                return
            try:
                async with asyncio.timeout(timeout):
                    await loop.sock_sendall(s, REQUEST)
                    if await _recv_exact_async(loop, s, len(RESPONSE)) == RESPONSE:
                        out["completed"] += 1
            except (OSError, ConnectionError, TimeoutError):
                pass
        finally:
            s.close()

    async def main() -> Metrics:
        loop = asyncio.get_running_loop()
        start = asyncio.Event()
        out: dict[str, float] = {"answered": 0, "hung": 0, "failed": 0, "completed": 0, "last_answer_s": 0.0}
        tasks = [asyncio.ensure_future(one(loop, start, out)) for _ in range(n)]
        await asyncio.sleep(0)  # every task is parked on the event: they go together
        start.set()
        await asyncio.gather(*tasks)
        return out

    return uvloop.run(main())


def easytier_interpreter_rss_mib(idle: float = 1.0) -> tuple[float, float]:
    """(RSS, peak RSS) in MiB of `bench/peers/easytier_node.py --baseline`: the Python interpreter
    that hosts an EasyTier node, with the same `import easytier_pyo3`, idle, and no node. What an
    EasyTier row's RSS includes that is not the core. Needs a loopback-only namespace, like a node."""
    argv = [sys.executable, str(PEERS / "easytier_node.py"), "--baseline"]
    peer = Peer("easytier-interpreter", argv, ready_text='"ready": true').start()
    try:
        time.sleep(idle)  # as settled as a node's interpreter after start-up
        return proc_rss_kib(peer.pid) / 1024, proc_peak_rss_kib(peer.pid) / 1024
    finally:
        peer.stop()


def loopback_only() -> bool:
    """True inside a network namespace that has only `lo` (bench/peers/isolated)."""
    with open("/proc/self/net/dev") as f:
        return [line.split(":")[0].strip() for line in f.readlines()[2:]] == ["lo"]


# --------------------------------------------------------------------------- the runner


@dataclass
class Runner:
    """Runs named variants for N rounds in alternating order and reports one table."""

    title: str
    rounds: int = 3
    baseline: str | None = None
    results: dict[str, list[Metrics]] = field(default_factory=dict)
    _variants: dict[str, Callable[[], Metrics]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)

    def add(self, name: str, fn: Callable[[], Metrics]) -> None:
        self._variants[name] = fn
        self.results[name] = []

    def run(self, verbose: bool = True) -> None:
        names = list(self._variants)
        for r in range(self.rounds):
            order = names if r % 2 == 0 else names[::-1]
            for name in order:
                if name in self.errors:
                    continue
                try:
                    m = self._variants[name]()
                except Exception as e:  # one broken peer must not lose the others' figures
                    self.errors[name] = f"{type(e).__name__}: {e}"
                    print(f"  [{self.title}] {name} failed: {self.errors[name]}", file=sys.stderr)
                    continue
                self.results[name].append(m)
                if verbose:
                    shown = ", ".join(f"{k}={_fmt(v)}" for k, v in m.items())
                    print(f"  round {r + 1}/{self.rounds} {name}: {shown}", file=sys.stderr, flush=True)

    def medians(self) -> dict[str, Metrics]:
        out: dict[str, Metrics] = {}
        for name, rows in self.results.items():
            if not rows:
                continue
            keys = list(dict.fromkeys(k for row in rows for k in row))
            out[name] = {k: statistics.median(row[k] for row in rows if k in row) for k in keys}
        return out

    def paired_ratios(self, metric: str) -> dict[str, float]:
        """Median over rounds of variant/baseline for `metric` (same round = a pair)."""
        if self.baseline is None or self.baseline not in self.results:
            return {}
        base = self.results[self.baseline]
        out: dict[str, float] = {}
        for name, rows in self.results.items():
            ratios = [
                row[metric] / b[metric]
                for row, b in zip(rows, base, strict=False)
                if metric in row and metric in b and b[metric]
            ]
            if ratios:
                out[name] = statistics.median(ratios)
        return out

    def table(self, ratio_metrics: Sequence[str] = ()) -> str:
        med = self.medians()
        metrics = list(dict.fromkeys(k for m in med.values() for k in m))
        ratio_cols = [m for m in ratio_metrics if m in metrics] if self.baseline else []
        ratios = {m: self.paired_ratios(m) for m in ratio_cols}
        header = ["variant", *metrics, *(f"{m} x{self.baseline}" for m in ratio_cols), "n"]
        rows = []
        for name in self._variants:
            if name not in med:
                rows.append([name, *(["-"] * (len(header) - 2)), "0"])
                continue
            cells = [name, *(_fmt(med[name][k]) if k in med[name] else "-" for k in metrics)]
            cells += [_fmt(ratios[m][name]) if name in ratios[m] else "-" for m in ratio_cols]
            cells.append(str(len(self.results[name])))
            rows.append(cells)
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
        title = f"{self.title}: medians of {self.rounds} alternating rounds"
        return self._render(title, header, rows, widths)

    def table_by_metric(self) -> str:
        """The same medians transposed, one metric per line and one variant per column, with the
        paired ratio of every other variant to the baseline: for many metrics and few variants."""
        med = self.medians()
        names = [n for n in self._variants if n in med]
        metrics = list(dict.fromkeys(k for n in names for k in med[n]))
        others = [n for n in names if n != self.baseline] if self.baseline in med else []
        header = ["metric", *names, *(f"{n}/{self.baseline}" for n in others)]
        rows = []
        for m in metrics:
            cells = [m, *(_fmt(med[n][m]) if m in med[n] else "-" for n in names)]
            ratios = self.paired_ratios(m)
            cells += [_fmt(ratios[n]) if n in ratios else "-" for n in others]
            rows.append(cells)
        widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
        counts = ", ".join(f"{n}: {len(self.results[n])}" for n in self._variants)
        title = f"{self.title}: medians of {self.rounds} alternating rounds (rounds run: {counts})"
        return self._render(title, header, rows, widths)

    def _render(self, title: str, header: list[str], rows: list[list[str]], widths: list[int]) -> str:
        """Title, aligned columns (first left, the rest right), then any variant's error."""
        lines = [title]
        for cells in [header, *rows]:
            lines.append(
                "  ".join(
                    c.rjust(w) if i else c.ljust(w)
                    for i, (c, w) in enumerate(zip(cells, widths, strict=True))
                )
            )
        for name, err in self.errors.items():
            lines.append(f"  {name}: {err}")
        return "\n".join(lines)

    def to_json(self, ratio_metrics: Sequence[str] = ()) -> dict[str, Any]:
        return {
            "title": self.title,
            "rounds": self.rounds,
            "baseline": self.baseline,
            "medians": self.medians(),
            "paired_ratios": {m: self.paired_ratios(m) for m in ratio_metrics},
            "raw": self.results,
            "errors": self.errors,
        }


def report(
    runners: Sequence[Runner],
    json_path: str | None = None,
    ratio_metrics: Sequence[str] = (),
    by_metric: bool = False,
) -> None:
    """Print every runner's table as one block and optionally write them all to JSON.
    `by_metric` prints them transposed (Runner.table_by_metric)."""
    tables = [r.table_by_metric() if by_metric else r.table(ratio_metrics) for r in runners]
    print("\n\n".join(tables), flush=True)
    print(f"scheduler: autogroup {autogroup_state()} (kernel.sched_autogroup_enabled), "
          f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}", flush=True)
    if json_path:
        data = {r.title: r.to_json(ratio_metrics) for r in runners}
        Path(json_path).write_text(json.dumps(data, indent=2, sort_keys=True))
        print(f"wrote {json_path}")


AUTOGROUP = Path("/proc/sys/kernel/sched_autogroup_enabled")


def autogroup_state() -> str:
    """The scheduler's autogroup setting, printed with every report. Peers start in sessions of
    their own (Peer.start), and with autogroup on the kernel shares CPU between sessions, not
    processes: a server of several processes then gets one session's share against the client's
    (on 2 cores, `dns.workers = 2` measured 0.56x the q/s of one process with it on, 1.04x off;
    docs/OPERATIONS.md, The DNS fast path). Figures are comparable only under the same setting."""
    try:
        return "on" if AUTOGROUP.read_text().strip() == "1" else "off"
    except OSError:
        return "absent"


@contextlib.contextmanager
def autogroup(choice: str) -> Iterator[None]:
    """`--autogroup off|on`: set kernel.sched_autogroup_enabled for the run (root), then put it
    back; `keep` leaves it."""
    before = autogroup_state()
    if choice == "keep" or choice == before or before == "absent":
        yield
        return
    try:
        AUTOGROUP.write_text("1" if choice == "on" else "0")
    except OSError as e:
        sys.exit(f"--autogroup {choice}: cannot write {AUTOGROUP} ({e}); run as root or use keep")
    try:
        yield
    finally:
        AUTOGROUP.write_text("1" if before == "on" else "0")


def add_args(p: argparse.ArgumentParser, rounds: int = 3) -> None:
    p.add_argument("--rounds", type=int, default=rounds, help="alternating rounds per variant")

    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    p.add_argument("--only", help="comma-separated variant names to run (default: all)")


def selected(args: argparse.Namespace, name: str) -> bool:
    only = getattr(args, "only", None)
    return not only or name in {s.strip() for s in only.split(",")}


def fmt(v: float) -> str:
    """A number as the tables show it (thousands separated, about three significant digits)."""
    return _fmt(v)


def _fmt(v: float) -> str:
    if v != v:  # NaN
        return "nan"
    a = abs(v)
    if a >= 1000:
        return f"{v:,.0f}"
    if a >= 100:
        return f"{v:.0f}"
    if a >= 10:
        return f"{v:.1f}"
    if a >= 0.01 or a == 0:
        return f"{v:.2f}"
    return f"{v:.2e}"
