"""TunService start-up failures: each is a StartupError naming the config key (exit status 2),
with nothing left behind. No root needed: the device opener is replaced."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from meshgate.config import from_dict
from meshgate.errors import StartupError
from meshgate.mesh.tun import TunService

MESH = object()  # a mesh is present; these tests never get as far as using it


def service(tmp: Path, mesh: Any = MESH, **node: Any) -> TunService:
    raw = {"node": {"name": "t", "state_dir": str(tmp), **node}, "tun": {"enable": True}}
    return TunService(from_dict(raw), mesh, opener=refuse)


def refuse(name: str) -> tuple[Any, int, int]:
    raise OSError(1, "Operation not permitted")


async def test_needs_the_mesh(tmp_path: Path) -> None:
    svc = service(tmp_path, mesh=None, ipv4="10.144.144.1/24")
    with pytest.raises(StartupError, match=r"tun\.enable: the TUN device needs the mesh"):
        await svc.start()


async def test_needs_a_virtual_address(tmp_path: Path) -> None:
    svc = service(tmp_path)
    with pytest.raises(StartupError, match=r"node\.ipv4 or node\.ipv6"):
        await svc.start()


async def test_device_refused_names_the_key_and_leaves_nothing(tmp_path: Path) -> None:
    svc = service(tmp_path, ipv4="10.144.144.1/24")
    with pytest.raises(StartupError, match=r"tun\.name: cannot create TUN device 'meshgate0': .*permitted"):
        await svc.start()
    assert not list(tmp_path.glob("tun-*.json"))
    assert svc.status()["routes"] == []
