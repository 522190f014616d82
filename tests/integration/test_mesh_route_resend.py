"""Route records a closed link may have taken with it (issue 18 item 5): links are reliable, so
the timed resend backs off for a neighbour slow to acknowledge; what makes a record really lost
is a link closing with it unsent while another link to the same neighbour stays up. Those
records go again at once over the link left, not a resend interval later."""

from __future__ import annotations

from typing import Any

from meshgate.mesh.routing import split_records
from tests.helpers import async_wait_until
from tests.mesh_testing import node_config, ring_name, start_node, stop_all


async def test_records_unacknowledged_when_one_of_two_links_closes_go_again_over_the_other() -> None:
    r1, r2 = ring_name(), ring_name()
    b = await start_node(node_config("b", "10.9.0.2/24", listen=[f"ring://{r1}", f"ring://{r2}"]))
    a = await start_node(node_config("a", "10.9.0.1/24", peers=[f"ring://{r1}", f"ring://{r2}"]))
    try:
        await async_wait_until(
            lambda: len(a.links.get(b.node_id, ())) == 2 and b.node_id in a.table.hop_paths
            and a.node_id in b.table.hop_paths, 10, "two links and routes",
        )
        # b now takes a's ROUTES without acknowledging them (as a busy loop that has not got to
        # them yet), and a's timed resend is far off: only the closed link can make a send again
        a.table.resend_after = 1000.0
        for sync in a.table._sync.values():
            sync.resend = 1000.0
        got: list[int] = []
        original = b._on_routes

        def unacknowledged(link: Any, body: memoryview) -> None:
            got.extend(v for o, _, v, _ in split_records(body) if o == a.node_id)

        b._on_routes = unacknowledged  # type: ignore[method-assign]
        version = a.table.local.version
        assert a.table.update_local(name="a-renamed")
        a._schedule_sync()
        await async_wait_until(lambda: version + 1 in got, 5, "the new version at b")
        assert got.count(version + 1) == 1
        link = a.links[b.node_id][0]
        assert link.transport is not None
        link.transport.close()
        await async_wait_until(lambda: got.count(version + 1) == 2, 5, "the version again")
        assert len(a.links[b.node_id]) == 1 and a.table.resent == 0  # no resend: the loss path
        b._on_routes = original  # type: ignore[method-assign]
    finally:
        await stop_all([a, b])
