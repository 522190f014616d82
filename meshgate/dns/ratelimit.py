"""Per-client query rate limit for DNS listeners (issue 16 item 9), sans I/O: peers and times in,
verdicts out.

One token bucket per client prefix (IPv4 /prefix_v4, IPv6 /prefix_v6: one host of an IPv6 /56
can take any address in it), refilled at `rate` tokens a second up to `burst`; each query takes
one. Over the limit the verdict is SLIP for every `slip`-th limited query of that client and DROP
for the rest (slip 0: always DROP). On UDP a SLIP is answered with an empty TC response, as
dnsdist's and Knot's rate limiting do: a real client retries over TCP, a spoofed victim receives a
reply no bigger than the query (no amplification), and a flood costs the listener no upstream
work. Stream transports (TCP, DoT, DoH, DoQ) carry no spoofed sources, so the listener answers
REFUSED there (a client learns to go elsewhere, nothing hangs).

The table is bounded (`max_clients` prefixes): when full, buckets that have refilled (idle long
enough to be new again) go first, then the oldest half. Addresses to prefixes go through a small
cache, so a query costs two dict look-ups and a little arithmetic.
"""

from __future__ import annotations

import ipaddress
from typing import Any

from meshgate.config import DnsListenerConfig, LimitsConfig
from meshgate.netfmt import is_loopback

OK, SLIP, DROP = 0, 1, 2
_KEYS_MAX = 65536


class ClientRateLimit:
    __slots__ = ("_buckets", "_keys", "burst", "max_clients", "prefix_v4", "prefix_v6", "rate", "slip")

    def __init__(self, rate: float, burst: int, slip: int, *, prefix_v4: int = 32, prefix_v6: int = 56,
                 max_clients: int = 65536) -> None:
        self.rate = rate
        self.burst = float(max(burst, 1))
        self.slip = slip
        self.prefix_v4 = prefix_v4
        self.prefix_v6 = prefix_v6
        self.max_clients = max_clients
        # prefix -> [tokens, last refill time, limited queries so far]
        self._buckets: dict[str, list[float]] = {}
        self._keys: dict[str, str] = {}  # address -> its prefix

    def __len__(self) -> int:
        return len(self._buckets)

    def key(self, host: str) -> str:
        key = self._keys.get(host)
        if key is None:
            try:
                addr = ipaddress.ip_address(host.partition("%")[0])
            except ValueError:
                key = host
            else:
                bits = self.prefix_v4 if addr.version == 4 else self.prefix_v6
                key = host if bits >= addr.max_prefixlen else str(
                    ipaddress.ip_network(f"{addr}/{bits}", strict=False))
            if len(self._keys) >= _KEYS_MAX:
                self._keys.clear()
            self._keys[host] = key
        return key

    def check(self, peer: Any, now: float) -> int:
        """OK, SLIP or DROP for one query from `peer` (a socket address tuple; anything else,
        such as the anonymous ODoH peer, is never limited)."""
        if type(peer) is not tuple or not peer:
            return OK
        key = self.key(peer[0])
        b = self._buckets.get(key)
        if b is None:
            if len(self._buckets) >= self.max_clients:
                self._evict(now)
            self._buckets[key] = [self.burst - 1.0, now, 0.0]
            return OK
        tokens = b[0] + (now - b[1]) * self.rate
        if tokens > self.burst:
            tokens = self.burst
        b[1] = now
        if tokens >= 1.0:
            b[0] = tokens - 1.0
            return OK
        b[0] = tokens
        b[2] += 1.0
        if self.slip and b[2] % self.slip == 0:
            return SLIP
        return DROP

    def _evict(self, now: float) -> None:
        full = self.burst / self.rate if self.rate > 0 else float("inf")
        buckets = self._buckets
        for k in [k for k, b in buckets.items() if now - b[1] >= full]:
            del buckets[k]
        if len(buckets) >= self.max_clients:
            for k in list(buckets)[: max(len(buckets) // 2, 1)]:
                del buckets[k]


def enabled(cfg: DnsListenerConfig) -> bool:
    """The listener's `rate_limit`, or by default: on when it is bound off loopback."""
    if cfg.rate_limit is not None:
        return cfg.rate_limit
    return not is_loopback(cfg.listen.host)


def for_listener(cfg: DnsListenerConfig, limits: LimitsConfig) -> ClientRateLimit | None:
    if not enabled(cfg) or limits.dns_client_qps <= 0:
        return None
    return ClientRateLimit(limits.dns_client_qps, limits.dns_client_burst, limits.dns_client_slip,
                           prefix_v4=limits.dns_client_prefix_v4, prefix_v6=limits.dns_client_prefix_v6,
                           max_clients=limits.dns_client_table)
