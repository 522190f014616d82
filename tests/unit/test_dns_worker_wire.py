"""The worker control channel's pieces without processes (meshgate/workerproc.py, shared by the DNS
and SOCKS5 workers; dns/worker_pool.py's name tables and DNS counter merge): frames, name tables,
counter merging, and the `dns.workers` config key."""

from __future__ import annotations

import asyncio
import ipaddress
import json

import pytest

from meshgate import workerproc as worker
from meshgate.config import ConfigError, from_dict
from meshgate.dns import worker_pool
from meshgate.metrics import REGISTRY


async def test_frames_round_trip_and_eof_is_none() -> None:
    r = asyncio.StreamReader()
    r.feed_data(worker.frame(b"N", b"{}") + worker.frame(b"S", b""))
    r.feed_data(worker.frame(b"M", b"x" * 10)[:7])  # cut short: the peer died mid-frame
    r.feed_eof()
    assert await worker.read_frame(r) == (b"N", b"{}")
    assert await worker.read_frame(r) == (b"S", b"")
    assert await worker.read_frame(r) is None


async def test_an_oversized_frame_is_refused() -> None:
    r = asyncio.StreamReader()
    r.feed_data(worker.HEAD.pack(worker.MAX_FRAME + 1, ord("M")))
    with pytest.raises(ValueError):
        await worker.read_frame(r)


def test_name_tables_round_trip() -> None:
    table = {"a": (ipaddress.IPv4Address("10.0.0.1"), ipaddress.IPv6Address("fd00::1")),
             "b": (None, ipaddress.IPv6Address("fd00::2")), "c": (ipaddress.IPv4Address("10.0.0.3"), None)}
    assert worker_pool.decode_names(worker_pool.encode_names(table)) == table


def test_counter_merge_adds_increases_once_and_survives_a_restart() -> None:
    fam = REGISTRY.counter("meshgate_dns_queries_total", "DNS queries received", ("listener",))
    c = fam.labels("udp://merge-test")
    base = c.value
    m = worker_pool.counter_merge(7)  # the DNS one: queries per listener and per worker

    def report(v: int) -> bytes:
        row = ["meshgate_dns_queries_total", "h", ["listener"], ["udp://merge-test"], v]
        return json.dumps([row]).encode()

    m.apply(report(5))
    m.apply(report(5))  # nothing new
    m.apply(report(8))
    assert c.value == base + 8
    m.restarted()  # the new process counts from zero again
    m.apply(report(2))
    assert c.value == base + 10
    assert m.queries == {"udp://merge-test": 10}
    assert REGISTRY.value("meshgate_dns_worker_queries_total", "7") == 10


def test_counter_merge_skips_a_counter_registered_with_other_labels() -> None:
    REGISTRY.counter("meshgate_test_merge_labels_total", "h", ("a",))
    m = worker.CounterMerge(8)
    m.apply(json.dumps([["meshgate_test_merge_labels_total", "h", ["a", "b"], ["1", "2"], 3],
                        ["meshgate_test_merge_ok_total", "h", [], [], 4]]).encode())
    assert REGISTRY.value("meshgate_test_merge_ok_total") == 4


def test_snapshot_lists_touched_counters() -> None:
    REGISTRY.counter("meshgate_test_snapshot_total", "h", ("x",)).labels("y").inc(3)
    rows = json.loads(worker.counter_snapshot())
    assert ["meshgate_test_snapshot_total", "h", ["x"], ["y"], 3] in rows


def test_dns_workers_config() -> None:
    assert from_dict({}).dns.workers == 1
    assert from_dict({"dns": {"workers": 2}}).dns.workers == 2
    assert from_dict({"dns": {"workers": "auto"}}).dns.workers >= 1
    for bad in (0, 65, "two", True):
        with pytest.raises(ConfigError, match=r"dns\.workers"):
            from_dict({"dns": {"workers": bad}})


def test_worker_config_carries_no_secret_and_no_mesh() -> None:
    cfg = from_dict({"node": {"name": "alpha", "secret": "s3cret-value"},
                     "mesh": {"listen": ["tcp://127.0.0.1:0"]}, "dns": {"workers": 2}})
    wc = worker_pool.worker_config(cfg, [])
    assert wc.node.secret == "" and wc.node.name == "alpha"
    assert wc.mesh.listen == () and wc.dns.workers == 1
