"""GET /console/stats: what the console shows beyond /status, /peers and /routes, built from
what the services already count (the metrics registry) and the mesh's link-state table.
Totals only (counters since start, gauges now): the page turns successive samples into rates.

- `mesh`: the graph as this node knows it: every reachable node (name, addresses, exit, proxy
  CIDRs; `relay`: another node's route from here goes through it) and every link the nodes'
  records name, `direct` where one end is this node over a live link of its own.
- `dns`: questions received, answers by rcode, cache hits/misses, blocked, and per upstream the
  queries sent and failures by reason (null without a DNS pipeline).
- `portal`: SOCKS5 and HTTP proxy clients open now, accepted, requests by reply code, bytes.
- `admin.token`: whether a token is configured (the page offers Reload only then).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from meshgate.metrics import REGISTRY, CounterFamily

if TYPE_CHECKING:
    from meshgate.mesh.service import MeshService


def _counters() -> dict[str, CounterFamily]:
    return {f.name: f for f in REGISTRY.counter_families()}


def _total(fams: dict[str, CounterFamily], name: str) -> int:
    fam = fams.get(name)
    return sum(c.value for _, c in fam.children()) if fam is not None else 0


def _by_label(fams: dict[str, CounterFamily], name: str, index: int) -> dict[str, int]:
    """A counter family summed over every label but the `index`th."""
    out: dict[str, int] = {}
    fam = fams.get(name)
    if fam is not None:
        for values, c in fam.children():
            if c.value:
                out[values[index]] = out.get(values[index], 0) + c.value
    return dict(sorted(out.items()))


def _dns(fams: dict[str, CounterFamily], upstreams: list[str]) -> dict[str, Any]:
    errors: dict[str, dict[str, int]] = {}
    fam = fams.get("meshgate_dns_upstream_errors_total")
    if fam is not None:
        for (url, reason), c in fam.children():
            if c.value:
                errors.setdefault(url, {})[reason] = c.value
    sent = _by_label(fams, "meshgate_dns_upstream_queries_total", 0)
    answered = _by_label(fams, "meshgate_dns_upstream_answers_total", 0)
    upstreams = list(dict.fromkeys([*upstreams, *sent, *errors]))  # [[dns.route]]'s upstreams too
    return {
        "queries": _total(fams, "meshgate_dns_queries_total"),
        "responses": _by_label(fams, "meshgate_dns_responses_total", 1),
        "cache_hits": _total(fams, "meshgate_dns_cache_hits_total"),
        "cache_misses": _total(fams, "meshgate_dns_cache_misses_total"),
        "blocked": _total(fams, "meshgate_dns_blocked_total"),
        "upstreams": [
            {"url": url, "queries": sent.get(url, 0), "answers": answered.get(url, 0),
             "errors": sum(errors.get(url, {}).values()),
             "errors_by_reason": errors.get(url, {})}
            for url in upstreams
        ],
    }


def _portal(fams: dict[str, CounterFamily], prefix: str, reply_label: int) -> dict[str, Any]:
    return {
        "clients": REGISTRY.value(f"meshgate_{prefix}_clients"),
        "accepted": _total(fams, f"meshgate_{prefix}_clients_total"),
        "replies": _by_label(fams, f"meshgate_{prefix}_requests_total", reply_label),
        "bytes_in": REGISTRY.value(f"meshgate_{prefix}_bytes_total", "in"),
        "bytes_out": REGISTRY.value(f"meshgate_{prefix}_bytes_total", "out"),
    }


def mesh_graph(mesh: MeshService) -> dict[str, Any]:
    t = mesh.table
    me = mesh.node_id
    reachable = t.reachable()
    relays = {p.next_hop for paths in (t.hop_paths, t.lat_paths) for p in paths.values() if p.hops > 1}
    nodes = []
    edges: dict[tuple[int, int], dict[str, Any]] = {}
    own = {nid: links for nid, links in mesh.links.items() if links}
    for origin in reachable:
        rec = t.records[origin]
        nodes.append({
            "id": f"{origin:08x}",
            "name": rec.name,
            "ipv4": str(rec.ipv4.ip) if rec.ipv4 else None,
            "ipv6": str(rec.ipv6.ip) if rec.ipv6 else None,
            "exit": rec.exit,
            "proxy_cidrs": [str(n) for n, _ in rec.cidrs],
            "self": origin == me,
            "relay": origin in relays and origin != me,
            "hops": t.hop_paths[origin].hops,
        })
        for nid, lat in rec.neighbours:
            if nid not in t.hop_paths:
                continue
            key = (min(origin, nid), max(origin, nid))
            edge = edges.setdefault(key, {"a": f"{key[0]:08x}", "b": f"{key[1]:08x}", "latency_ms": None,
                                          "direct": False, "kinds": []})
            if edge["latency_ms"] is None:
                edge["latency_ms"] = round(lat / 1000, 3)
    for nid, links in own.items():
        if nid not in t.hop_paths:
            continue
        key = (min(me, nid), max(me, nid))
        edge = edges.setdefault(key, {"a": f"{key[0]:08x}", "b": f"{key[1]:08x}", "latency_ms": None,
                                      "direct": False, "kinds": []})
        edge["direct"] = True
        edge["kinds"] = sorted({link.url.split(":", 1)[0] for link in links})
        edge["latency_ms"] = round(min(link.latency_us for link in links) / 1000, 3)
    return {"self": f"{me:08x}", "policy": mesh.config.mesh.policy, "nodes": nodes,
            "links": [edges[k] for k in sorted(edges)]}


def console_stats(
    mesh: MeshService | None, dns_upstreams: list[str] | None, token_configured: bool
) -> dict[str, Any]:
    fams = _counters()
    return {
        "admin": {"token": token_configured},
        "mesh": mesh_graph(mesh) if mesh is not None else None,
        "dns": _dns(fams, dns_upstreams) if dns_upstreams is not None else None,
        "portal": {"socks5": _portal(fams, "socks5", 1), "http_proxy": _portal(fams, "http_proxy", 1)},
    }
