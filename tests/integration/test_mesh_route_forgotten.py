"""A record a node expired comes back from a neighbour that can still reach its origin (issue 18
item 5). A node expires the record of an origin unreachable in its own graph for
`expiry` seconds, which a slow formation can make it think; its neighbour had it acknowledged
and would never send it again, so the node would have no route to that origin until the origin
made a new version. The expiry now tells each neighbour (origin, FORGOTTEN) on a ROUTE_ACK, and a
neighbour that reaches the origin sends the record again."""

from __future__ import annotations

from tests.helpers import async_wait_until
from tests.mesh_testing import ring_line, stop_all


async def test_an_expired_record_of_a_reachable_origin_comes_back_over_the_link() -> None:
    nodes = await ring_line()
    a, b, c = nodes
    try:
        assert c.node_id in a.table.records and c.node_id in b.table.hop_paths
        version = a.table.records[c.node_id].version
        sent_by_b = b.table.resent
        told: list[int] = []  # what a's expiry told its neighbours it forgot (the real method runs)
        tell = a._tell_forgotten

        def spy(gone: list[int]) -> None:
            told.extend(gone)
            tell(gone)

        a._tell_forgotten = spy  # type: ignore[method-assign]
        # a's expiry clock for c ran out (as if c had looked unreachable to a for a minute):
        # a's next tick drops the record, as RouteTable.expire does for an origin that is gone
        a.table._unreachable_since[c.node_id] = a.loop.time() - 2 * a.table.expiry
        # (a build in between would clear the clock instead: then this waits in vain, never passes)
        await async_wait_until(lambda: c.node_id in told, 5, "a's expiry of c")
        # b still reaches c: it sends the same version again, and a routes to c through b
        await async_wait_until(lambda: c.node_id in a.table.records, 5, "c's record back at a")
        assert a.table.records[c.node_id].version == version  # not a new version from c
        await async_wait_until(lambda: c.node_id in a.table.hop_paths, 5, "a route to c again")
        assert a.table.hop_paths[c.node_id].next_hop == b.node_id
        assert b.table.resent == sent_by_b  # sent as a new send, not a timed resend
    finally:
        await stop_all(nodes)
