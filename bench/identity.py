"""What node identity costs: handshakes, record verification, route convergence.

Sections (medians of alternating rounds, bench/common.py):

* **handshake**: complete link handshakes in one process, sans-I/O (two LinkCodecs:
  preface, Noise XXpsk3 with the persistent static keys, then each side's signed HELLO
  checked as MeshService.link_ready does), secret mode vs certificate mode. Reported:
  handshakes/s and CPU µs per handshake (both ends).
* **verify**: CPU µs per received route record checked (trust.check_record): secret mode
  (signature), certificate mode with the certificate already verified (the usual case:
  one certificate, many versions) and with a certificate seen for the first time.
* **sync**: convergence of the sans-I/O sync alone (every node's RouteTable exchanging
  ROUTES bodies round by round) for 50 and 200 nodes, records signed and verified vs the
  same tables with neither (what the protocol cost before this release), paired.
* **converge**: N MeshServices on ring links in one process (50 and 200), signed and
  verified vs verification switched off in the same services, paired.
* **revoke**: 10 services in certificate mode on ring links; the revocation list written to
  node 0's node.revocation_list; seconds until the revoked node is gone from every other
  node (records and links). The target is 5 s.

    .venv/bin/python bench/identity.py [--rounds N] [--only SECTIONS] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import Metrics, Runner, add_args, report, self_cpu_seconds
from bench.mesh import random_graph, run
from meshgate.mesh import certs
from meshgate.mesh.frames import (
    HELLO,
    Hello,
    LinkCodec,
    decode_hello,
    derive_psk,
    encode_hello,
    hello_signed_data,
)
from meshgate.mesh.identity import Identity
from meshgate.mesh.routing import Record, RouteTable, encode_records
from meshgate.mesh.trust import Trust
from tests.identity_testing import TestCA
from tests.mesh_testing import mesh_node, node_config, ring_name, stop_all

NOW = time.time()


class _World:
    """One CA, and identities with certificates, made once for every section."""

    def __init__(self, n: int) -> None:
        self.tmp = tempfile.TemporaryDirectory()
        self.ca = TestCA(Path(self.tmp.name))
        self.idents = [Identity.generate() for _ in range(n)]
        self.certs = []
        for i, ident in enumerate(self.idents):
            path = self.ca.issue(f"n{i}", ident, f"10.{i // 250}.{i % 250}.1/8")
            self.certs.append(certs.load_certificate_text(path.read_text()))

    def trust(self, i: int, cert_mode: bool) -> Trust:
        return Trust("testnet", (self.ca.cert,), self.certs[i]) if cert_mode else Trust("testnet")


# --------------------------------------------------------------------------- handshake


def _hello_sink(got: dict[str, Hello], side: str) -> Any:
    def on_frame(ftype: int, flags: int, hop: int, src: int, dst: int, body: memoryview) -> None:
        if ftype == HELLO:
            got[side] = decode_hello(body)
    return on_frame


def handshakes(world: _World, cert_mode: bool, count: int = 300) -> Metrics:
    psk = derive_psk("testnet", "bench secret")
    a_id, b_id = world.idents[0], world.idents[1]
    ta, tb = world.trust(0, cert_mode), world.trust(1, cert_mode)

    def hello_fn(ident: Identity, cert: bytes) -> Any:
        def body(h: bytes, initiator: bool) -> bytes:
            return encode_hello(Hello(ident.node_id, 1, "n", ident.public, cert,
                                      ident.sign(hello_signed_data(h, initiator))))
        return body

    ca_raw = world.certs[0].raw if cert_mode else b""
    cb_raw = world.certs[1].raw if cert_mode else b""
    t0, c0 = time.perf_counter(), self_cpu_seconds()
    for _ in range(count):
        got: dict[str, Hello] = {}
        a = LinkCodec(True, "testnet", psk, _hello_sink(got, "a"), hello=hello_fn(a_id, ca_raw),
                      static=a_id.dh_private)
        b = LinkCodec(False, "testnet", psk, _hello_sink(got, "b"), hello=hello_fn(b_id, cb_raw),
                      static=b_id.dh_private)
        a.start()
        for _ in range(4):
            for chunk in a.data_to_send():
                b.receive(chunk)
            for chunk in b.data_to_send():
                a.receive(chunk)
        ha, hb = got["a"], got["b"]  # a received b's HELLO and b a's
        ok_a = ta.check_hello(ha, a.remote_static, a.handshake_hash, False, NOW)
        ok_b = tb.check_hello(hb, b.remote_static, b.handshake_hash, True, NOW)
        assert not isinstance(ok_a, str) and not isinstance(ok_b, str), (ok_a, ok_b)
    wall, cpu = time.perf_counter() - t0, self_cpu_seconds() - c0
    return {"handshakes/s": count / wall, "cpu_us_each": cpu / count * 1e6}


# --------------------------------------------------------------------------- verify


def _record(world: _World, i: int, version: int, cert_mode: bool) -> Record:
    ident = world.idents[i]
    rec = Record(origin=ident.node_id, session=1, version=version, name=f"n{i}",
                 ipv4=world.certs[i].ipv4, key=ident.public, cert=world.certs[i].raw if cert_mode else b"")
    return dataclasses.replace(rec, signature=ident.sign(rec.signed_part))


def verify_cost(world: _World, mode: str, count: int = 2000) -> Metrics:
    cert_mode = mode != "secret"
    n = len(world.idents) - 1
    recs = [_record(world, 1 + k % n, int(NOW * 1000) + k, cert_mode) for k in range(count)]
    trust = world.trust(0, cert_mode)
    if mode == "cert-cached":
        for r in recs:
            trust.check_record(r, None, NOW)  # every certificate seen once
    t0 = self_cpu_seconds()
    for r in recs:
        if mode == "cert-first-seen":
            trust._verified.clear()
        assert trust.check_record(r, None, NOW) is None
    return {"cpu_us_per_record": (self_cpu_seconds() - t0) / count * 1e6}


# --------------------------------------------------------------------------- sync


def sync_simulation(world: _World, n: int, signed: bool) -> Metrics:
    adj = random_graph(n, 3, seed=n)
    tables: dict[int, RouteTable] = {}
    ids = {i: world.idents[i].node_id for i in adj}
    for i in adj:
        ident = world.idents[i]
        local = Record(ids[i], 1, int(NOW * 1000), f"n{i}", ipv4=world.certs[i].ipv4,
                       neighbours=tuple(sorted((ids[j], lat) for j, lat in adj[i])),
                       key=ident.public if signed else b"", cert=world.certs[i].raw if signed else b"")
        trust = world.trust(i, True)
        tables[i] = RouteTable(
            local, max_records=n + 1, sign=ident.sign if signed else None,
            accept=(lambda r, held, t=trust: t.check_record(r, held, NOW)) if signed else None,
        )
    for i, t in tables.items():
        for j, _ in adj[i]:
            t.neighbour_up(ids[j])
    t0, c0 = time.perf_counter(), self_cpu_seconds()
    while True:
        moved = 0
        for i, t in tables.items():
            for j, _ in adj[i]:
                recs = t.records_to_send(ids[j], 0.0)
                if recs:
                    for body in encode_records(recs, 60000):
                        t.receive_acks(ids[j], tables[j].receive_body(ids[i], body, 0.0))
                    moved += len(recs)
        for t in tables.values():
            moved += t.settle()  # what MeshService does before each build
        if not moved:
            break
    for t in tables.values():
        t.build()
    elapsed, cpu = time.perf_counter() - t0, self_cpu_seconds() - c0
    assert all(len(t.hop_paths) == n for t in tables.values())
    assert all(t.refused == 0 for t in tables.values())
    return {"converge_s": elapsed, "cpu_ms_per_node": cpu / n * 1000}


# --------------------------------------------------------------------------- converge


def convergence(n: int, signed: bool) -> Metrics:
    adj = random_graph(n, 3, seed=n)

    async def go() -> Metrics:
        names = {i: ring_name("idconv") for i in range(n)}
        nodes = []
        t0, c0 = time.perf_counter(), self_cpu_seconds()
        for i in range(n):
            peers = [f"ring://{names[j]}" for j, _ in adj[i] if j < i]
            svc = mesh_node(node_config(f"n{i}", listen=[f"ring://{names[i]}"], peers=peers,
                                        limits={"route_records": 4096}))
            if not signed:  # the same service, with signing and checking switched off
                svc.table._sign = None
                svc.table._accept = None
            await svc.start()
            nodes.append(svc)
        try:
            while not all(len(s.table.hop_paths) == n for s in nodes):
                await asyncio.sleep(0.01)
                if time.perf_counter() - t0 > 180:
                    raise RuntimeError("no convergence in 180 s")
            return {"converge_s": time.perf_counter() - t0, "cpu_s": self_cpu_seconds() - c0}
        finally:
            await stop_all(nodes)

    out: Metrics = run(go())
    return out


def revocation(n: int = 10) -> Metrics:
    """Certificate mode, N services on ring links (a random graph), the list written on node 0:
    seconds until the revoked node (the last) is gone from every other node's table and links."""
    adj = random_graph(n, 3, seed=n)
    tmp = tempfile.TemporaryDirectory()
    root = Path(tmp.name)
    ca = TestCA(root)

    async def go() -> Metrics:
        names = {i: ring_name("idrev") for i in range(n)}
        nodes: list[Any] = []
        certs_ = []
        for i in range(n):
            ident = Identity.generate()
            cert = ca.issue(f"n{i}", ident, f"10.77.0.{i + 1}/24")
            certs_.append(cert)
            peers = [f"ring://{names[j]}" for j, _ in adj[i] if j < i]
            node = {"certificate": str(cert), "ca": (ca.ca_file,),
                    "revocation_list": str(ca.revocation_list) if i == 0 else str(root / f"none{i}"),
                    "state_dir": str(root / f"s{i}")}
            cfg = node_config(f"n{i}", f"10.77.0.{i + 1}/24", listen=[f"ring://{names[i]}"], peers=peers)
            cfg = dataclasses.replace(cfg, node=dataclasses.replace(cfg.node, **node))
            svc = mesh_node(cfg, ident)
            await svc.start()
            nodes.append(svc)
        try:
            while not all(len(s.table.hop_paths) == n for s in nodes):
                await asyncio.sleep(0.01)
            victim = nodes[-1].node_id
            t0 = time.perf_counter()
            ca.revoke(certs_[-1])
            while any(victim in s.table.records or victim in s.links for s in nodes[:-1]):
                await asyncio.sleep(0.005)
                if time.perf_counter() - t0 > 30:
                    raise RuntimeError("revocation did not reach every node in 30 s")
            return {"gone_everywhere_s": time.perf_counter() - t0}
        finally:
            await stop_all(nodes)
            tmp.cleanup()

    out: Metrics = run(go())
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(p, rounds=3)
    args = p.parse_args()
    sections = {s.strip() for s in (args.only or "handshake,verify,sync,converge,revoke").split(",")}
    world = _World(200)
    runners: list[Runner] = []
    if "handshake" in sections:
        r = Runner("link handshakes with signed HELLOs, sans-I/O, one process", args.rounds, "secret")
        r.add("secret", functools.partial(handshakes, world, False))
        r.add("certificate", functools.partial(handshakes, world, True))
        r.run()
        runners.append(r)
    if "verify" in sections:
        r = Runner("route record checks (trust.check_record)", args.rounds)
        for mode in ("secret", "cert-cached", "cert-first-seen"):
            r.add(mode, functools.partial(verify_cost, world, mode))
        r.run()
        runners.append(r)
    if "sync" in sections:
        for n in (50, 200):
            r = Runner(f"sans-I/O sync of {n} nodes: signed+verified vs neither", args.rounds, "unsigned")
            r.add("unsigned", functools.partial(sync_simulation, world, n, False))
            r.add("signed", functools.partial(sync_simulation, world, n, True))
            r.run()
            runners.append(r)
    if "converge" in sections:
        for n in (50, 200):
            r = Runner(f"{n} services on ring links: signed+verified vs checks off", args.rounds, "unsigned")
            r.add("unsigned", functools.partial(convergence, n, False))
            r.add("signed", functools.partial(convergence, n, True))
            r.run()
            runners.append(r)
    if "revoke" in sections:
        r = Runner("revocation: written on one node of 10 (certificate mode, ring links)", args.rounds)
        r.add("10 nodes", revocation)
        r.run()
        runners.append(r)
    report(runners, json_path=args.json,
           ratio_metrics=["converge_s", "cpu_s", "cpu_ms_per_node", "handshakes/s"])


if __name__ == "__main__":
    main()
