"""A node: the services one config asks for, started and stopped in order.

Each component package exposes `build(node) -> Service`. The node owns the
shared pieces components reach each other through: `mesh` (routes, streams),
`resolver` (the DNS pipeline; the gateway's bootstrap lookups go through it)
and `dialer` (where a SOCKS destination goes).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Protocol

from meshgate import __version__
from meshgate.config import Config
from meshgate.memory import Trimmer

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
        self.mesh: Any = None  # meshgate.mesh.service.MeshService when the mesh is on
        self.resolver: Any = None  # meshgate.dns.resolver pipeline when DNS is on
        self.dialer: Any = None  # meshgate.gateway.dialer.Dialer
        self.trimmer = Trimmer(config.limits.memory_trim_interval)
        self.udp_hub: Any = None  # meshgate.mesh.udp_relay.UdpHub on mesh nodes
        self._stopped = asyncio.Event()

    def _plan(self) -> list[Service]:
        cfg = self.config
        plan: list[Service] = []
        if cfg.mesh.listen or cfg.mesh.peers or cfg.node.ipv4 or cfg.node.ipv6:
            from meshgate.mesh import exit as mesh_exit
            from meshgate.mesh import service as mesh_service

            self.mesh = mesh_service.build(self)
            # Streams arriving from the mesh leave through the exit/CIDR policy.
            self.mesh.egress_connect = mesh_exit.connector(self)
            plan.append(self.mesh)
        if cfg.dns.listeners or cfg.dns.upstreams or cfg.dns.records:
            from meshgate.dns import service as dns_service

            plan.append(dns_service.build(self))
        if cfg.socks5.enable:
            from meshgate.gateway import service as gateway_service

            plan.append(gateway_service.build(self))
        if cfg.tun.enable:
            from meshgate.mesh import tun

            plan.append(tun.build(self))
        if cfg.admin.enable:
            from meshgate import admin

            plan.append(admin.build(self))
        if self.mesh is not None:
            self._wire_mesh()
        return plan

    def _wire_mesh(self) -> None:
        """Give mesh-aware routing to what was built without a portal: a node
        with no SOCKS5 portal still resolves through upstreams on other nodes."""
        from meshgate.gateway.mesh_dialer import MeshDialer

        if self.dialer is None:
            self.dialer = MeshDialer.for_node(self)
        if self.resolver is None:
            return  # a portal-only node: keep the DNS client stack (aioquic, h2, OpenSSL) unloaded
        from meshgate.dns.upstream import TcpUpstream

        for up in getattr(self.resolver, "upstreams", []):
            if isinstance(up, TcpUpstream):
                up.node = self

    async def start(self) -> None:
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
                from meshgate.mesh.udp_relay import UdpHub

                UdpHub.for_node(self)

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
