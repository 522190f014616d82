import ipaddress
import subprocess
import sys
from pathlib import Path

import pytest

from meshgate import config
from meshgate.config import ConfigError, HostPort, load


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "node.toml"
    p.write_text(text)
    return p


def problems(tmp_path: Path, text: str) -> dict[str, str]:
    with pytest.raises(ConfigError) as ei:
        load(write(tmp_path, text))
    return {p.key: p.message for p in ei.value.problems}


def test_interface_example_parses(tmp_path: Path) -> None:
    cfg = load(
        write(
            tmp_path,
            """
[node]
name = "node-a"
network = "demo"
secret = "change-me-please"
ipv4 = "10.144.144.1/24"
ipv6 = "fd00:144::1/64"
[mesh]
listen = ["tcp://0.0.0.0:11010", "quic://0.0.0.0:11012"]
peers = ["tcp://192.0.2.10:11010"]
policy = "least-latency"
proxy_cidrs = ["10.1.2.0/24", "192.168.1.0/24->10.2.2.0/24"]
exit_node = true
exit_nodes = ["10.144.144.3", "auto"]
[exit]
deny = ["203.0.113.0/24"]
[socks5]
listen = "127.0.0.1:1081"
users = [{ name = "alice", password = "s3cret" }]
[dns]
zone = "mesh.internal"
upstreams = ["udp://127.0.0.53"]
records = { "printer.mesh.internal." = "10.1.2.9" }
[[dns.listener]]
protocol = "doh"
listen = "127.0.0.1:8443"
[[dns.listener]]
protocol = "odoh"
listen = "[::1]:8444"
mode = "dual"
key_seed = "000102030405060708090a0b0c0d0e0f"
[limits]
socks5_handshake_timeout = 3
stream_window = 65536
""",
        )
    )
    assert cfg.node.ipv4 == ipaddress.IPv4Interface("10.144.144.1/24")
    assert [str(u) for u in cfg.mesh.listen] == ["tcp://0.0.0.0:11010", "quic://0.0.0.0:11012"]
    mapped = cfg.mesh.proxy_cidrs[1]
    assert str(mapped.real) == "192.168.1.0/24" and str(mapped.advertised) == "10.2.2.0/24"
    assert cfg.mesh.exit_nodes == ("10.144.144.3", "auto")
    assert cfg.socks5.users[0].name == "alice"
    assert cfg.dns.zone == "mesh.internal."
    assert cfg.dns.listeners[1].listen == HostPort("::1", 8444)
    assert cfg.limits.socks5_handshake_timeout == 3.0
    assert cfg.limits.stream_window == 65536
    # secrets never appear in reprs (they end up in logs)
    assert "change-me-please" not in repr(cfg) and "s3cret" not in repr(cfg)


def test_every_problem_is_reported_with_its_key(tmp_path: Path) -> None:
    found = problems(
        tmp_path,
        """
[node]
ipv4 = "10.144.144.300/24"
[mesh]
listen = ["tcp://0.0.0.0:11010", "carrier-pigeon://x"]
proxy_cidrs = ["10.1.2.0/24->10.2.0.0/16", "10.1.2.1/24"]
[socks5]
listn = "127.0.0.1:1080"
max_clients = -1
[[dns.listener]]
protocol = "dox"
[limits]
stream_windw = 5
""",
    )
    assert "not a valid" in found["node.ipv4"] or "IPv4" in found["node.ipv4"]
    assert "unknown link scheme" in found["mesh.listen[1]"]
    assert "same IP version and prefix length" in found["mesh.proxy_cidrs[0]"]
    assert "not a valid CIDR" in found["mesh.proxy_cidrs[1]"]
    assert "did you mean 'listen'" in found["socks5.listn"]
    assert "positive" in found["socks5.max_clients"]
    assert "not one of" in found["dns.listener[0].protocol"]
    assert "did you mean 'stream_window'" in found["limits.stream_windw"]
    assert "is required when mesh.listen" in found["node.secret"]


def test_port_clash_and_types(tmp_path: Path) -> None:
    found = problems(
        tmp_path,
        """
[socks5]
listen = "127.0.0.1:9000"
udp = "yes"
[admin]
listen = "127.0.0.1:9000"
""",
    )
    assert "already used by socks5.listen" in found["admin.listen"]
    assert "true or false" in found["socks5.udp"]


def test_defaults_without_file() -> None:
    cfg = load(None)
    assert cfg.socks5.listen == HostPort("127.0.0.1", 1080)
    assert cfg.admin.listen == HostPort("127.0.0.1", 15888)
    protos = {(lst.protocol, lst.listen.port) for lst in cfg.dns.listeners}
    assert ("doh", 8443) in protos and ("udp", 5353) in protos
    assert cfg.mesh.listen == () and cfg.mesh.exit_node is False


def test_overrides_win_over_file(tmp_path: Path) -> None:
    p = write(tmp_path, '[socks5]\nlisten = "127.0.0.1:1081"\n[node]\nname = "a"\n')
    cfg = load(p, {"socks5": {"listen": "127.0.0.1:2000"}, "node": {"network": "n2"}})
    assert cfg.socks5.listen.port == 2000
    assert cfg.node.name == "a" and cfg.node.network == "n2"


def test_secret_file(tmp_path: Path) -> None:
    (tmp_path / "secret").write_text("from-a-file-123\n")
    p = write(tmp_path, f'[node]\nsecret_file = "{tmp_path / "secret"}"\n[mesh]\nlisten=["tcp://127.0.0.1:0"]\n')
    assert load(p).node.secret == "from-a-file-123"


def test_bad_toml_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as ei:
        load(write(tmp_path, "[node\nname="))
    assert "not valid TOML" in str(ei.value) and "node.toml" in str(ei.value)


@pytest.mark.parametrize(
    "text,expected",
    [
        ("127.0.0.1:80", HostPort("127.0.0.1", 80)),
        ("[::1]:53", HostPort("::1", 53)),
        ("localhost:1", HostPort("localhost", 1)),
    ],
)
def test_host_port(text: str, expected: HostPort) -> None:
    assert config.parse_host_port(text) == expected


@pytest.mark.parametrize("text", ["127.0.0.1:99999", "[::1:53", "host:port", ":80", "[zz::1]:1"])
def test_host_port_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        config.parse_host_port(text)


def test_check_config_cli(tmp_path: Path) -> None:
    good = tmp_path / "good.toml"
    good.write_text('[node]\nname = "x"\n')
    bad = tmp_path / "bad.toml"
    bad.write_text('[socks5]\nlisten = "127.0.0.1:99999"\nfoo = 1\n')
    r = subprocess.run(
        [sys.executable, "-m", "meshgate", "check-config", str(good), str(bad)],
        capture_output=True, text=True, timeout=60,
    )
    assert r.returncode == 1
    assert f"{bad}:socks5.listen: port 99999" in r.stderr
    assert f"{bad}:foo: unknown key" in r.stderr or f"{bad}:socks5.foo: unknown key" in r.stderr
    assert f"{good}: ok" in r.stdout


def test_link_schemes_are_the_registered_link_kinds() -> None:
    # config (a ground module) cannot import the mesh's registry; the two lists must agree
    from meshgate.config import LINK_SCHEMES
    from meshgate.mesh.link_kinds import LINK_KINDS

    assert sorted(LINK_SCHEMES) == sorted(LINK_KINDS)


def test_serve_publishes_ports_on_the_virtual_ip() -> None:
    from_dict = config.from_dict
    cfg = from_dict({"serve": {"8000": "127.0.0.1:8000", "2222": "127.0.0.1:22"}})
    assert [(p, str(t)) for p, t in cfg.serve] == [(2222, "127.0.0.1:22"), (8000, "127.0.0.1:8000")]
    assert from_dict({}).serve == ()  # nothing by default
    with pytest.raises(ConfigError) as e:
        from_dict({"serve": {"http": "127.0.0.1:80", "70000": "127.0.0.1:1", "22": "localhost:22"}})
    keys = {p.key for p in e.value.problems}
    assert keys == {"serve.http", "serve.70000", "serve.22"}
