"""OS routes, policy rules, nftables and sysctls for the TUN path; undone on stop and after a crash.

What a node installs (all through `ip`, `nft` and /proc/sys, so an operator can
read it back with the same tools):

* **Proxy CIDRs** of other nodes: `ip route add CIDR dev TUN proto 77 metric 4096`
  in the main table. Longest prefix still wins across all routes; the high
  metric makes an identical prefix the host already routes (its own LAN) win.
* **Exit** (`mesh.exit_nodes`): a default route (IPv4 and IPv6) via the TUN in
  table 19783, and two policy rules per family, as wg-quick does:
  `priority 5210 lookup main suppress_prefixlength 0` (every specific route of
  the host wins over the tunnel) and `priority 5220 not fwmark 0x4d47 lookup
  19783`. Link sockets marked with `LINK_FWMARK` (`mark_socket`) skip the
  tunnel table, so the node's own mesh links still leave by the physical
  interface and the tunnel never swallows itself. Configured peers' addresses
  also get `priority 5200 to PEER lookup main`, so outbound links stay out even
  if a socket were not marked.
* **Egress** (a node with `mesh.proxy_cidrs` or `mesh.exit_node`): forwarding
  sysctls, and one nftables table `inet meshgate_<tun>`: mapped CIDRs are
  translated by `dnat ip prefix to` (conntrack reverses the reply, so the
  mapping is stateful and needs no per-packet work in Python), packets from the
  TUN pass the egress policy (meshgate/policy.py, same order as
  `EgressPolicy.check`) in forward and input, and what leaves the node is
  masqueraded (marked by conntrack mark in forward, masqueraded in postrouting).

Crash safety: before each change the undo command is appended to a JSON state
file (`STATE_DIR/tun-<name>.json`, written atomically); `recover()` at the
next start runs every recorded undo and restores the recorded sysctl values.
The TUN device itself vanishes with the process, taking its routes along;
rules, nftables and sysctls are what the state file is for.

The planning functions are pure (config in, argv lists and nft text out) and
unit-tested; `NetConfig` is the thin I/O part.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import os
import re
import socket
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path

from meshgate.config import Config, IPNetwork
from meshgate.policy import BUILTIN_DENY

log = logging.getLogger("meshgate.mesh.tun")

LINK_FWMARK = 0x4D47  # "MG": mesh link sockets carry it and bypass the exit table
ROUTE_TABLE = 0x4D47  # 19783: the exit default routes live here
ROUTE_PROTO = 77  # `proto 77` tags every route meshgate adds, for `ip route show proto 77`
ROUTE_METRIC = 4096
RULE_PRIO_PEERS = 5200
RULE_PRIO_SUPPRESS = 5210
RULE_PRIO_EXIT = 5220
CT_MARK = 0x4D470000  # conntrack mark bit for "arrived from the TUN": masquerade on the way out
SO_MARK = getattr(socket, "SO_MARK", 36)

Command = tuple[str, ...]
Runner = Callable[[Command, bytes | None], Awaitable[tuple[int, str]]]


def mark_socket(sock: socket.socket) -> bool:
    """Mark a mesh link socket so it bypasses an exit's default route. Call before connect()/bind().

    Needs CAP_NET_ADMIN; without it (no TUN possible either) this returns False and does nothing.
    """
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_MARK, LINK_FWMARK)
    except OSError:
        return False
    return True


# --------------------------------------------------------------------------- planning (pure)


def nft_table_name(tun: str) -> str:
    return "meshgate_" + re.sub(r"[^A-Za-z0-9_]", "_", tun)


def _fam(net: IPNetwork | int) -> str:
    version = net if isinstance(net, int) else net.version
    return "-6" if version == 6 else "-4"


def cidr_route(tun: str, net: IPNetwork) -> tuple[Command, Command]:
    spec = (str(net), "dev", tun, "proto", str(ROUTE_PROTO), "metric", str(ROUTE_METRIC))
    return ("ip", _fam(net), "route", "add", *spec), ("ip", _fam(net), "route", "del", *spec)


def exit_plan(tun: str, peer_ips: Iterable[str] = ()) -> list[tuple[Command, Command]]:
    """Default routes via the TUN in ROUTE_TABLE and the policy rules around them, v4 and v6.

    `peer_ips` (the configured mesh peers' addresses) get a `to IP lookup main` rule ahead of
    everything: a second guard, beside SO_MARK, that outbound links never enter the tunnel.
    """
    out: list[tuple[Command, Command]] = []
    table = str(ROUTE_TABLE)
    for ip in sorted(set(peer_ips)):
        addr = ipaddress.ip_address(ip)
        fam = _fam(addr.version)
        spec = ("priority", str(RULE_PRIO_PEERS), "to", f"{addr}/{addr.max_prefixlen}", "lookup", "main")
        out.append((("ip", fam, "rule", "add", *spec), ("ip", fam, "rule", "del", *spec)))
    for fam in ("-4", "-6"):
        out.append((
            ("ip", fam, "route", "replace", "default", "dev", tun, "table", table, "proto", str(ROUTE_PROTO)),
            ("ip", fam, "route", "del", "default", "dev", tun, "table", table),
        ))
        out.append((
            ("ip", fam, "rule", "add", "priority", str(RULE_PRIO_SUPPRESS), "lookup", "main",
             "suppress_prefixlength", "0"),
            ("ip", fam, "rule", "del", "priority", str(RULE_PRIO_SUPPRESS)),
        ))
        out.append((
            ("ip", fam, "rule", "add", "priority", str(RULE_PRIO_EXIT), "not", "fwmark", hex(LINK_FWMARK),
             "lookup", table),
            ("ip", fam, "rule", "del", "priority", str(RULE_PRIO_EXIT)),
        ))
    return out


def is_egress(cfg: Config) -> bool:
    return bool(cfg.mesh.proxy_cidrs) or cfg.mesh.exit_node


def egress_sysctls(cfg: Config) -> dict[str, str]:
    """Forwarding switches an egress node needs (IPv6 only if it serves IPv6)."""
    out = {"net/ipv4/ip_forward": "1"}
    if cfg.mesh.exit_node or any(c.real.version == 6 for c in cfg.mesh.proxy_cidrs):
        out["net/ipv6/conf/all/forwarding"] = "1"
    return out


def _set(nets: Iterable[IPNetwork], version: int) -> str | None:
    picked = [n for n in nets if n.version == version]
    if not picked:
        return None
    merged = list(ipaddress.collapse_addresses(picked))  # type: ignore[type-var]
    return "{ " + ", ".join(str(n) for n in merged) + " }"


def egress_ruleset(tun: str, cfg: Config) -> str:
    """The nftables table for an egress node, as `nft -f` input (atomic: all or nothing)."""
    table = nft_table_name(tun)
    q = f'"{tun}"'
    own_vips = [i.ip for i in (cfg.node.ipv4, cfg.node.ipv6) if i is not None]
    lines = [f"table inet {table} {{"]

    # mapped CIDRs: peers address `mapped`, the LAN has `real` (prefix swap, host bits kept)
    lines.append("  chain mg_prerouting {")
    lines.append("    type nat hook prerouting priority dstnat; policy accept;")
    for c in cfg.mesh.proxy_cidrs:
        if c.mapped is not None:
            ip = "ip6" if c.real.version == 6 else "ip"
            lines.append(f"    iifname {q} {ip} daddr {c.mapped} dnat {ip} prefix to {c.real}")
    lines.append("  }")

    # the egress policy, in EgressPolicy.check's order
    lines.append("  chain mg_policy {")
    for version, ip in ((4, "ip"), (6, "ip6")):
        s = _set(cfg.exit.deny, version)
        if s:
            lines.append(f"    {ip} daddr {s} reject with icmpx admin-prohibited")
    for version, ip in ((4, "ip"), (6, "ip6")):
        s = _set((c.real for c in cfg.mesh.proxy_cidrs), version)
        if s:
            lines.append(f"    {ip} daddr {s} accept")
    if cfg.mesh.exit_node:
        if not cfg.exit.allow_private:
            for version, ip in ((4, "ip"), (6, "ip6")):
                s = _set(BUILTIN_DENY, version)
                if s:
                    lines.append(f"    {ip} daddr {s} reject with icmpx admin-prohibited")
        for version, ip in ((4, "ip"), (6, "ip6")):
            s = _set(cfg.exit.allow, version)
            if s:
                lines.append(f"    {ip} daddr {s} accept")
    lines.append("    reject with icmpx admin-prohibited")
    lines.append("  }")

    lines.append("  chain mg_forward {")
    lines.append("    type filter hook forward priority filter; policy accept;")
    lines.append(f"    iifname {q} ct state new ct mark set ct mark or {CT_MARK:#x}")
    lines.append(f"    iifname {q} ct state new jump mg_policy")
    lines.append("  }")

    # traffic from the TUN to the node's other addresses (LAN side, exit's uplink) obeys the
    # same policy; the node's own virtual IPs are its own services
    lines.append("  chain mg_input {")
    lines.append("    type filter hook input priority filter; policy accept;")
    for vip in own_vips:
        ip = "ip6" if vip.version == 6 else "ip"
        lines.append(f"    iifname {q} {ip} daddr {vip} accept")
    lines.append(f"    iifname {q} ip6 daddr fe80::/10 accept")  # link-local: neighbour discovery
    lines.append(f"    iifname {q} ct state new jump mg_policy")
    lines.append("  }")

    lines.append("  chain mg_postrouting {")
    lines.append("    type nat hook postrouting priority srcnat; policy accept;")
    lines.append(f"    ct mark and {CT_MARK:#x} == {CT_MARK:#x} oifname != {q} masquerade")
    lines.append("  }")
    lines.append("}")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- I/O


async def run_command(argv: Command, stdin: bytes | None = None) -> tuple[int, str]:
    """Run one tool; returns (exit status, stderr text)."""
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
    except OSError as e:
        return 127, f"{argv[0]}: {e.strerror}"
    _, err = await proc.communicate(stdin)
    return proc.returncode or 0, err.decode(errors="replace").strip()


class NetConfigError(Exception):
    pass


class NetConfig:
    """Applies changes and remembers how to undo them, in memory and in the state file."""

    def __init__(self, state_file: Path, runner: Runner = run_command, sysctl_root: Path = Path("/proc/sys")):
        self.state_file = state_file
        self.run = runner
        self.sysctl_root = sysctl_root
        self.undo: list[Command] = []
        self.sysctls: dict[str, str] = {}  # path -> value before we changed it

    # state file ------------------------------------------------------------
    def _save(self) -> None:
        tmp = self.state_file.with_suffix(".tmp")
        try:
            self.state_file.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps({"version": 1, "pid": os.getpid(), "undo": self.undo,
                                       "sysctl": self.sysctls}))
            os.replace(tmp, self.state_file)
        except OSError as e:
            log.warning("tun: cannot write state file %s (%s): a crash would leave routes behind",
                        self.state_file, e.strerror)

    async def recover(self) -> int:
        """Undo what a previous run recorded and did not undo (it crashed). Returns how many items."""
        try:
            state = json.loads(self.state_file.read_text())
        except FileNotFoundError:
            return 0
        except (OSError, ValueError) as e:
            log.warning("tun: ignoring unreadable state file %s: %s", self.state_file, e)
            with contextlib.suppress(OSError):
                self.state_file.unlink()
            return 0
        undo = [tuple(str(a) for a in c) for c in state.get("undo", []) if isinstance(c, list)]
        sysctls = {str(k): str(v) for k, v in dict(state.get("sysctl", {})).items()}
        log.info("tun: undoing %d changes left by a previous run (pid %s)", len(undo) + len(sysctls),
                 state.get("pid"))
        count = len(undo) + len(sysctls)
        self.undo, self.sysctls = undo, sysctls
        await self.teardown()
        return count

    # changes ---------------------------------------------------------------
    async def apply(self, do: Command, undo: Command) -> None:
        """Run `do`; its undo is recorded first, so a crash right after still gets undone."""
        self.undo.append(undo)
        self._save()
        rc, err = await self.run(do, None)
        if rc != 0:
            self.undo.remove(undo)
            self._save()
            raise NetConfigError(f"{' '.join(do)}: {err or f'exit status {rc}'}")

    async def revert(self, undo: Command) -> None:
        """Undo one earlier change now (a proxy CIDR that went away)."""
        if undo in self.undo:
            self.undo.remove(undo)
            self._save()
        rc, err = await self.run(undo, None)
        if rc != 0:
            log.debug("tun: %s: %s", " ".join(undo), err)

    async def nft_load(self, table: str, ruleset: str) -> None:
        # delete a same-named leftover first (its undo ran elsewhere or the file was lost)
        await self.run(("nft", "delete", "table", "inet", table), None)
        self.undo.append(("nft", "delete", "table", "inet", table))
        self._save()
        rc, err = await self.run(("nft", "-f", "-"), ruleset.encode())
        if rc != 0:
            self.undo.pop()
            self._save()
            raise NetConfigError(f"nft -f: {err or f'exit status {rc}'}")

    def set_sysctl(self, path: str, value: str) -> None:
        f = self.sysctl_root / path
        old = f.read_text().strip()
        if old == value:
            return
        self.sysctls.setdefault(path, old)
        self._save()
        f.write_text(value + "\n")

    async def teardown(self) -> None:
        """Undo everything, newest first; errors are logged, not raised (best effort, always finishes).

        Forwarding goes off before the firewall table goes away, never the other way round.
        """
        for path, old in self.sysctls.items():
            try:
                (self.sysctl_root / path).write_text(old + "\n")
            except OSError as e:
                log.warning("tun: cannot restore %s to %s: %s", path, old, e.strerror)
        self.sysctls = {}
        while self.undo:
            cmd = self.undo.pop()
            rc, err = await self.run(cmd, None)
            if rc != 0:
                log.debug("tun: undo %s: %s", " ".join(cmd), err)
        with contextlib.suppress(OSError):
            self.state_file.unlink()
