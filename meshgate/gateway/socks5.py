"""SOCKS5 server protocol core, sans-I/O (RFC 1928, RFC 1929).

Bytes in (`receive_data`), events and bytes out (`next_event`,
`data_to_send`); no sockets, no clock. The asyncio adapter in `server.py`
owns timeouts, dialing and relaying.

Protocol errors raise `Socks5Error`. Before raising, the core has already
queued whatever the RFC says to answer (a reply with the right code, the
0xFF method rejection, the RFC 1929 failure status), so the adapter's rule is
uniform: flush `data_to_send()`, then close. `Socks5Error.reply` is the reply
code that was sent, or None when the right answer was only to close.

UDP datagram headers (RFC 1928 section 7) are parsed and built here too, on
`bytes`/`memoryview` without formatting addresses as text, so the relay's
per-packet path stays free of string work.
"""

from __future__ import annotations

import hmac
import socket
from collections.abc import Mapping
from dataclasses import dataclass

from meshgate import replies

VERSION = 5

# Methods (RFC 1928 section 3).
METHOD_NO_AUTH = 0x00
METHOD_USERPASS = 0x02
METHOD_NO_ACCEPTABLE = 0xFF

# Commands.
CMD_CONNECT = 0x01
CMD_BIND = 0x02
CMD_UDP_ASSOCIATE = 0x03

# Address types.
ATYP_IPV4 = 0x01
ATYP_DOMAIN = 0x03
ATYP_IPV6 = 0x04

# Reply codes (RFC 1928 section 6): the one table is meshgate/replies.py; the
# REP_ names are the protocol's own spelling of it.
REP_SUCCEEDED = replies.SUCCEEDED
REP_GENERAL_FAILURE = replies.GENERAL_FAILURE
REP_NOT_ALLOWED = replies.NOT_ALLOWED
REP_NETWORK_UNREACHABLE = replies.NETWORK_UNREACHABLE
REP_HOST_UNREACHABLE = replies.HOST_UNREACHABLE
REP_CONNECTION_REFUSED = replies.REFUSED
REP_TTL_EXPIRED = replies.TTL_EXPIRED
REP_COMMAND_NOT_SUPPORTED = replies.COMMAND_NOT_SUPPORTED
REP_ATYP_NOT_SUPPORTED = replies.ATYP_NOT_SUPPORTED
REPLY_NAMES = replies.NAMES

# RFC 1929 sub-negotiation.
USERPASS_VERSION = 0x01
AUTH_OK = b"\x01\x00"
AUTH_FAILED = b"\x01\x01"

# The longest well-formed message is the RFC 1929 request (1+1+255+1+255);
# anything buffered beyond this before the request completes is not SOCKS.
MAX_HANDSHAKE_BYTES = 515

# The largest SOCKS UDP header: RSV(2) FRAG(1) ATYP(1) LEN(1) NAME(255) PORT(2).
MAX_UDP_HEADER = 262


class Socks5Error(Exception):
    """A protocol violation. `reply` is the SOCKS reply code already queued, or None.

    `kind` names the counter the adapter bumps: "version", "method", "auth",
    "bad_request", "command", "address_type".
    """

    def __init__(self, message: str, reply: int | None, kind: str) -> None:
        super().__init__(message)
        self.reply = reply
        self.kind = kind


# --------------------------------------------------------------------------- events


@dataclass(frozen=True, slots=True)
class MethodSelected:
    method: int


@dataclass(frozen=True, slots=True)
class Authenticated:
    username: str


@dataclass(frozen=True, slots=True)
class Request:
    """A parsed request. `addr` is the raw DST.ADDR (4 or 16 bytes, or the name)."""

    command: int
    atyp: int
    addr: bytes
    port: int

    @property
    def host(self) -> str:
        """Text form for the dialer and logs (not used on per-packet paths)."""
        return address_text(self.atyp, self.addr)


Event = MethodSelected | Authenticated | Request


def address_text(atyp: int, addr: bytes) -> str:
    if atyp == ATYP_IPV4:
        return socket.inet_ntop(socket.AF_INET, addr)
    if atyp == ATYP_IPV6:
        return socket.inet_ntop(socket.AF_INET6, addr)
    return addr.decode("ascii")


# --------------------------------------------------------------------------- the state machine

_GREETING, _AUTH, _REQUEST, _DONE, _FAILED = range(5)
_NO_USERS: Mapping[bytes, bytes] = {}


class ServerConnection:
    """One client's handshake: greeting, optional RFC 1929 auth, one request.

    `users` maps username bytes to password bytes; empty means no
    authentication. After the `Request` event, any bytes the client sent
    behind it (optimistic data) are available from `trailing_data()`.
    """

    __slots__ = ("_buf", "_out", "_state", "_users", "username")

    def __init__(self, users: Mapping[bytes, bytes] | None = None) -> None:
        # not copied: one per connection, and the server replaces its users mapping on a reload
        # rather than changing it, so a handshake under way keeps the users it started with
        self._users = users if users is not None else _NO_USERS
        self._buf = bytearray()
        self._out = bytearray()
        self._state = _GREETING
        self.username: str | None = None

    @property
    def done(self) -> bool:
        return self._state == _DONE

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        if self._state == _FAILED:
            return
        self._buf += data

    def data_to_send(self) -> bytes:
        out = bytes(self._out)
        self._out.clear()
        return out

    def resume(self, trailing: bytes) -> None:
        """Continue a handshake another process completed (a SOCKS worker's hand-over): the
        request is in, `trailing` is what the client sent behind it."""
        self._state = _DONE
        self._buf = bytearray(trailing)

    def trailing_data(self) -> bytes:
        out = bytes(self._buf)
        self._buf.clear()
        return out

    def _fail(self, message: str, kind: str, reply: int | None = None, send: bytes = b"") -> Socks5Error:
        self._state = _FAILED
        self._buf.clear()
        if send:
            self._out += send
        elif reply is not None:
            self._out += build_reply(reply)
        return Socks5Error(message, reply, kind)

    def next_event(self) -> Event | None:
        """The next complete event, or None if more bytes are needed."""
        if self._state == _GREETING:
            return self._greeting()
        if self._state == _AUTH:
            return self._auth()
        if self._state == _REQUEST:
            return self._request()
        return None

    def _greeting(self) -> Event | None:
        buf = self._buf
        if not buf:
            return None
        if buf[0] != VERSION:
            raise self._fail(f"not SOCKS5 (version byte {buf[0]:#04x})", "version")
        if len(buf) < 2:
            return None
        n = buf[1]
        if len(buf) < 2 + n:
            return None
        offered = bytes(buf[2 : 2 + n])
        del buf[: 2 + n]
        # With users configured only username/password is acceptable; without,
        # only "no authentication" (RFC 1928 section 3: the server chooses).
        want = METHOD_USERPASS if self._users else METHOD_NO_AUTH
        if want not in offered:
            raise self._fail(
                f"no acceptable method among {offered.hex() or 'none'}",
                "method",
                send=bytes((VERSION, METHOD_NO_ACCEPTABLE)),
            )
        self._out += bytes((VERSION, want))
        self._state = _AUTH if want == METHOD_USERPASS else _REQUEST
        return MethodSelected(want)

    def _auth(self) -> Event | None:
        buf = self._buf
        if not buf:
            return None
        if buf[0] != USERPASS_VERSION:
            raise self._fail(f"bad RFC 1929 version {buf[0]:#04x}", "auth", send=AUTH_FAILED)
        if len(buf) < 2:
            return None
        ulen = buf[1]
        if len(buf) < 3 + ulen:
            return None
        plen = buf[2 + ulen]
        end = 3 + ulen + plen
        if len(buf) < end:
            return None
        uname = bytes(buf[2 : 2 + ulen])
        passwd = bytes(buf[3 + ulen : end])
        del buf[:end]
        if not self._check(uname, passwd):
            # Never echo the password; the username is safe to log (escaped).
            raise self._fail(
                f"authentication failed for user {uname[:64]!r}", "auth", send=AUTH_FAILED
            )
        self._out += AUTH_OK
        self._state = _REQUEST
        self.username = uname.decode("utf-8", "replace")
        return Authenticated(self.username)

    def _check(self, uname: bytes, passwd: bytes) -> bool:
        # Compare against every user so timing does not reveal which names
        # exist; each comparison is constant-time in its contents.
        ok = False
        for name, secret in self._users.items():
            name_ok = hmac.compare_digest(name, uname)
            pass_ok = hmac.compare_digest(secret, passwd)
            ok |= name_ok & pass_ok
        return ok

    def _request(self) -> Event | None:
        buf = self._buf
        if len(buf) < 4:
            if buf and buf[0] != VERSION:
                raise self._fail(f"request version {buf[0]:#04x}", "version", REP_GENERAL_FAILURE)
            return None
        if buf[0] != VERSION:
            raise self._fail(f"request version {buf[0]:#04x}", "version", REP_GENERAL_FAILURE)
        cmd, atyp = buf[1], buf[3]
        if atyp == ATYP_IPV4:
            end = 4 + 4 + 2
        elif atyp == ATYP_IPV6:
            end = 4 + 16 + 2
        elif atyp == ATYP_DOMAIN:
            if len(buf) < 5:
                return None
            end = 5 + buf[4] + 2
        else:
            raise self._fail(f"address type {atyp:#04x}", "address_type", REP_ATYP_NOT_SUPPORTED)
        if len(buf) < end:
            return None
        start = 5 if atyp == ATYP_DOMAIN else 4
        addr = bytes(buf[start : end - 2])
        port = (buf[end - 2] << 8) | buf[end - 1]
        del buf[:end]
        if cmd not in (CMD_CONNECT, CMD_BIND, CMD_UDP_ASSOCIATE):
            raise self._fail(f"command {cmd:#04x}", "command", REP_COMMAND_NOT_SUPPORTED)
        if atyp == ATYP_DOMAIN:
            _check_domain(addr, self)
        self._state = _DONE
        return Request(cmd, atyp, addr, port)


def _check_domain(name: bytes, conn: ServerConnection) -> None:
    # Names travel as ASCII (IDNA A-labels); anything else cannot resolve.
    if not name:
        raise conn._fail("empty domain name", "bad_request", REP_HOST_UNREACHABLE)
    if not name.isascii() or b"\x00" in name:
        raise conn._fail("domain name is not ASCII", "bad_request", REP_HOST_UNREACHABLE)


# --------------------------------------------------------------------------- replies

_ZERO_V4 = b"\x00\x00\x00\x00"


def encode_address(host: str | None, port: int) -> bytes:
    """ATYP + ADDR + PORT for an IP literal (or a name if it is not one)."""
    if not host:
        return b"\x01" + _ZERO_V4 + port.to_bytes(2, "big")
    # inet_pton, not ipaddress: this runs once per CONNECT reply.
    try:
        return b"\x01" + socket.inet_pton(socket.AF_INET, host) + port.to_bytes(2, "big")
    except OSError:
        pass
    try:
        return b"\x04" + socket.inet_pton(socket.AF_INET6, host.split("%", 1)[0]) + port.to_bytes(2, "big")
    except OSError:
        pass
    raw = host.encode("idna")
    if len(raw) > 255:
        raise ValueError(f"name too long for SOCKS: {len(raw)} bytes")
    return bytes((ATYP_DOMAIN, len(raw))) + raw + port.to_bytes(2, "big")


def build_reply(rep: int, host: str | None = None, port: int = 0) -> bytes:
    """VER REP RSV ATYP BND.ADDR BND.PORT; a failure reports 0.0.0.0:0."""
    return bytes((VERSION, rep, 0)) + encode_address(host, port)


# --------------------------------------------------------------------------- UDP headers


@dataclass(frozen=True, slots=True)
class UdpHeader:
    frag: int
    atyp: int
    addr: bytes
    port: int
    offset: int  # where the payload starts


def parse_udp_header(data: bytes | bytearray | memoryview) -> UdpHeader:
    """RSV(2) FRAG ATYP DST.ADDR DST.PORT DATA; raises Socks5Error(reply=None) on junk."""
    n = len(data)
    if n < 4:
        raise Socks5Error(f"UDP datagram of {n} bytes is shorter than a header", None, "udp_header")
    frag, atyp = data[2], data[3]
    if atyp == ATYP_IPV4:
        start, end = 4, 8
    elif atyp == ATYP_IPV6:
        start, end = 4, 20
    elif atyp == ATYP_DOMAIN:
        if n < 5:
            raise Socks5Error("UDP header truncated in the name length", None, "udp_header")
        start = 5
        end = 5 + data[4]
        if end == 5:
            raise Socks5Error("UDP header with an empty name", None, "udp_header")
    else:
        raise Socks5Error(f"UDP header address type {atyp:#04x}", None, "udp_header")
    if n < end + 2:
        raise Socks5Error("UDP header truncated", None, "udp_header")
    addr = bytes(data[start:end])
    port = (data[end] << 8) | data[end + 1]
    return UdpHeader(frag, atyp, addr, port, end + 2)


def build_udp_header(atyp: int, addr: bytes, port: int) -> bytes:
    if atyp == ATYP_DOMAIN:
        return b"\x00\x00\x00\x03" + bytes((len(addr),)) + addr + port.to_bytes(2, "big")
    return b"\x00\x00\x00" + bytes((atyp,)) + addr + port.to_bytes(2, "big")
