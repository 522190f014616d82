"""Host and port as text: `host:port`, `[v6]:port`, and URL authorities that omit a default port.

One home for the bracket rule (RFC 3986 3.2.2: an IPv6 literal in an authority is written in
brackets), so log lines, URLs and HTTP `:authority` values agree. A ground module: no imports
from the rest of meshgate.
"""

from __future__ import annotations

import ipaddress


def bracket(host: object) -> str:
    """`host`, with brackets around an IPv6 literal (`::1` -> `[::1]`); already bracketed stays."""
    text = str(host)
    return f"[{text}]" if ":" in text and not text.startswith("[") else text


def is_loopback(host: str) -> bool:
    """Whether a listen host is this machine's loopback only (a wildcard or any other address is not)."""
    if host.lower().rstrip(".") == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name other than localhost: it resolves to who knows what


def host_port(host: object, port: object) -> str:
    """`host:port`, or `[host]:port` for an IPv6 literal (a socket address's first two items)."""
    return f"{bracket(host)}:{port}"


def authority(host: object, port: int, default_port: int | None = None) -> str:
    """A URL authority: `host:port`, or only the (bracketed) host when `port` is `default_port`
    (443 for https: `dns.example`, `[2001:db8::1]`, `dns.example:8443`)."""
    return bracket(host) if port == default_port else host_port(host, port)
