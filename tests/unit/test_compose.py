"""docker-compose.yml and examples/demo agree: configs valid, addresses and ports consistent.

No Docker engine runs here, so the compose file is checked as data: the
networks force portal -> relay -> exit -> web, and every address a config
names is the one compose gives that service.
"""

import ipaddress
from pathlib import Path
from typing import Any

import pytest
import yaml

from meshgate.config import load

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "examples" / "demo"


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    assert isinstance(data, dict)
    return data


def addr(compose: dict[str, Any], service: str, network: str) -> ipaddress.IPv4Address:
    return ipaddress.IPv4Address(compose["services"][service]["networks"][network]["ipv4_address"])


def test_every_config_is_valid(monkeypatch: pytest.MonkeyPatch, compose: dict[str, Any]) -> None:
    monkeypatch.setenv("MESHGATE_SECRET", "a-demo-secret")
    for name in ("portal", "relay", "exit"):
        cmd = compose["services"][name]["command"]
        assert cmd[-1] == f"/etc/meshgate/demo/{name}.toml"
        load(DEMO / f"{name}.toml")
    mount = compose["services"]["portal"]["volumes"][0]
    assert mount.startswith("./examples/demo:/etc/meshgate/demo")


def test_networks_force_the_line(compose: dict[str, Any]) -> None:
    nets = {s: set(v["networks"]) for s, v in compose["services"].items()}
    assert nets["portal"] == {"edge", "front"}
    assert nets["relay"] == {"front", "back"}
    assert nets["exit"] == {"back", "lan"}
    assert nets["web"] == {"lan"}
    for n in ("front", "back", "lan"):
        assert compose["networks"][n]["internal"] is True


def test_addresses_agree(monkeypatch: pytest.MonkeyPatch, compose: dict[str, Any]) -> None:
    monkeypatch.setenv("MESHGATE_SECRET", "a-demo-secret")
    portal, relay, exit_ = (load(DEMO / f"{n}.toml") for n in ("portal", "relay", "exit"))
    assert str(portal.mesh.peers[0].host) == str(addr(compose, "relay", "front"))
    assert portal.mesh.peers[0].port == relay.mesh.listen[0].port
    assert str(relay.mesh.peers[0].host) == str(addr(compose, "exit", "back"))
    assert relay.mesh.peers[0].port == exit_.mesh.listen[0].port
    lan = ipaddress.ip_network(compose["networks"]["lan"]["ipam"]["config"][0]["subnet"])
    cidr = exit_.mesh.proxy_cidrs[0]
    assert cidr.real == lan == ipaddress.ip_network("10.1.2.0/24")
    assert str(cidr.mapped) == "10.2.2.0/24"
    web = addr(compose, "web", "lan")
    assert str(web) == "10.1.2.10" and web in lan
    # the static record points at web's mapped address
    records = dict(portal.dns.records)
    mapped_web = ipaddress.ip_address(int(cidr.advertised.network_address) + (int(web) & 0xFF))
    assert records["web.mesh.internal."] == str(mapped_web)
    assert exit_.mesh.exit_node and portal.mesh.exit_nodes == ("auto",)


def test_published_ports_match_listeners(monkeypatch: pytest.MonkeyPatch, compose: dict[str, Any]) -> None:
    monkeypatch.setenv("MESHGATE_SECRET", "a-demo-secret")
    portal = load(DEMO / "portal.toml")
    published = {p.split(":", 1)[1] for p in compose["services"]["portal"]["ports"]}
    assert f"{portal.socks5.listen.port}:{portal.socks5.listen.port}/tcp" in published
    by_proto = {lst.protocol: lst.listen.port for lst in portal.dns.listeners}
    assert f"{by_proto['doh']}:{by_proto['doh']}/tcp" in published
    assert f"{by_proto['doq']}:{by_proto['doq']}/udp" in published
    assert all(p.startswith("127.0.0.1:") for p in compose["services"]["portal"]["ports"])
    assert (portal.socks5.listen.port, by_proto["doh"], by_proto["doq"]) == (1080, 8443, 8853)


def test_no_secret_in_images_or_configs(compose: dict[str, Any]) -> None:
    for name in ("portal", "relay", "exit"):
        text = (DEMO / f"{name}.toml").read_text()
        assert "secret =" not in text and "secret_file" not in text
        assert compose["services"][name]["env_file"] == "demo.env"
    instructions = [ln for ln in (ROOT / "Dockerfile").read_text().splitlines() if not ln.startswith("#")]
    assert not any("SECRET" in ln for ln in instructions)
