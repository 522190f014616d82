"""[dns.query_log] with `dns.workers = 2`: the questions the worker process answers reach the
node's ring and file too (they were in neither). Real worker process, dnspython on loopback."""

from __future__ import annotations

import json
from pathlib import Path

import dns.asyncquery
import dns.message

from meshgate.config import from_dict
from meshgate.dns.service import DnsService
from meshgate.node import Node
from tests.helpers import async_wait_until

WWW = "192.0.2.7"


async def test_worker_questions_are_in_the_nodes_ring_and_file(tmp_path: Path) -> None:
    path = tmp_path / "queries.jsonl"
    cfg = from_dict({
        "node": {"name": "alpha", "ipv4": "10.144.144.1/24", "state_dir": str(tmp_path / "state")},
        "socks5": {"enable": False},
        "admin": {"enable": False},
        "dns": {"workers": 2, "records": {"www.test": WWW},
                "upstreams": ["udp://127.0.0.1:9"],  # never asked: every name here is local
                "listener": [{"protocol": "udp", "listen": "127.0.0.1:0"}],
                "query_log": {"enable": True, "path": str(path)}},
    })
    node = Node(cfg)
    await node.start()
    try:
        svc = next(s for s in node.services if s.name == "dns")
        assert isinstance(svc, DnsService) and svc.pool is not None
        url = svc.urls[0]
        port = int(url.rsplit(":", 1)[1])
        qlog = node.resolver.query_log if node.resolver is not None else None
        assert qlog is not None
        # Each query from a socket of its own: the kernel spreads them over both processes.
        n = 60
        for _ in range(n):
            r = await dns.asyncquery.udp(dns.message.make_query("www.test", "A"), "127.0.0.1", port=port,
                                         timeout=5)
            assert r.answer[0][0].to_text() == WWW

        def worker_share() -> int:
            return int(svc.status()["workers"]["1"]["queries"].get(url, 0))

        await async_wait_until(lambda: worker_share() > 0, what="the worker's queries reported")
        await async_wait_until(lambda: qlog.seq == n, what="every question in the node's ring")
        entries = [qlog.as_dict(e) for e in qlog.since(0)]
        assert {(e["listener"], e["name"], e["type"], e["rcode"], e["client"]) for e in entries} == {
            (url, "www.test.", "A", "NOERROR", "127.0.0.1")}
        assert all(e["answers"] == [WWW] for e in entries)
        # one process writes the file, with every process's questions
        await async_wait_until(lambda: path.exists() and len(path.read_text().splitlines()) == n,
                               what="every question in the file")
        lines = [json.loads(line) for line in path.read_text().splitlines()]
        assert all(line["name"] == "www.test." and line["source"] == "local" for line in lines)
        times = [line["time"] for line in lines]
        assert max(times) - min(times) < 60
    finally:
        await node.stop()


def test_log_frames_round_trip() -> None:
    from meshgate.dns.worker_pool import decode_log, encode_log

    entries = [(1.5, ("192.0.2.9", 5353), "udp://127.0.0.1:53", b"\x03www\x04test\x00", 1, b"\x00" * 12,
                "cache", 0.25),
               (2.0, ("2001:db8::1", 53, 0, 0), "https://[::1]:8443/dns-query", b"\x00", 28, b"\x81\x83" * 6,
                "failed", 12.0),
               (3.0, None, "tcp://127.0.0.1:53", b"\x00", 6, b"", "local", 0.0)]
    back = decode_log(encode_log(entries))
    assert back[0] == entries[0]
    assert back[1][1] == ("2001:db8::1", 53) and back[1][2:] == entries[1][2:]
    assert back[2] == entries[2]
