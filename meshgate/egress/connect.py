"""Egress where traffic leaves the mesh: own virtual IP, proxy CIDRs, exit.

`connector(node)` is the node's `MeshService.egress_connect`: it serves
streams that arrive from the mesh and the portal's own traffic when this
node is itself the owner or the exit, so both obey one policy.

- The node's own virtual IPs mean its loopback (127.0.0.1 / ::1).
- A mapped proxy CIDR is translated back to the real prefix, host bits kept.
- Names resolve here (through the node's DNS pipeline when it has one).
- After resolution every address must be in one of this node's proxy CIDRs,
  or this node must offer exit (`mesh.exit_node`, or a `0.0.0.0/0` / `::/0`
  proxy CIDR); then `[exit]` (EgressPolicy) decides. A refusal is reply 0x02.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from typing import Any

from meshgate.config import Config, IPNetwork
from meshgate.gateway.dialer import Dialer, DialError
from meshgate.logs import RateLimitedLog
from meshgate.mesh.egress import EgressConnect, ProtocolFactory, error_code
from meshgate.mesh.streams import HOST_UNREACHABLE, NOT_ALLOWED, TTL_EXPIRED, StreamError
from meshgate.metrics import REGISTRY
from meshgate.policy import EgressPolicy, IPAddress, in_any, parse_ip

log = logging.getLogger("meshgate.mesh.exit")
_rlog = RateLimitedLog(log)
_refused = REGISTRY.counter(
    "meshgate_egress_refused_total", "Egress refused by policy where traffic leaves the mesh", ("reason",)
)
_egress = REGISTRY.counter("meshgate_egress_connects_total", "Egress connections by outcome", ("outcome",))


class ExitRules:
    """Pure decisions: translation and whether an address may be reached here."""

    def __init__(self, config: Config) -> None:
        mesh = config.mesh
        ifaces = [i for i in (config.node.ipv4, config.node.ipv6) if i is not None]
        self.own_ips: set[IPAddress] = {i.ip for i in ifaces}
        # The mesh's own virtual subnets: an address there with no route (unassigned,
        # or not yet converged) must never leave by the host's default route.
        self.vnets: tuple[IPNetwork, ...] = tuple(i.network for i in ifaces)
        self.maps = [(c.mapped, c.real) for c in mesh.proxy_cidrs if c.mapped is not None]
        # A catch-all proxy CIDR makes this node an exit for that family, not
        # "owner of everything": the exit policy still applies there.
        self.exit_families = {c.real.version for c in mesh.proxy_cidrs if c.real.prefixlen == 0}
        if mesh.exit_node:
            self.exit_families |= {4, 6}
        self.own_nets = tuple(c.real for c in mesh.proxy_cidrs if c.real.prefixlen > 0)
        self.policy = EgressPolicy(config.exit, [c for c in mesh.proxy_cidrs if c.real.prefixlen > 0])

    def translate(self, ip: IPAddress) -> IPAddress:
        for mapped, real in self.maps:
            if ip.version == mapped.version and ip in mapped:
                offset = int(ip) - int(mapped.network_address)
                return ipaddress.ip_address(int(real.network_address) + offset)
        return ip

    def check(self, ip: IPAddress) -> str | None:
        """None if allowed; else the reason (for logs and counters, never a secret)."""
        if not in_any(ip, self.own_nets) and ip.version not in self.exit_families:
            return f"{ip} is not in this node's proxy_cidrs and the node is not an exit (mesh.exit_node)"
        return self.policy.check(ip)


def connector(node: Any, timeout: float | None = None) -> EgressConnect:
    """The policy-checked egress for `node` (reads `node.resolver` at call time)."""
    config: Config = node.config
    rules = ExitRules(config)
    connect_timeout = timeout if timeout is not None else config.limits.socks5_connect_timeout

    async def resolve(host: str, port: int) -> list[IPAddress]:
        # the dialer's resolution (node's DNS pipeline, else getaddrinfo); node.resolver
        # is read per call because the DNS service is built after the mesh
        try:
            return await Dialer(resolver=node.resolver).resolve(host, port)
        except DialError as e:
            raise StreamError(e.reply, str(e)) from None

    async def connect(host: str, port: int, factory: ProtocolFactory) -> tuple[asyncio.BaseTransport, Any]:
        loop = asyncio.get_running_loop()
        ip = parse_ip(host)
        if ip is not None and ip in rules.own_ips:
            # The node's own virtual IP is the node itself: its loopback services.
            target = "::1" if ip.version == 6 else "127.0.0.1"
            return await _connect_one(loop, factory, target, port, host, connect_timeout)
        addrs = [rules.translate(ip)] if ip is not None else await resolve(host, port)
        if not addrs:
            raise StreamError(HOST_UNREACHABLE, f"no address for {host!r}")
        allowed: list[IPAddress] = []
        reason = ""
        for a in addrs:
            why = rules.check(a)
            if why is None:
                allowed.append(a)
            else:
                reason = reason or why
        if not allowed:
            _refused.labels("policy").inc()
            _rlog.debug(f"refused:{host}", "egress to %s:%d refused: %s", host, port, reason)
            raise StreamError(NOT_ALLOWED, f"egress to {host}:{port} refused: {reason}")
        last: StreamError | None = None
        for a in allowed:
            try:
                return await _connect_one(loop, factory, str(a), port, host, connect_timeout)
            except StreamError as e:
                last = e
        assert last is not None
        raise last

    return connect


async def _connect_one(
    loop: asyncio.AbstractEventLoop, factory: ProtocolFactory, target: str, port: int, asked: str,
    timeout: float,
) -> tuple[asyncio.BaseTransport, Any]:
    try:
        result = await asyncio.wait_for(loop.create_connection(factory, target, port), timeout)
    except TimeoutError:
        _egress.labels("timeout").inc()
        raise StreamError(TTL_EXPIRED, f"connect to {asked}:{port} timed out") from None
    except OSError as e:
        _egress.labels("error").inc()
        raise StreamError(error_code(e), f"connect to {asked}:{port} failed: {e.strerror or e}") from None
    _egress.labels("ok").inc()
    return result
