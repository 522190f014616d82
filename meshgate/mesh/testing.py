"""Helpers to run several mesh nodes in one process (tests and bench/mesh.py)."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

from meshgate.config import Config, LimitsConfig, from_dict
from meshgate.mesh.service import MeshService

_ring_ids = itertools.count(1)


def ring_name(prefix: str = "t") -> str:
    """A ring name unique in this process (the ring registry is module-level)."""
    return f"{prefix}{next(_ring_ids)}"


def node_config(
    name: str,
    ipv4: str | None = None,
    listen: Iterable[str] = (),
    peers: Iterable[str] = (),
    network: str = "testnet",
    secret: str = "correct horse battery",
    limits: dict[str, Any] | None = None,
    **mesh: Any,
) -> Config:
    raw: dict[str, Any] = {
        "node": {"name": name, "network": network, "secret": secret},
        "mesh": {"listen": list(listen), "peers": list(peers), **mesh},
        "limits": limits or {},
    }
    if ipv4:
        raw["node"]["ipv4"] = ipv4
    return from_dict(raw)


async def start_node(cfg: Config, node_id: int) -> MeshService:
    svc = MeshService(cfg, node_id=node_id)
    await svc.start()
    return svc


def fast_limits(**extra: Any) -> LimitsConfig:
    return replace(LimitsConfig(), **extra)


def converged(nodes: Iterable[MeshService]) -> bool:
    """Every node reaches every other node (routes built on both sides)."""
    nodes = list(nodes)
    ids = {n.node_id for n in nodes}
    return all(ids <= set(n.table.hop_paths) for n in nodes)


async def stop_all(nodes: Iterable[MeshService]) -> None:
    await asyncio.gather(*(n.stop() for n in nodes), return_exceptions=True)
