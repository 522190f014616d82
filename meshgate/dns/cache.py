"""Answer cache: wire-bytes answers keyed by question, bounded LRU, TTL from the answer.

Sans-I/O: every call takes `now`. Entries live `answer.ttl` seconds from when
they were stored (the smallest answer TTL, or RFC 2308's negative TTL);
serving ages every TTL in the copy (wire.pack_answer), never the stored bytes.
"""

from __future__ import annotations

from collections import OrderedDict

from meshgate.dns.wire import Answer
from meshgate.metrics import REGISTRY

_hits = REGISTRY.counter("meshgate_dns_cache_hits_total", "DNS answers served from the cache")
_misses = REGISTRY.counter("meshgate_dns_cache_misses_total", "DNS cache lookups that missed")
_evictions = REGISTRY.counter(
    "meshgate_dns_cache_evictions_total", "DNS cache entries evicted because the cache was full (LRU)"
)

Key = tuple[bytes, int, int]


class AnswerCache:
    def __init__(self, size: int) -> None:
        self.size = max(size, 1)
        # Read directly by the UDP fast path (dns/preformed.py), which serves a hit without get()
        # and counts it with count_hits().
        self.entries: OrderedDict[Key, Answer] = OrderedDict()
        self._hit = _hits.labels()
        self._miss = _misses.labels()

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, key: Key, now: float) -> Answer | None:
        ans = self.entries.get(key)
        if ans is None:
            self._miss.inc()
            return None
        if now - ans.stored >= ans.ttl:
            del self.entries[key]
            self._miss.inc()
            return None
        self.entries.move_to_end(key)
        self._hit.inc()
        return ans

    def count_hits(self, n: int) -> None:
        """Hits served without get() (the UDP fast path), counted in batches."""
        self._hit.inc(n)

    def put(self, key: Key, ans: Answer) -> bool:
        """Store if cacheable (positive TTL). The caller has already checked that the
        answer is for `key` (wire.parse_response refuses any other question)."""
        if ans.ttl <= 0:
            return False
        entries = self.entries
        entries[key] = ans
        entries.move_to_end(key)
        while len(entries) > self.size:
            entries.popitem(last=False)
            _evictions.inc()
        return True

    def clear(self) -> None:
        self.entries.clear()
