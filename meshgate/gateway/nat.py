"""The UDP ASSOCIATE NAT table, sans-I/O (time comes in as `now`).

Forward keys are what the client wrote in the SOCKS UDP header, as a tuple
of ints and bytes: `(atyp, addr, port)`; no address is formatted as text on
the per-packet path. Each entry carries the socket address its datagrams go
to, computed once when the entry is made (a resolved name, an IPv4-mapped
IPv6 address unwrapped to IPv4). Replies arrive from a socket address and map
back to the forward key, so the client sees the address it asked for:

* an IPv4-mapped IPv6 target (`::ffff:a.b.c.d`) is reached over IPv4 and its
  replies are reported with ATYP 4 and the mapped address;
* a domain target keeps precedence: if the client talks to `name:53` and to
  the address `name` resolved to, replies from that address are reported
  under the name (the client asked for the name first, or asked for both).

The table is bounded (`max_targets`, least recently used evicted and counted)
and entries expire after `idle_timeout` seconds without traffic.
"""

from __future__ import annotations

import ipaddress
from collections import OrderedDict
from dataclasses import dataclass

from meshgate.gateway.socks5 import ATYP_DOMAIN, ATYP_IPV4, ATYP_IPV6, build_udp_header

TargetKey = tuple[int, bytes, int]  # (atyp, raw address or name, port)
SockAddr = tuple[str, int]


@dataclass(slots=True)
class NatEntry:
    key: TargetKey
    sockaddr: SockAddr
    family: int  # 4 or 6: which egress socket carries it
    last_used: float
    header: bytes  # the SOCKS UDP header for replies, built once per entry


def sockaddr_for(atyp: int, addr: bytes, port: int) -> tuple[SockAddr, int]:
    """The socket address and IP version for an address target (not a name)."""
    if atyp == ATYP_IPV4:
        return (str(ipaddress.IPv4Address(addr)), port), 4
    if atyp == ATYP_IPV6:
        ip6 = ipaddress.IPv6Address(addr)
        if ip6.ipv4_mapped is not None:
            return (str(ip6.ipv4_mapped), port), 4
        return (str(ip6), port), 6
    raise ValueError("a domain target needs resolving first")


class NatTable:
    def __init__(self, max_targets: int, idle_timeout: float) -> None:
        self.max_targets = max_targets
        self.idle_timeout = idle_timeout
        self._entries: OrderedDict[TargetKey, NatEntry] = OrderedDict()
        self._reverse: dict[SockAddr, TargetKey] = {}
        self.evicted = 0  # least-recently-used entries pushed out by a full table
        self.expired = 0

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, key: TargetKey, now: float) -> NatEntry | None:
        """The entry for an outgoing datagram, refreshed; None if there is none yet."""
        entry = self._entries.get(key)
        if entry is not None:
            entry.last_used = now
            self._entries.move_to_end(key)
        return entry

    def add(self, key: TargetKey, sockaddr: SockAddr, family: int, now: float) -> NatEntry:
        old = self._entries.pop(key, None)
        if old is not None:
            self._unlink(old)
        while len(self._entries) >= self.max_targets:
            _, victim = self._entries.popitem(last=False)
            self._unlink(victim)
            self.evicted += 1
        entry = NatEntry(key, sockaddr, family, now, build_udp_header(*key))
        self._entries[key] = entry
        current = self._reverse.get(sockaddr)
        if current is None or key[0] == ATYP_DOMAIN or current[0] != ATYP_DOMAIN:
            # A name wins over an address for the same socket address; between
            # two names (or two addresses) the newest wins.
            self._reverse[sockaddr] = key
        return entry

    def add_address(self, key: TargetKey, now: float) -> NatEntry:
        sockaddr, family = sockaddr_for(*key)
        return self.add(key, sockaddr, family, now)

    def reply_entry(self, sockaddr: SockAddr, now: float) -> NatEntry | None:
        """The entry a reply from `sockaddr` belongs to (None: unsolicited); its
        `header` names the target as the client asked for it."""
        key = self._reverse.get(sockaddr)
        if key is None:
            return None
        entry = self._entries[key]
        entry.last_used = now
        self._entries.move_to_end(key)
        return entry

    def expire(self, now: float) -> int:
        """Drop entries idle for longer than idle_timeout; returns how many."""
        limit = now - self.idle_timeout
        n = 0
        while self._entries:
            key, entry = next(iter(self._entries.items()))
            if entry.last_used > limit:
                break  # ordered by last use: the rest are fresher
            del self._entries[key]
            self._unlink(entry)
            n += 1
        self.expired += n
        return n

    def _unlink(self, entry: NatEntry) -> None:
        if self._reverse.get(entry.sockaddr) != entry.key:
            return
        del self._reverse[entry.sockaddr]
        # Another target may share the socket address (a name and its address):
        # hand the reverse mapping to it, a name first. Eviction and expiry
        # only, so the scan over a bounded table is off the per-packet path.
        best: NatEntry | None = None
        for other in self._entries.values():
            if other.sockaddr == entry.sockaddr and (best is None or other.key[0] == ATYP_DOMAIN):
                best = other
        if best is not None:
            self._reverse[entry.sockaddr] = best.key

    def clear(self) -> None:
        self._entries.clear()
        self._reverse.clear()


__all__ = ["ATYP_DOMAIN", "ATYP_IPV4", "ATYP_IPV6", "NatEntry", "NatTable", "SockAddr", "TargetKey"]
