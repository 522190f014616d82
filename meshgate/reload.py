"""Which config keys changed between two configs, and whether they can change live (pure).

`diff(old, new)` walks the dataclass fields (`dataclasses.fields`) and names each changed leaf
by its dotted key (`socks5.users`, `exit.allow`, `dns.blocklist.lists`); a tuple field (users,
records, listeners, peers) is one key. Only key names leave this module, never values, so a
changed secret (`node.secret`, `admin.token`, a user's password) is named but never shown.

`LIVE` is what `Node.reload` can apply without a restart; any other changed key refuses the
whole reload (docs/OPERATIONS.md, "Reloading the config").
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from meshgate.config import Config, HostPort, LinkUrl, ProxyCidr, User

# what this node offers the mesh: its own route record carries them (re-originated)
MESH_OFFERS = frozenset({"mesh.proxy_cidrs", "mesh.exit_node"})
# how this node's portal picks where traffic leaves
MESH_EXITS = frozenset({"mesh.exit_nodes", "mesh.direct_fallback"})
DNS_UPSTREAMS = frozenset({"dns.upstreams", "dns.routes"})
DNS_BLOCKLIST = frozenset({"dns.blocklist.lists", "dns.blocklist.allow", "dns.blocklist.answer",
                           "dns.blocklist.refresh", "dns.blocklist.rebinding"})
# [limits] the portals read when a timer is armed or a connection arrives (gateway/server.py)
PORTAL_LIMITS = frozenset({"limits.socks5_handshake_timeout", "limits.socks5_idle_timeout",
                           "limits.socks5_max_clients_per_source"})

LIVE: frozenset[str] = frozenset({
    "log_level",
    "socks5.users",
    "dns.records",
    "exit.allow",
    "exit.deny",
    "exit.allow_private",
    "mesh.peers",
    "mesh.proxy_cidrs",
    "mesh.exit_node",
    "mesh.exit_nodes",
    "mesh.direct_fallback",
    "serve",
    "acl",
    "dns.upstreams",
    "dns.routes",
    "dns.serve_suffixes",
    *DNS_BLOCKLIST,
    *PORTAL_LIMITS,
})


# dataclasses that are one config value (`socks5.listen`), not a section to walk into
VALUE_TYPES = (HostPort, LinkUrl, ProxyCidr, User)


def changed_keys(old: Any, new: Any, prefix: str = "") -> list[str]:
    """Dotted keys of the leaves that differ, in field order."""
    out: list[str] = []
    for f in dataclasses.fields(old):
        key = f"{prefix}{f.name}"
        a, b = getattr(old, f.name), getattr(new, f.name)
        if dataclasses.is_dataclass(a) and not isinstance(a, (type, *VALUE_TYPES)) and type(a) is type(b):
            out += changed_keys(a, b, key + ".")
        elif a != b:
            out.append(key)
    return out


@dataclass(frozen=True)
class Plan:
    changed: tuple[str, ...]
    restart: tuple[str, ...]  # changed keys that cannot change live: the reload is refused

    @property
    def ok(self) -> bool:
        return not self.restart


def diff(old: Config, new: Config, live: frozenset[str] = LIVE) -> Plan:
    changed = tuple(changed_keys(old, new))
    return Plan(changed, tuple(k for k in changed if k not in live))
