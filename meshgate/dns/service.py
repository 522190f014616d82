"""The "dns" service: one resolver pipeline, every [[dns.listener]] in front of it."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import importlib
import importlib.util
import logging
from pathlib import Path
from typing import Any

from meshgate import tls
from meshgate.config import DnsListenerConfig, HostPort
from meshgate.dns.doh import DohApp
from meshgate.dns.resolver import Pipeline
from meshgate.dns.stats import ListenerStats
from meshgate.errors import bind_error

log = logging.getLogger("meshgate.dns")


def listener_url(lst: DnsListenerConfig, hp: HostPort | None = None) -> str:
    hp = hp or lst.listen
    scheme = {"udp": "udp", "tcp": "tcp", "dot": "tls", "doh": "https", "doq": "quic", "odoh": "https"}
    path = lst.path if lst.protocol in ("doh", "odoh") else ""
    return f"{scheme[lst.protocol]}://{hp}{path}"


class DnsService:
    name = "dns"

    def __init__(self, node: Any, *, worker: bool = False) -> None:
        self.node = node
        self.config = node.config
        # dns.workers > 1: shared listeners bind with SO_REUSEPORT and a WorkerPool runs the
        # other processes. `worker` is True inside one of those processes (dns/worker.py).
        self.worker = worker
        self.reuse_port = worker or self.config.dns.workers > 1
        self.pool: Any = None  # meshgate.dns.worker.WorkerPool
        self._shared: list[DnsListenerConfig] = []  # what the workers bind: bound ports, cert paths
        self.pipeline = Pipeline(self.config, node)
        node.resolver = self.pipeline
        self.urls: list[str] = []
        self.stats: dict[str, ListenerStats] = {}
        self.generated_cert: Path | None = None
        self._closers: list[Any] = []
        self._conn_sets: list[set[Any]] = []

    def _tls_files(self, lst: DnsListenerConfig) -> tuple[str, str]:
        if lst.cert and lst.key:
            return lst.cert, lst.key
        cert, key = tls.ensure_self_signed(self.config.state_path)
        self.generated_cert = cert
        return str(cert), str(key)

    async def start(self) -> None:
        try:
            for i, lst in enumerate(self.config.dns.listeners):
                try:
                    await self._start_listener(i, lst)
                except OSError as e:
                    raise bind_error(f"dns.listener[{i}].listen", lst.listen, e) from None
            if self._shared and not self.worker and self.config.dns.workers > 1:
                from meshgate.dns.worker import WorkerPool, answer_for_worker, worker_config

                cfg = worker_config(self.config, self._shared)
                self.pool = WorkerPool(cfg, self.config.dns.workers, self.pipeline.name_table,
                                       self.pipeline.names_changed,
                                       functools.partial(answer_for_worker, self.pipeline))
                await self.pool.start()
        except BaseException:
            await self.stop()
            raise

    async def _start_listener(self, i: int, lst: DnsListenerConfig) -> None:
        from meshgate.dns import plain

        limits = self.config.limits
        host, port = lst.listen.host, lst.listen.port
        stats = ListenerStats(listener_url(lst))
        actual: HostPort | None = None
        reuse = self.reuse_port
        files: tuple[str, str] | None = None
        if lst.protocol == "udp":
            transport = await plain.start_udp(self.pipeline, stats, host, port, reuse_port=reuse)
            self._closers.append(transport)
            actual = _bound(transport.get_extra_info("sockname"))
        elif lst.protocol in ("tcp", "dot"):
            ssl = None
            if lst.protocol == "dot":
                c, k = files = self._tls_files(lst)
                ssl = tls.server_context(Path(c), Path(k), alpn=["dot"])
            server, conns = await plain.start_stream(self.pipeline, stats, limits, host, port, ssl,
                                                     reuse_port=reuse)
            self._closers.append(server)
            self._conn_sets.append(conns)
            actual = _bound(server.sockets[0].getsockname())
        elif lst.protocol == "doh":
            from meshgate.dns.h2server import start_h2

            c, k = files = self._tls_files(lst)
            ssl = tls.server_context(Path(c), Path(k), alpn=["h2"])
            app = DohApp(self.pipeline, stats, lst.path)
            server, hconns = await start_h2(app, stats, limits, host, port, ssl, reuse_port=reuse)
            self._closers.append(server)
            self._conn_sets.append(hconns)
            actual = _bound(server.sockets[0].getsockname())
        elif lst.protocol == "doq":
            from meshgate.dns.doq import start_doq

            cert, key = self._tls_files(lst)
            qserver, qconns = await start_doq(self.pipeline, stats, limits, host, port, cert, key)
            self._closers.append(qserver)
            self._conn_sets.append(qconns)
            qt = qserver._transport
            actual = _bound(qt.get_extra_info("sockname")) if qt is not None else lst.listen
        elif lst.protocol == "odoh":
            # Built by the ODoH engineer; guarded so DNS works without it.
            if importlib.util.find_spec("meshgate.dns.odoh_server") is None:
                log.warning("dns.listener[%d]: odoh listener needs meshgate.dns.odoh_server (not present)", i)
                return
            mod = importlib.import_module("meshgate.dns.odoh_server")
            handle = await mod.build_listener(self.node, lst, self.pipeline)
            self._closers.append(handle)
            url = getattr(handle, "url", None)
            self.urls.append(url if isinstance(url, str) else listener_url(lst))
            return
        stats.rename(listener_url(lst, actual))
        self.stats[listener_url(lst, actual)] = stats
        self.urls.append(listener_url(lst, actual))
        if actual is not None and lst.protocol in ("udp", "tcp", "dot", "doh"):
            # Workers bind the port this process got (port 0 in the config included) and load
            # the certificate this process generated: one certificate for every process.
            if files is not None:
                lst = dataclasses.replace(lst, cert=files[0], key=files[1])
            self._shared.append(dataclasses.replace(lst, listen=actual))

    async def stop(self) -> None:
        if self.pool is not None:
            await self.pool.stop()
            self.pool = None
        for c in reversed(self._closers):
            try:
                close = c.close()
                if asyncio.iscoroutine(close):
                    await close
            except Exception:
                log.exception("closing a DNS listener")
        for conns in self._conn_sets:
            for proto in list(conns):
                t = getattr(proto, "transport", None)
                if t is not None:
                    t.abort()
        for c in self._closers:
            wait = getattr(c, "wait_closed", None)
            if wait is not None and isinstance(c, asyncio.AbstractServer):
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(wait(), 2.0)
        self._closers.clear()
        self._conn_sets.clear()
        self.pipeline.close()

    def status(self) -> dict[str, Any]:
        notes = list(self.urls)
        if self.generated_cert is not None:
            notes.append(f"self-signed certificate: {self.generated_cert}")
        return {
            "listen": ", ".join(self.urls),
            "notes": notes,
            "upstreams": [u.url for u in self.pipeline.upstreams],
            "cache_entries": len(self.pipeline.cache),
            "listeners": {url: st.snapshot() for url, st in self.stats.items()},
            **({"workers": self.pool.status()} if self.pool is not None else {}),
        }


def _bound(sockname: Any) -> HostPort:
    return HostPort(str(sockname[0]), int(sockname[1]))


def build(node: Any) -> DnsService:
    return DnsService(node)
