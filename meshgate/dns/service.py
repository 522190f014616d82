"""The "dns" service: one resolver pipeline, every [[dns.listener]] in front of it.

The node builds the pipeline (it decides where the mesh's names and routes come from) and hands
it in: `DnsService(config, pipeline)`; a DNS worker process builds its own the same way
(`worker=True`). Each listener is an object of the kind its `protocol` names in
meshgate.dns.listeners.DNS_LISTENERS; this service starts them in config order, stops them in
reverse, runs the worker processes (`dns.workers` > 1) and reports them all in `status()`.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from meshgate import tls
from meshgate.config import Config, DnsConfig, DnsListenerConfig
from meshgate.dns.listeners import Listener, listener_class
from meshgate.dns.resolver import Pipeline
from meshgate.dns.stats import ListenerStats

if TYPE_CHECKING:
    from meshgate.dns.worker_pool import WorkerPool

log = logging.getLogger("meshgate.dns")


class DnsService:
    name = "dns"

    def __init__(self, config: Config, pipeline: Pipeline, *, worker: bool = False) -> None:
        self.config = config
        self.pipeline = pipeline
        # dns.workers > 1: shared listeners bind with SO_REUSEPORT and a WorkerPool runs the
        # other processes. `worker` is True inside one of those processes (dns/worker.py).
        self.worker = worker
        self.reuse_port = worker or config.dns.workers > 1
        self.pool: WorkerPool | None = None
        self.listeners: list[Listener] = []
        self.urls: list[str] = []
        self.stats: dict[str, ListenerStats] = {}

    @property
    def _conn_sets(self) -> list[set[Any]]:
        """Each listener's live connections (tests look at them)."""
        return [lst.conns for lst in self.listeners]

    @property
    def generated_cert(self) -> Path | None:
        """The certificate the local CA issued the listeners (one per node, in its state directory)."""
        return next((lst.generated_cert for lst in self.listeners if lst.generated_cert is not None), None)

    async def start(self) -> None:
        try:
            for i, cfg in enumerate(self.config.dns.listeners):
                listener = listener_class(cfg.protocol)(self.config, cfg, self.pipeline, index=i,
                                                        reuse_port=self.reuse_port)
                await listener.start()  # a bind failure: StartupError naming dns.listener[i].listen
                self.listeners.append(listener)
                self.urls.append(listener.url)
                self.stats[listener.url] = listener.stats
            for listener in self.listeners:
                listener.linked(self.listeners)
            shared = [lst.worker_config() for lst in self.listeners if lst.shared]
            if shared and not self.worker and self.config.dns.workers > 1:
                await self._start_workers(shared)
        except BaseException:
            await self.stop()
            raise

    async def _start_workers(self, shared: list[DnsListenerConfig]) -> None:
        from meshgate.dns.worker_pool import WorkerPool, answer_for_worker, worker_config

        cfg = worker_config(self.config, shared)
        self.pool = WorkerPool(cfg, self.config.dns.workers, self.pipeline.name_table,
                               self.pipeline.names_changed,
                               functools.partial(answer_for_worker, self.pipeline),
                               query_log=self.pipeline.query_log)
        await self.pool.start()

    def set_local(self, dns: DnsConfig) -> None:
        """A reload's `dns.records` and `[dns.blocklist]` (the node set them in `pipeline`):
        the worker processes swap them in too."""
        if self.pool is not None:
            self.pool.push_local(dns)

    async def stop(self) -> None:
        if self.pool is not None:
            await self.pool.stop()
            self.pool = None
        while self.listeners:
            listener = self.listeners.pop()
            try:
                await listener.stop()
            except Exception:
                log.exception("closing DNS listener %s", listener.url)
        self.pipeline.close()  # upstream exchanges and pooled connections; it stays usable
        for st in self.stats.values():
            st.forget()

    def status(self) -> dict[str, Any]:
        notes = list(self.urls)
        if self.generated_cert is not None:
            notes.append(tls.cert_note(self.generated_cert))
        return {
            "listen": ", ".join(self.urls),
            "notes": notes,
            "upstreams": [u.url for u in self.pipeline.upstreams],
            "cache_entries": len(self.pipeline.cache),
            **({"blocklist": bl.status()} if (bl := self.pipeline.blocklist) is not None else {}),
            "listeners": {url: st.snapshot() for url, st in self.stats.items()},
            **({"workers": self.pool.status()} if self.pool is not None else {}),
        }
