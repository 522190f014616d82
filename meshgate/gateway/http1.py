"""HTTP/1.1 proxy requests without I/O: the request head, its targets, the forwarded head.

`parse_head(buf)` returns None until the head is complete, else a `Head` and the bytes
after it; every malformed or oversized head raises `HttpError` with the status to answer
(431 for a head over `MAX_HEAD` bytes or `MAX_HEADERS` lines, 400 for the rest).
`connect_target` reads a CONNECT authority (`host:port`, `[v6]:port`), `absolute_target`
an absolute-form `http://host[:port]/path`, and `forward_head` rewrites a request for the
origin: origin-form request line, `Host` from the URL, hop-by-hop headers dropped,
`Connection: close` (one request per upstream connection).
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import re
from dataclasses import dataclass

MAX_HEAD = 16384  # bytes up to and including the blank line; browsers send 1-4 KiB
MAX_HEADERS = 100

_TOKEN = re.compile(rb"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")
_LABEL = r"[A-Za-z0-9_][A-Za-z0-9_\-]{0,62}"
_HOST = re.compile(rf"^{_LABEL}(?:\.{_LABEL})*\.?$")
# Headers that describe this hop only (RFC 9110 section 7.6.1) plus the de facto Proxy-* ones.
# Transfer-Encoding stays: the body is relayed as it came.
HOP_BY_HOP = frozenset({
    b"connection", b"proxy-connection", b"keep-alive", b"proxy-authorization",
    b"proxy-authenticate", b"te", b"trailer", b"upgrade",
})

REASONS = {
    200: "OK", 400: "Bad Request", 403: "Forbidden", 404: "Not Found", 405: "Method Not Allowed",
    407: "Proxy Authentication Required", 431: "Request Header Fields Too Large",
    502: "Bad Gateway", 504: "Gateway Timeout", 505: "HTTP Version Not Supported",
}


class HttpError(Exception):
    """A request we answer with `status` and close; `kind` labels the counter."""

    def __init__(self, status: int, kind: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind


@dataclass(frozen=True)
class Head:
    method: str
    target: str
    version: str
    headers: tuple[tuple[bytes, bytes], ...]  # (lower-cased name, value) in order

    def get(self, name: bytes) -> bytes | None:
        for k, v in self.headers:
            if k == name:
                return v
        return None


def parse_head(buf: bytes | bytearray, max_head: int = MAX_HEAD) -> tuple[Head, bytes] | None:
    end = buf.find(b"\r\n\r\n")
    sep = 4
    if end < 0:
        end = buf.find(b"\n\n")  # bare LF line ends (RFC 9112 section 2.2 allows them)
        sep = 2
    if end < 0:
        if len(buf) > max_head:
            raise HttpError(431, "header_too_large", f"request head over {max_head} bytes")
        return None
    if end + sep > max_head:
        raise HttpError(431, "header_too_large", f"request head over {max_head} bytes")
    lines = bytes(buf[:end]).replace(b"\r\n", b"\n").split(b"\n")
    while lines and not lines[0]:
        lines.pop(0)  # RFC 9112 section 2.2: ignore empty lines before the request line
    if not lines:
        raise HttpError(400, "bad_request_line", "empty request")
    parts = lines[0].split(b" ")
    if len(parts) != 3 or not parts[0] or not parts[1]:
        raise HttpError(400, "bad_request_line", "malformed request line")
    method, target, version = parts
    if not _TOKEN.match(method):
        raise HttpError(400, "bad_request_line", "malformed method")
    if version not in (b"HTTP/1.1", b"HTTP/1.0"):
        if version.startswith(b"HTTP/"):
            raise HttpError(505, "bad_version", "HTTP version not supported")
        raise HttpError(400, "bad_request_line", "malformed request line")
    if any(c <= 0x20 or c == 0x7F for c in target):
        raise HttpError(400, "bad_request_line", "malformed request target")
    if len(lines) - 1 > MAX_HEADERS:
        raise HttpError(431, "header_too_large", f"more than {MAX_HEADERS} header lines")
    headers: list[tuple[bytes, bytes]] = []
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        if not colon or not _TOKEN.match(name):
            # no colon, a space before it, or an obs-fold continuation line (400 by RFC 9112 5.2)
            raise HttpError(400, "bad_header", "malformed header line")
        value = value.strip(b" \t")
        if b"\r" in value or b"\0" in value:
            raise HttpError(400, "bad_header", "malformed header value")
        headers.append((name.lower(), value))
    head = Head(method.decode("ascii"), target.decode("ascii"), version.decode("ascii"), tuple(headers))
    return head, bytes(buf[end + sep:])


def _host(host: str) -> str:
    if host.startswith("["):
        if not host.endswith("]"):
            raise ValueError("bad IPv6 literal")
        return str(ipaddress.IPv6Address(host[1:-1]))
    if not host or len(host) > 253 or not _HOST.match(host):
        raise ValueError("bad host")
    return host


def _authority(text: str, default_port: int | None) -> tuple[str, int]:
    if "@" in text:
        raise ValueError("userinfo in authority")
    if text.startswith("["):
        close = text.find("]")
        host, rest = text[: close + 1], text[close + 1:]
        if close < 0 or (rest and not rest.startswith(":")):
            raise ValueError("bad IPv6 literal")
        port_text = rest[1:] if rest else None
    else:
        host, colon, port_text_ = text.rpartition(":")
        if not colon:
            host, port_text = text, None
        else:
            port_text = port_text_
    if port_text is None or port_text == "":
        if default_port is None:
            raise ValueError("no port")
        port = default_port
    else:
        if not port_text.isdigit() or len(port_text) > 5:
            raise ValueError("bad port")
        port = int(port_text)
    if not 1 <= port <= 65535:
        raise ValueError("port out of range")
    return _host(host), port


def connect_target(target: str) -> tuple[str, int]:
    """CONNECT's authority-form target: host and port (required)."""
    try:
        return _authority(target, None)
    except ValueError as e:
        raise HttpError(400, "bad_target", f"bad CONNECT target {target[:80]!r}: {e}") from None


def absolute_target(target: str) -> tuple[str, int, str]:
    """An absolute-form `http://authority/path?query`: host, port, origin-form path."""
    if target[:7].lower() != "http://":
        raise HttpError(400, "bad_target", f"not an http:// URL: {target[:80]!r}")
    rest = target[7:]
    cut = min((i for i in (rest.find("/"), rest.find("?"), rest.find("#")) if i >= 0), default=len(rest))
    authority, path = rest[:cut], rest[cut:]
    path = path.split("#", 1)[0]
    if not path.startswith("/"):
        path = "/" + path
    try:
        host, port = _authority(authority, 80)
    except ValueError as e:
        raise HttpError(400, "bad_target", f"bad URL authority {authority[:80]!r}: {e}") from None
    return host, port, path


def forward_head(head: Head, host: str, port: int, path: str) -> bytes:
    """The request as the origin gets it (RFC 9112 section 3.2.2, RFC 9110 section 7.6.1)."""
    listed: set[bytes] = set()
    for k, v in head.headers:
        if k in (b"connection", b"proxy-connection"):
            listed.update(t.strip().lower() for t in v.split(b",") if t.strip())
    hosttext = f"[{host}]" if ":" in host else host
    if port != 80:
        hosttext += f":{port}"
    out = [f"{head.method} {path} HTTP/1.1\r\nHost: {hosttext}\r\n".encode("ascii")]
    for k, v in head.headers:
        if k in HOP_BY_HOP or k in listed or k == b"host":
            continue
        out.append(b"%s: %s\r\n" % (k, v))
    out.append(b"Connection: close\r\n\r\n")
    return b"".join(out)


def body_length(head: Head) -> int | None:
    """The bytes of body behind a request head (RFC 9112 section 6.3): its Content-Length, 0
    without one, None with a Transfer-Encoding (chunked: relayed as it comes). A malformed or
    conflicting Content-Length is a 400 (a smuggling vector between proxy and origin)."""
    if head.get(b"transfer-encoding") is not None:
        return None
    values = {v.strip() for k, v in head.headers if k == b"content-length"}
    if not values:
        return 0
    if len(values) > 1 or not all(v.isdigit() and len(v) <= 15 for v in values):
        raise HttpError(400, "bad_header", "malformed Content-Length")
    return int(values.pop())


def basic_credentials(value: bytes | None) -> tuple[bytes, bytes] | None:
    """`Basic base64(user:password)` -> (user, password); None for anything else."""
    if value is None:
        return None
    scheme, _, token = value.strip().partition(b" ")
    if scheme.lower() != b"basic":
        return None
    try:
        decoded = base64.b64decode(token.strip(), validate=True)
    except (binascii.Error, ValueError):
        return None
    user, colon, password = decoded.partition(b":")
    return (user, password) if colon else None


def response(status: int, headers: tuple[tuple[str, str], ...] = (), body: bytes = b"",
             close: bool = True) -> bytes:
    lines = [f"HTTP/1.1 {status} {REASONS.get(status, 'Error')}"]
    lines.extend(f"{k}: {v}" for k, v in headers)
    lines.append(f"Content-Length: {len(body)}")
    if close:
        lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("ascii") + body
