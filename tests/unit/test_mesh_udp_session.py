"""The udp:// link session (sans-I/O) over a simulated channel: seeded loss, reordering and
duplication on a virtual clock. Handshake under loss, reliable frames exactly once and in
order, datagrams never twice, the window bound, the retransmission budget, bad packets
counted and dropped, and a hypothesis fuzz of the packet decoder."""

from __future__ import annotations

import contextlib
import heapq
import os
import random
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshgate.mesh.frames import DATAGRAM, MAX_BODY, PING, STREAM_DATA, LinkError
from meshgate.mesh.udp_session import (
    INIT_MIN,
    KIND_DATA,
    KIND_INIT,
    MIN_RTO,
    UdpSession,
    is_init,
    payload_size,
    receiver_id,
)

PSK = bytes(range(32))
Frame = tuple[int, int, int, int, int, bytes]


class Wire:
    """Two sessions joined by a lossy, reordering, duplicating channel; time is virtual."""

    def __init__(
        self, seed: int, loss: float = 0.0, dup: float = 0.0, jitter: float = 0.0, delay: float = 0.005,
        window: int = 256 << 10, payload: int = 1472, max_retransmits: int = 8,
    ) -> None:
        self.rng = random.Random(seed)
        self.loss, self.dup, self.jitter, self.delay = loss, dup, jitter, delay
        self.now = 0.0
        self.got: dict[str, list[Frame]] = {"a": [], "b": []}
        self.a = UdpSession(True, "net", PSK, self._frame("b"), 0x1111, payload=payload, window=window,
                            max_retransmits=max_retransmits)
        self.b = UdpSession(False, "net", PSK, self._frame("a"), 0x2222, payload=payload, window=window,
                            max_retransmits=max_retransmits)
        self._q: list[tuple[float, int, str, bytes]] = []
        self._n = 0
        self.max_inflight = 0
        self.cut = False  # drop everything (a vanished peer)
        self.sent_packets = 0
        self._spacing = 0.0

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


def test_big_datagram_travels_on_the_reliable_channel() -> None:
    w = Wire(3, loss=0.2)
    w.establish()
    w.a.send_frame(PING, 0, 1, 1, 2, b"first")
    big = os.urandom(9000)
    w.a.send_frame(DATAGRAM, 0, 8, 1, 2, b"\x00\x03", big)
    w.run(w.now + 30, lambda: len(w.got["b"]) == 2)
    assert w.got["b"][1] == (DATAGRAM, 0, 8, 1, 2, b"\x00\x03" + big)


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
@given(st.binary(max_size=1600), st.sampled_from([KIND_INIT, 2, 3, KIND_DATA, 0, 255]))
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
