"""Per-listener DNS counters: queries, responses by rcode, drops and errors by reason."""

from __future__ import annotations

import logging

from meshgate.dns.wire import RCODE_NAMES
from meshgate.logs import RateLimitedLog
from meshgate.metrics import REGISTRY, Counter, CounterFamily

rlog = RateLimitedLog(logging.getLogger("meshgate.dns"))

_queries = REGISTRY.counter("meshgate_dns_queries_total", "DNS queries received", ("listener",))
_responses = REGISTRY.counter(
    "meshgate_dns_responses_total", "DNS responses sent, by rcode", ("listener", "rcode")
)
_drops = REGISTRY.counter(
    "meshgate_dns_dropped_total", "DNS queries or connections dropped, by reason", ("listener", "reason")
)
_errors = REGISTRY.counter(
    "meshgate_dns_errors_total", "Bad input and failures on a DNS listener, by reason", ("listener", "reason")
)


class ListenerStats:
    """Counters for one listener, labelled by its URL (e.g. https://127.0.0.1:8443/dns-query)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.queries: Counter = _queries.labels(name)
        self._responses: dict[int, Counter] = {}
        self._drops: dict[str, Counter] = {}
        self._errors: dict[str, Counter] = {}

    def rename(self, name: str) -> None:
        """Label by the bound address once known (a listener configured with port 0); DNS workers
        label theirs with the bound address, so both count under one name."""
        if name != self.name:
            self.name = name
            self._attach()

    def forget(self) -> None:
        """The listener stopped: its series leave the families (see _Family.forget)."""
        for family in (_queries, _responses, _drops, _errors):
            family.forget(self.name)
        self._attach()

    def _attach(self) -> None:
        """Take this name's counters from the families afresh (a new name, or forgotten ones)."""
        self.queries = _queries.labels(self.name)
        self._responses.clear()
        self._drops.clear()
        self._errors.clear()

    def response(self, rcode: int, n: int = 1) -> None:
        """`n` responses with `rcode` (n > 1: a batch, the UDP fast path's)."""
        c = self._responses.get(rcode)
        if c is None:
            c = self._responses[rcode] = _responses.labels(self.name, RCODE_NAMES.get(rcode, str(rcode)))
        c.inc(n)

    def drop(self, reason: str) -> None:
        c = self._drops.get(reason)
        if c is None:
            c = self._drops[reason] = _drops.labels(self.name, reason)
        c.inc()

    def error(self, reason: str) -> None:
        c = self._errors.get(reason)
        if c is None:
            c = self._errors[reason] = _errors.labels(self.name, reason)
        c.inc()

    def refused_connection(self, peer: object, live: int) -> None:
        """A connection turned away because `live` were open (limits.dns_tcp_max_clients, checked
        with meshgate.conns.admit by every stream listener: TCP/DoT, DoH/ODoH, DoQ)."""
        self.drop("max_clients")
        rlog.debug(f"{self.name} max", "dns %s: refusing %s: %d connections (limits.dns_tcp_max_clients)",
                   self.name, peer, live)

    def snapshot(self) -> dict[str, object]:
        # Read from the families, not this object's own children: with dns.workers > 1 the
        # counts other processes reported are merged into the same families (dns/worker_pool.py).
        return {
            "queries": self.queries.value,
            "responses": self._by(_responses),
            "drops": self._by(_drops),
            "errors": self._by(_errors),
        }

    def _by(self, family: CounterFamily) -> dict[str, int]:
        return {values[1]: c.value for values, c in family.children() if values[0] == self.name}
