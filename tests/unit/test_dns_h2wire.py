"""The sans-I/O HTTP/2 server core (meshgate.dns.h2wire) against the h2 library as the client and
against hand-made frames: preface, SETTINGS both ways, CONTINUATION, padding, flow control
blocking and resuming a large response, resets, rapid reset, and the GOAWAY code of every
connection error. The decoder is fuzzed: it raises nothing but H2ConnectionError."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import struct
from typing import Any

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.settings
import hpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshgate.buffers import Buffer, BufferPool
from meshgate.config import from_dict
from meshgate.dns import h2wire
from meshgate.dns.h2server import H2ServerProtocol, memo_request_head, request_head
from meshgate.dns.h2wire import PREFACE, H2ConnectionError, H2Wire, frame
from meshgate.dns.stats import ListenerStats
from tests.helpers import async_wait_until

REQ = [(":method", "POST"), (":path", "/dns-query"), (":scheme", "https"), (":authority", "x"),
       ("content-type", "application/dns-message")]
SETTINGS0 = frame(h2wire.SETTINGS_FRAME, 0, 0)


def frames(data: bytes) -> list[tuple[int, int, int, bytes]]:
    out, off = [], 0
    while off + 9 <= len(data):
        n = int.from_bytes(data[off : off + 3], "big")
        out.append((data[off + 3], data[off + 4], int.from_bytes(data[off + 5 : off + 9], "big") & 0x7FFFFFFF,
                    data[off + 9 : off + 9 + n]))
        off += 9 + n
    assert off == len(data), "output ends in a partial frame"
    return out


def goaway_code(data: bytes) -> int:
    gs = [p for t, _, _, p in frames(data) if t == h2wire.GOAWAY_FRAME]
    assert len(gs) == 1
    return int(struct.unpack(">LL", gs[0][:8])[1])


def server(**kw: Any) -> H2Wire:
    w = H2Wire(max_streams=kw.pop("max_streams", 100), max_header_list=kw.pop("max_header_list", 16384), **kw)
    w.initiate()
    return w


def client(local: dict[int, int] | None = None) -> h2.connection.H2Connection:
    c = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
    c.initiate_connection()
    if local:
        c.update_settings(local)
    return c


def pair(local: dict[int, int] | None = None, **kw: Any) -> tuple[H2Wire, h2.connection.H2Connection]:
    """A server and an h2 client past the settings exchange."""
    s, c = server(**kw), client(local)
    s.receive(c.data_to_send())
    c.receive_data(s.data_to_send())
    s.receive(c.data_to_send())  # the client's ACK of ours
    return s, c


def opened(head: bytes = b"") -> H2Wire:
    s = server()
    s.receive(PREFACE + SETTINGS0 + head)
    s.data_to_send()
    return s


def block(headers: list[tuple[str, str]] = REQ) -> bytes:
    return hpack.Encoder().encode(headers)


# --------------------------------------------------------------------------- preface and settings


def test_settings_exchange_with_h2() -> None:
    s, c = server(max_streams=7, max_header_list=9000), client({
        h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 1000, h2.settings.SettingCodes.MAX_FRAME_SIZE: 20000})
    pre = c.data_to_send()
    for i in range(0, len(pre), 5):  # the preface and SETTINGS may arrive in pieces
        assert s.receive(pre[i : i + 5]) == []
    events = c.receive_data(s.data_to_send())
    changed = next(e for e in events if isinstance(e, h2.events.RemoteSettingsChanged)).changed_settings
    assert changed[h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS].new_value == 7
    assert changed[h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE].new_value == 9000
    assert any(isinstance(e, h2.events.SettingsAcknowledged) for e in events)  # ours acked theirs
    assert s.peer_window == 1000 and s.peer_frame == 20000


def test_a_bad_preface_is_a_protocol_error() -> None:
    s = server()
    s.data_to_send()
    with pytest.raises(H2ConnectionError) as e:
        s.receive(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert e.value.code == h2wire.PROTOCOL_ERROR
    assert goaway_code(s.data_to_send()) == h2wire.PROTOCOL_ERROR
    assert s.receive(PREFACE) == []  # closed: nothing more is read


def test_ping_is_acked_and_unknown_and_priority_frames_are_ignored() -> None:
    s = opened()
    events = s.receive(frame(h2wire.PING_FRAME, 0, 0, b"12345678") + frame(0xEE, 0xFF, 3, b"whatever")
                       + frame(h2wire.PRIORITY_FRAME, 0, 9, b"\x00\x00\x00\x01\x10"))
    assert events == []
    assert frames(s.data_to_send()) == [(h2wire.PING_FRAME, h2wire.ACK, 0, b"12345678")]


# --------------------------------------------------------------------------- requests


def test_requests_from_h2_with_continuation_and_padding() -> None:
    s, c = pair(max_header_list=65536)
    c.send_headers(1, REQ)
    c.send_data(1, b"abc", end_stream=True, pad_length=10)
    c.send_headers(3, [*REQ, ("x-long", "v" * 40000)], end_stream=True)  # HEADERS + CONTINUATION
    events = s.receive(c.data_to_send())
    assert [(e[0], e[1]) for e in events] == [(h2wire.REQUEST, 1), (h2wire.DATA, 1), (h2wire.REQUEST, 3)]
    assert events[0][2][:2] == [(b":method", b"POST"), (b":path", b"/dns-query")] and events[0][3] is False
    assert events[1][2:] == (b"abc", True)
    assert events[2][2][-1] == (b"x-long", b"v" * 40000) and events[2][3] is True


def test_padded_headers_with_priority_fields() -> None:
    b = block()
    payload = bytes([4]) + b"\x00\x00\x00\x00\x20" + b + b"\x00" * 4
    s = opened(frame(h2wire.HEADERS_FRAME, h2wire.END_HEADERS | h2wire.END_STREAM | h2wire.PADDED
                     | h2wire.PRIORITY_FLAG, 1, payload))
    assert 1 in s.streams and s.streams[1].remote_closed


def test_a_header_block_interrupted_by_another_frame_is_a_protocol_error() -> None:
    s = opened()
    b = block()
    with pytest.raises(H2ConnectionError) as e:
        s.receive(frame(h2wire.HEADERS_FRAME, 0, 1, b[:5]) + frame(h2wire.PING_FRAME, 0, 0, b"x" * 8))
    assert e.value.code == h2wire.PROTOCOL_ERROR


def test_empty_continuations_are_a_flood_too() -> None:
    s = opened(frame(h2wire.HEADERS_FRAME, 0, 1, block()[:3]))
    with pytest.raises(H2ConnectionError) as e:
        s.receive(frame(h2wire.CONTINUATION_FRAME, 0, 1) * 100)
    assert e.value.code == h2wire.ENHANCE_YOUR_CALM


def test_a_continuation_flood_is_refused() -> None:
    s = opened(frame(h2wire.HEADERS_FRAME, 0, 1, block()))
    with pytest.raises(H2ConnectionError) as e:
        for _ in range(100):
            s.receive(frame(h2wire.CONTINUATION_FRAME, 0, 1, b"\x00" * 16384))
    assert e.value.code == h2wire.ENHANCE_YOUR_CALM


def test_request_body_windows_are_given_back() -> None:
    s, c = pair()
    c.send_headers(1, REQ)
    body, got = b"\x01" * 200_000, bytearray()
    ended = False
    while not ended:  # h2 sends only what our windows allow: this stalls unless we give them back
        room = min(c.local_flow_control_window(1), c.max_outbound_frame_size, len(body))
        assert room > 0, "stalled: the server did not give the window back"
        c.send_data(1, body[:room], end_stream=room == len(body))
        body = body[room:]
        for ev in s.receive(c.data_to_send()):
            if ev[0] == h2wire.DATA:
                got += ev[2]
                ended = ev[3]
        c.receive_data(s.data_to_send())
    assert len(got) == 200_000


# --------------------------------------------------------------------------- responses and flow control


def _respond(s: H2Wire, c: h2.connection.H2Connection, body: bytes) -> list[Any]:
    c.send_headers(1, REQ, end_stream=True)
    s.receive(c.data_to_send())
    s.send_headers(1, [(":status", "200"), ("content-length", str(len(body)))], end_stream=False)
    return [s.send_data(1, memoryview(body), end_stream=True)]


def test_a_large_response_blocks_on_the_window_and_resumes() -> None:
    s, c = pair({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 100})
    body = bytes(range(256)) * 12
    assert _respond(s, c, body) == [100]
    assert s.window(1) == 0 and s.send_data(1, memoryview(body)[100:], end_stream=True) == 0
    got = bytearray()
    ended = False
    sent = 100
    for _ in range(100):
        for ev in c.receive_data(s.data_to_send()):
            if isinstance(ev, h2.events.DataReceived):
                got += ev.data
                c.acknowledge_received_data(ev.flow_controlled_length, 1)
            ended = ended or isinstance(ev, h2.events.StreamEnded)
        if ended:
            break
        for wev in s.receive(c.data_to_send()):
            assert wev[:2] in ((h2wire.WINDOW, 1), (h2wire.WINDOW, 0))
        sent += s.send_data(1, memoryview(body)[sent:], end_stream=True)
    assert ended and bytes(got) == body
    assert 1 not in s.streams  # both sides ended it


def test_data_frames_respect_the_peers_max_frame_size() -> None:
    s, c = pair({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 1 << 20})
    c.increment_flow_control_window(1 << 20)
    s.receive(c.data_to_send())
    body = b"z" * 40000
    assert _respond(s, c, body) == [40000]
    out = frames(s.data_to_send())
    sizes = [len(p) for t, _, _, p in out if t == h2wire.DATA_FRAME]
    assert sizes == [16384, 16384, 40000 - 32768]
    assert [f for t, f, _, _ in out if t == h2wire.DATA_FRAME][-1] & h2wire.END_STREAM


def test_a_reset_stream_with_a_queued_answer_sends_nothing_more() -> None:
    s, c = pair({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 10})
    body = b"q" * 1000
    assert _respond(s, c, body) == [10]
    c.receive_data(s.data_to_send())
    c.reset_stream(1, h2.errors.ErrorCodes.CANCEL)
    assert s.receive(c.data_to_send()) == [(h2wire.RESET, 1, h2.errors.ErrorCodes.CANCEL, 0)]
    c.increment_flow_control_window(5000)
    s.receive(c.data_to_send())
    assert s.window(1) == 0 and s.send_data(1, memoryview(body)[10:], end_stream=True) == 0
    assert s.data_to_send() == b""


def test_an_answer_before_the_request_ended_resets_with_no_error() -> None:
    s, c = pair()
    c.send_headers(1, REQ)
    s.receive(c.data_to_send())
    s.send_headers(1, [(":status", "413")], end_stream=True)
    events = c.receive_data(s.data_to_send())
    assert [type(e) for e in events][-2:] == [h2.events.StreamEnded, h2.events.StreamReset]
    assert 1 not in s.streams
    # Late DATA for it is dropped (and still counted against the connection window).
    assert s.receive(frame(h2wire.DATA_FRAME, 0, 1, b"late")) == []


# --------------------------------------------------------------------------- errors


SETTINGS_FRAME = h2wire.SETTINGS_FRAME
H = h2wire.END_HEADERS


@pytest.mark.parametrize(("frames_", "code"), [
    (frame(h2wire.DATA_FRAME, 0, 0, b"x"), h2wire.PROTOCOL_ERROR),
    (frame(h2wire.DATA_FRAME, 0, 5, b"x"), h2wire.PROTOCOL_ERROR),  # idle stream
    (b"\x00\x40\x01\x00\x00\x00\x00\x00\x01" + b"\x00" * 16385, h2wire.FRAME_SIZE_ERROR),
    (frame(h2wire.PING_FRAME, 0, 0, b"1234567"), h2wire.FRAME_SIZE_ERROR),
    (frame(h2wire.PING_FRAME, 0, 1, b"12345678"), h2wire.PROTOCOL_ERROR),
    (frame(SETTINGS_FRAME, 0, 0, b"\x00\x04\x00"), h2wire.FRAME_SIZE_ERROR),
    (frame(SETTINGS_FRAME, h2wire.ACK, 0, b"\x00\x04\x00\x00\x00\x01"), h2wire.FRAME_SIZE_ERROR),
    (frame(SETTINGS_FRAME, 0, 1), h2wire.PROTOCOL_ERROR),
    (frame(SETTINGS_FRAME, 0, 0, struct.pack(">HL", 4, 2**31)), h2wire.FLOW_CONTROL_ERROR),
    (frame(SETTINGS_FRAME, 0, 0, struct.pack(">HL", 5, 100)), h2wire.PROTOCOL_ERROR),
    (frame(SETTINGS_FRAME, 0, 0, struct.pack(">HL", 2, 2)), h2wire.PROTOCOL_ERROR),
    (frame(h2wire.WINDOW_UPDATE_FRAME, 0, 0, struct.pack(">L", 2**31 - 1)), h2wire.FLOW_CONTROL_ERROR),
    (frame(h2wire.WINDOW_UPDATE_FRAME, 0, 0, struct.pack(">L", 0)), h2wire.PROTOCOL_ERROR),
    (frame(h2wire.WINDOW_UPDATE_FRAME, 0, 0, b"\x00\x01"), h2wire.FRAME_SIZE_ERROR),
    (frame(h2wire.HEADERS_FRAME, H, 1, b"\xff\xff\xff\xff\xff"), h2wire.COMPRESSION_ERROR),
    (frame(h2wire.HEADERS_FRAME, H, 0, block()), h2wire.PROTOCOL_ERROR),
    (frame(h2wire.HEADERS_FRAME, H, 2, block()), h2wire.PROTOCOL_ERROR),  # even: a server's id
    (frame(h2wire.HEADERS_FRAME, H | h2wire.PADDED, 1, b"\x09" + block()[:8]), h2wire.PROTOCOL_ERROR),
    (frame(h2wire.HEADERS_FRAME, H | h2wire.PRIORITY_FLAG, 1, b"\x00\x00"), h2wire.FRAME_SIZE_ERROR),
    (frame(h2wire.CONTINUATION_FRAME, H, 1, block()), h2wire.PROTOCOL_ERROR),
    (frame(h2wire.PUSH_PROMISE_FRAME, H, 1, b"\x00\x00\x00\x02"), h2wire.PROTOCOL_ERROR),
    (frame(h2wire.RST_STREAM_FRAME, 0, 0, b"\x00\x00\x00\x08"), h2wire.PROTOCOL_ERROR),
    (frame(h2wire.RST_STREAM_FRAME, 0, 1, b"\x00\x00\x00\x08"), h2wire.PROTOCOL_ERROR),  # idle
    (frame(h2wire.RST_STREAM_FRAME, 0, 1, b"\x00\x08"), h2wire.FRAME_SIZE_ERROR),
    (frame(h2wire.PRIORITY_FRAME, 0, 1, b"\x00"), h2wire.FRAME_SIZE_ERROR),
    (frame(h2wire.GOAWAY_FRAME, 0, 1, b"\x00" * 8), h2wire.PROTOCOL_ERROR),
    (frame(h2wire.HEADERS_FRAME, H, 1, block())  # a stream window pushed past 2^31-1 by SETTINGS
     + frame(h2wire.WINDOW_UPDATE_FRAME, 0, 1, struct.pack(">L", 1000))
     + frame(SETTINGS_FRAME, 0, 0, struct.pack(">HL", 4, 2**31 - 1)), h2wire.FLOW_CONTROL_ERROR),
])
def test_bad_frames_get_goaway_with_the_right_code(frames_: bytes, code: int) -> None:
    s = opened()
    with pytest.raises(H2ConnectionError) as e:
        s.receive(frames_)
    assert e.value.code == code
    assert goaway_code(s.data_to_send()) == code


def test_the_first_frame_must_be_settings() -> None:
    s = server()
    with pytest.raises(H2ConnectionError) as e:
        s.receive(PREFACE + frame(h2wire.PING_FRAME, 0, 0, b"12345678"))
    assert e.value.code == h2wire.PROTOCOL_ERROR


def test_an_oversized_header_list_is_refused() -> None:
    s = server(max_header_list=200)
    s.receive(PREFACE + SETTINGS0)
    with pytest.raises(H2ConnectionError) as e:
        s.receive(frame(h2wire.HEADERS_FRAME, H, 1, block([*REQ, ("x-big", "v" * 300)])))
    assert e.value.code == h2wire.ENHANCE_YOUR_CALM


@pytest.mark.parametrize(("extra", "code"), [
    (frame(h2wire.WINDOW_UPDATE_FRAME, 0, 1, struct.pack(">L", 0)), h2wire.PROTOCOL_ERROR),
    (frame(h2wire.WINDOW_UPDATE_FRAME, 0, 1, struct.pack(">L", 2**31 - 1)), h2wire.FLOW_CONTROL_ERROR),
    (frame(h2wire.DATA_FRAME, h2wire.END_STREAM, 1, b"x") * 2, h2wire.STREAM_CLOSED),
    (frame(h2wire.DATA_FRAME, h2wire.PADDED, 1, b"\x05abc"), None),  # padding past the end: connection
])
def test_stream_errors_reset_only_their_stream(extra: bytes, code: int | None) -> None:
    s = opened(frame(h2wire.HEADERS_FRAME, H, 1, block()) + frame(h2wire.HEADERS_FRAME, H, 3, block()))
    if code is None:
        with pytest.raises(H2ConnectionError):
            s.receive(extra)
        return
    events = s.receive(extra)
    assert events[-1] == (h2wire.RESET, 1, code, 0)
    rst = [(sid, p) for t, _, sid, p in frames(s.data_to_send()) if t == h2wire.RST_STREAM_FRAME]
    assert rst == [(1, struct.pack(">L", code))]
    assert 3 in s.streams and 1 not in s.streams and not s.closed


def test_a_stream_depending_on_itself_is_a_stream_error() -> None:
    s = opened()
    events = s.receive(frame(h2wire.HEADERS_FRAME, H | h2wire.PRIORITY_FLAG, 1,
                             b"\x00\x00\x00\x01\x10" + block()))
    assert events == [(h2wire.RESET, 1, h2wire.PROTOCOL_ERROR, 0)]
    # HPACK stayed in step: the next stream decodes.
    assert s.receive(frame(h2wire.HEADERS_FRAME, H, 3, block()))[0][:2] == (h2wire.REQUEST, 3)


def test_goaway_from_the_peer_is_reported() -> None:
    s = opened()
    assert s.receive(frame(h2wire.GOAWAY_FRAME, 0, 0, struct.pack(">LL", 0, 2))) == [(h2wire.GOAWAY, 0, 2, 0)]


# --------------------------------------------------------------------------- fuzz


frame_st = st.builds(
    lambda t, f, sid, p: frame(t, f, sid, p),
    st.integers(0, 12), st.integers(0, 255), st.sampled_from([0, 1, 2, 3, 5, 2**31 - 1]),
    st.one_of(st.binary(max_size=40), st.just(block()), st.just(struct.pack(">HL", 4, 2**31 - 1))),
)


@settings(max_examples=400, deadline=None)
@given(st.lists(frame_st, max_size=12), st.integers(1, 64))
def test_fuzzed_frames_raise_only_connection_errors(fs: list[bytes], cut: int) -> None:
    s = server()
    data = PREFACE + SETTINGS0 + b"".join(fs)
    try:
        for i in range(0, len(data), cut):
            s.receive(data[i : i + cut])
            s.send_data(1, b"answer", end_stream=True)  # answering whatever is open must not fail
    except H2ConnectionError:
        assert frames(s.data_to_send())[-1][0] == h2wire.GOAWAY_FRAME


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300))
def test_fuzzed_bytes_raise_only_connection_errors(junk: bytes) -> None:
    s = server()
    with contextlib.suppress(H2ConnectionError):
        s.receive(PREFACE + SETTINGS0 + junk)


# --------------------------------------------------------------------------- through H2ServerProtocol


class _Transport:
    def __init__(self) -> None:
        self.data: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.data.append(bytes(data))

    def writelines(self, chunks: list[bytes]) -> None:
        self.data.extend(bytes(c) for c in chunks)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def get_extra_info(self, key: str, default: Any = None) -> Any:
        return ("127.0.0.1", 1) if key == "peername" else default

    def take(self) -> bytes:
        out = b"".join(self.data)
        self.data.clear()
        return out


_names = itertools.count()


def _proto(handler: Any, **limits: Any) -> tuple[H2ServerProtocol, _Transport, h2.connection.H2Connection,
                                                  ListenerStats]:
    cfg = from_dict({"node": {"name": "alpha", "ipv4": "10.144.144.1/24"}, "limits": limits})
    stats = ListenerStats(f"test-h2wire-{next(_names)}")  # stats are shared by name
    srv = H2ServerProtocol(handler, stats, cfg.limits, set())
    t = _Transport()
    srv.connection_made(t)  # type: ignore[arg-type]
    c = client({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 10})
    c.receive_data(t.take())
    srv.data_received(c.data_to_send())
    c.receive_data(t.take())
    return srv, t, c, stats


def _close(srv: H2ServerProtocol) -> None:
    if srv.timer is not None:
        srv.timer.cancel()
    srv.connection_lost(None)


async def test_a_queued_pooled_answer_is_dropped_on_reset_and_recycled_when_sent() -> None:
    pool = BufferPool(capacity=4096)
    handed: list[Any] = []

    def handler(method: str, path: str, headers: Any, body: bytes) -> Any:
        buf = pool.get()
        buf.write(b"a" * 1000)
        handed.append(buf)
        return (200, [("content-type", "application/dns-message")], buf)

    srv, t, c, _ = _proto(handler)
    c.send_headers(1, REQ, end_stream=True)
    srv.data_received(c.data_to_send())
    held: Buffer = handed[0]
    assert srv.streams[1].out is held and len(pool) == 0  # 10 bytes sent, the rest waits
    c.receive_data(t.take())
    c.reset_stream(1)
    srv.data_received(c.data_to_send())
    assert held.pool is None and 1 not in srv.streams and srv.active == 0  # dropped, never reused
    # The next answer goes out whole (window opened) and its buffer goes back to the pool.
    c.increment_flow_control_window(100_000)
    c.send_headers(3, REQ, end_stream=True)
    srv.data_received(c.data_to_send())
    events = c.receive_data(t.take())
    assert 3 in srv.streams  # the stream window (10) still holds it
    c.increment_flow_control_window(5000, stream_id=3)
    srv.data_received(c.data_to_send())
    events += c.receive_data(t.take())
    body = b"".join(e.data for e in events if isinstance(e, h2.events.DataReceived) and e.stream_id == 3)
    assert body == b"a" * 1000 and any(isinstance(e, h2.events.StreamEnded) for e in events)
    assert len(pool) == 1 and handed[1].pool is pool and 3 not in srv.streams
    _close(srv)
    await asyncio.sleep(0)


async def test_rapid_reset_past_the_cap_gets_enhance_your_calm() -> None:
    loop = asyncio.get_running_loop()
    never: list[asyncio.Future[Any]] = []

    def handler(method: str, path: str, headers: Any, body: bytes) -> Any:
        never.append(loop.create_future())
        return never[-1]

    srv, t, _, stats = _proto(handler, doh_max_streams=3)
    enc = hpack.Encoder()  # raw frames: h2 itself would not open streams past our advertised cap

    def req(sid: int) -> bytes:
        return frame(h2wire.HEADERS_FRAME, H | h2wire.END_STREAM, sid, enc.encode(REQ))

    # Three running handlers whose streams the client reset: still counted.
    srv.data_received(b"".join(req(sid) + frame(h2wire.RST_STREAM_FRAME, 0, sid, b"\x00\x00\x00\x08")
                               for sid in (1, 3, 5)))
    assert srv.active == 3 and all(s.reset for s in srv.streams.values())
    # 2 x cap refusals are tolerated; the seventh gets GOAWAY.
    srv.data_received(b"".join(req(sid) for sid in range(7, 21, 2)))
    out = t.take()
    codes = [struct.unpack(">L", p)[0] for ty, _, _, p in frames(out) if ty == h2wire.RST_STREAM_FRAME]
    assert codes == [h2wire.REFUSED_STREAM] * 7
    assert goaway_code(out) == h2wire.ENHANCE_YOUR_CALM and t.closed
    snap: Any = stats.snapshot()
    assert snap["drops"]["max_streams"] == 7 and snap["errors"]["rapid_reset"] == 1
    _close(srv)
    await asyncio.sleep(0)


async def test_streams_we_reset_for_bad_frames_still_count_while_running() -> None:
    """MadeYouReset (CVE-2025-8671): a client provoking our own stream errors (WINDOW_UPDATE of
    0) while the handlers run must not get past the cap either."""
    loop = asyncio.get_running_loop()
    never: list[asyncio.Future[Any]] = []

    def handler(method: str, path: str, headers: Any, body: bytes) -> Any:
        never.append(loop.create_future())
        return never[-1]

    srv, t, _, stats = _proto(handler, doh_max_streams=2)
    enc = hpack.Encoder()
    bad = struct.pack(">L", 0)
    srv.data_received(b"".join(
        frame(h2wire.HEADERS_FRAME, H | h2wire.END_STREAM, sid, enc.encode(REQ))
        + frame(h2wire.WINDOW_UPDATE_FRAME, 0, sid, bad) for sid in (1, 3, 5)))
    out = frames(t.take())
    assert [(sid, struct.unpack(">L", p)[0]) for ty, _, sid, p in out if ty == h2wire.RST_STREAM_FRAME] == [
        (1, h2wire.PROTOCOL_ERROR), (3, h2wire.PROTOCOL_ERROR), (5, h2wire.PROTOCOL_ERROR)]  # one RST each
    assert srv.active == 2 and stats.snapshot()["drops"] == {"max_streams": 1}
    for fut in never:  # the handlers finish: their answers are dropped, the slots come back
        fut.set_result((200, [], b"late"))
    await async_wait_until(lambda: srv.active == 0 and not srv.streams, 5, "the handlers' slots back")
    _close(srv)
    await asyncio.sleep(0)


async def test_protocol_errors_close_the_connection_with_goaway() -> None:
    srv, t, _, stats = _proto(lambda *a: (200, [], b""))
    srv.data_received(frame(h2wire.PING_FRAME, 0, 0, b"short"))
    assert goaway_code(t.take()) == h2wire.FRAME_SIZE_ERROR and t.closed
    assert stats.snapshot()["errors"] == {"h2_protocol": 1}
    _close(srv)
    await asyncio.sleep(0)


HEADS = [(b":method", b"GET"), (b":method", b"POST"), (b":path", b"/dns-query"), (b":scheme", b"https"),
         (b":authority", b"x"), (b"content-type", b"application/dns-message"), (b"Content-Type", b"x"),
         (b"content-length", b"33"), (b"x-a", b" pad"), (b"te", b"trailers"), (b"x-big", b"v" * 2000)]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(st.sampled_from(HEADS), max_size=7), min_size=1, max_size=10))
def test_memo_request_head_agrees_with_request_head(lists: list[list[tuple[bytes, bytes]]]) -> None:
    for hs in lists + lists:  # the second pass is the memo's
        got, want = memo_request_head(list(hs)), request_head(hs)
        assert got == want
        again = memo_request_head(list(hs))
        if got is not None and again is not None:
            assert got[3] is not again[3]  # the handler's own copy


def test_respond_is_one_headers_and_data_piece_when_it_fits() -> None:
    s, c = pair({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 100})
    c.send_headers(1, REQ, end_stream=True)
    c.send_headers(3, REQ, end_stream=True)
    s.receive(c.data_to_send())
    c.receive_data(s.data_to_send())
    hblock = s.encoder.encode([(":status", "200"), ("content-length", "100")])
    body = bytearray(b"a" * 100)
    assert s.respond(1, hblock, memoryview(body))
    body[:] = b"b" * 100  # joined at once: the caller may reuse its buffer
    out = s.data_to_send()
    assert [(t, f & (h2wire.END_STREAM | h2wire.END_HEADERS)) for t, f, _, _ in frames(out)] == [
        (h2wire.HEADERS_FRAME, h2wire.END_HEADERS), (h2wire.DATA_FRAME, h2wire.END_STREAM)]
    evs = c.receive_data(out)
    assert [e.data for e in evs if isinstance(e, h2.events.DataReceived)] == [b"a" * 100]
    assert any(isinstance(e, h2.events.StreamEnded) for e in evs) and 1 not in s.streams
    # Over the stream window (or empty, or over a frame): nothing queued, the caller frames it.
    assert not s.respond(3, hblock, b"x" * 101) and not s.respond(3, hblock, b"")
    assert not s.respond(5, hblock, b"x") and s.data_to_send() == b"" and 3 in s.streams
