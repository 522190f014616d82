"""The sans-I/O HTTP/1.1 parser (meshgate/dns/h1wire.py): requests, bounds, bad input."""

from __future__ import annotations

import asyncio

import pytest

from meshgate.dns.h1wire import PREFACE, H1Continue, H1Error, H1Preface, H1Request, H1Wire


def events(wire: H1Wire) -> list[object]:
    out = []
    while (ev := wire.next_event()) is not None:
        out.append(ev)
    return out


GET = b"GET /dns-query?dns=AAAB HTTP/1.1\r\nHost: a\r\nAccept: application/dns-message\r\n\r\n"
POST = (b"POST /dns-query HTTP/1.1\r\nHost: a\r\nContent-Type: application/dns-message\r\n"
        b"Content-Length: 3\r\n\r\nabc")


def test_get_and_post_byte_by_byte() -> None:
    wire = H1Wire()
    got: list[object] = []
    for b in GET + POST:
        wire.receive(bytes([b]))
        got += events(wire)
    assert got == [
        H1Request("GET", "/dns-query?dns=AAAB", [("host", "a"), ("accept", "application/dns-message")],
                  b"", True),
        H1Request("POST", "/dns-query", [("host", "a"), ("content-type", "application/dns-message"),
                                         ("content-length", "3")], b"abc", True),
    ]


def test_pipelined_requests_come_one_at_a_time() -> None:
    wire = H1Wire()
    wire.receive(GET * 3 + b"\r\n" + POST)
    first = wire.next_event()
    assert isinstance(first, H1Request) and first.method == "GET"
    assert wire.buffered() == 2 * len(GET) + 2 + len(POST)  # the rest waits, unparsed
    assert [type(e) for e in events(wire)] == [H1Request, H1Request, H1Request]


def test_keep_alive_rules() -> None:
    close = H1Wire()
    close.receive(b"GET / HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n" + GET)
    req = close.next_event()
    assert isinstance(req, H1Request) and not req.keep_alive
    assert close.next_event() is None and close.done  # nothing after a closing request
    old = H1Wire()
    old.receive(b"GET / HTTP/1.0\r\n\r\nGET / HTTP/1.0\r\nConnection: Keep-Alive\r\n\r\n")
    req = old.next_event()
    assert isinstance(req, H1Request) and not req.keep_alive  # HTTP/1.0: no Host needed, closes
    old = H1Wire()
    old.receive(b"GET / HTTP/1.0\r\nConnection: Keep-Alive\r\n\r\n")
    req = old.next_event()
    assert isinstance(req, H1Request) and req.keep_alive


def test_expect_continue() -> None:
    wire = H1Wire()
    wire.receive(b"POST / HTTP/1.1\r\nHost: a\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\n")
    assert events(wire) == [H1Continue()]
    wire.receive(b"hi")
    req = wire.next_event()
    assert isinstance(req, H1Request) and req.body == b"hi"


def test_h2_preface_first_only() -> None:
    wire = H1Wire()
    wire.receive(PREFACE[:10])
    assert wire.next_event() is None
    wire.receive(PREFACE[10:] + b"\x00\x00")
    assert wire.next_event() == H1Preface()
    assert wire.rest() == PREFACE + b"\x00\x00"
    later = H1Wire()
    later.receive(GET + PREFACE)
    assert isinstance(later.next_event(), H1Request)
    ev = later.next_event()
    assert isinstance(ev, H1Error) and ev.status == 505  # later on, just a request for HTTP/2.0


@pytest.mark.parametrize(("data", "status", "reason"), [
    (b"GET / HTTP/1.1\r\nHost: a\r\nX: " + b"a" * 17000, 431, "h1_header_too_large"),  # no end in sight
    (b"GET / HTTP/1.1\r\nHost: a\r\nX: " + b"a" * 16400 + b"\r\n\r\n", 431, "h1_header_too_large"),
    (b"garbage\r\n\r\n", 400, "h1_malformed"),
    (b"GET  / HTTP/1.1\r\nHost: a\r\n\r\n", 400, "h1_malformed"),
    (b"GET http://a/ HTTP/1.1\r\nHost: a\r\n\r\n", 400, "h1_malformed"),
    (b"G\x01T / HTTP/1.1\r\nHost: a\r\n\r\n", 400, "h1_malformed"),
    (b"GET / HTTP/1.1\r\nHost: a\r\n folded\r\n\r\n", 400, "h1_malformed"),
    (b"GET / HTTP/1.1\r\nHost : a\r\n\r\n", 400, "h1_malformed"),
    (b"GET / HTTP/1.1\r\nHost: a\x00b\r\n\r\n", 400, "h1_malformed"),
    (b"GET / HTTP/1.1\r\n\r\n", 400, "h1_malformed"),  # no Host
    (b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 400, "h1_malformed"),
    (b"GET / HTTP/2.0\r\nHost: a\r\n\r\n", 505, "h1_version"),
    (b"POST / HTTP/1.1\r\nHost: a\r\n\r\n", 411, "h1_length_required"),
    (b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 65536\r\n\r\n", 413, "too_large"),
    (b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: -1\r\n\r\n", 400, "h1_malformed"),
    (b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n", 400, "h1_malformed"),
    (b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 501,
     "h1_transfer_encoding"),
])
def test_bad_input(data: bytes, status: int, reason: str) -> None:
    wire = H1Wire()
    wire.receive(data)
    ev = wire.next_event()
    assert isinstance(ev, H1Error) and (ev.status, ev.reason) == (status, reason)
    assert wire.done and wire.buffered() == 0
    wire.receive(GET)
    assert wire.next_event() is None  # nothing after an error


def test_body_at_the_bound() -> None:
    wire = H1Wire()
    wire.receive(b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 65535\r\n\r\n" + b"x" * 65535)
    req = wire.next_event()
    assert isinstance(req, H1Request) and len(req.body) == 65535


# --------------------------------------------------------------------------- through H1ServerProtocol


class _Transport:
    """Holds what is written as the views it was given, until `drain()` (a slow peer)."""

    def __init__(self) -> None:
        self.data: list[bytes | memoryview] = []
        self.pending = 0  # bytes "not yet sent"
        self.closed = False
        self.reading = True

    def writelines(self, chunks: list[bytes | memoryview]) -> None:
        self.data.extend(chunks)
        self.pending += sum(len(c) for c in chunks)

    def write(self, data: bytes) -> None:
        self.writelines([data])

    def drain(self) -> bytes:
        out = b"".join(bytes(c) for c in self.data)
        self.data.clear()  # the views are released: the "kernel" has the bytes now
        self.pending = 0
        return out

    def get_write_buffer_size(self) -> int:
        return self.pending

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def get_extra_info(self, key: str, default: object = None) -> object:
        return ("127.0.0.1", 1) if key == "peername" else default


async def test_pooled_answer_waits_for_the_drain_and_is_dropped_if_the_peer_goes() -> None:
    from meshgate.buffers import BufferPool
    from meshgate.config import LimitsConfig
    from meshgate.dns.h1server import H1ServerProtocol
    from meshgate.dns.stats import ListenerStats

    pool = BufferPool(capacity=512, headroom=16)
    held: list[object] = []

    def handler(method: str, path: str, headers: list[tuple[str, str]], body: bytes) -> object:
        buf = pool.get()
        buf.write(b"answer")
        held.append(buf)
        return (200, [("content-type", "application/dns-message")], buf)

    def proto(**limits: object) -> tuple[H1ServerProtocol, _Transport]:
        srv = H1ServerProtocol(handler, ListenerStats("test-h1"), LimitsConfig(**limits), set())  # type: ignore[arg-type]
        t = _Transport()
        srv.connection_made(t)  # type: ignore[arg-type]
        return srv, t

    srv, t = proto()
    srv.data_received(GET)
    assert len(pool) == 0 and len(srv.parked) == 1  # written, but the transport still holds it
    srv.data_received(GET)  # a second answer while the first is unsent: parked too
    assert len(srv.parked) == 2
    assert t.drain().count(b"HTTP/1.1 200 OK\r\n") == 2
    srv.resume_writing()
    assert len(pool) == 2 and not srv.parked  # both recycled once the transport holds nothing
    srv.data_received(GET)
    srv.connection_lost(None)  # the peer went with it unsent: dropped, never reused
    assert len(pool) == 1 and held[-1].pool is None  # type: ignore[attr-defined]
    srv.timer.cancel()

    # Pipelining bound: two in flight (the handler here never finishes), the rest left unread.
    never: asyncio.Future[object] = asyncio.get_running_loop().create_future()
    srv2, t2 = proto(doh_max_streams=2)
    srv2.handler = lambda *a: never  # type: ignore[assignment,return-value]
    srv2.data_received(GET * 5)
    assert len(srv2.queue) == 2 and srv2.wire.buffered() == 3 * len(GET) and not t2.reading
    srv2.connection_lost(None)
