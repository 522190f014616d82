"""The DNS listener kinds: `protocol = "..."` in a [[dns.listener]] table -> the class serving it.

`DNS_LISTENERS` is the one registry (the DNS service, its worker processes and the tests read
it): each entry names a `Listener` subclass as "module:Class", imported only when a listener
of that kind is configured (a node without DoQ never loads aioquic's server side).

Adding a kind (doh3.py was the last one): a module with a `Listener` subclass (scheme, `_serve()`,
`_close()`), and a line here. The config reads [[dns.listener]] without importing this package (config is a
ground module): its `DNS_LISTENER_KINDS` names each kind with what validation needs (default
port, UDP or TCP socket), and tests/unit/test_dns_registry.py checks both name the same kinds.

Every listener is a small service of its own: `start()` binds and serves (a bind failure is a
StartupError naming `dns.listener[i].listen`), `stop()` closes it and its connections,
`status()` describes it; `url` names it (the bound address once started), `stats` counts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ssl
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

from meshgate import tls
from meshgate.config import Config, DnsListenerConfig, HostPort, LimitsConfig
from meshgate.dns import ratelimit
from meshgate.dns.kinds import load_class
from meshgate.dns.resolver import Pipeline
from meshgate.dns.stats import ListenerStats
from meshgate.errors import bind_error

DNS_LISTENERS: dict[str, str] = {
    "udp": "meshgate.dns.plain:UdpListener",
    "tcp": "meshgate.dns.plain:TcpListener",
    "dot": "meshgate.dns.plain:DotListener",
    "doh": "meshgate.dns.doh:DohListener",
    "doq": "meshgate.dns.doq:DoqListener",
    "doh3": "meshgate.dns.doh3:Doh3Listener",
    "odoh": "meshgate.dns.odoh_server:OdohListener",
}

PLAIN = ("udp", "tcp")  # the kinds without TLS
STOP_WAIT = 2.0  # seconds stop() waits for a server's connections to finish closing


def listener_class(protocol: str) -> type[Listener]:
    """The class registered for `protocol` (imported now)."""
    return load_class(DNS_LISTENERS, protocol, Listener)


class Listener:
    """One [[dns.listener]] in front of the pipeline. Subclasses set `scheme` (their URL's) and
    implement `_serve()` (bind and serve; return the bound address) and `stop()`."""

    scheme: ClassVar[str]
    has_path: ClassVar[bool] = False  # the URL ends with the listener's `path` (DoH, ODoH)
    # dns.workers > 1: the worker processes bind this listener too (SO_REUSEPORT) and the kernel
    # spreads its queries; the other kinds stay in the main process.
    shared: ClassVar[bool] = False

    def __init__(self, config: Config, cfg: DnsListenerConfig, pipeline: Pipeline, *,
                 index: int | None = None, reuse_port: bool = False) -> None:
        self.config = config
        self.cfg = cfg
        self.pipeline = pipeline
        self.limits = config.limits
        self.index = index
        self.reuse_port = reuse_port and self.shared
        self.url = self.url_for(cfg.listen)
        self.stats = ListenerStats(self.stats_name(cfg.listen))
        self.bound: HostPort | None = None
        self.conns: set[Any] = set()  # live connections (none for UDP)
        self.generated_cert: Path | None = None  # the certificate the local CA issued it, if any
        # Per-client query rate (dns/ratelimit.py): `rate_limit`, on by default off loopback. One
        # table per listener and per process (with dns.workers, each worker counts its own share).
        self.limiter = ratelimit.for_listener(cfg, config.limits)
        self.alt_svc = ""  # the Alt-Svc this listener sends (DoH: a doh3 listener beside it)
        self._tls: tuple[str, str] | None = None

    # ------------------------------------------------------------------ names

    def url_for(self, hp: HostPort) -> str:
        return f"{self.scheme}://{hp}{self.cfg.path if self.has_path else ''}"

    def stats_name(self, hp: HostPort) -> str:
        """The `listener` label of its counters (its URL unless a kind says otherwise)."""
        return self.url_for(hp)

    @property
    def key(self) -> str:
        """Its config key, for errors."""
        index = self.index
        if index is None:
            with contextlib.suppress(ValueError):
                index = self.config.dns.listeners.index(self.cfg)
        return "dns.listener.listen" if index is None else f"dns.listener[{index}].listen"

    @property
    def port(self) -> int:
        return (self.bound or self.cfg.listen).port

    # ------------------------------------------------------------------ lifecycle

    def tls_files(self) -> tuple[str, str]:
        """The certificate and key: the listener's own, or the one the node's local CA issues in
        the state directory (meshgate/tls.py) for the addresses of every TLS listener without
        its own, so all of them share one certificate."""
        if self._tls is None:
            if self.cfg.cert and self.cfg.key:
                self._tls = (self.cfg.cert, self.cfg.key)
            else:
                hosts = [lst.listen.host for lst in self.config.dns.listeners
                         if lst.protocol not in PLAIN and not (lst.cert and lst.key)]
                cert, key = tls.ensure_listener_cert(
                    self.config.state_path, [*hosts, self.cfg.listen.host],
                    node_name=self.config.node.name, zone=self.config.dns.zone)
                self.generated_cert = cert
                self._tls = (str(cert), str(key))
        return self._tls

    def ssl_context(self, alpn: list[str]) -> ssl.SSLContext:
        cert, key = self.tls_files()
        return tls.server_context(Path(cert), Path(key), alpn=alpn)

    async def start(self) -> None:
        try:
            bound = await self._serve()
        except OSError as e:
            raise bind_error(self.key, self.cfg.listen, e) from None
        self.bound = bound
        self.url = self.url_for(bound)
        self.stats.rename(self.stats_name(bound))

    async def _serve(self) -> HostPort:
        raise NotImplementedError

    def linked(self, listeners: list[Listener]) -> None:
        """Every listener of the service has started (bound addresses known): a kind that
        refers to another (DoH advertising DoH3 in Alt-Svc) looks it up here."""

    async def stop(self) -> None:
        raise NotImplementedError

    async def _close_server(self, server: asyncio.AbstractServer | None) -> None:
        """A stream listener's stop: no new connections, the live ones aborted, then a bounded
        wait for the server to finish."""
        if server is None:
            return
        server.close()
        for proto in list(self.conns):
            t = getattr(proto, "transport", None)
            if t is not None:
                t.abort()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(server.wait_closed(), STOP_WAIT)

    def worker_config(self) -> DnsListenerConfig:
        """What a worker process binds for this listener: the address this process got (port 0 in
        the config included) and the certificate it uses (one certificate for every process)."""
        lst = self.cfg
        if self._tls is not None:
            lst = dataclasses.replace(lst, cert=self._tls[0], key=self._tls[1])
        return dataclasses.replace(lst, listen=self.bound or lst.listen, alt_svc=self.alt_svc)

    def status(self) -> dict[str, Any]:
        notes = [self.url]
        if self.generated_cert is not None:
            notes.append(tls.cert_note(self.generated_cert))
        return {"listen": self.url, "notes": notes, "stats": self.stats.snapshot()}


async def serve_stream(factory: Callable[[], asyncio.Protocol], limits: LimitsConfig, host: str, port: int,
                       ssl: Any = None, *, reuse_port: bool = False) -> asyncio.Server:
    """A TCP (or TLS) server as every DNS stream listener runs one: a deep accept backlog, and a
    TLS handshake bounded by limits.dns_tcp_idle_timeout (a client that never finishes it holds
    no slot for longer than an idle one would)."""
    return await asyncio.get_running_loop().create_server(
        factory, host, port, ssl=ssl, backlog=1024, reuse_port=reuse_port or None,
        ssl_handshake_timeout=limits.dns_tcp_idle_timeout if ssl is not None else None,
    )


def bound_address(sockname: Any) -> HostPort:
    """A socket's `getsockname()` as a HostPort."""
    return HostPort(str(sockname[0]), int(sockname[1]))
