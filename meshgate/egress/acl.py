"""Access rules where mesh traffic ends: who (by authenticated identity) may reach what here.

Nebula's firewall model in TOML (docs/OPERATIONS.md, "Access rules"):

    [[acl]]
    from = ["group:laptops", "node:alice", "10.144.144.0/24", "*"]
    to = ["self:22", "self:8000-8100", "10.1.2.0/24:80,443", "exit"]
    proto = "tcp"            # "tcp", "udp" or "any" (the default)

Rules only allow. With no [[acl]] at all every member reaches what this node serves,
proxies and exits (the node's other policy still applies: [serve], [exit]). Once any
rule is given, a connection from the mesh passes only if some rule matches all of: its
source (`node:NAME` its name, `group:G` a group in its certificate, a CIDR its virtual
IP, `*` anyone), its destination (`self[:PORTS]` this node's own virtual IP, `CIDR[:PORTS]`
an address there, `exit` an address outside this node's proxy CIDRs, `*` anything) and
its protocol. The node's own local users (its portal) are not subject to the rules.

Pure: no I/O. The source is authenticated by the mesh (mesh/e2e.py, mesh/trust.py).
"""

from __future__ import annotations

import contextlib
import ipaddress
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from meshgate.config import AclRule, IPNetwork
from meshgate.mesh.certs import CertError
from meshgate.policy import IPAddress, in_any

if TYPE_CHECKING:
    from meshgate.egress.rules import ExitRules
    from meshgate.mesh.service import MeshService


@dataclass(frozen=True)
class Source:
    """Who opened it: from the source's verified route record and certificate."""

    node_id: int
    name: str = ""
    groups: tuple[str, ...] = ()
    ip: IPAddress | None = None


@dataclass(frozen=True)
class Decision:
    allowed: bool
    rule: int | None  # the index of the [[acl]] rule that allowed it; None: no rule (or no rules)

    @property
    def label(self) -> str:
        return "none" if self.rule is None else str(self.rule)


class Acl:
    def __init__(self, rules: Iterable[AclRule], own_nets: tuple[IPNetwork, ...] = ()) -> None:
        self.rules = tuple(rules)
        self.own_nets = own_nets  # this node's proxy CIDRs (real side): not "exit" traffic

    @property
    def active(self) -> bool:
        return bool(self.rules)

    def decide(self, src: Source, dest: IPAddress | None, port: int, proto: str) -> Decision:
        """`dest` None: this node's own virtual IP ("self")."""
        if not self.rules:
            return Decision(True, None)
        for i, rule in enumerate(self.rules):
            if rule.proto != "any" and rule.proto != proto:
                continue
            if not any(_source_matches(f, src) for f in rule.sources):
                continue
            if any(self._dest_matches(t, dest, port) for t in rule.dests):
                return Decision(True, i)
        return Decision(False, None)

    def admits(self, src: Source) -> bool:
        """May `src` reach anything here at all (some rule is for it)? NAT traversal asks: a
        node does not punch a direct path for a member its rules keep out."""
        return not self.rules or any(_source_matches(f, src) for rule in self.rules for f in rule.sources)

    def _dest_matches(self, t: tuple[str, IPNetwork | None, tuple[tuple[int, int], ...]],
                      dest: IPAddress | None, port: int) -> bool:
        kind, net, ports = t
        if ports and not any(lo <= port <= hi for lo, hi in ports):
            return False
        if kind == "*":
            return True
        if kind == "self":
            return dest is None
        if dest is None:
            return False
        if kind == "exit":
            return not in_any(dest, self.own_nets)
        assert net is not None
        return dest.version == net.version and dest in net


def _source_matches(f: tuple[str, str | IPNetwork], src: Source) -> bool:
    kind, value = f
    if kind == "*":
        return True
    if kind == "node":
        return src.name == value
    if kind == "group":
        return value in src.groups
    assert isinstance(value, ipaddress.IPv4Network | ipaddress.IPv6Network)
    return src.ip is not None and src.ip.version == value.version and src.ip in value


def source_in(mesh: MeshService, node_id: int, now: float) -> Source:
    """The source as the mesh knows it: name and virtual IP from its verified record, groups
    from its certificate (certificate mode; in secret mode a node has no groups)."""
    rec = mesh.table.records.get(node_id)
    if rec is None:
        return Source(node_id)
    groups: tuple[str, ...] = ()
    if rec.cert and mesh.trust.certificate_mode:
        with contextlib.suppress(CertError):
            groups = mesh.trust.certificate(rec.cert, int(now)).groups
    return Source(node_id, rec.name, groups, rec.ipv4.ip if rec.ipv4 is not None else None)


class PacketAccess:
    """[[acl]] for TUN packets (mesh/tun_firewall.py's Access): the node's current rules (a
    reload replaces `rules.acl`), the destination as the rules see it (this node's own virtual
    IP is "self"; a mapped proxy CIDR is its real network) and the source as the mesh
    authenticated it. Asked once per new flow, not per packet."""

    def __init__(self, rules: ExitRules, mesh: MeshService) -> None:
        self.rules = rules
        self.mesh = mesh

    @property
    def active(self) -> bool:
        return self.rules.acl.active

    @property
    def version(self) -> object:
        return self.rules.acl  # a reload makes a new Acl

    def decide(self, node: int, dst: bytes, port: int, proto: str) -> int | None:
        rules = self.rules
        ip = ipaddress.ip_address(dst)
        dest = None if ip in rules.own_ips else rules.translate(ip)
        d = rules.acl.decide(source_in(self.mesh, node, time.time()), dest, port, proto)
        if not d.allowed:
            return None
        return -1 if d.rule is None else d.rule
