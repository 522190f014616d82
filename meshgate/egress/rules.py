"""Exit rules where traffic leaves the mesh: pure decisions, no I/O.

- The node's own virtual IPs reach only what `[serve]` publishes there, port by port
  (e.g. 8000 -> 127.0.0.1:8000); nothing else on the node (its admin API, a database kept
  on loopback) is reachable through them.
- A mapped proxy CIDR is translated back to the real prefix, host bits kept.
- After resolution every address must be in one of this node's proxy CIDRs,
  or this node must offer exit (`mesh.exit_node`, or a `0.0.0.0/0` / `::/0`
  proxy CIDR); then `[exit]` (EgressPolicy) decides.
"""

from __future__ import annotations

import ipaddress

from meshgate.config import Config, IPNetwork
from meshgate.egress.acl import Acl
from meshgate.policy import EgressPolicy, IPAddress, in_any


class ExitRules:
    """Translation and whether an address may be reached from here."""

    def __init__(self, config: Config) -> None:
        ifaces = [i for i in (config.node.ipv4, config.node.ipv6) if i is not None]
        self.own_ips: set[IPAddress] = {i.ip for i in ifaces}
        # The mesh's own virtual subnets: an address there with no route (unassigned,
        # or not yet converged) must never leave by the host's default route.
        self.vnets: tuple[IPNetwork, ...] = tuple(i.network for i in ifaces)
        self.set_offers(config)

    def set_offers(self, config: Config) -> None:
        """What this node offers (`mesh.proxy_cidrs`, `mesh.exit_node`) with the `[exit]` policy,
        `[serve]` and `[[acl]]` that depend on it: at start, and a reload's. Each attribute is
        one assignment, read per connection: those checked from now on see the new ones."""
        mesh = config.mesh
        self.maps = [(c.mapped, c.real) for c in mesh.proxy_cidrs if c.mapped is not None]
        # A catch-all proxy CIDR makes this node an exit for that family, not
        # "owner of everything": the exit policy still applies there.
        families = {c.real.version for c in mesh.proxy_cidrs if c.real.prefixlen == 0}
        self.exit_families = families | {4, 6} if mesh.exit_node else families
        self.own_nets = tuple(c.real for c in mesh.proxy_cidrs if c.real.prefixlen > 0)
        self._own_cidrs = [c for c in mesh.proxy_cidrs if c.real.prefixlen > 0]
        self.policy = EgressPolicy(config.exit, self._own_cidrs)
        self.set_access(config)

    def set_access(self, config: Config) -> None:
        """A reloaded [serve] and [[acl]]: streams and datagrams checked from now on use them."""
        self.served: dict[int, tuple[str, int]] = {port: (t.host, t.port) for port, t in config.serve}
        self.acl = Acl(config.acl, self.own_nets)

    def translate(self, ip: IPAddress) -> IPAddress:
        for mapped, real in self.maps:
            if ip.version == mapped.version and ip in mapped:
                offset = int(ip) - int(mapped.network_address)
                return ipaddress.ip_address(int(real.network_address) + offset)
        return ip

    def served_target(self, port: int) -> tuple[str, int] | None:
        """Where a connection to this node's virtual IP at `port` goes, or None: not published."""
        return self.served.get(port)

    def check(self, ip: IPAddress) -> str | None:
        """None if allowed; else the reason (for logs and counters, never a secret)."""
        if not in_any(ip, self.own_nets) and ip.version not in self.exit_families:
            return f"{ip} is not in this node's proxy_cidrs and the node is not an exit (mesh.exit_node)"
        return self.policy.check(ip)
