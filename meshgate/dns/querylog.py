"""`[dns.query_log]`: the answered questions, in a bounded ring and optionally a JSON-lines file.

Off by default: it records client addresses and the names they asked. When on, each answered
question is one tuple appended to a `collections.deque(maxlen=size)`; the oldest entry falls out.
Every entry carries a sequence number (1, 2, ...) so a reader asks for what came `since` the last
one it saw (`GET /dns/log?since=N`, `meshgate dns log --follow`).

The answering path only builds that tuple (the peer, the wire name and the Answer as they are):
the name is decoded, the client address anonymized and the answer's addresses read when an
entry is shown (`Formatter`), by the admin API for the ring and by the file writer's thread for
`path`. The writer takes entries from a queue of at most `queue`: when it falls behind (a slow
disk, a flood) new entries are dropped and counted (meshgate_dns_query_log_dropped_total)
instead of making an answer wait.

An entry shown (`Formatter.record`, one JSON line of the file): time (unix seconds), client
(full, anonymized: IPv4 /24 and IPv6 /48 zeroed, or "" for none), listener (its URL), name, type,
rcode, answers (the A/AAAA addresses of the answer section, [] for none), source (how it was
answered: `mesh` for the mesh zone, `local` for dns.records, `cache`, `blocked LIST`, the upstream
URL that answered, `route SUFFIX URL` for a `[[dns.route]]`'s upstream, `failed` when every
upstream failed) and latency_ms; the ring's entries also carry `seq`.

With dns.workers > 1 the worker processes forward their entries to the node's log
(dns/worker.py `ForwardedLog`), so it holds every process's questions (docs/OPERATIONS.md).
"""

from __future__ import annotations

import contextlib
import ipaddress
import itertools
import json
import logging
import os
import socket
import struct
import threading
import time
from collections import deque
from typing import Any

from meshgate.dns import wire
from meshgate.logs import RateLimitedLog
from meshgate.metrics import REGISTRY

log = logging.getLogger("meshgate.dns")

# (seq, unix time, peer, listener, wire name, qtype, answer, source, latency ms)
Entry = tuple[int, float, object, str, bytes, int, wire.Answer, str, float]

_dropped = REGISTRY.counter("meshgate_dns_query_log_dropped_total",
                            "Query log lines dropped because the file writer's queue was full")
_write_errors = REGISTRY.counter("meshgate_dns_query_log_write_errors_total",
                                 "Query log lines lost because the file could not be opened or written")

_TYPE_NAMES = {1: "A", 2: "NS", 5: "CNAME", 6: "SOA", 12: "PTR", 15: "MX", 16: "TXT", 28: "AAAA",
               33: "SRV", 64: "SVCB", 65: "HTTPS", 255: "ANY"}

FULL, ANONYMIZED, NONE = "full", "anonymized", "none"
_CLIENT_MEMO_MAX = 4096  # distinct peers remembered by a Formatter before it starts over


def type_name(qtype: int) -> str:
    return _TYPE_NAMES.get(qtype, f"TYPE{qtype}")


def client_text(peer: object) -> str:
    """A listener's peer (an address tuple, or a string) as the client's address."""
    if isinstance(peer, tuple) and peer:
        return str(peer[0])
    return str(peer)


def anonymize(address: str) -> str:
    """An address with its host part zeroed, as blocky and AdGuard Home do: IPv4 to its /24,
    IPv6 to its /48 (an IPv4-mapped IPv6 address as the IPv4 one); anything else unchanged."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return address
    if ip.version == 6 and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    prefix = 24 if ip.version == 4 else 48
    return str(ipaddress.ip_network(f"{ip}/{prefix}", strict=False).network_address)


def answer_addresses(ans: wire.Answer) -> list[str]:
    """The A/AAAA addresses of an answer's answer section ([] if it cannot be read)."""
    try:
        # inet_ntop: RFC 5952 text (an IPv4-mapped one as ::ffff:a.b.c.d) at a tenth of ipaddress's cost
        return [socket.inet_ntop(socket.AF_INET if len(rd) == 4 else socket.AF_INET6, rd)
                for _t, rd in wire.answer_addresses(ans)]
    except (struct.error, IndexError, ValueError):  # a truncated stored answer: show none
        return []


class Formatter:
    """Entries as the dicts shown (admin API, file lines), applying `client_ip`."""

    def __init__(self, client_ip: str = FULL) -> None:
        self.client_ip = client_ip
        self._clients: dict[object, str] = {}
        # line(): the JSON fragments that repeat from line to line, built once (bounded like
        # _clients): per Answer object (a cache hit logs the same one again and again) its
        # rcode and addresses, per wire name its text, per string its quoted form
        self._answers: dict[int, tuple[wire.Answer, str]] = {}
        self._names: dict[bytes, str] = {}
        self._quoted: dict[str, str] = {}

    def client(self, peer: object) -> str:
        mode = self.client_ip
        if mode == NONE or peer is None:
            return ""
        text = client_text(peer)
        if mode == FULL:
            return text
        memo = self._clients
        got = memo.get(text)
        if got is None:
            if len(memo) >= _CLIENT_MEMO_MAX:
                memo.clear()  # bounded: a scan of many addresses recomputes rather than grows
            got = memo[text] = anonymize(text)
        return got

    def record(self, e: Entry) -> dict[str, Any]:
        _seq, t, peer, listener, name, qtype, ans, source, ms = e
        return {"time": round(t, 3), "client": self.client(peer), "listener": listener,
                "name": wire.decode_name(name), "type": type_name(qtype),
                "rcode": wire.RCODE_NAMES.get(ans.rcode, str(ans.rcode)),
                "answers": answer_addresses(ans), "source": source, "latency_ms": round(ms, 3)}


    def line(self, e: Entry) -> bytes:
        """record(e) as one compact JSON line, built directly (the writer's per-line cost: about
        a third of json.dumps of the dict); json.loads(line) == record(e)."""
        _seq, t, peer, listener, name, qtype, ans, source, ms = e
        memo = self._answers
        held = memo.get(id(ans))
        if held is None or held[0] is not ans:  # (the Answer kept with it: its id stays its own)
            if len(memo) >= _CLIENT_MEMO_MAX:
                memo.clear()
            answers = ",".join(f'"{a}"' for a in answer_addresses(ans))  # addresses need no escaping
            rcode = wire.RCODE_NAMES.get(ans.rcode, str(ans.rcode))
            held = memo[id(ans)] = (ans, f'"rcode":{_quote(rcode)},"answers":[{answers}]')
        names = self._names
        text = names.get(name)
        if text is None:
            if len(names) >= _CLIENT_MEMO_MAX:
                names.clear()
            text = names[name] = _quote(wire.decode_name(name))
        q = self._quote
        return (f'{{"time":{round(t, 3)!r},"client":{q(self.client(peer))},"listener":{q(listener)},'
                f'"name":{text},"type":{q(type_name(qtype))},{held[1]},'
                f'"source":{q(source)},"latency_ms":{round(ms, 3)!r}}}\n').encode()

    def _quote(self, text: str) -> str:
        quoted = self._quoted
        got = quoted.get(text)
        if got is None:
            if len(quoted) >= _CLIENT_MEMO_MAX:
                quoted.clear()
            got = quoted[text] = _quote(text)
        return got


def _quote(text: str) -> str:
    return json.encoder.encode_basestring_ascii(text)


class RotatingFile:
    """Appends lines to `path`; before a line would take it past `max_bytes`, the file becomes
    path.1 (path.1 becomes path.2, ... up to path.KEEP, the oldest dropped) and a new one starts.
    A file holds at most max_bytes unless one line alone is longer. Used by one thread."""

    def __init__(self, path: str, max_bytes: int, keep: int) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.keep = keep
        self._f: Any = None
        self.size = 0

    def _open(self) -> None:
        self._f = open(self.path, "ab")  # noqa: SIM115 - kept open across writes, closed by close()
        self.size = os.fstat(self._f.fileno()).st_size

    def write(self, line: bytes) -> None:
        if self._f is None:
            self._open()
        if self.size and self.size + len(line) > self.max_bytes:
            self.rotate()
        self._f.write(line)
        self.size += len(line)

    def rotate(self) -> None:
        self.close()
        for i in range(self.keep - 1, 0, -1):
            older = f"{self.path}.{i}"
            if os.path.exists(older):
                os.replace(older, f"{self.path}.{i + 1}")
        os.replace(self.path, f"{self.path}.1")
        self._open()

    def flush(self) -> None:
        if self._f is not None:
            self._f.flush()

    def close(self) -> None:
        f, self._f = self._f, None
        if f is not None:
            with contextlib.suppress(OSError):  # a failed flush of lines already counted lost
                f.close()


class FileSink:
    """The writer thread of `path`: `put` (on the answering path) appends to a bounded deque or
    counts a drop; the thread formats and writes what is queued, flushing each batch.

    A deque because its append and popleft are atomic: the event loop never takes a lock for a
    line. The thread polls the deque (every 50 ms when idle) instead of being woken per line."""

    BATCH = 512
    IDLE = 0.05

    def __init__(self, path: str, max_bytes: int, keep: int, queue: int, fmt: Formatter) -> None:
        self.file = RotatingFile(path, max_bytes, keep)
        self.cap = queue
        self.fmt = fmt
        self.queue: deque[Entry] = deque()
        self.dropped = 0
        self.written = 0
        self._rlog = RateLimitedLog(log, interval=60.0)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def put(self, e: Entry) -> None:
        if self._thread is None:
            self.start()
        q = self.queue
        if len(q) >= self.cap:
            self.dropped += 1
            _dropped.inc()
            return
        q.append(e)

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="dns-query-log", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        q = self.queue
        while True:
            if not q:
                if self._stop.is_set():
                    break
                self._stop.wait(self.IDLE)
                continue
            batch = [q.popleft() for _ in range(min(len(q), self.BATCH))]
            self._write(batch)
        self.file.close()

    def _write(self, batch: list[Entry]) -> None:
        line = self.fmt.line
        f = self.file
        try:
            for e in batch:
                f.write(line(e))
            f.flush()
            self.written += len(batch)
        except OSError as exc:
            _write_errors.inc(len(batch))
            self._rlog.warning("query log write", "dns.query_log: cannot write %s (%s); %d lines lost",
                               f.path, exc, len(batch))
            f.close()  # opened again for the next batch

    def close(self, timeout: float = 5.0) -> None:
        """Write what is queued and stop the thread (waits up to `timeout`: a file that blocks,
        like a FIFO nobody reads, is left to its daemon thread). A later put starts it again."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._stop.set()
        thread.join(timeout)


class QueryLog:
    __slots__ = ("client_ip", "entries", "fmt", "seq", "sink", "size")

    def __init__(self, size: int, *, client_ip: str = FULL, path: str = "", max_bytes: int = 10_000_000,
                 keep: int = 5, queue: int = 10_000) -> None:
        self.size = size
        self.entries: deque[Entry] = deque(maxlen=size)
        self.seq = 0
        self.client_ip = client_ip
        self.fmt = Formatter(client_ip)
        self.sink = FileSink(path, max_bytes, keep, queue, Formatter(client_ip)) if path else None

    def add(self, peer: object, listener: str, name: bytes, qtype: int, ans: wire.Answer, source: str,
            ms: float, now: float | None = None) -> None:
        """Record one answered question (`name` in wire format): a tuple into the ring and, with
        a file, into its writer's queue; nothing is formatted here."""
        self.seq += 1
        e = (self.seq, time.time() if now is None else now, None if self.client_ip == NONE else peer,
             listener, name, qtype, ans, source, ms)
        self.entries.append(e)
        sink = self.sink
        if sink is not None:
            sink.put(e)

    def since(self, seq: int) -> list[Entry]:
        """Entries newer than `seq` (oldest first); those that fell out of the ring are gone."""
        entries = self.entries
        if not entries or seq >= self.seq:
            return []
        skip = max(0, seq - entries[0][0] + 1)
        return list(itertools.islice(entries, skip, None))

    def as_dict(self, e: Entry) -> dict[str, Any]:
        return {"seq": e[0], **self.fmt.record(e)}

    def close(self) -> None:
        if self.sink is not None:
            self.sink.close()


def answer(log: QueryLog | None, enabled: bool, since: int) -> dict[str, Any]:
    """The JSON of GET /dns/log?since=N: with the log off, enabled false and no entries."""
    if not enabled or log is None:
        return {"enabled": enabled, "size": log.size if log else 0, "last": 0, "entries": []}
    return {"enabled": True, "size": log.size, "last": log.seq,
            "entries": [log.as_dict(e) for e in log.since(since)]}


def format_line(e: dict[str, Any]) -> str:
    """One line of `meshgate dns log`: time, client, listener, name, type, rcode, answers, source,
    latency (a field missing from an older line shows as `-`)."""
    t = float(e.get("time", 0.0))
    stamp = time.strftime("%H:%M:%S", time.localtime(t)) + f".{int(t * 1000) % 1000:03d}"
    answers = ",".join(e.get("answers") or []) or "-"
    ms = float(e.get("latency_ms", 0.0))
    return (f"{stamp} {e.get('client') or '-'} {e.get('listener') or '-'} {e.get('name', '-')} "
            f"{e.get('type', '-')} {e.get('rcode', '-')} {answers} {e.get('source', '-')} {ms:.1f}ms")
