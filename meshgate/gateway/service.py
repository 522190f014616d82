"""The SOCKS5 portal as a node service named "socks5", handed its dialer by the node."""

from __future__ import annotations

from typing import Any

from meshgate.buffers import BufferPool
from meshgate.config import Config, HostPort
from meshgate.egress.dialer import Dialer
from meshgate.errors import bind_error
from meshgate.gateway.server import Socks5Server
from meshgate.gateway.socks5 import MAX_UDP_HEADER

# A pooled buffer holds the largest UDP payload behind room for the largest
# SOCKS UDP header, so replies get their header prepended in place.
_UDP_BUFFER = 65536


class Socks5Service:
    name = "socks5"

    def __init__(self, config: Config, dialer: Dialer) -> None:
        self.config = config
        self.dialer = dialer
        cfg = config
        self.pool = BufferPool(
            capacity=_UDP_BUFFER, headroom=MAX_UDP_HEADER, max_free=min(cfg.limits.buffer_pool_size, 64)
        )
        self.server: Socks5Server | None = None

    async def start(self) -> None:
        addr = self.config.socks5.listen
        self.server = Socks5Server(self.config, self.dialer, self.pool)
        try:
            await self.server.start(addr.host, addr.port)
        except OSError as e:
            self.server = None
            raise bind_error("socks5.listen", addr, e) from None

    async def stop(self) -> None:
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
        addr = self.address
        cfg = self.config.socks5
        out: dict[str, Any] = {
            "listen": str(addr) if addr else None,
            "clients": len(self.server.clients) if self.server else 0,
            "max_clients": cfg.max_clients,
            "auth": "username/password" if cfg.users else "none",
            "udp": cfg.udp,
        }
        if addr is not None:
            user = f" (user {cfg.users[0].name!r} and its password)" if cfg.users else ""
            out["notes"] = [
                f"browser: SOCKS5 host {addr.host}, port {addr.port}, remote DNS on{user}",
                f"try: curl --proxy socks5h://{addr}/ https://example.com/",
            ]
        return out

