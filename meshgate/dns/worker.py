"""A DNS worker process: `python -m meshgate.dns.worker FD`, started by the node's WorkerPool.

What the processes say to each other, and why, is in meshgate/dns/worker_pool.py (the main
process's side). This is the other side: read the setup frame from the control socket, build a
pipeline whose names are the table the main process pushes and whose only upstream is the main
process (`ParentUpstream`), serve the shared listeners with a DnsService, report counters, and
stop when told to or when the main process goes away.
"""

from __future__ import annotations

import asyncio
import json
import os
import pickle
import signal
import socket
import sys
import time

from meshgate import logs
from meshgate.config import Config
from meshgate.dns import wire
from meshgate.dns.querylog import QueryLog
from meshgate.dns.resolver import NameTable, Pipeline, upstream_spans
from meshgate.dns.service import DnsService
from meshgate.dns.upstream import Upstream
from meshgate.dns.worker_pool import _ID, LOG_PENDING, LogEntry, decode_names, encode_log
from meshgate.errors import StartupError
from meshgate.loop import new_loop
from meshgate.metrics import REGISTRY
from meshgate.workerproc import final_report, frame, read_frame, read_setup, report_counters

_log_dropped = REGISTRY.counter("meshgate_dns_query_log_dropped_total",
                                "Query log lines dropped because the file writer's queue was full")


class ParentUpstream(Upstream):
    """A worker's only upstream: the main process, over the control socket."""

    url = "parent"

    def __init__(self, writer: asyncio.StreamWriter, max_inflight: int, upstreams: int = 1) -> None:
        self.writer = writer
        self.max_inflight = max_inflight
        # the main process fails over through its upstreams, each with the same timeout
        self.spans = max(1, upstreams)
        self._next = 0
        self._waiting: dict[int, asyncio.Future[bytes]] = {}

    async def exchange(self, wire: bytes, timeout: float) -> bytes:
        if len(self._waiting) >= self.max_inflight or self.writer.is_closing():
            raise OSError("main process not reachable or busy")
        self._next = (self._next + 1) & 0xFFFFFFFF
        qid = self._next
        fut: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._waiting[qid] = fut
        try:
            self.writer.write(frame(b"Q", _ID.pack(qid) + wire))
            async with asyncio.timeout(timeout * self.spans):
                resp = await fut
        finally:
            self._waiting.pop(qid, None)
        if not resp:
            raise OSError("the main process's upstreams failed")
        return resp

    def answered(self, payload: bytes) -> None:
        if len(payload) < _ID.size:
            return
        fut = self._waiting.get(_ID.unpack_from(payload)[0])
        if fut is not None and not fut.done():
            fut.set_result(payload[_ID.size:])

    def close(self) -> None:
        for fut in self._waiting.values():
            if not fut.done():
                fut.set_exception(OSError("worker stopping"))


class ForwardedLog(QueryLog):
    """A worker's [dns.query_log]: the entries one loop tick answered leave for the main process
    in one G frame (worker_pool.py), which adds them to its ring and file; at most LOG_PENDING
    wait, the rest are dropped and counted like the file writer's."""

    __slots__ = ("armed", "loop", "pending", "writer")

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        super().__init__(1)
        self.writer = writer
        self.loop = asyncio.get_running_loop()
        self.pending: list[LogEntry] = []
        self.armed = False

    def add(self, peer: object, listener: str, name: bytes, qtype: int, ans: wire.Answer, source: str,
            ms: float, now: float | None = None) -> None:
        if len(self.pending) >= LOG_PENDING:
            _log_dropped.inc()
            return
        self.pending.append((time.time() if now is None else now, peer, listener, name, qtype, ans.wire,
                             source, ms))
        if not self.armed:
            self.armed = True
            self.loop.call_soon(self.flush)

    def flush(self) -> None:
        self.armed = False
        if self.pending and not self.writer.is_closing():
            self.writer.write(frame(b"G", encode_log(self.pending)))
        self.pending = []

    def close(self) -> None:
        self.flush()


async def _serve(sock: socket.socket, config: Config, index: int, query_log: bool = False) -> int:
    loop = asyncio.get_running_loop()
    reader, writer = await asyncio.open_unix_connection(sock=sock)
    # The worker's pipeline: the mesh's names as the main process last pushed them, and the main
    # process as its only upstream (it fails over through as many upstreams as it has, or a
    # [[dns.route]] has: it routes the names a worker sends).
    pushed: list[NameTable] = [{}]
    parent = ParentUpstream(writer, config.limits.dns_max_inflight, upstream_spans(config))
    pipeline = Pipeline(config, names=lambda: pushed[0], upstreams=[parent])
    if query_log:  # [dns.query_log] on in the main process: its log gets this process's entries
        pipeline.query_log = ForwardedLog(writer)
    svc = DnsService(config, pipeline, worker=True)
    try:
        await svc.start()
    except (StartupError, OSError) as e:
        writer.write(frame(b"E", f"dns worker {index}: {e}".encode()))
        await writer.drain()
        return 2
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    writer.write(frame(b"R", json.dumps({"pid": os.getpid(), "urls": svc.urls}).encode()))

    async def control() -> None:
        while True:
            got = await read_frame(reader)
            if got is None or got[0] == b"S":
                break  # EOF: the main process is gone
            if got[0] == b"A":
                parent.answered(got[1])
            elif got[0] == b"N":
                pushed[0] = decode_names(got[1])
                pipeline.names_changed()
            elif got[0] == b"L":  # a reload's dns.records and [dns.blocklist] (trusted: our parent)
                records, blocklist = pickle.loads(got[1])
                pipeline.set_records(records)
                pipeline.set_blocklist(blocklist)
        stop.set()

    tasks = [loop.create_task(control()), loop.create_task(report_counters(writer))]
    await stop.wait()
    await svc.stop()
    for t in tasks:
        t.cancel()
    await final_report(writer)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    sock = socket.socket(fileno=int(argv[0]))
    setup = read_setup(sock)
    if setup is None:
        return 1
    config: Config = setup["config"]
    logs.setup(config.log_level)
    loop = new_loop(setup["loop"])
    try:
        return loop.run_until_complete(_serve(sock, config, int(setup["index"]),
                                              bool(setup.get("query_log", False))))
    finally:
        loop.close()


if __name__ == "__main__":
    sys.exit(main())
