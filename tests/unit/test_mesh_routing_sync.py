"""What the flood sends, without sockets: what a large mesh forming must not pay for
(issue 18 item 5). Every record sent is checked (a signature) by every node of the mesh,
so nothing is sent that adds nothing, and finding what to send costs nothing per call
for what is not due."""

from __future__ import annotations

from meshgate.mesh import routing
from meshgate.mesh.routing import FORGOTTEN, RESEND_MAX, Record, RouteTable


def rec(origin: int, version: int = 1, **kw: object) -> Record:
    return Record(origin=origin, session=100 + origin, version=version, name=f"n{origin}", **kw)  # type: ignore[arg-type]


def test_an_own_record_without_neighbours_is_not_flooded_until_it_lists_one() -> None:
    """A node starting has links before its record lists them (the first RTT is awaited):
    that first record adds no edge to any graph, so sending it would only cost every node
    one more check. The version that lists a neighbour goes; so do other origins' records."""
    t = RouteTable(rec(0))
    t.neighbour_up(1)
    assert t.records_to_send(1, 0.0) == []
    t.update_local(neighbours=((1, 100),))
    assert [(r.origin, r.version) for r in t.records_to_send(1, 0.1)] == [(0, 2)]
    t.receive_records(2, [rec(3)], 0.2)  # another origin's, even without neighbours
    assert [r.origin for r in t.records_to_send(1, 0.2)] == [3]


def test_unacknowledged_sends_are_resent_when_due_whatever_was_sent_between() -> None:
    """The resend scan stops at the first send not yet due, so each send moves its origin to
    the end of the order: a record sent again later must not hide one still due behind it."""
    t = RouteTable(rec(0, neighbours=((1, 100),)), resend_after=3.0)
    t.neighbour_up(1)
    t.receive_records(5, [rec(2), rec(3)], 0.0)
    assert {r.origin for r in t.records_to_send(1, 0.0)} == {0, 2, 3}
    t.receive_records(5, [rec(2, 2)], 1.0)  # a newer version of 2, sent at 1.0
    assert [(r.origin, r.version) for r in t.records_to_send(1, 1.0)] == [(2, 2)]
    assert {r.origin for r in t.records_to_send(1, 3.5)} == {0, 3}  # 2 was due at 4.0 ...
    # ... but the resend at 3.5 backed the interval off to 6 s: 2 is due at 7.0
    assert t.records_to_send(1, 4.0) == []
    assert [r.origin for r in t.records_to_send(1, 7.0)] == [2]
    t.receive_acks(1, [(0, 1), (2, 2), (3, 1)], 7.0)
    assert t.records_to_send(1, 30.0) == []


def test_a_neighbour_slow_to_acknowledge_is_sent_again_ever_later_until_it_catches_up() -> None:
    """Links are reliable: a late acknowledgement sits behind a busy peer (a mesh forming, 125
    nodes on one loop), and every resend is one more copy it must read. So each resend doubles
    that neighbour's interval (up to RESEND_MAX), until it has acknowledged everything sent;
    another neighbour's interval is its own."""
    t = RouteTable(rec(0, neighbours=((1, 100),)), resend_after=3.0)
    t.neighbour_up(1)
    t.neighbour_up(2)
    assert [r.origin for r in t.records_to_send(1, 0.0)] == [0]
    sends = [now for now in (x * 0.5 for x in range(0, 400)) if t.records_to_send(1, now)]
    assert sends[:5] == [3.0, 9.0, 21.0, 45.0, 93.0]  # 3, 6, 12, 24, 48 s after the one before
    assert sends[5] - sends[4] == RESEND_MAX == 48.0
    assert t.resent == len(sends)
    # the other neighbour starts at resend_after
    assert [r.origin for r in t.records_to_send(2, 190.0)] == [0]
    assert [r.origin for r in t.records_to_send(2, 193.0)] == [0]
    # an acknowledgement that leaves something unacknowledged keeps the interval
    t.receive_records(5, [rec(3)], 200.0)
    assert [r.origin for r in t.records_to_send(1, 200.0)] == [3]
    t.receive_acks(1, [(0, 1)], 200.0)
    assert t.records_to_send(1, 200.0 + 47.5) == []
    assert [r.origin for r in t.records_to_send(1, 248.0)] == [3]
    # once all is acknowledged it is back at resend_after, but never under twice the slowest
    # acknowledgement the link has seen: 11 s (sent at 189, acknowledged at 200)
    t.receive_acks(1, [(3, 1)], 250.0)
    t.update_local(neighbours=((1, 100), (2, 200)))
    assert [r.version for r in t.records_to_send(1, 300.0)] == [2]  # a new version: sent at once
    assert t.records_to_send(1, 321.5) == []
    assert [r.version for r in t.records_to_send(1, 322.0)] == [2]


def test_a_neighbour_once_slow_to_acknowledge_is_not_sent_again_sooner_than_twice_that() -> None:
    """A neighbour that took 5 s to acknowledge (its loop busy with a mesh forming) will take
    as long again while the flood lasts: a resend after 3 s would be one more copy queued behind
    the first, so its next resend waits 10 s. A neighbour that acknowledges at once keeps 3 s."""
    t = RouteTable(rec(0, neighbours=((1, 100),)), resend_after=3.0)
    t.neighbour_up(1)
    t.neighbour_up(2)
    assert [r.origin for r in t.records_to_send(1, 0.0)] == [0]
    assert [r.origin for r in t.records_to_send(2, 0.0)] == [0]
    t.receive_acks(1, [(0, 1)], 5.0)
    t.receive_acks(2, [(0, 1)], 0.1)
    t.update_local(neighbours=((1, 100), (2, 100)))
    assert [r.version for r in t.records_to_send(1, 10.0)] == [2]
    assert [r.version for r in t.records_to_send(2, 10.0)] == [2]
    assert t.records_to_send(2, 12.9) == [] and [r.version for r in t.records_to_send(2, 13.0)] == [2]
    assert t.records_to_send(1, 19.9) == [] and [r.version for r in t.records_to_send(1, 20.0)] == [2]
    assert t.resent == 2


def test_nothing_is_sent_again_while_acknowledgements_keep_coming_back() -> None:
    """A link is reliable and in order: a neighbour acknowledging earlier sends is reading its
    way through the rest (125 nodes on one loop read a mesh's records for minutes). Only once no
    acknowledgement cleared anything for the resend interval are the sends past it sent again."""
    t = RouteTable(rec(0, neighbours=((1, 100),)), resend_after=3.0)
    t.neighbour_up(1)
    t.receive_records(5, [rec(o) for o in range(2, 12)], 0.0)
    assert len(t.records_to_send(1, 0.0)) == 11
    for now, origin in ((2.0, 2), (4.5, 3), (7.0, 4)):
        assert t.records_to_send(1, now) == []  # all due since 3.0, but it is reading them
        t.receive_acks(1, [(origin, 1)], now)
    t.receive_acks(1, [(2, 1)], 9.0)  # an acknowledgement that clears nothing is no progress
    assert t.records_to_send(1, 9.9) == [] and t.resent == 0
    # and the interval is now twice the slowest of those acknowledgements (7 s, at 7.0)
    assert t.records_to_send(1, 20.9) == [] and t.resent == 0
    assert {r.origin for r in t.records_to_send(1, 21.0)} == {0} | set(range(5, 12))
    assert t.resent == 8


def test_what_a_closed_link_held_goes_again_at_once_over_the_link_left() -> None:
    """Two links to one neighbour, one closes: records it carried and the neighbour has not
    acknowledged may have gone with it (which link carried which is not known), so all of them
    are sent again at the next sync, not after a resend interval. Acknowledged ones are not."""
    t = RouteTable(rec(0, neighbours=((1, 100),)), resend_after=3.0)
    t.neighbour_up(1)
    t.receive_records(5, [rec(2), rec(3)], 0.0)
    assert {r.origin for r in t.records_to_send(1, 0.0)} == {0, 2, 3}
    t.receive_acks(1, [(2, 1)], 0.1)
    assert t.records_to_send(1, 0.5) == []
    t.link_lost(1)
    assert {r.origin for r in t.records_to_send(1, 0.5)} == {0, 3}
    assert t.resent == 0  # not a resend of late acknowledgements: no backoff
    assert t.records_to_send(1, 3.4) == [] and {r.origin for r in t.records_to_send(1, 3.5)} == {0, 3}


def test_settle_checks_a_slice_at_a_time_and_a_forged_newer_version_hides_nothing() -> None:
    """A full table arriving is checked in slices (the mesh checks one per loop iteration,
    with its I/O between): `limit` origins in the order they arrived, the rest still held.
    Within a slice a forged newer version (it fails the check) still cannot hide the genuine
    older one held beside it, and a version superseded while held is never checked."""
    checked: list[tuple[int, int]] = []

    def accept(new: Record, held: Record | None) -> str | None:
        checked.append((new.origin, new.version))
        return "bad_signature" if new.signature == b"forged" else None

    t = RouteTable(rec(0, neighbours=((1, 100),)), accept=accept)
    t.neighbour_up(1)
    t.receive_records(1, [rec(o) for o in range(1, 11)], 0.0)
    t.receive_records(1, [rec(1, 5, signature=b"forged"), rec(4, 2)], 0.0)
    assert t.settle(3) == 3 and t.unchecked == 7
    assert sorted(o for o in t.records if o) == [1, 2, 3]
    assert t.records[1].version == 1  # the genuine one, beside the forged newer one
    assert checked == [(1, 5), (1, 1), (2, 1), (3, 1)]
    assert t.settle() == 7 and t.unchecked == 0
    assert (4, 1) not in checked and t.records[4].version == 2  # superseded while held


def _expired_while_unreachable() -> tuple[RouteTable, RouteTable, Record]:
    """n (0) - m (1) - y (6) - x (5): m sends n x's record, and y's (which holds x's only edge)
    only after n's expiry, as a slow formation can. n expires x, unreachable there all along."""
    n = RouteTable(rec(0, neighbours=((1, 100),)), expiry=60.0)
    m = RouteTable(rec(1, neighbours=((0, 100), (6, 100))), expiry=60.0)
    n.neighbour_up(1)
    m.neighbour_up(0)
    y = rec(6, neighbours=((1, 100), (5, 100)))
    m.receive_records(6, [y, rec(5, neighbours=((6, 100),))], 0.0)
    m.build()
    assert 5 in m.hop_paths
    sent = [r for r in m.records_to_send(0, 0.0) if r.origin != 6]
    m.receive_acks(0, n.receive_records(1, sent, 0.0), 0.0)
    n.build()
    n.mark_unreachable(0.0)
    assert 5 in n.records and 5 not in n.hop_paths
    expired = routing._expired.value
    assert n.expire(61.0) == [5] and 5 not in n.records
    assert routing._expired.value == expired + 1  # meshgate_mesh_route_records_expired_total
    return n, m, y


def test_a_record_expired_where_its_origin_looked_unreachable_comes_back_from_the_neighbour() -> None:
    """The neighbour counted x as acknowledged by n, so it would never send it again: n's
    (x, FORGOTTEN) acknowledgement (what MeshService sends on an expiry) takes that back, and
    since x is reachable at m, m sends it again. Once y's record comes, n routes to x."""
    n, m, y = _expired_while_unreachable()
    again = routing._forgotten.labels("sent_again").value
    assert m.receive_acks(0, [(5, FORGOTTEN)], 61.0) == 1
    assert routing._forgotten.labels("sent_again").value == again + 1
    m.receive_acks(0, n.receive_records(1, [y], 61.0), 61.0)
    again = m.records_to_send(0, 61.0)
    assert [r.origin for r in again] == [5]
    m.receive_acks(0, n.receive_records(1, again, 61.0), 61.0)
    n.build()
    assert n.hop_paths[5].next_hop == 1 and n.hop_paths[5].hops == 3
    assert m.records_to_send(0, 200.0) == []  # acknowledged again: nothing more


def test_a_record_forgotten_by_both_sides_is_not_sent_back_and_forth() -> None:
    """An origin that is gone (unreachable at the neighbour too) is not sent again on a
    FORGOTTEN acknowledgement: the neighbour expires it itself, and the two do not bounce it."""
    _, m, _ = _expired_while_unreachable()
    m.update_local(neighbours=((0, 100),))  # m's link to y is gone: x unreachable at m as well
    m.build()
    assert 5 not in m.hop_paths
    gone = routing._forgotten.labels("gone_here").value
    assert m.receive_acks(0, [(5, FORGOTTEN)], 61.0) == 0
    assert routing._forgotten.labels("gone_here").value == gone + 1
    assert all(r.origin != 5 for r in m.records_to_send(0, 200.0))
