"""An idle mesh stays idle (issue 18 item 5): a link carries one ping exchange per
interval, and a link's latency noise makes no route-record versions (each version
floods to every node, each checking its signature and rebuilding its routes), while
a real latency change still does, ever less often when it keeps swinging.

Pings run over real TCP links on loopback; the latency tests feed pongs with made-up
RTTs into a node (the only way to control what a link "measures")."""

from __future__ import annotations

import asyncio
from collections import Counter

from meshgate.mesh.frames import PING, U64
from meshgate.mesh.links import LinkBase
from meshgate.mesh.service import MeshService, latency_moved, rtt_clock_us
from tests.helpers import async_wait_until
from tests.mesh_testing import converged, mesh_node, node_config, ring_name, start_node, stop_all

PINGS = {"mesh_ping_interval": 0.2, "mesh_dead_after": 2.0}


SENT: dict[int, int] = {}  # node id -> the link latency its last PING carried


def _count_pings(svc: MeshService, counts: Counter[str], name: str) -> None:
    """Count the PINGs `svc` sends (every one goes through _send_ping)."""
    send = svc._send_ping

    def counted(link: LinkBase) -> None:
        counts[name] += 1
        SENT[svc.node_id] = link.latency_us
        send(link)

    svc._send_ping = counted  # type: ignore[method-assign]


def _old_pinger(svc: MeshService) -> None:
    """`svc` pings like a node before the RTT field: an 8-byte token, every tick, on every
    link, and takes nothing from a peer's PING but its token to echo."""

    def send(link: LinkBase) -> None:
        assert link.peer is not None
        link.send_frame(PING, 0, 1, svc.node_id, link.peer.node_id, U64.pack(rtt_clock_us()))

    svc._send_ping = send  # type: ignore[method-assign]
    svc._pings = lambda link, now: True  # type: ignore[method-assign]


async def _pair(old_dialer: bool = False) -> tuple[MeshService, MeshService, Counter[str]]:
    """b listens on TCP, a dials it; their PINGs counted from link-up on."""
    b = await start_node(node_config("b", "10.9.0.2/24", listen=["tcp://127.0.0.1:0"], limits=PINGS))
    counts: Counter[str] = Counter()
    _count_pings(b, counts, "b")
    a = mesh_node(node_config("a", "10.9.0.1/24", peers=[b.listen_addrs[0]], limits=PINGS))
    if old_dialer:
        _old_pinger(a)
    _count_pings(a, counts, "a")
    await a.start()
    await async_wait_until(lambda: converged([a, b]), 10, "routes")
    return a, b, counts


async def test_the_dialer_pings_and_the_other_side_answers_and_takes_its_rtt() -> None:
    a, b, counts = await _pair()
    try:
        counts.clear()
        await async_wait_until(lambda: counts["a"] >= 15, 20, "15 pings from the dialer")
        # b answered every one and pinged nothing itself (at most once, if a's ping came
        # late on a busy machine): one exchange per interval on the link, not two
        assert counts["b"] <= 1, counts
        link_ab, link_ba = a.links[b.node_id][0], b.links[a.node_id][0]
        assert link_ab.initiator and not link_ba.initiator
        # b's latency of the link is what a measured and sent along (both records agree)
        await async_wait_until(lambda: link_ba.latency_us == SENT[a.node_id] > 0, 5, "b takes a's RTT")
        assert link_ba.latency_us > 0
        # nobody went silent: both ends still hear each other every interval
        assert a.stats["link_dead"] == b.stats["link_dead"] == 0
        assert converged([a, b])
    finally:
        await stop_all([a, b])


async def test_a_peer_that_pings_without_the_rtt_is_pinged_back_every_interval() -> None:
    """A dialer from before the RTT field (8-byte PINGs): the listening side measures the
    link itself, as both sides did before."""
    a, b, counts = await _pair(old_dialer=True)
    try:
        counts.clear()
        link_ba = b.links[a.node_id][0]
        samples = link_ba.rtt_samples
        await async_wait_until(lambda: counts["a"] >= 15, 20, "15 pings from the old dialer")
        assert counts["b"] >= 10, counts
        assert link_ba.rtt_samples >= samples + 10  # its own round trips, not reported ones
        assert a.stats["link_dead"] == b.stats["link_dead"] == 0
    finally:
        await stop_all([a, b])


async def _quiet_pair() -> tuple[MeshService, MeshService, LinkBase]:
    """a - b on a ring, pings only at link-up (so only the pongs fed below move a's
    latency of the link), a's latency hold 0.3 s."""
    r = ring_name()
    quiet = {"mesh_ping_interval": 60.0, "mesh_dead_after": 600.0}
    a = await start_node(node_config("a", "10.9.0.1/24", listen=[f"ring://{r}"], limits=quiet))
    b = await start_node(node_config("b", "10.9.0.2/24", peers=[f"ring://{r}"], limits=quiet))
    a.latency_hold = 0.3
    a.latency_share = 0.0  # the hold alone (the mesh-size share has its own test)
    await async_wait_until(lambda: converged([a, b]), 10, "routes")
    measured = lambda: dict(a.table.local.neighbours).get(b.node_id, 0) > 0  # noqa: E731
    await async_wait_until(measured, 5, "first measurement")
    return a, b, a.links[b.node_id][0]


def _pong(a: MeshService, link: LinkBase, rtt_us: int) -> None:
    a._on_pong(link, memoryview(U64.pack(rtt_clock_us() - rtt_us)))


def _recorded(a: MeshService, b: MeshService) -> int:
    return dict(a.table.local.neighbours)[b.node_id]


async def _settle_at(a: MeshService, b: MeshService, link: LinkBase, rtt_us: int) -> None:
    """Feed a steady RTT until a's record carries it."""
    for _ in range(60):
        _pong(a, link, rtt_us)

    def follows() -> bool:
        _pong(a, link, rtt_us)
        return abs(_recorded(a, b) - rtt_us) <= 0.2 * rtt_us

    await async_wait_until(follows, 10, f"the record to follow {rtt_us} us")


async def test_latency_noise_makes_no_version_and_a_real_change_does() -> None:
    a, b, link = await _quiet_pair()
    try:
        await _settle_at(a, b, link, 1000)
        version = a.table.local.version
        # 1 ms with a stray 8 ms sample every 15 (a pong behind a busy loop): each one pulls
        # the smoothed RTT ~90 % up for a while, well past 20 % and 50 us, for 2 s (over 6
        # latency holds); all of it within the link's own jitter: no version
        loop = asyncio.get_running_loop()
        began, i, above = loop.time(), 0, 0
        while loop.time() - began < 2.0:
            for _ in range(5):
                _pong(a, link, 8000 if i % 15 == 0 else 1000)
                above += latency_moved(link.latency_us, 1000)  # the band alone would move
                i += 1
            await asyncio.sleep(0.02)
        assert above > 20
        assert a.table.local.version == version, (i, a.table.local.version - version)
        # a real change: 1 ms -> 3 ms for good; re-originated within a few holds
        await _settle_at(a, b, link, 3000)
        assert a.table.local.version > version
        await async_wait_until(lambda: b.table.records[a.node_id] == a.table.local, 5, "b holds it")
        assert abs(dict(b.table.records[a.node_id].neighbours)[b.node_id] - 3000) <= 600
    finally:
        await stop_all([a, b])


async def test_a_busy_spell_where_some_pongs_still_come_on_time_moves_no_record() -> None:
    """Records carry the base RTT, the least of the last 10: queueing and a busy loop only
    add to a round trip. Nine pongs in ten late by 10 ms for 2 s (the smoothed RTT goes to
    ~10 ms, again and again beyond its jitter band): the path is what it was, no version.
    Every pong late for good (the path got longer): the record follows."""
    a, b, link = await _quiet_pair()
    try:
        await _settle_at(a, b, link, 1000)
        version = a.table.local.version
        loop = asyncio.get_running_loop()
        began, i, above = loop.time(), 0, 0
        while loop.time() - began < 2.0:
            for _ in range(10):
                _pong(a, link, 1000 if i % 10 == 9 else 11000)
                # the smoothed RTT would move the record, jitter and all
                above += latency_moved(link.latency_us, 1000, link.jitter_us)
                i += 1
            await asyncio.sleep(0.02)
        assert above > 20 and abs(link.base_us - 1000) <= 50
        assert a.table.local.version == version, a.table.local.version - version
        await _settle_at(a, b, link, 11000)
        assert a.table.local.version > version
    finally:
        await stop_all([a, b])


async def test_a_latency_that_keeps_swinging_makes_ever_fewer_versions() -> None:
    """Plateaus of 1 ms and 3 ms, 0.1 s each, for 3 s: each is a real change (the jitter
    dies down within the plateau), but with a 0.3 s hold that doubles per version in a
    row, 3 s take at most 0.3 + 0.6 + 1.2 (+ one in progress): 4 versions, not 10."""
    a, b, link = await _quiet_pair()
    try:
        await _settle_at(a, b, link, 1000)
        await asyncio.sleep(0.7)  # a quiet spell: the hold is back at its base
        version = a.table.local.version
        loop = asyncio.get_running_loop()
        began, plateaus = loop.time(), 0
        while loop.time() - began < 3.0:
            for _ in range(40):
                _pong(a, link, 3000 if plateaus % 2 else 1000)
            plateaus += 1
            await asyncio.sleep(0.1)
        made = a.table.local.version - version
        assert plateaus >= 20 and 2 <= made <= 4, (plateaus, made)
        # and once it stops swinging the record ends on what the link measures
        await _settle_at(a, b, link, 2000)
    finally:
        await stop_all([a, b])


async def test_latency_versions_are_held_longer_the_larger_the_mesh() -> None:
    """Every node checks each version and every link carries it: latency-only versions are
    held `latency_share` seconds per node in the table (the mesh as a whole makes about one a
    second, whatever its size), on top of the hold."""
    a, b, link = await _quiet_pair()
    try:
        await _settle_at(a, b, link, 1000)
        if a._latency_timer is not None:  # one the settling left: set for the short hold
            a._latency_timer.cancel()
            a._latency_timer = None
        a.latency_share = 1.5  # two nodes in the table: held 3 s, not 0.3
        version = a.table.local.version
        for _ in range(60):  # a real change, 1 to 4 ms
            _pong(a, link, 4000)
        assert a.table.local.version == version
        assert a._latency_timer is not None
        assert a._latency_timer.when() >= a._last_originated + 3.0 - 1e-3
    finally:
        await stop_all([a, b])
