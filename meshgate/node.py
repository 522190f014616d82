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
- `reload()`: re-read the config it was started with (path, CLI overrides, the CLI's
  listener adjustment: handed in), diff it (reload.py) and hand each live change to the
  component that owns it through a small setter, or change nothing.

Packages are imported where they are built, not at the top: a portal-only
node never loads the DNS client stack (aioquic, h2, pyOpenSSL), a node without
the mesh never loads the Noise/link code (resident memory, docs/OPERATIONS.md).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from meshgate import __version__
from meshgate.buffers import BufferPool
from meshgate.config import Config, ConfigError
from meshgate.config import load as load_config
from meshgate.egress.dialer import Dialer, OnDatagram, UdpEgress
from meshgate.errors import StartupError
from meshgate.memory import Trimmer
from meshgate.reload import DNS_BLOCKLIST, DNS_UPSTREAMS, LIVE, MESH_EXITS, MESH_OFFERS, PORTAL_LIMITS, diff
from meshgate.statedir import StateDirLock

if TYPE_CHECKING:
    from meshgate.dns.mesh_dns import MeshDnsClient, MeshDnsRoutes, MeshDnsServer
    from meshgate.dns.mesh_odoh import MeshOdoh
    from meshgate.dns.resolver import Pipeline
    from meshgate.dns.service import DnsService
    from meshgate.dns.upstream import Dial
    from meshgate.egress.mesh_dialer import MeshDialer
    from meshgate.egress.rules import ExitRules
    from meshgate.gateway.http_proxy import HttpProxyService
    from meshgate.gateway.mesh_udp import UdpHub
    from meshgate.gateway.service import Socks5Service
    from meshgate.mesh.service import MeshService

log = logging.getLogger("meshgate.node")


class Service(Protocol):
    name: str

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def status(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class ReloadResult:
    """What `Node.reload` did: `applied` keys (all the changed ones) or nothing, with why.
    Key names and config problems only: never a value, so never a secret."""

    applied: bool
    changed: tuple[str, ...] = ()
    restart: tuple[str, ...] = ()  # changed keys that cannot change live
    problems: tuple[str, ...] = ()  # FILE:KEY: problem, as check-config prints them

    @property
    def message(self) -> str:
        if self.problems:
            return "invalid config, nothing changed:\n" + "\n".join(self.problems)
        if self.restart:
            return "nothing changed; restart to change: " + ", ".join(self.restart)
        if not self.changed:
            return "no changes"
        return "applied: " + ", ".join(self.changed)

    def as_dict(self) -> dict[str, Any]:
        return {"applied": self.applied, "changed": list(self.changed), "restart": list(self.restart),
                "problems": list(self.problems), "message": self.message}


class Node:
    def __init__(
        self,
        config: Config,
        *,
        config_path: str | None = None,
        overrides: Mapping[str, Any] | None = None,
        adjust: Callable[[Config], Config] | None = None,
    ) -> None:
        self.config = config
        # what `reload` re-reads: the file the node started with, the same CLI overrides and
        # the same after-load adjustment (cli.py's --doh/--doq/--dns listener moves)
        self.config_path = config_path
        self.overrides: Mapping[str, Any] = dict(overrides or {})
        self.adjust = adjust
        self.socks5: Socks5Service | None = None
        self.http_proxy: HttpProxyService | None = None
        self.exit_rules: ExitRules | None = None
        self.mesh_dialer: MeshDialer | None = None
        self.started_at = time.time()
        self.services: list[Service] = []
        self.trimmer = Trimmer(config.limits.memory_trim_interval)
        self.state_lock = StateDirLock(config.state_path)
        self.mesh: MeshService | None = None
        self.resolver: Pipeline | None = None
        self.dns_service: DnsService | None = None  # a reload hands its worker processes records
        self.dialer: Dialer | None = None
        # SOCKS UDP over the mesh, both sides: made once the mesh runs (it needs the loop)
        self.udp_hub: UdpHub | None = None
        self.mesh_dns_client: MeshDnsClient | None = None  # split DNS through the mesh, both ways
        self.mesh_dns_server: MeshDnsServer | None = None
        self.mesh_dns_routes: MeshDnsRoutes | None = None
        self.mesh_odoh: MeshOdoh | None = None  # ODoH through the mesh: asker, proxy, target
        self._stopped = asyncio.Event()

    def _plan(self) -> list[Service]:
        cfg = self.config
        limits = cfg.limits
        mesh_on = bool(cfg.mesh.listen or cfg.mesh.peers or cfg.node.ipv4 or cfg.node.ipv6)
        plan: list[Service] = []
        dns = cfg.dns
        if (dns.listeners or dns.upstreams or dns.records or dns.routes or dns.blocklist.lists
                or dns.serve_suffixes):
            from meshgate.dns.resolver import Pipeline

            mesh_dns = None
            if mesh_on and dns.mesh_routes:
                from meshgate.dns.mesh_dns import MeshDnsClient, MeshDnsRoutes
                from meshgate.mesh.channels import DNS_QUERY

                # names under suffixes other nodes serve are asked there, over the mesh
                self.mesh_dns_client = MeshDnsClient(self._mesh_send, DNS_QUERY,
                                                     limits.dns_upstream_max_queries)
                mesh_dns = self.mesh_dns_routes = MeshDnsRoutes(
                    self.mesh_dns_client, lambda: self._mesh().dns_servers(), dns.serve_suffixes)
            if mesh_on:
                from meshgate.dns.mesh_odoh import MeshOdoh

                # odoh-mesh:// upstreams, and the proxy / target roles (dns.mesh_odoh_*)
                self.mesh_odoh = MeshOdoh(self._mesh_odoh_send, self._find_node, limits,
                                          proxy=dns.mesh_odoh_proxy)
            self.resolver = Pipeline(
                cfg,
                names=self._mesh_names if mesh_on else None,
                upstream_route=self._upstream_route if mesh_on else None,
                mesh_dns=mesh_dns, mesh_odoh=self.mesh_odoh,
            )
            if self.mesh_odoh is not None and dns.mesh_odoh_target:
                self.mesh_odoh.serve_target(self.resolver)
        dial_kw: dict[str, Any] = {
            "connect_timeout": limits.socks5_connect_timeout,
            "resolver": self.resolver,
            "write_high_water": limits.socks5_write_high_water,
        }
        if mesh_on:
            from meshgate.egress.connect import connector
            from meshgate.egress.mesh_dialer import MeshDialer

            # names resolve where traffic leaves: through this node's pipeline, else the host's
            from meshgate.egress.rules import ExitRules
            from meshgate.mesh.service import MeshService

            self.exit_rules = ExitRules(cfg)  # the node keeps it: a reload sets its [exit]
            from meshgate.egress.acl import source_in

            # [[acl]] decides by who opened the stream, as the mesh (built next) authenticated it
            egress = connector(cfg, Dialer(resolver=self.resolver).resolve, rules=self.exit_rules,
                               identify=lambda nid: source_in(self._mesh(), nid, time.time()))
            self.mesh = MeshService(cfg, egress=egress)
            rules = self.exit_rules
            # traversal punches only for members the [[acl]] rules (current ones: a reload
            # replaces rules.acl) let reach something here
            self.mesh.traversal_allowed = lambda nid: rules.acl.admits(
                source_in(self._mesh(), nid, time.time()))
            self._serve_mesh_dns(rules)
            self.mesh_dialer = MeshDialer(cfg, self.mesh, egress, self._open_mesh_udp, **dial_kw)
            self.dialer = self.mesh_dialer
            plan.append(self.mesh)
        else:
            self.dialer = Dialer(**dial_kw)
        if self.resolver is not None:
            from meshgate.dns.service import DnsService

            self.dns_service = DnsService(cfg, self.resolver)
            plan.append(self.dns_service)
        if cfg.socks5.enable:
            from meshgate.gateway.service import Socks5Service

            self.socks5 = Socks5Service(cfg, self.dialer)
            plan.append(self.socks5)
        if cfg.http_proxy.enable:
            from meshgate.gateway.http_proxy import HttpProxyService

            # the same dialer: HTTP destinations route through the mesh as SOCKS5 CONNECT's do
            routes = self.mesh.routes if self.mesh is not None else None
            self.http_proxy = HttpProxyService(cfg, self.dialer, routes, lambda: self.config)
            plan.append(self.http_proxy)
        if cfg.tun.enable:
            from meshgate.mesh.tun import TunService

            access = None
            if self.exit_rules is not None and self.mesh is not None:
                from meshgate.egress.acl import PacketAccess

                # [[acl]] on TUN packets, by the authenticated source (a reload sets the rules)
                access = PacketAccess(self.exit_rules, self.mesh)
            plan.append(TunService(cfg, self.mesh, access=access))
        if cfg.admin.enable:
            from meshgate.admin import AdminService

            plan.append(AdminService(cfg, self.status, self.mesh, lambda: self.reload().as_dict(),
                                     self._dns_log, lambda: self.config))
        return plan

    # --- what the components ask the node for, late-bound because each needs the other

    def _mesh_names(self) -> dict[str, tuple[Any, Any]]:
        assert self.mesh is not None  # given to the pipeline only on mesh nodes
        return self.mesh.name_table()

    def _mesh_send(self, node_id: int, channel: int, payload: bytes) -> bool:
        return self._mesh().send_datagram(node_id, channel, payload)

    def _serve_mesh_dns(self, rules: ExitRules) -> None:
        """Mesh DNS both ways on the mesh's datagram channels: answers to this node's questions
        (dns.mesh_routes), and questions for its own dns.serve_suffixes, from members the
        [[acl]] rules (the current ones: a reload replaces rules.acl) let reach port 53/udp.
        ODoH through the mesh on its own channel."""
        from meshgate.egress.acl import source_in
        from meshgate.mesh.channels import DNS_ANSWER, DNS_QUERY, ODOH

        mesh = self._mesh()
        if self.mesh_odoh is not None:
            mesh.on_datagram(ODOH, self.mesh_odoh.on_datagram)
            self.mesh_odoh.start()  # the target's key rotation
        if self.mesh_dns_client is not None:
            mesh.on_datagram(DNS_ANSWER, self.mesh_dns_client.on_answer)
        if self.resolver is not None:  # also with no suffixes: a reload may add some
            from meshgate.dns.mesh_dns import MeshDnsServer
            from meshgate.mesh.e2e import SEAL_OVERHEAD
            from meshgate.mesh.frames import MAX_BODY
            from meshgate.mesh.service import CHANNEL

            def admit(nid: int) -> bool:
                return rules.acl.decide(source_in(mesh, nid, time.time()), None, 53, "udp").allowed

            self.mesh_dns_server = MeshDnsServer(self.resolver, self._mesh_send, DNS_ANSWER,
                                                 self.config.dns.serve_suffixes, admit,
                                                 MAX_BODY - SEAL_OVERHEAD - CHANNEL.size)
            mesh.on_datagram(DNS_QUERY, self.mesh_dns_server.on_query)

    def _mesh_odoh_send(self, node_id: int, payload: bytes) -> bool:
        from meshgate.mesh.channels import ODOH

        return self._mesh().send_datagram(node_id, ODOH, payload)

    def _find_node(self, ref: str) -> int | None:
        """An odoh-mesh:// URL's node: `exit` (where this node's traffic leaves the mesh), a
        node name, a virtual IP or an 8-digit hex node id; None when no reachable node is it."""
        mesh = self._mesh()
        table = mesh.table
        if ref == "exit":
            route = table.exit_route(latency=bool(mesh.policy_flag))
            return route.node_id if route is not None else None
        try:
            route = mesh.lookup(ipaddress.ip_address(ref))
            return route.node_id if route is not None and route.kind in ("self", "peer") else None
        except ValueError:
            pass
        reachable = table.reachable()
        for origin in reachable:
            if table.records[origin].name == ref:
                return origin
        try:
            nid = int(ref, 16) if len(ref) == 8 else None
        except ValueError:
            nid = None
        return nid if nid is not None and nid in table.hop_paths else None

    def _dns_log(self, since: int) -> dict[str, Any]:
        """GET /dns/log?since=N: the pipeline's [dns.query_log] entries newer than N."""
        from meshgate.dns.querylog import answer

        log = self.resolver.query_log if self.resolver is not None else None
        return answer(log, self.config.dns.query_log.enable, since)

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
        mesh = self.config.mesh  # with exit_nodes set, never from this host (as for CONNECT)
        return await self.udp_hub.open_portal(on_datagram, pool, mesh.direct_fallback and not mesh.exit_nodes)

    # --- lifecycle

    async def start(self) -> None:
        self.state_lock.acquire()  # before anything reads or writes the state dir
        self.trimmer.start()
        try:
            plan = self._plan()
        except BaseException:  # a config the components refuse (StartupError): let go of the dir
            await self.stop()
            raise
        for svc in plan:
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

                self.udp_hub = UdpHub(self.config, self.mesh, self.exit_rules)

    async def stop(self) -> None:
        self.trimmer.stop()
        if self.udp_hub is not None:
            self.udp_hub.close()
            self.udp_hub = None
        if self.mesh_dns_server is not None:
            self.mesh_dns_server.close()
        if self.mesh_dns_client is not None:
            self.mesh_dns_client.close()
        if self.mesh_odoh is not None:
            self.mesh_odoh.close()
        while self.services:
            svc = self.services.pop()
            try:
                await svc.stop()
            except Exception:
                log.exception("error while stopping %s", svc.name)
        self.state_lock.release()
        self._stopped.set()

    # --- reload (docs/OPERATIONS.md, "Reloading the config")

    def live_keys(self, new: Config | None = None) -> frozenset[str]:
        """reload.LIVE, less what this node cannot change live:
        - with no DNS pipeline: every DNS key (a restart builds one);
        - with DNS worker processes (dns.workers > 1): dns.upstreams and [[dns.route]] when `new`
          makes a question fail over through more upstreams than a worker waits for
          (upstream_spans); otherwise they stay live (a worker sends every miss to this process,
          which routes it), and dns.records and [dns.blocklist] are pushed to the workers;
        - with no mesh running: mesh.peers and the offers and exits; with TUN on, the offers and
          exits too (its kernel routes and forwarding are set up at start)."""
        live = set(LIVE)
        if self.resolver is None:
            live -= {"dns.records", *DNS_UPSTREAMS, *DNS_BLOCKLIST}
        elif self.config.dns.workers > 1:
            from meshgate.dns.resolver import upstream_spans

            if new is not None and upstream_spans(new) > upstream_spans(self.config):
                live -= DNS_UPSTREAMS
        if self.mesh is None or self.resolver is None:  # no mesh DNS to change: a restart builds it
            live.discard("dns.serve_suffixes")
        if self.mesh is None:  # no mesh running to keep them: a restart builds one
            live -= {"mesh.peers", *MESH_OFFERS, *MESH_EXITS}
        elif self.config.tun.enable:
            live -= MESH_OFFERS | MESH_EXITS
        return frozenset(live)

    def reload(self) -> ReloadResult:
        """Re-read the config the node started with; apply it when every changed key can change
        live, else change nothing. Synchronous: no other task runs between check and apply."""
        try:
            new = load_config(self.config_path, self.overrides)
            if self.adjust is not None:
                new = self.adjust(new)
        except ConfigError as e:
            res = ReloadResult(False, problems=tuple(p.render(e.source) for p in e.problems))
        except ValueError as e:  # an adjustment's own check (cli.py: --doh/--doq/--dns)
            res = ReloadResult(False, problems=(f"--doh/--doq/--dns: {e}",))
        else:
            plan = diff(self.config, new, self.live_keys(new))
            problems = self._check(new, frozenset(plan.changed)) if plan.ok else ()
            res = ReloadResult(plan.ok and bool(plan.changed) and not problems, plan.changed, plan.restart,
                               problems)
            if res.applied:
                self._apply(new, frozenset(plan.changed))
        level = logging.INFO if res.applied or not (res.problems or res.restart) else logging.WARNING
        log.log(level, "reload: %s", res.message.replace("\n", "; "))
        return res

    def _check(self, new: Config, changed: frozenset[str]) -> tuple[str, ...]:
        """What refuses a live change before anything is applied: offers the node's certificate
        does not grant (certificate mode), as check-config would name them."""
        try:
            if changed & MESH_OFFERS and self.mesh is not None:
                self.mesh.check_offers(new.mesh)
            if "dns.serve_suffixes" in changed and self.mesh is not None:
                self.mesh.check_dns_suffixes(new.dns.serve_suffixes)
        except StartupError as e:
            return (f"{self.config_path or '-'}:{e}",)
        return ()

    def _apply(self, new: Config, changed: frozenset[str]) -> None:
        """Hand each change to the component that owns it. Every setter is checked beforehand
        (config validation, `_check`) and only swaps what it holds, so none fails half-way."""
        if "log_level" in changed:
            logging.getLogger().setLevel(getattr(logging, new.log_level.upper(), logging.INFO))
        if "socks5.users" in changed:
            for portal in (self.socks5, self.http_proxy):
                if portal is not None:
                    portal.set_users(new.socks5.users)
        if changed & PORTAL_LIMITS:
            for portal in (self.socks5, self.http_proxy):
                if portal is not None:
                    portal.set_limits(new.limits)
        if "dns.records" in changed:
            if self.resolver is not None:
                self.resolver.set_records(new.dns.records)
            if self.mesh_dialer is not None:
                self.mesh_dialer.set_records(new.dns.records)
        if changed & DNS_UPSTREAMS and self.resolver is not None:
            self.resolver.set_upstreams(new)
        if changed & DNS_BLOCKLIST and self.resolver is not None:
            self.resolver.set_blocklist(new.dns.blocklist)
        if changed & {"dns.records", *DNS_BLOCKLIST} and self.dns_service is not None:
            self.dns_service.set_local(new.dns)  # the worker processes' own pipelines
        if "mesh.peers" in changed and self.mesh is not None:
            self.mesh.set_peers(new.mesh.peers)
        if changed & {"exit.allow", "exit.deny", "exit.allow_private", "serve", "acl", *MESH_OFFERS} \
                and self.exit_rules is not None:
            self.exit_rules.set_offers(new)  # before the record says so: a stream that arrives is served
        if changed & (MESH_OFFERS | MESH_EXITS) and self.mesh is not None:
            self.mesh.set_offers(new.mesh)
        if changed & MESH_EXITS and self.mesh_dialer is not None:
            self.mesh_dialer.set_exits(new.mesh)
        if "dns.serve_suffixes" in changed and self.mesh is not None:
            suffixes = new.dns.serve_suffixes
            if self.mesh_dns_server is not None:  # answers them before the record says so
                self.mesh_dns_server.set_suffixes(suffixes)
            if self.mesh_dns_routes is not None:  # answered here, not sent to another server
                self.mesh_dns_routes.own = suffixes
            self.mesh.set_dns_suffixes(suffixes)  # re-originated: every node routes by it
        self.config = new  # the PAC file, /config and SOCKS UDP's fallback read it

    def _mesh(self) -> MeshService:
        assert self.mesh is not None
        return self.mesh

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
            out["fingerprint"] = self.mesh.identity.fingerprint
            out["identity"] = self.mesh.identity_text()
            out["traversal"] = self.mesh.traversal_text()
            # one line per link, naming its cipher (`meshgate status` prints one per line)
            out["links"] = [f"{p['name'] or p['id']} {p['url']} {p['aead'] or 'handshake'}"
                            for p in self.mesh.peers() if p["url"]]
            if self.mesh.traversal is not None:
                out["traversal_counters"] = self.mesh.traversal.status()["counters"]
            if self.resolver is not None:
                text = self._dns_mesh_text()
                if text:
                    out["dns_mesh"] = text
        return out

    def _dns_mesh_text(self) -> str:
        """Split DNS through the mesh in one line: what this node serves, and where names under
        other nodes' suffixes go (nearest first), e.g. `serves lan.example.; corp.example. -> c`."""
        dns = self.config.dns
        _, servers = self._mesh().dns_servers()
        parts = [f"serves {s}" for s in dns.serve_suffixes]
        for suffix, nodes in sorted(servers.items()):
            names = ",".join(name or f"{nid:08x}" for nid, name in nodes)
            parts.append(f"{suffix} -> {names}" + ("" if dns.mesh_routes else " (off: dns.mesh_routes)"))
        return "; ".join(parts)
