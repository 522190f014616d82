"""What a node's worker processes (DNS: dns/worker_pool.py, SOCKS5: gateway/workers.py) and
the node's process share: the control socket's frames, counters reported and merged, and the
worker's tie to its parent. Below both features (ground layer), so neither imports the other.

Frames on the control socket (a socketpair; its fd number is a worker's only argument, so no
config or secret is ever on a command line): `length(4) kind(1) payload`, at most MAX_FRAME.
A worker reports its counters (absolute, since it started) every REPORT_INTERVAL seconds;
the node's process adds the increase since the last report to its own families.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import json
import logging
import os
import pickle
import signal
import socket
import struct
import sys
from collections.abc import Awaitable, Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import meshgate
from meshgate.errors import StartupError
from meshgate.metrics import REGISTRY

log = logging.getLogger("meshgate.workers")

REPORT_INTERVAL = 1.0
READY_TIMEOUT = 20.0  # a worker's first start, until its "R"
STOP_TIMEOUT = 3.0
RESTART_BACKOFF = 0.2
RESTART_BACKOFF_MAX = 30.0
STABLE_AFTER = 60.0  # a worker that ran this long before exiting restarts with the shortest backoff
MAX_FRAME = 16 << 20
HEAD = struct.Struct("!IB")
# Environment variables that carry secrets (config.py reads them); never passed to workers.
SECRET_ENV = ("MESHGATE_SECRET", "MESHGATE_ADMIN_TOKEN")


def frame(kind: bytes, payload: bytes) -> bytes:
    return HEAD.pack(len(payload), kind[0]) + payload


async def read_frame(reader: asyncio.StreamReader) -> tuple[bytes, bytes] | None:
    """The next frame, or None at EOF (the other process is gone)."""
    try:
        head = await reader.readexactly(HEAD.size)
        n, kind = HEAD.unpack(head)
        if n > MAX_FRAME:
            raise ValueError(f"control frame of {n} bytes")
        return bytes((kind,)), await reader.readexactly(n)
    except (asyncio.IncompleteReadError, ConnectionError):
        return None


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """`n` bytes from a blocking socket (a worker's setup frame, before its loop runs)."""
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise EOFError("control socket closed")
        out += chunk
    return bytes(out)


def die_with_parent() -> None:
    """SIGTERM this process when its parent dies (PR_SET_PDEATHSIG); EOF on the control socket
    covers the rest."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)


def counter_snapshot() -> bytes:
    """Every non-zero counter of this process, as a worker reports them."""
    rows = []
    for fam in REGISTRY.counter_families():
        for values, c in fam.children():
            if c.value:
                rows.append([fam.name, fam.help, list(fam.labelnames), list(values), c.value])
    return json.dumps(rows).encode()


class CounterMerge:
    """Adds one worker's reported counters to this process's families. With `queries_metric`,
    also sums that counter's increases per its first label into `queries` (and hands each
    report's total to `on_queries`)."""

    def __init__(self, index: int, queries_metric: str = "",
                 on_queries: Callable[[int], None] | None = None) -> None:
        self.index = index
        self.queries_metric = queries_metric
        self.on_queries = on_queries
        self.last: dict[tuple[str, tuple[str, ...]], int] = {}
        self.queries: dict[str, int] = {}  # by first label, over every incarnation of this worker

    def restarted(self) -> None:
        self.last.clear()  # a new process counts from zero

    def apply(self, payload: bytes) -> None:
        new_queries = 0
        for name, help_, labelnames, values, value in json.loads(payload):
            values = [str(v) for v in values]
            key = (name, tuple(values))
            delta = int(value) - self.last.get(key, 0)
            if delta <= 0:
                continue
            self.last[key] = int(value)
            try:
                REGISTRY.counter(name, help_, tuple(labelnames)).labels(*values).inc(delta)
            except ValueError as e:  # a name this process registered differently: skip that one
                log.warning("worker %d: cannot merge counter %s%s: %s", self.index, name, values, e)
                continue
            if name == self.queries_metric and values:
                new_queries += delta
                self.queries[values[0]] = self.queries.get(values[0], 0) + delta
        if new_queries and self.on_queries is not None:
            self.on_queries(new_queries)


# --------------------------------------------------------------------------- the worker's side


def read_setup(sock: socket.socket) -> dict[str, Any] | None:
    """A worker's start: tie it to its parent, read the setup frame (config, index, loop kind,
    parent pid) from the control socket; None when there is none or the parent already died."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the node stops us
    try:
        n, _kind = HEAD.unpack(recv_exact(sock, HEAD.size))
        if n > MAX_FRAME:
            return None
        # Trusted: our parent wrote it into a socketpair only the two processes hold.
        setup: dict[str, Any] = pickle.loads(recv_exact(sock, n))
    except EOFError:
        return None
    if os.getppid() != setup["parent"]:
        return None  # the parent died before PR_SET_PDEATHSIG was armed
    return setup


async def report_counters(writer: asyncio.StreamWriter) -> None:
    """Every REPORT_INTERVAL, this worker's counters to the node's process (cancel to stop)."""
    while not writer.is_closing():
        await asyncio.sleep(REPORT_INTERVAL)
        writer.write(frame(b"M", counter_snapshot()))


async def final_report(writer: asyncio.StreamWriter) -> None:
    """The last counter report, then the control socket closed (a stopping worker)."""
    with contextlib.suppress(ConnectionError):
        if not writer.is_closing():
            writer.write(frame(b"M", counter_snapshot()))
            await writer.drain()
    writer.close()


# --------------------------------------------------------------------------- the node's side


@dataclasses.dataclass
class WorkerSlot:
    """One worker process as its pool holds it (restarted in the same slot)."""

    index: int
    merge: CounterMerge
    proc: asyncio.subprocess.Process | None = None
    writer: asyncio.StreamWriter | None = None
    task: asyncio.Task[None] | None = None  # reads the worker's control frames
    ready: asyncio.Future[None] | None = None  # the first start's "R" (or its failure)
    restarts: int = 0
    started_at: float = 0.0


W = TypeVar("W", bound=WorkerSlot)


async def stop_workers(workers: Iterable[WorkerSlot], what: str, timeout: float) -> None:
    """Ask every worker to stop, wait `timeout` for each (then kill it), and let each reader
    task drain the final counter report before it sees EOF."""
    workers = list(workers)
    for w in workers:
        if w.writer is not None and not w.writer.is_closing():
            w.writer.write(frame(b"S", b""))
    for w in workers:
        if w.proc is None or w.proc.returncode is not None:
            continue
        try:
            async with asyncio.timeout(timeout):
                await w.proc.wait()
        except TimeoutError:
            log.warning("%s worker %d (pid %d) did not stop in %.0fs: killed", what, w.index, w.proc.pid,
                        timeout)
            with contextlib.suppress(ProcessLookupError):
                w.proc.kill()
            await w.proc.wait()
    for w in workers:
        if w.task is not None:
            with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                async with asyncio.timeout(timeout):
                    await w.task
            if not w.task.done():
                w.task.cancel()


async def spawn(module: str, ends: Sequence[socket.socket]) -> asyncio.subprocess.Process:
    """`python -m MODULE FD...` with the child's socket `ends` passed to it (and closed here).
    It imports this process's meshgate tree (a checkout or a git ref's copy), and no secret is
    in its environment: its config copy has none, a worker's /proc/PID/environ is readable by
    the same user, and it parses untrusted input."""
    env = {k: v for k, v in os.environ.items() if k not in SECRET_ENV}
    root = str(Path(meshgate.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    try:
        return await asyncio.create_subprocess_exec(
            sys.executable, "-m", module, *(str(e.fileno()) for e in ends),
            pass_fds=tuple(e.fileno() for e in ends), env=env, stdin=asyncio.subprocess.DEVNULL,
        )
    finally:
        for e in ends:
            e.close()


def common_frame(w: WorkerSlot, kind: bytes, payload: bytes) -> bool:
    """The frames every worker sends: M (counters), R (ready), E (could not start). False for a
    kind the pool handles itself."""
    if kind == b"M":
        w.merge.apply(payload)
    elif kind == b"R":
        if w.ready is not None and not w.ready.done():
            w.ready.set_result(None)
    elif kind == b"E":
        text = payload.decode(errors="replace")
        if w.ready is not None and not w.ready.done():  # the first start: it fails the node's
            w.ready.set_exception(StartupError(text))
        else:
            log.error("%s", text)  # a restart that failed: retried after the backoff
    else:
        return False
    return True


async def after_exit(w: W, what: str, started: bool, stopping: Callable[[], bool],
                     respawn: Callable[[W], Awaitable[None]]) -> None:
    """A worker's process is gone: fail the node's start if it never got ready; else, unless
    the pool stops, start it again after a backoff that doubles up to RESTART_BACKOFF_MAX (the
    shortest again after STABLE_AFTER seconds of running)."""
    assert w.proc is not None
    code = await w.proc.wait()
    if not started:  # the node's start fails (and stops the pool); no restarts
        if w.ready is not None and not w.ready.done():
            w.ready.set_exception(StartupError(f"{what} worker {w.index} exited with {code} while starting"))
        return
    if stopping():
        return
    ran = asyncio.get_running_loop().time() - w.started_at
    delay = RESTART_BACKOFF if ran >= STABLE_AFTER else min(
        RESTART_BACKOFF * 2 ** min(w.restarts, 16), RESTART_BACKOFF_MAX)
    w.restarts += 1
    log.warning("%s worker %d (pid %d) exited with %s after %.1fs; restarting in %.1fs",
                what, w.index, w.proc.pid, code, ran, delay)
    await asyncio.sleep(delay)
    if stopping():
        return
    try:
        await respawn(w)
    except OSError as e:
        log.error("%s worker %d: cannot restart: %s", what, w.index, e)
