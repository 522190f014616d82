"""Reply codes for a connection that could not be made, and the one map from
what really happened (an OSError, a timeout, a failed lookup) to a code.

The codes are SOCKS5's (RFC 1928 section 6). A mesh stream reset carries the
same code (docs/PROTOCOL.md section 5), so the portal passes it straight on,
and the egress side of a stream, the dialer and the portal all map failures
through `for_exception`.
"""

from __future__ import annotations

import errno
import socket

SUCCEEDED = 0x00
GENERAL_FAILURE = 0x01
NOT_ALLOWED = 0x02
NETWORK_UNREACHABLE = 0x03
HOST_UNREACHABLE = 0x04
REFUSED = 0x05
TTL_EXPIRED = 0x06
COMMAND_NOT_SUPPORTED = 0x07
ATYP_NOT_SUPPORTED = 0x08

# Metric label values (meshgate_socks5_connects_total and the stream counters).
NAMES = {
    SUCCEEDED: "succeeded",
    GENERAL_FAILURE: "general_failure",
    NOT_ALLOWED: "not_allowed",
    NETWORK_UNREACHABLE: "network_unreachable",
    HOST_UNREACHABLE: "host_unreachable",
    REFUSED: "connection_refused",
    TTL_EXPIRED: "ttl_expired",
    COMMAND_NOT_SUPPORTED: "command_not_supported",
    ATYP_NOT_SUPPORTED: "address_type_not_supported",
}

# The same in words, for messages and the mesh stream counters' labels.
WORDS = {
    GENERAL_FAILURE: "general failure",
    NOT_ALLOWED: "not allowed",
    NETWORK_UNREACHABLE: "network unreachable",
    HOST_UNREACHABLE: "host unreachable",
    REFUSED: "connection refused",
    TTL_EXPIRED: "TTL expired / timeout",
}

_ERRNO = {
    errno.ECONNREFUSED: REFUSED,
    errno.ENETUNREACH: NETWORK_UNREACHABLE,
    errno.ENETDOWN: NETWORK_UNREACHABLE,
    errno.EHOSTUNREACH: HOST_UNREACHABLE,
    errno.EHOSTDOWN: HOST_UNREACHABLE,
    errno.EADDRNOTAVAIL: HOST_UNREACHABLE,
    errno.ETIMEDOUT: TTL_EXPIRED,
    errno.EACCES: NOT_ALLOWED,  # a local firewall or an EPERM from a socket mark
    errno.EPERM: NOT_ALLOWED,
}


class ReplyError(Exception):
    """A failure that already knows its reply code (a mesh stream reset, a dial refusal)."""

    def __init__(self, code: int, message: str = "") -> None:
        super().__init__(message or WORDS.get(code, f"code {code}"))
        self.code = code


def for_exception(exc: BaseException) -> int:
    """The reply code for a failed connect, lookup or stream open."""
    if isinstance(exc, ReplyError):
        return exc.code
    if isinstance(exc, TimeoutError):
        return TTL_EXPIRED
    if isinstance(exc, socket.gaierror):
        return HOST_UNREACHABLE
    if isinstance(exc, OSError) and exc.errno is not None:
        return _ERRNO.get(exc.errno, GENERAL_FAILURE)
    return GENERAL_FAILURE
