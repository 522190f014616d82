"""One registry per kind: the DNS listener kinds and upstream URL schemes config accepts are exactly
the ones meshgate.dns implements (config is a ground module and cannot import dns to ask)."""

from __future__ import annotations

import pytest

from meshgate import config
from meshgate.config import ConfigError, from_dict
from meshgate.dns.listeners import DNS_LISTENERS, Listener, listener_class
from meshgate.dns.upstream import UPSTREAMS, Upstream, parse_upstream, upstream_class


def test_config_accepts_exactly_the_registered_listener_kinds() -> None:
    assert set(config.DNS_LISTENER_KINDS) == set(DNS_LISTENERS)
    assert tuple(config.DNS_LISTENER_KINDS) == config.DNS_PROTOCOLS


def test_config_accepts_exactly_the_registered_upstream_schemes() -> None:
    assert set(config.UPSTREAM_SCHEMES) == set(UPSTREAMS)


@pytest.mark.parametrize("protocol", sorted(DNS_LISTENERS))
def test_every_listener_kind_loads_and_config_reads_it(protocol: str) -> None:
    cls = listener_class(protocol)
    assert issubclass(cls, Listener) and cls.scheme
    kind = config.DNS_LISTENER_KINDS[protocol]
    lst = from_dict({"dns": {"listener": [{"protocol": protocol}]}}).dns.listeners[0]
    assert lst.protocol == protocol and lst.listen.port == kind.default_port
    assert kind.socket in ("udp", "tcp")


@pytest.mark.parametrize("scheme", sorted(UPSTREAMS))
def test_every_upstream_scheme_loads(scheme: str) -> None:
    cls = upstream_class(scheme)
    assert issubclass(cls, Upstream) and cls.from_url.__func__ is not Upstream.from_url.__func__  # type: ignore[attr-defined]
    assert from_dict({"dns": {"upstreams": [f"{scheme}://127.0.0.1/"]}}).dns.upstreams


def test_unknown_kinds_are_refused_in_config_and_in_dns() -> None:
    with pytest.raises(ConfigError, match="protocol"):
        from_dict({"dns": {"listener": [{"protocol": "dnscrypt"}]}})
    with pytest.raises(ConfigError, match="expected udp://"):
        from_dict({"dns": {"upstreams": ["h3://127.0.0.1"]}})
    with pytest.raises(ValueError, match="unsupported upstream scheme"):
        parse_upstream("h3://127.0.0.1")


def test_only_plain_tcp_upstreams_take_the_mesh_route() -> None:
    def route(host: str) -> None:
        return None

    tcp = parse_upstream("tcp://10.144.0.9", route=route)
    tls = parse_upstream("tls://10.144.0.9#dns.example", verify=False, route=route)
    udp = parse_upstream("udp://10.144.0.9", route=route)
    assert tcp.route is route  # type: ignore[attr-defined]
    assert tls.route is None  # type: ignore[attr-defined]
    assert udp.tcp.route is None  # type: ignore[attr-defined]  # UDP's TCP retry dials directly
