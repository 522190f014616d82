"""DNS benchmark: meshgate beside unbound and dnsdist, and pooled vs unpooled answer packing.

Tables (bench/common.py runner: alternating rounds, medians):

1. dns-alloc (in process, no sockets): N DoH GET requests for a name with five
   A records (a cache hit) through the real HTTP/2 server protocol
   (h2server.H2ServerProtocol + DohApp + pipeline + packing) with a fake
   transport; dns-pack: the packing step alone (parse, cache hit, pack,
   release). Variants: `unpooled` (the baseline: `Pipeline(pooled=False)`, the
   pipeline's own switch, which packs every answer into a fresh one-off
   Buffer) and `pooled` (BufferPool, recycled once h2wire has joined the
   answer into its frames). Both arms are measured the same way, each pass on
   a fresh pipeline (`measure_queries`): wall and CPU microseconds per query
   and gc collections per million queries (untraced); tracemalloc bytes per
   query (the traced peak while one query runs, above the level before it:
   median and p99 over the queries) and bytes and blocks still held after the
   run; and Buffer objects constructed per query with their bytes (counted by
   wrapping Buffer.__init__ in a pass of its own). After the tables one line
   per table says what pooling saves: medians over rounds of the paired
   difference unpooled - pooled, and of pooled/unpooled for time and CPU.
   The seed's own measure is one million queries: `--alloc-queries 1000000`
   (slow: minutes per round).

2. dns-load (loopback): queries/s, lost queries, latency p50/p99 (dnsperf -v,
   client-observed) or mean (h2load), the server's CPU microseconds per
   query (from /proc, summed over the server's processes and threads) and its
   peak RSS (VmHWM summed over its processes) for: UDP (dnsperf -m udp, 16
   sockets), DoH GET and POST (h2load, 8 connections x 8 streams; `h1`: the
   same GET over HTTP/1.1, h2load --h1, 8 connections x 8 pipelined), DoH over
   HTTP/3 GET (meshgate's `doh3` listener on the DoH port number over UDP;
   this h2load has no QUIC, so the client is bench/h3load.py, aioquic's h3 in
   a process of its own, 4 connections x 16 streams: a Python client, likely
   the limit of the q/s it reports; the server's CPU per query is the figure
   to compare; unbound 1.17 and dnsdist 1.7 serve no HTTP/3), DoQ (`doq
   dnspython`: bench/doqload.py, dnspython's DoQ client in a process of its
   own, 4 connections x 16 queries in flight; a client not written here, and
   Python: the q/s it reports is its own limit, so the row also gives the
   client's CPU per query; unbound 1.17 and dnsdist 1.7 serve no DoQ), DoH with
   dnsperf -m doh; against meshgate (`meshgate`: one process, uvloop;
   `meshgate-wN`: `dns.workers = N`, the node and N-1 worker processes sharing
   the listeners with SO_REUSEPORT; `--workers` picks the counts), unbound and
   dnsdist with as many threads as those meshgate rows have processes
   (`unbound`, `dnsdist`: one; `unbound-tN`, `dnsdist-tN`: N; the `threads`
   column says how many answer), all answering `www.test A` from memory
   (meshgate: its cache, filled from the one-thread unbound as the loopback
   upstream). Cache misses: meshgate with a fresh name per query (UDP and DoH
   GET), each resolved through unbound on loopback (`--upstream tcp`: over
   meshgate's pooled, pipelined TCP upstream connections instead of UDP).
   Peer configs: bench/peers/unbound.conf.in, bench/peers/dnsdist.conf.in.
   `--rate-limit` adds `meshgate-rl`: the per-client rate limit on its udp and
   doh listeners at a rate no row reaches, so the row beside `meshgate` shows
   what the check costs per query.

3. dns-blocklist-memory: a generated list of `--blocklist-size` (default one
   million) plain domains loaded into dns/blocklist.py's table in a fresh
   process: RSS after minus before, the VmHWM growth while parsing, CPU to
   load (`--ab REF`: the same for meshgate as of REF beside it). blocky's
   published figure for its own lists is ~100 MB for 1.4 million domains.
   dns-blocklist-cost: cache hits through Frontend.query (what the udp
   listener calls) over 1000 cached names on the loop's real clock, with that
   list vs none (`cold`: the one-second memo of blocklist decisions cleared
   before every query, so each pays the decision). dns-query-log: the same
   queries with [dns.query_log] off, the ring only, the ring and a file
   (queue big enough for every line; the writer thread's CPU is counted: the
   run waits for it), anonymized, and with a queue of 1000 (dropped/q: what
   a writer that falls behind a flood loses instead of slowing answers). `--skip-lists`
   leaves these out; `--skip-alloc --skip-load` runs only these.

Nothing leaves 127.0.0.1: peers answer `*.test` locally; load is bounded in
count and time.

    .venv/bin/python bench/dns.py [--rounds 3] [--alloc-queries N] [--seconds S] [--json FILE]

A/B of a change on real sockets: `--ab REF` also runs meshgate as of git REF
(`meshgate@REF`, from a `git archive` of meshgate/) beside the working tree,
in the same alternating rounds; `--only meshgate,meshgate@REF --rows GET,POST`
narrows the table to the DoH rows of the two.
"""

from __future__ import annotations

import argparse
import array
import asyncio
import base64
import contextlib
import gc
import inspect
import json
import random
import re
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# This file is bench/dns.py: with bench/ on sys.path, `import dns` would import this script
# instead of dnspython. Run from the repository root instead.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

import dns.message  # noqa: E402
import dns.rrset  # noqa: E402
import h2.config  # noqa: E402
import h2.connection  # noqa: E402

from bench.common import (  # noqa: E402
    PEERS,
    Metrics,
    Peer,
    Runner,
    add_args,
    autogroup,
    fmt,
    free_port,
    git_tree,
    report,
    selected,
)
from meshgate.buffers import Buffer  # noqa: E402
from meshgate.config import from_dict  # noqa: E402
from meshgate.dns import wire  # noqa: E402
from meshgate.dns.doh import DohApp  # noqa: E402
from meshgate.dns.h2server import H2ServerProtocol  # noqa: E402
from meshgate.dns.resolver import Pipeline  # noqa: E402
from meshgate.dns.stats import ListenerStats  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
HIT_NAME = "www.test"

# --------------------------------------------------------------------------- 1. in-process allocation A/B


class _NullTransport:
    """Counts what the server writes; keeps nothing (so held memory is the server's own)."""

    def __init__(self) -> None:
        self.bytes = 0
        self.last = b""

    def write(self, data: bytes) -> None:
        self.bytes += len(data)
        self.last = data

    def writelines(self, chunks: list[bytes]) -> None:
        for data in chunks:
            self.write(data)

    def is_closing(self) -> bool:
        return False

    def get_extra_info(self, key: str, default: Any = None) -> Any:
        return ("127.0.0.1", 50000) if key == "peername" else default

    def close(self) -> None:
        pass

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def _five_a_pipeline(pooled: bool, now: float = 0.0) -> Pipeline:
    """A pipeline whose cache holds five.bench A (TTL 3600 from `now`: the server path asks the
    cache at the loop's clock, which is past 3600 on a machine up for more than an hour)."""
    cfg = from_dict({"node": {"name": "bench"}, "limits": {"dns_tcp_idle_timeout": 3600.0}})
    if "names" in inspect.signature(Pipeline).parameters:  # Pipeline(config, *, names, ...)
        p = Pipeline(cfg, upstreams=[], pooled=pooled)
    else:  # before the node contract: Pipeline(config, node, ...)
        p = Pipeline(cfg, types.SimpleNamespace(config=cfg, mesh=None), upstreams=[], pooled=pooled)
    q = dns.message.make_query("five.bench.", "A")
    r = dns.message.make_response(q)
    five = [f"192.0.2.{i}" for i in range(1, 6)]
    r.answer.append(dns.rrset.from_text("five.bench.", 3600, "IN", "A", *five))
    key = (wire.encode_name("five.bench"), 1, 1)
    p.cache.put(key, wire.parse_response(r.to_wire(), q.id, key, now))
    p.cache.get(key, now)
    return p


def _client_bytes(n: int) -> list[bytes]:
    """The bytes an h2 client sends for n GETs (with connection window updates), one chunk per request."""
    q = dns.message.make_query("five.bench.", "A")
    q.id = 0
    path = "/dns-query?dns=" + base64.urlsafe_b64encode(q.to_wire()).decode().rstrip("=")
    headers = [(":method", "GET"), (":path", path), (":scheme", "https"), (":authority", "localhost"),
               ("accept", "application/dns-message")]
    c = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
    c.initiate_connection()
    chunks = [c.data_to_send()]
    for i in range(n):
        sid = c.get_next_available_stream_id()
        c.send_headers(sid, headers, end_stream=True)
        if i % 500 == 0:
            c.increment_flow_control_window(1 << 20)  # what a client's acks amount to
        chunks.append(c.data_to_send())
    return chunks


Tick = Callable[[], None] | None
Serve = Callable[[Tick], None]


@contextlib.contextmanager
def _count_buffers() -> Iterator[list[int]]:
    """Count every `Buffer` constructed while inside (a pool miss and a one-off answer buffer
    alike) and the bytes each costs (the Buffer object plus its bytearray, sys.getsizeof):
    [buffers, bytes]. The wrapper costs time, so it runs in a pass of its own."""
    counts = [0, 0]
    orig = Buffer.__init__

    def counting_init(self: Buffer, capacity: int, headroom: int, pool: Any = None) -> None:
        orig(self, capacity, headroom, pool)
        counts[0] += 1
        counts[1] += sys.getsizeof(self) + sys.getsizeof(self.data)

    Buffer.__init__ = counting_init  # type: ignore[method-assign]
    try:
        yield counts
    finally:
        Buffer.__init__ = orig  # type: ignore[method-assign]


def measure_queries(setup: Callable[[], Serve], n: int) -> Metrics:
    """Three passes over `n` queries, each on a fresh `setup()` (a new pipeline, so the pooled
    arm starts with an empty pool every time and pays for filling it):

    1. untraced: wall and CPU microseconds per query, gc collections per million queries;
    2. tracemalloc: for every query, the traced peak while it ran above the traced memory just
       before it (what one query allocates at once, freed or not: an unpooled answer buffer
       shows here), median and 99th percentile over the queries; and what the whole run left
       held afterwards (snapshot diff), in bytes and blocks per query;
    3. counting: Buffer objects constructed per query and their bytes (`_count_buffers`).

    `setup()` returns `serve(tick)`, which answers the n queries and calls `tick()` (if given)
    before the first query and after each one.
    """
    serve = setup()
    gc.collect()
    gc0 = sum(s["collections"] for s in gc.get_stats())
    cpu0, t0 = time.process_time(), time.perf_counter()
    serve(None)
    wall = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    collections = sum(s["collections"] for s in gc.get_stats()) - gc0
    out: Metrics = {"q/s": n / wall, "us/q": wall / n * 1e6, "cpu_us/q": cpu / n * 1e6,
                    "gc/1Mq": collections / n * 1e6}

    serve = setup()
    peaks = array.array("q", bytes(8 * (n + 1)))  # preallocated: no list growth inside a query
    state = [0, -1]  # [traced bytes at the last tick, queries seen]

    def tick() -> None:
        cur, peak = tracemalloc.get_traced_memory()
        if state[1] >= 0:
            peaks[state[1]] = peak - state[0]
        state[0], state[1] = cur, state[1] + 1
        tracemalloc.reset_peak()

    gc.collect()
    tracemalloc.start()
    snap0 = tracemalloc.take_snapshot()
    serve(tick)
    snap1 = tracemalloc.take_snapshot()
    tracemalloc.stop()
    assert state[1] == n, f"{state[1]} ticks for {n} queries"
    per_query = sorted(peaks[:n])
    diff = snap1.compare_to(snap0, "filename")
    out["peak_B/q"] = float(statistics.median(per_query))
    out["peak_B/q p99"] = float(per_query[int(n * 0.99)])
    out["held_B/q"] = sum(s.size_diff for s in diff if s.size_diff > 0) / n
    out["held_blocks/q"] = sum(s.count_diff for s in diff if s.count_diff > 0) / n

    serve = setup()
    with _count_buffers() as counted:
        serve(None)
    out["buffers/q"] = counted[0] / n
    out["buffer_B/q"] = counted[1] / n
    return out


def alloc_variant(pooled: bool, n: int, chunks: list[bytes]) -> Metrics:
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(_alloc_variant(pooled, n, chunks))
    finally:
        loop.close()


async def _alloc_variant(pooled: bool, n: int, chunks: list[bytes]) -> Metrics:
    # Everything runs synchronously inside one coroutine: cache hits never await, and the server
    # writes the answers to one read before data_received returns.
    now = asyncio.get_running_loop().time()

    def setup() -> Serve:
        pipeline = _five_a_pipeline(pooled, now)
        stats = ListenerStats(f"bench-{'pooled' if pooled else 'unpooled'}")
        app = DohApp(pipeline, stats, "/dns-query")
        limits = pipeline.config.limits

        def serve(tick: Tick) -> None:
            srv = H2ServerProtocol(app, stats, limits, set())
            t = _NullTransport()
            srv.max_streams = n + 1
            srv.connection_made(t)  # type: ignore[arg-type]
            srv.data_received(chunks[0])  # the client's preface and settings
            if tick:
                tick()
            for chunk in chunks[1:]:  # one GET each
                srv.data_received(chunk)
                if tick:
                    tick()
            if srv.timer is not None:
                srv.timer.cancel()
            srv.connection_lost(None)
            answered = stats.snapshot()["responses"]
            assert isinstance(answered, dict) and answered.get("NOERROR", 0) >= n, f"unanswered: {answered}"

        return serve

    return measure_queries(setup, n)


def pack_variant(pooled: bool, n: int) -> Metrics:
    """Only the packing step (parse, cache hit, pack, release): pooling's effect undiluted by h2.
    Inside a running event loop, as every listener packs (the pool batches its reuse counter
    per loop tick)."""
    loop = asyncio.new_event_loop()

    async def run() -> Metrics:
        return _pack_variant(pooled, n)

    try:
        return loop.run_until_complete(run())
    finally:
        loop.close()


def _pack_variant(pooled: bool, n: int) -> Metrics:
    q = dns.message.make_query("five.bench.", "A")
    q.id = 0
    data = q.to_wire()

    def setup() -> Serve:
        pipeline = _five_a_pipeline(pooled)

        def serve(tick: Tick) -> None:
            if tick:
                tick()
            for _ in range(n):
                query = wire.parse_query(data)
                ans = pipeline.lookup(query, 1.0)
                assert ans is not None
                buf = pipeline.buffer(wire.packed_size(ans, query, False))
                wire.pack_answer(buf, ans, query, 1.0)
                buf.recycle()  # what a copying writer (h2wire's frame join, sendto) allows
                if tick:
                    tick()

        return serve

    return measure_queries(setup, n)


SAVED = ("peak_B/q", "buffers/q", "buffer_B/q", "held_B/q", "held_blocks/q", "gc/1Mq")
RATIO = ("us/q", "cpu_us/q")


def pooling_saves(r: Runner) -> str:
    """What pooling saves per query, from the rounds just run: medians over rounds of the paired
    difference unpooled - pooled (same round), and of the paired ratio pooled/unpooled."""
    base, cand = r.results.get("unpooled", []), r.results.get("pooled", [])
    pairs = list(zip(base, cand, strict=False))
    if not pairs:
        return f"{r.title.split(' ')[0]}: no pair of rounds ran, nothing to compare"
    parts = []
    for k in SAVED:
        d = statistics.median(b[k] - c[k] for b, c in pairs)
        parts.append(f"{k} {fmt(d)}")
    for k in RATIO:
        ratios = [c[k] / b[k] for b, c in pairs if b[k]]
        parts.append(f"{k} pooled/unpooled {fmt(statistics.median(ratios))}" if ratios
                     else f"{k} pooled/unpooled n/a (unpooled 0)")
    return (f"{r.title.split(' ')[0]}: pooling saves per query (median of {len(pairs)} paired rounds, "
            f"unpooled - pooled): " + ", ".join(parts))


def scaling(r: Runner) -> str:
    """N processes/threads against one, per protocol row: medians over rounds of the paired
    ratios (same round) of q/s and of CPU per query, e.g. meshgate-w2 / meshgate."""
    lines = ["dns-load: N processes (meshgate-wN) or threads (unbound-tN, dnsdist-tN) against one, "
             "medians of paired ratios:"]
    for label, rows in r.results.items():
        server, _, proto = label.partition(" ")
        m = re.fullmatch(r"(.+)-[wt](\d+)", server)
        if m is None or f"{m.group(1)} {proto}" not in r.results:
            continue
        pairs = list(zip(rows, r.results[f"{m.group(1)} {proto}"], strict=False))
        q = [a["qps"] / b["qps"] for a, b in pairs if b["qps"]]
        c = [a["cpu_us/q"] / b["cpu_us/q"] for a, b in pairs if b["cpu_us/q"]]
        if q and c:
            lines.append(f"  {server}/{m.group(1)} {proto}: q/s {fmt(statistics.median(q))}x "
                         f"(rounds {fmt(min(q))}-{fmt(max(q))}), CPU/q {fmt(statistics.median(c))}x")
    return "\n".join(lines) if len(lines) > 1 else "dns-load: no N-against-one pairs ran"


def against(r: Runner, ab_ref: str | None) -> str:
    """Each meshgate row against meshgate as of --ab REF and against the peers with as many
    threads as it has processes, per protocol row: medians over rounds of the paired ratios
    (same round) of CPU per query and of q/s, e.g. meshgate/dnsdist, meshgate-w2/dnsdist-t2."""
    lines = ["dns-load: meshgate against the tree before (--ab) and the peers with equal thread counts, "
             "medians of paired ratios:"]
    for label, rows in r.results.items():
        server, _, proto = label.partition(" ")
        m = re.fullmatch(r"meshgate(-w(\d+))?", server)
        if m is None:
            continue
        n = int(m.group(2) or 1)
        suffix = "" if n == 1 else f"-t{n}"
        others = [f"meshgate@{ab_ref}{m.group(1) or ''}"] if ab_ref else []
        others += [f"dnsdist{suffix}", f"unbound{suffix}"]
        for other in others:
            pairs = list(zip(rows, r.results.get(f"{other} {proto}", []), strict=False))
            c = [a["cpu_us/q"] / b["cpu_us/q"] for a, b in pairs if b["cpu_us/q"]]
            q = [a["qps"] / b["qps"] for a, b in pairs if b["qps"]]
            if c and q:
                lines.append(f"  {server}/{other} {proto}: CPU/q {fmt(statistics.median(c))}x "
                             f"(rounds {fmt(min(c))}-{fmt(max(c))}), q/s {fmt(statistics.median(q))}x "
                             f"(rounds {fmt(min(q))}-{fmt(max(q))})")
    return "\n".join(lines) if len(lines) > 1 else "dns-load: no meshgate row had a partner"


# --------------------------------------------------------------------------- 2. load against peers


def _cert(tmp: Path) -> tuple[Path, Path]:
    cert, key = tmp / "cert.pem", tmp / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
                    "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "30",
                    "-subj", "/CN=localhost"], check=True, capture_output=True)
    return cert, key


def _fill(template: Path, out: Path, **values: str) -> Path:
    text = template.read_text()
    for k, v in values.items():
        text = text.replace(f"@{k}@", v)
    out.write_text(text)
    return out


class Server:
    """One server under load; `threads` is how many processes (meshgate) or threads (peers)
    answer its listeners."""

    def __init__(self, name: str, peer: Peer, udp: int, doh: int, threads: int = 1, h3: int = 0,
                 doq: int = 0) -> None:
        self.name, self.peer, self.udp, self.doh, self.threads = name, peer, udp, doh, threads
        self.h3 = h3  # DoH over HTTP/3 on this UDP port (0: none)
        self.doq = doq  # DoQ on this UDP port (0: none)


def _start_unbound(tmp: Path, name: str, threads: int, cert: Path, key: Path) -> Server:
    udp, doh = free_port(), free_port()
    work = tmp / name
    work.mkdir()
    conf = _fill(PEERS / "unbound.conf.in", work / "unbound.conf", UDP_PORT=str(udp),
                 DOH_PORT=str(doh), CERT=str(cert), KEY=str(key), DIR=str(work), THREADS=str(threads))
    peer = Peer(name, ["unbound", "-d", "-c", str(conf)], port=doh).start()
    return Server(name, peer, udp, doh, threads)


def _start_dnsdist(tmp: Path, name: str, threads: int, cert: Path, key: Path) -> Server:
    udp, doh = free_port(), free_port()
    conf = _fill(PEERS / "dnsdist.conf.in", tmp / f"{name}.conf", UDP_PORT=str(udp),
                 DOH_PORT=str(doh), CERT=str(cert), KEY=str(key), THREADS=str(threads))
    argv = ["dnsdist", "--supervised", "--disable-syslog", "-C", str(conf)]
    return Server(name, Peer(name, argv, port=doh).start(), udp, doh, threads)


def start_servers(tmp: Path, wanted: set[str], ab_ref: str | None = None,
                  upstream_scheme: str = "udp", workers: tuple[int, ...] = (1,),
                  keep: Callable[[str], bool] = lambda name: True, rate_limit: bool = False
                  ) -> dict[str, Server]:
    """The servers under load; `keep(name)` False leaves one unstarted (`--only`), except the
    one-thread unbound, which is meshgate's upstream."""
    cert, key = _cert(tmp)
    servers: dict[str, Server] = {}
    # unbound (one thread) is also meshgate's loopback upstream, so it always runs. The peers get
    # as many threads as meshgate has processes in the rows they are compared with: for every
    # dns.workers value N, `unbound-tN` and `dnsdist-tN` (N = 1: plain `unbound`, `dnsdist`).
    servers["unbound"] = _start_unbound(tmp, "unbound", 1, cert, key)
    u_udp = servers["unbound"].udp
    for n in workers:
        if n != 1 and keep(f"unbound-t{n}"):
            servers[f"unbound-t{n}"] = _start_unbound(tmp, f"unbound-t{n}", n, cert, key)
    if "dnsdist" in wanted and shutil.which("dnsdist"):
        for n in workers:
            name = "dnsdist" if n == 1 else f"dnsdist-t{n}"
            if keep(name):
                servers[name] = _start_dnsdist(tmp, name, n, cert, key)
    trees = [("meshgate", ROOT)]
    if ab_ref:
        trees.append((f"meshgate@{ab_ref}", git_tree(ab_ref, str(tmp))))
    for base, cwd in trees:
        for n in workers:
            # "meshgate" is one process (as before dns.workers); "meshgate-w2" the node plus one worker.
            name = base if n == 1 else f"{base}-w{n}"
            if not keep(name):
                continue
            # unbound answers TCP on its UDP port too: tcp:// is a pooled, pipelined upstream.
            servers[name] = _start_meshgate(tmp, name, cwd, f"{upstream_scheme}://127.0.0.1:{u_udp}", cert,
                                            key, n)
    if rate_limit and keep("meshgate-rl"):
        # The per-client rate limit on every listener, at a rate no row reaches: what its check
        # costs per query.
        servers["meshgate-rl"] = _start_meshgate(tmp, "meshgate-rl", ROOT, f"{upstream_scheme}://127.0.0.1:{u_udp}",
                                                 cert, key, 1, rate_limit=True)
    return servers


def _start_meshgate(tmp: Path, name: str, cwd: Path, upstream: str, cert: Path, key: Path,
                    workers: int = 1, rate_limit: bool = False) -> Server:
    m_udp, m_doh, m_doq = free_port(), free_port(), free_port()
    # DoH over HTTP/3 on the DoH port number over UDP (the working tree only: an --ab REF from
    # before the doh3 kind would refuse the config).
    h3 = m_doh if cwd == ROOT else 0
    doh3 = (f'[[dns.listener]]\nprotocol = "doh3"\nlisten = "127.0.0.1:{m_doh}"\n'
            f'cert = "{cert}"\nkey = "{key}"')
    rl = "rate_limit = true" if rate_limit else ""
    rl_limits = "dns_client_qps = 1e9\ndns_client_burst = 1000000000" if rate_limit else ""
    tag = name.replace("@", "-").replace("/", "_")
    cfg = tmp / f"{tag}.toml"
    cfg.write_text(f"""
[node]
name = "bench"
state_dir = "{tmp / ('state-' + tag)}"
[socks5]
enable = false
[admin]
enable = false
[dns]
upstreams = ["{upstream}"]
cache_size = 1000000
{f"workers = {workers}" if workers != 1 else ""}
[[dns.listener]]
protocol = "udp"
listen = "127.0.0.1:{m_udp}"
{rl}
[[dns.listener]]
protocol = "doh"
listen = "127.0.0.1:{m_doh}"
cert = "{cert}"
key = "{key}"
{rl}
{doh3 if h3 else ""}
[[dns.listener]]
protocol = "doq"
listen = "127.0.0.1:{m_doq}"
cert = "{cert}"
key = "{key}"
[limits]
dns_max_inflight = 100000
buffer_pool_size = 4096
{rl_limits}
""")
    argv = [sys.executable, "-m", "meshgate", "run", "-c", str(cfg)]
    # `python -m` imports meshgate from the working directory: the checkout or the git REF's tree.
    peer = Peer(name, argv, port=m_doh, cwd=str(cwd)).start()
    return Server(name, peer, m_udp, m_doh, workers, h3, m_doq)


def _query_b64(name: str) -> str:
    q = dns.message.make_query(name, "A")
    q.id = 0
    return base64.urlsafe_b64encode(q.to_wire()).decode().rstrip("=")


def _percentile(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(p / 100 * len(values)))]


def dnsperf(server: Server, mode: str, data: Path, seconds: float, extra: list[str]) -> Metrics:
    port = server.udp if mode in ("udp", "tcp") else server.doh
    cpu0, kernel0 = server.peer.cpu_seconds(), server.peer.kernel_cpu_seconds()
    out = subprocess.run(["dnsperf", "-m", mode, "-s", "127.0.0.1", "-p", str(port), "-d", str(data),
                          "-l", str(seconds), "-t", "2", "-v", *extra],
                         capture_output=True, text=True, timeout=seconds + 30).stdout
    cpu = server.peer.cpu_seconds() - cpu0
    kernel = server.peer.kernel_cpu_seconds() - kernel0
    sent = int(_grab(r"Queries sent:\s+(\d+)", out))
    done = int(_grab(r"Queries completed:\s+(\d+)", out))
    lat = [float(x) for x in re.findall(r"^> \S+ \S+ \S+ ([0-9.]+)$", out, re.M)]
    return {"threads": float(server.threads),
            "qps": float(_grab(r"Queries per second:\s+([0-9.]+)", out)), "lost": float(sent - done),
            "p50_ms": _percentile(lat, 50) * 1000, "p99_ms": _percentile(lat, 99) * 1000,
            "cpu_us/q": cpu / max(done, 1) * 1e6, "kernel_us/q": kernel / max(done, 1) * 1e6,
            "peak_rss_MiB": server.peer.peak_rss_kib() / 1024}


def h2load(server: Server, n: int, post: bool, uris: Path | None = None, body: Path | None = None,
           h1: bool = False) -> Metrics:
    base = f"https://127.0.0.1:{server.doh}/dns-query"
    # 8 connections x 8 streams: SO_REUSEPORT spreads connections, and 4 would land all on one of
    # two processes one run in eight.
    argv = ["h2load", "-n", str(n), "-c", "8", "-m", "8", "-t", "1", *(["--h1"] if h1 else [])]
    if post:
        assert body is not None
        argv += ["-d", str(body), "-H", "content-type: application/dns-message", base]
    elif uris is not None:
        argv += ["-i", str(uris)]
    else:
        argv += [f"{base}?dns={_query_b64(HIT_NAME)}"]
    cpu0 = server.peer.cpu_seconds()
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120).stdout
    cpu = server.peer.cpu_seconds() - cpu0
    ok = int(_grab(r"(\d+) succeeded", out))
    mean = re.search(r"time for request:\s+\S+\s+\S+\s+([0-9.]+)(us|ms|s)", out)
    mean_ms = float("nan")
    if mean:
        mean_ms = float(mean.group(1)) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[mean.group(2)]
    return {"threads": float(server.threads),
            "qps": float(_grab(r"finished in [0-9.]+\w+, ([0-9.]+) req/s", out)), "lost": float(n - ok),
            "mean_ms": mean_ms, "cpu_us/q": cpu / max(ok, 1) * 1e6,
            "peak_rss_MiB": server.peer.peak_rss_kib() / 1024}


def h3load(server: Server, n: int) -> Metrics:
    """DoH over HTTP/3 GET of the cache hit, from bench/h3load.py in a process of its own."""
    argv = [sys.executable, str(ROOT / "bench" / "h3load.py"), str(server.h3), str(n), "--conns", "4",
            "--streams", "16", "--path", f"/dns-query?dns={_query_b64(HIT_NAME)}"]
    cpu0 = server.peer.cpu_seconds()
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=str(ROOT))
    cpu = server.peer.cpu_seconds() - cpu0
    if out.returncode != 0:
        raise RuntimeError(f"h3load failed: {out.stderr[-600:]}")
    got = json.loads(out.stdout.strip().splitlines()[-1])
    ok = int(got["ok"])
    return {"threads": float(server.threads), "qps": ok / got["seconds"], "lost": float(n - ok),
            "mean_ms": float("nan"), "cpu_us/q": cpu / max(ok, 1) * 1e6,
            "peak_rss_MiB": server.peer.peak_rss_kib() / 1024}


def doqload(server: Server, n: int) -> Metrics:
    """DoQ queries for the cache hit from bench/doqload.py: dnspython's DoQ client (not written
    here), 4 connections x 16 queries in flight, in a process of its own."""
    argv = [sys.executable, str(ROOT / "bench" / "doqload.py"), str(server.doq), str(n), "--conns", "4",
            "--streams", "16", "--name", HIT_NAME]
    cpu0 = server.peer.cpu_seconds()
    out = subprocess.run(argv, capture_output=True, text=True, timeout=180, cwd=str(ROOT))
    cpu = server.peer.cpu_seconds() - cpu0
    if out.returncode != 0:
        raise RuntimeError(f"doqload failed: {out.stderr[-600:]}")
    got = json.loads(out.stdout.strip().splitlines()[-1])
    ok = int(got["ok"])
    return {"threads": float(server.threads), "qps": ok / got["seconds"], "lost": float(n - ok),
            "mean_ms": float("nan"), "cpu_us/q": cpu / max(ok, 1) * 1e6,
            "client_cpu_us/q": got["client_cpu_s"] / max(ok, 1) * 1e6,
            "peak_rss_MiB": server.peer.peak_rss_kib() / 1024}


def _grab(pattern: str, text: str) -> str:
    m = re.search(pattern, text)
    if m is None:
        raise RuntimeError(f"unexpected tool output (no {pattern!r}): {text[-600:]}")
    return m.group(1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(ap)
    ap.add_argument("--alloc-queries", type=int, default=20000, help="queries per in-process round")
    ap.add_argument("--seconds", type=float, default=3.0, help="dnsperf run length per round")
    ap.add_argument("--requests", type=int, default=20000, help="h2load requests per round")
    ap.add_argument("--skip-load", action="store_true", help="only the in-process A/B")
    ap.add_argument("--skip-alloc", action="store_true", help="only the load table")
    ap.add_argument("--ab", metavar="REF", help="also run meshgate as of git REF (rows meshgate@REF)")
    ap.add_argument("--rows", help="comma-separated substrings: keep only load rows containing one")
    ap.add_argument("--upstream", choices=["udp", "tcp"], default="udp",
                    help="meshgate's loopback upstream (unbound) for the MISS rows")
    ap.add_argument("--rate-limit", action="store_true",
                    help="also run meshgate-rl: the per-client rate limit on, never reached (its cost)")
    ap.add_argument("--workers", default="1,2",
                    help="comma-separated dns.workers values: 1 = row 'meshgate', N = 'meshgate-wN'")
    ap.add_argument("--skip-lists", action="store_true",
                    help="skip the blocklist (memory, cost) and query log (on vs off) sections")
    ap.add_argument("--blocklist-size", type=int, default=1_000_000, help="domains in the generated list")
    ap.add_argument("--udp-batches", action="store_true",
                    help="add dns-udp-batches: the UDP listener in process, batched vs a call per datagram")
    ap.add_argument("--autogroup", choices=["keep", "on", "off"], default="keep",
                    help="kernel.sched_autogroup_enabled for the run (root; put back after): with it on "
                         "a server's processes share one session's CPU (bench/common.py autogroup_state)")
    args = ap.parse_args()
    with autogroup(args.autogroup):
        _run(args)


def _run(args: argparse.Namespace) -> None:
    runners: list[Runner] = []

    if args.udp_batches:
        batches = Runner("dns-udp-batches (in process, five.bench A from the cache, dnsperf -c 16 -q 200)",
                         rounds=args.rounds, baseline="per-datagram")
        with tempfile.TemporaryDirectory(prefix="bench-dns-batches-") as d:
            batches.add("per-datagram", lambda: udp_batch_variant(False, args.seconds, Path(d)))
            batches.add("batched", lambda: udp_batch_variant(True, args.seconds, Path(d)))
            batches.run()
        runners.append(batches)

    if not args.skip_lists:
        with tempfile.TemporaryDirectory(prefix="bench-dns-lists-") as d:
            runners.extend(blocklist_runners(args, Path(d)))
            runners.append(query_log_runner(args, Path(d)))

    if not args.skip_alloc:
        alloc = Runner("dns-alloc (in-process DoH GET, five A records, cache hit)", rounds=args.rounds,
                       baseline="unpooled")
        chunks = _client_bytes(args.alloc_queries)
        alloc.add("unpooled", lambda: alloc_variant(False, args.alloc_queries, chunks))
        alloc.add("pooled", lambda: alloc_variant(True, args.alloc_queries, chunks))
        alloc.run()
        runners.append(alloc)
        pack = Runner("dns-pack (in-process: parse + cache hit + pack, no HTTP)", rounds=args.rounds,
                      baseline="unpooled")
        pack.add("unpooled", lambda: pack_variant(False, args.alloc_queries * 5))
        pack.add("pooled", lambda: pack_variant(True, args.alloc_queries * 5))
        pack.run()
        runners.append(pack)

    if not args.skip_load:
        for tool in ("dnsperf", "h2load", "unbound", "openssl"):
            if shutil.which(tool) is None:
                sys.exit(f"{tool} is not installed")
        with tempfile.TemporaryDirectory(prefix="bench-dns-") as d:
            tmp = Path(d)
            wanted = {"meshgate", "unbound", "dnsdist"}
            workers = tuple(int(w) for w in args.workers.split(","))
            servers = start_servers(tmp, wanted, args.ab, args.upstream, workers,
                                    keep=lambda name: selected(args, name), rate_limit=args.rate_limit)
            try:
                runners.append(_load(args, tmp, servers))
            finally:
                for s in servers.values():
                    s.peer.stop()
    report(runners, json_path=args.json, ratio_metrics=["us/q", "cpu_us/q", "peak_B/q", "held_B/q", "rss_MB"])
    for r in runners:
        if r.baseline == "unpooled":
            print(pooling_saves(r))
        elif r.title.startswith("dns-load"):
            print(scaling(r))
            print(against(r, args.ab))


def _load(args: argparse.Namespace, tmp: Path, servers: dict[str, Server]) -> Runner:
    hit = tmp / "hit.txt"
    hit.write_text(f"{HIT_NAME} A\n")
    body = tmp / "hit.bin"
    q = dns.message.make_query(HIT_NAME, "A")
    q.id = 0
    body.write_bytes(q.to_wire())
    # Warm meshgate's cache (the first www.test goes to unbound): from many sockets, so every
    # worker process (each has its own cache) gets its copy.
    for name, s in servers.items():
        if name.startswith("meshgate"):
            dnsperf(s, "udp", hit, 0.5, ["-c", "16", "-q", "16"])
    run = Runner("dns-load (loopback; hit = www.test from memory/cache)", rounds=args.rounds)
    sec, n = args.seconds, args.requests
    rows = [r.strip() for r in args.rows.split(",")] if getattr(args, "rows", None) else None

    def add(label: str, fn: Any) -> None:
        if rows is None or any(r in label for r in rows):
            run.add(label, fn)

    live = {name: s for name, s in servers.items() if selected(args, name)}
    # Grouped by protocol, so the rows compared with each other (meshgate-wN with meshgate,
    # unbound-tN with unbound, ...) run close together in every round.
    # 16 sockets (dnsperf -c): the kernel spreads UDP over SO_REUSEPORT processes by source port.
    for name, s in live.items():
        add(f"{name} udp dnsperf", lambda s=s: dnsperf(s, "udp", hit, sec, ["-c", "16", "-q", "200"]))
    for name, s in live.items():
        add(f"{name} doh GET h2load", lambda s=s: h2load(s, n, post=False))
    for name, s in live.items():
        add(f"{name} doh POST h2load", lambda s=s: h2load(s, n, post=True, body=body))
    for name, s in live.items():
        if name.startswith("unbound"):
            continue  # unbound serves DoH over HTTP/2 only (its https-port speaks no HTTP/1.1)
        add(f"{name} doh h1 GET h2load", lambda s=s: h2load(s, n, post=False, h1=True))
    for name, s in live.items():
        if s.h3:
            add(f"{name} doh3 GET h3load", lambda s=s: h3load(s, max(n // 4, 1000)))
    for name, s in live.items():
        if s.doq:  # unbound 1.17 and dnsdist 1.7 serve no DoQ
            add(f"{name} doq dnspython", lambda s=s: doqload(s, max(n // 4, 1000)))
    for name, s in live.items():
        if name.startswith("dnsdist"):
            # dnsperf 2.10 -m doh loses dnsdist 1.7's answers (dnsdist sends them; the client drops
            # them: bench/peers/README.md), so that row would measure the client: h2load's stand.
            print(f"  {name} doh dnsperf: skipped (dnsperf -m doh loses dnsdist's answers)", file=sys.stderr)
        else:
            add(f"{name} doh dnsperf", lambda s=s: dnsperf(s, "doh", hit, sec, ["-c", "4", "-q", "50"]))
    up = args.upstream
    for name, mg in servers.items():
        if not name.startswith("meshgate") or not selected(args, name):
            continue

        def udp_miss(mg: Server = mg) -> Metrics:
            data = tmp / "miss.txt"
            tag = secrets.token_hex(4)
            data.write_text("".join(f"m{i}-{tag}.test A\n" for i in range(200000)))
            return dnsperf(mg, "udp", data, args.seconds, ["-c", "16", "-q", "200", "-n", "1"])

        def doh_miss(mg: Server = mg) -> Metrics:
            uris = tmp / "miss-uris.txt"
            tag = secrets.token_hex(4)
            n = args.requests // 4
            uris.write_text("".join(f"https://127.0.0.1:{mg.doh}/dns-query?dns={_query_b64(f'd{i}-{tag}.test')}\n"
                                    for i in range(n)))
            return h2load(mg, n, post=False, uris=uris)

        add(f"{name} udp MISS via {up} dnsperf", udp_miss)
        add(f"{name} doh GET MISS via {up} h2load", doh_miss)
    run.run()
    return run


# --------------------------------------------------------------------------- 2b. UDP batches in process
# The working tree's UDP listener in this process under dnsperf (16 sockets, 200 outstanding):
# batched (one recvmmsg per wake-up, one sendmmsg for its answers: meshgate/udpbatch.py) against
# the same listener with a system call per datagram (start_udp(batched=False)), and how many
# datagrams each wake-up read. The CPU is this process's (dnsperf is a child, not counted).


def udp_batch_variant(batched: bool, seconds: float, tmp: Path) -> Metrics:
    from meshgate.loop import new_loop

    loop = new_loop("uvloop")
    try:
        return loop.run_until_complete(_udp_batch_variant(batched, seconds, tmp))
    finally:
        loop.close()


async def _udp_batch_variant(batched: bool, seconds: float, tmp: Path) -> Metrics:
    import resource

    from meshgate.dns import plain

    loop = asyncio.get_running_loop()
    srv = await plain.start_udp(_five_a_pipeline(True, loop.time()), ListenerStats("udp://bench-batches"),
                                "127.0.0.1", 0, batched=batched)
    assert (srv.batch is not None) == batched, "no recvmmsg/sendmmsg here"
    sizes: list[int] = []
    wakeups = [0]
    if srv.batch is not None:
        recv = srv.batch.recv

        def counting_recv() -> list[bytes]:
            got = recv()
            sizes.append(len(got))
            return got

        srv.batch.recv = counting_recv  # type: ignore[method-assign]
    else:
        readable = srv._readable

        def counting_readable() -> None:
            wakeups[0] += 1
            readable()

        loop.remove_reader(srv.sock.fileno())
        loop.add_reader(srv.sock.fileno(), counting_readable)
    data = tmp / "five.txt"
    data.write_text("five.bench A\n")
    argv = ["dnsperf", "-m", "udp", "-s", "127.0.0.1", "-p", str(srv.sock.getsockname()[1]), "-d", str(data),
            "-c", "16", "-q", "200", "-t", "2"]
    try:
        warm = await asyncio.create_subprocess_exec(*argv, "-l", "0.3", stdout=subprocess.DEVNULL)
        await warm.wait()
        sizes.clear()
        wakeups[0] = 0
        q0 = srv.stats.queries.value
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        proc = await asyncio.create_subprocess_exec(*argv, "-l", str(seconds), stdout=subprocess.PIPE)
        out = (await proc.communicate())[0].decode()
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        queries = max(srv.stats.queries.value - q0, 1)
    finally:
        srv.close()
    user, kernel = r1.ru_utime - r0.ru_utime, r1.ru_stime - r0.ru_stime
    done = max(int(_grab(r"Queries completed:\s+(\d+)", out)), 1)
    reads = len(sizes) if batched else wakeups[0]
    m: Metrics = {"qps": float(_grab(r"Queries per second:\s+([0-9.]+)", out)),
                  "cpu_us/q": (user + kernel) / done * 1e6, "kernel_us/q": kernel / done * 1e6,
                  "dgrams/wakeup": queries / max(reads, 1)}
    if batched:  # the share of datagrams read in full batches (64), in batches of 2-63, and alone
        got = max(sum(sizes), 1)
        m["full_share"] = sum(n for n in sizes if n == plain.READ_BATCH) / got
        m["2-63_share"] = sum(n for n in sizes if 1 < n < plain.READ_BATCH) / got
        m["single_share"] = sum(n for n in sizes if n == 1) / got
    return m


# --------------------------------------------------------------------------- 3. blocklist and query log
# In process, no sockets: what a one-million-domain blocklist costs in memory and per cache-hit
# query, and what [dns.query_log] costs per query. The query path is Frontend.query (parse,
# lookup, pack, and the query-log hook where it lives), the same the udp listener calls.

_MEMORY_CHILD = """
import os, sys, time
def rss():
    with open('/proc/self/statm') as f:
        return int(f.read().split()[1]) * os.sysconf('SC_PAGE_SIZE')
def hwm():
    with open('/proc/self/status') as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith('VmHWM'))
from meshgate.dns.blocklist import Blocklist
import gc
gc.collect()
r0, h0 = rss(), hwm()
cpu = time.process_time()
bl = Blocklist([sys.argv[1]], [], 3600.0)
cpu = time.process_time() - cpu
gc.collect()
print(bl.entries, rss() - r0, hwm() - h0, cpu)
"""


def _domain_list(path: Path, n: int) -> None:
    """n distinct plain-domain lines (6-14 random characters, a number, sometimes a label, a TLD),
    about 24 bytes each: the shape of the big public lists' entries."""
    rng = random.Random(16)
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789"
    tlds = ("com", "net", "org", "io", "de", "info")
    mids = ("", "ads.", "track.", "cdn.")
    with path.open("w") as f:
        for i in range(n):
            host = "".join(rng.choices(alphabet, k=rng.randint(6, 14)))
            f.write(f"{host}{i}.{rng.choice(mids)}{rng.choice(tlds)}\n")


def blocklist_memory(list_path: Path, tree: Path) -> Metrics:
    """Load the list into dns/blocklist.py's table in a fresh process (the tree's meshgate):
    RSS after minus before (what stays), VmHWM growth (the peak while parsing), CPU to load."""
    out = subprocess.run([sys.executable, "-c", _MEMORY_CHILD, str(list_path)], cwd=tree, check=True,
                         capture_output=True, text=True, timeout=600).stdout.split()
    entries, kept, peak, cpu = int(out[0]), int(out[1]), int(out[2]), float(out[3])
    return {"entries": entries, "rss_MB": kept / 1e6, "B/domain": kept / entries,
            "peak_MB": peak / 1e6, "load_cpu_s": cpu}


def _frontend(log_cfg: dict[str, Any] | None, names: list[str], now: float) -> Any:
    """A Frontend whose pipeline's cache holds an A record for each of `names`."""
    from meshgate.dns.resolver import Frontend

    cfg: dict[str, Any] = {"node": {"name": "bench"}}
    if log_cfg is not None:
        cfg["dns"] = {"query_log": log_cfg}
    p = Pipeline(from_dict(cfg), upstreams=[])
    for name in names:
        q = dns.message.make_query(name, "A")
        r = dns.message.make_response(q)
        r.answer.append(dns.rrset.from_text(name, 3600, "IN", "A", "192.0.2.1"))
        key = (wire.encode_name(name), 1, 1)
        p.cache.put(key, wire.parse_response(r.to_wire(), q.id, key, now))
    return Frontend(p, ListenerStats("udp://127.0.0.1:53"))


def _queries(names: list[str]) -> list[bytes]:
    out = []
    for name in names:
        q = dns.message.make_query(name, "A")
        q.id = 0
        out.append(q.to_wire())
    return out


def frontend_variant(n: int, names: list[str], *, blocklist: Any = None, cold: bool = False,
                     log_cfg: dict[str, Any] | None = None) -> Metrics:
    """n cache-hit queries through Frontend.query cycling over `names`, on the loop's real clock
    (so the pipeline's one-second memo of local and blocklist decisions expires as it does in
    a node). `cold` clears that memo before every query: each then pays the blocklist decision.
    With a query log file, the run includes writing out what is queued (its thread's CPU is in
    the process's CPU time) and reports lines dropped per query."""
    loop = asyncio.new_event_loop()

    async def run() -> Metrics:
        now = loop.time()
        fe = _frontend(log_cfg, names, now)
        p = fe.pipeline
        if blocklist is not None:
            p.blocklist = blocklist
        datas = _queries(names)
        peer = ("192.0.2.77", 5353)
        m = len(datas)
        for data in datas:  # warm: memo and pool filled, every name answered once
            fe.query(data, loop.time(), peer, udp=True).buffer.recycle()
        gc.collect()
        cpu0, t0 = time.process_time(), time.perf_counter()
        for i in range(n):
            if cold:
                p._memo.clear()
            ready = fe.query(datas[i % m], loop.time(), peer, udp=True)
            ready.buffer.recycle()
        log = p.query_log
        dropped = 0
        if log is not None and log.sink is not None:
            dropped = log.sink.dropped
            log.close()  # waits for the writer: its work is part of the cost
        wall = time.perf_counter() - t0
        cpu = time.process_time() - cpu0
        out: Metrics = {"q/s": n / wall, "cpu_us/q": cpu / n * 1e6}
        if log is not None and log.sink is not None:
            out["dropped/q"] = dropped / n
        return out

    try:
        return loop.run_until_complete(run())
    finally:
        loop.close()


def blocklist_runners(args: argparse.Namespace, tmp: Path) -> list[Runner]:
    from meshgate.dns.blocklist import Blocklist

    size = args.blocklist_size
    list_path = tmp / "blocklist.txt"
    _domain_list(list_path, size)
    mem = Runner(f"dns-blocklist-memory ({size:,} plain domains, fresh process each)", rounds=args.rounds,
                 baseline=f"meshgate@{args.ab}" if args.ab else None)
    mem.add("meshgate", lambda: blocklist_memory(list_path, ROOT))
    if args.ab:
        tree = git_tree(args.ab, str(tmp))
        mem.add(f"meshgate@{args.ab}", lambda: blocklist_memory(list_path, tree))
    mem.run()
    bl = Blocklist([str(list_path)], [], 3600.0)
    names = [f"host{i}.cached.example." for i in range(1000)]  # none of them blocked
    n = args.alloc_queries * 5
    cost = Runner(f"dns-blocklist-cost (in-process Frontend.query, cache hits over 1000 names; "
                  f"list: {bl.entries:,} domains)", rounds=args.rounds, baseline="none")
    cost.add("none", lambda: frontend_variant(n, names))
    cost.add("list", lambda: frontend_variant(n, names, blocklist=bl))
    cost.add("none cold", lambda: frontend_variant(n, names, cold=True))
    cost.add("list cold", lambda: frontend_variant(n, names, blocklist=bl, cold=True))
    cost.run()
    return [mem, cost]


def query_log_runner(args: argparse.Namespace, tmp: Path) -> Runner:
    names = [f"host{i}.cached.example." for i in range(1000)]
    n = args.alloc_queries * 5
    path = str(tmp / "queries.jsonl")
    run = Runner("dns-query-log (in-process Frontend.query, cache hits over 1000 names)", rounds=args.rounds,
                 baseline="off")
    run.add("off", lambda: frontend_variant(n, names))
    run.add("ring", lambda: frontend_variant(n, names, log_cfg={"enable": True}))
    # queue = n: the file gets every line, so the row is the whole cost of writing them
    run.add("ring+file", lambda: frontend_variant(
        n, names, log_cfg={"enable": True, "path": path, "queue": n}))
    run.add("ring+file anonymized", lambda: frontend_variant(
        n, names, log_cfg={"enable": True, "path": path, "queue": n, "client_ip": "anonymized"}))
    run.add("ring+file queue 1000", lambda: frontend_variant(
        n, names, log_cfg={"enable": True, "path": path, "queue": 1000}))
    run.run()
    return run


if __name__ == "__main__":
    main()
