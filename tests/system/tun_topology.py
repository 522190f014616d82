"""Network-namespace topology for the TUN system tests and bench/tun.py (root only).

    lan (10.1.2.10, ─┐
         fd12::10)   │                                   ┌─ inet (198.51.100.10, 2001:db8:100::10
                     C ──── B ──── A                     │        and 198.51.100.99, denied)
                     └───────────────────────────────────┘

    A ══ 172.31.1.0/24 ══ B ══ 172.31.2.0/24 ══ C ══ 10.1.2.0/24 ══ lan
                                                 C ══ 198.51.100.0/24, 2001:db8:100::/64 ══ inet

A reaches B's link address 172.31.9.2 (on B's loopback) through A's *default
route*, so with an exit default route installed A's own mesh link would fall
into its own tunnel unless the link socket is marked (SO_MARK) — the case the
exit test exists for. The "internet" addresses are documentation ranges that
exist only inside these namespaces; nothing here has a path to the host's
network. Namespace names carry a per-run prefix; `destroy()` removes them all
and stops every process started through `spawn`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SECRET = "tun-system-test-secret"


def sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, check=check, capture_output=True, text=True)


@dataclass
class Topology:
    prefix: str
    workdir: Path
    loop: str = "uvloop"
    names: tuple[str, ...] = ("a", "b", "c", "lan", "inet")
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    created: list[str] = field(default_factory=list)

    def ns(self, role: str) -> str:
        return f"{self.prefix}-{role}"

    # ------------------------------------------------------------------ build
    def make_namespaces(self) -> None:
        """One namespace per role (leftovers of an aborted run removed first), loopback up."""
        for role in self.names:
            sh("ip", "netns", "del", self.ns(role), check=False)
        for role in self.names:
            sh("ip", "netns", "add", self.ns(role))
            self.created.append(self.ns(role))
            self.ip(role, "link", "set", "lo", "up")

    def build(self) -> None:
        self.make_namespaces()
        self.veth("a", "b", "172.31.1.1/24", "172.31.1.2/24")
        self.veth("b", "c", "172.31.2.2/24", "172.31.2.3/24")
        self.veth("c", "lan", "10.1.2.1/24", "10.1.2.10/24", "fd12::1/64", "fd12::10/64")
        self.veth("c", "inet", "198.51.100.1/24", "198.51.100.10/24",
                  "2001:db8:100::1/64", "2001:db8:100::10/64")
        self.ip("inet", "addr", "add", "198.51.100.99/24", "dev", "to_c")
        # B's link address lives on its loopback; A reaches it only via its default route
        self.ip("b", "addr", "add", "172.31.9.2/32", "dev", "lo")
        self.ip("a", "route", "add", "default", "via", "172.31.1.2")
        for role in self.names:  # v6 addresses usable at once, no DAD wait
            sh("ip", "netns", "exec", self.ns(role), "sysctl", "-q", "-w", "net.ipv6.conf.all.accept_dad=0")

    def veth(self, x: str, y: str, ax: str, ay: str, ax6: str = "", ay6: str = "") -> None:
        sh("ip", "-n", self.ns(x), "link", "add", f"to_{y}", "type", "veth", "peer", "name", f"to_{x}",
           "netns", self.ns(y))
        for role, other, addr, addr6 in ((x, y, ax, ax6), (y, x, ay, ay6)):
            self.ip(role, "addr", "add", addr, "dev", f"to_{other}")
            if addr6:
                self.ip(role, "-6", "addr", "add", addr6, "dev", f"to_{other}", "nodad")
            self.ip(role, "link", "set", f"to_{other}", "up")

    def ip(self, role: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        if args and args[0] in ("-4", "-6"):
            return sh("ip", args[0], "-n", self.ns(role), *args[1:], check=check)
        return sh("ip", "-n", self.ns(role), *args, check=check)

    def nsexec(self, role: str, *argv: str, check: bool = False, timeout: float = 60
               ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["ip", "netns", "exec", self.ns(role), *argv], capture_output=True, text=True,
                              check=check, timeout=timeout, cwd=REPO)

    def tool(self, role: str, *args: str, timeout: float = 60) -> dict[str, object]:
        r = self.nsexec(role, sys.executable, "-m", "tests.system.tun_tools", *args, timeout=timeout)
        try:
            out: dict[str, object] = json.loads(r.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            raise AssertionError(f"tun_tools {args} in {role}: {r.stdout!r} {r.stderr!r}") from None
        return out

    # ------------------------------------------------------------------ nodes
    def config(self, role: str, text: str) -> Path:
        path = self.workdir / f"{role}.toml"
        state = self.workdir / f"state-{role}"
        path.write_text(
            f'[node]\nname = "{role}"\nnetwork = "tuntest"\nsecret = "{SECRET}"\nstate_dir = "{state}"\n'
            f'{text}\n[socks5]\nenable = false\n[admin]\nlisten = "127.0.0.1:15888"\n'
        )
        return path

    def spawn(self, key: str, role: str, argv: list[str]) -> subprocess.Popen[bytes]:
        log = open(self.workdir / f"{key}.log", "ab")  # noqa: SIM115 - lives as long as the process
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        proc = subprocess.Popen(["ip", "netns", "exec", self.ns(role), *argv], stdout=log,
                                stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)
        self.procs[key] = proc
        return proc

    def start_node(self, role: str) -> subprocess.Popen[bytes]:
        argv = [sys.executable, "-m", "meshgate", "run", "-c", str(self.workdir / f"{role}.toml"),
                "--loop", self.loop]
        return self.spawn(role, role, argv)

    def stop(self, key: str, sig: int = signal.SIGTERM, timeout: float = 15) -> int | None:
        proc = self.procs.pop(key, None)
        if proc is None:
            return None
        if proc.poll() is None:
            # `ip netns exec` execs the command, so proc.pid is meshgate itself
            os.kill(proc.pid, sig)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            return proc.wait()

    def log(self, key: str) -> str:
        try:
            return (self.workdir / f"{key}.log").read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def destroy(self) -> None:
        for key in list(self.procs):
            self.stop(key, timeout=5)
        for name in self.created:
            sh("ip", "netns", "del", name, check=False)
        self.created.clear()

    def start_line(self, what: str = "mesh", roles: tuple[str, ...] = ("c", "b", "a")) -> None:
        """Start the nodes (far end first) and wait until A pings C's virtual IP through them;
        if it never does, fail with every node's log."""
        for role in roles:
            self.start_node(role)
        try:
            self.wait_ping("a", "10.144.144.3", timeout=30)
        except AssertionError:
            raise AssertionError(f"{what} did not come up:\n" + "\n".join(
                f"--- {r}\n{self.log(r)}" for r in sorted(roles))) from None

    # ------------------------------------------------------------------ waits
    def wait_ping(self, role: str, dst: str, timeout: float = 30) -> dict[str, object]:
        deadline = time.monotonic() + timeout
        last: dict[str, object] = {}
        while time.monotonic() < deadline:
            last = self.tool(role, "ping", dst, "--count", "1", "--timeout", "0.5")
            if last["replies"]:
                return last
        raise AssertionError(f"no ping reply {role} -> {dst} within {timeout}s: {last}")
