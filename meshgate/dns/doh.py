"""DoH (RFC 8484): the request handling, and the `doh` listener kind.

`DohApp(pipeline, stats, path)` is an h2server Handler, independent of the
HTTP/2 plumbing: call it with (method, path, headers, body) and get (status,
headers, body) back, or an awaitable of that when the answer needs an
upstream. The ODoH listener reuses it for the plain DoH part of a dual
listener. `DohListener` serves it over TLS on HTTP/2 (meshgate.dns.h2server) and HTTP/1.1
(meshgate.dns.h1server) on one port, the protocol picked per connection by ALPN.

Rules (RFC 8484 sections 4.1 and 5.1; docs/ARCHITECTURE.md, "A DoH query"): GET `?dns=` is base64url without
padding (400 for '=', '+', '/' or other bad encodings), POST needs
`content-type: application/dns-message` (415) and at most 65535 bytes (413,
enforced by the server while the body arrives), other methods 405. Every
DNS answer, whatever its RCODE, is 200 with `cache-control: max-age` = the
remaining TTL (smallest answer TTL, or the negative TTL). The EDNS UDP size
is ignored: never truncate.
"""

from __future__ import annotations

import asyncio
import binascii
from collections.abc import Awaitable

from meshgate.buffers import Buffer
from meshgate.config import HostPort
from meshgate.dns.h1server import ALPN, start_https
from meshgate.dns.h2server import Response, current_peer
from meshgate.dns.listeners import Listener, bound_address
from meshgate.dns.preformed import PreformedAnswers
from meshgate.dns.ratelimit import ClientRateLimit
from meshgate.dns.resolver import Frontend, Later, Pipeline, Ready
from meshgate.dns.stats import ListenerStats

CONTENT_TYPE = "application/dns-message"
_TEXT = [("content-type", "text/plain; charset=utf-8")]
# base64url -> standard base64 for a2b_base64's strict mode, which then refuses everything
# outside the base64url alphabet: '+', '/' and '=' become '!' (never valid), and so does any
# other stray byte.
_B64URL_TO_STD = bytes.maketrans(b"-_+/=", b"+/!!!")
_PAD = (b"", b"", b"==", b"=")  # by length % 4 (1 is refused before)
_OK_HEADERS_MAX = 4096  # distinct max-age values remembered (one header list each)


def decode_get_param(query_string: str) -> bytes | None:
    """The `dns` parameter of a GET, or None if missing or not unpadded base64url."""
    value: str | None = None
    if query_string[:4] == "dns=" and "&" not in query_string:
        value = query_string[4:]  # what every client sends: the one parameter
    else:
        for part in query_string.split("&"):
            k, sep, v = part.partition("=")
            if k == "dns" and sep:
                value = v
                break
    if not value or len(value) % 4 == 1:
        return None
    try:
        raw = value.encode("ascii")
        return binascii.a2b_base64(raw.translate(_B64URL_TO_STD) + _PAD[len(raw) % 4], strict_mode=True)
    except (binascii.Error, UnicodeEncodeError):
        return None


def _error(status: int, text: str, extra: list[tuple[str, str]] | None = None) -> Response:
    return (status, [*_TEXT, *(extra or [])], text.encode())


class DohApp:
    """`fast_entries`: the bound of its preformed-answer table (dns/preformed.py, the cache-hit
    fast path: a repeated query answered without parsing or packing); 0: none. A listener with a
    per-client rate limit or a query log keeps to the general path (which checks and logs)."""

    def __init__(self, pipeline: Pipeline, stats: ListenerStats, path: str = "/dns-query",
                 limiter: ClientRateLimit | None = None, fast_entries: int = 0) -> None:
        self.frontend = Frontend(pipeline, stats, limiter=limiter)
        self.pipeline = pipeline
        self.stats = stats
        self.path = path
        self.loop = asyncio.get_running_loop()
        self.fast = (PreformedAnswers(pipeline, fast_entries, udp=False)
                     if fast_entries > 0 and limiter is None else None)
        self._count_armed = False
        # The 200 answer's header list per max-age: shared, never mutated (h2server only reads it).
        self._ok_headers: dict[int, list[tuple[str, str]]] = {}
        self._alt_svc: list[tuple[str, str]] = []

    def advertise(self, alt_svc: str) -> None:
        """Send `Alt-Svc: alt_svc` with every answer (a doh3 listener beside this one); "" stops."""
        self._alt_svc = [("alt-svc", alt_svc)] if alt_svc else []
        self._ok_headers.clear()

    def __call__(self, method: str, path: str, headers: list[tuple[str, str]],
                 body: bytes) -> Response | Awaitable[Response]:
        target, _, qs = path.partition("?")
        if target != self.path:
            self.stats.error("http_404")
            return _error(404, "not found\n")
        if method == "GET":
            msg = decode_get_param(qs)
            if msg is None:
                self.stats.error("http_400_base64")
                return _error(400, "dns parameter must be base64url without padding\n")
        elif method == "POST":
            ctype = next((v for k, v in headers if k == "content-type"), "")
            if ctype.split(";")[0].strip().lower() != CONTENT_TYPE:
                self.stats.error("http_415")
                return _error(415, f"content-type must be {CONTENT_TYPE}\n")
            if len(body) > 65535:
                self.stats.error("too_large")
                return _error(413, "body over 65535 bytes\n")
            msg = body
        else:
            self.stats.error("http_405")
            return _error(405, "use GET or POST\n", [("allow", "GET, POST")])
        now = self.loop.time()
        fast = self.fast if self.pipeline.query_log is None else None  # the log sees every question
        if fast is not None:
            out = fast.answer(msg, now)
            if out is not None:
                if not self._count_armed:
                    self._count_armed = True
                    self.loop.call_soon(self._count)
                return self._ok(out, fast.max_age)
        fe = self.frontend
        fe.answered = None
        res = fe.query(msg, now, current_peer.get())
        if isinstance(res, Ready):
            if fast is not None and fe.answered is not None:
                fast.learn(msg, now, fe.answered, res.buffer.view())
            return self._ok(res.buffer, res.max_age)
        if res is None:
            return _error(400, "not a DNS query\n")
        return self._ok_later(res)

    def _count(self) -> None:
        """The fast path's hits of this loop tick, added to the counters at once."""
        self._count_armed = False
        assert self.fast is not None
        self.fast.flush_counts(self.stats)

    async def _ok_later(self, later: Later) -> Response:
        try:
            ready = await later.answer
        except asyncio.CancelledError:  # the stream or connection went away
            later.abandon()
            raise
        return self._ok(None, 0) if ready is None else self._ok(ready.buffer, ready.max_age)

    def _ok(self, buf: Buffer | bytes | None, max_age: int) -> Response:
        if buf is None:  # dropped: too much in flight
            return _error(503, "busy\n", [("retry-after", "1")])
        headers = self._ok_headers.get(max_age)
        if headers is None:
            if len(self._ok_headers) >= _OK_HEADERS_MAX:
                self._ok_headers.clear()
            headers = self._ok_headers[max_age] = [("content-type", CONTENT_TYPE),
                                                   ("cache-control", f"max-age={max_age}"), *self._alt_svc]
        return (200, headers, buf)


class DohListener(Listener):
    """`protocol = "doh"`: DoH over TLS, HTTP/2 or HTTP/1.1 (meshgate.dns.h1server.start_https),
    answering at `path`."""

    scheme = "https"
    has_path = True
    shared = True
    server: asyncio.Server | None = None
    app: DohApp | None = None

    async def _serve(self) -> HostPort:
        ssl = self.ssl_context(ALPN)
        lim = self.limits
        app = self.app = DohApp(self.pipeline, self.stats, self.cfg.path, self.limiter,
                                lim.dns_fast_path_entries if lim.dns_fast_path else 0)
        app.advertise(self.cfg.alt_svc)  # a worker process: what the node's listener advertises
        hp = self.cfg.listen
        self.server, self.conns = await start_https(app, self.stats, self.limits, hp.host, hp.port, ssl,
                                                 reuse_port=self.reuse_port)
        return bound_address(self.server.sockets[0].getsockname())

    def linked(self, listeners: list[Listener]) -> None:
        """Advertise a doh3 listener on the same host (or a wildcard) and path: Alt-Svc names a
        port on the same host, so a client that reached us here finds HTTP/3 there."""
        if self.app is None:
            return
        me = self.cfg.listen.host
        for lst in listeners:
            c = lst.cfg
            if c.protocol == "doh3" and c.path == self.cfg.path and (
                    c.listen.host == me or c.listen.host in ("0.0.0.0", "::")):
                self.alt_svc = f'h3=":{lst.port}"; ma=86400'
                self.app.advertise(self.alt_svc)
                return

    async def stop(self) -> None:
        await self._close_server(self.server)
        self.server = None
