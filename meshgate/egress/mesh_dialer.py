"""The dialer when the node is in a mesh: pick where a destination leaves.

Per destination (docs/ARCHITECTURE.md, "A SOCKS CONNECT"):

1. `<name>.<dns.zone>` is that node's virtual IP; a static `dns.records`
   name is its address. Both are then routed as addresses.
2. An address: the route table says self / peer (virtual IP) / cidr (longest
   prefix) / exit. Own node → this node's egress (own virtual IP means
   127.0.0.1); another node → a mesh stream to it, which connects there.
3. Any other name travels unresolved to the exit (socks5h semantics), so it
   resolves where the traffic leaves; with no exit, `mesh.direct_fallback`
   resolves and connects from this host, else reply 0x03.

The mesh stream's transport behaves like an asyncio transport, so the relay
in server.py does not know which kind of upstream it has.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections.abc import Callable
from typing import Any, cast

from meshgate import replies
from meshgate.buffers import BufferPool
from meshgate.config import Config, MeshConfig
from meshgate.egress.dialer import Dialer, DialError, OnDatagram, UdpEgress, UdpOpener
from meshgate.egress.rules import ExitRules
from meshgate.logs import RateLimitedLog
from meshgate.mesh.routing import Route
from meshgate.mesh.service import MeshService
from meshgate.mesh.splice import EgressConnect
from meshgate.mesh.streams import StreamError
from meshgate.metrics import REGISTRY
from meshgate.policy import IPAddress, in_any

_routed = REGISTRY.counter(
    "meshgate_socks5_routed_total", "SOCKS5 CONNECT destinations by where they leave", ("via",)
)
# Used only to ask "which node carries generic internet traffic" when a name
# has no address yet: any public address answers the longest-prefix question
# the same way for a 0.0.0.0/0 proxy CIDR.
_PROBE_V4 = ipaddress.IPv4Address("1.1.1.1")


_rlog = RateLimitedLog(logging.getLogger("meshgate.egress"))


class MeshDialer(Dialer):
    def __init__(
        self, config: Config, mesh: MeshService, egress: EgressConnect, open_udp: UdpOpener, **kw: Any
    ) -> None:
        super().__init__(**kw)
        self.mesh = mesh
        self.zone = config.dns.zone.rstrip(".")
        self.records = {name.rstrip("."): ipaddress.ip_address(a) for name, a in config.dns.records}
        # with mesh.exit_nodes set the user chose where traffic leaves: when no exit is
        # reachable the portal refuses, it never leaves from this host instead (nor resolves
        # the name here, a DNS leak)
        self.set_exits(config.mesh)
        # this node's own egress (the connector the mesh has), for routes that end here
        self.egress = egress
        self._open_udp = open_udp
        self.rules = ExitRules(config)

    def set_exits(self, mesh: MeshConfig) -> None:
        """`mesh.exit_nodes` and `mesh.direct_fallback` (at start, and a reload's): connections
        dialed from now on follow them."""
        self.exit_required = bool(mesh.exit_nodes)
        self.direct_fallback = mesh.direct_fallback and not self.exit_required

    def set_records(self, records: tuple[tuple[str, str], ...]) -> None:
        """Reloaded `dns.records`: names dialed from now on resolve through them."""
        self.records = {name.rstrip("."): ipaddress.ip_address(a) for name, a in records}

    def mesh_name(self, host: str) -> IPAddress | None:
        """Address for a mesh or static name; DialError(0x04) for an unknown name in the zone."""
        name = host.lower().rstrip(".")
        if name in self.records:
            return self.records[name]
        if name.endswith("." + self.zone):
            label = name[: -len(self.zone) - 1]
            entry = self.mesh.name_table().get(label)
            if entry is None:
                raise DialError(replies.HOST_UNREACHABLE, f"no node named {label!r} in {self.zone}")
            v4, v6 = entry
            ip: IPAddress | None = v4 or v6
            if ip is None:
                raise DialError(replies.HOST_UNREACHABLE, f"node {label!r} has no virtual IP")
            return ip
        return None

    async def resolve(self, host: str, port: int) -> list[IPAddress]:
        """Mesh and static names first (UDP ASSOCIATE resolves through here), then DNS."""
        try:
            return [ipaddress.ip_address(host)]
        except ValueError:
            pass
        ip = self.mesh_name(host)
        return [ip] if ip is not None else await super().resolve(host, port)

    def route_name(self) -> Route | None:
        """Where a name with no mesh meaning leaves: an exit, or a catch-all proxy CIDR."""
        route: Route | None = self.mesh.table.exit_route(bool(self.mesh.policy_flag))
        if route is None:
            route = self.mesh.lookup(_PROBE_V4)
        return route

    async def open_udp(self, on_datagram: OnDatagram, pool: BufferPool) -> UdpEgress:
        """UDP ASSOCIATE: datagrams ride mesh datagrams to the node where they leave
        (the portal's mesh UDP, gateway/mesh_udp.py, handed in by the node)."""
        return await self._open_udp(on_datagram, pool)

    async def dial(
        self, host: str, port: int, protocol_factory: Callable[[], asyncio.BaseProtocol]
    ) -> tuple[asyncio.Transport, asyncio.BaseProtocol, tuple[str, int]]:
        try:
            ip: IPAddress | None = ipaddress.ip_address(host)
        except ValueError:
            ip = self.mesh_name(host)
        if ip is not None:
            host = str(ip)
            route = self.mesh.lookup(ip)
        else:
            route = self.route_name()
        if route is None:
            if self.direct_fallback and not (ip is not None and in_any(ip, self.rules.vnets)):
                _routed.labels("direct").inc()
                return await super().dial(host, port, protocol_factory)
            _routed.labels("unreachable").inc()
            if self.exit_required:
                _rlog.warning("no_exit", "no exit of mesh.exit_nodes is reachable: %s:%d refused (0x03),"
                              " not sent from this host", host, port)
            raise DialError(replies.NETWORK_UNREACHABLE, f"no mesh route to {host} and no exit node")
        try:
            if route.node_id == self.mesh.node_id:
                _routed.labels("self").inc()
                transport, protocol = await self.egress(host, port, protocol_factory)
                sock = transport.get_extra_info("sockname")
                bound = (str(sock[0]), int(sock[1])) if sock else ("0.0.0.0", 0)
            else:
                _routed.labels(route.kind).inc()
                transport, protocol = await self.mesh.open_stream(route.node_id, host, port, protocol_factory)
                bound = (str(next(iter(self.rules.own_ips), "0.0.0.0")), 0)
        except StreamError as e:
            raise DialError(e.code, f"{host}:{port} via {route.name or route.node_id}: {e}") from None
        # uvloop's transports are not asyncio.Transport subclasses: cast, don't assert
        transport = cast(asyncio.Transport, transport)
        protocol = cast(asyncio.Protocol, protocol)
        return transport, protocol, bound
