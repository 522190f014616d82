"""DNS worker processes: `[dns] workers = N` answers the udp/tcp/dot/doh listeners from N processes.

The node's own process binds every listener with SO_REUSEPORT and starts N-1
workers (`python -m meshgate.dns.worker FD`) that bind the same addresses, so
the kernel spreads queries (UDP by source address, TCP/TLS by connection) over
the processes. Each worker runs the same resolver pipeline on its own event
loop, with its own cache and upstream connections. The kinds shared are the
ones whose listener class says `shared` (meshgate/dns/listeners.py); DoQ and
ODoH listeners stay in the main process.

This module is the main process's side (WorkerPool) and the frames both sides
speak; the worker process's side is meshgate/dns/worker.py.

One control socket (a socketpair; its fd number is the only argument, so the
config and the network secret never appear on a command line) carries frames
of `length(4) kind(1) payload`:

    main -> worker   C  setup (pickle: config, index, loop kind, parent pid), first frame only
                     N  mesh name table (JSON {name: [ipv4|null, ipv6|null]})
                     S  stop
                     A  upstream answer (u32 id, then the response; nothing after the id = failed)
    worker -> main   R  ready (JSON {"pid", "urls"})    E  could not start (text)
                     M  counters (JSON [[name, help, labelnames, labels, value], ...])
                     Q  upstream query (u32 id, then the query)
                     G  query log entries, with [dns.query_log] on (JSON [[unix time, client
                        host, port, listener, name hex, qtype, answer hex, source, ms], ...])

Upstream queries (cache misses) go through the main process: it is the one
with the mesh (upstreams at other nodes' addresses are reached over mesh
streams), and its cache and pooled upstream connections serve every worker,
so a worker answers exactly what the node itself would.

Query log: a worker's pipeline logs into a `ForwardedLog` (worker.py), which sends what one loop
tick answered in one G frame (at most LOG_PENDING entries wait; beyond, they are dropped and
counted like the file writer's drops); the main process adds them to its own log with their
times, so its ring and its file hold every process's questions and one process writes the file.

Counts: a worker reports its counters every REPORT_INTERVAL seconds and when it
stops; the main process adds the increase since the last report to the same
metric families, so /metrics, `meshgate stats` and the listener snapshots in
/status show totals over all processes (what a worker counted since its last
report is lost if it crashes). A worker dies with the main process
(PR_SET_PDEATHSIG, and EOF on the control socket); one that exits unexpectedly
is restarted after a backoff that doubles up to workerproc.RESTART_BACKOFF_MAX.
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import json
import logging
import os
import pickle
import socket
import struct
from collections.abc import Awaitable, Callable
from typing import Any

from meshgate.config import Config, DnsConfig, DnsListenerConfig, DnsQueryLogConfig, MeshConfig, Socks5Config
from meshgate.dns import wire
from meshgate.dns.querylog import QueryLog
from meshgate.dns.resolver import Names, NameTable, Pipeline
from meshgate.errors import StartupError
from meshgate.metrics import REGISTRY
from meshgate.workerproc import (
    READY_TIMEOUT,
    REPORT_INTERVAL,
    STOP_TIMEOUT,
    CounterMerge,
    WorkerSlot,
    after_exit,
    common_frame,
    frame,
    read_frame,
    spawn,
    stop_workers,
)

log = logging.getLogger("meshgate.dns.worker")

_ID = struct.Struct("!I")
LOG_PENDING = 10000  # query log entries a worker holds for its next G frame

_worker_queries = REGISTRY.counter(
    "meshgate_dns_worker_queries_total", "DNS queries received by each worker process (1..N-1)", ("worker",)
)
_worker_restarts = REGISTRY.counter(
    "meshgate_dns_worker_restarts_total", "DNS worker processes restarted after an unexpected exit",
    ("worker",),
)
_parent_refused = REGISTRY.counter(
    "meshgate_dns_worker_upstream_refused_total",
    "Upstream queries from workers not taken: limits.dns_max_inflight already in flight",
)
_QUERIES = "meshgate_dns_queries_total"


# --------------------------------------------------------------------------- control frames


def encode_names(table: NameTable) -> bytes:
    return json.dumps({k: [str(v4) if v4 else None, str(v6) if v6 else None]
                       for k, (v4, v6) in table.items()}, sort_keys=True).encode()


def decode_names(payload: bytes) -> NameTable:
    raw = json.loads(payload)
    return {str(k): (ipaddress.IPv4Address(v4) if v4 else None, ipaddress.IPv6Address(v6) if v6 else None)
            for k, (v4, v6) in raw.items()}


# a worker's query log entry: time, peer, listener, wire name, qtype, answer wire, source, ms
LogEntry = tuple[float, Any, str, bytes, int, bytes, str, float]


def encode_log(entries: list[LogEntry]) -> bytes:
    rows = []
    for t, peer, listener, name, qtype, answer, source, ms in entries:
        host, port = (str(peer[0]), int(peer[1])) if isinstance(peer, tuple) and len(peer) >= 2 else ("", 0)
        rows.append([t, host, port, listener, name.hex(), qtype, answer.hex(), source, ms])
    return json.dumps(rows).encode()


def decode_log(payload: bytes) -> list[LogEntry]:
    out: list[LogEntry] = []
    for t, host, port, listener, name, qtype, answer, source, ms in json.loads(payload):
        out.append((float(t), (str(host), int(port)) if host else None, str(listener), bytes.fromhex(name),
                    int(qtype), bytes.fromhex(answer), str(source), float(ms)))
    return out


def counter_merge(index: int) -> CounterMerge:
    """A DNS worker's counter merge: its queries also counted per listener and per worker."""
    return CounterMerge(index, _QUERIES, _worker_queries.labels(str(index)).inc)


# --------------------------------------------------------------------------- main process side


def worker_config(config: Config, listeners: list[DnsListenerConfig]) -> Config:
    """What a worker needs: the DNS settings with the listeners it shares (bound ports, cert paths
    filled in) and the node's name for the zone; no mesh, network secret or SOCKS users."""
    node = dataclasses.replace(config.node, secret="")
    # No [dns.query_log] of their own in workers: they forward their entries (G frames) to the
    # main process's log, which holds the ring and writes the file
    dns = dataclasses.replace(config.dns, listeners=tuple(listeners), workers=1,
                              query_log=DnsQueryLogConfig())
    return dataclasses.replace(config, node=node, mesh=MeshConfig(), socks5=Socks5Config(), dns=dns)


_Worker = WorkerSlot


class WorkerPool:
    """The N-1 extra processes of a DNS service: started, fed name tables, restarted, stopped."""

    def __init__(self, config: Config, count: int, names: Names,
                 changed: Callable[[], None] | None = None,
                 answer: Callable[[bytes], Awaitable[bytes]] | None = None,
                 query_log: QueryLog | None = None) -> None:
        self.config = config
        self.query_log = query_log  # the main process's: the workers' entries go into it too
        self.names = names
        self.changed = changed  # the main process's own pipeline forgets memoised names too
        self.answer = answer  # a worker's upstream query -> the response (b"" = failed)
        self._asks: set[asyncio.Task[None]] = set()
        self.workers = [_Worker(i, counter_merge(i)) for i in range(1, count)]
        self.stopping = False
        self.started = False  # every worker reported ready once; from then on exits mean restarts
        self._names_payload = b""
        self._names: NameTable = {}
        self._loop_kind = "asyncio"
        self._watch: asyncio.Task[None] | None = None

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        # Workers run the loop the main process runs (uvloop unless `--loop asyncio`).
        self._loop_kind = "uvloop" if type(loop).__module__.startswith("uvloop") else "asyncio"
        self._names = self.names()
        self._names_payload = encode_names(self._names)
        for w in self.workers:
            await self._spawn(w)
        pending = [w.ready for w in self.workers if w.ready is not None]
        try:
            async with asyncio.timeout(READY_TIMEOUT):
                await asyncio.gather(*pending)
        except TimeoutError:
            raise StartupError(f"dns.workers: a worker did not start within {READY_TIMEOUT:.0f}s") from None
        self.started = True
        self._watch = loop.create_task(self._watch_names())

    async def _spawn(self, w: _Worker) -> None:
        loop = asyncio.get_running_loop()
        parent, child = socket.socketpair()
        w.proc = await spawn("meshgate.dns.worker", [child])
        reader, writer = await asyncio.open_unix_connection(sock=parent)
        w.writer = writer
        w.started_at = loop.time()
        w.ready = loop.create_future() if not self.started else None
        w.merge.restarted()
        setup = {"config": self.config, "index": w.index, "loop": self._loop_kind, "parent": os.getpid(),
                 "query_log": self.query_log is not None}
        writer.write(frame(b"C", pickle.dumps(setup)))
        writer.write(frame(b"N", self._names_payload))
        w.task = loop.create_task(self._run(w, reader))

    async def _run(self, w: _Worker, reader: asyncio.StreamReader) -> None:
        while True:
            got = await read_frame(reader)
            if got is None:
                break
            kind, payload = got
            if common_frame(w, kind, payload):
                continue
            if kind == b"Q":
                self._ask(w, payload)
            elif kind == b"G":
                self._logged(w, payload)
        if w.writer is not None:
            w.writer.close()
            w.writer = None
        await after_exit(w, "dns", self.started, lambda: self.stopping, self._respawn)

    async def _respawn(self, w: _Worker) -> None:
        _worker_restarts.labels(str(w.index)).inc()
        await self._spawn(w)

    def _logged(self, w: _Worker, payload: bytes) -> None:
        """A worker's query log entries into this process's log (their own times kept)."""
        qlog = self.query_log
        if qlog is None:
            return
        try:
            entries = decode_log(payload)
        except (ValueError, TypeError) as e:  # our own child wrote it: a bug, not an attack
            log.warning("dns worker %d: bad query log frame: %r", w.index, e)
            return
        for t, peer, listener, name, qtype, answer, source, ms in entries:
            ans = wire.Answer(answer, (), (), 0, answer[3] & 0xF if len(answer) >= 4 else 0)
            qlog.add(peer, listener, name, qtype, ans, source, ms, now=t)

    def _ask(self, w: _Worker, payload: bytes) -> None:
        if self.answer is None or len(payload) < _ID.size:
            return
        if len(self._asks) >= self.config.limits.dns_max_inflight:
            _parent_refused.inc()  # the worker's exchange times out and it answers SERVFAIL
            return
        task = asyncio.get_running_loop().create_task(self._reply(w, payload))
        self._asks.add(task)
        task.add_done_callback(self._asks.discard)

    async def _reply(self, w: _Worker, payload: bytes) -> None:
        assert self.answer is not None
        try:
            resp = await self.answer(payload[_ID.size:])
        except Exception as e:  # never let one query take down the control channel
            log.debug("dns worker %d: upstream query failed: %r", w.index, e)
            resp = b""
        if w.writer is not None and not w.writer.is_closing():
            w.writer.write(frame(b"A", payload[:_ID.size] + resp))

    async def _watch_names(self) -> None:
        # The mesh has no change callback for names: compare the table every REPORT_INTERVAL
        # (cheap: one dict build) and push only a change.
        while not self.stopping:
            await asyncio.sleep(REPORT_INTERVAL / 4)
            self.push_names(self.names())

    def push_names(self, table: NameTable) -> None:
        if table == self._names:
            return  # compared as dicts: encoding a large table four times a second would cost more
        self._names = table
        payload = self._names_payload = encode_names(table)
        if self.changed is not None:
            self.changed()
        for w in self.workers:
            if w.writer is not None and not w.writer.is_closing():
                w.writer.write(frame(b"N", payload))

    def push_local(self, dns: DnsConfig) -> None:
        """A reload's `dns.records` and `[dns.blocklist]`: every worker swaps them into its
        pipeline (each reads the lists itself) and a worker started later gets them too."""
        local = dataclasses.replace(self.config.dns, records=dns.records, blocklist=dns.blocklist)
        self.config = dataclasses.replace(self.config, dns=local)
        payload = pickle.dumps((dns.records, dns.blocklist))
        for w in self.workers:
            if w.writer is not None and not w.writer.is_closing():
                w.writer.write(frame(b"L", payload))

    async def stop(self) -> None:
        self.stopping = True
        if self._watch is not None:
            self._watch.cancel()
        for t in list(self._asks):
            t.cancel()
        await stop_workers(self.workers, "dns", STOP_TIMEOUT)

    def pids(self) -> list[int]:
        return [w.proc.pid for w in self.workers if w.proc is not None and w.proc.returncode is None]

    def status(self) -> dict[str, Any]:
        return {str(w.index): {"pid": w.proc.pid if w.proc else None, "queries": w.merge.queries,
                               "restarts": w.restarts} for w in self.workers}


async def answer_for_worker(pipeline: Pipeline, data: bytes) -> bytes:
    """The main process's answer to a worker's upstream query: its own pipeline (local
    names, shared cache, then its upstreams, coalesced), packed under the worker's ID."""
    q = wire.parse_query(data)
    now = asyncio.get_running_loop().time()
    ans = pipeline.lookup(q, now) or await pipeline.resolve(q)
    if ans is None:
        return b""  # too many queries in flight: the worker fails over like on a timeout
    buf = pipeline.buffer(wire.packed_size(ans, q, False))
    wire.pack_answer(buf, ans, q, asyncio.get_running_loop().time())
    out = bytes(buf.view())
    buf.recycle()
    return out
