"""Certificate mode with four `meshgate run` processes on loopback, each with its own state dir,
and an attacker holding a valid certificate of the same CA (an in-process node whose code was
changed to claim more than its certificate grants, and to show certificates that are not its own).

a-b-c-d: a line, so a reaches d through two relays. The attacker links to a."""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from meshgate.config import from_dict
from meshgate.mesh import certs
from meshgate.mesh.frames import MAX_BODY, ROUTES
from meshgate.mesh.identity import Identity, load_or_create
from meshgate.mesh.routing import Record, encode_records
from meshgate.mesh.service import MeshService
from tests.helpers import async_wait_until, free_port
from tests.identity_testing import TestCA

ROOT = Path(__file__).resolve().parents[2]
NAMES = ("a", "b", "c", "d")


def _get(admin: int, path: str) -> Any:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{admin}{path}", timeout=2) as r:
            body = r.read()
    except OSError:
        return None
    return body.decode() if path == "/metrics" else json.loads(body)


async def _aget(admin: int, path: str) -> Any:
    return await asyncio.get_running_loop().run_in_executor(None, _get, admin, path)


def _metric(text: str | None, name: str, label: str) -> float:
    for line in (text or "").splitlines():
        if line.startswith(name + "{") and label in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


class Mesh:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.ca = TestCA(tmp)
        self.mesh = [free_port() for _ in NAMES]
        self.admin = [free_port() for _ in NAMES]
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.certs: dict[str, Path] = {}
        for i, name in enumerate(NAMES):
            ident = load_or_create(tmp / name)  # what `meshgate key show` does on that node
            self.certs[name] = self.ca.issue(name, ident, f"10.144.144.{i + 1}/24",
                                            cidrs=("10.50.0.0/16",) if name == "d" else ())

    def config(self, i: int) -> Path:
        name = NAMES[i]
        node = self.ca.node_keys(self.certs[name])
        peers = f'"tcp://127.0.0.1:{self.mesh[i - 1]}"' if i else ""
        cidrs = 'proxy_cidrs = ["10.50.0.0/16"]' if name == "d" else ""
        path = self.tmp / f"{name}.toml"
        revocation = node["revocation_list"] if name == "a" else str(self.tmp / f"{name}-none.list")
        path.write_text(f"""
[node]
name = "{name}"
network = "testnet"
ipv4 = "10.144.144.{i + 1}/24"
state_dir = "{self.tmp / name}"
certificate = "{node['certificate']}"
ca = "{node['ca']}"
revocation_list = "{revocation}"
[mesh]
listen = ["tcp://127.0.0.1:{self.mesh[i]}"]
peers = [{peers}]
{cidrs}
[socks5]
enable = false
[admin]
listen = "127.0.0.1:{self.admin[i]}"
""")
        return path

    def start(self, i: int) -> None:
        self.procs[NAMES[i]] = subprocess.Popen(
            [sys.executable, "-m", "meshgate", "run", "-c", str(self.config(i)), "--log-level", "warning"],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )

    def stop(self, name: str) -> None:
        p = self.procs.pop(name)
        p.terminate()
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


@pytest.fixture
def mesh(tmp_path: Path) -> Iterator[Mesh]:
    m = Mesh(tmp_path)
    try:
        for i in range(len(NAMES)):
            m.start(i)
        yield m
    finally:
        for name in list(m.procs):
            m.stop(name)


async def _names(admin: int) -> set[str]:
    routes = await _aget(admin, "/routes")
    return {r["name"] for r in routes} if routes else set()


def _attacker(m: Mesh, name: str, ip: str, ident: Identity | None = None, **grants: Any) -> MeshService:
    ident = ident or Identity.generate()
    cert = m.ca.issue(name, ident, ip, **grants)
    cfg = from_dict({
        "node": {"name": name, "network": "testnet", "ipv4": ip, "state_dir": str(m.tmp / name),
                 **m.ca.node_keys(cert)},
        "mesh": {"peers": [f"tcp://127.0.0.1:{m.mesh[0]}"]},
    })
    return MeshService(cfg, identity=ident)


async def test_four_nodes_with_certificates_hold_an_attacker_to_its_grant(mesh: Mesh) -> None:
    await async_wait_until(lambda: _all_see(mesh, set(NAMES)), 60, "a, b, c and d to converge")
    a_routes = {r["name"]: r for r in await _aget(mesh.admin[0], "/routes")}
    assert a_routes["d"]["hops"] == 3 and a_routes["d"]["proxy_cidrs"] == ["10.50.0.0/16"]
    status = await _aget(mesh.admin[0], "/status")
    assert "certificate" in json.dumps(status)

    # mallory: a valid certificate for 10.144.144.5 only; its changed code claims b's virtual
    # IP, a CIDR it was not granted and the exit, then forges a record in b's name
    mallory = _attacker(mesh, "mallory", "10.144.144.5/24")
    await mallory.start()
    try:
        await async_wait_until(lambda: bool(mallory.links), 20, "mallory to link to a")
        await async_wait_until(lambda: _has(mesh.admin[0], "mallory"), 10, "a to hear mallory's record")
        before = _metric(await _aget(mesh.admin[0], "/metrics"),
                         "meshgate_mesh_route_records_dropped_total", 'reason="not_granted"')
        mallory.table.update_local(ipv4=ipaddress.IPv4Interface("10.144.144.2/24"),
                                   cidrs=((ipaddress.ip_network("10.60.0.0/16"), False),), exit=True)
        mallory._schedule_sync()
        await async_wait_until(
            lambda: _dropped_more(mesh.admin[0], "not_granted", before), 10, "a to drop the claims")
        routes = await _aget(mesh.admin[0], "/routes")
        by_name = {r["name"]: r for r in routes}
        assert by_name["mallory"]["ipv4"] == "10.144.144.5"  # its last granted version stays
        assert not by_name["mallory"]["exit"] and by_name["mallory"]["proxy_cidrs"] == []
        assert by_name["b"]["ipv4"] == "10.144.144.2" and by_name["b"]["id"] != by_name["mallory"]["id"]

        b_id = int(by_name["b"]["id"], 16)
        a_id = int(by_name["a"]["id"], 16)
        forged = Record(origin=b_id, session=1, version=int(time.time() * 1000) + 1000, name="b",
                        ipv4=ipaddress.IPv4Interface("10.144.144.2/24"), exit=True,
                        key=mallory.identity.public, cert=mallory._own_cert_raw)
        forged = dataclasses.replace(forged, signature=mallory.identity.sign(forged.signed_part))
        before = _metric(await _aget(mesh.admin[0], "/metrics"),
                         "meshgate_mesh_route_records_dropped_total", 'reason="bad_origin"')
        link = mallory.links[a_id][0]
        for body in encode_records([forged], MAX_BODY):
            link.send_frame(ROUTES, 0, 1, mallory.node_id, a_id, body)
        await async_wait_until(lambda: _dropped_more(mesh.admin[0], "bad_origin", before), 10,
                               "a to drop the forged record")
        by_name = {r["name"]: r for r in await _aget(mesh.admin[0], "/routes")}
        assert not by_name["b"]["exit"]
    finally:
        await mallory.stop()

    # certificates that are not the presenter's own, expired, or from another CA: refused at
    # the handshake (the attacker's code shows them instead of its own)
    other_ca = TestCA(mesh.tmp / "other")
    for reason in ("wrong_key", "expired", "unknown_ca"):
        ident = Identity.generate()
        svc = _attacker(mesh, f"att-{reason.replace('_', '')}", "10.144.144.9/24", ident)
        if reason == "wrong_key":  # b's certificate, shown with another key
            shown = mesh.certs["b"]
        elif reason == "expired":  # its own key's, expired
            past = int(time.time()) - 3 * 86400
            shown = mesh.ca.issue("old", ident, "10.144.144.9/24", now=past, valid=86400)
        else:
            shown = other_ca.issue("x", ident, "10.144.144.9/24")
        svc._own_cert_raw = certs.load_certificate_text(shown.read_text()).raw
        await svc.start()
        try:
            await async_wait_until(
                lambda r=reason: _refused(mesh.admin[0], r), 20, f"a to refuse a certificate: {reason}")
            # a holds no link to it (its own side may see a link for a moment before a's close
            # arrives, and its keeper dials again: ask a, not the attacker)
            peers = await _aget(mesh.admin[0], "/peers")
            assert all(p["id"] != f"{svc.node_id:08x}" for p in peers)
        finally:
            await svc.stop()
    assert "att-" not in json.dumps(await _aget(mesh.admin[0], "/routes"))


async def test_revoking_a_node_on_a_cuts_it_off_everywhere(mesh: Mesh) -> None:
    await async_wait_until(lambda: _all_see(mesh, set(NAMES)), 60, "a, b, c and d to converge")
    t0 = time.monotonic()
    mesh.ca.revoke(mesh.certs["d"])  # written to a's node.revocation_list only
    await async_wait_until(lambda: _all_see(mesh, {"a", "b", "c"}, range(3)), 5,
                           "d to vanish from every node within 5 s")
    took = time.monotonic() - t0
    print(f"revocation: d gone from a, b and c after {took:.2f} s")
    # d restarted with its revoked certificate: it refuses to start once it has the list ...
    mesh.stop("d")
    (mesh.tmp / "d" / "revoked").write_text((mesh.ca.dir / "revoked").read_text())
    mesh.start(3)
    d = mesh.procs["d"]
    assert d.wait(30) == 2
    assert d.stderr is not None and b"revoked" in d.stderr.read()
    mesh.procs.pop("d")
    # ... and a d that threw the list away is refused by its peer
    (mesh.tmp / "d" / "revoked").unlink()
    mesh.start(3)
    await async_wait_until(lambda: _refused(mesh.admin[2], "revoked"), 30, "c to refuse d's certificate")
    assert "d" not in await _names(mesh.admin[2])


async def _refused(admin: int, reason: str) -> bool:
    text = await _aget(admin, "/metrics")
    return _metric(text, "meshgate_mesh_handshakes_total", f'result="refused_{reason}"') >= 1


async def _all_see(m: Mesh, names: set[str], nodes: range | None = None) -> bool:
    for i in nodes if nodes is not None else range(len(NAMES)):
        if await _names(m.admin[i]) != names:
            return False
    return True


async def _has(admin: int, name: str) -> bool:
    return name in await _names(admin)


async def _dropped_more(admin: int, reason: str, before: float) -> bool:
    text = await _aget(admin, "/metrics")
    return _metric(text, "meshgate_mesh_route_records_dropped_total", f'reason="{reason}"') > before


async def test_moving_a_secret_mesh_to_certificates_node_by_node(tmp_path: Path) -> None:
    """The migration of docs/OPERATIONS.md: a node with its certificate and
    require_certificates = false links with a secret-only node (and holds certificate holders to
    their certificates); once it requires certificates the secret-only node is refused."""
    ca = TestCA(tmp_path)
    secret = "migration test secret, long enough"
    old = MeshService(from_dict({
        "node": {"name": "old", "network": "testnet", "secret": secret, "ipv4": "10.144.144.9/24",
                 "state_dir": str(tmp_path / "old")},
        "mesh": {"listen": ["tcp://127.0.0.1:0"]},
    }), identity=Identity.generate())
    await old.start()

    def moved(require: bool) -> MeshService:
        ident = Identity.generate()
        cert = ca.issue("new", ident, "10.144.144.8/24")
        return MeshService(from_dict({
            "node": {"name": "new", "network": "testnet", "secret": secret, "ipv4": "10.144.144.8/24",
                     "state_dir": str(tmp_path / f"new-{require}"), "require_certificates": require,
                     **ca.node_keys(cert)},
            "mesh": {"peers": [old.listen_addrs[0]]},
        }), identity=ident)

    moving = moved(False)
    await moving.start()
    try:
        await async_wait_until(lambda: old.node_id in moving.table.hop_paths
                               and moving.node_id in old.table.hop_paths, 10, "the two to link")
    finally:
        await moving.stop()
    strict = moved(True)
    await strict.start()
    try:
        await async_wait_until(lambda: strict.stats["handshake_refused_no_certificate"] >= 1, 10,
                               "the secret-only node refused")
        assert old.node_id not in strict.table.hop_paths
    finally:
        await strict.stop()
        await old.stop()
