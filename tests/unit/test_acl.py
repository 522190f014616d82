"""Access rules ([[acl]], meshgate/egress/acl.py): parsing and decisions."""

from __future__ import annotations

import ipaddress
import subprocess
import sys
from pathlib import Path

import pytest

from meshgate.config import ConfigError, from_dict
from meshgate.egress.acl import Acl, Source
from meshgate.policy import IPAddress

ROOT = Path(__file__).resolve().parents[2]


def _acl(*rules: dict[str, object]) -> Acl:
    cfg = from_dict({"acl": list(rules)})
    return Acl(cfg.acl, (ipaddress.ip_network("10.1.2.0/24"),))


ALICE = Source(1, "alice", ("laptops",), ipaddress.ip_address("10.144.144.5"))
BOB = Source(2, "bob", (), ipaddress.ip_address("10.144.200.9"))
IP = ipaddress.ip_address


def test_no_rules_allow_everything() -> None:
    d = _acl().decide(BOB, None, 22, "tcp")
    assert d.allowed and d.rule is None


def test_rules_only_allow_and_the_first_match_decides() -> None:
    acl = _acl(
        {"from": ["group:laptops"], "to": ["self:22", "self:8000-8100"], "proto": "tcp"},
        {"from": ["node:bob"], "to": ["10.1.2.0/24:80,443"]},
        {"from": ["10.144.144.0/24"], "to": ["exit"], "proto": "udp"},
        {"from": ["*"], "to": ["self:53"], "proto": "udp"},
    )
    cases: list[tuple[Source, IPAddress | None, int, str, int | None]] = [
        (ALICE, None, 22, "tcp", 0), (ALICE, None, 8050, "tcp", 0), (ALICE, None, 8101, "tcp", None),
        (ALICE, None, 22, "udp", None),                                   # by protocol
        (BOB, None, 22, "tcp", None),                                     # by group
        (BOB, IP("10.1.2.7"), 443, "tcp", 1), (BOB, IP("10.1.2.7"), 22, "tcp", None),  # by port
        (ALICE, IP("10.1.2.7"), 443, "tcp", None),                        # by node
        (ALICE, IP("198.51.100.1"), 53, "udp", 2),                        # by source CIDR, exit
        (ALICE, IP("10.1.2.7"), 53, "udp", None),                         # a proxied net is not exit
        (BOB, IP("198.51.100.1"), 53, "udp", None),
        (BOB, None, 53, "udp", 3),                                        # anyone
    ]
    for src, dest, port, proto, rule in cases:
        d = acl.decide(src, dest, port, proto)
        assert (d.allowed, d.rule) == (rule is not None, rule), (src.name, dest, port, proto)


def test_bad_rules_are_config_errors_naming_the_key() -> None:
    with pytest.raises(ConfigError) as e:
        from_dict({"acl": [
            {"from": ["nobody:x"], "to": ["self:22"]},
            {"from": ["*"], "to": ["self:0"]},
            {"from": ["*"], "to": ["10.0.0.0/8:70000"]},
            {"from": ["*"], "to": ["self"], "proto": "sctp"},
            {"to": ["self"]},
            {"from": ["*"], "to": ["self"], "extra": 1},
        ]})
    keys = {p.key for p in e.value.problems}
    assert {"acl[0].from[0]", "acl[1].to[0]", "acl[2].to[0]", "acl[3].proto", "acl[4].from",
            "acl[5].extra"} <= keys


def test_icmp_rules_match_icmp_only_and_port_rules_never_match_it() -> None:
    # TUN packets (mesh/tun_firewall.py) ask with proto "icmp" and port 0
    acl = _acl({"from": ["*"], "to": ["self"], "proto": "icmp"}, {"from": ["*"], "to": ["self:22"]})
    assert acl.decide(BOB, None, 0, "icmp").rule == 0
    assert acl.decide(BOB, None, 22, "tcp").rule == 1
    assert not acl.decide(BOB, None, 80, "tcp").allowed
    assert not _acl({"from": ["*"], "to": ["self:1-65535"]}).decide(BOB, None, 0, "icmp").allowed


def test_ipv6_destinations_take_brackets() -> None:
    acl = _acl({"from": ["*"], "to": ["[fd00::/64]:443"]})
    assert acl.decide(BOB, IP("fd00::5"), 443, "tcp").allowed
    assert not acl.decide(BOB, IP("fd00::5"), 80, "tcp").allowed


def test_acl_test_command_says_which_rule_decides(tmp_path: Path) -> None:
    cfg = tmp_path / "n.toml"
    cfg.write_text('[[acl]]\nfrom = ["group:ops"]\nto = ["self:22"]\nproto = "tcp"\n')

    def run(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "meshgate", "acl", "test", *argv, "-c", str(cfg)],
                              cwd=ROOT, capture_output=True, text=True, timeout=60)

    ok = run("group:ops", "self", "22")
    assert ok.returncode == 0 and "allowed by acl[0]" in ok.stdout
    no = run("node:mallory", "self", "22")
    assert no.returncode == 1 and "denied" in no.stdout
    assert run("group:ops", "self", "22", "--proto", "udp").returncode == 1
    # ping rules (TUN): proto icmp, no ports
    cfg.write_text('[[acl]]\nfrom = ["group:ops"]\nto = ["self"]\nproto = "icmp"\n')
    ping = run("group:ops", "self", "0", "--proto", "icmp")
    assert ping.returncode == 0 and "allowed by acl[0]" in ping.stdout, ping.stdout + ping.stderr
    assert run("group:ops", "self", "0", "--proto", "tcp").returncode == 1
