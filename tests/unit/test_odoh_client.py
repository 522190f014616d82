"""ODoH client pieces that need no network: URLs, the proxy URI template, padding, upstream URLs."""

from __future__ import annotations

import pytest

from meshgate.dns.odoh_client import (
    HttpsEndpoint,
    OdohClientError,
    OdohUpstream,
    padding_for,
    parse_endpoint,
)
from meshgate.dns.upstream import parse_upstream


def test_parse_endpoint_forms() -> None:
    assert parse_endpoint("https://odoh.example/dns-query", "/x") == HttpsEndpoint("odoh.example", 443,
                                                                                  "/dns-query")
    assert parse_endpoint("localhost:8444", "/dns-query") == HttpsEndpoint("localhost", 8444, "/dns-query")
    # RFC 9230's URI template form: the variables are ours to fill in.
    e = parse_endpoint("https://proxy.example:8443/proxy{?targethost,targetpath}", "/x")
    assert e == HttpsEndpoint("proxy.example", 8443, "/proxy")
    assert e.authority == "proxy.example:8443"
    assert parse_endpoint("https://[::1]:8444/q", "/x").authority == "[::1]:8444"


@pytest.mark.parametrize("url", ["http://plain.example/", "https://", "https://h:99999/", "ftp://x/"])
def test_parse_endpoint_rejects(url: str) -> None:
    with pytest.raises(OdohClientError):
        parse_endpoint(url, "/dns-query")


def test_query_padding_hides_length() -> None:
    for n in range(12, 600):
        pad = padding_for(n)
        assert 0 <= pad < 128 and (n + 4 + pad) % 128 == 0


def test_odoh_upstream_url() -> None:
    up = parse_upstream("odoh://target.example:8444/dns-query?proxy=https://proxy.example/proxy")
    assert isinstance(up, OdohUpstream)
    assert up.client.target == HttpsEndpoint("target.example", 8444, "/dns-query")
    assert up.client.proxy == HttpsEndpoint("proxy.example", 443, "/proxy")
    direct = OdohUpstream("odoh://target.example")
    assert direct.client.proxy is None and direct.client.target.path == "/dns-query"
    with pytest.raises(ValueError):
        OdohUpstream("odoh://target.example/?proxy=http://plain.example/")
