"""A sans-I/O HTTP/2 server connection (RFC 9113) cut to what DoH and ODoH need.

Bytes in (`receive`), events and bytes out (`data_to_send`); no sockets, no clock. It replaces
h2's state machine on the server side, whose generality (event objects, hyperframe frame
objects, a state machine per stream, priority trees) cost about two thirds of a DoH query's CPU.

What it does: the client preface; SETTINGS both ways (ours: MAX_CONCURRENT_STREAMS,
MAX_HEADER_LIST_SIZE, INITIAL_WINDOW_SIZE; theirs: HEADER_TABLE_SIZE, INITIAL_WINDOW_SIZE,
MAX_FRAME_SIZE applied, ENABLE_PUSH checked); HEADERS with CONTINUATION, PADDED and PRIORITY;
DATA with padding and END_STREAM; WINDOW_UPDATE both ways (the peer's windows are given back as
we consume, since the application takes every byte at once); RST_STREAM; PING; GOAWAY;
PRIORITY and unknown frame types ignored. Streams: idle -> open -> half-closed(remote) ->
closed, client ids odd and increasing. The application decides stream caps and refusals (it
counts streams whose handler still runs after a reset, which this layer cannot know).

Events are plain tuples (kind, stream id, a, b), cheaper than objects:

    (REQUEST, sid, headers: list[(bytes, bytes)], end_stream: bool)
    (DATA, sid, data: bytes, end_stream: bool)          data may be b"" (END_STREAM via trailers)
    (RESET, sid, error code, 0)                          the peer reset it, or we did (stream error)
    (WINDOW, sid or 0, 0, 0)                             send room appeared (0: maybe on any stream)
    (GOAWAY, last stream id, error code, 0)              the peer is closing the connection

A connection error queues GOAWAY with the right code and raises H2ConnectionError; the caller
sends data_to_send() and closes. A stream error sends RST_STREAM and reports RESET.

Bytes handed to send_data() are referenced, not copied, until the next data_to_send() joins
everything queued into one bytes object: a pooled answer buffer may be recycled after that.
"""

from __future__ import annotations

import struct
from typing import Any, NoReturn

import hpack

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

# Frame types (RFC 9113 6)
DATA_FRAME, HEADERS_FRAME, PRIORITY_FRAME, RST_STREAM_FRAME, SETTINGS_FRAME = 0, 1, 2, 3, 4
PUSH_PROMISE_FRAME, PING_FRAME, GOAWAY_FRAME, WINDOW_UPDATE_FRAME, CONTINUATION_FRAME = 5, 6, 7, 8, 9
# Flags
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20
# Error codes (RFC 9113 7)
NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR = 0x0, 0x1, 0x2, 0x3
STREAM_CLOSED, FRAME_SIZE_ERROR, REFUSED_STREAM, CANCEL = 0x5, 0x6, 0x7, 0x8
COMPRESSION_ERROR, ENHANCE_YOUR_CALM = 0x9, 0xB
# Settings (RFC 9113 6.5.2)
HEADER_TABLE_SIZE, ENABLE_PUSH, MAX_CONCURRENT_STREAMS = 0x1, 0x2, 0x3
INITIAL_WINDOW_SIZE, MAX_FRAME_SIZE, MAX_HEADER_LIST_SIZE = 0x4, 0x5, 0x6

# Event kinds
REQUEST, DATA, RESET, WINDOW, GOAWAY = 0, 1, 2, 3, 4

DEFAULT_WINDOW = 65535
DEFAULT_FRAME = 16384
MAX_CONTINUATIONS = 32  # per header block: 16 KiB fits in two full frames; room for finer splits
MAX_WINDOW = 2**31 - 1
Event = tuple[int, int, Any, Any]

_HEAD = struct.Struct(">HBBBL")  # 24-bit length as 16 + 8 bits, type, flags, R + stream id
_U32 = struct.Struct(">L")
_SETTING = struct.Struct(">HL")
_GOAWAY = struct.Struct(">LL")


class H2ConnectionError(Exception):
    """A connection error (RFC 9113 5.4.1): GOAWAY(code) is queued; close after sending it."""

    def __init__(self, code: int, msg: str) -> None:
        super().__init__(msg)
        self.code = code


class _StreamError(Exception):
    def __init__(self, sid: int, code: int) -> None:
        super().__init__(sid, code)
        self.sid = sid
        self.code = code


def frame(ftype: int, flags: int, sid: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    return _HEAD.pack(n >> 8, n & 0xFF, ftype, flags, sid) + payload


class _Stream:
    __slots__ = ("recv_left", "remote_closed", "send_window")

    def __init__(self, send_window: int, recv_window: int) -> None:
        self.send_window = send_window
        self.recv_left = recv_window  # what the peer may still send before we give window back
        self.remote_closed = False


class H2Wire:
    """One server-side HTTP/2 connection, sans I/O."""

    def __init__(self, *, max_streams: int, max_header_list: int, initial_window: int = DEFAULT_WINDOW,
                 encoder: hpack.Encoder | None = None, decoder: hpack.Decoder | None = None) -> None:
        self.encoder = encoder if encoder is not None else hpack.Encoder()
        self.decoder = decoder if decoder is not None else hpack.Decoder()
        self.decoder.max_header_list_size = max_header_list
        self.max_streams = max_streams
        self.max_header_list = max_header_list
        self.initial_window = initial_window  # ours: what each stream may send us
        # A header block (HEADERS + CONTINUATION) bigger than this is a flood, not a request.
        self.max_block = 2 * max_header_list
        self.streams: dict[int, _Stream] = {}
        self.last_sid = 0  # highest client stream id seen (GOAWAY's last-stream-id)
        self.peer_window = DEFAULT_WINDOW  # the peer's INITIAL_WINDOW_SIZE for our sending
        self.peer_frame = DEFAULT_FRAME  # the peer's MAX_FRAME_SIZE
        self.send_window = DEFAULT_WINDOW  # connection-level send window
        self.recv_consumed = 0  # connection-level bytes received since our last WINDOW_UPDATE
        self.closed = False
        self._out: list[bytes | memoryview] = []
        self._buf = b""
        self._preface = False
        self._settings_seen = False
        self._block: bytearray | None = None  # header block awaiting CONTINUATION
        self._block_sid = 0
        self._block_end = False
        self._block_bad = False
        self._block_frames = 0

    @property
    def header_block_open(self) -> bool:
        """A HEADERS frame came without END_HEADERS and its CONTINUATIONs are not all in (the
        connection can carry nothing else until they are: the server puts a deadline on it)."""
        return self._block is not None

    # ------------------------------------------------------------------ output

    def initiate(self) -> None:
        """Queue our SETTINGS (the server preface)."""
        payload = b"".join((_SETTING.pack(MAX_CONCURRENT_STREAMS, self.max_streams),
                            _SETTING.pack(MAX_HEADER_LIST_SIZE, self.max_header_list),
                            _SETTING.pack(INITIAL_WINDOW_SIZE, self.initial_window)))
        self._out.append(frame(SETTINGS_FRAME, 0, 0, payload))

    def data_to_send(self) -> bytes:
        out = self._out
        if not out:
            return b""
        self._out = []
        return out[0] if len(out) == 1 and type(out[0]) is bytes else b"".join(out)

    def window(self, sid: int) -> int:
        """Bytes of DATA that may go out now on `sid` (0 for an unknown stream)."""
        st = self.streams.get(sid)
        if st is None:
            return 0
        return min(st.send_window, self.send_window)

    def send_headers(self, sid: int, headers: list[tuple[str, str]], end_stream: bool) -> None:
        self.send_block(sid, self.encoder.encode(headers), end_stream)

    def send_block(self, sid: int, block: bytes, end_stream: bool) -> None:
        """send_headers() for a header block the caller encoded with this connection's encoder."""
        flags = END_STREAM if end_stream else 0
        limit = self.peer_frame
        if len(block) <= limit:
            n = len(block)
            self._out.append(_HEAD.pack(n >> 8, n & 0xFF, HEADERS_FRAME, flags | END_HEADERS, sid) + block)
        else:
            self._out.append(frame(HEADERS_FRAME, flags, sid, block[:limit]))
            for a in range(limit, len(block), limit):
                last = a + limit >= len(block)
                flag = END_HEADERS if last else 0
                self._out.append(frame(CONTINUATION_FRAME, flag, sid, block[a : a + limit]))
        if end_stream:
            self._local_end(sid)

    def respond(self, sid: int, block: bytes, data: bytes | memoryview) -> bool:
        """A whole response in one piece: HEADERS (an encoded `block`, END_HEADERS) and one DATA
        frame with END_STREAM, joined into one bytes object now (so `data` may be reused at once).
        Only when it fits the peer's frame size and both send windows, and `data` is not empty;
        returns False without queueing anything otherwise (use send_headers/send_data)."""
        st = self.streams.get(sid)
        n = len(data)
        limit = self.peer_frame
        if (st is None or not n or n > limit or len(block) > limit or n > st.send_window
                or n > self.send_window):
            return False
        pack = _HEAD.pack
        b = len(block)
        self._out.append(b"".join((pack(b >> 8, b & 0xFF, HEADERS_FRAME, END_HEADERS, sid), block,
                                   pack(n >> 8, n & 0xFF, DATA_FRAME, END_STREAM, sid), data)))
        st.send_window -= n
        self.send_window -= n
        self._local_end(sid)
        return True

    def send_data(self, sid: int, data: bytes | memoryview, end_stream: bool) -> int:
        """Queue as much of `data` as the windows and the peer's frame size allow, in DATA frames;
        END_STREAM goes on the frame carrying the last byte. Returns the bytes queued."""
        st = self.streams.get(sid)
        if st is None:
            return 0
        n = len(data)
        room = min(st.send_window, self.send_window, n)
        limit = self.peer_frame
        out = self._out
        off = 0
        while off < room or (n == 0 and end_stream and off == 0):
            k = min(room - off, limit)
            flags = END_STREAM if end_stream and off + k == n else 0
            out.append(_HEAD.pack(k >> 8, k & 0xFF, DATA_FRAME, flags, sid))
            if k:
                out.append(data[off : off + k])
            off += k
            if n == 0:
                break
        st.send_window -= off
        self.send_window -= off
        if end_stream and off == n:
            self._local_end(sid)
        return off

    def reset(self, sid: int, code: int) -> None:
        """Reset a stream that is open; nothing for one already closed (never two RST_STREAMs,
        e.g. when a stream error here and the application's refusal meet in one read)."""
        if self.streams.pop(sid, None) is not None:
            self._out.append(frame(RST_STREAM_FRAME, 0, sid, _U32.pack(code)))

    def goaway(self, code: int = NO_ERROR) -> None:
        if not self.closed:
            self.closed = True
            self._out.append(frame(GOAWAY_FRAME, 0, 0, _GOAWAY.pack(self.last_sid, code)))

    def _local_end(self, sid: int) -> None:
        st = self.streams.pop(sid, None)
        if st is not None and not st.remote_closed:
            # Answered before the request ended (413): ask the client to stop sending
            # (RFC 9113 8.1) rather than keep a half-closed stream the client may never end.
            self._out.append(frame(RST_STREAM_FRAME, 0, sid, _U32.pack(NO_ERROR)))

    # ------------------------------------------------------------------ input

    def receive(self, data: bytes) -> list[Event]:
        """Parse what arrived; events for what it completed. Raises H2ConnectionError."""
        if self.closed:
            return []
        buf = self._buf + data if self._buf else data
        events: list[Event] = []
        off = 0
        if not self._preface:
            if len(buf) < len(PREFACE):
                if not PREFACE.startswith(buf):
                    self._fail(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
                self._buf = bytes(buf)
                return events
            if buf[: len(PREFACE)] != PREFACE:
                self._fail(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
            self._preface = True
            off = len(PREFACE)
        end = len(buf)
        unpack = _HEAD.unpack_from
        try:
            while end - off >= 9:
                hi, lo, ftype, flags, sid = unpack(buf, off)
                length = hi << 8 | lo
                if length > DEFAULT_FRAME:  # our MAX_FRAME_SIZE: never raised
                    self._fail(FRAME_SIZE_ERROR, f"frame of {length} bytes")
                if end - off - 9 < length:
                    break
                payload = buf[off + 9 : off + 9 + length]
                off += 9 + length
                sid &= 0x7FFFFFFF
                try:
                    self._frame(ftype, flags, sid, payload, events)
                except _StreamError as e:
                    self.streams.pop(e.sid, None)
                    self._out.append(frame(RST_STREAM_FRAME, 0, e.sid, _U32.pack(e.code)))
                    events.append((RESET, e.sid, e.code, 0))
        except H2ConnectionError:
            self._buf = b""
            raise
        self._buf = bytes(buf[off:]) if off < end else b""
        return events

    def _fail(self, code: int, msg: str) -> NoReturn:
        self.goaway(code)
        raise H2ConnectionError(code, msg)

    def _frame(self, ftype: int, flags: int, sid: int, p: bytes, events: list[Event]) -> None:
        if self._block is not None and ftype != CONTINUATION_FRAME:
            self._fail(PROTOCOL_ERROR, "header block interrupted by another frame")
        if not self._settings_seen:
            if ftype != SETTINGS_FRAME or flags & ACK:
                self._fail(PROTOCOL_ERROR, "first frame is not SETTINGS")
            self._settings_seen = True
        if ftype == DATA_FRAME:
            self._data(flags, sid, p, events)
        elif ftype == HEADERS_FRAME:
            self._headers(flags, sid, p, events)
        elif ftype == CONTINUATION_FRAME:
            self._continuation(flags, sid, p, events)
        elif ftype == WINDOW_UPDATE_FRAME:
            self._window_update(sid, p, events)
        elif ftype == SETTINGS_FRAME:
            self._settings(flags, sid, p, events)
        elif ftype == RST_STREAM_FRAME:
            if sid == 0:
                self._fail(PROTOCOL_ERROR, "RST_STREAM on stream 0")
            if len(p) != 4:
                self._fail(FRAME_SIZE_ERROR, "RST_STREAM length")
            if sid > self.last_sid:
                self._fail(PROTOCOL_ERROR, "RST_STREAM on an idle stream")
            if self.streams.pop(sid, None) is not None:
                events.append((RESET, sid, _U32.unpack(p)[0], 0))
        elif ftype == PING_FRAME:
            if sid != 0:
                self._fail(PROTOCOL_ERROR, "PING on a stream")
            if len(p) != 8:
                self._fail(FRAME_SIZE_ERROR, "PING length")
            if not flags & ACK:
                self._out.append(frame(PING_FRAME, ACK, 0, p))
        elif ftype == PRIORITY_FRAME:
            if sid == 0:
                self._fail(PROTOCOL_ERROR, "PRIORITY on stream 0")
            if len(p) != 5:
                self._fail(FRAME_SIZE_ERROR, "PRIORITY length")
            if _U32.unpack_from(p)[0] & 0x7FFFFFFF == sid:
                raise _StreamError(sid, PROTOCOL_ERROR)  # depends on itself (RFC 9113 5.3.1)
        elif ftype == GOAWAY_FRAME:
            if sid != 0:
                self._fail(PROTOCOL_ERROR, "GOAWAY on a stream")
            if len(p) < 8:
                self._fail(FRAME_SIZE_ERROR, "GOAWAY length")
            last, code = _GOAWAY.unpack_from(p)
            events.append((GOAWAY, last & 0x7FFFFFFF, code, 0))
        elif ftype == PUSH_PROMISE_FRAME:
            self._fail(PROTOCOL_ERROR, "PUSH_PROMISE from a client")
        # Unknown frame types are ignored (RFC 9113 5.5).

    def _unpad(self, flags: int, p: bytes) -> bytes:
        if flags & PADDED:
            if not p:
                self._fail(FRAME_SIZE_ERROR, "padded frame without a pad length")
            pad = p[0]
            if pad >= len(p):
                self._fail(PROTOCOL_ERROR, "padding longer than the frame")
            return p[1 : len(p) - pad]
        return p

    def _data(self, flags: int, sid: int, p: bytes, events: list[Event]) -> None:
        if sid == 0:
            self._fail(PROTOCOL_ERROR, "DATA on stream 0")
        if sid > self.last_sid:
            self._fail(PROTOCOL_ERROR, "DATA on an idle stream")
        n = len(p)  # padding counts against flow control too
        self.recv_consumed += n
        if self.recv_consumed > DEFAULT_WINDOW:
            self._fail(FLOW_CONTROL_ERROR, "connection receive window exceeded")
        # The application consumes every byte at once: give the window back once half is used.
        if self.recv_consumed >= DEFAULT_WINDOW // 2:
            self._out.append(frame(WINDOW_UPDATE_FRAME, 0, 0, _U32.pack(self.recv_consumed)))
            self.recv_consumed = 0
        st = self.streams.get(sid)
        if st is None:
            return  # closed (we reset it, or answered it): late frames are dropped
        if st.remote_closed:
            raise _StreamError(sid, STREAM_CLOSED)
        st.recv_left -= n
        if st.recv_left < 0:
            raise _StreamError(sid, FLOW_CONTROL_ERROR)
        body = self._unpad(flags, p)
        end = bool(flags & END_STREAM)
        if end:
            st.remote_closed = True
        elif self.initial_window - st.recv_left >= self.initial_window // 2:
            grant = self.initial_window - st.recv_left
            st.recv_left = self.initial_window
            self._out.append(frame(WINDOW_UPDATE_FRAME, 0, sid, _U32.pack(grant)))
        events.append((DATA, sid, body, end))

    def _headers(self, flags: int, sid: int, p: bytes, events: list[Event]) -> None:
        if sid == 0:
            self._fail(PROTOCOL_ERROR, "HEADERS on stream 0")
        block = self._unpad(flags, p)
        bad = False
        if flags & PRIORITY_FLAG:
            if len(block) < 5:
                self._fail(FRAME_SIZE_ERROR, "HEADERS too short for its priority fields")
            bad = _U32.unpack_from(block)[0] & 0x7FFFFFFF == sid  # depends on itself (5.3.1)
            block = block[5:]
        if len(block) > self.max_block:
            self._fail(ENHANCE_YOUR_CALM, "header block too large")
        end = bool(flags & END_STREAM)
        if flags & END_HEADERS:
            self._block_done(sid, block, end, bad, events)
        else:
            self._block = bytearray(block)
            self._block_sid, self._block_end, self._block_bad = sid, end, bad
            self._block_frames = 0

    def _continuation(self, flags: int, sid: int, p: bytes, events: list[Event]) -> None:
        block = self._block
        if block is None or sid != self._block_sid:
            self._fail(PROTOCOL_ERROR, "unexpected CONTINUATION")
        block += p
        self._block_frames += 1
        # Empty CONTINUATIONs never grow the block: count them too (CVE-2024-27316 and kin).
        if self._block_frames > MAX_CONTINUATIONS:
            self._fail(ENHANCE_YOUR_CALM, "too many CONTINUATION frames")
        if len(block) > self.max_block:
            self._fail(ENHANCE_YOUR_CALM, "header block too large")
        if flags & END_HEADERS:
            self._block = None
            self._block_done(sid, bytes(block), self._block_end, self._block_bad, events)

    def _block_done(self, sid: int, block: bytes, end: bool, bad: bool, events: list[Event]) -> None:
        try:
            # Always decoded, even for a stream we refuse: the HPACK table must stay in step.
            headers = self.decoder.decode(block, raw=True)
        except hpack.OversizedHeaderListError:
            self._fail(ENHANCE_YOUR_CALM, "header list over MAX_HEADER_LIST_SIZE")
        except (hpack.HPACKError, IndexError, ValueError, TypeError, UnicodeDecodeError):
            self._fail(COMPRESSION_ERROR, "undecodable header block")
        st = self.streams.get(sid)
        if st is not None:  # trailers
            if st.remote_closed:
                raise _StreamError(sid, STREAM_CLOSED)
            if not end or bad:
                raise _StreamError(sid, PROTOCOL_ERROR)
            st.remote_closed = True
            events.append((DATA, sid, b"", True))
            return
        if sid <= self.last_sid:
            return  # a stream that is closed (answered or reset): dropped
        if not sid & 1:
            self._fail(PROTOCOL_ERROR, "even stream id from a client")
        self.last_sid = sid
        if bad:
            raise _StreamError(sid, PROTOCOL_ERROR)
        st = _Stream(self.peer_window, self.initial_window)
        st.remote_closed = end
        self.streams[sid] = st
        events.append((REQUEST, sid, headers, end))

    def _window_update(self, sid: int, p: bytes, events: list[Event]) -> None:
        if len(p) != 4:
            self._fail(FRAME_SIZE_ERROR, "WINDOW_UPDATE length")
        inc = _U32.unpack(p)[0] & 0x7FFFFFFF
        if sid == 0:
            if inc == 0:
                self._fail(PROTOCOL_ERROR, "WINDOW_UPDATE of 0")
            self.send_window += inc
            if self.send_window > MAX_WINDOW:
                self._fail(FLOW_CONTROL_ERROR, "connection window over 2^31-1")
            events.append((WINDOW, 0, 0, 0))
            return
        if sid > self.last_sid:
            self._fail(PROTOCOL_ERROR, "WINDOW_UPDATE on an idle stream")
        st = self.streams.get(sid)
        if st is None:
            return
        if inc == 0:
            raise _StreamError(sid, PROTOCOL_ERROR)
        st.send_window += inc
        if st.send_window > MAX_WINDOW:
            raise _StreamError(sid, FLOW_CONTROL_ERROR)
        events.append((WINDOW, sid, 0, 0))

    def _settings(self, flags: int, sid: int, p: bytes, events: list[Event]) -> None:
        if sid != 0:
            self._fail(PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & ACK:
            if p:
                self._fail(FRAME_SIZE_ERROR, "SETTINGS ACK with a payload")
            return
        if len(p) % 6:
            self._fail(FRAME_SIZE_ERROR, "SETTINGS length")
        opened = False
        for off in range(0, len(p), 6):
            key, value = _SETTING.unpack_from(p, off)
            if key == INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    self._fail(FLOW_CONTROL_ERROR, "INITIAL_WINDOW_SIZE over 2^31-1")
                delta = value - self.peer_window
                self.peer_window = value
                for st in self.streams.values():
                    st.send_window += delta
                    if st.send_window > MAX_WINDOW:
                        self._fail(FLOW_CONTROL_ERROR, "a stream window over 2^31-1")
                opened = opened or delta > 0
            elif key == MAX_FRAME_SIZE:
                if not DEFAULT_FRAME <= value <= 16777215:
                    self._fail(PROTOCOL_ERROR, "MAX_FRAME_SIZE out of range")
                self.peer_frame = value
            elif key == HEADER_TABLE_SIZE:
                # The encoder emits the size update at the start of its next block.
                self.encoder.header_table_size = min(value, 4096)
            elif key == ENABLE_PUSH and value > 1:
                self._fail(PROTOCOL_ERROR, "ENABLE_PUSH not 0 or 1")
            # MAX_CONCURRENT_STREAMS and MAX_HEADER_LIST_SIZE: we push nothing, send small heads.
        self._out.append(frame(SETTINGS_FRAME, ACK, 0))
        if opened:
            events.append((WINDOW, 0, 0, 0))
