"""Shared benchmark runner: paired, alternating rounds; medians; one table; optional JSON.

Method (DESIGN.md "Benchmarks"): every variant runs once per round, the order
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
* `Peer` starts a command, waits for its port, reports its CPU and RSS, and
  stops it (and its process group) afterwards.

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
import contextlib
import gc
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

Metrics = dict[str, float]

_CLK_TCK = os.sysconf("SC_CLK_TCK")


# --------------------------------------------------------------------------- /proc readers


def proc_cpu_seconds(pid: int, children: bool = True) -> float:
    """utime+stime of `pid` (plus its reaped children's, if `children`) in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        text = f.read()
    # The command name (field 2) may contain spaces; the rest follows its ')'.
    fields = text[text.rindex(")") + 2 :].split()
    utime, stime, cutime, cstime = (int(x) for x in fields[11:15])
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


def proc_tree_cpu_seconds(pid: int) -> float:
    total = 0.0
    for p in proc_tree_pids(pid):
        with contextlib.suppress(OSError):  # exited between listing and reading
            total += proc_cpu_seconds(p, children=(p == pid))
    return total


def proc_peak_rss_kib(pid: int) -> int:
    """VmHWM (peak resident set) of one process, in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
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
    proc: subprocess.Popen[bytes] | None = field(default=None, init=False)
    _cpu0: float = field(default=0.0, init=False)
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
            wait_port(self.host, self.port, timeout, self.proc)
        except RuntimeError:
            err = self._stderr_tail()
            self.stop()
            raise RuntimeError(f"peer {self.name} did not start: {err}") from None
        self._cpu0 = self.cpu_seconds()
        return self

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
        ratio_cols = [m for m in ratio_metrics if m in metrics]
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
        lines = [f"{self.title}: medians of {self.rounds} alternating rounds"]
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
    runners: Sequence[Runner], json_path: str | None = None, ratio_metrics: Sequence[str] = ()
) -> None:
    """Print every runner's table as one block and optionally write them all to JSON."""
    print("\n\n".join(r.table(ratio_metrics) for r in runners), flush=True)
    if json_path:
        data = {r.title: r.to_json(ratio_metrics) for r in runners}
        Path(json_path).write_text(json.dumps(data, indent=2, sort_keys=True))
        print(f"wrote {json_path}")


def add_args(p: argparse.ArgumentParser, rounds: int = 3) -> None:
    p.add_argument("--rounds", type=int, default=rounds, help="alternating rounds per variant")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    p.add_argument("--only", help="comma-separated variant names to run (default: all)")


def selected(args: argparse.Namespace, name: str) -> bool:
    only = getattr(args, "only", None)
    return not only or name in {s.strip() for s in only.split(",")}


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
