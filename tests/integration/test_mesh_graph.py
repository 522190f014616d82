"""50 services on ring links in a random connected graph: they converge, and every next hop
agrees with shortest paths computed here, independently, on the same graph."""

from __future__ import annotations

import heapq
import random
from collections import deque

from meshgate.mesh.routing import UNKNOWN_LATENCY_US
from meshgate.mesh.service import MeshService
from tests.helpers import async_wait_until
from tests.mesh_testing import node_config, ring_name, start_node, stop_all

N = 50


def _bfs(adj: dict[int, set[int]], src: int) -> dict[int, int]:
    dist = {src: 0}
    q = deque([src])
    while q:
        u = q.popleft()
        for v in adj[u]:
            if v not in dist:
                dist[v] = dist[u] + 1
                q.append(v)
    return dist


def _dijkstra(w: dict[int, dict[int, int]], src: int) -> dict[int, int]:
    dist: dict[int, int] = {}
    heap = [(0, src)]
    while heap:
        d, u = heapq.heappop(heap)
        if u in dist:
            continue
        dist[u] = d
        for v, c in w[u].items():
            if v not in dist:
                heapq.heappush(heap, (d + c, v))
    return dist


async def test_random_50_node_mesh_matches_bfs_and_dijkstra() -> None:
    rng = random.Random(50)
    edges: set[tuple[int, int]] = set()
    for i in range(1, N):
        edges.add((rng.randrange(i), i))
    while len(edges) < N + 25:
        x, y = sorted(rng.sample(range(N), 2))
        edges.add((x, y))
    names = [ring_name("g") for _ in range(N)]
    nodes: list[MeshService] = []
    try:
        for i in range(N):
            peers = [f"ring://{names[x]}" for x, y in edges if y == i]
            nodes.append(await start_node(node_config(f"g{i}", listen=[f"ring://{names[i]}"], peers=peers)))
        ids = {n.node_id for n in nodes}
        await async_wait_until(lambda: all(set(n.table.hop_paths) == ids for n in nodes), 30, "convergence")

        def in_sync() -> bool:  # every node holds every origin's latest record
            latest = {n.node_id: n.table.local.version for n in nodes}
            return all(n.table.records[o].version == v for n in nodes for o, v in latest.items())

        await async_wait_until(in_sync, 30, "records in sync")
        for n in nodes:
            n.table.build()  # a build may be held back by the throttle; the check is on the same records
        nid = [n.node_id for n in nodes]  # graph vertex i is nodes[i], whatever its id
        adj: dict[int, set[int]] = {v: set() for v in nid}
        for x, y in edges:
            adj[nid[x]].add(nid[y])
            adj[nid[y]].add(nid[x])
        for n in nodes:
            me = n.node_id
            assert {nid for nid, _ in n.table.local.neighbours} == adj[me]
            dist = {v: _bfs(adj, v) for v in adj}
            for dst, p in n.table.hop_paths.items():
                assert p.hops == dist[me][dst]
                if dst != me:  # the next hop is a neighbour one step closer
                    assert p.next_hop in adj[me] and dist[p.next_hop][dst] == p.hops - 1
            # least latency on the graph as this node sees it (latencies from the records)
            w = {
                o: {v: (lat or UNKNOWN_LATENCY_US) for v, lat in rec.neighbours}
                for o, rec in n.table.records.items()
            }
            expect = _dijkstra(w, me)
            for dst, p in n.table.lat_paths.items():
                assert p.latency_us == expect[dst]
                if dst != me:
                    assert p.next_hop in adj[me]
    finally:
        await stop_all(nodes)
