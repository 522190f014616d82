"""Link-state routing without sockets: record codec, sync, graph build, lookup."""

from __future__ import annotations

import contextlib
import ipaddress
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshgate.mesh import routing
from meshgate.mesh.routing import (
    Record,
    RecordError,
    RouteTable,
    decode_acks,
    decode_records,
    encode_acks,
    encode_records,
)
from meshgate.metrics import REGISTRY

ip = ipaddress.ip_address
net = ipaddress.ip_network


def rec(origin: int, version: int = 1, **kw: object) -> Record:
    return Record(origin=origin, session=100 + origin, version=version, name=f"n{origin}", **kw)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- codec

records_st = st.builds(
    Record,
    origin=st.integers(0, 2**32 - 1),
    session=st.integers(0, 2**32 - 1),
    version=st.integers(0, 2**64 - 1),
    name=st.text(max_size=40).filter(lambda s: len(s.encode()) <= 255),
    ipv4=st.none()
    | st.builds(lambda a, p: ipaddress.IPv4Interface((a, p)), st.integers(0, 2**32 - 1), st.integers(0, 32)),
    ipv6=st.none()
    | st.builds(
        lambda a, p: ipaddress.IPv6Interface((a, p)), st.integers(0, 2**128 - 1), st.integers(0, 128)
    ),
    cidrs=st.lists(
        st.tuples(
            st.builds(
                lambda a, p: ipaddress.IPv4Network((a, p), strict=False),
                st.integers(0, 2**32 - 1),
                st.integers(0, 32),
            ),
            st.booleans(),
        ),
        max_size=4,
    ).map(tuple),
    exit=st.booleans(),
    neighbours=st.lists(st.tuples(st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1)), max_size=6).map(
        lambda x: tuple(sorted(x))
    ),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(records_st, max_size=5))
def test_records_round_trip(records: list[Record]) -> None:
    out: list[Record] = []
    for body in encode_records(records, 1 << 16):
        out.extend(decode_records(body))
    assert out == records


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400))
def test_fuzz_decode_records_only_raises_record_error(data: bytes) -> None:
    with contextlib.suppress(RecordError):
        decode_records(data)
    with contextlib.suppress(RecordError):
        decode_acks(data)


def test_acks_round_trip() -> None:
    acks = [(1, 2), (2**32 - 1, 2**64 - 1)]
    assert decode_acks(encode_acks(acks)) == acks


def test_encode_records_splits_by_size() -> None:
    records = [rec(i, neighbours=tuple((j, 1) for j in range(50))) for i in range(20)]
    bodies = encode_records(records, 2000)
    assert len(bodies) > 1 and all(len(b) <= 2000 for b in bodies)
    assert [r for b in bodies for r in decode_records(b)] == records


# ----------------------------------------------------------------------------- sync simulation


class Sim:
    """Nodes with RouteTables exchanging records over a graph, no sockets."""

    def __init__(self, edges: dict[tuple[int, int], int], n: int) -> None:
        self.tables = {i: RouteTable(rec(i)) for i in range(n)}
        self.edges = edges
        for a, b in edges:
            self.tables[a].neighbour_up(b)
            self.tables[b].neighbour_up(a)
        for i, t in self.tables.items():
            t.update_local(
                neighbours=tuple(
                    sorted((b if a == i else a, lat) for (a, b), lat in edges.items() if i in (a, b))
                )
            )

    def run(self, now: float = 0.0) -> int:
        rounds = 0
        while True:
            moved = 0
            for i, t in self.tables.items():
                for a, b in self.edges:
                    if i not in (a, b):
                        continue
                    other = b if a == i else a
                    recs = t.records_to_send(other, now)
                    if recs:
                        moved += len(recs)
                        acks = self.tables[other].receive_records(i, recs, now)
                        t.receive_acks(other, acks, now)
            rounds += 1
            if not moved:
                break
            assert rounds < 500
        for t in self.tables.values():
            t.build()
        return rounds


def _expected(
    edges: dict[tuple[int, int], int], n: int, src: int, hop_first: bool
) -> dict[int, tuple[int, int]]:
    """Independent: Bellman-Ford on (primary, secondary) costs, then the lowest next hop
    among neighbours that lie on an optimal path. Returns dest -> (next hop, hops)."""
    adj: dict[int, list[tuple[int, int]]] = {i: [] for i in range(n)}
    for (a, b), lat in edges.items():
        adj[a].append((b, lat))
        adj[b].append((a, lat))

    def dist_from(s: int) -> dict[int, tuple[int, int]]:
        d = {s: (0, 0)}
        changed = True
        while changed:
            changed = False
            for u in list(d):
                for v, w in adj[u]:
                    h, lat = d[u][0] + 1, d[u][1] + w
                    c = (h, lat) if hop_first else (lat, h)
                    if v not in d or c < (d[v] if hop_first else (d[v][1], d[v][0])):
                        d[v] = (h, lat)
                        changed = True
        return d

    def key(x: tuple[int, int]) -> tuple[int, int]:
        return x if hop_first else (x[1], x[0])

    ds = dist_from(src)
    all_d = {v: dist_from(v) for v, _ in adj[src]}
    out = {}
    for dest in ds:
        if dest == src:
            continue
        best = key(ds[dest])
        hops = [
            v
            for v, w in adj[src]
            if dest in all_d[v] and key((all_d[v][dest][0] + 1, all_d[v][dest][1] + w)) == best
        ]
        out[dest] = (min(hops), ds[dest][0])
    return out


def _random_graph(rng: random.Random, n: int, extra: int, latencies: int = 50) -> dict[tuple[int, int], int]:
    edges: dict[tuple[int, int], int] = {}
    for i in range(1, n):  # a random spanning tree keeps it connected
        j = rng.randrange(i)
        edges[(j, i)] = rng.randint(1, latencies) * 1000
    for _ in range(extra):
        a, b = rng.sample(range(n), 2)
        edges.setdefault((min(a, b), max(a, b)), rng.randint(1, latencies) * 1000)
    return edges


@pytest.mark.parametrize(("seed", "latencies"), [(1, 50), (2, 50), (3, 50), (4, 2), (5, 1)])
def test_50_node_random_graph_matches_independent_shortest_paths(seed: int, latencies: int) -> None:
    """Both builds (the hop layers, the latency heap) against Bellman-Ford; with one or two
    latency values most paths tie and the lowest next hop decides."""
    rng = random.Random(seed)
    n = 50
    edges = _random_graph(rng, n, 40, latencies)
    sim = Sim(edges, n)
    sim.run()
    for src, t in sim.tables.items():
        assert len(t.hop_paths) == n
        for hop_first, paths in ((True, t.hop_paths), (False, t.lat_paths)):
            exp = _expected(edges, n, src, hop_first)
            got = {d: (p.next_hop, p.hops) for d, p in paths.items() if d != src}
            assert got == exp, (seed, src, hop_first)


def test_triangle_policies_disagree() -> None:
    # 0-1 direct but slow (80 ms); 0-2-1 fast (2 x 5 ms)
    sim = Sim({(0, 1): 80_000, (0, 2): 5_000, (1, 2): 5_000}, 3)
    sim.run()
    t = sim.tables[0]
    assert t.hop_paths[1].next_hop == 1 and t.hop_paths[1].hops == 1
    assert t.lat_paths[1].next_hop == 2 and t.lat_paths[1].hops == 2 and t.lat_paths[1].latency_us == 10_000


def test_latency_paths_are_walked_only_when_asked_for_and_are_the_builds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A build walks the least-hop paths only; the least-latency walk waits for the first
    caller after it (while a mesh forms, nobody asks between most builds), once per build,
    over the graph of that build even if records changed since."""
    walks: list[int] = []
    walk = routing._least_latency

    def counted(adj: dict[int, list[tuple[int, int]]], src: int) -> dict[int, routing.PathInfo]:
        walks.append(src)
        return walk(adj, src)

    monkeypatch.setattr(routing, "_least_latency", counted)
    sim = Sim({(0, 1): 80_000, (0, 2): 5_000, (1, 2): 5_000}, 3)
    sim.run()
    t = sim.tables[0]
    t.dirty = True
    assert t.build() and walks == []
    t.receive_records(1, [rec(1, 9, neighbours=((0, 80_000),))], 0)  # 1-2 gone, not built yet
    assert t.lat_paths[1].next_hop == 2 and t.lat_paths[1].latency_us == 10_000  # the build's graph
    assert t.lat_paths[2].hops == 1 and walks == [0]  # walked once
    assert t.build() and t.lat_paths[1].next_hop == 1 and walks == [0, 0]


def test_anti_entropy_sends_only_unacked_and_resyncs_on_link_up() -> None:
    sim = Sim({(0, 1): 1000, (1, 2): 1000}, 3)
    sim.run()
    t1 = sim.tables[1]
    assert t1.records_to_send(0, 100.0) == [] and t1.records_to_send(2, 100.0) == []
    sim.tables[2].update_local(exit=True)
    sim.run(100.0)
    assert sim.tables[0].records[2].exit
    t1.neighbour_up(0)  # the link to 0 came back (maybe 0 restarted): send everything again
    assert {r.origin for r in t1.records_to_send(0, 101.0)} == {1, 2}


def test_unchanged_record_does_not_rebuild() -> None:
    t = RouteTable(rec(0, neighbours=((1, 1000),)))
    t.neighbour_up(1)
    t.receive_records(1, [rec(1, 1, neighbours=((0, 1000),))], 0)
    assert t.build()
    builds = REGISTRY.value("meshgate_mesh_route_builds_total")
    t.receive_records(1, [rec(1, 2, neighbours=((0, 1000),))], 1)
    assert t.records[1].version == 2
    assert not t.build()
    assert REGISTRY.value("meshgate_mesh_route_builds_total") == builds
    t.receive_records(1, [rec(1, 1, neighbours=((0, 1000),), exit=True)], 2)  # stale: ignored
    assert not t.build() and not t.records[1].exit


def test_expiry_of_unreachable_records() -> None:
    t = RouteTable(rec(0, neighbours=((1, 1000),)), expiry=30)
    t.neighbour_up(1)
    t.receive_records(1, [rec(1, neighbours=((0, 1000), (2, 1000))), rec(2, neighbours=((1, 1000),))], 0)
    t.build()
    assert set(t.hop_paths) == {0, 1, 2}
    t.receive_records(1, [rec(1, 2, neighbours=((0, 1000),))], 1)  # 1 lost its link to 2
    t.build()
    t.mark_unreachable(1)
    assert set(t.hop_paths) == {0, 1} and 2 in t.records
    assert t.expire(20) == []
    assert t.expire(31) == [2] and 2 not in t.records


def test_table_is_bounded() -> None:
    before = REGISTRY.value("meshgate_mesh_route_records_dropped_total", "table_full")
    t = RouteTable(rec(0), max_records=3)
    t.receive_records(1, [rec(i) for i in range(1, 6)], 0)
    assert len(t.records) == 3
    assert REGISTRY.value("meshgate_mesh_route_records_dropped_total", "table_full") - before == 3


def test_duplicate_node_id_ignored_and_counted() -> None:
    before = REGISTRY.value("meshgate_mesh_duplicate_total", "node_id")
    t = RouteTable(rec(0))
    impostor = Record(origin=0, session=999, version=10**15, name="impostor")
    t.receive_records(1, [impostor], 0)
    assert t.records[0].name == "n0"
    assert REGISTRY.value("meshgate_mesh_duplicate_total", "node_id") == before + 1


def _lookup_table() -> RouteTable:
    own = rec(
        0,
        ipv4=ipaddress.IPv4Interface("10.0.0.1/24"),
        cidrs=((net("192.168.0.0/16"), False),),
        neighbours=((1, 1000), (2, 1000)),
    )
    t = RouteTable(own, exit_nodes=("10.0.0.3", "auto"))
    t.neighbour_up(1)
    t.neighbour_up(2)
    t.receive_records(
        1,
        [
            rec(
                1,
                ipv4=ipaddress.IPv4Interface("10.0.0.2/24"),
                ipv6=ipaddress.IPv6Interface("fd00::2/64"),
                cidrs=(
                    (net("192.168.0.0/16"), False),
                    (net("172.16.0.0/12"), False),
                    (net("192.168.5.0/24"), False),
                    (net("fd10::/48"), True),
                ),
                exit=True,
                neighbours=((0, 1000), (3, 1000)),
            ),
            rec(
                2,
                ipv4=ipaddress.IPv4Interface("10.0.0.3/24"),
                cidrs=((net("172.16.1.0/24"), False),),
                neighbours=((0, 1000),),
            ),
            rec(3, ipv4=ipaddress.IPv4Interface("10.0.0.4/24"), exit=True, neighbours=((1, 1000),)),
        ],
        0,
    )
    t.build()
    return t


def test_lookup_order() -> None:
    t = _lookup_table()
    r = t.lookup(ip("10.0.0.1"))
    assert r is not None and (r.kind, r.node_id, r.hops) == ("self", 0, 0)
    r = t.lookup(ip("10.0.0.4"))
    assert r is not None and (r.kind, r.node_id, r.next_hop, r.hops) == ("peer", 3, 1, 2)
    r = t.lookup(ip("fd00::2"))
    assert r is not None and (r.kind, r.node_id) == ("peer", 1)
    # longest prefix: 172.16.1.0/24 (node 2) beats 172.16.0.0/12 (node 1)
    r = t.lookup(ip("172.16.1.9"))
    assert r is not None and (r.kind, r.node_id) == ("cidr", 2)
    r = t.lookup(ip("172.17.0.1"))
    assert r is not None and (r.kind, r.node_id) == ("cidr", 1)
    # own 192.168.0.0/16 wins the tie; node 1's /24 inside it is ignored
    r = t.lookup(ip("192.168.5.5"))
    assert r is not None and (r.kind, r.node_id) == ("cidr", 0)
    r = t.lookup(ip("fd10::1"))
    assert r is not None and (r.kind, r.node_id) == ("cidr", 1)
    # exit: 10.0.0.3 (node 2) does not offer exit, so "auto" -> nearest exit: node 1 (1 hop) over node 3
    r = t.lookup(ip("8.8.8.8"))
    assert r is not None and (r.kind, r.node_id) == ("exit", 1)
    # unassigned address inside the own virtual subnet: nobody serves it
    assert t.lookup(ip("10.0.0.99")) is None


def test_no_exit_configured_means_no_route() -> None:
    t = RouteTable(rec(0))
    assert t.lookup(ip("1.1.1.1")) is None


def test_duplicate_virtual_ip_lowest_id_wins() -> None:
    before = REGISTRY.value("meshgate_mesh_duplicate_total", "virtual_ip")
    t = RouteTable(rec(5, neighbours=((7, 1000), (6, 1000))))
    t.neighbour_up(7)
    same = ipaddress.IPv4Interface("10.1.1.1/24")
    t.receive_records(
        7, [rec(7, ipv4=same, neighbours=((5, 1000),)), rec(6, ipv4=same, neighbours=((5, 1000),))], 0
    )
    t.build()
    r = t.lookup(ip("10.1.1.1"))
    assert r is not None and r.node_id == 6
    assert REGISTRY.value("meshgate_mesh_duplicate_total", "virtual_ip") > before


def test_one_way_edge_is_not_used() -> None:
    t = RouteTable(rec(0, neighbours=((1, 1000),)))
    t.receive_records(1, [rec(1, neighbours=())], 0)
    t.build()
    assert 1 not in t.hop_paths


def test_the_reads_process_flag_round_trips_and_is_signed() -> None:
    rec = Record(origin=7, session=9, version=3, name="n", reads_process=True)
    (back,) = decode_records(encode_records([rec], 1 << 16)[0])
    assert back.reads_process
    plain = Record(origin=7, session=9, version=3, name="n")  # what nodes from before it send
    (back,) = decode_records(encode_records([plain], 1 << 16)[0])
    assert not back.reads_process
    assert rec.signed_part != plain.signed_part  # a relay cannot set or clear it unnoticed


def test_decoding_makes_one_interface_object_per_address_and_bad_prefixes_still_fail() -> None:
    """Every version and copy of an origin carries the same virtual IPs: decoding makes each
    interface once (~20 µs each, a fifth of a record's signature check). A prefix out of range
    is still a RecordError, every time (an exception is not remembered)."""
    a = rec(7, 1, ipv4=ipaddress.IPv4Interface("10.7.0.7/16"), ipv6=ipaddress.IPv6Interface("fd00::7/64"))
    b = rec(7, 2, ipv4=ipaddress.IPv4Interface("10.7.0.7/16"), ipv6=ipaddress.IPv6Interface("fd00::7/64"))
    da, db = (decode_records(encode_records([r], 1 << 16)[0])[0] for r in (a, b))
    assert da == a and db == b
    assert da.ipv4 is db.ipv4 and da.ipv6 is db.ipv6
    bad = bytearray(rec(8, ipv4=ipaddress.IPv4Interface("10.8.0.8/16")).encode())
    bad[routing._HEAD.size + len("n8") + 4] = 33  # the IPv4 prefix length
    for _ in range(2):
        with pytest.raises(RecordError):
            routing.decode_one(bytes(bad))
