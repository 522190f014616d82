"""Configuration: TOML file -> frozen dataclasses, validated.

Every problem is collected (not just the first) as a `ConfigProblem(key, message)`
so `meshgate check-config` can print `FILE:KEY: problem` for each one. Keys are
dotted paths (`socks5.listen`, `dns.listener[1].protocol`).
"""

from __future__ import annotations

import difflib
import ipaddress
import os
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

from meshgate import netsecret
from meshgate.netfmt import host_port, is_loopback

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
IPInterface = ipaddress.IPv4Interface | ipaddress.IPv6Interface

LINK_SCHEMES = ("tcp", "quic", "ring", "udp")


class DnsListenerKind(NamedTuple):
    """What reading a [[dns.listener]] needs to know about its protocol."""

    default_port: int
    socket: str  # what it binds, "udp" or "tcp": two listeners of one socket kind cannot share a port


# [[dns.listener]] protocols. The kinds are implemented in meshgate/dns (its DNS_LISTENERS
# registry; config must not import it): tests/unit/test_dns_registry.py checks both name the same.
DNS_LISTENER_KINDS: dict[str, DnsListenerKind] = {
    "udp": DnsListenerKind(53, "udp"),
    "tcp": DnsListenerKind(53, "tcp"),
    "dot": DnsListenerKind(853, "tcp"),
    "doh": DnsListenerKind(443, "tcp"),
    "doq": DnsListenerKind(853, "udp"),
    "doh3": DnsListenerKind(443, "udp"),  # DoH over HTTP/3: the doh listener's port number, over UDP
    "odoh": DnsListenerKind(443, "tcp"),
}
DNS_PROTOCOLS = tuple(DNS_LISTENER_KINDS)
# dns.upstreams URL schemes (meshgate/dns/upstream.py's UPSTREAMS registry; the same test).
UPSTREAM_SCHEMES = ("udp", "tcp", "tls", "https", "quic", "odoh", "odoh-mesh")
ODOH_MODES = ("target", "proxy", "dual")
DEFAULT_STATE_DIR = "~/.local/state/meshgate"


@dataclass(frozen=True)
class ConfigProblem:
    key: str
    message: str

    def render(self, source: str) -> str:
        return f"{source}:{self.key}: {self.message}"


class ConfigError(Exception):
    """Raised with every problem found; `str()` lists them one per line."""

    def __init__(self, problems: list[ConfigProblem], source: str = "<config>") -> None:
        self.problems = problems
        self.source = source
        super().__init__("\n".join(p.render(source) for p in problems))


@dataclass(frozen=True, order=True)
class HostPort:
    host: str
    port: int

    def __str__(self) -> str:
        return host_port(self.host, self.port)


@dataclass(frozen=True)
class LinkUrl:
    """`tcp://host:port`, `quic://host:port`, `udp://host:port` or `ring://name`."""

    scheme: str
    host: str
    port: int

    def __str__(self) -> str:
        if self.scheme == "ring":
            return f"ring://{self.host}"
        return f"{self.scheme}://{HostPort(self.host, self.port)}"


@dataclass(frozen=True)
class ProxyCidr:
    """A subnet this node proxies; `mapped` is what peers address it as."""

    real: IPNetwork
    mapped: IPNetwork | None = None

    @property
    def advertised(self) -> IPNetwork:
        return self.mapped if self.mapped is not None else self.real

    def __str__(self) -> str:
        return f"{self.real}->{self.mapped}" if self.mapped else str(self.real)


@dataclass(frozen=True)
class User:
    name: str
    password: str = field(repr=False)


@dataclass(frozen=True)
class NodeConfig:
    name: str = "meshgate"
    network: str = "default"
    secret: str = field(default="", repr=False)
    ipv4: ipaddress.IPv4Interface | None = None
    ipv6: ipaddress.IPv6Interface | None = None
    state_dir: str = DEFAULT_STATE_DIR
    # certificate mode (docs/OPERATIONS.md "Identity"): this node's certificate, the CA
    # certificates it trusts (more than one while a CA is rotated) and the revocation list
    certificate: str = ""
    ca: tuple[str, ...] = ()
    revocation_list: str = ""
    require_certificates: bool = True  # false: also link with secret-mode peers (a migration)


@dataclass(frozen=True)
class MeshConfig:
    listen: tuple[LinkUrl, ...] = ()
    peers: tuple[LinkUrl, ...] = ()
    policy: str = "least-hop"
    proxy_cidrs: tuple[ProxyCidr, ...] = ()
    exit_node: bool = False
    exit_nodes: tuple[str, ...] = ()
    direct_fallback: bool = True
    # NAT traversal (mesh/traversal.py) through this node's udp:// listener: direct links to
    # nodes reached through a relay
    traversal: bool = True
    traversal_keepalive: float = 25.0  # endpoint refresh to udp:// neighbours; holds NAT mappings (< 30 s)
    traversal_idle: float = 300.0  # a direct link made by traversal that carried no traffic this long closes


@dataclass(frozen=True)
class ExitConfig:
    allow: tuple[IPNetwork, ...] = (
        ipaddress.ip_network("0.0.0.0/0"),
        ipaddress.ip_network("::/0"),
    )
    deny: tuple[IPNetwork, ...] = ()
    allow_private: bool = False


@dataclass(frozen=True)
class Socks5Config:
    enable: bool = True
    listen: HostPort = HostPort("127.0.0.1", 1080)
    users: tuple[User, ...] = ()
    udp: bool = True
    max_clients: int = 1024
    # processes accepting SOCKS5 connections (SO_REUSEPORT): workers relay what leaves from this
    # host and hand what needs the mesh to the node's process; "auto" = CPU count
    workers: int = 1


@dataclass(frozen=True)
class HttpProxyConfig:
    """HTTP CONNECT, plain HTTP forwarding and /proxy.pac through the portal's dialer.
    Its connection caps and timeouts are the SOCKS5 portal's (socks5.max_clients,
    limits.socks5_*): the same clients (browsers) behind either kind of proxy setting."""

    enable: bool = False
    listen: HostPort = HostPort("127.0.0.1", 8080)
    auth: bool = True  # Proxy-Authorization: Basic against socks5.users, when there are any


@dataclass(frozen=True)
class DnsListenerConfig:
    protocol: str
    listen: HostPort
    cert: str | None = None
    key: str | None = None
    path: str = "/dns-query"
    mode: str = "target"
    key_seed: str | None = field(default=None, repr=False)
    allow_doh: bool = False
    key_rotation: float = 86400.0
    targets: tuple[str, ...] = ()
    allow_ip_targets: bool = False
    # per-client query rate limit (limits.dns_client_*): None = on when bound off loopback
    rate_limit: bool | None = None
    # not a file key: the Alt-Svc the node's doh listener sends (a doh3 beside it), for its workers
    alt_svc: str = ""


@dataclass(frozen=True)
class DnsRouteConfig:
    """[[dns.route]]: names at or under `suffix` (lowercased, trailing dot) go to `upstreams`."""

    suffix: str
    upstreams: tuple[str, ...]


@dataclass(frozen=True)
class DnsBlocklistConfig:
    """[dns.blocklist]: files or http(s) URLs of names answered with `answer` instead of being
    resolved (allow lists win); files re-read every `refresh` seconds when their mtime or size
    changed, URLs downloaded again then (ETag/If-Modified-Since)."""

    lists: tuple[str, ...] = ()
    allow: tuple[str, ...] = ()
    answer: str = "nxdomain"  # nxdomain, zero (A 0.0.0.0 / AAAA ::, NODATA otherwise), refused
    refresh: float = 3600.0
    # http(s) URLs in lists/allow: one download's deadline and size bound (more: a failure)
    fetch_timeout: float = 30.0
    max_bytes: int = 64 << 20
    # DNS-rebinding protection: an upstream answer for a name outside every [[dns.route]] and
    # served suffix that holds a private, loopback or link-local address is answered as blocked
    rebinding: bool = False

    @property
    def enabled(self) -> bool:
        return bool(self.lists)


BLOCKLIST_ANSWERS = ("nxdomain", "zero", "refused")


@dataclass(frozen=True)
class DnsQueryLogConfig:
    """[dns.query_log]: a ring of the last `size` answered questions (client, name, type, rcode,
    how answered, latency) for GET /dns/log and `meshgate dns log`. Off: it records clients.
    `path` also writes them as JSON lines, rotated at `max_bytes` into `keep` older files,
    through a queue of `queue` lines that drops (counted) rather than slow answers.
    `client_ip`: full, anonymized (IPv4 /24, IPv6 /48) or none, in the ring and the file."""

    enable: bool = False
    size: int = 1000
    path: str = ""
    max_bytes: int = 10_000_000
    keep: int = 5
    client_ip: str = "full"
    queue: int = 10_000


@dataclass(frozen=True)
class DnsConfig:
    zone: str = "mesh.internal."
    upstreams: tuple[str, ...] = ()
    cache_size: int = 10000
    records: tuple[tuple[str, str], ...] = ()
    listeners: tuple[DnsListenerConfig, ...] = ()
    workers: int = 1  # processes answering udp/tcp/dot/doh listeners (SO_REUSEPORT); "auto" = CPU count
    routes: tuple[DnsRouteConfig, ...] = ()  # split DNS: the longest matching suffix wins
    blocklist: DnsBlocklistConfig = DnsBlocklistConfig()
    query_log: DnsQueryLogConfig = DnsQueryLogConfig()
    # suffixes this node answers for the whole mesh: its signed record carries them and every
    # other node forwards those names here over the mesh (dns/mesh_dns.py)
    serve_suffixes: tuple[str, ...] = ()
    mesh_routes: bool = True  # forward names under other nodes' serve_suffixes to them
    # ODoH through the mesh (dns/mesh_odoh.py): answer sealed questions of any member / carry them
    mesh_odoh_target: bool = False
    mesh_odoh_proxy: bool = False


@dataclass(frozen=True)
class TunConfig:
    enable: bool = False
    name: str = "meshgate0"
    mtu: int = 1380


@dataclass(frozen=True)
class AdminConfig:
    enable: bool = True
    listen: HostPort = HostPort("127.0.0.1", 15888)
    # `Authorization: Bearer` token; required for every request when the API listens off loopback
    token: str = field(default="", repr=False)
    # Host header names accepted besides IP literals and localhost (DNS-rebinding defence)
    hosts: tuple[str, ...] = ()


AES_INSTRUCTIONS = ("auto", "yes", "no")  # limits.aes_instructions


@dataclass(frozen=True)
class LimitsConfig:
    """Every bound in one place. Seconds for timeouts, bytes for sizes."""

    socks5_handshake_timeout: float = 10.0
    socks5_connect_timeout: float = 10.0
    socks5_idle_timeout: float = 300.0
    socks5_udp_idle_timeout: float = 60.0
    socks5_udp_max_targets: int = 256
    mesh_udp_max_associations: int = 4096
    socks5_write_high_water: int = 1 << 20
    # a bulk relay between two TCP sockets moves to splice(2) (gateway/splice_relay.py): off, the
    # Python relay's 2 MiB reads moved more on Linux 6.18 loopback (docs/OPERATIONS.md)
    socks5_splice: bool = False
    stream_window: int = 1048576  # 1 MiB: 256 KiB stalled 4-process pipelines on 2 cores (bench/portal.py)
    max_streams_per_peer: int = 4096
    e2e_sessions: int = 1024  # end-to-end sessions (node pairs) held; the least recently used goes
    e2e_queue_bytes: int = 1 << 20  # bytes queued for one node while its session is set up
    max_peers: int = 256
    max_pending_handshakes: int = 64
    handshake_timeout: float = 5.0
    route_records: int = 4096
    mesh_ping_interval: float = 1.0  # link pings (latency, liveness)
    traversal_probes_per_minute: int = 60  # NAT traversal probes to one node in any minute, at most
    traversal_pairs: int = 256  # nodes this node keeps punching state for (least recently used goes)
    traversal_backoff_max: float = 300.0  # seconds between failed traversal attempts grow up to this
    # IP TTL of the first probe round (opens our NAT, dies before the far one); 64: every round full
    traversal_first_ttl: int = 2
    mesh_dead_after: float = 5.0  # a link silent this long is closed and its routes withdrawn
    # a link holding more than mesh_link_buffer that sends nothing on for this long is closed: its
    # peer stopped reading (a byte-pipe link; udp:// links fail on their own retransmission limits)
    mesh_link_stall: float = 10.0
    mesh_route_expiry: float = 60.0  # records of unreachable nodes are forgotten after this
    mesh_link_buffer: int = 4194304  # bytes queued on a link above which datagrams are dropped
    udp_link_mtu: int = 1500  # path MTU under udp:// links: UDP payload <= 1472 B (IPv4), 1452 (IPv6)
    udp_link_window: int = 2097152  # udp:// links: reliable bytes in flight (sent, not yet acknowledged)
    udp_link_queue: int = 33554432  # udp:// links: reliable bytes queued behind the window; more: link fails
    udp_link_retransmits: int = 8  # udp:// links: retransmission timeouts in a row before the link fails
    udp_link_gso: bool = True  # udp:// links: batch sends with UDP_SEGMENT (GSO) where the kernel has it
    udp_link_read_batch: int = 256  # udp:// links: datagrams read per socket wake-up before yielding
    udp_link_send_queue: int = 4096  # udp:// links: packets held while the socket is full (EAGAIN); more drop
    udp_link_reassembly: int = 64  # udp:// links: datagrams in reassembly from pieces; more: oldest lost
    udp_link_reassembly_bytes: int = 1048576  # udp:// links: fragment bytes held for reassembly per link
    udp_link_reassembly_timeout: float = 0.5  # udp:// links: seconds a datagram may wait for its pieces
    udp_link_fragment_datagrams: bool = True  # udp:// links: big datagrams in pieces; false: reliable channel
    # AEAD negotiation (udp:// links, end-to-end sessions): whether this node offers AES instructions;
    # AES-256-GCM where both ends do, else ChaCha20-Poly1305. auto: from /proc/cpuinfo; yes | no
    aes_instructions: str = "auto"
    tun_read_batch: int = 256  # packets read from the TUN device per loop wake-up before yielding
    tun_write_queue: int = 4096  # mesh packets queued for the TUN device within one loop tick
    # flows a TUN node with [[acl]] remembers (new ones allowed by a rule, and its own), LRU; ~300 B each
    tun_conntrack_max: int = 16384
    dns_timeout: float = 3.0
    dns_max_inflight: int = 4096
    dns_tcp_idle_timeout: float = 10.0
    dns_tcp_max_clients: int = 1024  # per DNS TCP/DoT/DoH listener
    dns_tcp_max_queries: int = 64  # pipelined queries in flight per TCP/DoT connection
    # one client address cannot hold every DoH/ODoH/DoH3/DoQ slot; 0 = a quarter of dns_tcp_max_clients (>= 4)
    dns_tcp_max_clients_per_source: int = 0
    dns_upstream_max_connections: int = 4  # pooled connections per tcp/tls/https/quic upstream
    dns_upstream_max_queries: int = 64  # queries in flight on one upstream connection (streams for h2/DoQ)
    dns_upstream_idle_timeout: float = 30.0  # an upstream connection with nothing in flight this long closes
    doh_max_streams: int = 100
    # seconds a DoH/ODoH request may take to arrive whole (header block, then body), from its first byte
    doh_request_timeout: float = 5.0
    # per-client DNS query rate on listeners with rate_limit (on by default off loopback): a token
    # bucket per client address (IPv4 /dns_client_prefix_v4, IPv6 /dns_client_prefix_v6) refilled
    # at dns_client_qps up to dns_client_burst; over it UDP answers every dns_client_slip-th query
    # with TC (0: none) and drops the rest, other transports answer REFUSED
    dns_client_qps: float = 50.0
    dns_client_burst: int = 100
    dns_client_slip: int = 2
    dns_client_prefix_v4: int = 32
    dns_client_prefix_v6: int = 56
    dns_client_table: int = 65536  # client prefixes tracked per listener; more: the idle go first
    doq_max_streams: int = 64
    doq_stream_timeout: float = 5.0
    # the udp and doh listeners' cache-hit fast path (dns/preformed.py): repeated queries answered
    # from preformed answers, at most dns_fast_path_entries per listener and process; false = every
    # query takes the general path
    dns_fast_path: bool = True
    dns_fast_path_entries: int = 4096
    buffer_pool_size: int = 1024
    admin_max_clients: int = 64
    # one source cannot hold every admin slot (70 idle connections locked the API out for 5 s)
    admin_max_clients_per_source: int = 8
    # one source cannot hold every portal slot (a browser uses at most ~32 connections per
    # proxy); 0 = a quarter of socks5.max_clients (256 of the default 1024), at least 32
    socks5_max_clients_per_source: int = 0
    memory_trim_interval: float = 10.0  # seconds between returns of freed heap to the kernel; 0 = off
    odoh_proxy_max_connections: int = 64  # pooled HTTP/2 connections from an ODoH proxy to targets
    odoh_proxy_timeout: float = 5.0  # connect + answer deadline for one forwarded ODoH query


AclSource = tuple[str, "str | IPNetwork"]  # ("*"|"node"|"group"|"cidr", value)
AclDest = tuple[str, "IPNetwork | None", tuple[tuple[int, int], ...]]  # (kind, network, port ranges)


@dataclass(frozen=True)
class AclRule:
    """One [[acl]] rule (egress/acl.py): who may reach what, by which protocol."""

    sources: tuple[AclSource, ...]
    dests: tuple[AclDest, ...]
    proto: str = "any"


@dataclass(frozen=True)
class Config:
    node: NodeConfig = NodeConfig()
    mesh: MeshConfig = MeshConfig()
    exit: ExitConfig = ExitConfig()
    socks5: Socks5Config = Socks5Config()
    dns: DnsConfig = DnsConfig()
    tun: TunConfig = TunConfig()
    admin: AdminConfig = AdminConfig()
    limits: LimitsConfig = LimitsConfig()
    log_level: str = "info"
    http_proxy: HttpProxyConfig = HttpProxyConfig()
    # [serve]: what the mesh reaches at this node's virtual IPs, port -> local address;
    # nothing is published by default (a virtual IP is not the node's whole loopback)
    serve: tuple[tuple[int, HostPort], ...] = ()
    acl: tuple[AclRule, ...] = ()  # [[acl]]: none = every member reaches what the node serves

    @property
    def state_path(self) -> Path:
        return Path(os.path.expanduser(self.node.state_dir))


# --------------------------------------------------------------------------- parsers
# Each parser takes the raw TOML value and returns the typed value or raises
# ValueError with a message for the user (never echoing secrets).

T = TypeVar("T")


def parse_host_port(value: object, default_port: int | None = None) -> HostPort:
    if not isinstance(value, str):
        raise ValueError(f"expected a string like \"127.0.0.1:1080\", got {type(value).__name__}")
    text = value.strip()
    host: str
    port_text: str | None
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            raise ValueError(f"unclosed '[' in address {value!r}")
        host = text[1:end]
        rest = text[end + 1 :]
        if rest and not rest.startswith(":"):
            raise ValueError(f"expected ':PORT' after ']' in {value!r}")
        port_text = rest[1:] if rest else None
    elif text.count(":") == 1:
        host, port_text = text.split(":")
    elif text.count(":") > 1:
        host, port_text = text, None  # bare IPv6 literal
    else:
        host, port_text = text, None
    if port_text is None:
        if default_port is None:
            raise ValueError(f"address {value!r} has no port")
        port = default_port
    else:
        if not port_text.isdigit():
            raise ValueError(f"port {port_text!r} in {value!r} is not a number")
        port = int(port_text)
    if not 0 <= port <= 65535:
        raise ValueError(f"port {port} in {value!r} is out of range 0-65535")
    if not host:
        raise ValueError(f"address {value!r} has no host")
    if ":" in host:
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"{host!r} is not a valid IPv6 address") from None
    return HostPort(host, port)


def parse_link_url(value: object) -> LinkUrl:
    if not isinstance(value, str):
        raise ValueError(f"expected a URL string like \"tcp://host:11010\", got {type(value).__name__}")
    scheme, sep, rest = value.partition("://")
    if not sep:
        raise ValueError(f"{value!r} is not a URL; expected scheme://host:port")
    if scheme not in LINK_SCHEMES:
        raise ValueError(f"unknown link scheme {scheme!r}; expected one of {', '.join(LINK_SCHEMES)}")
    if scheme == "ring":
        if not rest:
            raise ValueError("ring:// needs a name")
        return LinkUrl("ring", rest, 0)
    hp = parse_host_port(rest, default_port=11010)
    return LinkUrl(scheme, hp.host, hp.port)


def parse_network(value: object) -> IPNetwork:
    if not isinstance(value, str):
        raise ValueError(f"expected a CIDR string, got {type(value).__name__}")
    try:
        return ipaddress.ip_network(value.strip(), strict=True)
    except ValueError as e:
        raise ValueError(f"{value!r} is not a valid CIDR ({e})") from None


def parse_proxy_cidr(value: object) -> ProxyCidr:
    if not isinstance(value, str):
        raise ValueError(f"expected \"CIDR\" or \"REAL->MAPPED\", got {type(value).__name__}")
    if "->" in value:
        real_text, mapped_text = value.split("->", 1)
        real, mapped = parse_network(real_text), parse_network(mapped_text)
        if real.version != mapped.version or real.prefixlen != mapped.prefixlen:
            raise ValueError(
                f"{value!r}: mapped CIDR must have the same IP version and prefix length as the real one"
            )
        return ProxyCidr(real, mapped)
    return ProxyCidr(parse_network(value))


def _parse_bool(value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"expected true or false, got {value!r}")
    return value


def _parse_str(value: object) -> str:
    if not isinstance(value, str):
        raise ValueError(f"expected a string, got {type(value).__name__}")
    return value


def _parse_nonempty_str(value: object) -> str:
    s = _parse_str(value)
    if not s.strip():
        raise ValueError("must not be empty")
    return s


def _positive_int(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"expected a whole number, got {value!r}")
    if value <= 0:
        raise ValueError(f"must be positive, got {value}")
    return value


def _dns_workers(value: object) -> int:
    if value == "auto":
        return os.cpu_count() or 1
    n = _positive_int(value)
    if n > 64:
        raise ValueError(f"at most 64 worker processes, got {n}")
    return n


def _positive_float(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"expected a number, got {value!r}")
    if value <= 0:
        raise ValueError(f"must be positive, got {value}")
    return float(value)


def _choice(*choices: str) -> Callable[[object], str]:
    def parse(value: object) -> str:
        s = _parse_str(value)
        if s not in choices:
            raise ValueError(f"{s!r} is not one of {', '.join(choices)}")
        return s

    return parse


def _ipv4_iface(value: object) -> ipaddress.IPv4Interface:
    s = _parse_str(value)
    try:
        iface = ipaddress.IPv4Interface(s)
    except ValueError:
        raise ValueError(f"{s!r} is not an IPv4 address with prefix, like 10.144.144.1/24") from None
    return iface


def _ipv6_iface(value: object) -> ipaddress.IPv6Interface:
    s = _parse_str(value)
    try:
        return ipaddress.IPv6Interface(s)
    except ValueError:
        raise ValueError(f"{s!r} is not an IPv6 address with prefix, like fd00:144::1/64") from None


def _exit_node_ref(value: object) -> str:
    s = _parse_str(value)
    if s == "auto":
        return s
    try:
        return str(ipaddress.ip_address(s))
    except ValueError:
        raise ValueError(f"{s!r} is neither \"auto\" nor a virtual IP address") from None


def _upstream(value: object) -> str:
    s = _parse_str(value)
    scheme, sep, _ = s.partition("://")
    if not sep or scheme not in UPSTREAM_SCHEMES:
        *first, last = (f"{x}://" for x in UPSTREAM_SCHEMES)
        raise ValueError(f"{s!r}: expected {', '.join(first)} or {last} URL")
    return s


# --------------------------------------------------------------------------- the walker


class _Reader:
    """Reads one table, recording problems under dotted keys."""

    def __init__(self, problems: list[ConfigProblem]) -> None:
        self.problems = problems

    def problem(self, key: str, message: str) -> None:
        self.problems.append(ConfigProblem(key, message))

    def table(self, raw: Mapping[str, Any], prefix: str, known: list[str]) -> None:
        for k in raw:
            if k not in known:
                hint = difflib.get_close_matches(k, known, n=1)
                suggestion = f"; did you mean {hint[0]!r}?" if hint else ""
                self.problem(f"{prefix}{k}", f"unknown key{suggestion}")

    def value(
        self, raw: Mapping[str, Any], prefix: str, key: str, parse: Callable[[object], T], default: T
    ) -> T:
        if key not in raw:
            return default
        try:
            return parse(raw[key])
        except ValueError as e:
            self.problem(f"{prefix}{key}", str(e))
            return default

    def items(
        self, raw: Mapping[str, Any], prefix: str, key: str, parse: Callable[[object], T]
    ) -> tuple[T, ...] | None:
        if key not in raw:
            return None
        value = raw[key]
        if not isinstance(value, list):
            self.problem(f"{prefix}{key}", f"expected a list, got {type(value).__name__}")
            return None
        out: list[T] = []
        for i, item in enumerate(value):
            try:
                out.append(parse(item))
            except ValueError as e:
                self.problem(f"{prefix}{key}[{i}]", str(e))
        return tuple(out)

    def secret(self, raw: Mapping[str, Any], prefix: str, key: str, default: str, env: str) -> str:
        """A secret from `KEY_file` (read, stripped), else `KEY`, else $ENV, else `default`.
        The environment variable keeps it out of files and images (compose env_file); the
        file's value and then a CLI override win over it. Problems never echo the value."""
        value = self.value(raw, prefix, key, _parse_str, default or os.environ.get(env, ""))
        file_key = f"{key}_file"
        if file_key in raw:
            path = self.value(raw, prefix, file_key, _parse_nonempty_str, "")
            if path:
                try:
                    value = Path(os.path.expanduser(path)).read_text().strip()
                except OSError as e:
                    self.problem(f"{prefix}{file_key}", f"cannot read {path!r}: {e.strerror}")
        return value

    def dataclass_fields(self, raw: Mapping[str, Any], prefix: str, default: Any) -> Any:
        """Scalar sections (limits, tun): type taken from the default value."""
        known = [f.name for f in fields(default)]
        self.table(raw, prefix, known)
        changes: dict[str, Any] = {}
        for f in fields(default):
            if f.name not in raw:
                continue
            current = getattr(default, f.name)
            parser: Callable[[object], Any]
            if isinstance(current, bool):
                parser = _parse_bool
            elif isinstance(current, int):
                parser = _positive_int
            elif isinstance(current, float):
                parser = _positive_float
            else:
                parser = _parse_nonempty_str
            changes[f.name] = self.value(raw, prefix, f.name, parser, current)
        return replace(default, **changes)


def _section(r: _Reader, raw: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    value = raw.get(name, {})
    if not isinstance(value, dict):
        r.problem(name, f"expected a table [{name}], got {type(value).__name__}")
        return {}
    return value


def _read_users(value: object) -> User:
    if not isinstance(value, dict):
        raise ValueError("expected { name = \"...\", password = \"...\" }")
    extra = set(value) - {"name", "password"}
    if extra:
        raise ValueError(f"unknown field(s) {', '.join(sorted(extra))}; expected name and password")
    name, password = value.get("name"), value.get("password")
    if not isinstance(name, str) or not 1 <= len(name.encode()) <= 255:
        raise ValueError("name must be a string of 1-255 bytes (RFC 1929)")
    if not isinstance(password, str) or not 1 <= len(password.encode()) <= 255:
        raise ValueError(f"password for user {name!r} must be a string of 1-255 bytes (RFC 1929)")
    return User(name, password)


_LISTENER_KEYS = [
    "protocol", "listen", "cert", "key", "path", "mode", "key_seed", "allow_doh",
    "key_rotation", "targets", "allow_ip_targets", "rate_limit",
]


def _read_listener(r: _Reader, raw: object, prefix: str) -> DnsListenerConfig | None:
    if not isinstance(raw, dict):
        r.problem(prefix.rstrip("."), "expected a table [[dns.listener]]")
        return None
    r.table(raw, prefix, _LISTENER_KEYS)
    if "protocol" not in raw:
        r.problem(f"{prefix}protocol", f"required; one of {', '.join(DNS_PROTOCOLS)}")
        return None
    protocol = r.value(raw, prefix, "protocol", _choice(*DNS_PROTOCOLS), "")
    if not protocol:
        return None
    default_port = DNS_LISTENER_KINDS[protocol].default_port
    listen = r.value(
        raw, prefix, "listen", lambda v: parse_host_port(v, default_port), HostPort("127.0.0.1", default_port)
    )
    cert = r.value(raw, prefix, "cert", _parse_nonempty_str, None)
    key = r.value(raw, prefix, "key", _parse_nonempty_str, None)
    if (cert is None) != (key is None):
        missing = "key" if key is None else "cert"
        r.problem(f"{prefix}{missing}", "cert and key go together; set both or neither")
    path = r.value(raw, prefix, "path", _parse_str, "/dns-query")
    if not path.startswith("/"):
        r.problem(f"{prefix}path", f"{path!r} must start with '/'")
    key_seed = r.value(raw, prefix, "key_seed", _parse_str, None)
    if key_seed is not None:
        try:
            if len(bytes.fromhex(key_seed)) < 16:
                r.problem(f"{prefix}key_seed", "must be at least 16 bytes (32 hex digits)")
        except ValueError:
            r.problem(f"{prefix}key_seed", "must be hex digits")
    return DnsListenerConfig(
        protocol=protocol,
        listen=listen,
        cert=cert,
        key=key,
        path=path,
        mode=r.value(raw, prefix, "mode", _choice(*ODOH_MODES), "target"),
        key_seed=key_seed,
        allow_doh=r.value(raw, prefix, "allow_doh", _parse_bool, False),
        key_rotation=r.value(raw, prefix, "key_rotation", _positive_float, 86400.0),
        targets=r.items(raw, prefix, "targets", _parse_nonempty_str) or (),
        allow_ip_targets=r.value(raw, prefix, "allow_ip_targets", _parse_bool, False),
        rate_limit=r.value(raw, prefix, "rate_limit", _parse_bool, None),
    )


def _normalize_zone(zone: str) -> str:
    return zone.lower().rstrip(".") + "."


def dns_suffix(value: object) -> str:
    s = _parse_nonempty_str(value)
    name = _normalize_zone(s.strip())
    if name == ".":
        raise ValueError(f"{s!r} is the root, which dns.upstreams already serves")
    labels = name[:-1].split(".")
    if any(not 1 <= len(label.encode()) <= 63 for label in labels) or len(name) > 254:
        raise ValueError(f"{s!r} is not a domain name: labels of 1-63 bytes, 253 in all")
    if any(c.isspace() or c == "/" for c in name) or not name.isascii():
        raise ValueError(f"{s!r} is not a domain name: ASCII (IDNA's xn-- form), no spaces or slashes")
    return name


def _list_path(value: object) -> str:
    s = _parse_nonempty_str(value).strip()
    scheme, sep, rest = s.partition("://")
    if sep and scheme.lower() in ("http", "https"):
        if not rest.split("/", 1)[0]:
            raise ValueError(f"{s!r}: a URL needs a host")
        return s  # downloaded in the background (dns/blocklist_url.py)
    if sep:
        raise ValueError(f"{s!r}: expected the path of a file or an http(s) URL")
    return os.path.expanduser(s)


def _read_blocklist(r: _Reader, d: Mapping[str, Any], base: DnsBlocklistConfig) -> DnsBlocklistConfig:
    b = d["blocklist"]
    if not isinstance(b, dict):
        r.problem("dns.blocklist", "expected a table [dns.blocklist]")
        return base
    r.table(b, "dns.blocklist.", ["lists", "allow", "answer", "refresh", "fetch_timeout", "max_bytes",
                                  "rebinding"])
    cfg = DnsBlocklistConfig(
        lists=r.items(b, "dns.blocklist.", "lists", _list_path) or (),
        allow=r.items(b, "dns.blocklist.", "allow", _list_path) or (),
        answer=r.value(b, "dns.blocklist.", "answer", _choice(*BLOCKLIST_ANSWERS), base.answer),
        refresh=r.value(b, "dns.blocklist.", "refresh", _positive_float, base.refresh),
        fetch_timeout=r.value(b, "dns.blocklist.", "fetch_timeout", _positive_float, base.fetch_timeout),
        max_bytes=r.value(b, "dns.blocklist.", "max_bytes", _positive_int, base.max_bytes),
        rebinding=r.value(b, "dns.blocklist.", "rebinding", _parse_bool, base.rebinding),
    )
    if cfg.allow and not cfg.lists:
        r.problem("dns.blocklist.lists", "required with dns.blocklist.allow: the lists the allow files"
                  " make exceptions to")
    return cfg


def _read_query_log(r: _Reader, d: Mapping[str, Any], base: DnsQueryLogConfig) -> DnsQueryLogConfig:
    q = d["query_log"]
    if not isinstance(q, dict):
        r.problem("dns.query_log", "expected a table [dns.query_log]")
        return base
    r.table(q, "dns.query_log.", ["enable", "size", "path", "max_bytes", "keep", "client_ip", "queue"])
    size = r.value(q, "dns.query_log.", "size", _positive_int, base.size)
    if size > QUERY_LOG_MAX:
        r.problem("dns.query_log.size", f"{size} is more than {QUERY_LOG_MAX}")
        size = base.size
    queue = r.value(q, "dns.query_log.", "queue", _positive_int, base.queue)
    if queue > QUERY_LOG_MAX:
        r.problem("dns.query_log.queue", f"{queue} is more than {QUERY_LOG_MAX}")
        queue = base.queue
    keep = r.value(q, "dns.query_log.", "keep", _positive_int, base.keep)
    if keep > QUERY_LOG_KEEP_MAX:
        r.problem("dns.query_log.keep", f"{keep} is more than {QUERY_LOG_KEEP_MAX}")
        keep = base.keep
    path = os.path.expanduser(r.value(q, "dns.query_log.", "path", _parse_str, base.path).strip())
    enable = r.value(q, "dns.query_log.", "enable", _parse_bool, base.enable)
    if path and not enable:
        r.problem("dns.query_log.path", "needs dns.query_log.enable = true")
    return DnsQueryLogConfig(
        enable=enable, size=size, path=path, queue=queue, keep=keep,
        max_bytes=r.value(q, "dns.query_log.", "max_bytes", _positive_int, base.max_bytes),
        client_ip=r.value(q, "dns.query_log.", "client_ip", _choice(*QUERY_LOG_CLIENT_IP), base.client_ip))


QUERY_LOG_MAX = 1_000_000
QUERY_LOG_KEEP_MAX = 100
QUERY_LOG_CLIENT_IP = ("full", "anonymized", "none")


MAX_SERVE_SUFFIXES = 16  # what a route record carries (mesh/routing.py)


def _read_serve_suffixes(
    r: _Reader, d: Mapping[str, Any], zone: str, base: tuple[str, ...]
) -> tuple[str, ...]:
    if "serve_suffixes" not in d:
        return base
    got = r.items(d, "dns.", "serve_suffixes", dns_suffix) or ()
    out: list[str] = []
    for suffix in got:
        if suffix == zone or suffix.endswith("." + zone) or zone.endswith("." + suffix):
            r.problem("dns.serve_suffixes",
                      f"{suffix!r} overlaps dns.zone {zone!r}: every node answers the mesh zone")
        elif suffix not in out:
            out.append(suffix)
    if len(out) > MAX_SERVE_SUFFIXES:
        r.problem("dns.serve_suffixes", f"{len(out)} suffixes: at most {MAX_SERVE_SUFFIXES}")
        return base
    return tuple(out)


def _read_routes(r: _Reader, d: Mapping[str, Any], zone: str) -> list[DnsRouteConfig]:
    raw_routes = d["route"]
    if not isinstance(raw_routes, list):
        r.problem("dns.route", "expected [[dns.route]] tables")
        return []
    routes: list[DnsRouteConfig] = []
    seen: dict[str, int] = {}
    for i, raw in enumerate(raw_routes):
        prefix = f"dns.route[{i}]."
        if not isinstance(raw, dict):
            r.problem(f"dns.route[{i}]", "expected a table [[dns.route]]")
            continue
        r.table(raw, prefix, ["suffix", "upstreams"])
        if "suffix" not in raw:
            r.problem(f"{prefix}suffix", "required: the domain whose names go to this route's upstreams")
        suffix = r.value(raw, prefix, "suffix", dns_suffix, "")
        upstreams = r.items(raw, prefix, "upstreams", _upstream)
        if "upstreams" not in raw or (upstreams is not None and not raw["upstreams"]):
            r.problem(f"{prefix}upstreams", "required: a list of one or more upstream URLs")
        if not suffix:
            continue
        if suffix == zone or suffix.endswith("." + zone):
            r.problem(f"{prefix}suffix",
                      f"{suffix!r} is in dns.zone {zone!r}: the mesh zone answers those names")
            continue
        if suffix in seen:
            r.problem(f"{prefix}suffix", f"{suffix!r} is also dns.route[{seen[suffix]}].suffix")
            continue
        seen[suffix] = i
        if upstreams:
            routes.append(DnsRouteConfig(suffix, upstreams))
    return routes


def from_dict(raw: Mapping[str, Any], base: Config | None = None) -> Config:
    """Build a Config from parsed TOML; raises ConfigError listing every problem."""
    base = base or Config()
    problems: list[ConfigProblem] = []
    r = _Reader(problems)
    r.table(raw, "", ["node", "mesh", "exit", "socks5", "http_proxy", "dns", "tun", "admin", "limits",
                      "serve", "acl",
                      "log_level"])

    n = _section(r, raw, "node")
    r.table(n, "node.", ["name", "network", "secret", "secret_file", "ipv4", "ipv6", "state_dir",
                         "certificate", "ca", "revocation_list", "require_certificates"])
    # MESHGATE_SECRET keeps the secret out of files and images (compose env_file);
    # the file's secret / secret_file and then --secret win over it.
    secret = r.secret(n, "node.", "secret", base.node.secret, "MESHGATE_SECRET")
    ca_files = base.node.ca  # node.ca: one path, or a list while a CA is rotated
    if isinstance(n.get("ca"), list):
        ca_files = r.items(n, "node.", "ca", _parse_nonempty_str) or ()
    elif "ca" in n:
        ca_files = tuple(x for x in (r.value(n, "node.", "ca", _parse_nonempty_str, ""),) if x)
    node = NodeConfig(
        name=r.value(n, "node.", "name", _parse_nonempty_str, base.node.name),
        network=r.value(n, "node.", "network", _parse_nonempty_str, base.node.network),
        secret=secret,
        ipv4=r.value(n, "node.", "ipv4", _ipv4_iface, base.node.ipv4),
        ipv6=r.value(n, "node.", "ipv6", _ipv6_iface, base.node.ipv6),
        state_dir=r.value(n, "node.", "state_dir", _parse_nonempty_str, base.node.state_dir),
        certificate=r.value(n, "node.", "certificate", _parse_nonempty_str, base.node.certificate),
        ca=ca_files,
        revocation_list=r.value(n, "node.", "revocation_list", _parse_nonempty_str,
                                base.node.revocation_list),
        require_certificates=r.value(n, "node.", "require_certificates", _parse_bool,
                                     base.node.require_certificates),
    )
    if node.certificate and not any(node.ca):
        r.problem("node.ca", "node.certificate needs the CA certificate(s) it is checked against")
    if any(node.ca) and not node.certificate:
        r.problem("node.certificate", "node.ca is set: give this node's certificate too")
    if node.certificate and not node.require_certificates and not node.secret:
        r.problem("node.require_certificates", "false links with secret-mode peers: set node.secret too")
    if any(c in node.name for c in ". /") or len(node.name) > 63:
        r.problem("node.name", f"{node.name!r} must be a DNS label: no dots, spaces or slashes, ≤ 63 chars")

    m = _section(r, raw, "mesh")
    r.table(m, "mesh.", [f.name for f in fields(MeshConfig)])
    mesh = MeshConfig(
        listen=r.items(m, "mesh.", "listen", parse_link_url) or base.mesh.listen,
        peers=r.items(m, "mesh.", "peers", parse_link_url) or base.mesh.peers,
        policy=r.value(m, "mesh.", "policy", _choice("least-hop", "least-latency"), base.mesh.policy),
        proxy_cidrs=r.items(m, "mesh.", "proxy_cidrs", parse_proxy_cidr) or base.mesh.proxy_cidrs,
        exit_node=r.value(m, "mesh.", "exit_node", _parse_bool, base.mesh.exit_node),
        exit_nodes=r.items(m, "mesh.", "exit_nodes", _exit_node_ref) or base.mesh.exit_nodes,
        direct_fallback=r.value(m, "mesh.", "direct_fallback", _parse_bool, base.mesh.direct_fallback),
        traversal=r.value(m, "mesh.", "traversal", _parse_bool, base.mesh.traversal),
        traversal_keepalive=r.value(
            m, "mesh.", "traversal_keepalive", _positive_float, base.mesh.traversal_keepalive
        ),
        traversal_idle=r.value(m, "mesh.", "traversal_idle", _positive_float, base.mesh.traversal_idle),
    )
    if (mesh.listen or mesh.peers) and not node.secret and not node.certificate:
        r.problem("node.secret", "a network secret (or node.certificate) is required when mesh.listen"
                  " or mesh.peers is set")
    if node.secret and len(node.secret) < 8 and (mesh.listen or mesh.peers):
        r.problem("node.secret", "too short; use at least 8 characters")

    x = _section(r, raw, "exit")
    r.table(x, "exit.", ["allow", "deny", "allow_private"])
    exit_cfg = ExitConfig(
        allow=r.items(x, "exit.", "allow", parse_network) or base.exit.allow,
        deny=r.items(x, "exit.", "deny", parse_network) or base.exit.deny,
        allow_private=r.value(x, "exit.", "allow_private", _parse_bool, base.exit.allow_private),
    )

    s = _section(r, raw, "socks5")
    r.table(s, "socks5.", ["enable", "listen", "users", "udp", "max_clients", "workers"])
    users = r.items(s, "socks5.", "users", _read_users)
    socks5 = Socks5Config(
        enable=r.value(s, "socks5.", "enable", _parse_bool, base.socks5.enable),
        listen=r.value(s, "socks5.", "listen", lambda v: parse_host_port(v, 1080), base.socks5.listen),
        users=users if users is not None else base.socks5.users,
        udp=r.value(s, "socks5.", "udp", _parse_bool, base.socks5.udp),
        max_clients=r.value(s, "socks5.", "max_clients", _positive_int, base.socks5.max_clients),
        workers=r.value(s, "socks5.", "workers", _dns_workers, base.socks5.workers),
    )

    hp = _section(r, raw, "http_proxy")
    r.table(hp, "http_proxy.", ["enable", "listen", "auth"])
    http_proxy = HttpProxyConfig(
        enable=r.value(hp, "http_proxy.", "enable", _parse_bool, base.http_proxy.enable),
        listen=r.value(hp, "http_proxy.", "listen", lambda v: parse_host_port(v, 8080),
                       base.http_proxy.listen),
        auth=r.value(hp, "http_proxy.", "auth", _parse_bool, base.http_proxy.auth),
    )

    d = _section(r, raw, "dns")
    r.table(d, "dns.", ["zone", "upstreams", "cache_size", "records", "listener", "workers", "route",
                          "blocklist", "query_log", "serve_suffixes", "mesh_routes",
                          "mesh_odoh_target", "mesh_odoh_proxy"])
    records_raw = d.get("records", {})
    records: list[tuple[str, str]] = []
    if not isinstance(records_raw, dict):
        r.problem("dns.records", "expected a table of name = \"address\"")
    else:
        for rname, addr in records_raw.items():
            try:
                records.append((_normalize_zone(rname), str(ipaddress.ip_address(addr))))
            except (ValueError, TypeError):
                r.problem(f"dns.records.{rname}", f"{addr!r} is not an IP address")
    listeners: list[DnsListenerConfig] = []
    if "listener" in d:
        raw_listeners = d["listener"]
        if not isinstance(raw_listeners, list):
            r.problem("dns.listener", "expected [[dns.listener]] tables")
        else:
            for i, item in enumerate(raw_listeners):
                lst = _read_listener(r, item, f"dns.listener[{i}].")
                if lst is not None:
                    listeners.append(lst)
    zone = _normalize_zone(r.value(d, "dns.", "zone", _parse_nonempty_str, base.dns.zone))
    dns = DnsConfig(
        zone=zone,
        upstreams=r.items(d, "dns.", "upstreams", _upstream) or base.dns.upstreams,
        cache_size=r.value(d, "dns.", "cache_size", _positive_int, base.dns.cache_size),
        records=tuple(records) or base.dns.records,
        listeners=tuple(listeners) if "listener" in d else base.dns.listeners,
        workers=r.value(d, "dns.", "workers", _dns_workers, base.dns.workers),
        routes=tuple(_read_routes(r, d, zone)) if "route" in d else base.dns.routes,
        blocklist=_read_blocklist(r, d, base.dns.blocklist) if "blocklist" in d else base.dns.blocklist,
        query_log=_read_query_log(r, d, base.dns.query_log) if "query_log" in d else base.dns.query_log,
        serve_suffixes=_read_serve_suffixes(r, d, zone, base.dns.serve_suffixes),
        mesh_routes=r.value(d, "dns.", "mesh_routes", _parse_bool, base.dns.mesh_routes),
        mesh_odoh_target=r.value(d, "dns.", "mesh_odoh_target", _parse_bool, base.dns.mesh_odoh_target),
        mesh_odoh_proxy=r.value(d, "dns.", "mesh_odoh_proxy", _parse_bool, base.dns.mesh_odoh_proxy),
    )

    tun = r.dataclass_fields(_section(r, raw, "tun"), "tun.", base.tun)
    if not 576 <= tun.mtu <= 65535:
        r.problem("tun.mtu", f"{tun.mtu} is outside 576-65535")
    a = _section(r, raw, "admin")
    r.table(a, "admin.", ["enable", "listen", "token", "token_file", "hosts"])
    token = r.secret(a, "admin.", "token", base.admin.token, "MESHGATE_ADMIN_TOKEN")
    if token and len(token) < 16:
        key = "admin.token_file" if "token_file" in a else "admin.token"
        r.problem(key, "too short; use at least 16 characters")
    admin = AdminConfig(
        enable=r.value(a, "admin.", "enable", _parse_bool, base.admin.enable),
        listen=r.value(a, "admin.", "listen", lambda v: parse_host_port(v, 15888), base.admin.listen),
        token=token,
        hosts=tuple(h.lower().rstrip(".") for h in r.items(a, "admin.", "hosts", _parse_nonempty_str) or ())
        or base.admin.hosts,
    )
    limits = r.dataclass_fields(_section(r, raw, "limits"), "limits.", base.limits)
    if limits.aes_instructions not in AES_INSTRUCTIONS:
        r.problem("limits.aes_instructions", f"expected one of {', '.join(AES_INSTRUCTIONS)}")
        limits = replace(limits, aes_instructions=base.limits.aes_instructions)
    log_level = r.value(
        raw, "", "log_level", _choice("debug", "info", "warning", "error"), base.log_level
    )

    serve = _read_serve(r, _section(r, raw, "serve"), base.serve)
    acl = _read_acl(r, raw["acl"]) if "acl" in raw else base.acl
    _check_ports(r, socks5, dns, admin, http_proxy)
    if problems:
        raise ConfigError(problems)
    return Config(node, mesh, exit_cfg, socks5, dns, tun, admin, limits, log_level, http_proxy, serve, acl)


def _read_acl(r: _Reader, raw: object) -> tuple[AclRule, ...]:
    if not isinstance(raw, list):
        r.problem("acl", "expected [[acl]] tables")
        return ()
    rules: list[AclRule] = []
    for i, t in enumerate(raw):
        prefix = f"acl[{i}]."
        if not isinstance(t, dict):
            r.problem(f"acl[{i}]", "expected a table with from, to and proto")
            continue
        r.table(t, prefix, ["from", "to", "proto"])
        sources = r.items(t, prefix, "from", parse_acl_source)
        dests = r.items(t, prefix, "to", parse_acl_dest)
        proto = r.value(t, prefix, "proto", _choice("tcp", "udp", "icmp", "any"), "any")
        if not sources:
            r.problem(f"{prefix}from", "required: who the rule is for, e.g. [\"group:laptops\"] or [\"*\"]")
        if not dests:
            r.problem(f"{prefix}to", "required: what it allows, e.g. [\"self:22\"] or [\"exit\"]")
        if sources and dests:
            rules.append(AclRule(sources, dests, proto))
    return tuple(rules)


def parse_acl_source(value: object) -> AclSource:
    """`*`, `node:NAME`, `group:NAME` or a CIDR (or an address) the source's virtual IP is in."""
    if not isinstance(value, str) or not value.strip():
        raise ValueError("expected \"*\", \"node:NAME\", \"group:NAME\" or a CIDR")
    text = value.strip()
    if text == "*":
        return ("*", "")
    for kind in ("node", "group"):
        if text.startswith(kind + ":"):
            name = text[len(kind) + 1:]
            if not name:
                raise ValueError(f"{text!r}: a {kind} name after the colon")
            return (kind, name)
    try:
        return ("cidr", ipaddress.ip_network(text, strict=False))
    except ValueError:
        raise ValueError(f"{text!r}: expected *, node:NAME, group:NAME or a CIDR") from None


def _parse_ports(text: str, whole: str) -> tuple[tuple[int, int], ...]:
    out = []
    for part in text.split(","):
        lo_s, _, hi_s = part.strip().partition("-")
        try:
            lo, hi = int(lo_s), int(hi_s or lo_s)
        except ValueError:
            raise ValueError(f"{whole!r}: ports are N, N-M or N,M,...") from None
        if not 1 <= lo <= hi <= 65535:
            raise ValueError(f"{whole!r}: ports 1-65535, low to high")
        out.append((lo, hi))
    return tuple(out)


def parse_acl_dest(value: object) -> AclDest:
    """`*`, `self[:PORTS]`, `exit[:PORTS]`, `CIDR[:PORTS]` (IPv6: `[CIDR]:PORTS`)."""
    if not isinstance(value, str) or not value.strip():
        raise ValueError("expected \"self:22\", \"10.1.2.0/24:80,443\", \"exit\" or \"*\"")
    text = value.strip()
    for kind in ("*", "self", "exit"):
        if text == kind:
            return (kind, None, ())
        if text.startswith(kind + ":"):
            return (kind, None, _parse_ports(text[len(kind) + 1:], text))
    ports: tuple[tuple[int, int], ...] = ()
    net_text = text
    if text.startswith("["):
        net_text, _, rest = text[1:].partition("]")
        if rest:
            if not rest.startswith(":"):
                raise ValueError(f"{text!r}: expected [CIDR]:PORTS")
            ports = _parse_ports(rest[1:], text)
    elif text.count(":") == 1:
        net_text, _, port_text = text.partition(":")
        ports = _parse_ports(port_text, text)
    try:
        return ("cidr", ipaddress.ip_network(net_text, strict=False), ports)
    except ValueError:
        raise ValueError(f"{text!r}: expected self[:PORTS], exit[:PORTS], CIDR[:PORTS] or *") from None


def _read_serve(
    r: _Reader, raw: Mapping[str, Any], base: tuple[tuple[int, HostPort], ...]
) -> tuple[tuple[int, HostPort], ...]:
    """[serve]: `8000 = "127.0.0.1:8000"`, `"22" = "127.0.0.1:22"` (TOML keys are strings)."""
    if not raw:
        return base
    out: list[tuple[int, HostPort]] = []
    for key, value in raw.items():
        if not str(key).isdigit() or not 1 <= int(key) <= 65535:
            r.problem(f"serve.{key}", "the key is a port number, 1-65535, on this node's virtual IPs")
            continue
        try:
            target = parse_host_port(value)
        except ValueError as e:
            r.problem(f"serve.{key}", f"{e} (the local address served there, e.g. \"127.0.0.1:{key}\")")
            continue
        try:
            ipaddress.ip_address(target.host)
        except ValueError:
            r.problem(f"serve.{key}", f"{target.host!r}: an IP address, not a name (e.g. 127.0.0.1)")
            continue
        out.append((int(key), target))
    return tuple(sorted(out, key=lambda x: x[0]))


def _check_ports(r: _Reader, socks5: Socks5Config, dns: DnsConfig, admin: AdminConfig,
                 http_proxy: HttpProxyConfig | None = None) -> None:
    """Two TCP listeners (or two UDP ones) on one address can never both start."""
    seen: dict[tuple[str, HostPort], str] = {}

    def claim(kind: str, hp: HostPort, key: str) -> None:
        if hp.port == 0:
            return
        prev = seen.get((kind, hp))
        if prev is not None:
            r.problem(key, f"{hp} ({kind}) is already used by {prev}")
        else:
            seen[(kind, hp)] = key

    if socks5.enable:
        claim("tcp", socks5.listen, "socks5.listen")
    if http_proxy is not None and http_proxy.enable:
        claim("tcp", http_proxy.listen, "http_proxy.listen")
    if admin.enable:
        claim("tcp", admin.listen, "admin.listen")
    for i, lst in enumerate(dns.listeners):
        claim(DNS_LISTENER_KINDS[lst.protocol].socket, lst.listen, f"dns.listener[{i}].listen")


def warnings(cfg: Config) -> list[ConfigProblem]:
    """What is allowed but unwise; check-config prints these, `meshgate run` logs them."""
    out: list[ConfigProblem] = []
    secret = cfg.node.secret
    if secret and (cfg.mesh.listen or cfg.mesh.peers):
        bits = netsecret.estimated_bits(secret)
        if bits < netsecret.WEAK_BITS:
            out.append(ConfigProblem(
                "node.secret",
                f"weak (about {bits:.0f} bits): whoever answers one of this node's dials can test"
                " guesses offline; `meshgate secret new` makes a 256-bit one",
            ))
    if cfg.admin.enable and not is_loopback(cfg.admin.listen.host) and not cfg.admin.token:
        out.append(ConfigProblem(
            "admin.listen",
            f"{cfg.admin.listen} is off loopback with no admin.token: anyone who reaches it reads"
            " the node's peers, routes and metrics; set admin.token_file",
        ))
    if cfg.socks5.enable and not is_loopback(cfg.socks5.listen.host) and not cfg.socks5.users:
        out.append(ConfigProblem(
            "socks5.listen",
            f"{cfg.socks5.listen} is off loopback with no socks5.users: anyone who reaches it"
            " uses this node (and the mesh behind it) as a proxy",
        ))
    hp = cfg.http_proxy
    if hp.enable and not is_loopback(hp.listen.host) and not (hp.auth and cfg.socks5.users):
        out.append(ConfigProblem(
            "http_proxy.listen",
            f"{hp.listen} is off loopback with no auth (http_proxy.auth and socks5.users): anyone who"
            " reaches it uses this node (and the mesh behind it) as a proxy",
        ))
    return out


def default_listeners() -> tuple[DnsListenerConfig, ...]:
    """What `meshgate run` serves with no file: DoH on 8443, plain DNS on 5353."""
    return (
        DnsListenerConfig("doh", HostPort("127.0.0.1", 8443)),
        DnsListenerConfig("udp", HostPort("127.0.0.1", 5353)),
        DnsListenerConfig("tcp", HostPort("127.0.0.1", 5353)),
    )


def default_config() -> Config:
    return Config(dns=DnsConfig(listeners=default_listeners()))


def load(path: str | os.PathLike[str] | None, overrides: Mapping[str, Any] | None = None) -> Config:
    """Load FILE (or the built-in defaults) and apply CLI overrides (a nested dict)."""
    source = str(path) if path is not None else "<defaults>"
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            with open(path, "rb") as f:
                raw = tomllib.load(f)
        except OSError as e:
            raise ConfigError([ConfigProblem("-", f"cannot read: {e.strerror}")], source) from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError([ConfigProblem("-", f"not valid TOML: {e}")], source) from None
    merged = _merge(raw, overrides or {})
    # Only the zero-config start serves DNS by default; a file that names no
    # [[dns.listener]] gets none.
    base = default_config() if path is None else Config()
    try:
        return from_dict(merged, base)
    except ConfigError as e:
        raise ConfigError(e.problems, source) from None


def _merge(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(a)
    for k, v in b.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out
