"""The HTTP proxy's pure parts: request heads (gateway/http1.py), the status map and the PAC
file (gateway/http_proxy.py), the PAC evaluated by node.js with the PAC helpers a browser has."""

from __future__ import annotations

import base64
import ipaddress
import json
import subprocess

import pytest

from meshgate import replies
from meshgate.config import Config, ConfigError, HttpProxyConfig, from_dict, warnings
from meshgate.gateway import http1
from meshgate.gateway.http_proxy import build_pac, pac_networks, status_for
from tests.helpers import require_tool


def test_head_is_none_until_complete_then_parsed_with_the_rest() -> None:
    assert http1.parse_head(b"GET http://a/ HTTP/1.1\r\nHost: a\r\n") is None
    head, rest = http1.parse_head(b"GET http://a/ HTTP/1.1\r\nHost: a\r\nX-Y:  z \r\n\r\nBODY") or (None, b"")
    assert head is not None and rest == b"BODY"
    assert (head.method, head.target, head.version) == ("GET", "http://a/", "HTTP/1.1")
    assert head.get(b"x-y") == b"z" and head.get(b"host") == b"a"
    got = http1.parse_head(b"\r\nGET / HTTP/1.0\n\n")  # a stray CRLF before it, bare LF line ends
    assert got is not None and got[0].target == "/"


@pytest.mark.parametrize(
    "data,status",
    [
        (b"GET / HTTP/1.1\r\nX: " + b"a" * http1.MAX_HEAD, 431),  # no end in sight
        (b"GET / HTTP/1.1\r\nX: " + b"a" * http1.MAX_HEAD + b"\r\n\r\n", 431),
        (b"GET / HTTP/1.1\r\n" + b"A: b\r\n" * (http1.MAX_HEADERS + 1) + b"\r\n", 431),
        (b"GET /\r\n\r\n", 400),
        (b"GET  / HTTP/1.1\r\n\r\n", 400),
        (b"G(T / HTTP/1.1\r\n\r\n", 400),
        (b"GET / HTTP/3\r\n\r\n", 505),
        (b"GET / FOO/1.1\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nNo colon\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nName : v\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nA: b\r\n  folded\r\n\r\n", 400),
    ],
)
def test_bad_heads(data: bytes, status: int) -> None:
    with pytest.raises(http1.HttpError) as ei:
        http1.parse_head(data)
    assert ei.value.status == status


def test_connect_targets() -> None:
    assert http1.connect_target("example.com:443") == ("example.com", 443)
    assert http1.connect_target("[2001:db8::1]:8443") == ("2001:db8::1", 8443)
    assert http1.connect_target("10.0.0.1:1") == ("10.0.0.1", 1)
    for bad in ("example.com", "example.com:", "example.com:0", "example.com:65536", "a:b:c",
                "[::1]", "[::1:443", "[zz]:443", "user@host:443", "bad host:1", ":443", "ex ample:1"):
        with pytest.raises(http1.HttpError) as ei:
            http1.connect_target(bad)
        assert ei.value.status == 400, bad


def test_absolute_targets() -> None:
    assert http1.absolute_target("http://a.b/x?y=1#frag") == ("a.b", 80, "/x?y=1")
    assert http1.absolute_target("HTTP://a.b:8080") == ("a.b", 8080, "/")
    assert http1.absolute_target("http://a.b?q") == ("a.b", 80, "/?q")
    assert http1.absolute_target("http://[::1]:81/p") == ("::1", 81, "/p")
    for bad in ("https://a/", "/relative", "http:///x", "http://a:0/", "http://u:p@a/", "ftp://a/"):
        with pytest.raises(http1.HttpError):
            http1.absolute_target(bad)


def test_forward_head_drops_hop_by_hop_and_sets_host() -> None:
    got = http1.parse_head(
        b"GET http://a.b:8080/x HTTP/1.1\r\nHost: wrong\r\nProxy-Authorization: Basic eA==\r\n"
        b"Proxy-Connection: keep-alive\r\nConnection: keep-alive, X-Hop\r\nX-Hop: 1\r\nKeep-Alive: 5\r\n"
        b"TE: trailers\r\nUpgrade: h2c\r\nTransfer-Encoding: chunked\r\nX-End: 2\r\n\r\n"
    )
    assert got is not None
    head = got[0]
    out = http1.forward_head(head, "a.b", 8080, "/x")
    assert out == (b"GET /x HTTP/1.1\r\nHost: a.b:8080\r\ntransfer-encoding: chunked\r\nx-end: 2\r\n"
                   b"Connection: close\r\n\r\n")
    assert http1.forward_head(head, "::1", 80, "/").startswith(b"GET / HTTP/1.1\r\nHost: [::1]\r\n")


def test_basic_credentials() -> None:
    token = base64.b64encode(b"alice:pa:ss")
    assert http1.basic_credentials(b"Basic " + token) == (b"alice", b"pa:ss")
    assert http1.basic_credentials(b"basic  " + token) == (b"alice", b"pa:ss")
    for bad in (None, b"Bearer x", b"Basic !!!", b"Basic " + base64.b64encode(b"nocolon"), b"Basic"):
        assert http1.basic_credentials(bad) is None


def test_status_for_dial_failures() -> None:
    assert status_for(replies.NOT_ALLOWED) == 403
    assert status_for(replies.TTL_EXPIRED) == 504
    for code in (replies.GENERAL_FAILURE, replies.NETWORK_UNREACHABLE, replies.HOST_UNREACHABLE,
                 replies.REFUSED):
        assert status_for(code) == 502


# --------------------------------------------------------------------------- PAC

_PAC_HELPERS = """
function ip4(s) { var p = s.split("."); return ((+p[0] << 24) >>> 0) + (+p[1] << 16) + (+p[2] << 8) + +p[3]; }
function dnsDomainIs(host, domain) {
  return host.length >= domain.length && host.substring(host.length - domain.length) == domain;
}
function isInNet(host, pattern, mask) {
  if (!/^[0-9.]+$/.test(host)) throw new Error("isInNet would resolve " + host);
  return ((ip4(host) & ip4(mask)) >>> 0) == ((ip4(pattern) & ip4(mask)) >>> 0);
}
"""


def evaluate(pac: str, hosts: list[str]) -> dict[str, str]:
    """FindProxyForURL for each host, by node.js with the browser's PAC helpers."""
    exe = require_tool("node")
    script = (_PAC_HELPERS + pac + "\nvar hosts = " + json.dumps(hosts) + ";\nvar out = {};\n"
              "hosts.forEach(function (h) { out[h] = FindProxyForURL('http://' + h + '/', h); });\n"
              "console.log(JSON.stringify(out));\n")
    r = subprocess.run([exe, "-e", script], capture_output=True, text=True, timeout=30, check=True)
    result: dict[str, str] = json.loads(r.stdout)
    return result


def test_pac_sends_the_mesh_to_the_proxy_and_the_rest_direct() -> None:
    nets = [ipaddress.ip_network("10.144.1.0/24"), ipaddress.ip_network("10.2.2.0/24"),
            ipaddress.ip_network("10.144.1.3/32"), ipaddress.ip_network("fd00:1::/64")]
    pac = build_pac("127.0.0.1:8080", "mesh.internal.", nets, names=["web.example."])
    got = evaluate(pac, ["c.mesh.internal", "MESH.internal", "10.144.1.3", "10.2.2.10", "web.example",
                         "10.144.2.1", "example.com", "notmesh.internal", "8.8.8.8"])
    proxy = "PROXY 127.0.0.1:8080"
    assert got == {
        "c.mesh.internal": proxy, "MESH.internal": proxy, "10.144.1.3": proxy, "10.2.2.10": proxy,
        "web.example": proxy, "10.144.2.1": "DIRECT", "example.com": "DIRECT",
        "notmesh.internal": "DIRECT", "8.8.8.8": "DIRECT",
    }
    assert 'isInNetEx(ip, "fd00:1::/64")' in pac
    assert pac.count("isInNet(host,") == 2  # the /32 inside the /24 is collapsed away


def test_pac_with_exit_nodes_sends_everything_to_the_proxy() -> None:
    pac = build_pac("[::1]:8080", "mesh.internal.", [], everything=True)
    assert evaluate(pac, ["example.com", "10.0.0.1"]) == {
        "example.com": "PROXY [::1]:8080", "10.0.0.1": "PROXY [::1]:8080"}


def test_pac_networks_from_config_and_live_routes() -> None:
    cfg = from_dict({"node": {"ipv4": "10.144.1.1/24", "ipv6": "fd00:1::1/64", "secret": "x" * 16},
                     "mesh": {"proxy_cidrs": ["192.168.7.0/24->10.9.0.0/24", "172.16.0.0/16"]}})
    routes = [{"ipv4": "10.150.0.5", "ipv6": None, "proxy_cidrs": ["10.2.2.0/24"]}]
    nets = {str(n) for n in pac_networks(cfg, lambda: routes)}
    assert nets == {"10.144.1.0/24", "fd00:1::/64", "10.9.0.0/24", "172.16.0.0/16", "10.150.0.5/32",
                    "10.2.2.0/24"}
    assert {str(n) for n in pac_networks(Config(), None)} == set()


# --------------------------------------------------------------------------- config


def test_http_proxy_config() -> None:
    assert Config().http_proxy == HttpProxyConfig()
    assert not Config().http_proxy.enable
    cfg = from_dict({"http_proxy": {"enable": True, "listen": "127.0.0.1", "auth": False}})
    assert cfg.http_proxy.listen.port == 8080 and cfg.http_proxy.auth is False
    with pytest.raises(ConfigError) as ei:
        from_dict({"http_proxy": {"enable": "yes", "listn": "x", "listen": "1.2.3.4:99999"}})
    found = {p.key: p.message for p in ei.value.problems}
    assert "true or false" in found["http_proxy.enable"]
    assert "did you mean 'listen'" in found["http_proxy.listn"]
    assert "http_proxy.listen" in found
    with pytest.raises(ConfigError) as ei:
        from_dict({"http_proxy": {"enable": True, "listen": "127.0.0.1:1080"}})  # socks5's default
    found = {p.key: p.message for p in ei.value.problems}
    assert "already used by socks5.listen" in found["http_proxy.listen"]
    from_dict({"http_proxy": {"enable": False, "listen": "127.0.0.1:1080"}})  # disabled: no claim


def test_http_proxy_off_loopback_without_auth_is_warned() -> None:
    def keys(raw: dict[str, object]) -> set[str]:
        return {w.key for w in warnings(from_dict(raw))}

    assert "http_proxy.listen" in keys({"http_proxy": {"enable": True, "listen": "0.0.0.0:8080"}})
    users = {"users": [{"name": "u", "password": "p"}], "enable": False}
    assert "http_proxy.listen" not in keys({"http_proxy": {"enable": True, "listen": "0.0.0.0:8080"},
                                            "socks5": users})
    assert "http_proxy.listen" in keys({"http_proxy": {"enable": True, "listen": "0.0.0.0:8080",
                                                       "auth": False}, "socks5": users})
    assert "http_proxy.listen" not in keys({"http_proxy": {"enable": True}})
