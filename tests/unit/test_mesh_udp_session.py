"""The udp:// link session (sans-I/O) over a simulated channel: seeded loss, reordering and
duplication on a virtual clock. Handshake under loss, reliable frames exactly once and in
order, datagrams never twice, big datagrams in pieces (whole or not at all, packed densely,
a bounded reassembly table, bad pieces counted), the window bound, the retransmission
budget, bad packets counted and dropped, and hypothesis fuzzes of the packet and fragment
decoders."""

from __future__ import annotations

import contextlib
import heapq
import os
import random
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshgate.mesh.frames import DATAGRAM, FRAME, MAX_BODY, PING, STREAM_DATA, LinkError
from meshgate.mesh.udp_session import (
    ACK,
    CAP_PIECES,
    CH_ACK,
    CH_DFRAG,
    CH_DGRAM,
    DATA,
    DATA_OVERHEAD,
    DFRAG,
    DFRAG_MAX,
    INIT_MIN,
    KIND_DATA,
    KIND_INIT,
    KIND_PIECE,
    MIN_RTO,
    PIECE,
    PIECE_SIZE,
    UdpSession,
    is_init,
    payload_size,
    receiver_id,
)

PSK = bytes(range(32))
OLD = (True, False)  # b a node from before CAP_PIECES: big datagrams in DFRAG chunks, both ways
Frame = tuple[int, int, int, int, int, bytes]


class Wire:
    """Two sessions joined by a lossy, reordering, duplicating channel; time is virtual."""

    def __init__(
        self, seed: int, loss: float = 0.0, dup: float = 0.0, jitter: float = 0.0, delay: float = 0.005,
        window: int = 256 << 10, payload: int = 1472, max_retransmits: int = 8,
        pieces: tuple[bool, bool] = (True, True), **reassembly: float,
    ) -> None:
        self.rng = random.Random(seed)
        self.loss, self.dup, self.jitter, self.delay = loss, dup, jitter, delay
        self.now = 0.0
        self.got: dict[str, list[Frame]] = {"a": [], "b": []}
        # pieces: whether each end offers CAP_PIECES (False: a node from before it, DFRAG chunks)
        self.a = UdpSession(True, "net", PSK, self._frame("b"), 0x1111, payload=payload, window=window,
                            max_retransmits=max_retransmits, pieces=pieces[0],
                            **reassembly)  # type: ignore[arg-type]
        self.b = UdpSession(False, "net", PSK, self._frame("a"), 0x2222, payload=payload, window=window,
                            max_retransmits=max_retransmits, pieces=pieces[1],
                            **reassembly)  # type: ignore[arg-type]
        self._q: list[tuple[float, int, str, bytes]] = []
        self._n = 0
        self.max_inflight = 0
        self.cut = False  # drop everything (a vanished peer)
        self.sent_packets = 0
        self._spacing = 0.0
        self.max_held = (0, 0)  # the most b's reassembly table held (entries, bytes)

    def _frame(self, sender: str):  # type: ignore[no-untyped-def]
        other = "a" if sender == "b" else "b"

        def on_frame(ftype: int, flags: int, hop: int, src: int, dst: int, body: memoryview) -> None:
            self.got[other].append((ftype, flags, hop, src, dst, bytes(body)))

        return on_frame

    def _put(self, dst: str, packet: bytes) -> None:
        self.sent_packets += 1
        if self.cut or self.rng.random() < self.loss:
            return
        copies = 2 if self.rng.random() < self.dup else 1
        # packets of one flush leave 10 us apart (a wire serialises them); jitter reorders
        self._spacing += 1e-5
        for _ in range(copies):
            at = self.now + self._spacing + self.delay + self.rng.random() * self.jitter
            self._n += 1
            heapq.heappush(self._q, (at, self._n, dst, packet))

    def flush(self) -> None:
        self._spacing = 0.0
        for p in self.a.packets_to_send(self.now):
            self._put("b", p)
        for p in self.b.packets_to_send(self.now):
            self._put("a", p)
        self.max_inflight = max(self.max_inflight, self.a._inflight, self.b._inflight)

    def run(self, until: float, done=lambda: False) -> None:  # type: ignore[no-untyped-def]
        """Deliver and fire timers in time order until `done()` or the deadline."""
        self.flush()
        while self.now < until and not done():
            deadlines = [d for d in (self.a.deadline(), self.b.deadline()) if d is not None]
            if self._q:
                deadlines.append(self._q[0][0])
            if not deadlines:
                break
            self.now = max(self.now, min(deadlines))
            # one "loop tick": every packet due now, then one flush (the tick's ACKs)
            while self._q and self._q[0][0] <= self.now:
                _, _, dst, packet = heapq.heappop(self._q)
                (self.a if dst == "a" else self.b).receive(packet, self.now)
                held = self.b.reassembly_held()
                self.max_held = (max(self.max_held[0], held[0]), max(self.max_held[1], held[1]))
            for s in (self.a, self.b):
                d = s.deadline()
                if d is not None and d <= self.now:
                    s.on_timer(self.now)
            self.flush()

    def establish(self) -> None:
        self.a.start(self.now)
        self.run(30.0, lambda: self.a.established and self.b.established and self.a.confirmed)
        assert self.a.established and self.b.established and self.a.confirmed


@pytest.mark.parametrize("seed", range(6))
def test_handshake_completes_under_heavy_loss(seed: int) -> None:
    w = Wire(seed, loss=0.3, dup=0.1, jitter=0.02)
    w.establish()
    assert w.a.peer_id == 0x2222 and w.b.peer_id == 0x1111
    assert w.now < 10.0  # msg1/msg3 retransmissions double from 0.25 s


def test_responder_only_answers_and_never_outgrows_the_request() -> None:
    a = UdpSession(True, "net", PSK, lambda *f: None, 1)
    b = UdpSession(False, "net", PSK, lambda *f: None, 2)
    a.start(0.0)
    (msg1,) = a.packets_to_send(0.0)
    assert len(msg1) == INIT_MIN and is_init(msg1)
    b.receive(msg1, 0.0)
    (msg2,) = b.packets_to_send(0.0)
    assert len(msg2) <= len(msg1) and receiver_id(msg2) == 1
    assert b.deadline() is None  # the responder keeps no retransmission timer
    b.receive(msg1, 0.1)  # a retransmitted msg1 (msg2 was lost): the same msg2 again
    assert b.packets_to_send(0.1) == [msg2]
    assert not is_init(msg1[:-1]) and not is_init(b"\x01" + msg1[1:5] + b"\x07" + msg1[6:])


def test_wrong_secret_fails_the_handshake() -> None:
    a = UdpSession(True, "net", PSK, lambda *f: None, 1)
    b = UdpSession(False, "net", bytes(32), lambda *f: None, 2)
    a.start(0.0)
    b.receive(a.packets_to_send(0.0)[0], 0.0)
    a.receive(b.packets_to_send(0.0)[0], 0.0)  # msg2 carries no PSK yet: a cannot tell
    (msg3,) = a.packets_to_send(0.0)
    with pytest.raises(LinkError) as e:
        b.receive(msg3, 0.0)
    assert e.value.reason == "handshake" and not b.established


@pytest.mark.parametrize(("seed", "loss"), [(1, 0.1), (2, 0.15), (3, 0.2)])
def test_reliable_frames_exactly_once_in_order_under_loss_and_reordering(seed: int, loss: float) -> None:
    w = Wire(seed, loss=loss, dup=0.05, jitter=0.01)
    w.establish()
    rng = random.Random(seed)
    sent = []
    for i in range(300):
        body = os.urandom(rng.choice((0, 8, 100, 1400, 5000, MAX_BODY // 4)))
        ftype = PING if i % 7 == 0 else STREAM_DATA
        sent.append((ftype, 0, 8, 1, 2, body))
        w.a.send_frame(ftype, 0, 8, 1, 2, body)
        if i % 20 == 0:
            w.run(w.now + 0.003)
    w.run(w.now + 120, lambda: len(w.got["b"]) >= len(sent) and not w.a._unacked)
    assert w.got["b"] == sent
    assert w.a.retransmits > 0 and w.b.duplicates + w.a.replayed + w.b.replayed > 0
    assert w.max_inflight <= w.a.window
    assert w.a.buffered() == 0


def test_datagrams_unreliable_never_duplicated_and_never_before_the_first_frame() -> None:
    w = Wire(7, loss=0.1, dup=0.3, jitter=0.0003)  # reordering within the 64-record replay window
    w.establish()
    # before any reliable frame was delivered, b drops datagrams (the HELLO gates a link)
    w.a.send_frame(DATAGRAM, 0, 8, 1, 2, b"\x00\x03", b"early")
    w.run(w.now + 0.1)
    assert w.got["b"] == [] and w.b.unexpected >= 1
    w.a.send_frame(PING, 0, 1, 1, 2, b"hello first")
    w.run(w.now + 5, lambda: len(w.got["b"]) == 1)
    sent = [struct.pack("!I", i) + os.urandom(i % 1300) for i in range(500)]
    for d in sent:
        w.a.send_frame(DATAGRAM, 0, 8, 1, 2, b"\x00\x03", d)
    w.run(w.now + 2)
    got = [f[5][2:] for f in w.got["b"][1:]]
    assert len(got) == len(set(got))  # duplicated packets were dropped by the replay window
    assert set(got) <= set(sent) and 0.7 * len(sent) < len(got) < len(sent)
    assert not w.a._unacked  # datagrams never enter the reliable channel
    # several small datagrams share a packet
    before = w.sent_packets
    for _ in range(20):
        w.a.send_frame(DATAGRAM, 0, 8, 1, 2, b"\x00\x03", b"x" * 40)
    w.flush()
    assert w.sent_packets - before <= 2


def _hello(w: Wire) -> None:
    """The first reliable frame: b accepts datagrams from then on."""
    w.a.send_frame(PING, 0, 1, 1, 2, b"first")
    w.run(w.now + 30, lambda: len(w.got["b"]) == 1)
    assert len(w.got["b"]) == 1


def _big(i: int, size: int) -> bytes:
    return struct.pack("!I", i) + os.urandom(size - 4)


@pytest.mark.parametrize("pieces", [(True, True), OLD, (False, True)], ids=["pieces", "old-b", "old-a"])
@pytest.mark.parametrize(("seed", "loss"), [(1, 0.0), (2, 0.02), (3, 0.1)])
def test_big_datagrams_arrive_whole_or_not_at_all_never_twice(
    seed: int, loss: float, pieces: tuple[bool, bool]
) -> None:
    # reordering (jitter) within the 64-record replay window; duplicates are the window's to drop
    jitter, dup = (0.0003, 0.05) if loss else (0.0, 0.0)
    w = Wire(seed, loss=loss, dup=dup, jitter=jitter, reassembly=16, reassembly_bytes=512 << 10,
             pieces=pieces)
    w.establish()
    assert w.a.pieces == w.b.pieces == (pieces == (True, True))
    _hello(w)
    reliable = w.a.snd_nxt
    rng = random.Random(seed)
    sent = {}
    for i in range(300):
        d = _big(i, rng.choice((1400, 1500, 3000, 9000, 32768, DFRAG_MAX - FRAME.size - 2)))
        sent[d[:4]] = d
        w.a.send_frame(DATAGRAM, 0, 8, 1, 2, b"\x00\x03", d)
        if i % 10 == 9:
            w.run(w.now + 0.002)
    w.run(w.now + 2)
    got = [f[5][2:] for f in w.got["b"][1:]]
    assert all(f[0] == DATAGRAM for f in w.got["b"][1:])
    assert len({g[:4] for g in got}) == len(got)  # never twice
    assert all(sent[g[:4]] == g for g in got)  # whole or not at all
    lost = w.b.frag_timeout + w.b.frag_evicted
    if loss == 0.0:
        assert len(got) == len(sent) and lost == 0
    else:
        assert 0.3 * len(sent) < len(got) < len(sent) and lost > 0
        assert len(got) + lost <= len(sent)
    assert w.a.snd_nxt == reliable and not w.a._unacked  # nothing went on the reliable channel
    assert w.a.fragmented_out == sum(1 for d in sent.values() if len(d) > 1400)
    assert w.max_held[0] <= 16 and w.max_held[1] <= 512 << 10
    assert w.b.frag_malformed == 0


def test_fragments_fill_packets_so_gso_runs_stay_whole() -> None:
    w = Wire(11, pieces=OLD)
    w.establish()
    _hello(w)
    data = [_big(i, 30_000) for i in range(10)]
    for d in data:
        w.a.send_frame(DATAGRAM, 0, 8, 1, 2, b"\x00\x03", d)
    packets = w.a.packets_to_send(w.now)
    sizes = [len(p) for p in packets]
    assert all(n == 1472 for n in sizes[:-1]) and sizes[-1] <= 1472  # one equal-size run
    frame_bytes = sum(FRAME.size + 2 + len(d) for d in data)
    # dense: a packet holds at most two pieces (the end of one datagram, the start of the next)
    assert len(packets) <= -(-frame_bytes // (1472 - DATA_OVERHEAD - ACK.size - 2 * DFRAG.size))
    for p in packets:
        w.b.receive(p, w.now)
    assert [f[5][2:] for f in w.got["b"][1:]] == data and w.b.reassembled == 10
    assert w.b.reassembly_held() == (0, 0)


def test_one_read_opens_across_rekeys_and_refuses_its_replay() -> None:
    """receive_batch opens the current key's newer records inline and every other through
    RecvCipher.open: one GRO read in which the sender rekeyed several times delivers each
    datagram once; the same read again delivers nothing and counts every packet as bad."""
    w = Wire(21, pieces=OLD)
    w.establish()
    _hello(w)
    assert w.a.send is not None and w.b.recv is not None
    w.a.send.rekey_after = 7
    data = [_big(i, 30_000) for i in range(3)]
    for d in data:
        w.a.send_frame(DATAGRAM, 0, 8, 1, 2, b"\x00\x03", d)
    packets = w.a.packets_to_send(w.now)
    size = len(packets[0])
    assert all(len(p) == size for p in packets[:-1]) and len(packets) > 3 * 7
    # a straggler: the last record of one epoch behind the first two of the next (a newer
    # counter than the window's, but of the previous key)
    epoch_of = [p[DATA.size + 4] for p in packets]
    first = epoch_of.index(epoch_of[len(packets) // 2])
    packets.insert(first + 1, packets.pop(first - 1))  # (after the pop, first is the second of them)
    read = memoryview(b"".join(packets))
    assert w.b.receive_batch(read, len(read), size, w.now) == (len(packets), len(read))
    assert w.b.recv.epoch == w.a.send.epoch >= 3
    assert [f[5][2:] for f in w.got["b"][1:]] == data
    assert w.b.replayed == w.b.forged == w.b.malformed == 0
    assert w.b.receive_batch(read, len(read), size, w.now) == (0, len(read))
    assert w.b.replayed + w.b.forged == len(packets)
    assert len(w.got["b"]) == 1 + len(data)


def test_a_record_missing_from_a_read_is_accepted_later_once() -> None:
    """The replay window after a run of records with one missing (the inline open's all-ones
    shortcut must not cover it): the missing one, arriving later, is opened; again, refused."""
    w = Wire(22, window=1 << 20, pieces=OLD)
    w.establish()
    _hello(w)
    data = [_big(i, 30_000) for i in range(6)]
    for d in data:
        w.a.send_frame(DATAGRAM, 0, 8, 1, 2, b"\x00\x03", d)
    packets = w.a.packets_to_send(w.now)
    size = len(packets[0])
    late = packets.pop(100)  # behind 64 in a row and more: the window's bitmap is all ones there
    read = memoryview(b"".join(packets))
    assert w.b.receive_batch(read, len(read), size, w.now) == (len(packets), len(read))
    assert len(w.got["b"]) == 1 + len(data) - 1  # the datagram with the missing piece waits
    assert w.b.receive(late, w.now) is True
    assert sorted(f[5][2:] for f in w.got["b"][1:]) == sorted(data)  # the late piece completed its own
    assert w.b.receive(late, w.now) is False and w.b.replayed == 1
    assert len(w.got["b"]) == 1 + len(data)


def _sealed(w: Wire, plain: bytes) -> bytes:
    """A data packet from a to b with this plaintext (authentic: a's key seals it)."""
    assert w.a.send is not None
    header, ct = w.a.send.seal(plain)
    return DATA.pack(KIND_DATA, w.b.local_id) + header + ct


def _frag(fid: int, total: int, off: int, piece: bytes) -> bytes:
    return ACK.pack(CH_ACK, 0, 0) + DFRAG.pack(CH_DFRAG, fid, total, off, len(piece)) + piece


def _frame(body: bytes, ftype: int = DATAGRAM) -> bytes:
    return FRAME.pack(ftype, 0, 8, len(body), 1, 2) + body


def test_a_foretold_piece_is_still_checked() -> None:
    """After an in-order piece, receive_batch foretells the next packet's head (same datagram,
    size and ACK) and takes a packet that has it with fewer checks: a piece that runs past its
    datagram's end, or past the table's byte bound, is still refused there."""
    w = Wire(23, reassembly_bytes=7500, pieces=OLD)
    w.establish()
    _hello(w)
    b = w.b

    def one_read(*plains: bytes) -> None:
        packets = [_sealed(w, p) for p in plains]
        assert len({len(p) for p in packets}) == 1  # one GRO read: equal sizes
        read = memoryview(b"".join(packets))
        assert b.receive_batch(read, len(read), len(packets[0]), w.now) == (len(packets), len(read))

    good = _frame(os.urandom(3500 - FRAME.size))
    # three in-order pieces of 1000 bytes, then one more of the same size that ends past the total
    one_read(*(_frag(1, len(good), off, good[off : off + 1000]) for off in (0, 1000, 2000)),
             _frag(1, len(good), 3000, good[3000:] + bytes(500)))
    assert b.frag_malformed == 1 and b.reassembly_held() == (0, 0) and b.reassembled == 0
    # in-order pieces of a datagram the table takes (7,000 bytes) until their charge (each
    # piece's bytes and PIECE_COST) passes the bound: the last one evicts the oldest (itself)
    big = _frame(os.urandom(7000 - FRAME.size))
    one_read(*(_frag(2, len(big), off, big[off : off + 1000]) for off in range(0, 7000, 1000)))
    assert b.frag_evicted == 1 and b.reassembly_held() == (0, 0)
    # and a datagram cut the same way, whole, is delivered
    one_read(*(_frag(3, len(good), off, good[off : off + 1000]) for off in (0, 1000, 2000)))
    assert b.receive(_sealed(w, _frag(3, len(good), 3000, good[3000:])), w.now) is True
    assert b.reassembled == 1 and w.got["b"][-1][5] == good[FRAME.size :]
    # an ACK of segments never sent is counted in every packet that carries it, foretold or not
    before = b.malformed
    bogus = ACK.pack(CH_ACK, 1000, 0)
    one_read(*(bogus + _frag(4, len(good), off, good[off : off + 1000])[ACK.size :]
               for off in (0, 1000, 2000)))
    assert b.malformed == before + 3


def test_bad_fragments_are_dropped_and_counted_never_delivered() -> None:
    w = Wire(12, reassembly=4, reassembly_bytes=50_000, reassembly_timeout=0.5, pieces=OLD)
    w.establish()
    _hello(w)
    b = w.b
    good = _frame(os.urandom(3000))
    t = len(good)

    def feed(*chunks: bytes) -> None:
        for c in chunks:
            assert b.receive(_sealed(w, c), w.now) is True

    bad = [
        _frag(1, t, t - 100, good[:200]),  # beyond the total
        _frag(2, 10, 0, good[:10]),  # shorter than a frame header
        _frag(3, t, 0, good[:20]),  # a non-final piece below FRAG_MIN
        _frag(4, 60_000, 0, good[:1000]),  # a datagram bigger than the table's bytes
    ]
    feed(*bad)
    assert b.frag_malformed == 4
    # overlapping pieces (in and out of order), a repeated offset and a changed total end the datagram
    for first, second in (
        (_frag(5, t, 0, good[:1000]), _frag(5, t, 500, good[500:1500])),
        (_frag(5, t, 1000, good[1000:2000]), _frag(5, t, 0, good[:1500])),
        (_frag(5, t, 0, good[:1000]), _frag(5, t, 0, good[:1000])),
        (_frag(5, t, 0, good[:1000]), _frag(5, t + 1, 1000, good[1000:2000])),
    ):
        feed(first)
        assert b.reassembly_held()[0] == 1
        feed(second)
        assert b.reassembly_held() == (0, 0)
    assert b.frag_malformed == 8
    # a whole, well-cut frame that is not a DATAGRAM is not delivered either
    stream = _frame(os.urandom(3000), STREAM_DATA)
    feed(_frag(7, len(stream), 0, stream[:1500]), _frag(7, len(stream), 1500, stream[1500:]))
    assert b.frag_malformed == 9 and b.reassembled == 0
    assert len(w.got["b"]) == 1  # only the HELLO stand-in
    # too many at once: the oldest are evicted, the table stays at its bound
    for fid in range(100, 110):
        feed(_frag(fid, t, 0, good[:1000]))
    assert b.reassembly_held()[0] == 4 and b.frag_evicted == 6
    # the byte bound: 3 x 20 KB pieces over 50 KB evicts the oldest
    big = _frame(os.urandom(40_000))
    for fid in range(200, 203):
        feed(_frag(fid, len(big), 0, big[:20_000]))
    assert b.reassembly_held()[1] <= 50_000 and b.frag_evicted >= 6 + 1
    # incomplete ones expire; a good one still goes through afterwards
    w.now += 1.0
    held = b.reassembly_held()[0]
    feed(_frag(300, t, 1500, good[1500:]), _frag(300, t, 0, good[:1500]))  # out of order
    assert b.frag_timeout == held and b.reassembly_held() == (0, 0)
    assert w.got["b"][-1][5] == good[FRAME.size:] and b.reassembled == 1
    assert b.malformed == 0 and b.frag_malformed == 9


def test_fragments_before_the_first_frame_are_dropped() -> None:
    w = Wire(13)
    w.establish()
    w.a.send_frame(DATAGRAM, 0, 8, 1, 2, b"\x00\x03", os.urandom(5000))
    w.run(w.now + 0.1)
    assert w.got["b"] == [] and w.b.unexpected >= 4 and w.b.reassembly_held() == (0, 0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 5000), st.integers(0, 5000),
                          st.integers(0, 1500)), max_size=40),
       st.binary(min_size=16, max_size=16))
def test_fuzz_fragment_decoder_is_bounded_and_delivers_only_whole_frames(
    pieces: list[tuple[int, int, int, int]], header: bytes
) -> None:
    w = Wire(14, reassembly=3, reassembly_bytes=20_000, pieces=OLD)
    w.establish()
    _hello(w)
    body = header + bytes(5000)
    for fid, total, off, n in pieces:
        piece = body[off : off + n]
        assert w.b.receive(_sealed(w, _frag(fid, total, off, piece)), w.now) is True
        entries, held = w.b.reassembly_held()
        assert entries <= 3 and held <= 20_000
        w.now += 0.01
    for f in w.got["b"][1:]:
        assert f[0] == DATAGRAM
    assert w.b.malformed == 0


def test_window_bounds_what_is_in_flight_and_buffered_reports_the_rest() -> None:
    w = Wire(4, window=64 << 10)
    w.establish()
    w.cut = True  # the peer went silent: nothing is acknowledged any more
    data = os.urandom(4 << 20)
    for i in range(0, len(data), 60000):
        w.a.send_frame(STREAM_DATA, 0, 8, 1, 2, data[i : i + 60000])
    w.run(w.now + 1.0)
    assert w.a._inflight <= 64 << 10 and w.max_inflight <= 64 << 10
    assert w.a.buffered() >= len(data) and w.a.queued() >= len(data) - (64 << 10)


def test_link_fails_after_the_retransmission_budget() -> None:
    w = Wire(5, max_retransmits=4)
    w.establish()
    w.cut = True
    w.a.send_frame(PING, 0, 1, 1, 2, b"anyone?")
    with pytest.raises(LinkError) as e:
        w.run(w.now + 120)
    assert e.value.reason == "retransmits"
    assert w.a.retransmits == 4 and w.now >= 4 * MIN_RTO


def test_queue_limit_fails_the_link_instead_of_growing() -> None:
    s = UdpSession(True, "net", PSK, lambda *f: None, 1, queue_limit=100_000)
    with pytest.raises(LinkError) as e:
        for _ in range(10):
            s.send_frame(STREAM_DATA, 0, 8, 1, 2, bytes(20_000))
    assert e.value.reason == "queue_full" and s.queued() <= 100_000


def test_forged_replayed_and_malformed_packets_are_counted_and_dropped() -> None:
    w = Wire(6)
    w.establish()
    w.a.send_frame(PING, 0, 1, 1, 2, b"one")
    pkts = w.a.packets_to_send(w.now)
    (pkt,) = pkts
    w.b.receive(pkt, w.now)
    assert [f[5] for f in w.got["b"]] == [b"one"]
    assert w.b.receive(pkt, w.now) is False and w.b.replayed == 1  # replay
    forged = bytearray(pkt)
    forged[-1] ^= 1
    forged[13] ^= 0x40  # a fresh counter, so it is judged by its tag, not the window
    assert w.b.receive(bytes(forged), w.now) is False and w.b.forged == 1
    for bad in (pkt[:20], pkt[:-1], bytes((KIND_DATA,)) + struct.pack("!I", 0x9999) + pkt[5:], b""):
        assert w.b.receive(bad, w.now) is False
    assert w.b.malformed == 4
    assert [f[5] for f in w.got["b"]] == [b"one"]


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=1600), st.sampled_from([KIND_INIT, 2, 3, KIND_DATA, KIND_PIECE, 0, 255]))
def test_fuzz_decoder_never_raises_but_link_errors(junk: bytes, kind: int) -> None:
    w = Wire(8)
    w.establish()
    for s in (w.a, w.b, UdpSession(False, "net", PSK, lambda *f: None, 9)):
        for packet in (junk, bytes((kind,)) + junk, bytes((kind,)) + b"MGMx\x01" + junk):
            with contextlib.suppress(LinkError):
                s.receive(packet, w.now)
    assert w.got == {"a": [], "b": []}  # nothing forged reached the owner


def test_payload_sizes_fit_ethernet() -> None:
    assert payload_size(1500, False) == 1472 and payload_size(1500, True) == 1452
    w = Wire(9, payload=1452)
    w.establish()
    w.a.send_frame(STREAM_DATA, 0, 8, 1, 2, os.urandom(50_000))
    sizes = [len(p) for p in w.a.packets_to_send(w.now)]
    assert max(sizes) == 1452 and len(sizes) >= 50_000 // 1452
    with pytest.raises(ValueError):
        UdpSession(True, "net", PSK, lambda *f: None, 1, payload=100)


def test_newest_tells_the_latest_record_from_stragglers_and_junk() -> None:
    """The roaming test (link_udp): only the newest authentic record may move a session."""
    w = Wire(15)
    w.establish()
    _hello(w)
    pkts = []
    for i in range(3):
        w.a.send_frame(PING, 0, 1, 1, 2, bytes((i,)))
        pkts += w.a.packets_to_send(w.now)
    p0, p1, p2 = pkts
    assert w.b.receive(p1, w.now) and w.b.newest(p1)
    assert w.b.receive(p0, w.now) and not w.b.newest(p0)  # authentic, but older: a straggler
    assert not w.b.receive(p1, w.now)  # a replay is not even accepted
    assert w.b.receive(p2, w.now) and w.b.newest(p2)
    assert not w.b.newest(b"") and not w.b.newest(p2[:20]) and not w.b.newest(p2[:1] + bytes(60))


def test_a_full_size_datagram_frame_takes_the_reliable_channel() -> None:
    """65536 frame bytes do not fit DFRAG's u16 total: the one size that goes reliably."""
    w = Wire(16, loss=0.1)
    w.establish()
    _hello(w)
    body = os.urandom(MAX_BODY - 2)
    w.a.send_frame(DATAGRAM, 0, 8, 1, 2, b"\x00\x03", body)
    assert w.a.fragmented_out == 0 and w.a.queued() == FRAME.size + MAX_BODY
    w.run(w.now + 30, lambda: len(w.got["b"]) == 2)
    assert w.got["b"][1] == (DATAGRAM, 0, 8, 1, 2, b"\x00\x03" + body)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(
    st.binary(max_size=200),
    st.builds(lambda fid, total, off, n, junk: DFRAG.pack(CH_DFRAG, fid, total, off, n) + junk,
              st.integers(0, 2), st.integers(0, 3000), st.integers(0, 3000), st.integers(0, 1400),
              st.binary(max_size=1400)),
), max_size=6))
def test_fuzz_authentic_plaintext_never_raises_but_link_errors(chunks: list[bytes]) -> None:
    """Sealed with the real key, so it gets past the AEAD into the chunk decoder."""
    w = Wire(17, reassembly=4, reassembly_bytes=150_000)
    w.establish()
    _hello(w)
    for c in chunks:
        with contextlib.suppress(LinkError):  # a CLOSE chunk ends the link: the one allowed error
            w.b.receive(_sealed(w, ACK.pack(CH_ACK, 0, 0) + c), w.now)
        assert w.b.reassembly_held()[0] <= 4 and w.b.reassembly_held()[1] <= 150_000
        w.now += 0.2


def test_fragmenting_switched_off_big_datagrams_take_the_reliable_channel() -> None:
    """limits.udp_link_fragment_datagrams = false: retransmitted hop by hop, never lost."""
    w = Wire(18, loss=0.1, fragment=False)
    w.establish()
    _hello(w)
    sent = [_big(i, 20_000) for i in range(20)]
    for d in sent:
        w.a.send_frame(DATAGRAM, 0, 8, 1, 2, b"\x00\x03", d)
    assert w.a.fragmented_out == 0 and w.a.queued() > 0
    w.a.send_frame(DATAGRAM, 0, 8, 1, 2, b"\x00\x03", b"small")  # fits a packet: still unreliable
    assert len(w.a._dgrams) == 1
    w.run(w.now + 30, lambda: len(w.got["b"]) >= 21 and not w.a._unacked)
    got = [f[5][2:] for f in w.got["b"][1:] if f[5][2:] != b"small"]
    assert got == sent and w.a.retransmits > 0


# ---------------------------------------------------------------------- pieced records (CAP_PIECES)


def _records(packets: list[bytes]) -> list[list[bytes]]:
    """KIND_PIECE packets grouped by their record (epoch, counter), in order."""
    runs: dict[bytes, list[bytes]] = {}
    for p in packets:
        assert p[0] == KIND_PIECE
        runs.setdefault(p[DATA.size + 4 : DATA.size + 13], []).append(p)
    return list(runs.values())


def _read(session: UdpSession, packets: list[bytes], now: float) -> tuple[int, int]:
    """One GRO read of these packets (equal sizes but the last)."""
    read = memoryview(b"".join(packets))
    return session.receive_batch(read, len(read), len(packets[0]), now)


def _pieced(w: Wire, frame: bytes) -> list[bytes]:
    """The KIND_PIECE packets of one record from a to b whose plaintext is a DGRAM chunk of
    `frame` (what a's flush makes of a big datagram), cut by a's own code."""
    out: list[bytes] = []
    w.a._seal_pieces(struct.pack("!BH", CH_DGRAM, len(frame)) + frame, out)
    return out


@pytest.mark.parametrize("size", [30_000, 1500, 3000, 0xFFFF - FRAME.size - 2])
def test_both_ends_offering_pieces_send_big_datagrams_as_records_in_one_gso_run(size: int) -> None:
    """Each big datagram is one record cut evenly into as few pieces as the packet size allows,
    the last padded: records of one size make one run of equal-size packets (GSO sends of up to
    GSO_MAX_BYTES, GRO reads across records), taken whole by the receiver whatever the reads."""
    w = Wire(31)
    w.establish()
    _hello(w)
    assert w.a.pieces and w.b.pieces
    data = [_big(i, size) for i in range(10)]
    for d in data:
        w.a.send_frame(DATAGRAM, 0, 8, 1, 2, b"\x00\x03", d)
    packets = w.a.packets_to_send(w.now)
    runs = _records(packets)
    assert len(runs) == 10 and w.a.fragmented_out == 10
    ct = 3 + FRAME.size + 2 + size + 16  # DGRAM chunk header, frame, tag
    count = -(-ct // (1472 - PIECE_SIZE))
    piece = -(-ct // count)
    assert {len(p) for p in packets} == {PIECE_SIZE + piece}  # one size: one run
    for run in runs:
        assert len(run) == count and [PIECE.unpack_from(p)[5] for p in run] == list(range(0, ct, piece))
        assert run[-1].endswith(bytes(count * piece - ct))  # the padding
    # GRO reads of up to 64 KB, across records: every packet authentic once its record opened
    # (a read counts the pieces of the records it completed, those of earlier reads included)
    per_read = 65000 // (PIECE_SIZE + piece)
    authentic = 0
    for i in range(0, len(packets), per_read):
        read = packets[i : i + per_read]
        good, used = _read(w.b, read, w.now)
        assert used == sum(map(len, read))
        authentic += good
    assert authentic == len(packets)
    assert [f[5][2:] for f in w.got["b"][1:]] == data and w.b.reassembled == 10
    assert w.b.reassembly_held() == (0, 0) and w.b.packets_in >= len(packets)
    assert w.b.forged == w.b.replayed == w.b.frag_malformed == w.b.unexpected == 0


@pytest.mark.parametrize("old", ["a", "b"])
def test_a_node_from_before_pieces_gets_dfrag_chunks_either_way(old: str) -> None:
    """The capability is offered in the handshake (msg1's caps byte, msg2's answer): with a peer
    that does not offer it (a node from before), neither end sends or takes pieced records."""
    w = Wire(32, pieces=(old != "a", old != "b"))
    w.establish()
    assert not w.a.pieces and not w.b.pieces
    _hello(w)
    w.b.send_frame(PING, 0, 1, 2, 1, b"first")
    w.run(w.now + 30, lambda: len(w.got["a"]) == 1)
    for x, y in ((w.a, w.b), (w.b, w.a)):
        for i in range(3):
            x.send_frame(DATAGRAM, 0, 8, 1, 2, b"\x00\x03", _big(i, 20_000))
        packets = x.packets_to_send(w.now)
        assert {p[0] for p in packets} == {KIND_DATA}
        for p in packets:
            y.receive(p, w.now)
    assert len(w.got["a"]) == len(w.got["b"]) == 4 and w.a.reassembled == w.b.reassembled == 3


def test_the_offer_carries_the_pieces_bit_only_when_on() -> None:
    for pieces in (True, False):
        a = UdpSession(True, "net", PSK, lambda *f: None, 1, pieces=pieces)
        b = UdpSession(False, "net", PSK, lambda *f: None, 2)
        assert bool(a._offered() & CAP_PIECES) == pieces and b._offered() & CAP_PIECES
        a.start(0.0)
        b.receive(a.packets_to_send(0.0)[0], 0.0)
        a.receive(b.packets_to_send(0.0)[0], 0.0)
        assert a.pieces == b.pieces == pieces


@pytest.mark.parametrize("seed", range(4))
def test_pieces_in_any_order_and_duplicated_make_each_datagram_once(seed: int) -> None:
    w = Wire(33 + seed)
    w.establish()
    _hello(w)
    rng = random.Random(seed)
    frames = [_frame(_big(i, rng.choice((3000, 9000, 32_000, 0xFFFF - FRAME.size)))) for i in range(5)]
    packets = [p for f in frames for p in _pieced(w, f)]
    dups = rng.sample(packets, len(packets) // 4)
    packets += dups
    rng.shuffle(packets)
    for p in packets:
        w.b.receive(p, w.now)
    assert sorted(f[5] for f in w.got["b"][1:]) == sorted(f[FRAME.size :] for f in frames)
    assert w.b.reassembly_held() == (0, 0) and w.b.reassembled == 5
    assert w.b.forged == w.b.frag_malformed == 0
    # a copy before its record opened is a duplicate piece; after, a piece of a record seen
    assert w.b.duplicates + w.b.replayed == len(dups) > 0


def test_a_forged_piece_loses_its_record_only() -> None:
    """No piece is authenticated on its own: a changed byte anywhere in one (its ciphertext, its
    offset) fails the whole record's tag, counted as forged once per piece, nothing delivered;
    the records before and after it are untouched."""
    w = Wire(37)
    w.establish()
    _hello(w)
    b = w.b
    frames = [_frame(_big(i, 9000)) for i in range(4)]
    runs = [_pieced(w, f) for f in frames]
    bad = bytearray(runs[1][2])
    bad[-5] ^= 0x01  # ciphertext
    runs[1][2] = bytes(bad)
    moved = bytearray(runs[2][1])
    struct.pack_into("!I", moved, PIECE_SIZE - 4, PIECE.unpack_from(moved)[5] + 1)  # offset + 1
    runs[2][1] = bytes(moved)
    for run in runs:
        for p in run:
            b.receive(p, w.now)
    assert [f[5] for f in w.got["b"][1:]] == [frames[0][FRAME.size :], frames[3][FRAME.size :]]
    # the moved piece left a one-byte gap, so its record never closed: it waits, then expires
    assert b.forged == len(runs[1]) and b.reassembly_held()[0] == 1
    w.now += 1.0
    for p in _pieced(w, frames[0]):
        b.receive(p, w.now)
    assert b.frag_timeout == 1 and b.reassembly_held() == (0, 0) and len(w.got["b"]) == 4


def test_bad_pieces_are_refused_and_the_table_stays_bounded() -> None:
    w = Wire(38, reassembly=4, reassembly_bytes=60_000, reassembly_timeout=0.5)
    w.establish()
    _hello(w)
    b = w.b
    good = _frame(os.urandom(9000))

    def feed(*packets: bytes) -> None:
        for p in packets:
            assert b.receive(p, w.now) is False  # nothing authentic until a record opens

    run = _pieced(w, good)
    kind, rid, length, epoch, counter, off = PIECE.unpack_from(run[0])
    body = run[0][PIECE_SIZE:]

    def piece(length: int = length, counter: int = counter, off: int = off, data: bytes = body) -> bytes:
        return PIECE.pack(kind, rid, length, epoch, counter, off) + data

    feed(piece(off=length - 9))  # starts at the record's end (a last piece's padding may run past it)
    feed(piece(length=0xFFFF + 3 + 16 + 9 + 1))  # bigger than any DGRAM chunk of a frame
    feed(piece(length=9 + 16))  # no room for a plaintext
    feed(piece(length=9 + 61_000))  # bigger than the table's bytes
    assert b.frag_malformed == 4 and b.reassembly_held() == (0, 0)
    feed(run[0], piece(length=length + 1450))  # not the header the record was made with
    assert b.frag_malformed == 5 and b.reassembly_held()[0] == 1
    for p in run[1:]:
        b.receive(p, w.now)
    assert w.got["b"][-1][5] == good[FRAME.size :] and b.reassembly_held() == (0, 0)
    feed(*run)  # the same record again: refused piece by piece, nothing held
    assert b.replayed == len(run) and b.reassembly_held() == (0, 0) and len(w.got["b"]) == 2
    # too many at once: the oldest are evicted, the table stays at its bounds (entries, bytes)
    firsts = [_pieced(w, good)[0] for _ in range(10)]
    feed(*firsts)
    assert b.reassembly_held()[0] == 4 and b.frag_evicted == 6
    big = _frame(os.urandom(25_000))
    feed(*(_pieced(w, big)[0] for _ in range(3)))
    assert b.reassembly_held()[1] <= 60_000 and b.frag_evicted >= 6 + 3
    # incomplete ones expire; a good one still goes through afterwards, its pieces in any order
    w.now += 1.0
    held = b.reassembly_held()[0]
    run = _pieced(w, good)
    feed(*run[:0:-1])
    assert b.frag_timeout == held and b.reassembly_held()[0] == 1
    assert b.receive(run[0], w.now) is True
    assert w.got["b"][-1][5] == good[FRAME.size :] and b.reassembly_held() == (0, 0)
    assert b.forged == b.malformed == 0 and b.frag_malformed == 5


def test_pieces_before_the_hello_or_without_the_capability_are_dropped() -> None:
    w = Wire(39)
    w.establish()
    for p in _pieced(w, _frame(os.urandom(5000))):  # before the first reliable frame
        w.b.receive(p, w.now)
    assert w.got["b"] == [] and w.b.unexpected == 4 and w.b.reassembly_held() == (0, 0)
    # a peer that did not offer the capability has its pieces refused (it never sends any) ...
    w = Wire(40, pieces=OLD)
    w.establish()
    _hello(w)
    for p in _pieced(w, _frame(os.urandom(5000))):
        w.b.receive(p, w.now)
    assert len(w.got["b"]) == 1 and w.b.unexpected == 4 and w.b.reassembly_held() == (0, 0)
    # ... and one that did has its DFRAG chunks refused (it never sends any either)
    w = Wire(41)
    w.establish()
    _hello(w)
    good = _frame(os.urandom(3000))
    for off in (0, 1500):
        assert w.b.receive(_sealed(w, _frag(1, len(good), off, good[off : off + 1500])), w.now)
    assert len(w.got["b"]) == 1 and w.b.unexpected == 2 and w.b.reassembly_held() == (0, 0)


def test_pieced_records_open_across_rekeys_and_their_replay_is_refused() -> None:
    """Records that complete out of order around a rekey (one of the previous epoch after the
    first of the next) open with the right key, each once; the same reads again deliver nothing."""
    w = Wire(42)
    w.establish()
    _hello(w)
    assert w.a.send is not None and w.b.recv is not None
    w.a.send.rekey_after = 2
    frames = [_frame(_big(i, 20_000)) for i in range(9)]
    runs = [_pieced(w, f) for f in frames]
    runs.insert(4, runs.pop(3))  # the last of epoch 1 behind the first of epoch 2
    for run in runs:
        assert _read(w.b, run, w.now) == (len(run), sum(map(len, run)))
    assert w.b.recv.epoch == w.a.send.epoch >= 4
    order = [*frames[:3], frames[4], frames[3], *frames[5:]]
    assert [f[5] for f in w.got["b"][1:]] == [f[FRAME.size :] for f in order]
    for run in runs:
        assert _read(w.b, run, w.now) == (0, sum(map(len, run)))
    assert w.b.replayed + w.b.forged == sum(map(len, runs)) and len(w.got["b"]) == 10


def test_an_owed_ack_leaves_in_a_data_packet_when_the_flush_has_only_pieces() -> None:
    w = Wire(43)
    w.establish()
    _hello(w)
    w.b.packets_to_send(w.now)  # (b's ACK of the HELLO stand-in)
    w.a.send_frame(PING, 0, 1, 1, 2, b"acknowledge me")
    for p in w.a.packets_to_send(w.now):
        w.b.receive(p, w.now)
    w.b.send_frame(DATAGRAM, 0, 8, 2, 1, b"\x00\x03", os.urandom(20_000))
    packets = w.b.packets_to_send(w.now)
    assert [p[0] for p in packets].count(KIND_DATA) == 1 and packets[0][0] == KIND_PIECE
    for p in packets:
        w.a.receive(p, w.now)
    assert not w.a._unacked and w.a.snd_una == w.a.snd_nxt


def test_newest_and_liveness_of_pieces() -> None:
    """A piece is authentic only as part of its opened record: receive() says True (liveness,
    roaming) for the piece that opened it, and newest() then for that piece if the record is the
    latest seen."""
    w = Wire(44)
    w.establish()
    _hello(w)
    first, second = (_pieced(w, _frame(_big(i, 5000))) for i in range(2))
    assert [w.b.receive(p, w.now) for p in second] == [False] * (len(second) - 1) + [True]
    assert w.b.newest(second[-1])
    assert [w.b.receive(p, w.now) for p in first[::-1]] == [False] * (len(first) - 1) + [True]
    assert not w.b.newest(first[0])  # authentic, but older: a straggler
    assert not w.b.newest(first[0][:PIECE_SIZE])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 70_000), st.integers(0, 70_000),
                          st.integers(0, 1450)), max_size=40))
def test_fuzz_piece_decoder_is_bounded_and_delivers_nothing_forged(
    pieces: list[tuple[int, int, int, int]]
) -> None:
    w = Wire(45, reassembly=3, reassembly_bytes=100_000)
    w.establish()
    _hello(w)
    for counter, length, off, n in pieces:
        packet = PIECE.pack(KIND_PIECE, w.b.local_id, length, 0, 1000 + counter, off) + bytes(n)
        with contextlib.suppress(LinkError):
            assert w.b.receive(packet, w.now) is False
        entries, held = w.b.reassembly_held()
        assert entries <= 3 and held <= 100_000
        w.now += 0.01
    assert len(w.got["b"]) == 1  # (a piece of no bytes is a malformed packet)


@pytest.mark.parametrize("change", ["swapped", "duplicated", "foreign", "offset", "head"])
def test_a_read_whose_pieces_do_not_follow_on_is_taken_piece_by_piece(change: str) -> None:
    """receive_batch takes a run of full-size pieces of the record being filled in one struct
    call only if every one's head is that record's and the offsets follow on; a read with two
    pieces swapped, one repeated, one of another record of the same size, or a head or offset
    changed, is taken piece by piece: each correct piece still lands where it belongs."""
    w = Wire(46)
    w.establish()
    _hello(w)
    b = w.b
    frames = [_frame(_big(i, 30_000)) for i in range(2)]
    run, other = (_pieced(w, f) for f in frames)
    read = run[:-1]  # the full-size pieces (a GRO read), the short last one alone after
    if change == "swapped":
        read[5], read[6] = read[6], read[5]
    elif change == "duplicated":
        read.insert(7, read[6])
    elif change == "foreign":
        read[8] = other[8]
    else:
        bad = bytearray(read[9])
        if change == "offset":
            two_on = PIECE.unpack_from(bad)[5] + 2 * (len(bad) - PIECE_SIZE)  # piece 11's offset
            struct.pack_into("!I", bad, PIECE_SIZE - 4, two_on)
        else:
            bad[1] ^= 0x80  # another session's id: the read ends there for this session
        read[9] = bytes(bad)
    view = memoryview(b"".join(read))
    size = len(read[0])
    good, used = b.receive_batch(view, len(view), size, w.now)
    assert good == 0 and used == (9 * size if change == "head" else len(view))
    for p in read[used // size :] if change == "head" else []:
        b.receive(p, w.now)  # (the listener would hand the rest on one by one)
    rest = {"foreign": run[8:9] + run[-1:], "offset": run[9:], "head": run[9:]}.get(change, run[-1:])
    for p in rest:
        b.receive(p, w.now)
    assert b.reassembly_held()[0] == (1 if change == "foreign" else 0)  # other's piece 8 waits
    if change == "offset":
        # the moved piece sat where piece 11 goes, so the real one was a duplicate: the record
        # fails its tag, as with any piece forged by the path
        assert w.got["b"][1:] == [] and b.forged == len(run) and b.duplicates > 0
        return
    assert [f[5] for f in w.got["b"][1:]] == [frames[0][FRAME.size :]]
    assert b.forged == 0
