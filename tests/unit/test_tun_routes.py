"""tun_routes: the commands and nftables text a node would apply, and the crash-safe undo log.

The I/O runner is replaced by a recorder; where nft and root are present, the
generated ruleset is also checked by nft itself (`nft -c`, which applies nothing).
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import subprocess
from pathlib import Path

import pytest

from meshgate.config import from_dict
from meshgate.mesh import tun_routes as tr
from tests.helpers import require_root, require_tool


class Recorder:
    def __init__(self, fail: set[str] | None = None) -> None:
        self.calls: list[tuple[tuple[str, ...], bytes | None]] = []
        self.fail = fail or set()

    async def __call__(self, argv: tuple[str, ...], stdin: bytes | None) -> tuple[int, str]:
        self.calls.append((argv, stdin))
        text = " ".join(argv)
        return (2, "RTNETLINK answers: File exists") if any(f in text for f in self.fail) else (0, "")


def cfg(**mesh: object) -> object:
    raw = {"node": {"name": "c", "secret": "long enough secret", "ipv4": "10.144.144.3/24",
                    "ipv6": "fd00:144::3/64"},
           "mesh": {"listen": ["tcp://0.0.0.0:11010"], **mesh}}
    return from_dict(raw)


def test_mark_socket_sets_so_mark() -> None:
    with socket.socket() as s:
        ok = tr.mark_socket(s)
        if os.geteuid() == 0:
            assert ok
            assert s.getsockopt(socket.SOL_SOCKET, tr.SO_MARK) == tr.LINK_FWMARK
        else:
            assert not ok  # needs CAP_NET_ADMIN; harmless without


def test_exit_plan_routes_and_rules_both_families() -> None:
    plan = tr.exit_plan("mg0")
    dos = [" ".join(d) for d, _ in plan]
    for fam in ("-4", "-6"):
        assert f"ip {fam} route replace default dev mg0 table 19783 proto 77" in dos
        assert f"ip {fam} rule add priority 5210 lookup main suppress_prefixlength 0" in dos
        assert f"ip {fam} rule add priority 5220 not fwmark 0x4d47 lookup 19783" in dos
    undos = [" ".join(u) for _, u in plan]
    assert "ip -6 rule del priority 5220" in undos
    with_peers = tr.exit_plan("mg0", ["192.0.2.7", "2001:db8::7", "192.0.2.7"])
    assert [" ".join(d) for d, _ in with_peers[:2]] == [
        "ip -4 rule add priority 5200 to 192.0.2.7/32 lookup main",
        "ip -6 rule add priority 5200 to 2001:db8::7/128 lookup main",
    ]


def test_cidr_route_uses_proto_and_metric() -> None:
    do, undo = tr.cidr_route("mg0", ipaddress.ip_network("fd00:2::/64"))
    assert do == ("ip", "-6", "route", "add", "fd00:2::/64", "dev", "mg0", "proto", "77", "metric", "4096")
    assert undo[3] == "del" and undo[4:] == do[4:]


def test_egress_ruleset_proxy_owner_only() -> None:
    c = cfg(proxy_cidrs=["10.1.2.0/24->10.2.2.0/24", "10.5.0.0/16"])
    text = tr.egress_ruleset("mg0", c)  # type: ignore[arg-type]
    assert 'iifname "mg0" ip daddr 10.2.2.0/24 dnat ip prefix to 10.1.2.0/24' in text
    assert "ip daddr { 10.1.2.0/24, 10.5.0.0/16 } accept" in text
    # not an exit: nothing but its own CIDRs, so no allow-list line
    assert "0.0.0.0/0" not in text
    assert text.rstrip().endswith("}")
    assert tr.egress_sysctls(c) == {"net/ipv4/ip_forward": "1"}  # type: ignore[arg-type]


def test_egress_ruleset_exit_follows_policy_order() -> None:
    c = from_dict({"node": {"name": "x", "ipv4": "10.144.144.3/24"},
                   "mesh": {"exit_node": True, "proxy_cidrs": ["192.168.7.0/24"]},
                   "exit": {"deny": ["198.51.100.99/32", "198.51.100.98/32"]}})
    text = tr.egress_ruleset("mg0", c)
    policy = text[text.index("chain mg_policy"):text.index("chain mg_forward")]
    lines = [ln.strip() for ln in policy.splitlines()]
    deny = lines.index("ip daddr { 198.51.100.98/31 } reject with icmpx admin-prohibited")  # collapsed
    own = lines.index("ip daddr { 192.168.7.0/24 } accept")
    builtin = next(i for i, ln in enumerate(lines) if "127.0.0.0/8" in ln)
    allow = lines.index("ip daddr { 0.0.0.0/0 } accept")
    assert deny < own < builtin < allow
    rules = [ln for ln in lines if ln and ln != "}"]
    assert rules[-1] == "reject with icmpx admin-prohibited"  # anything not allowed
    assert "net/ipv6/conf/all/forwarding" in tr.egress_sysctls(c)
    # allow_private drops the built-in deny
    c2 = from_dict({"node": {"name": "x", "ipv4": "10.144.144.3/24"}, "mesh": {"exit_node": True},
                    "exit": {"allow_private": True}})
    assert "127.0.0.0/8" not in tr.egress_ruleset("mg0", c2)


@pytest.mark.parametrize("mesh", [{"exit_node": True}, {"proxy_cidrs": ["10.1.2.0/24->10.2.2.0/24"]}])
def test_egress_ruleset_is_valid_nft(mesh: dict[str, object]) -> None:
    require_root()  # nft -c needs root; both fail (not skip) under MESHGATE_REQUIRE_E2E=1
    require_tool("nft")
    text = tr.egress_ruleset("mg0", cfg(**mesh))  # type: ignore[arg-type]
    r = subprocess.run(["nft", "-c", "-f", "-"], input=text.encode(), capture_output=True)
    assert r.returncode == 0, r.stderr.decode() + text


async def test_apply_records_undo_before_doing(tmp_path: Path) -> None:
    rec = Recorder()
    state = tmp_path / "tun-mg0.json"
    net = tr.NetConfig(state, runner=rec)
    do, undo = tr.cidr_route("mg0", ipaddress.ip_network("10.2.2.0/24"))
    await net.apply(do, undo)
    assert json.loads(state.read_text())["undo"] == [list(undo)]
    await net.nft_load("meshgate_mg0", "table inet meshgate_mg0 {}\n")
    assert rec.calls[-1] == (("nft", "-f", "-"), b"table inet meshgate_mg0 {}\n")
    await net.teardown()
    ran = [c for c, _ in rec.calls[-2:]]
    assert ran == [("nft", "delete", "table", "inet", "meshgate_mg0"), undo]  # newest first
    assert not state.exists()


async def test_failed_apply_leaves_no_undo(tmp_path: Path) -> None:
    net = tr.NetConfig(tmp_path / "s.json", runner=Recorder(fail={"route add"}))
    do, undo = tr.cidr_route("mg0", ipaddress.ip_network("10.2.2.0/24"))
    with pytest.raises(tr.NetConfigError, match="File exists"):
        await net.apply(do, undo)
    assert net.undo == []


async def test_recover_undoes_a_crashed_run(tmp_path: Path) -> None:
    sysctl = tmp_path / "sys"
    (sysctl / "net/ipv4").mkdir(parents=True)
    (sysctl / "net/ipv4/ip_forward").write_text("0\n")
    state = tmp_path / "tun-mg0.json"
    crashed = tr.NetConfig(state, runner=Recorder(), sysctl_root=sysctl)
    crashed.set_sysctl("net/ipv4/ip_forward", "1")
    for do, undo in tr.exit_plan("mg0"):
        await crashed.apply(do, undo)
    assert (sysctl / "net/ipv4/ip_forward").read_text().strip() == "1"
    # the process dies here: no teardown. The next start:
    rec = Recorder()
    fresh = tr.NetConfig(state, runner=rec, sysctl_root=sysctl)
    assert await fresh.recover() == 7
    assert [c for c, _ in rec.calls] == [u for _, u in reversed(tr.exit_plan("mg0"))]
    assert (sysctl / "net/ipv4/ip_forward").read_text().strip() == "0"
    assert not state.exists()
    assert await tr.NetConfig(state, runner=rec).recover() == 0


async def test_recover_survives_a_corrupt_state_file(tmp_path: Path) -> None:
    state = tmp_path / "tun-mg0.json"
    state.write_text("{not json")
    assert await tr.NetConfig(state, runner=Recorder()).recover() == 0
    assert not state.exists()
