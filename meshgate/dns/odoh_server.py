"""The ODoH listener (`protocol = "odoh"`): target, proxy, or both (`mode = "dual"`).

Runs on the DoH server (HTTP/2 or HTTP/1.1 per connection: meshgate.dns.h1server.start_https)
with this routing:

* `GET /.well-known/odohconfigs` (target, dual): the target's current config.
* `POST <path>?targethost=..&targetpath=..` (proxy, dual): forwarded by the
  proxy role (meshgate.dns.odoh_proxy). In proxy mode every request to
  `<path>` is a proxy request; in dual mode the query parameters decide.
* `POST <path>` with `application/oblivious-dns-message` (target, dual):
  opened, resolved, sealed (meshgate.dns.odoh_target).
* With `allow_doh`, plain DoH (GET `?dns=`, POST `application/dns-message`)
  on the same path, answered by the DoH app over the same pipeline.
* Anything else at `<path>`: 405 for a method other than POST (GET too,
  unless `allow_doh`), 415 for another media type; other paths 404.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import Any

from meshgate import tls
from meshgate.config import Config, DnsListenerConfig, HostPort, LimitsConfig
from meshgate.dns import odoh
from meshgate.dns.doh import DohApp
from meshgate.dns.h1server import ALPN, start_https
from meshgate.dns.h2server import Response
from meshgate.dns.listeners import Listener, bound_address
from meshgate.dns.odoh_proxy import OdohProxy
from meshgate.dns.odoh_target import OdohTarget
from meshgate.dns.resolver import Pipeline
from meshgate.dns.stats import ListenerStats

log = logging.getLogger("meshgate.dns.odoh")

_TEXT = ("content-type", "text/plain; charset=utf-8")


def _error(status: int, text: str, *extra: tuple[str, str]) -> Response:
    return (status, [_TEXT, ("cache-control", "no-store"), *extra], text.encode())


class OdohApp:
    """The HTTP handler (h2server.Handler, served over HTTP/2 and HTTP/1.1) for one ODoH listener."""

    def __init__(self, cfg: DnsListenerConfig, limits: LimitsConfig, pipeline: Pipeline,
                 stats: ListenerStats) -> None:
        self.path = cfg.path
        self.mode = cfg.mode
        self.stats = stats
        self.target = OdohTarget(cfg, limits, pipeline, stats) if cfg.mode in ("target", "dual") else None
        self.proxy = OdohProxy(cfg, limits) if cfg.mode in ("proxy", "dual") else None
        self.doh = DohApp(pipeline, stats, cfg.path) if cfg.allow_doh and self.target is not None else None

    def __call__(self, method: str, path: str, headers: list[tuple[str, str]],
                 body: bytes) -> Response | Awaitable[Response]:
        where, _, qs = path.partition("?")
        if where == odoh.CONFIGS_PATH and self.target is not None:
            if method != "GET":
                self.stats.error("http_405")
                return _error(405, "use GET\n", ("allow", "GET"))
            return self.target.configs()
        if where != self.path:
            self.stats.error("http_404")
            return _error(404, "not found\n")
        ctype = next((v for k, v in headers if k == "content-type"), None)
        if ctype is not None:
            ctype = ctype.split(";")[0].strip().lower()
        if self.proxy is not None and (self.target is None or "targethost=" in qs):
            return self._proxied(method, ctype, qs, body)
        assert self.target is not None
        if method == "POST" and ctype == odoh.MEDIA_TYPE:
            return self.target.answer(body)
        if self.doh is not None:
            return self.doh(method, path, headers, body)
        if method != "POST":
            self.stats.error("http_405")
            return _error(405, "ODoH takes POST only\n", ("allow", "POST"))
        self.stats.error("http_415")
        return _error(415, f"content-type must be {odoh.MEDIA_TYPE}\n")

    async def _proxied(self, method: str, ctype: str | None, qs: str, body: bytes) -> Response:
        assert self.proxy is not None
        reply = await self.proxy.forward(method, ctype, qs, body)
        return reply.response()

    def rotate(self) -> None:
        if self.target is not None:
            self.target.rotate()

    def close(self) -> None:
        if self.target is not None:
            self.target.close()
        if self.proxy is not None:
            self.proxy.close()


class OdohListener(Listener):
    """`protocol = "odoh"`: an ODoH target, proxy or both on the HTTP/2 + HTTP/1.1 server. Stays in the main
    process with dns.workers > 1 (one target key pair, rotated in one place)."""

    scheme = "https"
    has_path = True
    app: OdohApp | None = None
    server: asyncio.Server | None = None
    timer: asyncio.TimerHandle | None = None  # the next key rotation

    @property
    def name(self) -> str:
        return f"odoh-{self.cfg.mode}"

    def stats_name(self, hp: HostPort) -> str:
        return f"odoh://{hp}{self.cfg.path}"

    async def _serve(self) -> HostPort:
        cfg = self.cfg
        ctx = self.ssl_context(ALPN)
        self.app = OdohApp(cfg, self.limits, self.pipeline, self.stats)
        try:
            self.server, self.conns = await start_https(
                self.app, self.stats, self.limits, cfg.listen.host, cfg.listen.port, ctx
            )
        except BaseException:
            self.app.close()
            raise
        if self.app.target is not None and self.app.target.rotation is not None:
            self._schedule_rotation(self.app.target.rotation)
        return bound_address(self.server.sockets[0].getsockname())

    def _schedule_rotation(self, period: float) -> None:
        def rotate() -> None:
            if self.app is not None:
                self.app.rotate()
            self.timer = asyncio.get_running_loop().call_later(period, rotate)

        self.timer = asyncio.get_running_loop().call_later(period, rotate)

    async def stop(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        await self._close_server(self.server)
        self.server = None
        if self.app is not None:
            self.app.close()

    async def close(self) -> None:
        await self.stop()

    def status(self) -> dict[str, Any]:
        notes = [f"ODoH {self.cfg.mode}"]
        app = self.app
        hp = self.bound or self.cfg.listen
        if app is not None and app.target is not None:
            kid = app.target.keys.current.key_id[:8].hex()
            notes.append(f"configs at https://{hp}{odoh.CONFIGS_PATH} (key id {kid}...)")
            if self.cfg.allow_doh:
                notes.append("plain DoH on the same path")
        if app is not None and app.proxy is not None:
            notes.append(f"proxy URI {self.url}?targethost={{targethost}}&targetpath={{targetpath}}")
        if self.generated_cert is not None:
            notes.append(tls.cert_note(self.generated_cert))
        return {"listen": self.url, "notes": notes, "stats": self.stats.snapshot()}


async def build_listener(config: Config, listener_cfg: DnsListenerConfig, pipeline: Pipeline) -> OdohListener:
    """One `protocol = "odoh"` listener, started (`stop()` or `close()` stops it, `url` names it,
    `status()` describes it). The DNS service builds it like every other kind (dns/listeners.py)."""
    listener = OdohListener(config, listener_cfg, pipeline)
    await listener.start()
    return listener
