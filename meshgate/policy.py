"""Egress policy for exits and proxy-CIDR owners (config `[exit]`).

Pure logic: an address in, allowed or a reason out. Applied after name
resolution on the node where traffic leaves the mesh, so a name that
resolves to a private address is refused like the address itself (no
DNS-rebinding bypass).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

from meshgate.config import ExitConfig, IPNetwork, ProxyCidr

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

# Loopback, link-local, private, shared (CGNAT), benchmarking, multicast and
# reserved ranges (RFC 6890): what sits on the exit's own side, which an exit
# must not reach on a user's behalf by default. The documentation ranges
# (192.0.2.0/24, 198.51.100.0/24, 203.0.113.0/24, 2001:db8::/32) are left
# out: they lead nowhere real, and test networks use them as "the internet".
BUILTIN_DENY: tuple[IPNetwork, ...] = tuple(
    ipaddress.ip_network(n)
    for n in (
        "0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16",
        "172.16.0.0/12", "192.0.0.0/24", "192.168.0.0/16", "198.18.0.0/15",
        "224.0.0.0/4", "240.0.0.0/4",
        "::/128", "::1/128", "64:ff9b:1::/48", "100::/64", "fc00::/7",
        "fe80::/10", "fec0::/10", "ff00::/8",
    )
)


# The node's own loopback: reached only through a proxy CIDR that lies inside it (a deliberate
# "proxy this loopback subnet"), never because a broader CIDR (0.0.0.0/1) or
# exit.allow_private happens to cover it; [serve] is how a node publishes loopback services.
LOOPBACK: tuple[IPNetwork, ...] = (ipaddress.ip_network("127.0.0.0/8"), ipaddress.ip_network("::1/128"))


def parse_ip(text: str) -> IPAddress | None:
    """The address `text` names, or None for a host name."""
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


def in_any(addr: IPAddress, nets: Iterable[IPNetwork]) -> bool:
    return any(addr.version == n.version and addr in n for n in nets)


class EgressPolicy:
    def __init__(self, cfg: ExitConfig, own_cidrs: Iterable[ProxyCidr] = ()) -> None:
        self.allow = cfg.allow
        self.deny = cfg.deny
        self.allow_private = cfg.allow_private
        # The real side of our own proxy CIDRs: reaching them is the point.
        self.own = tuple(c.real for c in own_cidrs)

    def check(self, addr: IPAddress) -> str | None:
        """None if `addr` may be reached; otherwise the reason it may not."""
        if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
            addr = addr.ipv4_mapped  # judge ::ffff:a.b.c.d as a.b.c.d
        if in_any(addr, self.deny):
            return f"{addr} is in exit.deny"
        if in_any(addr, LOOPBACK) and not any(
            addr.version == n.version and addr in n and n.subnet_of(lo)  # type: ignore[arg-type]
            for n in self.own for lo in LOOPBACK if lo.version == n.version
        ):
            return (f"{addr} is this node's loopback: only a proxy CIDR inside 127.0.0.0/8 (or ::1)"
                    " reaches it; [serve] publishes loopback services")
        if in_any(addr, self.own):
            return None
        if not self.allow_private and in_any(addr, BUILTIN_DENY):
            return f"{addr} is a loopback/private/special address (set exit.allow_private to permit)"
        if not in_any(addr, self.allow):
            return f"{addr} is not in exit.allow"
        return None
