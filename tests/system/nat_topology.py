"""Network namespaces that stand for the internet, for the NAT traversal tests and bench (root).

                       wan (router: 198.51.100.1, 203.0.113.1, 192.0.2.1)
             ┌──────────────┼────────────────┐
     r 198.51.100.2    n1 203.0.113.2      n2 192.0.2.2          NAT routers (nftables)
     (public relay)       │ 10.1.0.1          │ 10.2.0.1
                     ┌────┴─────┐             │
              a 10.1.0.2   a2 10.1.0.3     b 10.2.0.2            hosts behind them

N1 and N2 masquerade what leaves their wan side (`random`: a new port per mapping, which
behaves symmetric) and drop what arrives unsolicited on it (`ct state new drop` on input, as
home routers do); `full_cone` instead forwards one UDP port statically to the host behind
(the port-forward case). The wan namespace routes between the three public networks only:
nothing reaches the hosts' private ranges except through their NAT. The addresses are
documentation ranges that exist only inside these namespaces.
"""

from __future__ import annotations

import json
import subprocess
import time
from dataclasses import dataclass

from tests.system.tun_topology import REPO, Topology, sh

NAT_SECRET = "nat-traversal-test-secret"
B_PORT = 41641  # B's udp:// listener (the statically forwarded port in the full-cone case)


@dataclass
class NatTopology(Topology):
    names: tuple[str, ...] = ("wan", "r", "n1", "n2", "a", "a2", "b")
    nat1: str = "restricted"  # "restricted" | "bare" (no drop rule) | "random" | "full_cone"
    nat2: str = "restricted"

    def build(self) -> None:
        self.make_namespaces()
        self.veth("wan", "r", "198.51.100.1/24", "198.51.100.2/24")
        self.veth("wan", "n1", "203.0.113.1/24", "203.0.113.2/24")
        self.veth("wan", "n2", "192.0.2.1/24", "192.0.2.2/24")
        # N1's LAN: a bridge with A and A2 on it
        self.ip("n1", "link", "add", "lan", "type", "bridge")
        self.ip("n1", "addr", "add", "10.1.0.1/24", "dev", "lan")
        self.ip("n1", "link", "set", "lan", "up")
        for host, addr in (("a", "10.1.0.2/24"), ("a2", "10.1.0.3/24")):
            if host not in self.names:
                continue
            sh("ip", "-n", self.ns("n1"), "link", "add", f"p_{host}", "type", "veth", "peer", "name", "to_n1",
               "netns", self.ns(host))
            self.ip("n1", "link", "set", f"p_{host}", "master", "lan", "up")
            self.ip(host, "addr", "add", addr, "dev", "to_n1")
            self.ip(host, "link", "set", "to_n1", "up")
            self.ip(host, "route", "add", "default", "via", "10.1.0.1")
        self.veth("n2", "b", "10.2.0.1/24", "10.2.0.2/24")
        self.ip("b", "route", "add", "default", "via", "10.2.0.1")
        self.ip("r", "route", "add", "default", "via", "198.51.100.1")
        self.ip("n1", "route", "add", "default", "via", "203.0.113.1")
        self.ip("n2", "route", "add", "default", "via", "192.0.2.1")
        for role in ("wan", "n1", "n2"):
            self.nsexec(role, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1", check=True)
        self.nat("n1", "to_wan", "10.1.0.2", self.nat1)
        self.nat("n2", "to_wan", "10.2.0.2", self.nat2)

    def nat(self, role: str, wan_if: str, host: str, kind: str) -> None:
        masq = "masquerade random" if kind == "random" else "masquerade"
        forward = ""
        if kind == "full_cone":
            forward = (f'  chain pre {{ type nat hook prerouting priority -100; '
                       f'iifname "{wan_if}" udp dport {B_PORT} dnat to {host}:{B_PORT}; }}\n')
        rules = (
            "table ip nat {\n"
            f"{forward}"
            f'  chain post {{ type nat hook postrouting priority 100; oifname "{wan_if}" {masq}; }}\n'
            "}\n"
            + ("" if kind == "bare" else
            "table inet filter {\n"
            f'  chain input {{ type filter hook input priority 0; iifname "{wan_if}" ct state new drop; }}\n'
            f'  chain forward {{ type filter hook forward priority 0; iifname "{wan_if}" ct state new '
            f'{"udp dport " + str(B_PORT) + " accept; " if kind == "full_cone" else ""}'
            f'iifname "{wan_if}" ct state new drop; }}\n'
            "}\n")
        )
        r = self.nsinput(role, rules, "nft", "-f", "-")
        if r.returncode != 0:
            raise AssertionError(f"nft in {role}: {r.stderr}\n{rules}")

    def nsinput(self, role: str, text: str, *argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["ip", "netns", "exec", self.ns(role), *argv], capture_output=True, text=True,
                              timeout=60, cwd=REPO, input=text)

    def flush_conntrack(self, role: str) -> None:
        """Forget every NAT mapping of a router (conntrack -F)."""
        r = self.nsexec(role, "conntrack", "-F", check=False)
        if r.returncode != 0:
            raise AssertionError(f"conntrack -F in {role}: {r.stderr}")

    # ------------------------------------------------------------------ nodes

    def node_config(self, role: str, mesh: str, extra: str = "", limits: str = "") -> None:
        state = self.workdir / f"state-{role}"
        (self.workdir / f"{role}.toml").write_text(
            f'[node]\nname = "{role}"\nnetwork = "nattest"\nsecret = "{NAT_SECRET}"\n'
            f'state_dir = "{state}"\n{extra}\n[mesh]\n{mesh}\n'
            f'[socks5]\nlisten = "127.0.0.1:1080"\n[admin]\nlisten = "127.0.0.1:15888"\n'
            f'[limits]\n{limits}\n'
        )

    def admin(self, role: str, path: str) -> object:
        r = self.nsexec(role, "curl", "-s", "--max-time", "5", f"http://127.0.0.1:15888{path}")
        try:
            return json.loads(r.stdout)
        except ValueError:
            raise AssertionError(f"admin {path} on {role}: {r.stdout!r} {r.stderr!r}\n"
                                 f"{self.log(role)}") from None

    def peers(self, role: str) -> list[dict[str, object]]:
        out = self.admin(role, "/peers")
        assert isinstance(out, list)
        return out

    def traversal(self, role: str) -> dict[str, int]:
        """The node's traversal counters (`meshgate status`)."""
        status = self.admin(role, "/status")
        assert isinstance(status, dict)
        t = status.get("traversal_counters")
        assert isinstance(t, dict), f"{role}: {status.get('traversal')!r}"
        return t

    def direct_to(self, role: str, name: str) -> dict[str, object] | None:
        for p in self.peers(role):
            if p["name"] == name and str(p.get("path", "")).startswith("direct"):
                return p
        return None

    def wait(self, cond: object, timeout: float, what: str) -> float:
        """Seconds until `cond()` held; AssertionError with every log after `timeout`."""
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            if cond():  # type: ignore[operator]
                return time.monotonic() - start
            time.sleep(0.05)
        raise AssertionError(f"not within {timeout}s: {what}\n" + "\n".join(
            f"--- {k}\n{self.log(k)}" for k in sorted(self.procs)))

