"""The portals as node services, handed their dialer by the node: SOCKS5 ("socks5") here,
the HTTP proxy ("http_proxy") in http_proxy.py; `PortalService` is what both share."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from meshgate.buffers import BufferPool
from meshgate.config import Config, HostPort, LimitsConfig, User
from meshgate.egress.dialer import Dialer
from meshgate.errors import bind_error
from meshgate.gateway.server import Socks5Server
from meshgate.gateway.socks5 import MAX_UDP_HEADER

if TYPE_CHECKING:
    from meshgate.gateway.workers import SocksWorkerPool

# A pooled buffer holds the largest UDP payload behind room for the largest
# SOCKS UDP header, so replies get their header prepended in place.
_UDP_BUFFER = 65536


class PortalService:
    """Start, stop and the bound address of one portal listener; a subclass names its config
    key and makes its server."""

    name = ""
    listen_key = ""  # the config key a bind failure names

    def __init__(self, config: Config, dialer: Dialer) -> None:
        self.config = config
        self.dialer = dialer
        self.server: Socks5Server | None = None
        self.workers: SocksWorkerPool | None = None  # socks5.workers > 1 (the SOCKS5 portal only)

    def listen_address(self) -> HostPort:
        raise NotImplementedError

    def make_server(self) -> Socks5Server:
        raise NotImplementedError

    def worker_count(self) -> int:
        return 1

    async def start(self) -> None:
        addr = self.listen_address()
        self.server = self.make_server()
        count = self.worker_count()
        try:
            await self.server.start(addr.host, addr.port, reuse_port=count > 1)
        except OSError as e:
            self.server = None
            raise bind_error(self.listen_key, addr, e) from None
        if count > 1:
            from meshgate.gateway.workers import SocksWorkerPool

            port = self.server.sockname[1]  # a listen port of 0: the workers bind the one chosen
            self.workers = SocksWorkerPool(self.config, count, self.dialer, self.server, port)
            try:
                await self.workers.start()
            except BaseException:
                await self.stop()
                raise

    def set_users(self, users: tuple[User, ...]) -> None:
        """Reloaded `socks5.users` for new connections (status reports them too)."""
        self.config = replace(self.config, socks5=replace(self.config.socks5, users=users))
        if self.server is not None:
            self.server.set_users(users)
        if self.workers is not None:
            self.workers.push(users, self.config.limits)

    def set_limits(self, limits: LimitsConfig) -> None:
        """Reloaded `[limits]` (the portal's live ones, node.py's PORTAL_LIMITS)."""
        self.config = replace(self.config, limits=limits)
        if self.server is not None:
            self.server.set_limits(limits)
        if self.workers is not None:
            self.workers.push(self.config.socks5.users, limits)

    async def stop(self) -> None:
        if self.workers is not None:
            await self.workers.stop()
            self.workers = None
        if self.server is not None:
            await self.server.close()
            self.server = None

    @property
    def address(self) -> HostPort | None:
        if self.server is None or self.server.server is None:
            return None
        host, port = self.server.sockname
        return HostPort(host, port)

    def status(self) -> dict[str, Any]:
        raise NotImplementedError


class Socks5Service(PortalService):
    name = "socks5"
    listen_key = "socks5.listen"

    def __init__(self, config: Config, dialer: Dialer) -> None:
        super().__init__(config, dialer)
        self.pool = BufferPool(
            capacity=_UDP_BUFFER, headroom=MAX_UDP_HEADER, max_free=min(config.limits.buffer_pool_size, 64)
        )

    def listen_address(self) -> HostPort:
        return self.config.socks5.listen

    def worker_count(self) -> int:
        return self.config.socks5.workers

    def make_server(self) -> Socks5Server:
        return Socks5Server(self.config, self.dialer, self.pool)

    def status(self) -> dict[str, Any]:
        addr = self.address
        cfg = self.config.socks5
        out: dict[str, Any] = {
            "listen": str(addr) if addr else None,
            "clients": len(self.server.clients) if self.server else 0,
            "max_clients": cfg.max_clients,
            "auth": "username/password" if cfg.users else "none",
            "udp": cfg.udp,
        }
        if self.workers is not None:
            out["workers"] = self.workers.status()
        if addr is not None:
            user = f" (user {cfg.users[0].name!r} and its password)" if cfg.users else ""
            out["notes"] = [
                f"browser: SOCKS5 host {addr.host}, port {addr.port}, remote DNS on{user}",
                f"try: curl --proxy socks5h://{addr}/ https://example.com/",
            ]
        return out

