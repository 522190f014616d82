"""The connect the mesh is handed for streams that leave the mesh here.

`connector(config, resolve)` serves streams that arrive from the mesh, and
the portal's own traffic when this node is itself the owner or the exit, so
both obey one policy (egress/rules.py): names resolve here, every address
is checked after resolution, and a refusal is reply 0x02.

`local_connect(own_ips)` connects anything from this host with no policy:
what an in-process test mesh uses.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from meshgate import replies
from meshgate.config import Config
from meshgate.egress.acl import Source
from meshgate.egress.rules import ExitRules
from meshgate.logs import RateLimitedLog
from meshgate.mesh.splice import EgressConnect, ProtocolFactory
from meshgate.mesh.streams import StreamError
from meshgate.metrics import REGISTRY
from meshgate.policy import IPAddress, parse_ip

log = logging.getLogger("meshgate.egress")
_rlog = RateLimitedLog(log)
_refused = REGISTRY.counter(
    "meshgate_egress_refused_total", "Egress refused by policy where traffic leaves the mesh", ("reason",)
)
_acl_denied = REGISTRY.counter(
    "meshgate_acl_denied_total", "Connections from the mesh no [[acl]] rule allows", ("proto",)
)
_egress = REGISTRY.counter("meshgate_egress_connects_total", "Egress connections by outcome", ("outcome",))

# host, port -> the addresses to try (raises a ReplyError such as DialError when there are none)
Resolve = Callable[[str, int], Awaitable[list[IPAddress]]]


def connector(
    config: Config, resolve: Resolve, timeout: float | None = None, rules: ExitRules | None = None,
    identify: Callable[[int], Source] | None = None,
) -> EgressConnect:
    """The policy-checked egress for this node's config (checked against `rules`, made from the
    config when not given: the node hands its own so a reload can change `[exit]`)."""
    if rules is None:
        rules = ExitRules(config)
    connect_timeout = timeout if timeout is not None else config.limits.socks5_connect_timeout

    def admitted(source: int, dest: IPAddress | None, host: str, port: int) -> bool:
        """[[acl]]: may `source` (a node, authenticated; 0 = our own users) reach this?"""
        if not source or not rules.acl.active:
            return True
        src = identify(source) if identify is not None else Source(source)
        if rules.acl.decide(src, dest, port, "tcp").allowed:
            return True
        _acl_denied.labels("tcp").inc()
        _rlog.debug(f"acl:{source}:{host}", "access rules: %s (%08x) may not reach %s:%d over tcp",
                    src.name or "?", source, host, port)
        return False

    async def connect(
        host: str, port: int, factory: ProtocolFactory, source: int = 0
    ) -> tuple[asyncio.BaseTransport, Any]:
        loop = asyncio.get_running_loop()
        ip = parse_ip(host)
        if ip is not None and ip in rules.own_ips:
            if not admitted(source, None, host, port):
                raise StreamError(replies.NOT_ALLOWED, f"access rules refuse {host}:{port} ([[acl]])")
            # The node's own virtual IP: only what [serve] publishes there
            served = rules.served_target(port)
            if served is None:
                _refused.labels("not_served").inc()
                _rlog.debug(f"not_served:{port}", "connection to %s:%d refused: not published ([serve])",
                            host, port)
                raise StreamError(replies.NOT_ALLOWED, f"port {port} is not published on {host} ([serve])")
            return await _connect_one(loop, factory, served[0], served[1], host, connect_timeout)
        if ip is not None:
            addrs = [rules.translate(ip)]
        else:
            try:
                addrs = await resolve(host, port)
            except replies.ReplyError as e:
                raise StreamError(e.code, str(e)) from None
        if not addrs:
            raise StreamError(replies.HOST_UNREACHABLE, f"no address for {host!r}")
        allowed: list[IPAddress] = []
        reason = ""
        for a in addrs:
            why = rules.check(a)
            if why is None:
                allowed.append(a)
            else:
                reason = reason or why
        if allowed and not admitted(source, allowed[0], host, port):
            raise StreamError(replies.NOT_ALLOWED, f"access rules refuse {host}:{port} ([[acl]])")
        if not allowed:
            _refused.labels("policy").inc()
            _rlog.debug(f"refused:{host}", "egress to %s:%d refused: %s", host, port, reason)
            raise StreamError(replies.NOT_ALLOWED, f"egress to {host}:{port} refused: {reason}")
        last: StreamError | None = None
        for a in allowed:
            try:
                return await _connect_one(loop, factory, str(a), port, host, connect_timeout)
            except StreamError as e:
                last = e
        assert last is not None
        raise last

    return connect


def local_connect(own_ips: set[str], timeout: float = 10.0) -> EgressConnect:
    """Connect from this host with no policy; the node's own virtual IPs mean 127.0.0.1 / ::1."""

    async def connect(
        host: str, port: int, factory: ProtocolFactory, source: int = 0
    ) -> tuple[asyncio.BaseTransport, Any]:
        target = host
        if host in own_ips:
            target = "::1" if ipaddress.ip_address(host).version == 6 else "127.0.0.1"
        try:
            return await asyncio.wait_for(asyncio.get_running_loop().create_connection(factory, target, port),
                                          timeout)
        except (OSError, TimeoutError) as e:
            raise StreamError(replies.for_exception(e), f"connect to {host}:{port} failed: {e}") from None

    return connect


async def _connect_one(
    loop: asyncio.AbstractEventLoop, factory: ProtocolFactory, target: str, port: int, asked: str,
    timeout: float,
) -> tuple[asyncio.BaseTransport, Any]:
    try:
        result = await asyncio.wait_for(loop.create_connection(factory, target, port), timeout)
    except TimeoutError:
        _egress.labels("timeout").inc()
        raise StreamError(replies.TTL_EXPIRED, f"connect to {asked}:{port} timed out") from None
    except OSError as e:
        _egress.labels("error").inc()
        reason = e.strerror or e
        raise StreamError(replies.for_exception(e), f"connect to {asked}:{port} failed: {reason}") from None
    _egress.labels("ok").inc()
    return result
