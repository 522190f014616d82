"""[dns.blocklist] on a real node: its udp listener asked with dnspython, a LocalAuthority-style
upstream on loopback for what is not blocked, real list files in tmp_path (hosts, plain and
adblock formats with garbage lines), re-reading and deleting a file, DNS worker processes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import dns.asyncquery
import dns.message
import dns.rcode
import pytest

from meshgate.config import Config, from_dict
from meshgate.dns.service import DnsService
from meshgate.metrics import REGISTRY
from meshgate.node import Node
from tests.helpers import async_wait_until
from tests.integration.test_dns_split import TagAuthority

UP = "192.0.2.7"

ADS = """\
# hosts format
0.0.0.0 ads.example tracker.example
127.0.0.1 localhost
! adblock style
||Metrics.Example^
@@||fine.metrics.example^
plain.example
this line is garbage
||half
"""


@pytest.fixture
async def auth() -> AsyncIterator[TagAuthority]:
    a = await TagAuthority(UP).start()
    yield a
    await a.stop()


def node_config(tmp_path: Path, auth: TagAuthority, *, workers: int = 1, **blocklist: Any) -> Config:
    (tmp_path / "ads.txt").write_text(ADS)
    (tmp_path / "allow.txt").write_text("0.0.0.0 good.ads.example\n")
    bl = {"lists": [str(tmp_path / "ads.txt")], "allow": [str(tmp_path / "allow.txt")], **blocklist}
    return from_dict({
        "node": {"name": "alpha", "ipv4": "10.144.144.1/24", "state_dir": str(tmp_path / "state")},
        "socks5": {"enable": False},
        "admin": {"enable": False},
        "dns": {"workers": workers, "upstreams": [auth.url], "blocklist": bl,
                "records": {"ads.example.": "192.0.2.99"},
                "listener": [{"protocol": "udp", "listen": "127.0.0.1:0"}]},
        "limits": {"dns_timeout": 2.0},
    })


def udp_port(node: Node) -> tuple[DnsService, str, int]:
    svc = next(s for s in node.services if s.name == "dns")
    assert isinstance(svc, DnsService)
    url = next(u for u in svc.urls if u.startswith("udp://"))
    return svc, url, int(url.rsplit(":", 1)[1])


async def ask(port: int, name: str, rdtype: str = "A") -> tuple[str, list[str]]:
    r = await dns.asyncquery.udp(dns.message.make_query(name, rdtype), "127.0.0.1", port=port, timeout=5.0)
    return dns.rcode.to_text(r.rcode()), [rr.to_text() for rrset in r.answer for rr in rrset]


def blocked_count() -> int:
    return REGISTRY.counter("meshgate_dns_blocked_total", "", ("reason",)).labels("list").value




async def test_blocked_names_answer_nxdomain_allowlisted_and_other_names_resolve(
        tmp_path: Path, auth: TagAuthority) -> None:
    node = Node(node_config(tmp_path, auth))
    await node.start()
    try:
        svc, _url, port = udp_port(node)
        before = blocked_count()
        assert await ask(port, "tracker.example") == ("NXDOMAIN", [])
        assert await ask(port, "x.y.Tracker.Example") == ("NXDOMAIN", [])  # under it, any case
        assert await ask(port, "metrics.example", "AAAA") == ("NXDOMAIN", [])  # ||…^
        assert await ask(port, "plain.example") == ("NXDOMAIN", [])
        assert await ask(port, "a.ads.example") == ("NXDOMAIN", [])
        assert blocked_count() - before == 5
        # allowed inside a blocked domain: by the allow file and by an @@ rule
        assert await ask(port, "good.ads.example") == ("NOERROR", [UP])
        assert await ask(port, "fine.metrics.example") == ("NOERROR", [UP])
        assert await ask(port, "xtracker.example") == ("NOERROR", [UP])  # not a label boundary
        assert await ask(port, "localhost.example") == ("NOERROR", [UP])
        assert set(auth.queries) == {"good.ads.example.", "fine.metrics.example.", "xtracker.example.",
                                     "localhost.example."}
        # local data wins: a static record and the mesh zone are never blocked
        assert await ask(port, "ads.example") == ("NOERROR", ["192.0.2.99"])
        assert await ask(port, "alpha.mesh.internal") == ("NOERROR", ["10.144.144.1"])
        lists = svc.status()["blocklist"]["lists"]
        assert lists[str(tmp_path / "ads.txt")]["malformed"] == 2
        # ads, tracker, metrics, plain; fine.metrics allowed
        assert lists[str(tmp_path / "ads.txt")]["entries"] == 5
    finally:
        await node.stop()


@pytest.mark.parametrize(("mode", "a", "aaaa", "mx"), [
    ("zero", ("NOERROR", ["0.0.0.0"]), ("NOERROR", ["::"]), ("NOERROR", [])),
    ("refused", ("REFUSED", []), ("REFUSED", []), ("REFUSED", [])),
    ("nxdomain", ("NXDOMAIN", []), ("NXDOMAIN", []), ("NXDOMAIN", [])),
])
async def test_answer_modes(tmp_path: Path, auth: TagAuthority, mode: str, a: Any, aaaa: Any,
                            mx: Any) -> None:
    node = Node(node_config(tmp_path, auth, answer=mode))
    await node.start()
    try:
        _svc, _url, port = udp_port(node)
        assert await ask(port, "w.tracker.example", "A") == a
        assert await ask(port, "w.tracker.example", "AAAA") == aaaa
        assert await ask(port, "w.tracker.example", "MX") == mx
        assert auth.asked() == 0
    finally:
        await node.stop()


async def test_a_cached_name_blocked_later_is_not_served_from_the_cache_and_a_deleted_list_keeps_its_copy(
        tmp_path: Path, auth: TagAuthority) -> None:
    node = Node(node_config(tmp_path, auth, refresh=0.2))
    await node.start()
    try:
        _svc, _url, port = udp_port(node)
        assert await ask(port, "news.example") == ("NOERROR", [UP])  # now in the cache
        ads = tmp_path / "ads.txt"
        ads.write_text(ADS + "news.example\n")

        async def news_blocked() -> bool:
            return await ask(port, "news.example") == ("NXDOMAIN", [])

        await async_wait_until(news_blocked, 15, "the changed list blocks news.example")
        assert auth.queries["news.example."] == 1
        failures = REGISTRY.counter("meshgate_dns_blocklist_load_failures_total", "",
                                    ("list",)).labels(str(ads))
        before = failures.value
        ads.unlink()

        async def failure_counted() -> bool:
            # files are checked on a question, at most every dns.blocklist.refresh seconds
            assert await ask(port, "news.example") == ("NXDOMAIN", [])  # the last good copy
            return failures.value > before

        await async_wait_until(failure_counted, 15, "the missing list is counted")
        assert await ask(port, "tracker.example") == ("NXDOMAIN", [])
    finally:
        await node.stop()


async def test_a_big_changed_list_is_parsed_beside_answering_and_then_blocks(
        tmp_path: Path, auth: TagAuthority) -> None:
    """A list file that changes is re-read in a thread: while its 300,000 lines parse, the node
    keeps answering from the old rules (a parse on the event loop held every answer, and the
    mesh's pings, for the whole parse: about 10 s for a million lines), then the new rules block."""
    node = Node(node_config(tmp_path, auth, refresh=0.2))
    await node.start()
    try:
        _svc, _url, port = udp_port(node)
        assert node.resolver is not None and node.resolver.blocklist is not None
        assert await ask(port, "late.example") == ("NOERROR", [UP])
        big = "".join(f"n{i}.bulk.example\n" for i in range(300_000))
        (tmp_path / "ads.txt").write_text(ADS + big + "late.example\n")
        listfile = node.resolver.blocklist.files[0]

        async def parsing() -> bool:
            await ask(port, "other.example")  # questions trigger the re-read check
            return listfile.task is not None and not listfile.task.done()

        await async_wait_until(parsing, 15, "the changed list being parsed")
        # answered while the parse runs, by the old rules (ads still blocked, late not yet)
        assert await ask(port, "tracker.example") == ("NXDOMAIN", [])
        assert await ask(port, "news2.example") == ("NOERROR", [UP])
        assert listfile.task is not None and not listfile.task.done(), "answered only after the parse"

        async def late_blocked() -> bool:
            return await ask(port, "late.example") == ("NXDOMAIN", [])

        await async_wait_until(late_blocked, 60, "the new rules in")
        assert await ask(port, "n299999.bulk.example") == ("NXDOMAIN", [])
    finally:
        await node.stop()


@pytest.mark.parametrize("inside", ["192.168.1.5", "10.9.9.9", "127.0.0.1", "169.254.1.1", "100.64.0.7"])
async def test_rebinding_protection_blocks_public_names_pointing_inside_but_not_routed_ones(
        tmp_path: Path, inside: str) -> None:
    """dns.blocklist.rebinding: an upstream answer for a public name that holds a private,
    loopback, link-local or CGNAT address is answered as blocked (counted, cached); the same
    answer for a name under a [[dns.route]] (internal by config) passes, as do public addresses."""
    evil = await TagAuthority(inside).start()
    public = await TagAuthority("198.51.100.80").start()
    rebinding = REGISTRY.counter("meshgate_dns_blocked_total", "", ("reason",)).labels("rebinding")
    node = Node(from_dict({
        "node": {"name": "alpha", "state_dir": str(tmp_path / "state")},
        "socks5": {"enable": False}, "admin": {"enable": False},
        "dns": {"upstreams": [evil.url], "blocklist": {"rebinding": True},
                "route": [{"suffix": "lan.example.", "upstreams": [evil.url]},
                          {"suffix": "pub.example.", "upstreams": [public.url]}],
                "listener": [{"protocol": "udp", "listen": "127.0.0.1:0"}]},
    }))
    await node.start()
    try:
        _svc, _url, port = udp_port(node)
        before = rebinding.value
        assert await ask(port, "attacker.example") == ("NXDOMAIN", [])
        assert rebinding.value == before + 1
        assert await ask(port, "attacker.example") == ("NXDOMAIN", [])  # from the cache
        assert evil.queries["attacker.example."] == 1
        assert await ask(port, "nas.lan.example") == ("NOERROR", [inside])  # routed: internal
        assert await ask(port, "www.pub.example") == ("NOERROR", ["198.51.100.80"])
        assert rebinding.value == before + 1
    finally:
        await node.stop()
        await evil.stop()
        await public.stop()


async def test_without_rebinding_protection_private_answers_pass(tmp_path: Path) -> None:
    evil = await TagAuthority("192.168.1.5").start()
    node = Node(from_dict({
        "node": {"name": "alpha", "state_dir": str(tmp_path / "state")},
        "socks5": {"enable": False}, "admin": {"enable": False},
        "dns": {"upstreams": [evil.url], "listener": [{"protocol": "udp", "listen": "127.0.0.1:0"}]},
    }))
    await node.start()
    try:
        _svc, _url, port = udp_port(node)
        assert await ask(port, "attacker.example") == ("NOERROR", ["192.168.1.5"])
    finally:
        await node.stop()
        await evil.stop()


async def test_a_missing_list_at_start_is_not_a_start_up_failure(tmp_path: Path, auth: TagAuthority) -> None:
    cfg = node_config(tmp_path, auth)
    (tmp_path / "ads.txt").unlink()
    node = Node(cfg)
    await node.start()
    try:
        svc, _url, port = udp_port(node)
        assert await ask(port, "tracker.example") == ("NOERROR", [UP])
        assert svc.status()["blocklist"]["lists"][str(tmp_path / "ads.txt")]["load_failures"] == 1
    finally:
        await node.stop()


async def test_worker_processes_block_the_same_names_themselves(tmp_path: Path, auth: TagAuthority) -> None:
    """Workers answer what they can locally and send misses to the main process. They load the
    same list files (their config carries [dns.blocklist]), so a blocked name never reaches the main
    process from a worker: the worker's own blocked counter rises, and no name reaches upstream."""
    node = Node(node_config(tmp_path, auth, workers=2))
    await node.start()
    try:
        svc, url, port = udp_port(node)
        assert svc.pool is not None
        worker = svc.pool.workers[0]
        # distinct names and fresh sockets: the kernel spreads them over both processes
        answers = await asyncio.gather(*(ask(port, f"h{i}.tracker.example") for i in range(32)))
        assert answers == [("NXDOMAIN", [])] * 32
        assert auth.asked() == 0

        blocked_key = ("meshgate_dns_blocked_total", ("list",))

        async def worker_reported_all() -> bool:
            # the worker's report is one snapshot: every query it counted so far, it blocked itself
            got = worker.merge.queries.get(url, 0)
            return got > 0 and worker.merge.last.get(blocked_key, 0) == got

        await async_wait_until(worker_reported_all, 15, "the worker reports the names it blocked itself")
        # the rest the main process answered (the kernel gave it some), also without an upstream
        assert worker.merge.queries[url] < 32, "the worker got every query: the main process answered none"
        # the worker's answers for names not blocked still come through the main process
        assert await ask(port, "open.example") == ("NOERROR", [UP])
    finally:
        await node.stop()
