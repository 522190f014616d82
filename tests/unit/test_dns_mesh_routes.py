"""dns/mesh_dns.MeshDnsRoutes without a mesh: which table a cache miss is routed by."""

from __future__ import annotations

import gc

from meshgate.dns import wire
from meshgate.dns.mesh_dns import MeshDnsClient, MeshDnsRoutes
from meshgate.dns.routes import RouteTable, UpstreamGroup
from meshgate.dns.upstream import Upstream


class _Up(Upstream):
    def __init__(self, url: str) -> None:
        self.url = url


def _configured(url: str) -> RouteTable:
    return RouteTable(UpstreamGroup("dns.upstreams", [_Up("udp://main")]),
                      {wire.encode_name("corp.example."): UpstreamGroup("corp.example.", [_Up(url)])})


def test_a_new_configured_table_is_followed_even_where_the_old_ones_id_comes_back() -> None:
    """A reload swaps the pipeline's configured table while the mesh's generation stays: the
    table asked must be the new one's. Freed objects' ids recur (the new table often gets the
    old one's address), so the cache is keyed on the table itself, not its id."""
    routes = MeshDnsRoutes(MeshDnsClient(lambda *a: True, 6, 8),
                           lambda: (1, {"lan.example.": [(0x0C, "c")]}), ())
    name = wire.encode_name("x.corp.example.")
    lan = wire.encode_name("x.lan.example.")
    for i in range(50):
        table = routes.table(_configured(f"udp://corp{i}"))
        gc.collect()  # the configured table just passed is garbage now: its id may come back
        assert table.group(name).upstreams[0].url == f"udp://corp{i}", i
        assert table.group(lan).upstreams[0].url == "mesh://c"
