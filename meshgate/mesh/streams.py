"""End-to-end multiplexed streams over the mesh, with credit-based flow control.

A stream is identified by (remote node, stream id, who opened it): each
side allocates ids for the streams it opens, and every stream frame carries
FLAG_OPENER when sent by the opener, so both directions share one id space
without collisions.

Flow control: each side grants the other a window of bytes
(`limits.stream_window`) in OPEN/ACCEPT and tops it up with WINDOW frames as
its application consumes data. A sender never has more than the window in
flight, so a slow reader bounds memory at the sender, at every relay (which
keeps no per-stream state) and at the receiver. A peer that overruns the
window is reset.

`MeshStream` is an `asyncio.Transport` for the application's protocol; it
owns no socket and reads no clock: frames go out through the mux's `send`
callable and come in through `StreamMux.on_frame`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import struct
from collections.abc import Callable
from typing import Any

from meshgate import replies
from meshgate.logs import RateLimitedLog
from meshgate.mesh.e2e import SEAL_OVERHEAD
from meshgate.mesh.frames import (
    FLAG_OPENER,
    MAX_BODY,
    STREAM_ACCEPT,
    STREAM_DATA,
    STREAM_FIN,
    STREAM_OPEN,
    STREAM_RESET,
    STREAM_WINDOW,
)
from meshgate.metrics import REGISTRY
from meshgate.replies import GENERAL_FAILURE, NETWORK_UNREACHABLE, NOT_ALLOWED

log = logging.getLogger("meshgate.mesh.streams")
_rlog = RateLimitedLog(log)

# Reset codes are SOCKS5 reply codes (meshgate/replies.py) so the portal can pass them straight on.
CODE_NAMES = replies.WORDS

SID_SIZE = 4
# payload per DATA frame: one frame fills one sealed link record, with room for the end-to-end
# seal a relayed frame gets (mesh/e2e.py)
MAX_DATA = MAX_BODY - SID_SIZE - SEAL_OVERHEAD

OPEN = struct.Struct("!IIHB")  # sid, window, port, host length; then host
ACCEPT = struct.Struct("!II")  # sid, window
SID = struct.Struct("!I")
WINDOW = struct.Struct("!II")  # sid, credit
RESET = struct.Struct("!IB")  # sid, code

_streams_total = REGISTRY.counter("meshgate_mesh_streams_total", "Mesh streams", ("side", "result"))
_stream_drops = REGISTRY.counter(
    "meshgate_mesh_stream_frames_dropped_total", "Stream frames dropped", ("reason",)
)
_active = REGISTRY.gauge("meshgate_mesh_streams_active", "Open mesh streams")


class StreamError(replies.ReplyError):
    """A stream could not be opened or was reset; `code` is a SOCKS5 reply code."""


# send(ftype, flags, dst, head, data) -> routed?
SendFn = Callable[[int, int, int, bytes, bytes | bytearray | memoryview], bool]
StreamKey = tuple[int, int, bool]  # (remote node, sid, opened locally)


def encode_open(sid: int, window: int, host: str, port: int) -> bytes:
    h = host.encode("idna" if not host.isascii() else "ascii", "replace")[:255]
    return OPEN.pack(sid, window, port, len(h)) + h


def decode_open(body: memoryview) -> tuple[int, int, str, int]:
    if len(body) < OPEN.size:
        raise ValueError("truncated open")
    sid, window, port, n = OPEN.unpack_from(body)
    if len(body) != OPEN.size + n or n == 0:
        raise ValueError("bad open host length")
    return sid, window, bytes(body[OPEN.size :]).decode("ascii", "replace"), port


class MeshStream(asyncio.Transport):
    """One end of a mesh stream, seen by its protocol as an asyncio transport."""

    def __init__(self, mux: StreamMux, peer: int, sid: int, local_opener: bool, window: int) -> None:
        super().__init__()
        self._mux = mux
        self.peer = peer
        self.sid = sid
        self.local_opener = local_opener
        self._flags = FLAG_OPENER if local_opener else 0
        self._sid_bytes = SID.pack(sid)
        self._protocol: asyncio.BaseProtocol | None = None
        self.window = window
        self.send_credit = 0
        self.credit_full = 0  # the credit the peer granted at first: all of it back = nothing in flight
        # moving to another path (MeshService): hold new data until all sent is consumed
        self.draining = False
        self._drain_timer: asyncio.TimerHandle | None = None
        self.recv_allowed = window  # bytes the peer may still send before we grant more
        self._consumed = 0  # delivered since our last WINDOW grant
        self._send_buf = bytearray()
        self._recv_buf: list[bytes] = []
        self._recv_buffered = 0
        self._high = 4 * window
        self._low = window
        self._write_paused = False
        self._reading_paused = False
        self.accepted = False
        self.fin_sent = False
        self._fin_pending = False
        self.fin_received = False
        self._eof_delivered = False
        self._closing = False
        self.closed = False
        self._extra: dict[str, Any] = {"peername": (f"mesh:{peer:08x}", sid), "sockname": None}
        self.bytes_in = 0
        self.bytes_out = 0

    # ------------------------------------------------------------ asyncio.Transport API

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._extra.get(name, default)

    def is_closing(self) -> bool:
        return self._closing or self.closed

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._protocol = protocol

    def get_protocol(self) -> asyncio.BaseProtocol:
        assert self._protocol is not None
        return self._protocol

    def is_reading(self) -> bool:
        return not self._reading_paused

    def pause_reading(self) -> None:
        self._reading_paused = True

    def resume_reading(self) -> None:
        if not self._reading_paused:
            return
        self._reading_paused = False
        self._deliver_buffered()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        if high is None:
            high = 4 * self.window if low is None else 4 * low
        if low is None:
            low = high // 4
        self._high, self._low = high, low
        self._check_pause()

    @property
    def quiet(self) -> bool:
        """None of our data is in flight: the peer consumed all we sent (its whole credit is
        back), so a frame sent on another path now cannot overtake any of ours."""
        return self.send_credit >= self.credit_full

    def drain(self, give_up_after: float) -> None:
        """Hold new data until all we sent is consumed, and ask the peer to return its credit
        now (a STREAM_WINDOW of 0: "grant what you consumed"), so the stream can move to a new
        path without reordering. A peer that never answers (one from before this) leaves it
        where it is after `give_up_after` seconds."""
        if self.draining or self.closed or self.quiet:
            return
        self.draining = True
        # the probe goes after the frame in hand (the one whose send decided to move): the
        # peer's answer then covers every byte sent
        self._mux.loop.call_soon(self._ask_credit)
        self._drain_timer = self._mux.loop.call_later(give_up_after, self._drained, False)

    def _ask_credit(self) -> None:
        if self.draining and not self.closed:
            self._mux.send(STREAM_WINDOW, self._flags, self.peer, WINDOW.pack(self.sid, 0), b"")

    def _drained(self, moved: bool) -> None:
        self.draining = False
        if self._drain_timer is not None:
            self._drain_timer.cancel()
            self._drain_timer = None
        if not moved:
            self._mux.drain_gave_up(self)
        if self._send_buf or self._fin_pending:
            self._flush()
            self._check_pause()

    def get_write_buffer_size(self) -> int:
        return len(self._send_buf)

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._low, self._high

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._closing or self.closed or self.fin_sent or self._fin_pending:
            return  # like asyncio after close: silently ignored
        if not data:
            return
        if self._send_buf or self.send_credit <= 0 or self.draining:
            self._send_buf += data
        else:
            n = len(data)
            credit = self.send_credit
            if n <= credit and n <= MAX_DATA:
                self._emit_data(data)
            else:
                self._send_buf += data
                self._flush()
        if self._send_buf or self._write_paused:  # else there is nothing to pause or resume
            self._check_pause()

    def writelines(self, list_of_data: Any) -> None:
        for d in list_of_data:
            self.write(d)

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        if self.fin_sent or self._fin_pending or self.closed:
            return
        self._fin_pending = True
        self._flush()

    def close(self) -> None:
        """Flush, send FIN, and tell the protocol connection_lost(None)."""
        if self._closing or self.closed:
            return
        self._closing = True
        self.write_eof()
        self._maybe_finish()

    def abort(self) -> None:
        self.reset(GENERAL_FAILURE, local=True)

    # ------------------------------------------------------------ internals

    def _emit_data(self, data: bytes | bytearray | memoryview) -> None:
        n = len(data)
        # credit is taken after the send: the mesh asks `quiet` (is any of our data in
        # flight?) to pick this frame's path, and this frame is not in flight yet
        sent = self._mux.send(STREAM_DATA, self._flags, self.peer, self._sid_bytes, data)
        self.send_credit -= n
        self.bytes_out += n
        if not sent:
            self._mux.loop.call_soon(self.reset, NETWORK_UNREACHABLE, True)

    def _flush(self) -> None:
        buf = self._send_buf
        if self.draining:
            return  # FIN waits behind the held data too
        if buf and self.send_credit > 0 and not self.closed:
            view = memoryview(buf)
            pos = 0
            end = len(buf)
            try:
                while pos < end and self.send_credit > 0:
                    n = min(end - pos, self.send_credit, MAX_DATA)
                    self._emit_data(view[pos : pos + n])
                    pos += n
            finally:
                view.release()
            del buf[:pos]
        if self._fin_pending and not buf and not self.fin_sent and not self.closed:
            self.fin_sent = True
            self._mux.send(STREAM_FIN, self._flags, self.peer, self._sid_bytes, b"")
            self._maybe_finish()

    def _check_pause(self) -> None:
        size = len(self._send_buf)
        proto = self._protocol
        if not self._write_paused and size > self._high:
            self._write_paused = True
            if isinstance(proto, asyncio.Protocol):
                proto.pause_writing()
        elif self._write_paused and size <= self._low:
            self._write_paused = False
            if isinstance(proto, asyncio.Protocol):
                proto.resume_writing()

    def _grant(self, n: int) -> None:
        self._consumed += n
        if self._consumed >= self.window // 4 and not self.closed and not self.fin_received:
            credit = self._consumed
            self._consumed = 0
            self.recv_allowed += credit
            self._mux.send(STREAM_WINDOW, self._flags, self.peer, WINDOW.pack(self.sid, credit), b"")

    def _deliver_buffered(self) -> None:
        proto = self._protocol
        while self._recv_buf and not self._reading_paused and not self.closed:
            chunk = self._recv_buf.pop(0)
            self._recv_buffered -= len(chunk)
            if isinstance(proto, asyncio.Protocol):
                proto.data_received(chunk)
            self._grant(len(chunk))
        if not self._recv_buf and self.fin_received and not self._eof_delivered and not self._reading_paused:
            self._deliver_eof()

    def _deliver_eof(self) -> None:
        self._eof_delivered = True
        proto = self._protocol
        keep_open = proto.eof_received() if isinstance(proto, asyncio.Protocol) else False
        if not keep_open:
            self.close()
        self._maybe_finish()

    def _maybe_finish(self) -> None:
        """Both FINs exchanged (or closed locally and all sent): the stream is done."""
        if self.closed:
            return
        if self.fin_sent and ((self.fin_received and self._eof_delivered) or self._closing):
            if self._closing and not self.fin_received:
                # closed locally: the protocol is told now; the stream entry lingers
                # until the peer's FIN/RESET so its late data is credited, not reset
                self._lost(None, keep_entry=True)
                return
            self._lost(None)

    def _lost(self, exc: Exception | None, keep_entry: bool = False) -> None:
        if self._drain_timer is not None:
            self._drain_timer.cancel()
            self._drain_timer = None
        if self.closed:
            if not keep_entry:
                self._mux.remove(self)
            return
        self.closed = True
        if not keep_entry:
            self._mux.remove(self)
        proto = self._protocol
        self._send_buf = bytearray()
        self._recv_buf.clear()
        if proto is not None:
            self._mux.loop.call_soon(proto.connection_lost, exc)

    # ------------------------------------------------------------ frames from the peer

    def on_data(self, data: memoryview) -> None:
        n = len(data)
        if n > self.recv_allowed:
            _stream_drops.labels("window_overrun").inc()
            _rlog.debug(
                f"overrun:{self.peer}", "stream %08x/%d overran its window; reset", self.peer, self.sid
            )
            self.reset(GENERAL_FAILURE)
            return
        self.recv_allowed -= n
        self.bytes_in += n
        if self.closed or self.fin_received:
            self._grant(n)  # closed locally: discard, keep the peer unblocked
            return
        chunk = bytes(data)
        proto = self._protocol
        if (
            self._reading_paused or self._recv_buf or not self.accepted
            or not isinstance(proto, asyncio.Protocol)
        ):
            self._recv_buf.append(chunk)
            self._recv_buffered += n
            return
        proto.data_received(chunk)
        self._grant(n)

    def on_window(self, credit: int) -> None:
        if credit == 0:
            # the peer asks for its credit back (it is moving the stream): grant what our
            # protocol consumed, however little
            if self._consumed and not self.closed and not self.fin_received:
                credit_back, self._consumed = self._consumed, 0
                self.recv_allowed += credit_back
                self._mux.send(STREAM_WINDOW, self._flags, self.peer, WINDOW.pack(self.sid, credit_back), b"")
            return
        # never more in flight than our own window (limits.stream_window), whatever the peer
        # grants: a peer that grants 2^32 and stops reading must not fill our memory
        self.send_credit = min(self.send_credit + credit, self._mux.window)
        if self.draining:
            if self.quiet:
                self._drained(True)
            return
        if self._send_buf or self._fin_pending:
            self._flush()
            self._check_pause()

    def on_fin(self) -> None:
        if self.fin_received:
            return
        self.fin_received = True
        if self.closed:
            self._mux.remove(self)
            return
        if self.accepted and not self._recv_buf and not self._reading_paused:
            self._deliver_eof()

    def reset(self, code: int, local: bool = False) -> None:
        """Reset: tell the peer (if `local` or we detected the fault) and drop state."""
        if self.closed and not local:
            self._mux.remove(self)
            return
        self._mux.send(STREAM_RESET, self._flags, self.peer, RESET.pack(self.sid, code), b"")
        self._lost(StreamError(code) if not local else None)

    def on_reset(self, code: int) -> None:
        self._lost(ConnectionResetError(f"mesh stream reset: {CODE_NAMES.get(code, code)}"))

    def attach(self, protocol: asyncio.BaseProtocol) -> None:
        """Accepted and bound to its protocol: connection_made, then anything buffered."""
        self._protocol = protocol
        self.accepted = True
        protocol.connection_made(self)
        self._deliver_buffered()
        self._flush()
        self._check_pause()


class StreamMux:
    """Every stream of one node, keyed by (remote node, sid, opened locally)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        send: SendFn,
        window: int,
        max_streams_per_peer: int,
    ) -> None:
        self.loop = loop
        self.send = send
        self.window = window
        self.max_per_peer = max_streams_per_peer
        self.streams: dict[StreamKey, MeshStream] = {}
        self._per_peer: dict[int, int] = {}
        # a random first id: a restarted node (same id, new session) does not reuse the ids of
        # its previous life's streams, which a peer may still hold until it hears of the restart
        self._next_sid = int.from_bytes(os.urandom(4), "big") or 1
        self._opening: dict[StreamKey, asyncio.Future[MeshStream]] = {}
        # the service sets this: a stream that could not move paths stays where it is
        self.drain_gave_up: Callable[[MeshStream], None] = lambda s: None
        # the service sets this: (stream, host, port) for an OPEN from a peer
        self.on_open: Callable[[MeshStream, str, int], None] = lambda s, h, p: s.reset(NOT_ALLOWED)

    def __len__(self) -> int:
        return len(self.streams)

    def _add(self, stream: MeshStream) -> bool:
        count = self._per_peer.get(stream.peer, 0)
        if count >= self.max_per_peer:
            _stream_drops.labels("too_many_streams").inc()
            _rlog.debug(
                f"limit:{stream.peer}", "node %08x has %d streams (limits.max_streams_per_peer); refusing",
                stream.peer, count,
            )
            return False
        self._per_peer[stream.peer] = count + 1
        self.streams[(stream.peer, stream.sid, stream.local_opener)] = stream
        _active.inc()
        return True

    def remove(self, stream: MeshStream) -> None:
        key = (stream.peer, stream.sid, stream.local_opener)
        if self.streams.get(key) is stream:
            del self.streams[key]
            _active.dec()
            left = self._per_peer.get(stream.peer, 1) - 1
            if left > 0:
                self._per_peer[stream.peer] = left
            else:
                self._per_peer.pop(stream.peer, None)
        fut = self._opening.pop(key, None)
        if fut is not None and not fut.done():
            fut.set_exception(StreamError(GENERAL_FAILURE, "stream closed while opening"))

    def open(self, peer: int, host: str, port: int) -> tuple[MeshStream, asyncio.Future[MeshStream]]:
        """Send OPEN; the future resolves on ACCEPT or fails with StreamError on RESET."""
        sid = self._next_sid
        self._next_sid = (sid + 1) & 0xFFFFFFFF or 1
        stream = MeshStream(self, peer, sid, True, self.window)
        if not self._add(stream):
            raise StreamError(GENERAL_FAILURE, "too many streams to this node (limits.max_streams_per_peer)")
        fut: asyncio.Future[MeshStream] = self.loop.create_future()
        self._opening[(peer, sid, True)] = fut
        if not self.send(STREAM_OPEN, FLAG_OPENER, peer, encode_open(sid, self.window, host, port), b""):
            self.remove(stream)
            stream.closed = True
            raise StreamError(NETWORK_UNREACHABLE, "no route to the node")
        return stream, fut

    def accept(self, stream: MeshStream) -> bool:
        """Egress connected: send ACCEPT with our receive window (False: no route back)."""
        if self.send(STREAM_ACCEPT, 0, stream.peer, ACCEPT.pack(stream.sid, stream.window), b""):
            return True
        stream.closed = True
        self.remove(stream)
        _streams_total.labels("egress", "no_route_back").inc()
        return False

    def refuse(self, stream: MeshStream, code: int) -> None:
        self.send(STREAM_RESET, 0, stream.peer, RESET.pack(stream.sid, code), b"")
        stream.closed = True
        self.remove(stream)
        _streams_total.labels("egress", CODE_NAMES.get(code, "error")).inc()

    def on_frame(self, ftype: int, flags: int, src: int, body: memoryview) -> None:
        if len(body) < 4:
            _stream_drops.labels("malformed").inc()
            return
        sid = SID.unpack_from(body)[0]
        # FLAG_OPENER on an incoming frame: the peer opened it, so it is not ours
        key = (src, sid, not flags & FLAG_OPENER)
        stream = self.streams.get(key)
        if ftype == STREAM_DATA:
            if stream is None:
                _stream_drops.labels("unknown_stream").inc()
                return
            stream.on_data(body[4:])
        elif ftype == STREAM_WINDOW:
            if stream is not None and len(body) == WINDOW.size:
                stream.on_window(WINDOW.unpack_from(body)[1])
        elif ftype == STREAM_FIN:
            if stream is not None:
                stream.on_fin()
        elif ftype == STREAM_RESET:
            code = body[4] if len(body) >= 5 else GENERAL_FAILURE
            fut = self._opening.pop(key, None)
            if stream is not None:
                stream.closed = True if fut is not None else stream.closed
                if fut is not None:
                    self.remove(stream)
                    if not fut.done():
                        fut.set_exception(StreamError(code))
                    _streams_total.labels("open", CODE_NAMES.get(code, "error")).inc()
                else:
                    stream.on_reset(code)
        elif ftype == STREAM_ACCEPT:
            fut = self._opening.pop(key, None)
            if stream is None or fut is None or len(body) != ACCEPT.size:
                _stream_drops.labels("unexpected_accept").inc()
                return
            stream.send_credit = stream.credit_full = min(ACCEPT.unpack_from(body)[1], self.window)
            _streams_total.labels("open", "ok").inc()
            if not fut.done():
                fut.set_result(stream)
        elif ftype == STREAM_OPEN:
            try:
                sid, window, host, port = decode_open(body)
            except ValueError:
                _stream_drops.labels("malformed").inc()
                return
            if stream is not None:
                _stream_drops.labels("duplicate_open").inc()
                return
            new = MeshStream(self, src, sid, False, self.window)
            new.send_credit = new.credit_full = min(window, self.window)
            if not self._add(new):
                self.send(STREAM_RESET, 0, src, RESET.pack(sid, GENERAL_FAILURE), b"")
                return
            self.on_open(new, host, port)

    def fail_opening(self, peer: int, code: int) -> None:
        """A relay could not deliver to `peer`: streams still opening to it fail with `code`
        (it cannot say which one, as the OPEN was sealed; established streams are untouched)."""
        for key in [k for k in self._opening if k[0] == peer]:
            stream = self.streams.get(key)
            fut = self._opening.pop(key)
            if not fut.done():
                fut.set_exception(StreamError(code))
            if stream is not None:
                stream.closed = True
                self.remove(stream)
            _streams_total.labels("open", CODE_NAMES.get(code, "error")).inc()

    def relay_refusal(self, peer: int, body: memoryview) -> None:
        """A STREAM_RESET a relay sent in `peer`'s name for an OPEN it could not deliver: taken
        for a stream still opening only (a relay cannot reset an established stream)."""
        if len(body) < RESET.size:
            return
        sid = RESET.unpack_from(body)[0]
        key = (peer, sid, True)
        if key in self._opening:
            self.on_frame(STREAM_RESET, 0, peer, body)

    def drop_peer(self, peer: int, code: int = NETWORK_UNREACHABLE) -> None:
        """The node became unreachable: every stream with it is reset locally."""
        for key, stream in list(self.streams.items()):
            if key[0] == peer:
                fut = self._opening.pop(key, None)
                if fut is not None and not fut.done():
                    fut.set_exception(StreamError(code, "node unreachable"))
                stream._lost(ConnectionResetError("mesh node unreachable"))
                self.remove(stream)

    def reset_streams(self, peer: int, code: int, only: set[tuple[int, bool]]) -> int:
        """Reset these streams with `peer` ((sid, opened here) keys): each end hears it (RESET
        sent), so neither waits for bytes that were lost. The count reset."""
        n = 0
        for key, stream in list(self.streams.items()):
            if key[0] != peer or (key[1], key[2]) not in only:
                continue
            fut = self._opening.pop(key, None)
            if fut is not None and not fut.done():
                fut.set_exception(StreamError(code, "link lost"))
            stream.reset(code)
            n += 1
        return n

    def close_all(self) -> None:
        for stream in list(self.streams.values()):
            stream._lost(ConnectionAbortedError("mesh stopped"))
            self.remove(stream)
        for fut in self._opening.values():
            if not fut.done():
                fut.set_exception(StreamError(GENERAL_FAILURE, "mesh stopped"))
        self._opening.clear()
