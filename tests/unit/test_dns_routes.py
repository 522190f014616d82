"""`[[dns.route]]`: the config reader (every problem named by its key) and the suffix table."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from meshgate.config import ConfigError, DnsRouteConfig, from_dict, load
from meshgate.dns import wire
from meshgate.dns.resolver import Pipeline, upstream_spans
from meshgate.dns.routes import RouteTable, UpstreamGroup
from meshgate.dns.upstream import TcpUpstream, Upstream


def problems(routes: Any, **dns: Any) -> dict[str, str]:
    with pytest.raises(ConfigError) as ei:
        from_dict({"dns": {"route": routes, **dns}})
    return {p.key: p.message for p in ei.value.problems}


def test_routes_parse_with_the_suffix_normalised(tmp_path: Path) -> None:
    path = tmp_path / "m.toml"
    path.write_text('[dns]\nupstreams = ["udp://9.9.9.9"]\n\n'
                    '[[dns.route]]\nsuffix = "Corp.Example"\nupstreams = ["udp://10.1.2.53", "tcp://10.1.2.54:5353"]\n\n'
                    '[[dns.route]]\nsuffix = "eng.corp.example."\nupstreams = ["tls://10.1.2.55#dns.corp.example"]\n')
    cfg = load(path)
    assert cfg.dns.routes == (
        DnsRouteConfig("corp.example.", ("udp://10.1.2.53", "tcp://10.1.2.54:5353")),
        DnsRouteConfig("eng.corp.example.", ("tls://10.1.2.55#dns.corp.example",)),
    )
    assert cfg.dns.upstreams == ("udp://9.9.9.9",)
    assert from_dict({}).dns.routes == ()


def test_upstream_urls_are_checked_like_dns_upstreams_and_named_by_index() -> None:
    got = problems([{"suffix": "a.example", "upstreams": ["udp://10.0.0.1"]},
                    {"suffix": "b.example", "upstreams": ["udp://10.0.0.1", "ftp://10.0.0.2", "10.0.0.3"]}],
                   upstreams=["gopher://x"])
    assert set(got) == {"dns.upstreams[0]", "dns.route[1].upstreams[1]", "dns.route[1].upstreams[2]"}
    assert got["dns.route[1].upstreams[1]"] == got["dns.upstreams[0]"].replace("gopher://x", "ftp://10.0.0.2")


def test_a_duplicate_suffix_names_both_routes() -> None:
    got = problems([{"suffix": "corp.example.", "upstreams": ["udp://10.0.0.1"]},
                    {"suffix": "x.example", "upstreams": ["udp://10.0.0.1"]},
                    {"suffix": "CORP.example", "upstreams": ["udp://10.0.0.2"]}])
    assert got == {"dns.route[2].suffix": "'corp.example.' is also dns.route[0].suffix"}


@pytest.mark.parametrize(("route", "key"), [
    ({"upstreams": ["udp://10.0.0.1"]}, "dns.route[0].suffix"),
    ({"suffix": "", "upstreams": ["udp://10.0.0.1"]}, "dns.route[0].suffix"),
    ({"suffix": ".", "upstreams": ["udp://10.0.0.1"]}, "dns.route[0].suffix"),
    ({"suffix": "a..example", "upstreams": ["udp://10.0.0.1"]}, "dns.route[0].suffix"),
    ({"suffix": "x" * 64 + ".example", "upstreams": ["udp://10.0.0.1"]}, "dns.route[0].suffix"),
    ({"suffix": "a b.example", "upstreams": ["udp://10.0.0.1"]}, "dns.route[0].suffix"),
    ({"suffix": 5, "upstreams": ["udp://10.0.0.1"]}, "dns.route[0].suffix"),
    ({"suffix": "n1.mesh.internal", "upstreams": ["udp://10.0.0.1"]}, "dns.route[0].suffix"),
    ({"suffix": "a.example"}, "dns.route[0].upstreams"),
    ({"suffix": "a.example", "upstreams": []}, "dns.route[0].upstreams"),
    ({"suffix": "a.example", "upstreams": "udp://10.0.0.1"}, "dns.route[0].upstreams"),
    ({"suffix": "a.example", "upstreams": ["udp://10.0.0.1"], "upstream": []}, "dns.route[0].upstream"),
    ("a.example", "dns.route[0]"),
])
def test_a_bad_route_is_named_by_its_key(route: Any, key: str) -> None:
    assert list(problems([route])) == [key]


def test_route_must_be_an_array_of_tables() -> None:
    assert list(problems({"suffix": "a.example"})) == ["dns.route"]


def test_a_suffix_above_the_zone_is_allowed() -> None:
    assert from_dict({"dns": {"route": [{"suffix": "internal", "upstreams": ["udp://10.0.0.1"]}]}}).dns.routes


def test_a_worker_waits_as_many_timeouts_as_the_longest_list() -> None:
    cfg = from_dict({"dns": {"upstreams": ["udp://10.0.0.1"], "route": [
        {"suffix": "a.example", "upstreams": ["udp://10.0.0.2", "udp://10.0.0.3", "udp://10.0.0.4"]}]}})
    assert upstream_spans(cfg) == 3
    assert upstream_spans(from_dict({"dns": {"upstreams": ["udp://10.0.0.1", "udp://10.0.0.2"]}})) == 2


# --------------------------------------------------------------------------- the table


def _table(*suffixes: str) -> RouteTable:
    return RouteTable(UpstreamGroup("dns.upstreams", []),
                      {wire.encode_name(s): UpstreamGroup(s, []) for s in suffixes})


@pytest.mark.parametrize(("name", "route"), [
    ("corp.example.", "corp.example."),
    ("a.corp.example.", "corp.example."),
    ("a.b.c.corp.example.", "corp.example."),
    ("xcorp.example.", "dns.upstreams"),
    ("corp.example.org.", "dns.upstreams"),
    ("example.", "dns.upstreams"),
    ("eng.corp.example.", "eng.corp.example."),
    ("x.eng.corp.example.", "eng.corp.example."),
    ("xeng.corp.example.", "corp.example."),
    ("any.lan.", "lan."),
    ("lan.", "lan."),
    ("plan.", "dns.upstreams"),
    (".", "dns.upstreams"),
])
def test_longest_suffix_on_label_boundaries(name: str, route: str) -> None:
    t = _table("corp.example.", "eng.corp.example.", "lan.")
    assert t.max_labels == 3
    assert t.group(wire.encode_name(name)).name == route


def test_no_routes_is_the_main_list() -> None:
    t = _table()
    assert t.group(wire.encode_name("a.corp.example.")) is t.default


def test_a_name_with_many_labels_probes_only_as_many_suffixes_as_a_route_has() -> None:
    probed: list[bytes] = []
    t = _table("corp.example.")

    class Spy(dict[bytes, UpstreamGroup]):
        def get(self, key: bytes, default: Any = None) -> Any:  # type: ignore[override]
            probed.append(key)
            return super().get(key, default)

    t.routes = Spy(t.routes)
    name = wire.encode_name(".".join(["l"] * 100) + ".corp.example.")
    assert t.group(name).name == "corp.example."
    assert probed == [wire.encode_name("corp.example.")]  # one probe, not 102
    probed.clear()
    assert t.group(wire.encode_name(".".join(["l"] * 100) + ".example.")) is t.default
    assert probed == [wire.encode_name("l.example."), wire.encode_name("example.")]


def test_the_pipeline_builds_routes_upstreams_with_the_mesh_route() -> None:
    """A tcp:// upstream of a route is handed the node's mesh route, as dns.upstreams' are."""
    cfg = from_dict({"dns": {"upstreams": ["tcp://10.0.0.1"], "route": [
        {"suffix": "corp.example", "upstreams": ["tcp://10.144.9.2:5353", "udp://10.0.0.3"]}]}})

    def route(host: str) -> None:
        return None

    p = Pipeline(cfg, upstream_route=route)
    group = p.routes.group(wire.encode_name("a.corp.example."))
    assert [u.url for u in group.upstreams] == ["tcp://10.144.9.2:5353", "udp://10.0.0.3"]
    first = group.upstreams[0]
    assert isinstance(first, TcpUpstream) and first.route is route
    main = p.upstreams[0]
    assert isinstance(main, TcpUpstream) and main.route is route
    p.close()


def test_given_upstreams_replace_the_routes_too() -> None:
    """A DNS worker's pipeline: its one upstream (the main process) gets every miss, routed or not."""
    cfg = from_dict({"dns": {"route": [{"suffix": "corp.example", "upstreams": ["udp://10.0.0.3"]}]}})
    parent = Upstream()
    p = Pipeline(cfg, upstreams=[parent])
    assert p.routes.group(wire.encode_name("a.corp.example.")).upstreams == [parent]
