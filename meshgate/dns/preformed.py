"""Preformed answers: the cache-hit fast path's table, sans-I/O (bytes and `now` in, bytes out).

The general path (resolver.Frontend) parses every query, looks it up and packs the answer. For
UDP (and likewise for DoH, `udp=False`) the answer is a function of the query's bytes after its
ID (flags, question with its letter case, EDNS size, DO bit and options) and of the Answer it
comes from, aged to the second. So once the general path has answered a query from the cache or
from local data, `learn()` keeps the bytes it sent under the query's bytes;
`answer()` then serves a repeat of that query with a dictionary look-up: the stored bytes behind
the new ID, the TTLs re-patched when the age moved to another second. Nothing is parsed on a hit.

A stored answer is served only while the general path would give the same bytes:

- the pipeline's memo of local decisions still holds what it held when learned (the mesh zone,
  dns.records and the blocklist decide before the cache: a name that became local, or blocked,
  or a memo cleared by a reload or a new name table, sends the query back to the general path),
  and the memo's one-second epoch has not run out (lookup() then re-reads the blocklist);
- for a cache answer, the cache still holds that very Answer object, unexpired.

Blocked answers are left to the general path (they count per list). The query log, when on,
sees every question, so the listener then keeps to the general path; so does a DoH listener
with a per-client rate limit (the UDP listener checks the limit itself on a hit, once a query).
A hit keeps the cache's LRU order and is counted like a general hit, in batches (`flush_counts`).

The table is bounded (`limits.dns_fast_path_entries`): full, it is emptied and refilled by what
is asked next, as the pipeline's memo is.
"""

from __future__ import annotations

import struct

from meshgate.dns import wire
from meshgate.dns.resolver import _NOT_LOCAL, Pipeline, _Blocked
from meshgate.dns.stats import ListenerStats
from meshgate.dns.wire import Answer, Query
from meshgate.udpbatch import Pinned

_U32 = struct.Struct(">I")


class _Entry:
    __slots__ = ("age", "ans", "key", "offsets", "rcode", "source", "tail")

    def __init__(self, tail: Pinned, age: int, ans: Answer, key: tuple[bytes, int, int], source: Answer,
                 offsets: tuple[int, ...]) -> None:
        # the packed answer after its 2-byte ID, where a batched UDP send can point at it (its
        # TTLs are patched in place: a batch's answers share one `now`, so one age)
        self.tail = tail
        self.age = age  # the age its TTLs carry
        self.ans = ans
        self.key = key
        self.source = source  # what the pipeline's memo held for `key` (_NOT_LOCAL: the cache)
        self.offsets = offsets  # TTL offsets in the answer, 2 past those in `tail` (none: truncated)
        self.rcode = ans.rcode


class PreformedAnswers:
    """`udp` False (DoH): `max_age` holds the remaining TTL of the answer just given (what
    pack_answer returns: cache-control's)."""

    def __init__(self, pipeline: Pipeline, size: int, *, udp: bool = True) -> None:
        self.pipeline = pipeline
        self.size = size
        self.udp = udp
        self.max_age = 0
        self._table: dict[bytes, _Entry] = {}
        self._seen: set[bytes] = set()  # answered once by the general path (bounded like the table)
        # counted on hits, added to the counters in batches by the listener (flush_counts);
        # NOERROR is what is left of `hits` after the other rcodes
        self.hits = 0
        self.cache_hits = 0
        self.other_hits = 0
        self.other_rcodes: dict[int, int] = {}
        self._last: _Entry | None = None

    def __len__(self) -> int:
        return len(self._table)

    def answer(self, data: bytes, now: float) -> bytes | None:
        """The answer to `data` if it repeats a learned query and is still what the general path
        would send; None: ask the general path."""
        e = self.entry(data[2:], now)
        return None if e is None else data[:2] + e.tail.data

    def entry(self, key: bytes, now: float) -> _Entry | None:
        """`answer()` for a query's bytes after its ID, as the stored entry: its `tail` goes
        behind the query's ID. Counted as a hit; None: ask the general path."""
        e = self._table.get(key)
        if e is None:
            return None
        p = self.pipeline
        if now >= p._memo_until or p._memo.get(e.key) is not e.source:
            return None
        ans = e.ans
        if e.source is _NOT_LOCAL:
            cache = p.cache
            if cache.entries.get(e.key) is not ans or now - ans.stored >= ans.ttl:
                return None
            cache.entries.move_to_end(e.key)
            self.cache_hits += 1
        if ans.aging:
            age = int(now - ans.stored)
            if age != e.age and age > 0:
                tail = e.tail.data
                for off, ttl in zip(e.offsets, ans.ttls, strict=False):
                    _U32.pack_into(tail, off - 2, ttl - age if ttl > age else 0)
                e.age = age
            if not self.udp:  # what pack_answer returns
                self.max_age = ans.ttl if age <= 0 else max(ans.ttl - age, 0)
        elif not self.udp:
            self.max_age = ans.ttl
        self.hits += 1
        if e.rcode:
            self.other_hits += 1
            self.other_rcodes[e.rcode] = self.other_rcodes.get(e.rcode, 0) + 1
        self._last = e
        return e

    def unanswered(self) -> None:
        """The answer just given is not sent after all (the client is over its rate limit, which
        the general path checks before it looks anything up): take its counts back."""
        e = self._last
        assert e is not None
        self.hits -= 1
        if e.rcode:
            self.other_hits -= 1
            self.other_rcodes[e.rcode] -= 1
        if e.source is _NOT_LOCAL:
            self.cache_hits -= 1

    def learn(self, data: bytes, now: float, q: Query, packed: bytes | memoryview) -> None:
        """After the general path answered `data` at once with `packed`, from lookup() for `q`
        (Frontend.answered): store it if it came from the cache or from local data (not
        blocked). Those are the bytes a repeat gets (behind its own ID), so nothing is parsed or
        packed again here. A query is stored the second time it is answered: clients that
        randomize the letter case of every name (0x20) never repeat one, and pay only this
        look-up for it."""
        tail = data[2:]
        seen = self._seen
        if tail not in seen:
            if len(seen) >= self.size:
                seen.clear()
            seen.add(tail)
            return
        p = self.pipeline
        key = (q.name, q.qtype, q.qclass)
        source = p._memo.get(key)
        if source is None or type(source) is _Blocked or now >= p._memo_until:
            return
        if source is _NOT_LOCAL:
            ans = p.cache.entries.get(key)  # what the general path just served (unexpired)
            if ans is None:
                return
        else:
            ans = source
        # TTLs sit where they sit in ans.wire (the question is the client's, of the same length);
        # a truncated answer (header, question, OPT) has none.
        offsets = ans.ttl_offsets if len(packed) >= len(ans.wire) else ()
        age = int(now - ans.stored) if ans.aging else 0
        table = self._table
        if len(table) >= self.size:
            table.clear()
        table[tail] = _Entry(Pinned(packed[2:]), max(age, 0), ans, key, source, offsets)

    def flush_counts(self, stats: ListenerStats) -> None:
        """Add the hits since the last call to the listener's and the cache's counters."""
        hits = self.hits
        if not hits:
            return
        stats.queries.inc(hits)
        if hits > self.other_hits:
            stats.response(wire.NOERROR, hits - self.other_hits)
        if self.other_hits:
            for rcode, n in self.other_rcodes.items():
                if n:
                    stats.response(rcode, n)
            self.other_rcodes.clear()
        if self.cache_hits:
            self.pipeline.cache.count_hits(self.cache_hits)
        self.hits = self.cache_hits = self.other_hits = 0

    def clear(self) -> None:
        self._table.clear()
        self._seen.clear()
