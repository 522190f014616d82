"""A node: the composition root, the one module that knows every package.

`Node(config)` builds what the config asks for, in order, and hands each
component what it needs in its constructor; no component reaches back into
the node. The seams:

- the DNS pipeline (`resolver`), which the gateway's and the exit's name
  lookups go through, asking the mesh for its name table and for a way to
  reach an upstream at another node's address;
- the egress connector (egress/connect.py): the policy-checked connect the
  mesh serves the streams that end here with, and the portal uses when this
  node is itself where a destination leaves;
- the mesh (`mesh`), handed that connector;
- one dialer (`dialer`): a MeshDialer on a mesh node, else a local Dialer;
- the services: mesh, DNS, SOCKS5 portal, HTTP proxy, TUN, admin, started in that order
  and stopped in reverse.

Packages are imported where they are built, not at the top: a portal-only
node never loads the DNS client stack (aioquic, h2, pyOpenSSL), a node without
the mesh never loads the Noise/link code (resident memory, docs/OPERATIONS.md).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import time
from typing import TYPE_CHECKING, Any, Protocol

from meshgate import __version__
from meshgate.buffers import BufferPool
from meshgate.config import Config
from meshgate.egress.dialer import Dialer, OnDatagram, UdpEgress
from meshgate.memory import Trimmer
from meshgate.statedir import StateDirLock

if TYPE_CHECKING:
    from meshgate.dns.resolver import Pipeline
    from meshgate.dns.upstream import Dial
    from meshgate.gateway.mesh_udp import UdpHub
    from meshgate.mesh.service import MeshService

log = logging.getLogger("meshgate.node")


class Service(Protocol):
    name: str

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def status(self) -> dict[str, Any]: ...


class Node:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.started_at = time.time()
        self.services: list[Service] = []
        self.trimmer = Trimmer(config.limits.memory_trim_interval)
        self.state_lock = StateDirLock(config.state_path)
        self.mesh: MeshService | None = None
        self.resolver: Pipeline | None = None
        self.dialer: Dialer | None = None
        # SOCKS UDP over the mesh, both sides: made once the mesh runs (it needs the loop)
        self.udp_hub: UdpHub | None = None
        self._stopped = asyncio.Event()

    def _plan(self) -> list[Service]:
        cfg = self.config
        limits = cfg.limits
        mesh_on = bool(cfg.mesh.listen or cfg.mesh.peers or cfg.node.ipv4 or cfg.node.ipv6)
        plan: list[Service] = []
        dns = cfg.dns
        if dns.listeners or dns.upstreams or dns.records or dns.routes or dns.blocklist.lists:
            from meshgate.dns.resolver import Pipeline

            self.resolver = Pipeline(
                cfg,
                names=self._mesh_names if mesh_on else None,
                upstream_route=self._upstream_route if mesh_on else None,
            )
        dial_kw: dict[str, Any] = {
            "connect_timeout": limits.socks5_connect_timeout,
            "resolver": self.resolver,
            "write_high_water": limits.socks5_write_high_water,
        }
        if mesh_on:
            from meshgate.egress.connect import connector
            from meshgate.egress.mesh_dialer import MeshDialer
            from meshgate.mesh.service import MeshService

            # names resolve where traffic leaves: through this node's pipeline, else the host's
            egress = connector(cfg, Dialer(resolver=self.resolver).resolve)
            self.mesh = MeshService(cfg, egress=egress)
            self.dialer = MeshDialer(cfg, self.mesh, egress, self._open_mesh_udp, **dial_kw)
            plan.append(self.mesh)
        else:
            self.dialer = Dialer(**dial_kw)
        if self.resolver is not None:
            from meshgate.dns.service import DnsService

            plan.append(DnsService(cfg, self.resolver))
        if cfg.socks5.enable:
            from meshgate.gateway.service import Socks5Service

            plan.append(Socks5Service(cfg, self.dialer))
        if cfg.http_proxy.enable:
            from meshgate.gateway.http_proxy import HttpProxyService

            # the same dialer: HTTP destinations route through the mesh as SOCKS5 CONNECT's do
            routes = self.mesh.routes if self.mesh is not None else None
            plan.append(HttpProxyService(cfg, self.dialer, routes))
        if cfg.tun.enable:
            from meshgate.mesh.tun import TunService

            plan.append(TunService(cfg, self.mesh))
        if cfg.admin.enable:
            from meshgate.admin import AdminService

            plan.append(AdminService(cfg, self.status, self.mesh))
        return plan

    # --- what the components ask the node for, late-bound because each needs the other

    def _mesh_names(self) -> dict[str, tuple[Any, Any]]:
        assert self.mesh is not None  # given to the pipeline only on mesh nodes
        return self.mesh.name_table()

    def _upstream_route(self, host: str) -> Dial | None:
        """A DNS upstream at an address the mesh routes (a resolver on another node's
        virtual IP or behind its proxy CIDR) is reached over a mesh stream."""
        if self.mesh is None or self.dialer is None:
            return None
        try:
            route = self.mesh.lookup(ipaddress.ip_address(host))
        except ValueError:
            return None
        return self.dialer.connect if route is not None else None

    async def _open_mesh_udp(self, on_datagram: OnDatagram, pool: BufferPool) -> UdpEgress:
        assert self.udp_hub is not None  # made when the mesh started, before the portal
        return await self.udp_hub.open_portal(on_datagram, pool, self.config.mesh.direct_fallback)

    # --- lifecycle

    async def start(self) -> None:
        self.state_lock.acquire()  # before anything reads or writes the state dir
        self.trimmer.start()
        for svc in self._plan():
            try:
                await svc.start()
            except BaseException:
                await self.stop()
                raise
            self.services.append(svc)
            log.debug("started %s", svc.name)
            if svc is self.mesh:
                # Every mesh node can be where SOCKS UDP leaves the mesh.
                from meshgate.gateway.mesh_udp import UdpHub

                self.udp_hub = UdpHub(self.config, self.mesh)

    async def stop(self) -> None:
        self.trimmer.stop()
        if self.udp_hub is not None:
            self.udp_hub.close()
            self.udp_hub = None
        while self.services:
            svc = self.services.pop()
            try:
                await svc.stop()
            except Exception:
                log.exception("error while stopping %s", svc.name)
        self.state_lock.release()
        self._stopped.set()

    def status(self) -> dict[str, Any]:
        cfg = self.config.node
        out: dict[str, Any] = {
            "name": cfg.name,
            "network": cfg.network,
            "ipv4": str(cfg.ipv4.ip) if cfg.ipv4 else None,
            "ipv6": str(cfg.ipv6.ip) if cfg.ipv6 else None,
            "uptime": round(time.time() - self.started_at, 3),
            "version": __version__,
            "services": {s.name: s.status() for s in self.services},
        }
        if self.mesh is not None:
            out["id"] = self.mesh.node_id_text
        return out
