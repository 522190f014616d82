"""Sans-I/O session of one udp:// link: handshake in single packets, sealed packets,
a small reliable in-order channel for control and stream frames, unreliable datagrams.

Wire format (docs/PROTOCOL.md section 2.5 has the full text):

    handshake  = kind u8 (1, 2, 3) | MAGIC (4) | VERSION u8 | sender id u32 | receiver id u32 | Noise msg
    data       = kind u8 (4) | receiver id u32 | record header (u32 length, epoch u8, counter u64) | AEAD
    piece      = kind u8 (5) | receiver id u32 | record header | offset u32 | bytes of that record's AEAD
                 output (ciphertext + tag) from offset: a record too big for one packet (CAP_PIECES)
    plaintext  = chunk*
    chunk      = ACK   0x01 | next expected segment u32 | SACK bitmap u64 (bit i: segment next+1+i held)
               | SEG   0x02 | segment number u32 | length u16 | bytes of the reliable stream
               | DGRAM 0x03 | length u16 | one frame (frames.FRAME header + body), unreliable
               | CLOSE 0x04                                    the sender closed the link
               | DFRAG 0x05 | datagram id u32 | total u16 | offset u16 | length u16 | bytes
                                        a piece of one DATAGRAM frame too big for a packet

Every data packet is ONE record sealed with frames.SendCipher (explicit epoch and
counter, so a receiver opens packets in any order, with the 64-record replay window
of frames.RecvCipher). The handshake is the TCP link's Noise XXpsk3 with the same
prologue and PSK; msg1 carries padding so that no answer is bigger than the packet
that asked for it, and only the initiator retransmits (msg1 until msg2 arrives, msg3
until the responder's first sealed packet arrives): a responder sends one msg2 per
msg1 received and nothing else before the handshake completes.

DATAGRAM frames travel unreliably: one that fits a packet whole (DGRAM); a bigger one (up
to 65535 frame bytes; only a full 65536-byte frame takes the reliable channel, as the u16
total cannot say its size) travels in pieces, reassembled by the receiver in a bounded
table (entries, bytes, a timeout): a lost piece loses that datagram only, which is counted
by reason. Where both ends offered CAP_PIECES in the handshake (every node since it), the
frame is sealed as one record of its own (a DGRAM chunk) and that record is cut into piece
packets, all full-size but the last (one GSO run): one AEAD call per datagram, not per
packet, and no piece is authentic until its record opens (a forged one fails the record).
With a peer from before it, DFRAG chunks inside ordinary data packets, packed densely into
the room packets have left (so runs of full-size packets stay GSO-friendly).

The reliable channel carries every other frame: the frames are encoded back to back
into a byte stream that is cut into numbered segments (one per packet). The receiver
acknowledges cumulatively with a SACK bitmap in every packet it sends (each flush, i.e.
once per loop tick, sends a pure ACK when nothing else carries one). The sender keeps
at most min(cwnd, window) bytes unacknowledged (NewReno-style cwnd: slow start, halving
on loss, reset on timeout), retransmits a segment that three later segments overtook,
and on a retransmission timeout (RTO from the measured RTT, RFC 6298, doubled per
timeout) the oldest unacknowledged one; `max_retransmits` timeouts in a row without progress fail the link.

No socket, no clock: `receive(packet, now)`, `send_frame(...)`, `packets_to_send(now)`,
`deadline()` / `on_timer(now)`. Errors that end the link raise frames.LinkError; bad
packets are counted and dropped.
"""

from __future__ import annotations

import struct
from collections import deque
from collections.abc import Callable
from typing import Any

from cryptography.exceptions import InvalidTag

from meshgate.mesh.frames import (
    FRAME,
    MAGIC,
    NOISE_PATTERN,
    RECORD,
    RECORD_EXTRA,
    REPLAY_WINDOW,
    TAG,
    UNRELIABLE,
    VERSION,
    WINDOW_MASK,
    FrameHandler,
    LinkError,
    RecvCipher,
    SendCipher,
    aead_offer,
    answer_offer,
    answered_suite,
    iter_frames,
    offered_caps,
    prologue,
)
from meshgate.mesh.noise import (
    CHACHA20_POLY1305,
    HandshakeState,
    NoiseError,
    Suite,
    generate_private,
)

KIND_INIT = 1
KIND_RESP = 2
KIND_FINAL = 3
KIND_DATA = 4
KIND_PIECE = 5  # a piece of one sealed record too big for a packet (CAP_PIECES, both ends)

HS = struct.Struct("!B4sBII")  # kind, magic, version, sender id, receiver id
DATA = struct.Struct("!BI")  # kind, receiver id
DATA_HEAD = struct.Struct("!BIIBQ")  # kind, receiver id, then the record header (frames.RECORD)
DATA_OVERHEAD = DATA.size + RECORD.size + TAG  # bytes of a data packet that are not plaintext
# kind, receiver id, the record header (length, epoch, counter), then the piece's offset in the
# record's ciphertext: a data packet's head with a u32 after it, so one unpack reads either
PIECE = struct.Struct("!BIIBQI")
PIECE_SIZE = PIECE.size
_unpack_piece = PIECE.unpack_from
RUN_MIN = 4  # fewer full-size pieces in a read are taken one by one
_runs: dict[tuple[int, int], struct.Struct] = {}


def _run(step: int, k: int) -> struct.Struct:
    """The Struct that reads k piece packets of `step` bytes back to back (a GRO read): per
    packet its first 18 bytes (kind, receiver id, record header), its offset, its bytes."""
    run = _runs.get((step, k))
    if run is None:
        if len(_runs) >= 512:
            _runs.clear()
        run = _runs[step, k] = struct.Struct("!" + f"18sI{step - PIECE_SIZE}s" * k)
    return run
# the capability bit (the AEAD offer's caps byte, docs/PROTOCOL.md section 2.5) a udp:// session
# offers: "a record too big for a packet may come in KIND_PIECE pieces". Both ends offer it:
# big datagrams travel that way; else (a peer from before it) in DFRAG chunks as before
CAP_PIECES = 0x02
# the most ciphertext a pieced record carries: a DGRAM chunk of the biggest DATAGRAM frame
PIECED_MAX = 3 + 0xFFFF + TAG
INIT_PADDING = 64  # msg1 payload: makes msg1 (126 B) no smaller than msg2 (113 B)
# The AEAD offer (frames.aead_offer, docs/PROTOCOL.md section 2.6) starts msg1's payload, then
# zeros to INIT_PADDING (a version-3 initiator from before it sends the zeros alone).
INIT_MIN = HS.size + 32 + INIT_PADDING + TAG  # a shorter msg1 is dropped unanswered

CH_ACK = 0x01
CH_SEG = 0x02
CH_DGRAM = 0x03
CH_CLOSE = 0x04
ACK = struct.Struct("!BIQ")
SEG = struct.Struct("!BIH")
DGRAM = struct.Struct("!BH")
CH_DFRAG = 0x05
DFRAG = struct.Struct("!BIHHH")  # type, datagram id, total frame bytes, offset, piece length
ACK_DFRAG = struct.Struct("!BIQBIHHH")  # an ACK chunk, then a DFRAG chunk's header (one struct call)
# the sizes receive_batch uses per packet, as plain ints (a Struct's .size is an attribute lookup)
DATA_SIZE = DATA.size
BODY_AT = DATA.size + RECORD.size  # where a data packet's ciphertext starts
LENGTH_FROM = DATA.size + 4  # packet bytes not counted by the record header's length
ACK_SIZE = ACK.size
AD_SIZE = ACK_DFRAG.size
_unpack_ad, _pack_ad = ACK_DFRAG.unpack_from, ACK_DFRAG.pack
DFRAG_MAX = 0xFFFF  # a bigger frame (65536 bytes: a full-size body) takes the reliable channel
FRAG_MIN = 64  # smallest piece but a datagram's last: leftover room below this starts a new packet
INF = float("inf")
PIECE_COST = 128  # bytes a held piece is charged beyond its length (objects, dict slot)
SACK_BITS = 64
MASK = 0xFFFFFFFF

HS_RESEND = 0.25  # first handshake retransmission; doubles up to HS_RESEND_MAX
HS_RESEND_MAX = 1.0  # a peer that starts late is reached within a second (msg1 is 126 bytes)
MIN_RTO = 0.2
MAX_RTO = 3.0
INITIAL_RTO = 0.5
DUP_THRESH = 3  # a segment that this many later segments overtook is lost
INITIAL_CWND_SEGMENTS = 64
MIN_CWND_SEGMENTS = 4


def payload_size(mtu: int, ipv6: bool) -> int:
    """UDP payload bytes per packet on a path of this MTU (IP and UDP headers off)."""
    return mtu - (48 if ipv6 else 28)


def is_init(packet: bytes | bytearray | memoryview) -> bool:
    """A well-formed, padded msg1: the only packet a listener answers from an unknown source."""
    return (
        len(packet) >= INIT_MIN and packet[0] == KIND_INIT and bytes(packet[1:5]) == MAGIC
        and packet[5] == VERSION
    )


def receiver_id(packet: bytes | bytearray | memoryview) -> int | None:
    """The receiver's session id of a data/msg2/msg3 packet (demux), or None."""
    kind = packet[0] if packet else 0
    if kind in (KIND_DATA, KIND_PIECE) and len(packet) >= DATA.size:
        return int(DATA.unpack_from(packet)[1])
    if kind in (KIND_RESP, KIND_FINAL) and len(packet) >= HS.size:
        return int(HS.unpack_from(packet)[4])
    return None


def _unwrap(wire: int, ref: int) -> int:
    """The full sequence number nearest `ref` whose low 32 bits are `wire`."""
    d = (wire - ref) & MASK
    if d >= 1 << 31:
        d -= 1 << 32
    return ref + d


class _Reassembly:
    """The pieces of one fragmented datagram received so far."""

    __slots__ = ("created", "end", "got", "in_order", "pieces", "total")

    def __init__(self, total: int, created: float) -> None:
        self.total = total
        self.created = created
        self.got = 0  # piece bytes held; they are charged got + PIECE_COST per piece (`cost`)
        self.end = 0  # the highest end of a piece so far: a piece at or past it overlaps nothing
        self.in_order = True  # every piece came at or past `end` (the pieces dict is in offset order)
        self.pieces: dict[int, bytes | memoryview] = {}  # offset -> piece

    def cost(self) -> int:
        """What the pieces held are charged against the table's byte bound."""
        return self.got + PIECE_COST * len(self.pieces)

    def overlaps(self, off: int, n: int) -> bool:
        """Only for a piece that came out of order (rare): against every piece held."""
        end = off + n
        return any(o < end and off < o + len(p) for o, p in self.pieces.items())


# receive_batch's foretold piece before there is one (entry, datagram id, end, size, packet size,
# ACK, charge): a module constant, so that a read of one packet sets it up with one unpack
_NOTHING_FORETOLD = (_Reassembly(0, 0.0), 0, 0, 0, 0, 0, 0)


class _Record:
    """The KIND_PIECE pieces of one sealed record received so far: its ciphertext filled in
    place (charged whole from the first piece), `end` the length of the filled prefix, and the
    pieces past a gap by offset until the gap is filled. No piece is authentic until the whole
    record opens; a forged one makes the record fail its tag (lost, counted as forged)."""

    __slots__ = ("buf", "count", "counter", "created", "end", "epoch", "key", "later", "length", "total")

    def __init__(self, key: int, length: int, epoch: int, counter: int, created: float) -> None:
        self.key = key
        self.length = length  # the record header's length (ciphertext bytes + RECORD_EXTRA)
        self.epoch = epoch
        self.counter = counter
        self.total = length - RECORD_EXTRA  # ciphertext bytes
        self.created = created
        self.buf = bytearray(self.total)
        self.end = 0  # every byte before it is filled
        self.count = 0  # pieces taken
        self.later: dict[int, int] = {}  # offset -> length of the pieces taken past `end`

    def cost(self) -> int:
        return self.total + PIECE_COST


# receive_batch's record being filled in order before there is one: matches no piece
_NO_RECORD = _Record(-1, RECORD_EXTRA, 0, -1, 0.0)


class UdpSession:
    """One end of one udp:// link. `local_id` is this side's session id (random, non-zero)."""

    def __init__(
        self,
        initiator: bool,
        network: str,
        psk: bytes,
        on_frame: FrameHandler,
        local_id: int,
        payload: int = 1472,
        window: int = 2 << 20,
        queue_limit: int = 32 << 20,
        max_retransmits: int = 8,
        on_established: Callable[[], None] | None = None,
        reassembly: int = 64,
        reassembly_bytes: int = 1 << 20,
        reassembly_timeout: float = 0.5,
        fragment: bool = True,
        static: bytes | None = None,
        caps: int = 0,
        pieces: bool = True,
    ) -> None:
        if payload < DATA_OVERHEAD + ACK.size + SEG.size + FRAME.size + 64:
            raise ValueError(f"UDP payload of {payload} bytes is too small for a link")
        self.initiator = initiator
        self.on_frame = on_frame
        self.local_id = local_id
        self.peer_id = 0
        self.payload = payload
        self.plain_room = payload - DATA_OVERHEAD
        self.seg_room = self.plain_room - ACK.size - SEG.size  # stream bytes per segment
        self.datagram_room = self.plain_room - ACK.size - DGRAM.size - FRAME.size  # body of a whole DGRAM
        self.window = max(window, 4 * self.seg_room)
        self.queue_limit = queue_limit
        self.max_retransmits = max_retransmits
        self.on_established = on_established
        self._hs: HandshakeState | None = HandshakeState(
            NOISE_PATTERN, initiator, prologue(network), s=static or generate_private(), psks=(psk,)
        )
        self.remote_static = b""  # the peer's Noise static key, once the handshake is done
        self.handshake_hash = b""
        self.caps = caps  # our AEAD capability bits (noise.CAP_AES), offered in the handshake
        self.suite: Suite = CHACHA20_POLY1305  # the negotiated transport AEAD, once msg2 is done
        self.send: SendCipher | None = None
        self.recv: RecvCipher | None = None
        self.confirmed = not initiator  # initiator: a sealed packet from the responder arrived
        self._hs_packet: bytes | None = None  # our last handshake packet, for retransmission
        self.peer_init: bytes | None = None  # responder: the msg1 answered (duplicates resend msg2)
        self._hs_at: float | None = None
        self._hs_interval = HS_RESEND
        self._out: list[bytes] = []  # handshake packets to send
        # reliable channel, sending side
        self._tx = bytearray()  # encoded frames not yet cut into segments
        self._unacked: dict[int, list[object]] = {}  # seq -> [data bytes, last sent at, sends]
        self._inflight = 0
        self._retx: deque[int] = deque()
        self.snd_una = 0
        self.snd_nxt = 0
        self.cwnd = INITIAL_CWND_SEGMENTS * self.seg_room
        self.ssthresh = 1 << 62
        self._recover = -1  # loss recovery lasts until snd_una passes this
        self.srtt = 0.0
        self.rttvar = 0.0
        self.rto = INITIAL_RTO
        self._rto_at: float | None = None
        self._backoff = 0
        self._highest_sacked = -1
        # reliable channel, receiving side
        self.rcv_next = 0
        self._ooo: dict[int, bytes] = {}
        self._rx = bytearray()  # in-order stream bytes not yet a whole frame
        self._need = FRAME.size  # bytes _rx must hold before the next frame is whole
        self._rx_max_segments = self.window // self.seg_room + SACK_BITS
        self._ack_owed = False
        self._frames_seen = False  # datagrams wait for the first reliable frame (the HELLO)
        # unreliable datagrams, packed into packets at the next flush: whole frames (bytes), and
        # frames too big for a packet as [id, frame view, offset of the next piece]
        self._dgrams: deque[bytes | list[Any] | tuple[bytes]] = deque()
        self._dgram_bytes = 0
        self._dgram_id = 0
        # reassembly of fragmented datagrams: id -> _Reassembly, oldest first (insertion order)
        self._frags: dict[int, _Reassembly] = {}
        # KIND_PIECE records being put together: (epoch << 64 | counter) -> _Record, oldest first;
        # the record receive_batch fills in order (a piece at its `end` is taken inline)
        self._records: dict[int, _Record] = {}
        self._filling = _NO_RECORD
        # both ends offered CAP_PIECES (set by the handshake): big datagrams go as pieced records,
        # and only those are taken from the peer (its DFRAG chunks are refused, and the other way)
        self.pieces = False
        self.offer_pieces = pieces  # ours: offered in the handshake (False: as a node from before it)
        self._frag_bytes = 0  # bytes held (pieces plus PIECE_COST each)
        self._expire_at = INF  # no earlier than this is an entry due to expire (may be early, never late)
        self.reassembly = max(1, reassembly)
        self.reassembly_bytes = reassembly_bytes
        self.reassembly_timeout = reassembly_timeout
        # False: a DATAGRAM too big for a packet takes the reliable channel (retransmitted hop by
        # hop) instead of DFRAG pieces, whose loss loses it whole (limits.udp_link_fragment_datagrams)
        self.dfrag_max = DFRAG_MAX if fragment else 0
        self._close = False
        # counters the adapter reports
        self.packets_in = 0
        self.packets_out = 0
        self.retransmits = 0
        self.replayed = 0
        self.forged = 0
        self.malformed = 0
        self.unexpected = 0  # handshake packets out of turn, early data: harmless, dropped
        self.beyond_window = 0
        self.duplicates = 0
        self.fragmented_out = 0  # datagrams sent in pieces
        self.reassembled = 0  # datagrams put together again and delivered
        self.frag_timeout = 0  # incomplete datagrams lost: a piece did not come in time
        self.frag_evicted = 0  # incomplete datagrams lost to the table bounds (entries, bytes)
        self.frag_malformed = 0  # pieces (and the datagrams they belong to) dropped as invalid

    # ------------------------------------------------------------------ state

    @property
    def established(self) -> bool:
        return self.send is not None

    def buffered(self) -> int:
        """Reliable bytes not yet acknowledged (queued or in flight) plus queued datagrams."""
        return len(self._tx) + self._inflight + self._dgram_bytes

    def reliable_outstanding(self) -> int:
        """Reliable bytes not yet acknowledged (queued or in flight): what a lost link loses
        of the frames it carried (datagrams aside, which may be lost anyway)."""
        return len(self._tx) + self._inflight

    def queued(self) -> int:
        """Reliable bytes waiting behind the window (the backpressure signal)."""
        return len(self._tx)

    # ------------------------------------------------------------------ handshake

    def start(self, now: float) -> None:
        """Initiator: send msg1 (retransmitted until msg2 arrives)."""
        if not self.initiator:
            return
        assert self._hs is not None
        msg = self._hs.write_message(aead_offer(self._offered()).ljust(INIT_PADDING, b"\0"))
        self._send_hs(HS.pack(KIND_INIT, MAGIC, VERSION, self.local_id, 0) + msg, now)

    def _offered(self) -> int:
        """The capability bits this end offers: the AEAD's (self.caps), CAP_PIECES if on."""
        return self.caps | CAP_PIECES if self.offer_pieces else self.caps & ~CAP_PIECES

    def _peer_caps(self, peer: int) -> None:
        self.pieces = bool(self._offered() & peer & CAP_PIECES)

    def _send_hs(self, packet: bytes, now: float) -> None:
        self._hs_packet = packet
        self._out.append(packet)
        if self.initiator:
            self._hs_interval = HS_RESEND
            self._hs_at = now + HS_RESEND

    def _receive_handshake(self, packet: bytes | bytearray | memoryview, now: float) -> None:
        if len(packet) < HS.size:
            self.malformed += 1
            return
        kind, magic, version, sender, receiver = HS.unpack_from(packet)
        if magic != MAGIC:
            self.malformed += 1
            return
        if version != VERSION:
            raise LinkError("bad_version", f"unsupported protocol version {version}")
        body = bytes(packet[HS.size :])
        hs = self._hs
        if not self.initiator and kind == KIND_INIT:
            if hs is not None and self.peer_init is None:
                if not is_init(packet):
                    self.malformed += 1
                    return
                self.peer_init = bytes(packet)
                self.peer_id = sender
                try:
                    offer = hs.read_message(body)
                    self.suite, answer = answer_offer(self._offered(), offer)
                    msg2 = hs.write_message(answer)
                except NoiseError:
                    raise LinkError("handshake", "handshake failed") from None
                # (an initiator from before the offer sends zeros: no capabilities)
                self._peer_caps(offered_caps(offer) or 0)
                self._send_hs(HS.pack(KIND_RESP, MAGIC, VERSION, self.local_id, sender) + msg2, now)
            elif hs is not None and bytes(packet) == self.peer_init and self._hs_packet is not None:
                self._out.append(self._hs_packet)  # msg2 was lost: answer the retransmitted msg1 again
            else:
                self.unexpected += 1
            return
        if receiver != self.local_id:
            self.unexpected += 1
            return
        if self.initiator and kind == KIND_RESP and hs is not None and not hs.finished:
            self.peer_id = sender
            try:
                answer = hs.read_message(body)
            except NoiseError:
                raise LinkError("handshake", "handshake failed") from None
            self.suite = answered_suite(self._offered(), answer)
            self._peer_caps(answer[2] if answer else 0)  # (answered_suite checked its form)
            try:
                msg3 = hs.write_message()
            except NoiseError:
                raise LinkError("handshake", "handshake failed") from None
            self._send_hs(HS.pack(KIND_FINAL, MAGIC, VERSION, self.local_id, sender) + msg3, now)
            self._finish(hs)
        elif not self.initiator and kind == KIND_FINAL and sender == self.peer_id:
            if hs is None:
                # msg3 again: our first sealed packet was lost; the ACK owed now confirms
                self._ack_owed = True
                return
            try:
                hs.read_message(body)
            except NoiseError:
                raise LinkError("handshake", "handshake failed") from None
            self._finish(hs)
            self._ack_owed = True  # a sealed packet at once confirms the handshake to the initiator
        else:
            self.unexpected += 1  # duplicates after the handshake, stray ids

    def _finish(self, hs: HandshakeState) -> None:
        i2r, r2i = hs.split()
        assert i2r.k is not None and r2i.k is not None
        send_key, recv_key = (i2r.k, r2i.k) if self.initiator else (r2i.k, i2r.k)
        self.send = SendCipher(send_key, suite=self.suite)
        self.recv = RecvCipher(recv_key, self.suite)
        self._rx_key = self.recv.current()  # what receive_batch opens with (again after a rekey)
        self.remote_static = hs.rs or b""
        self.handshake_hash = hs.handshake_hash
        self._hs = None
        if self.on_established is not None:
            self.on_established()

    # ------------------------------------------------------------------ receive

    def receive(self, packet: bytes | bytearray | memoryview, now: float) -> bool:
        """One UDP payload. True when it was authentic (liveness); LinkError ends the link."""
        n = len(packet)
        view = packet if isinstance(packet, memoryview) else memoryview(packet)
        good, used = self.receive_batch(view, n, n, now)
        if not used:
            return self._receive_other(packet, now)
        return bool(good)

    def receive_batch(self, buf: memoryview, n: int, step: int, now: float) -> tuple[int, int]:
        """The data packets of this session at the front of `buf[:n]`, each `step` bytes (the
        last may be shorter): a GRO batch in one call, the per-packet work inline (at ~1 Gbit/s
        a node opens ~80,000 packets a second; a Python call per layer per packet showed).
        Returns (authentic packets, bytes used); it stops before the first packet that is not a
        data packet for this session (the caller routes that one: a handshake, another session's).
        Bad ones of ours are counted and skipped."""
        recv = self.recv
        if recv is None:
            return 0, 0
        # (little set-up: without GRO, or where a path does not coalesce, each read is one packet)
        decrypt, nonce, window, recv_epoch = self._rx_key
        frags = self._frags
        frames_seen = self._frames_seen  # if it turns true within the batch, _chunks reads it again
        # no entry due to expire: else _chunks first, whose _on_fragment expires them (it moves
        # _expire_at only to after `now`, so it is read again only after _chunks)
        live = now < self._expire_at
        # the plaintext head the next packet has if it is the next piece of the datagram the last
        # one's piece went to (set by the in-order path, with x_entry and the other x_ values;
        # None after anything else)
        expect: bytes | None = None
        x_entry, x_fid, x_end, x_fn, x_plen, x_wire, x_cost = _NOTHING_FORETOLD
        bad = off = pieces = opened = 0
        lid = self.local_id
        while off < n:
            end = off + step
            if end > n:
                end = n
            if end - off <= PIECE_SIZE:
                break
            kind, rid, length, epoch, counter, poff = _unpack_piece(buf, off)
            if rid != lid:
                break
            if kind == KIND_PIECE:
                # a piece of a sealed record (TUN super-packets: nearly every packet of a bulk
                # transfer). The next piece, in order, of the record being filled goes in place
                # here; anything else takes _piece. Nothing is authentic until the record opens.
                pieces += 1
                rec = self._filling
                if counter == rec.counter and poff == rec.end and length == rec.length and epoch == rec.epoch:
                    room = step - PIECE_SIZE
                    k = (n - off) // step  # full-size packets from this one on (a GRO read: all but the last)
                    if k >= RUN_MIN and room > 0:
                        left = (rec.total - poff) // room
                        if k > left:
                            k = left
                        if k >= RUN_MIN:
                            # a run of k pieces in one struct call: each one's first 18 head bytes,
                            # offset and bytes; taken if every head is this one's (checked above)
                            # and the offsets follow on, else packet by packet below
                            vals = _run(step, k).unpack_from(buf, off)
                            stop = poff + k * room
                            if vals[0::3] == (vals[0],) * k and vals[1::3] == tuple(range(poff, stop, room)):
                                rec.buf[poff:stop] = b"".join(vals[2::3])
                                rec.end = stop
                                rec.count += k
                                pieces += k - 1
                                off += k * step
                                if stop == rec.total:
                                    opened += self._open_record(rec, now)
                                    decrypt, nonce, window, recv_epoch = self._rx_key
                                continue
                    last = poff + end - off - PIECE_SIZE
                    if last < rec.total:
                        rec.buf[poff:last] = buf[off + PIECE_SIZE : end]
                        rec.end = last
                        rec.count += 1
                        off = end
                        continue
                    # the record's last piece (poff is inside the record: it is not whole yet);
                    # any bytes after the record's end are the sender's padding
                    last = rec.total
                    rec.buf[poff:last] = buf[off + PIECE_SIZE : off + PIECE_SIZE + last - poff]
                    rec.end = last
                    rec.count += 1
                    off = end
                    opened += self._open_record(rec, now)
                    decrypt, nonce, window, recv_epoch = self._rx_key
                    continue
                opened += self._piece(buf, off, end, length, epoch, counter, poff, now)
                decrypt, nonce, window, recv_epoch = self._rx_key
                frames_seen = self._frames_seen
                live = now < self._expire_at
                off = end
                continue
            if kind != KIND_DATA or end - off < DATA_OVERHEAD:
                break
            if length != end - off - LENGTH_FROM:
                self.malformed += 1
                bad += 1
                off = end
                continue
            hstart = off + DATA_SIZE
            body = off + BODY_AT
            hi = window.highest
            if counter > hi and epoch == recv_epoch:
                # a newer record of the current key (nearly every packet): RecvCipher.open's
                # first case without the call
                try:
                    plain: bytes | None = decrypt(nonce(counter), buf[body:end], buf[hstart:body])
                except InvalidTag:
                    plain = None
                else:
                    shift = counter - hi
                    # the next counter with none missing: the bitmap stays all ones (no big-int
                    # arithmetic for nearly every packet of a lossless path)
                    if shift != 1 or window.bitmap != WINDOW_MASK:
                        window.bitmap = (((window.bitmap << shift) | 1) & WINDOW_MASK
                                         if shift < REPLAY_WINDOW else 1)
                    window.highest = counter
            else:
                plain = recv.open(buf[hstart:body], epoch, counter, buf[body:end])
                if recv.epoch != recv_epoch:  # the peer rekeyed: that record opened the next epoch
                    decrypt, nonce, window, recv_epoch = self._rx_key = recv.current()
            off = end
            if plain is None:
                if recv.window.highest >= counter and epoch == recv.epoch:
                    self.replayed += 1
                else:
                    self.forged += 1
                bad += 1
                continue
            plen = len(plain)
            if expect is not None:
                if plen == x_plen and plain.startswith(expect):
                    # exactly the head foretold by the last packet: the next full-size piece of
                    # the same datagram, with the same ACK (nothing new in it). The checks below
                    # held for every field of it then; only the end and the byte bound can differ.
                    last = x_end + x_fn
                    if last <= x_entry.total and self._frag_bytes + x_cost <= self.reassembly_bytes:
                        x_entry.pieces[x_end] = memoryview(plain)[AD_SIZE:]
                        x_entry.got += x_fn
                        x_entry.end = x_end = last
                        self._frag_bytes += x_cost
                        if x_entry.got == x_entry.total:
                            expect = None
                            self._complete(x_fid, x_entry)
                        else:
                            expect = _pack_ad(CH_ACK, x_wire, 0, CH_DFRAG, x_fid, x_entry.total, last, x_fn)
                        continue
                expect = None
            if plen > AD_SIZE and frames_seen:
                a_type, wire, sack, d_type, fid, total, foff, fn = _unpack_ad(plain)
                if a_type == CH_ACK:
                    # an ACK and (nearly every packet of TUN traffic) a DFRAG piece: one unpack for
                    # both; a packet with another chunk after its ACK takes _chunks from there
                    acked = sack or wire != self.snd_una & MASK  # else nothing new (most packets)
                    if acked:
                        self._on_ack(wire, sack, now)
                    # the next piece, in order, of a datagram being put together (the rest of the
                    # packet, if any, is the start of the next datagram: _chunks takes it). Nothing
                    # it could overlap, its total checked with the first piece: only its own size
                    # and the byte bound. Anything else takes _chunks and _on_fragment's full checks.
                    entry = frags.get(fid) if d_type == CH_DFRAG else None
                    last = foff + fn
                    if (entry is not None and foff == entry.end and total == entry.total and last <= total
                            and (fn >= FRAG_MIN or last == total) and fn <= plen - AD_SIZE and live
                            and self._frag_bytes + fn + PIECE_COST <= self.reassembly_bytes):
                        stop = AD_SIZE + fn
                        if stop == plen:  # the piece fills the packet: a view of it
                            entry.pieces[foff] = memoryview(plain)[AD_SIZE:]
                            if last < total and not acked:
                                # foretell the next packet's head: the following piece, same size
                                # and ACK (a flush's packets carry one ACK)
                                expect = _pack_ad(CH_ACK, wire, 0, CH_DFRAG, fid, total, last, fn)
                                x_entry, x_fid, x_end, x_fn, x_plen = entry, fid, last, fn, plen
                                x_wire, x_cost = wire, fn + PIECE_COST
                        else:  # a view if the piece is most of the packet, else a copy (see _chunks)
                            piece = memoryview(plain)[AD_SIZE:stop]
                            entry.pieces[foff] = piece if 2 * fn >= plen else bytes(piece)
                        entry.got += fn
                        entry.end = last
                        self._frag_bytes += fn + PIECE_COST
                        if entry.got == total:
                            self._complete(fid, entry)
                        if stop < plen:
                            self._chunks(plain, stop, now)
                            live = now < self._expire_at
                        continue
                    self._chunks(plain, ACK_SIZE, now)
                    live = now < self._expire_at
                    continue
            pos = 0
            if plain[0] == CH_ACK and plen >= ACK.size:  # every packet starts with one
                _, wire, sack = ACK.unpack_from(plain)
                if sack or wire != self.snd_una & MASK:
                    self._on_ack(wire, sack, now)
                pos = ACK.size
            self._chunks(plain, pos, now)
            live = now < self._expire_at
        # every packet up to `off` was one of ours: the data packets not counted bad were
        # authentic, and the pieces of the records that opened
        good = (off + step - 1) // step - bad - pieces + opened if off else 0
        if good and not self.confirmed:
            self.confirmed = True  # the responder's first sealed packet: the handshake is done
            self._hs_at = None
            self._hs_packet = None
        self.packets_in += good
        return good, off

    def _piece(self, buf: memoryview, off: int, end: int, length: int, epoch: int, counter: int, poff: int,
               now: float) -> int:
        """A KIND_PIECE packet (buf[off:end]) receive_batch did not take inline: checked, put in
        its record (made if new, within the table's bounds); returns the pieces authentic if it
        completed the record (0 if not yet, or if it did not open)."""
        recv = self.recv
        assert recv is not None
        if not self.pieces or not self._frames_seen:
            # a peer that did not offer CAP_PIECES sends none; before the HELLO the link is not up
            self.unexpected += 1
            return 0
        n = end - off - PIECE_SIZE
        total = length - RECORD_EXTRA
        if (total <= TAG or total > PIECED_MAX or poff >= total
                or total + PIECE_COST > self.reassembly_bytes):
            self.frag_malformed += 1
            return 0
        if poff + n > total:
            n = total - poff  # the last piece: its padding is not the record's
        if now >= self._expire_at:
            self._expire(now)
        records = self._records
        key = epoch << 64 | counter
        rec = records.get(key)
        if rec is None:
            if epoch == recv.epoch and not recv.window.check(counter):
                self.replayed += 1  # a piece of a record opened already (or older than the window)
                return 0
            while records and (len(records) >= self.reassembly
                               or self._frag_bytes + total + PIECE_COST > self.reassembly_bytes):
                self._drop_record(next(iter(records)))
                self.frag_evicted += 1
            rec = records[key] = _Record(key, length, epoch, counter, now)
            self._frag_bytes += rec.cost()
            if self._expire_at == INF:
                self._expire_at = now + self.reassembly_timeout
        elif rec.length != length:
            self.frag_malformed += 1  # not this record's header: refused, the record stays
            return 0
        filled = rec.end
        later = rec.later
        if poff < filled or poff in later:
            self.duplicates += 1
            return 0
        rec.buf[poff : poff + n] = buf[off + PIECE_SIZE : off + PIECE_SIZE + n]
        rec.count += 1
        if poff != filled:
            later[poff] = n  # past a gap: receive_batch leaves the record to this path until it closes
            if self._filling is rec:
                self._filling = _NO_RECORD
            return 0
        filled += n
        while later:
            more = later.pop(filled, None)
            if more is None:
                break
            filled += more
        rec.end = filled
        if filled == rec.total:
            return self._open_record(rec, now)
        if not later:
            self._filling = rec
        return 0

    def _open_record(self, rec: _Record, now: float) -> int:
        """A pieced record is whole: open it as a data packet's record; the pieces it had if
        authentic (its plaintext then handled as a data packet's), else 0 (counted)."""
        self._drop_record(rec.key)
        recv = self.recv
        assert recv is not None
        plain = recv.open(RECORD.pack(rec.length, rec.epoch, rec.counter), rec.epoch, rec.counter,
                          memoryview(rec.buf))
        if recv.epoch != self._rx_key[3]:
            self._rx_key = recv.current()  # the peer rekeyed: that record opened the next epoch
        if plain is None:
            if recv.window.highest >= rec.counter and rec.epoch == recv.epoch:
                self.replayed += rec.count
            else:
                self.forged += rec.count
            return 0
        if len(plain) > DGRAM.size and plain[0] == CH_DGRAM and DGRAM.unpack_from(plain)[1] == len(plain) - 3:
            self._deliver_datagram(memoryview(plain)[DGRAM.size :])  # (what the sender puts there)
        else:
            self._chunks(plain, 0, now)
        return rec.count

    def _drop_record(self, key: int) -> None:
        rec = self._records.pop(key)
        self._frag_bytes -= rec.cost()
        if rec is self._filling:
            self._filling = _NO_RECORD

    def _receive_other(self, packet: bytes | bytearray | memoryview, now: float) -> bool:
        """Everything but a well-formed data packet of an established session."""
        if not packet:
            self.malformed += 1
        elif packet[0] not in (KIND_DATA, KIND_PIECE):
            self._receive_handshake(packet, now)
        elif self.recv is None:
            self.unexpected += 1  # data before msg3 (msg3 lost): the sender retransmits
        else:
            self.malformed += 1  # too short
        return False

    def newest(self, packet: bytes | bytearray | memoryview) -> bool:
        """Whether this data packet, just accepted by `receive`, is the newest record seen (the
        roaming test: a replay or a straggler from the peer's old address is not)."""
        recv = self.recv
        if recv is None or len(packet) <= PIECE_SIZE or packet[0] not in (KIND_DATA, KIND_PIECE):
            return False
        _, epoch, counter = RECORD.unpack_from(packet, DATA.size)
        return bool(epoch == recv.epoch and recv.window.highest == counter)

    def _chunks(self, plain: bytes, pos: int, now: float) -> None:
        end = len(plain)
        view = memoryview(plain)
        while pos < end:
            t = plain[pos]
            if t == CH_SEG:
                if end - pos < SEG.size:
                    break
                _, wire, n = SEG.unpack_from(plain, pos)
                pos += SEG.size
                if end - pos < n:
                    break
                self._on_segment(wire, view[pos : pos + n])
                pos += n
            elif t == CH_DFRAG:
                if end - pos < DFRAG.size:
                    break
                _, fid, total, off, n = DFRAG.unpack_from(plain, pos)
                pos += DFRAG.size
                if end - pos < n:
                    break
                if self._frames_seen and not self.pieces:
                    # a piece that is most of its packet is kept as a view of the packet; a small
                    # one is copied, so a held piece never pins much more than its own bytes
                    piece = view[pos : pos + n] if 2 * n >= end else bytes(view[pos : pos + n])
                    self._on_fragment(fid, total, off, piece, now)
                else:
                    self.unexpected += 1
                pos += n
            elif t == CH_DGRAM:
                if end - pos < DGRAM.size:
                    break
                n = DGRAM.unpack_from(plain, pos)[1]
                pos += DGRAM.size
                if end - pos < n:
                    break
                if self._frames_seen:
                    self.malformed += iter_frames(bytes(view[pos : pos + n]), self.on_frame)
                else:
                    self.unexpected += 1  # before the HELLO (still on its way): the link is not up
                pos += n
            elif t == CH_ACK:
                if end - pos < ACK.size:
                    break
                _, wire, sack = ACK.unpack_from(plain, pos)
                pos += ACK.size
                self._on_ack(wire, sack, now)
            elif t == CH_CLOSE:
                raise LinkError("closed", "peer closed the link")
            else:
                break
        else:
            return
        self.malformed += 1

    def _on_fragment(self, fid: int, total: int, off: int, piece: bytes | memoryview, now: float) -> None:
        """One DFRAG piece: held until its datagram is whole, which then goes to on_frame."""
        frags = self._frags
        if now >= self._expire_at:
            self._expire(now)
        n = len(piece)
        entry = frags.get(fid)
        if (
            total < FRAME.size or off + n > total or not n
            or (off + n < total and n < FRAG_MIN)  # a sender cuts pieces of FRAG_MIN at least
            or total + PIECE_COST > self.reassembly_bytes
            or (entry is not None and (entry.total != total or entry.got + n > total
                                       or (off < entry.end and entry.overlaps(off, n))))
        ):
            self.frag_malformed += 1
            if entry is not None:
                self._drop_entry(fid)
            return
        if entry is None:
            if n == total:
                self._deliver_datagram(piece)  # a whole frame in one piece (a tiny MTU's leftover)
                return
            while len(frags) >= self.reassembly:
                self._drop_entry(next(iter(frags)))
                self.frag_evicted += 1
            entry = frags[fid] = _Reassembly(total, now)
            if self._expire_at == INF:
                self._expire_at = now + self.reassembly_timeout
        cost = n + PIECE_COST
        while self._frag_bytes + cost > self.reassembly_bytes:
            oldest = next(iter(frags))
            self._drop_entry(oldest)
            self.frag_evicted += 1
            if oldest == fid:
                return
        entry.pieces[off] = piece
        entry.got += n
        self._frag_bytes += cost
        if off >= entry.end:
            entry.end = off + n
        else:
            entry.in_order = False
        if entry.got == total:
            self._complete(fid, entry)

    def _complete(self, fid: int, entry: _Reassembly) -> None:
        # no piece overlaps another and they add up to the total: they cover it exactly
        self._drop_entry(fid)
        pieces = entry.pieces
        if entry.in_order:
            self._deliver_datagram(b"".join(pieces.values()))
        else:
            self._deliver_datagram(b"".join(p for _, p in sorted(pieces.items())))

    def _expire(self, now: float) -> None:
        """Drop the datagrams whose first piece came `reassembly_timeout` ago (the oldest first:
        entries are in creation order); note when the next one is due."""
        frags = self._frags
        limit = now - self.reassembly_timeout
        due = INF
        while frags:
            first = next(iter(frags))
            created = frags[first].created
            if created > limit:
                due = created + self.reassembly_timeout
                break
            self._drop_entry(first)
            self.frag_timeout += 1
        records = self._records
        while records:
            rec = next(iter(records.values()))
            if rec.created > limit:
                due = min(due, rec.created + self.reassembly_timeout)
                break
            self._drop_record(rec.key)
            self.frag_timeout += 1
        self._expire_at = due

    def _drop_entry(self, fid: int) -> None:
        entry = self._frags.pop(fid)
        self._frag_bytes -= entry.cost()

    def _deliver_datagram(self, frame: bytes | memoryview) -> None:
        """A reassembled frame: exactly one DATAGRAM frame, or it is dropped as malformed."""
        if len(frame) < FRAME.size:
            self.frag_malformed += 1
            return
        ftype, flags, hop, length, src, dst = FRAME.unpack_from(frame)
        if ftype not in UNRELIABLE or FRAME.size + length != len(frame):
            self.frag_malformed += 1
            return
        self.reassembled += 1
        self.on_frame(ftype, flags, hop, src, dst, memoryview(frame)[FRAME.size :])

    def reassembly_held(self) -> tuple[int, int]:
        """(datagrams being reassembled, bytes charged for their pieces)."""
        return len(self._frags) + len(self._records), self._frag_bytes

    def _on_segment(self, wire: int, data: memoryview) -> None:
        self._ack_owed = True
        seq = _unwrap(wire, self.rcv_next)
        if seq < self.rcv_next:
            self.duplicates += 1  # our ACK was lost: the one owed now repairs that
            return
        if seq >= self.rcv_next + self._rx_max_segments:
            self.beyond_window += 1
            return
        if seq != self.rcv_next:
            if seq in self._ooo:
                self.duplicates += 1
            else:
                self._ooo[seq] = bytes(data)
            return
        rx = self._rx
        rx += data
        nxt = seq + 1
        ooo = self._ooo
        while ooo:
            more = ooo.pop(nxt, None)
            if more is None:
                break
            rx += more
            nxt += 1
        self.rcv_next = nxt
        if len(rx) >= self._need:
            self._deliver()

    def _deliver(self) -> None:
        """Hand every whole frame at the front of the stream to on_frame."""
        rx = self._rx
        pos, end = 0, len(rx)
        need = FRAME.size
        while end - pos >= FRAME.size:
            need = FRAME.size + FRAME.unpack_from(rx, pos)[3]
            if end - pos < need:
                break
            pos += need
            need = FRAME.size
        self._need = need  # a 64 KB frame spans ~46 segments: parse its header once, not 46 times
        if not pos:
            return
        # copied out so a frame's memoryview stays valid whatever the handler keeps
        frames = bytes(rx[:pos])
        del rx[:pos]
        self._frames_seen = True
        self.malformed += iter_frames(frames, self.on_frame)

    def _on_ack(self, wire: int, sack: int, now: float) -> None:
        if not sack and wire == self.snd_una & MASK:
            return  # nothing new (every packet of a one-way bulk transfer carries this one)
        cum = _unwrap(wire, self.snd_una)
        if cum > self.snd_nxt or cum < self.snd_una:
            self.malformed += 1
            return
        unacked = self._unacked
        acked = 0
        if cum > self.snd_una:
            newest: list[object] | None = None
            for seq in range(self.snd_una, cum):
                seg = unacked.pop(seq, None)
                if seg is not None:
                    acked += len(seg[0])  # type: ignore[arg-type]
                    newest = seg
            if newest is not None and newest[2] == 1:
                self._rtt_sample(now - newest[1])  # type: ignore[operator]
            self.snd_una = cum
            self._backoff = 0
            self._rto_at = now + self.rto if unacked else None
        if sack:
            base = cum + 1
            while sack:
                low = sack & -sack
                seq = base + low.bit_length() - 1
                sack ^= low
                seg = unacked.pop(seq, None)
                if seg is not None:
                    acked += len(seg[0])  # type: ignore[arg-type]
                if seq > self._highest_sacked:
                    self._highest_sacked = seq
        if acked:
            self._inflight -= acked
            if self.cwnd < self.ssthresh:
                self.cwnd += acked
            else:
                self.cwnd += max(1, self.seg_room * acked // self.cwnd)
            self.cwnd = min(self.cwnd, self.window)
        if self._highest_sacked - DUP_THRESH >= self.snd_una and unacked:
            self._fast_retransmit(now)

    def _fast_retransmit(self, now: float) -> None:
        limit = self._highest_sacked - DUP_THRESH
        gate = now - max(self.srtt, 0.001)  # once per RTT per segment
        lost = False
        for seq, seg in self._unacked.items():
            if seq > limit:
                break
            if seg[1] <= gate:  # type: ignore[operator]
                seg[1] = now  # claimed for the next flush; its send time is set again there
                self._retx.append(seq)
                lost = True
        if lost and self.snd_una > self._recover:
            self._recover = self.snd_nxt
            self.cwnd = max(self.cwnd // 2, MIN_CWND_SEGMENTS * self.seg_room)
            self.ssthresh = self.cwnd

    def _rtt_sample(self, rtt: float) -> None:
        if self.srtt == 0.0:
            self.srtt, self.rttvar = rtt, rtt / 2
        else:
            self.rttvar = 0.75 * self.rttvar + 0.25 * abs(self.srtt - rtt)
            self.srtt = 0.875 * self.srtt + 0.125 * rtt
        self.rto = min(MAX_RTO, max(MIN_RTO, self.srtt + 4 * self.rttvar))

    # ------------------------------------------------------------------ timers

    def deadline(self) -> float | None:
        """When `on_timer` wants to run next (None: nothing pending)."""
        a, b = self._hs_at, self._rto_at
        if a is None:
            return b
        return a if b is None or a < b else b

    def on_timer(self, now: float) -> None:
        if self._hs_at is not None and now >= self._hs_at:
            if self._hs_packet is not None and (self._hs is not None or not self.confirmed):
                self._out.append(self._hs_packet)
                self._hs_interval = min(HS_RESEND_MAX, self._hs_interval * 2)
                self._hs_at = now + self._hs_interval
            else:
                self._hs_at = None
        if self._rto_at is not None and now >= self._rto_at:
            if not self._unacked:
                self._rto_at = None
                return
            self._backoff += 1
            if self._backoff > self.max_retransmits:
                raise LinkError("retransmits", f"nothing acknowledged after {self.max_retransmits} timeouts")
            self.ssthresh = max(self._inflight // 2, MIN_CWND_SEGMENTS * self.seg_room)
            self.cwnd = MIN_CWND_SEGMENTS * self.seg_room
            self._retx.appendleft(next(iter(self._unacked)))
            self._rto_at = now + min(MAX_RTO, self.rto * (2 ** self._backoff))

    # ------------------------------------------------------------------ send

    def send_frame(
        self,
        ftype: int,
        flags: int,
        hop: int,
        src: int,
        dst: int,
        head: bytes | bytearray | memoryview,
        data: bytes | bytearray | memoryview = b"",
    ) -> None:
        """Queue one frame: a DATAGRAM goes unreliably (whole if it fits a packet, else in
        DFRAG pieces), anything else on the reliable channel."""
        n = len(head) + len(data)
        whole = FRAME.size + n + DGRAM.size + ACK.size <= self.plain_room  # one DGRAM chunk
        if ftype in UNRELIABLE and (whole or FRAME.size + n <= self.dfrag_max):
            if not whole and self.pieces:
                # one record of its own, cut into KIND_PIECE packets at the flush: its plaintext is
                # what a data packet holding it whole would carry (a DGRAM chunk)
                plain = b"".join((DGRAM.pack(CH_DGRAM, FRAME.size + n),
                                  FRAME.pack(ftype, flags, hop, n, src, dst), head, data))
                self._dgrams.append((plain,))
                self.fragmented_out += 1
                self._dgram_bytes += len(plain)
                return
            frame = b"".join((FRAME.pack(ftype, flags, hop, n, src, dst), head, data))
            if whole:
                self._dgrams.append(frame)
            else:
                self._dgram_id = (self._dgram_id + 1) & MASK
                self._dgrams.append([self._dgram_id, memoryview(frame), 0])
                self.fragmented_out += 1
            self._dgram_bytes += len(frame)
            return
        if len(self._tx) + FRAME.size + n > self.queue_limit:
            raise LinkError("queue_full", f"more than {self.queue_limit} bytes queued on the link")
        tx = self._tx
        tx += FRAME.pack(ftype, flags, hop, n, src, dst)
        tx += head
        if data:
            tx += data

    def close(self) -> None:
        """Tell the peer at the next flush (best effort: one unreliable packet)."""
        self._close = True

    def wants_flush(self) -> bool:
        return bool(self._out or self._ack_owed or self._retx or self._dgrams or self._close or (
            self._tx and self._inflight + min(len(self._tx), self.seg_room) <= min(self.cwnd, self.window)))

    def packets_to_send(self, now: float) -> list[bytes]:
        """Every packet this session can send now, in order: handshake packets, then data
        packets (retransmissions first, new segments within the window, datagrams packed
        into the room left, a pure ACK if nothing else carried one)."""
        out, self._out = self._out, []
        send = self.send
        if send is None:
            return out
        wire, sack = self._ack_fields()
        ack = ACK.pack(CH_ACK, wire, sack)
        prefix = DATA.pack(KIND_DATA, self.peer_id)
        join = b"".join
        dgrams = self._dgrams
        unacked = self._unacked
        n_before = len(out)
        retx = self._retx
        while retx:
            seq = retx.popleft()
            entry = unacked.get(seq)
            if entry is not None:
                data: bytes = entry[0]  # type: ignore[assignment]
                entry[1] = now
                entry[2] += 1  # type: ignore[operator]
                self.retransmits += 1
                out.append(self._packet(prefix, [ack, SEG.pack(CH_SEG, seq & MASK, len(data)), data]))
        tx = self._tx
        if tx:
            # the bulk path: one full segment per packet, locals only
            limit = min(self.cwnd, self.window)
            seg_room = self.seg_room
            inflight = self._inflight
            snd_nxt = self.snd_nxt
            pack_seg = SEG.pack
            if self._rto_at is None:
                self._rto_at = now + self.rto * (2 ** self._backoff)
            plains: list[bytes] = []  # sealed together after the loop (send.seal_batch)
            while tx:
                n = len(tx)
                if n > seg_room:
                    n = seg_room
                if inflight + n > limit:
                    break
                seg = tx[:n]
                del tx[:n]  # from the front of a bytearray: no memmove
                unacked[snd_nxt] = [seg, now, 1]
                parts: list[bytes | bytearray | memoryview] = [ack, pack_seg(CH_SEG, snd_nxt & MASK, n), seg]
                snd_nxt += 1
                inflight += n
                if dgrams:
                    out.append(self._packet(prefix, parts))  # (only before the full-segment packets)
                else:
                    plains.append(join(parts))
            send.seal_batch(prefix, plains, out)
            self._inflight = inflight
            self.snd_nxt = snd_nxt
            if not unacked:
                self._rto_at = None
        pieced = 0  # KIND_PIECE packets in `out` (they carry no ACK)
        if dgrams:
            # the bulk path of big datagrams: every full packet of the head datagram's pieces
            # straight from its frame, locals only; its tail and the rest go through _packet
            room = self.plain_room - ACK_DFRAG.size
            pack_ad = ACK_DFRAG.pack
            while dgrams:
                d = dgrams[0]
                if isinstance(d, tuple):
                    dgrams.popleft()
                    self._dgram_bytes -= len(d[0])
                    pieced += self._seal_pieces(d[0], out)
                    continue
                if not isinstance(d, bytes) and len(d[1]) - d[2] > room:
                    fid, frame, off = d
                    total = len(frame)
                    start = off
                    pieces: list[bytes] = []
                    while total - off > room:
                        # the ACK and the piece's header in one struct call, the piece added to it
                        pieces.append(pack_ad(CH_ACK, wire, sack, CH_DFRAG, fid, total, off, room)
                                      + frame[off : off + room])
                        off += room
                    send.seal_batch(prefix, pieces, out)
                    d[2] = off
                    self._dgram_bytes -= off - start
                out.append(self._packet(prefix, [ack]))
        if self._close or (len(out) - pieced == n_before and self._ack_owed):
            out.append(self._packet(prefix, [ack]))  # a pure ACK (or the CLOSE)
        self._ack_owed = False
        self.packets_out += len(out)
        return out

    def _seal_pieces(self, plain: bytes, out: list[bytes]) -> int:
        """Seal `plain` as one record and append it to `out` cut into KIND_PIECE packets of one
        size: as few as the packet size allows, the record cut evenly between them and the last
        padded with (fewer than that many) zeros. So the pieces of records of one size (a TCP
        flow's super-packets through TUN) make one GSO run across records, up to GSO_MAX_BYTES
        a send, and one GRO read at the receiver. Returns how many."""
        send = self.send
        assert send is not None
        header, ct = send.seal(plain)
        length, epoch, counter = RECORD.unpack(header)
        total = len(ct)
        count = -(-total // (self.payload - PIECE_SIZE))
        size = -(-total // count)
        pack, rid, view = PIECE.pack, self.peer_id, memoryview(ct)
        out.extend([pack(KIND_PIECE, rid, length, epoch, counter, off) + view[off : off + size]
                    for off in range(0, total, size)])
        pad = count * size - total
        if pad:
            out[-1] += bytes(pad)
        return count

    def _packet(self, prefix: bytes, parts: list[bytes | bytearray | memoryview]) -> bytes:
        """Seal one data packet: `parts` (ACK, maybe a segment) plus the queued datagrams
        that fit the room left (whole, or the next piece of a big one), plus CLOSE if the
        link is closing."""
        used = sum(map(len, parts))
        room = self.plain_room
        dgrams = self._dgrams
        while dgrams:
            d = dgrams[0]
            if isinstance(d, tuple):
                break  # a pieced record: packets of its own
            if isinstance(d, bytes):
                if used + DGRAM.size + len(d) > room:
                    break
                dgrams.popleft()
                self._dgram_bytes -= len(d)
                parts.append(DGRAM.pack(CH_DGRAM, len(d)))
                parts.append(d)
                used += DGRAM.size + len(d)
                continue
            left = room - used - DFRAG.size
            if left < FRAG_MIN:
                break
            fid, frame, off = d
            total = len(frame)
            n = total - off
            if n > left:
                n = left
                d[2] = off + n
            else:
                dgrams.popleft()
            self._dgram_bytes -= n
            parts.append(DFRAG.pack(CH_DFRAG, fid, total, off, n))
            parts.append(frame[off : off + n])
            used += DFRAG.size + n
        if self._close and used < room:
            parts.append(bytes((CH_CLOSE,)))
            self._close = False
        assert self.send is not None
        header, ct = self.send.seal(b"".join(parts))
        return b"".join((prefix, header, ct))

    def _ack_fields(self) -> tuple[int, int]:
        """What the ACK chunk of this flush's packets says: (next expected segment, SACK bitmap)."""
        sack = 0
        if self._ooo:
            base = self.rcv_next + 1
            ooo = self._ooo
            for i in range(SACK_BITS):
                if base + i in ooo:
                    sack |= 1 << i
        return self.rcv_next & MASK, sack
