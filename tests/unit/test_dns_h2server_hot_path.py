"""The DoH server's hot path: the memoizing HPACK encoder and decoder give exactly what hpack's own
would, the one-pass request checks refuse what RFC 9113 calls malformed (a stream reset, not a
dead connection), and the answers to one read leave in one writelines, one buffer (TLS record) per
answer."""

from __future__ import annotations

import asyncio
from typing import Any

import dns.message
import h2.config
import h2.connection
import h2.errors
import h2.events
import hpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshgate.config import from_dict
from meshgate.dns.doh import DohApp
from meshgate.dns.h2server import H2ServerProtocol, _MemoDecoder, _MemoEncoder, request_head
from meshgate.dns.resolver import Pipeline
from meshgate.dns.stats import ListenerStats

NAMES = [b":status", b"content-type", b"cache-control", b"content-length", b"x-secret"]
VALUES = [b"200", b"400", b"application/dns-message", b"max-age=300", b"max-age=299", b"113", b"x" * 300]

header = st.tuples(st.sampled_from(NAMES), st.sampled_from(VALUES))
step = st.one_of(
    st.lists(header, min_size=1, max_size=5).map(lambda hs: ("encode", hs)),
    st.lists(header, min_size=1, max_size=3).map(lambda hs: ("never", hs)),
    st.sampled_from([100, 256, 4096]).map(lambda n: ("resize", n)),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(step, min_size=1, max_size=40))
def test_memo_encoder_matches_hpack_byte_for_byte(steps: list[tuple[str, object]]) -> None:
    memo, plain = _MemoEncoder(), hpack.Encoder()
    decoder: hpack.Decoder | None = hpack.Decoder()
    for kind, arg in steps:
        if kind == "resize":
            memo.header_table_size = plain.header_table_size = arg  # type: ignore[assignment]
            decoder = None  # hpack disagrees with itself after some resizes: compare bytes only
            continue
        hs = list(arg)  # type: ignore[call-overload]
        if kind == "never":  # sensitive: must never be served from a plain tuple's memo
            hs = [hpack.NeverIndexedHeaderTuple(n, v) for n, v in hs]
        for _ in range(2):  # the second time is the memo's chance
            a, b = memo.encode(list(hs)), plain.encode(list(hs))
            assert a == b
            if decoder is not None:
                assert decoder.decode(a, raw=True) == [(n, v) for n, v in hs]
        assert list(memo.header_table.dynamic_entries) == list(plain.header_table.dynamic_entries)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([200, 400, 413]), st.sampled_from([0, 45, 113]),
                          st.lists(st.tuples(st.sampled_from(["content-type", "cache-control"]),
                                             st.sampled_from(["max-age=1", "max-age=2", "text/plain"])),
                                   max_size=2),
                          st.sampled_from([None, 100, 4096])), min_size=1, max_size=30))
def test_memo_response_blocks_match_hpack(steps: list[Any]) -> None:
    memo, plain = _MemoEncoder(), hpack.Encoder()
    for status, n, hs, resize in steps:
        if resize is not None:
            memo.header_table_size = plain.header_table_size = resize
        full = [(":status", str(status)), *hs, ("content-length", str(n))]
        for _ in range(2):  # the second time is the memo's chance
            assert memo.encode_response(status, hs, n) == plain.encode(full)
        assert list(memo.header_table.dynamic_entries) == list(plain.header_table.dynamic_entries)


def test_memo_serves_repeated_blocks() -> None:
    memo = _MemoEncoder()
    hs = [(b":status", b"200"), (b"content-type", b"application/dns-message")]
    first = memo.encode(list(hs))  # adds content-type to the table: not remembered yet
    second = memo.encode(list(hs))
    assert first != second and memo.encode(list(hs)) is second  # the third is the memo's


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[list[bytes]] = []

    def write(self, data: bytes) -> None:
        self.calls.append([bytes(data)])

    def writelines(self, chunks: list[bytes]) -> None:
        self.calls.append([bytes(c) for c in chunks])

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        pass

    def get_extra_info(self, key: str, default: Any = None) -> Any:
        return ("127.0.0.1", 1) if key == "peername" else default


async def test_answers_to_one_read_leave_in_one_writelines_one_buffer_each() -> None:
    cfg = from_dict({"node": {"name": "alpha", "ipv4": "10.144.144.1/24"}})
    p = Pipeline(cfg, upstreams=[])
    stats = ListenerStats("test-hot-path")
    srv = H2ServerProtocol(DohApp(p, stats), stats, cfg.limits, set())
    t = _Recorder()
    srv.connection_made(t)  # type: ignore[arg-type]
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
    client.initiate_connection()
    client.receive_data(b"".join(b for call in t.calls for b in call))  # the server's SETTINGS
    t.calls.clear()
    q = dns.message.make_query("alpha.mesh.internal", "A")
    q.id = 0
    for _ in range(3):
        sid = client.get_next_available_stream_id()
        client.send_headers(sid, [(":method", "POST"), (":path", "/dns-query"), (":scheme", "https"),
                                  (":authority", "x"), ("content-type", "application/dns-message")])
        client.send_data(sid, q.to_wire(), end_stream=True)
    srv.data_received(client.data_to_send())  # three requests in one read
    assert len(t.calls) == 1 and len(t.calls[0]) >= 3  # one call; a buffer per answer (+ acks)
    ended = [ev.stream_id for buf in t.calls[0] for ev in client.receive_data(buf)
             if isinstance(ev, h2.events.StreamEnded)]
    assert ended == [1, 3, 5]
    # Never two answers in one buffer: dnsperf takes one answer per TLS record.
    assert max(_stream_ends(buf) for buf in t.calls[0]) == 1
    if srv.timer is not None:
        srv.timer.cancel()
    srv.connection_lost(None)
    await asyncio.sleep(0)


def _stream_ends(buf: bytes) -> int:
    """HEADERS or DATA frames with END_STREAM in a buffer of whole frames."""
    ends = off = 0
    while off + 9 <= len(buf):
        length = int.from_bytes(buf[off : off + 3], "big")
        if buf[off + 3] in (0x0, 0x1) and buf[off + 4] & 0x1:
            ends += 1
        off += 9 + length
    return ends


# --------------------------------------------------------------------------- inbound: memo decoder, checks

REQ = [(b":method", b"GET"), (b":method", b"POST"), (b":path", b"/dns-query"),
       (b":path", b"/dns-query?dns=AAAB"), (b":scheme", b"https"), (b":authority", b"localhost"),
       (b"content-type", b"application/dns-message"),
       (b"content-length", b"33"), (b"content-length", b"41"), (b"accept", b"application/dns-message")]
enc_step = st.one_of(
    st.lists(st.sampled_from(REQ), min_size=1, max_size=6).map(lambda hs: ("encode", hs)),
    st.lists(st.sampled_from(REQ), min_size=1, max_size=3).map(lambda hs: ("never", hs)),
    st.sampled_from([0, 64, 4096]).map(lambda n: ("resize", n)),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(enc_step, min_size=1, max_size=40))
def test_memo_decoder_matches_hpack(steps: list[tuple[str, object]]) -> None:
    enc = hpack.Encoder()
    memo, plain = _MemoDecoder(), hpack.Decoder()
    history: list[bytes] = []
    resized = False
    for kind, arg in steps:
        if kind == "resize":
            enc.header_table_size = arg  # type: ignore[assignment]  # the next block carries the update
            resized = True
            continue
        hs = list(arg)  # type: ignore[call-overload]
        if kind == "never":
            hs = [hpack.NeverIndexedHeaderTuple(n, v) for n, v in hs]
        block = enc.encode(hs)
        got, expected = _decode(memo, block), _decode(plain, block)
        assert got == expected
        if not resized:  # hpack disagrees with itself after some resizes (see above)
            assert expected == [tuple(h) for h in hs]
        # The same bytes again (the memo's chance): whatever the table now makes of them, the
        # memo must agree with hpack (a replay after the table changed decodes differently).
        # On a second pair fed the same history, so the first pair stays in step with the encoder.
        history.append(block)
        m2, p2 = _MemoDecoder(), hpack.Decoder()
        for old in history:
            _decode(m2, old)
            _decode(p2, old)
        assert _decode(m2, block) == _decode(p2, block)
        assert list(m2.header_table.dynamic_entries) == list(p2.header_table.dynamic_entries)


def _decode(d: hpack.Decoder, block: bytes) -> object:
    try:
        return d.decode(block, raw=True)
    except hpack.HPACKError as e:
        return type(e)


def test_memo_decoder_keeps_refusing_an_oversized_list_after_the_limit_shrinks() -> None:
    hs = [(b":method", b"GET"), (b":path", b"/" + b"a" * 200)]
    enc = hpack.Encoder()
    block = enc.encode([hpack.NeverIndexedHeaderTuple(n, v) for n, v in hs])  # leaves the table alone
    memo = _MemoDecoder()
    assert memo.decode(block, raw=True) == hs
    memo.max_header_list_size = 100
    with pytest.raises(hpack.OversizedHeaderListError):
        memo.decode(block, raw=True)


GOOD = [(b":method", b"GET"), (b":scheme", b"https"), (b":authority", b"x"), (b":path", b"/dns-query?dns=AA"),
        (b"accept", b"application/dns-message"), (b"content-length", b"12")]


def test_request_head_picks_out_what_doh_uses() -> None:
    assert request_head(GOOD) == ("GET", "/dns-query?dns=AA", 12,
                                  [("accept", "application/dns-message"), ("content-length", "12")])


@pytest.mark.parametrize("bad", [
    [(b":method", b"GET"), (b":path", b"/")],  # no :scheme
    [(b":scheme", b"https"), (b":path", b"/")],  # no :method
    [(b":method", b"GET"), (b":scheme", b"https")],  # no :path
    [*GOOD, (b":method", b"POST")],  # pseudo-header after a regular one (and repeated)
    [(b":method", b"GET"), *GOOD[1:4], (b":path", b"/again")],  # repeated :path
    [(b":status", b"200"), *GOOD],  # a response pseudo-header
    [*GOOD, (b"Accept", b"x")],  # upper case
    [*GOOD, (b"connection", b"keep-alive")],
    [*GOOD, (b"te", b"gzip")],
    [*GOOD, (b"x-a", b"one\r\ntwo")],
    [*GOOD, (b"x-a", b" padded")],
    [*GOOD, (b"x a", b"v")],
    [*GOOD, (b"", b"v")],
])
def test_request_head_refuses_malformed_requests(bad: list[tuple[bytes, bytes]]) -> None:
    assert request_head(bad) is None


async def test_a_malformed_request_resets_its_stream_and_the_connection_goes_on() -> None:
    cfg = from_dict({"node": {"name": "alpha", "ipv4": "10.144.144.1/24"}})
    p = Pipeline(cfg, upstreams=[])
    stats = ListenerStats("test-malformed")
    srv = H2ServerProtocol(DohApp(p, stats), stats, cfg.limits, set())
    t = _Recorder()
    srv.connection_made(t)  # type: ignore[arg-type]
    client = h2.connection.H2Connection(h2.config.H2Configuration(
        client_side=True, header_encoding=None, validate_outbound_headers=False,
        normalize_outbound_headers=False))
    client.initiate_connection()
    client.receive_data(b"".join(b for call in t.calls for b in call))
    t.calls.clear()
    q = dns.message.make_query("alpha.mesh.internal", "A")
    q.id = 0
    good = [(":method", "POST"), (":path", "/dns-query"), (":scheme", "https"),
            ("content-type", "application/dns-message")]
    client.send_headers(1, [*good, ("Content-Type", "x")])  # upper case: malformed
    client.send_data(1, q.to_wire(), end_stream=True)
    client.send_headers(3, good)
    client.send_data(3, q.to_wire(), end_stream=True)
    srv.data_received(client.data_to_send())
    events = [ev for call in t.calls for buf in call for ev in client.receive_data(buf)]
    resets = [ev for ev in events if isinstance(ev, h2.events.StreamReset)]
    assert [(ev.stream_id, ev.error_code) for ev in resets] == [(1, h2.errors.ErrorCodes.PROTOCOL_ERROR)]
    assert [ev.stream_id for ev in events if isinstance(ev, h2.events.StreamEnded)] == [3]
    assert stats.snapshot()["errors"] == {"h2_malformed": 1}
    if srv.timer is not None:
        srv.timer.cancel()
    srv.connection_lost(None)
    await asyncio.sleep(0)
