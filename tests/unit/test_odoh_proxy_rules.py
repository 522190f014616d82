"""ODoH proxy request rules: targethost/targetpath parsing, allow-list, IP literals, SSRF."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshgate.config import DnsListenerConfig, HostPort, LimitsConfig
from meshgate.dns import odoh
from meshgate.dns.odoh_proxy import OdohProxy, ProxyRefusal, parse_target, proxy_status
from meshgate.metrics import REGISTRY


def proxy(**kw: object) -> OdohProxy:
    cfg = DnsListenerConfig("odoh", HostPort("127.0.0.1", 0), mode="proxy", **kw)  # type: ignore[arg-type]
    return OdohProxy(cfg, LimitsConfig())


def test_parse_name_and_port() -> None:
    t = parse_target("targethost=Odoh.Example.&targetpath=/dns-query")
    assert (t.host, t.port, t.path, t.ip) == ("odoh.example", 443, "/dns-query", None)
    t = parse_target("targethost=localhost:8444&targetpath=%2Fdns-query")
    assert (t.host, t.port, t.path) == ("localhost", 8444, "/dns-query")
    assert t.authority == "localhost:8444"
    t = parse_target("targethost=[::1]:8444&targetpath=/q")
    assert (t.host, t.port) == ("::1", 8444) and t.ip is not None


@pytest.mark.parametrize(
    "query",
    [
        "",
        "targethost=a.example",
        "targetpath=/x",
        "targethost=a.example&targethost=b.example&targetpath=/x",
        "targethost=a.example&targetpath=relative",
        "targethost=a.example&targetpath=/has space",
        "targethost=a.example&targetpath=/x%0d%0aX-Injected:1",
        "targethost=a.example&targetpath=/dns-query%3Ftargethost%3Db.example%26targetpath%3D/x",
        "targethost=a.example&targetpath=/x%23frag",
        "targethost=bad_host!&targetpath=/x",
        "targethost=-lead.example&targetpath=/x",
        "targethost=a.example:99999&targetpath=/x",
        "targethost=a.example:&targetpath=/x",
        "targethost=[::1&targetpath=/x",
        "targethost=&targetpath=/x",
    ],
)
def test_malformed_is_400(query: str) -> None:
    with pytest.raises(ProxyRefusal) as e:
        parse_target(query)
    assert e.value.status == 400
    assert e.value.error == "http_request_error"


@pytest.mark.parametrize("host", ["127.0.0.1", "[::1]", "10.0.0.1:443", "127.1", "2130706433", "0x7f.0.0.1"])
def test_ip_literal_refused_by_default(host: str) -> None:
    t = parse_target(f"targethost={host}&targetpath=/dns-query")
    assert t.ip is not None
    with pytest.raises(ProxyRefusal) as e:
        proxy().check(t)
    assert e.value.status == 403 and e.value.error == "destination_ip_prohibited"
    proxy(allow_ip_targets=True).check(t)  # configured: allowed


def test_allow_list() -> None:
    p = proxy(targets=("localhost:8444", "odoh.example"))
    p.check(parse_target("targethost=localhost:8444&targetpath=/dns-query"))
    p.check(parse_target("targethost=ODOH.example&targetpath=/dns-query"))
    for bad in ("localhost:8445", "other.example", "odoh.example:8443"):
        with pytest.raises(ProxyRefusal) as e:
            p.check(parse_target(f"targethost={bad}&targetpath=/dns-query"))
        assert (e.value.status, e.value.error) == (403, "http_request_denied")


async def test_private_resolution_refused_unless_listed() -> None:
    t = parse_target("targethost=localhost:8444&targetpath=/dns-query")
    with pytest.raises(ProxyRefusal) as e:
        await proxy()._address(t)
    assert (e.value.status, e.value.error) == (403, "destination_ip_prohibited")
    assert await proxy(targets=("localhost:8444",))._address(t) in ("127.0.0.1", "::1")
    assert await proxy(allow_ip_targets=True)._address(t) in ("127.0.0.1", "::1")


async def test_forward_refusals_carry_proxy_status() -> None:
    p = proxy()
    good_q = "targethost=localhost:1&targetpath=/dns-query"
    r = await p.forward("GET", odoh.MEDIA_TYPE, good_q, b"")
    assert r.status == 405 and ("allow", "POST") in r.headers
    r = await p.forward("POST", "application/dns-message", good_q, b"x")
    assert r.status == 415
    r = await p.forward("POST", odoh.MEDIA_TYPE, good_q, bytes(odoh.MAX_MESSAGE_LEN + 1))
    assert r.status == 413
    before = REGISTRY.value("meshgate_odoh_proxy_requests_total", "refused", "destination_ip_prohibited")
    r = await p.forward("POST", odoh.MEDIA_TYPE, "targethost=127.0.0.1:1&targetpath=/dns-query", b"x")
    assert r.status == 403
    after = REGISTRY.value("meshgate_odoh_proxy_requests_total", "refused", "destination_ip_prohibited")
    assert after == before + 1
    status = dict(r.headers)["proxy-status"]
    assert status.startswith("meshgate; error=destination_ip_prohibited")


async def test_unreachable_target_is_502() -> None:
    from tests.helpers import free_port

    p = proxy(allow_ip_targets=True)
    q = f"targethost=127.0.0.1:{free_port()}&targetpath=/dns-query"
    r = await p.forward("POST", odoh.MEDIA_TYPE, q, b"sealed")
    assert r.status == 502
    assert dict(r.headers)["proxy-status"].startswith("meshgate; error=connection_refused")
    p.close()


def test_proxy_status_escapes_details() -> None:
    assert proxy_status("dns_error", 'a "b" \\c') == 'meshgate; error=dns_error; details="a \\"b\\" \\\\c"'
    assert proxy_status(received=200) == "meshgate; received-status=200"


@given(st.text(max_size=200))
def test_parse_target_never_crashes(query: str) -> None:
    try:
        t = parse_target(query)
    except ProxyRefusal as e:
        assert e.status == 400
    else:
        assert t.path.startswith("/") and 0 < t.port < 65536
