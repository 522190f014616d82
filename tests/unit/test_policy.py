import ipaddress

import pytest

from meshgate.config import ExitConfig, ProxyCidr
from meshgate.policy import EgressPolicy

ip = ipaddress.ip_address
net = ipaddress.ip_network


def policy(**kw: object) -> EgressPolicy:
    own = kw.pop("own", ())
    return EgressPolicy(ExitConfig(**kw), own)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "addr",
    ["127.0.0.1", "10.1.2.3", "192.168.0.1", "172.20.0.1", "169.254.1.1", "::1", "fe80::1",
     "fd00::1", "::ffff:127.0.0.1", "0.0.0.0", "100.64.0.1", "224.0.0.1"],
)
def test_builtin_deny(addr: str) -> None:
    assert policy().check(ip(addr)) is not None


@pytest.mark.parametrize("addr", ["1.1.1.1", "8.8.8.8", "2606:4700::1111", "::ffff:1.1.1.1"])
def test_public_allowed(addr: str) -> None:
    assert policy().check(ip(addr)) is None


def test_own_proxy_cidr_is_reachable_even_if_private() -> None:
    p = policy(own=(ProxyCidr(net("10.1.2.0/24"), net("10.2.2.0/24")),))
    assert p.check(ip("10.1.2.10")) is None
    assert p.check(ip("10.1.3.10")) is not None  # a neighbouring private range is not


def test_deny_beats_everything_and_allow_private() -> None:
    p = policy(deny=(net("1.1.1.0/24"),), allow_private=True)
    assert "exit.deny" in (p.check(ip("1.1.1.1")) or "")
    assert p.check(ip("10.1.2.3")) is None
    assert "loopback" in (p.check(ip("127.0.0.1")) or "")  # never the node's own loopback


def test_allow_list_restricts() -> None:
    p = policy(allow=(net("1.0.0.0/8"),))
    assert p.check(ip("1.2.3.4")) is None
    assert "exit.allow" in (p.check(ip("8.8.8.8")) or "")
    assert p.check(ip("2606:4700::1111")) is not None  # no IPv6 in the allow list


def test_a_broad_proxy_cidr_or_allow_private_never_serves_the_own_loopback() -> None:
    """A CIDR that merely covers loopback (0.0.0.0/1), or exit.allow_private, does not make the
    node's loopback reachable from the mesh; a proxy CIDR inside 127.0.0.0/8 still does (it says
    so on purpose), and [serve] publishes loopback services port by port."""
    from meshgate.config import ExitConfig, ProxyCidr

    broad = EgressPolicy(ExitConfig(allow_private=True), [ProxyCidr(ipaddress.ip_network("0.0.0.0/1"))])
    assert broad.check(ipaddress.ip_address("127.0.0.1")) is not None
    assert broad.check(ipaddress.ip_address("::1")) is not None
    assert broad.check(ipaddress.ip_address("10.1.2.3")) is None  # the rest of the CIDR still works
    deliberate = EgressPolicy(ExitConfig(), [ProxyCidr(ipaddress.ip_network("127.0.0.0/24"))])
    assert deliberate.check(ipaddress.ip_address("127.0.0.9")) is None
    assert deliberate.check(ipaddress.ip_address("127.0.1.9")) is not None
