"""A sans-I/O HTTP/1.1 server parser (RFC 9112) for DoH and ODoH: bytes in, requests out.

`H1Wire.receive(data)` buffers bytes; `next_event()` returns the next complete event, or None
until more bytes arrive. The caller pulls events only as fast as it wants to answer them: that
is how pipelining stays bounded (bytes of requests not yet pulled stay in the buffer, and the
adapter stops reading the socket).

Events:

* `H1Request(method, target, headers, body, keep_alive)` - a complete request; header
  names lower-cased, values without surrounding whitespace.
* `H1Continue()` - the head of a request carrying `Expect: 100-continue` is in but its body
  is not: the adapter may send `100 Continue`.
* `H1Error(status, reason, detail)` - the input is bad: answer `status` and close. Nothing
  follows an error.
* `H1Preface()` - the connection starts with the HTTP/2 preface (`PRI * HTTP/2.0`): a client
  without ALPN speaking h2 with prior knowledge. The unread bytes, preface included, are in
  `rest()`.

Bounds: the request line and headers together at most `max_head` bytes (431 beyond), bodies at
most `max_body` bytes (413, refused from the Content-Length before any of the body is read). A
POST needs Content-Length (411); a Transfer-Encoding (chunked) is refused with 501: DNS messages
are small and every DoH client sends a length. Malformed request lines and headers are 400,
an HTTP version other than 1.0/1.1 is 505, HTTP/1.1 without Host is 400 (RFC 9112 3.2).
Keep-alive: HTTP/1.1 unless `Connection: close`, HTTP/1.0 only with `Connection: keep-alive`;
after a request that closes, the parser returns nothing more.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

MAX_HEAD = 16384  # the same bound as the HTTP/2 header list (h2server.MAX_HEADER_LIST)
MAX_BODY = 65535
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

_TOKEN = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_TARGET = re.compile(rb"/[!-~]*")  # origin-form: printable ASCII, no spaces or controls
_VERSION = re.compile(rb"HTTP/(\d)\.(\d)")
_BAD_VALUE = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")


@dataclass(frozen=True, slots=True)
class H1Request:
    method: str
    target: str
    headers: list[tuple[str, str]]
    body: bytes
    keep_alive: bool


@dataclass(frozen=True, slots=True)
class H1Continue:
    pass


@dataclass(frozen=True, slots=True)
class H1Error:
    status: int
    reason: str  # the counter's label
    detail: str  # for the debug line


@dataclass(frozen=True, slots=True)
class H1Preface:
    pass


H1Event = H1Request | H1Continue | H1Error | H1Preface


class H1Wire:
    __slots__ = ("_buf", "_continued", "_done", "_first", "_head", "max_body", "max_head")

    def __init__(self, max_head: int = MAX_HEAD, max_body: int = MAX_BODY) -> None:
        self.max_head = max_head
        self.max_body = max_body
        self._buf = bytearray()
        self._first = True  # nothing parsed yet (the h2 preface is only recognised first)
        self._done = False  # an error, a preface or a closing request: nothing more
        # A parsed head waiting for its body: (method, target, headers, keep_alive, length).
        self._head: tuple[str, str, list[tuple[str, str]], bool, int] | None = None
        self._continued = False

    @property
    def done(self) -> bool:
        return self._done

    def receive(self, data: bytes) -> None:
        if not self._done:
            self._buf += data

    def buffered(self) -> int:
        return len(self._buf)

    @property
    def partial(self) -> bool:
        """Part of a request is in (bytes of its head, or a head whose body is not all here)."""
        return not self._done and (bool(self._buf) or self._head is not None)

    def rest(self) -> bytes:
        """The bytes not parsed (after H1Preface: the HTTP/2 connection's first bytes)."""
        out = bytes(self._buf)
        self._buf.clear()
        return out

    def next_event(self) -> H1Event | None:
        if self._done:
            return None
        if self._head is None:
            ev = self._parse_head()
            if ev is not None or self._head is None:
                return ev
        method, target, headers, keep_alive, length = self._head
        if len(self._buf) < length:
            if not self._continued and length and any(
                    k == "expect" and v.lower() == "100-continue" for k, v in headers):
                self._continued = True
                return H1Continue()
            return None
        body = bytes(self._buf[:length])
        del self._buf[:length]
        self._head = None
        self._continued = False
        if not keep_alive:
            self._finish()
        return H1Request(method, target, headers, body, keep_alive)

    def _finish(self) -> None:
        self._done = True
        self._buf.clear()

    def _fail(self, status: int, reason: str, detail: str) -> H1Error:
        self._finish()
        return H1Error(status, reason, detail)

    def _parse_head(self) -> H1Event | None:
        buf = self._buf
        # RFC 9112 2.2: empty lines before a request line are ignored.
        skip = 0
        while buf.startswith(b"\r\n", skip):
            skip += 2
        if skip:
            del buf[:skip]
        if self._first and buf[:3] == b"PRI" and PREFACE.startswith(bytes(buf[: len(PREFACE)])):
            if len(buf) < len(PREFACE):
                return None
            self._done = True  # the buffer stays for rest()
            return H1Preface()
        end = buf.find(b"\r\n\r\n", 0, self.max_head + 4)
        if end < 0:
            if len(buf) > self.max_head:
                return self._fail(431, "h1_header_too_large", f"request head over {self.max_head} bytes")
            return None
        if end + 4 > self.max_head:
            return self._fail(431, "h1_header_too_large", f"request head over {self.max_head} bytes")
        head = bytes(buf[:end])
        del buf[: end + 4]
        self._first = False
        lines = head.split(b"\r\n")
        parts = lines[0].split(b" ")
        if len(parts) != 3 or _TOKEN.fullmatch(parts[0]) is None:
            return self._fail(400, "h1_malformed", f"bad request line {lines[0][:64]!r}")
        method, target, version = parts
        v = _VERSION.fullmatch(version)
        if v is None:
            return self._fail(400, "h1_malformed", f"bad request line {lines[0][:64]!r}")
        if v.group(1) != b"1":
            return self._fail(505, "h1_version", f"HTTP version {version!r}")
        if _TARGET.fullmatch(target) is None:
            return self._fail(400, "h1_malformed", f"bad request target {target[:64]!r}")
        headers: list[tuple[str, str]] = []
        for line in lines[1:]:
            name, colon, value = line.partition(b":")
            if not colon or _TOKEN.fullmatch(name) is None:  # also obs-fold and "name :"
                return self._fail(400, "h1_malformed", f"bad header line {line[:64]!r}")
            value = value.strip(b" \t")
            if _BAD_VALUE.search(value) is not None:
                return self._fail(400, "h1_malformed", f"bad header value for {name[:64]!r}")
            headers.append((name.decode("ascii").lower(), value.decode("latin-1")))
        http10 = v.group(2) == b"0"
        length: int | None = None
        host = 0
        tokens: set[str] = set()
        for k, val in headers:
            if k == "content-length":
                if not val.isdigit() or (length is not None and int(val) != length):
                    return self._fail(400, "h1_malformed", f"bad content-length {val[:32]!r}")
                length = int(val)
            elif k == "transfer-encoding":
                return self._fail(501, "h1_transfer_encoding", f"transfer-encoding {val[:32]!r} refused")
            elif k == "host":
                host += 1
            elif k == "connection":
                tokens.update(t.strip().lower() for t in val.split(","))
        if (not http10 and host != 1) or host > 1:
            return self._fail(400, "h1_malformed", "HTTP/1.1 request without exactly one host header")
        m = method.decode("ascii")
        if length is None:
            if m == "POST":
                return self._fail(411, "h1_length_required", "POST without content-length")
            length = 0
        if length > self.max_body:
            return self._fail(413, "too_large", f"content-length {length}")
        keep_alive = "keep-alive" in tokens if http10 else "close" not in tokens
        self._head = (m, target.decode("ascii"), headers, keep_alive, length)
        return None
