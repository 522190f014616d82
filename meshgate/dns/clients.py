"""The live connections of one DoH/ODoH listener, counted per client address.

`ClientConns` is the listener's connection set (what `stop()` aborts and the tests read) that
also counts how many connections each client address holds, so one address cannot take every
slot: limits.dns_tcp_max_clients_per_source (0: a quarter of limits.dns_tcp_max_clients, at
least 4). Without it, 64 connections each holding a request that never ended locked every other
DoH client out (issue 16 item 8). The per-address count follows the connection out in
`discard()`, which every connection_lost and the HTTP/1.1 -> HTTP/2 hand-over already call.

`admit_client(conns, conn, peer, limits, stats)` is the check both HTTP protocols make on
connection_made: the listener cap (meshgate.conns.admit), then the per-address cap when `conns`
is a ClientConns (a plain set, as unit tests pass, has only the first). A refusal is counted
(drops `max_clients` / `max_clients_per_source`) with a rate-limited debug line naming the peer.
"""

from __future__ import annotations

import logging
from typing import Any

from meshgate.config import LimitsConfig
from meshgate.conns import admit
from meshgate.dns.stats import ListenerStats
from meshgate.logs import RateLimitedLog

rlog = RateLimitedLog(logging.getLogger("meshgate.dns"))


def per_source_limit(limits: LimitsConfig) -> int:
    return limits.dns_tcp_max_clients_per_source or max(4, limits.dns_tcp_max_clients // 4)


def source_of(peer: Any) -> str:
    """The client address of a peername (host, port[, flow, scope]); the peer itself otherwise."""
    if isinstance(peer, tuple) and peer:
        return str(peer[0])
    return str(peer)


class ClientConns(set[Any]):
    def __init__(self, limits: LimitsConfig) -> None:
        super().__init__()
        self.limit = limits.dns_tcp_max_clients
        self.per_source = per_source_limit(limits)
        self._source: dict[Any, str] = {}
        self.by_source: dict[str, int] = {}

    def admit(self, conn: Any, peer: Any, stats: ListenerStats) -> bool:
        if len(self) >= self.limit:
            stats.refused_connection(peer, len(self))
            return False
        source = source_of(peer)
        held = self.by_source.get(source, 0)
        if held >= self.per_source:
            stats.drop("max_clients_per_source")
            rlog.debug(f"{stats.name} per_source {source}",
                       "dns %s: refusing %s: %d connections from %s already "
                       "(limits.dns_tcp_max_clients_per_source)", stats.name, peer, held, source)
            return False
        self.add(conn)
        self._source[conn] = source
        self.by_source[source] = held + 1
        return True

    def discard(self, conn: Any) -> None:
        super().discard(conn)
        source = self._source.pop(conn, None)
        if source is not None:
            left = self.by_source[source] - 1
            if left:
                self.by_source[source] = left
            else:
                del self.by_source[source]


def admit_client(conns: set[Any], conn: Any, peer: Any, limits: LimitsConfig, stats: ListenerStats) -> bool:
    """Take `conn` into `conns` unless a cap says no (counted and logged); False: refuse it."""
    if isinstance(conns, ClientConns):
        return conns.admit(conn, peer, stats)
    if admit(conns, conn, limits.dns_tcp_max_clients):
        return True
    stats.refused_connection(peer, len(conns))
    return False
