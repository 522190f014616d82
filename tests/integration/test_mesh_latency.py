"""Route latency end to end (issue 17 item 5): what a link measures reaches the
records, the graph, `routes()` and `peers()`, with sub-millisecond resolution.

Under uvloop `loop.time()` counts whole milliseconds, so a ping timed with it
read 0 (shown as 0.001 ms) or 1 ms on a loopback link, and latency changes under
1 ms were never re-originated: `routes` showed 0.002 ms for two ~0.4 ms links.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from meshgate.mesh.frames import U64
from meshgate.mesh.service import MeshService, latency_moved, rtt_clock_us
from tests.helpers import async_wait_until
from tests.mesh_testing import converged, node_config, ring_name, start_node, stop_all

# faster pings than the default 1 s so the smoothed values settle within seconds
LIMITS = {"mesh_ping_interval": 0.2, "mesh_dead_after": 2.0}


async def _line(kind: str, delay_ab: float = 0.0, delay_bc: float = 0.0) -> list[MeshService]:
    """A—B—C; A and C share no link."""
    if kind == "tcp":
        b = await start_node(node_config("b", "10.9.0.2/24", listen=["tcp://127.0.0.1:0"], limits=LIMITS))
        to_b = to_c = b.listen_addrs[0]
    else:
        r1, r2 = ring_name(), ring_name()
        b = await start_node(
            node_config("b", "10.9.0.2/24", listen=[f"ring://{r1}", f"ring://{r2}"], limits=LIMITS),
        )
        to_b, to_c = f"ring://{r1}?delay={delay_ab}", f"ring://{r2}?delay={delay_bc}"
    a = await start_node(node_config("a", "10.9.0.1/24", peers=[to_b], limits=LIMITS))
    c = await start_node(node_config("c", "10.9.0.3/24", peers=[to_c], limits=LIMITS))
    nodes = [a, b, c]
    await async_wait_until(lambda: converged(nodes), 10, "routes to converge")
    return nodes


def _link_us(node: MeshService, peer: MeshService) -> int:
    links = node.links.get(peer.node_id)
    return links[0].latency_us if links else 0


def _base_us(node: MeshService, peer: MeshService) -> int:
    """The link's base RTT (the least of its last samples): what the records carry."""
    links = node.links.get(peer.node_id)
    return links[0].base_us if links else 0


def _route_us(node: MeshService, dst: MeshService) -> int:
    p = node.table.lat_paths.get(dst.node_id)
    return p.latency_us if p is not None and p.hops > 0 else 0


def _edge_us(node: MeshService, origin: MeshService, to: MeshService) -> int:
    """The latency of origin's edge to `to` in the records `node` holds."""
    rec = node.table.records.get(origin.node_id)
    return dict(rec.neighbours).get(to.node_id, 0) if rec is not None else 0


def _state(a: MeshService, b: MeshService, c: MeshService) -> str:
    return (
        f"links a-b {_link_us(a, b)}/{_link_us(b, a)} us, b-c {_link_us(b, c)}/{_link_us(c, b)} us;"
        f" a's route to c {_route_us(a, c)} us (records: a {a.table.records[a.node_id].neighbours},"
        f" b {a.table.records[b.node_id].neighbours})"
    )


async def _wait(cond: Callable[[], bool], timeout: float, what: str, nodes: list[MeshService]) -> None:
    try:
        await async_wait_until(cond, timeout, what)
    except AssertionError as e:
        raise AssertionError(f"{e}: {_state(*nodes)}") from None


def _steady(cond: Callable[[], bool], for_s: float) -> Callable[[], bool]:
    """True once `cond` has held at every poll for `for_s` seconds of loop time: a value
    that only passes through the band (noise around a stale record) does not count."""
    loop = asyncio.get_running_loop()
    since: list[float] = []

    def check() -> bool:
        if not cond():
            since.clear()
            return False
        if not since:
            since.append(loop.time())
        return loop.time() - since[0] >= for_s

    return check


def _close(got: int, want: int, rel: float, floor_us: int) -> bool:
    return abs(got - want) <= rel * want + floor_us


def _check_shown(a: MeshService, b: MeshService, c: MeshService) -> None:
    """routes() and peers() show what the graph and the links hold (µs resolution)."""
    route = _route_us(a, c)
    assert a.table.hop_paths[c.node_id].latency_us == route  # a line: both policies take the one path
    shown = {r["name"]: r for r in a.routes()}["c"]
    assert shown["latency_ms"] == shown["latency_ms_ll"] == round(route / 1000, 3)
    assert a.peers()[0]["latency_ms"] == round(_link_us(a, b) / 1000, 3)


async def test_two_hop_route_latency_is_the_sum_of_loopback_tcp_links() -> None:
    nodes = await _line("tcp")
    a, b, c = nodes
    try:
        # A loopback round trip through both codecs is tens to hundreds of µs: never
        # under 20 µs (a ping timed inside one millisecond tick read 1 µs before).
        def settled() -> bool:
            ends = (_link_us(a, b), _link_us(b, a), _link_us(b, c), _link_us(c, b))
            ab, bc = _base_us(a, b), _base_us(b, c)
            edges = (_edge_us(a, a, b), _edge_us(a, b, c))
            return (
                all(20 <= x <= 50_000 for x in (*ends, *edges))
                # each edge as a holds it (its own record, b's) is what that link measures (its
                # base RTT), within the re-origination threshold (20 %, 50 µs) and some slack
                and _close(edges[0], ab, 0.25, 75)
                and _close(edges[1], bc, 0.25, 75)
                and _close(_route_us(a, c), ab + bc, 0.25, 150)
            )

        # steady for 5 ping intervals, each link end measured again meanwhile
        await _wait(_steady(settled, 1.0), 20, "the route's latency to match its links", nodes)
        # exactly the sum of the record edges once the graph is built from the newest records
        # (a record may land between two throttled builds: wait for the build, don't race it)
        await _wait(lambda: _route_us(a, c) == _edge_us(a, a, b) + _edge_us(a, b, c), 10,
                    "the graph built from the newest records", nodes)
        _check_shown(a, b, c)
    finally:
        await stop_all(nodes)


@pytest.mark.parametrize(("d_ab", "d_bc"), [(0.005, 0.010)])
async def test_two_hop_route_latency_follows_injected_ring_delays(d_ab: float, d_bc: float) -> None:
    nodes = await _line("ring", d_ab, d_bc)
    a, b, c = nodes
    rtt_ab, rtt_bc = int(2 * d_ab * 1e6), int(2 * d_bc * 1e6)  # the delay applies each way
    try:
        # a ring delay is a loop timer: it fires up to a millisecond late under uvloop, and
        # the pong waits for the loop like any callback. It can also fire a little early (a
        # loop runs what is due within its clock's resolution; uvloop counts whole ms), and the
        # base RTT (the least of the last samples, what records carry) keeps such an early
        # sample: a record that took one stays below the injected delay, since a move of a few %
        # re-originates nothing (seen: 19,734 µs carried for a 20,000 µs ring). So the bounds
        # allow 10% under the delays; the smoothed RTT also carries every late timer of a
        # loaded machine, which the upper bounds allow
        def settled() -> bool:
            ab, bc = _base_us(a, b), _base_us(b, c)
            return (
                all(rtt_ab * 0.9 <= x <= rtt_ab * 1.15 + 2500 for x in (ab, _base_us(b, a)))
                and all(rtt_bc * 0.9 <= x <= rtt_bc * 1.15 + 2500 for x in (bc, _base_us(c, b)))
                and _close(_route_us(a, c), ab + bc, 0.25, 150)
            )

        def route_follows() -> bool:
            # settled() holds the route only within 25% of the links; the route itself must also
            # reach the injected delays' bounds. Under load the records lag the links for a while
            # (asserting once right after settled() failed twice in full runs beside a busy core),
            # so wait for both together; a route that never gets there still fails
            route = _route_us(a, c)
            return settled() and (rtt_ab + rtt_bc) * 0.9 <= route <= (rtt_ab + rtt_bc) * 1.15 + 5000

        await _wait(route_follows, 20, "latencies and the route close to the injected delays", nodes)
        _check_shown(a, b, c)
    finally:
        await stop_all(nodes)


async def test_latency_reorigination_follows_the_smoothed_rtt_and_is_rate_bounded() -> None:
    """Pongs with made-up RTTs: the record follows the smoothed value, jitter under
    the threshold re-originates nothing, and a link whose latency keeps swinging
    makes at most one version per `latency_hold`."""
    r = ring_name()
    quiet = {"mesh_ping_interval": 60.0, "mesh_dead_after": 600.0}  # only the link-up pings
    a = await start_node(node_config("a", "10.9.0.1/24", listen=[f"ring://{r}"], limits=quiet))
    b = await start_node(node_config("b", "10.9.0.2/24", peers=[f"ring://{r}"], limits=quiet))
    a.latency_hold = 0.3
    a.latency_share = 0.0  # the hold alone (the mesh-size share has its own test)
    loop = asyncio.get_running_loop()
    try:
        await async_wait_until(lambda: converged([a, b]), 10, "routes")
        await async_wait_until(
            lambda: dict(a.table.local.neighbours).get(b.node_id, 0) > 0, 5, "first measurement"
        )
        link = a.links[b.node_id][0]

        def pong(rtt_us: int) -> None:
            a._on_pong(link, memoryview(U64.pack(rtt_clock_us() - rtt_us)))

        def recorded() -> int:
            return dict(a.table.local.neighbours)[b.node_id]

        for _ in range(40):  # a step to 2 ms: the smoothed RTT gets there, the record follows
            pong(2000)
        assert 1960 <= link.latency_us <= 2040
        await async_wait_until(lambda: not latency_moved(link.latency_us, recorded()), 5, "re-origination")
        assert abs(recorded() - 2000) <= 400
        await async_wait_until(lambda: b.table.records[a.node_id] == a.table.local, 5, "b holds a's record")

        version = a.table.local.version
        for i in range(100):  # ±5 % jitter: nothing to re-originate
            pong(1900 if i % 2 else 2100)
        assert (a._latency_timer, a._originate_timer, a.table.local.version) == (None, None, version)

        # bursts swinging between 0.5 and 6 ms, every 20 ms for 1.5 s (75 changes of
        # well over 20 %): at most one version per latency_hold (0.3 s), not one per burst
        # (most of such a swing is the link's own jitter, which makes none at all;
        # tests/integration/test_mesh_idle.py has the jitter and the growing hold)
        began = loop.time()
        swings = 0
        while loop.time() - began < 1.5:
            for _ in range(20):
                pong(500 if swings % 2 else 6000)
            swings += 1
            await asyncio.sleep(0.02)
        made = a.table.local.version - version
        assert swings > 40 and made <= 1.5 / 0.3 + 2, (swings, made)

        # and once the link measures steadily again the record settles on what it measures
        def steady() -> bool:
            pong(3000)
            return not latency_moved(link.latency_us, recorded())

        await async_wait_until(steady, 10, "settled")
    finally:
        await stop_all([a, b])
