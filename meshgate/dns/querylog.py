"""`[dns.query_log]`: a bounded ring of the most recent answered questions (pure).

Off by default: it records client addresses and the names they asked. When on, each answered
question is one tuple appended to a `collections.deque(maxlen=size)`; the oldest entry falls out.
Every entry carries a sequence number (1, 2, ...) so a reader asks for what came `since` the last
one it saw (`GET /dns/log?since=N`, `meshgate dns log --follow`).

An entry: (seq, unix time, client, name, qtype, rcode, via, latency ms), `via` being how it was
answered: `local` (mesh zone, dns.records), `cache`, `blocked`, the upstream URL that answered,
`route SUFFIX URL` for a `[[dns.route]]`'s upstream, or `failed` (every upstream failed: SERVFAIL).

The log holds what the process that built it answered: with dns.workers > 1 the worker processes'
own cache hits are not in it (docs/OPERATIONS.md).
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from typing import Any

from meshgate.dns import wire

Entry = tuple[int, float, str, str, int, int, str, float]

_TYPE_NAMES = {1: "A", 2: "NS", 5: "CNAME", 6: "SOA", 12: "PTR", 15: "MX", 16: "TXT", 28: "AAAA",
               33: "SRV", 64: "SVCB", 65: "HTTPS", 255: "ANY"}


def type_name(qtype: int) -> str:
    return _TYPE_NAMES.get(qtype, f"TYPE{qtype}")


def client_text(peer: object) -> str:
    """A listener's peer (an address tuple, or a string) as the client's address."""
    if isinstance(peer, tuple) and peer:
        return str(peer[0])
    return str(peer)


class QueryLog:
    __slots__ = ("entries", "seq", "size")

    def __init__(self, size: int) -> None:
        self.size = size
        self.entries: deque[Entry] = deque(maxlen=size)
        self.seq = 0

    def add(self, peer: object, name: bytes, qtype: int, rcode: int, via: str, ms: float,
            now: float | None = None) -> None:
        """Record one answered question (`name` in wire format)."""
        self.seq += 1
        self.entries.append((self.seq, time.time() if now is None else now, client_text(peer),
                             wire.decode_name(name), qtype, rcode, via, ms))

    def since(self, seq: int) -> list[Entry]:
        """Entries newer than `seq` (oldest first); those that fell out of the ring are gone."""
        entries = self.entries
        if not entries or seq >= self.seq:
            return []
        skip = max(0, seq - entries[0][0] + 1)
        return list(itertools.islice(entries, skip, None))


def as_dict(e: Entry) -> dict[str, Any]:
    seq, t, client, name, qtype, rcode, via, ms = e
    return {"seq": seq, "time": round(t, 3), "client": client, "name": name, "type": type_name(qtype),
            "rcode": wire.RCODE_NAMES.get(rcode, str(rcode)), "via": via, "ms": round(ms, 3)}


def answer(log: QueryLog | None, enabled: bool, since: int) -> dict[str, Any]:
    """The JSON of GET /dns/log?since=N: with the log off, enabled false and no entries."""
    if not enabled or log is None:
        return {"enabled": enabled, "size": log.size if log else 0, "last": 0, "entries": []}
    return {"enabled": True, "size": log.size, "last": log.seq,
            "entries": [as_dict(e) for e in log.since(since)]}


def format_line(e: dict[str, Any]) -> str:
    """One line of `meshgate dns log`: time, client, name, type, rcode, via, latency."""
    t = time.strftime("%H:%M:%S", time.localtime(e["time"])) + f".{int(e['time'] * 1000) % 1000:03d}"
    return f"{t} {e['client']} {e['name']} {e['type']} {e['rcode']} {e['via']} {e['ms']:.1f}ms"

