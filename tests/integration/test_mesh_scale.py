"""What a mesh forming costs (issue 18 item 5): every version of a node's record floods
to every node, each checking its signature and rebuilding its routes, so a node makes as
few as its changes allow, and a busy host does not slow the flood down.

bench/mesh_scale.py measures the same at 100-1,000 nodes over several processes."""

from __future__ import annotations

import asyncio
import time

from meshgate.mesh.routing import Record
from meshgate.mesh.service import MIN_BUILD_INTERVAL, MeshService
from tests.helpers import async_wait_until
from tests.mesh_testing import converged, node_config, ring_name, start_node, stop_all


def _versions(svc: MeshService) -> list[Record]:
    """Every version `svc` originates from now on."""
    made: list[Record] = []
    update = svc.table.update_local

    def logged(**changes: object) -> bool:
        changed = update(**changes)
        if changed:
            made.append(svc.table.local)
        return changed

    svc.table.update_local = logged  # type: ignore[method-assign]
    return made


async def test_a_link_whose_first_pong_is_slow_comes_into_the_record_measured() -> None:
    """A ring link with 60 ms each way: the first RTT (120 ms) comes after the 50 ms the own
    record waits to gather changes. The record waits for it: one version, measured, not one
    with the link unmeasured (costing 500 ms in every node's graph) and one more after."""
    r = ring_name()
    hub = await start_node(node_config("hub", "10.9.0.1/24", listen=[f"ring://{r}"]))
    made = _versions(hub)
    leaf = await start_node(node_config("leaf", "10.9.0.2/24", peers=[f"ring://{r}?delay=0.06"]))
    try:
        await async_wait_until(lambda: converged([hub, leaf]), 10, "routes")
        assert [dict(v.neighbours)[leaf.node_id] > 0 for v in made] == [True], [v.neighbours for v in made]
    finally:
        await stop_all([hub, leaf])


async def test_links_coming_up_one_by_one_make_few_versions_and_a_loss_goes_at_once() -> None:
    """Six neighbours dial a hub 0.1 s apart (a mesh forming): the hub's record waits
    0.5 s after each version for more changes, so it makes two or three versions, not six.
    A neighbour that goes is withdrawn from the record at once, gap or not."""
    r = ring_name()
    hub = await start_node(node_config("hub", "10.9.0.1/24", listen=[f"ring://{r}"]))
    made = _versions(hub)
    leaves = []
    try:
        for i in range(6):
            cfg = node_config(f"l{i}", f"10.9.0.{i + 2}/24", peers=[f"ring://{r}"])
            leaves.append(await start_node(cfg))
            await asyncio.sleep(0.1)  # the pace of the scenario (not a wait for a condition)
        await async_wait_until(lambda: converged([hub, *leaves]), 10, "routes")
        assert 1 <= len(made) <= 3, [len(v.neighbours) for v in made]
        assert len(made[-1].neighbours) == 6
        count = len(made)
        gone = leaves.pop()
        await gone.stop()
        # within the liveness of a ring link closing: the next version drops it
        await async_wait_until(lambda: len(made) > count, 5, "the loss re-originated")
        assert gone.node_id not in dict(made[count].neighbours)
    finally:
        await stop_all([hub, *leaves])


async def test_the_build_interval_follows_the_cpu_a_build_took_not_the_wall_time() -> None:
    """A build the scheduler paused (a busy host: here a sleep inside it) took 0.3 s of
    wall time and almost no CPU: the next one may run after the minimum interval. Timed by
    the wall clock it was 3 s, and every record this node relays waited that long."""
    r = ring_name()
    a = await start_node(node_config("a", "10.9.0.1/24", listen=[f"ring://{r}"]))
    b = await start_node(node_config("b", "10.9.0.2/24", peers=[f"ring://{r}"]))
    try:
        await async_wait_until(lambda: converged([a, b]), 10, "routes")
        build = a.table.build

        def paused() -> bool:
            time.sleep(0.3)
            return build()

        a.table.build = paused  # type: ignore[method-assign]
        a.table.dirty = True
        a._build(a.loop.time())
        assert a._build_interval == MIN_BUILD_INTERVAL
    finally:
        await stop_all([a, b])
