"""The asyncio adapter of one link (TCP, QUIC or ring): bytes in -> LinkCodec -> frames.

Sending is synchronous: `send_frame` appends to the codec's batch and the
batch is sealed and written with one `writelines` at the end of the loop
tick, or, for frames a link's `data_received` sends on other links (relayed frames), at the
end of that call: a relay writes what a read made in the same callback, without a loop turn
in between. A handshake that does not finish within `limits.handshake_timeout` is
aborted; the owner (MeshService) handles every established frame.

`LinkBase` is the surface the owner sees (HELLO gate, counters, fail/close);
`Link` is it over a byte pipe, `link_udp.UdpLink` over UDP datagrams.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from typing import Any, Protocol, cast

from meshgate.config import LinkUrl
from meshgate.logs import RateLimitedLog
from meshgate.mesh import link_tcp
from meshgate.mesh.frames import (
    HELLO,
    MAX_BODY,
    Hello,
    LinkCodec,
    LinkError,
    decode_hello,
)
from meshgate.mesh.identity import Identity
from meshgate.metrics import REGISTRY

log = logging.getLogger("meshgate.mesh.links")
_rlog = RateLimitedLog(log)

RTT_GAIN = 1 / 8  # the smoothed RTT's EWMA gain once warmed up (TCP's SRTT, RFC 6298)
RTTVAR_GAIN = 1 / 4  # the mean deviation's gain (TCP's RTTVAR, RFC 6298)
BASE_RTT_SAMPLES = 10  # the base RTT is the least of this many last samples
HANDSHAKE_EXTENSIONS = 3  # a progressing handshake gets its timeout again at most this often
LATE_LOOP = 0.25  # s: a timer this late ran in a loop that has not read its sockets yet

_sessions = REGISTRY.counter(
    "meshgate_mesh_link_sessions_total",
    "Byte-pipe link handshakes completed (tcp://, quic://, ring://), by scheme and negotiated AEAD",
    ("scheme", "aead"),
)


class LinkOwner(Protocol):
    node_id: int
    network: str
    psk: bytes
    identity: Identity
    aead_caps: int  # our AEAD capability bits (noise.local_caps of limits.aes_instructions)
    handshake_timeout: float
    loop: asyncio.AbstractEventLoop

    def hello_body(self, handshake_hash: bytes, initiator: bool) -> bytes: ...

    def link_ready(self, link: LinkBase) -> bool: ...
    def link_lost(self, link: LinkBase) -> None: ...
    def link_failed(self, link: LinkBase, reason: str) -> None: ...
    def on_frame(
        self, link: LinkBase, ftype: int, flags: int, hop: int, src: int, dst: int, body: memoryview
    ) -> None: ...


class LinkBase:
    """What the owner uses of a link, whatever carries it: the peer's HELLO gates the
    link (nothing before it reaches the owner), counters, liveness, fail/close."""

    def __init__(self, owner: LinkOwner, url: str, initiator: bool) -> None:
        self.owner = owner
        self.url = url
        self.initiator = initiator
        self.loop = owner.loop
        self.peer: Hello | None = None  # set when the peer's HELLO arrives
        # the peer's Noise static key and the handshake hash, once the handshake is done:
        # the owner checks the HELLO against them
        self.remote_static = b""
        self.handshake_hash = b""
        self.closed: asyncio.Future[bool] = self.loop.create_future()  # result: was it established
        self._timer: asyncio.TimerHandle | None = None
        self._extensions = 0  # times the handshake timeout was given again (HANDSHAKE_EXTENSIONS)
        self._timer_due = 0.0  # loop time the handshake timer is set for
        self.last_rx = self.loop.time()
        self.latency_us = 0  # smoothed ping RTT in µs; 0 = not measured yet
        # the least RTT of the last BASE_RTT_SAMPLES: what route records carry. Queueing and a
        # busy loop only ever add to a round trip, so this moves with the path, not the load
        self.base_us = 0
        self._recent: collections.deque[int] = collections.deque(maxlen=BASE_RTT_SAMPLES)
        self.rtt_samples = 0  # ping round trips measured
        # how far the latency wanders by itself: RTTVAR (RFC 6298), falling no faster than
        # SRTT settles, so a stray sample's pull on SRTT stays covered while it lasts
        self.jitter_us = 0
        self._srtt = 0.0
        self._rttvar = 0.0
        self._jitter = 0.0
        # loop time of the last PING from the peer that carried its RTT of this link: such a
        # peer keeps the link's pings going itself (MeshService._tick)
        self.peer_pinged = -1e9
        self.up_at = 0.0  # loop time the owner took the link up (its HELLO checked)
        self.bytes_in = 0
        self.bytes_out = 0
        self.bytes_reported = (0, 0)
        self.drops_reported = (0, 0, 0)  # replayed, forged, malformed already counted
        self.write_paused = False
        self._failed = False
        # 0: configured or accepted; traversal.LOCAL / REFLEXIVE: made by NAT traversal
        self.traversal_kind = 0
        self.gone_seen = False  # the owner has handled this link's loss (once)
        self.stall = (0, 0.0)  # (drained bytes, since when) while it holds more than the owner allows

    @property
    def aead(self) -> str:
        """The transport AEAD this link negotiated (noise.Suite.name), "" before its handshake."""
        raise NotImplementedError

    # ------------------------------------------------------------ for the carrier

    def _start_handshake_timer(self) -> None:
        self._timer_due = self.loop.time() + self.owner.handshake_timeout
        self._timer = self.loop.call_at(self._timer_due, self._handshake_timeout)

    def _on_frame(self, ftype: int, flags: int, hop: int, src: int, dst: int, body: memoryview) -> None:
        if self.peer is None:
            if ftype != HELLO:
                self.fail("no_hello", "frame before hello")
                return
            try:
                hello = decode_hello(body)
            except LinkError as e:
                self.fail(e.reason, str(e))
                return
            self.peer = hello
            self._cancel_timer()
            if not self.owner.link_ready(self):
                self.peer = None
                self._failed = True
                self.close()
            return
        self.owner.on_frame(self, ftype, flags, hop, src, dst, body)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _ended(self) -> None:
        """The carrier is gone: tell the owner once, resolve `closed`."""
        self._cancel_timer()
        if self.peer is None and not self._failed:
            # closed by the other side before it said HELLO: a failed handshake from
            # our point of view (wrong secret or network on one side, or a stray probe)
            self._failed = True
            self.owner.link_failed(self, "closed")
        self.owner.link_lost(self)
        if not self.closed.done():
            self.closed.set_result(self.peer is not None)

    def _handshake_timeout(self) -> None:
        self._timer = None
        if self.peer is not None:
            return
        # A handshake that is progressing (the peer's last message came within the timeout) is
        # given the timeout again from that message, at most HANDSHAKE_EXTENSIONS times: behind a
        # busy peer (a loaded host, many nodes in one process) each step of it may come late,
        # and a link that fails to come up is a node cut off until its next dial. A peer that
        # says nothing still fails at the timeout, and one that trickles bytes at 4x it.
        # A timer that ran late ran before its loop read what came meanwhile (uvloop runs due
        # timers before it polls): looked at again once it has.
        now = self.loop.time()
        quiet = now - self.last_rx
        timeout = self.owner.handshake_timeout
        late = now - self._timer_due > LATE_LOOP
        if (quiet < timeout or late) and self._extensions < HANDSHAKE_EXTENSIONS:
            self._extensions += 1
            self._timer_due = now + (timeout - quiet if quiet < timeout else 0.05)
            self._timer = self.loop.call_at(self._timer_due, self._handshake_timeout)
            return
        self.fail("timeout", "handshake timed out")

    # ------------------------------------------------------------ for the owner

    def rtt_sample(self, rtt_us: int) -> None:
        """One ping round trip. The smoothed RTT is the mean of the first 8 samples,
        then an EWMA with gain 1/8: no single sample (a slow first ping at link-up
        among them) rules it for long."""
        self._deviation(rtt_us)
        self._srtt += max(RTT_GAIN, 1 / self.rtt_samples) * (rtt_us - self._srtt)
        self.latency_us = max(1, round(self._srtt))
        self._recent.append(rtt_us)
        self.base_us = max(1, min(self._recent))

    def rtt_reported(self, rtt_us: int, base_us: int, jitter_us: int) -> None:
        """The peer's smoothed and base RTT of this link and its jitter, from its PING: taken
        as they are (measured there), so both ends' records carry the same figure, moved alike."""
        self.rtt_samples += 1
        self._srtt = float(rtt_us)
        self._rttvar = self._jitter = float(jitter_us)
        self.latency_us = max(1, rtt_us)
        self.base_us = max(1, base_us or rtt_us)
        self.jitter_us = jitter_us

    def _deviation(self, rtt_us: int) -> None:
        """RTTVAR as RFC 6298 keeps it (R/2 at first, then gain 1/4 on |SRTT - R|): how
        far the link's latency wanders by itself, which re-origination looks past."""
        self.rtt_samples += 1
        if self.rtt_samples == 1:
            self._rttvar = rtt_us / 2
        else:
            self._rttvar += RTTVAR_GAIN * (abs(self._srtt - rtt_us) - self._rttvar)
        # RTTVAR alone falls faster (gain 1/4) than a stray sample's pull on SRTT (1/8) fades
        self._jitter = max(self._rttvar, self._jitter * (1 - RTT_GAIN))
        self.jitter_us = round(self._jitter)

    def send_frame(
        self, ftype: int, flags: int, hop: int, src: int, dst: int, head: Any, data: Any = b""
    ) -> None:
        raise NotImplementedError

    def buffered(self) -> int:
        """Bytes accepted for sending and not yet gone (or, on UDP, not yet acknowledged)."""
        raise NotImplementedError

    def drained(self) -> int | None:
        """Bytes that left this process towards the peer so far (written through the
        transport's buffer), or None where the link kind checks progress itself (udp://)."""
        return None

    def undelivered(self) -> int:
        """Bytes of reliable frames (streams, routes) this link took and has not delivered as
        far as it knows: when it goes, those frames are lost."""
        return self.buffered()

    def datagram_room(self) -> int:
        """The largest DATAGRAM frame body this link carries as one unit (a byte pipe: any;
        a udp:// link: what fits one packet beside its headers; bigger ones go in pieces)."""
        return MAX_BODY

    def drop_counts(self) -> tuple[int, int, int]:
        """Records dropped so far: (replayed, forged, malformed)."""
        raise NotImplementedError

    def abort(self) -> None:
        """Close now, without flushing."""
        raise NotImplementedError

    def close(self) -> None:
        """Flush what is queued, then close."""
        raise NotImplementedError

    def fail(self, reason: str, message: str) -> None:
        if not self._failed and self.peer is None:
            self._failed = True
            self.owner.link_failed(self, reason)
        if reason == "bad_version":
            # an operator's problem (nodes on different releases), not noise: say it at warning
            _rlog.warning("bad_version", "link %s refused: %s", self.url, message)
            self.close()  # flushes our preface, so the peer learns our version too
            return
        _rlog.debug(f"link:{self.url}", "link %s closed: %s", self.url, message)
        self.abort()

    def mark_dead(self) -> None:
        """The owner has already withdrawn this link: later callbacks are no news."""
        self.peer = None
        self._failed = True


# The links sent on while a Link.data_received runs (None outside one): that call flushes the
# others (what it relays) when it returns, instead of each scheduling a flush for the end of the
# loop tick; the link read from flushes at the end of the tick as before
_dispatch: list[Link] | None = None


class Link(LinkBase, asyncio.Protocol):
    """A link over a byte pipe (TCP, QUIC stream, ring) with the LinkCodec."""

    def __init__(self, owner: LinkOwner, url: str, initiator: bool) -> None:
        super().__init__(owner, url, initiator)
        self.transport: asyncio.Transport | None = None
        self.codec = LinkCodec(
            initiator, owner.network, owner.psk, self._on_frame, hello=self._hello_body,
            static=owner.identity.dh_private, caps=owner.aead_caps,
        )
        self._flush_scheduled = False

    @property
    def aead(self) -> str:
        send = self.codec.send
        return send.suite.name if send is not None else ""

    def _hello_body(self, handshake_hash: bytes, initiator: bool) -> bytes:
        # called once, as the handshake finishes
        self.remote_static, self.handshake_hash = self.codec.remote_static, handshake_hash
        _sessions.labels(self.url.partition(":")[0], self.codec.suite.name).inc()
        return self.owner.hello_body(handshake_hash, initiator)

    # ------------------------------------------------------------ asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses: cast, don't assert
        transport = cast(asyncio.Transport, transport)
        self.transport = transport
        link_tcp.tune(transport)
        scheme = self.url.partition(":")[0]
        if not self.initiator and scheme in ("tcp", "quic"):
            peer = transport.get_extra_info("peername")
            if isinstance(peer, tuple):
                self.url = str(LinkUrl(scheme, peer[0], peer[1]))
        self._start_handshake_timer()
        self.codec.start()
        self._flush()

    def data_received(self, data: bytes) -> None:
        global _dispatch
        self.last_rx = self.loop.time()
        self.bytes_in += len(data)
        codec = self.codec
        handshaking = codec.send is None  # its answers go out without send_frame
        outer = _dispatch
        batch: list[Link] = [] if outer is None else outer
        _dispatch = batch
        try:
            try:
                codec.receive(data)
            except LinkError as e:
                self.fail(e.reason, str(e))
                return
            if handshaking:
                self._flush()
        finally:
            if outer is None:
                # a link called within another's data_received (a ring delivering what a
                # resumed read held) leaves the flushing to the outer call
                _dispatch = None
                for link in batch:
                    if link is self:
                        # its own answers (PONG, window updates) leave with whatever else this
                        # loop tick sends it (other streams' frames): one record under load
                        self.loop.call_soon(self._flush)
                    else:
                        link._flush()

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._ended()

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False

    # ------------------------------------------------------------ frames

    def send_frame(
        self, ftype: int, flags: int, hop: int, src: int, dst: int, head: Any, data: Any = b""
    ) -> None:
        self.codec.send_frame(ftype, flags, hop, src, dst, head, data)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            if _dispatch is not None:
                _dispatch.append(self)
            else:
                self.loop.call_soon(self._flush)

    def buffered(self) -> int:
        t = self.transport
        return self.codec.pending_bytes() + (t.get_write_buffer_size() if t is not None else 0)

    def drained(self) -> int | None:
        t = self.transport
        return self.bytes_out - (t.get_write_buffer_size() if t is not None else 0)

    def drop_counts(self) -> tuple[int, int, int]:
        c = self.codec
        return c.replayed, c.forged, c.malformed

    def _flush(self) -> None:
        self._flush_scheduled = False
        chunks = self.codec.data_to_send()
        t = self.transport
        if chunks and t is not None and not t.is_closing():
            self.bytes_out += sum(map(len, chunks))
            t.writelines(chunks)

    # ------------------------------------------------------------ closing

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self._flush()
            self.transport.close()
