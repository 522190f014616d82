"""Link codec: handshake over bytes, sealed records, replay/forgery drops, rekey, fuzzed decoders."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshgate.mesh import frames
from meshgate.mesh.frames import (
    DATAGRAM,
    FRAME,
    HELLO,
    PREFACE,
    Hello,
    LinkCodec,
    LinkError,
    decode_hello,
    derive_psk,
    encode_hello,
    iter_frames,
)

Got = list[tuple[int, int, int, int, int, bytes]]


def _codec(
    initiator: bool, got: Got, network: str = "net", secret: str = "s3cret-pass", **kw: int
) -> LinkCodec:
    def on_frame(t: int, f: int, h: int, s: int, d: int, body: memoryview) -> None:
        got.append((t, f, h, s, d, bytes(body)))

    hello = Hello(1 if initiator else 2, 7, "a" if initiator else "b")
    # the mesh signs its HELLO for each handshake; the codec only sends what it is given
    return LinkCodec(initiator, network, derive_psk(network, secret), on_frame,
                     hello=lambda hs_hash, _initiator: encode_hello(hello), **kw)


def _pump(a: LinkCodec, b: LinkCodec) -> None:
    for _ in range(6):
        for x, y in ((a, b), (b, a)):
            for chunk in x.data_to_send():
                y.receive(chunk)


def _pair(**kw: int) -> tuple[LinkCodec, LinkCodec, Got, Got]:
    ga: Got = []
    gb: Got = []
    a, b = _codec(True, ga, **kw), _codec(False, gb, **kw)
    a.start()
    _pump(a, b)
    assert a.established and b.established
    return a, b, ga, gb


def test_handshake_then_hello_first() -> None:
    _, _, ga, gb = _pair()
    assert ga[0][0] == HELLO and decode_hello(ga[0][5]) == Hello(2, 7, "b")
    assert gb[0][0] == HELLO and decode_hello(gb[0][5]) == Hello(1, 7, "a")


def test_frames_round_trip_batched_into_one_record() -> None:
    a, b, _, gb = _pair()
    gb.clear()
    before = b.records_in
    for i in range(50):
        a.send_frame(DATAGRAM, 2, 8, 1, 99, b"h", bytes([i]) * i)
    for chunk in a.data_to_send():
        b.receive(chunk)
    assert [(g[0], g[1], g[2], g[3], g[4]) for g in gb] == [(DATAGRAM, 2, 8, 1, 99)] * 50
    assert [g[5] for g in gb] == [b"h" + bytes([i]) * i for i in range(50)]
    assert b.records_in - before == 1  # one AEAD for the whole batch


def test_byte_at_a_time_delivery() -> None:
    a, b, _, gb = _pair()
    gb.clear()
    a.send_frame(DATAGRAM, 0, 8, 1, 2, b"x" * 1000)
    for chunk in a.data_to_send():
        for i in range(len(chunk)):
            b.receive(chunk[i : i + 1])
    assert gb == [(DATAGRAM, 0, 8, 1, 2, b"x" * 1000)]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=3000), min_size=1, max_size=8), st.data())
def test_records_split_anywhere_arrive_whole_and_in_order(sizes: list[int], data: st.DataObject) -> None:
    """Chunks holding several records and a partial one: the complete records open straight
    from the chunk, the tail is held back and finished by the next chunks."""
    a, b, _, gb = _pair()
    gb.clear()
    wire = b""
    for i, n in enumerate(sizes):
        a.send_frame(DATAGRAM, 0, 8, 1, 2, bytes([i]) * n)
        wire += b"".join(a.data_to_send())  # one record per frame
    cuts = sorted(data.draw(st.lists(st.integers(min_value=1, max_value=len(wire) - 1), max_size=6)))
    for lo, hi in zip([0, *cuts], [*cuts, len(wire)], strict=True):
        b.receive(wire[lo:hi])
    assert [g[5] for g in gb] == [bytes([i]) * n for i, n in enumerate(sizes)]


def test_replayed_record_is_dropped_and_counted() -> None:
    a, b, _, gb = _pair()
    gb.clear()
    a.send_frame(DATAGRAM, 0, 8, 1, 2, b"once")
    record = b"".join(a.data_to_send())
    b.receive(record)
    b.receive(record)
    assert len(gb) == 1 and b.replayed == 1 and b.forged == 0


def test_forged_record_is_dropped_and_link_survives() -> None:
    a, b, _, gb = _pair()
    gb.clear()
    a.send_frame(DATAGRAM, 0, 8, 1, 2, b"genuine")
    record = bytearray(b"".join(a.data_to_send()))
    forged = bytearray(record)
    forged[-1] ^= 1
    b.receive(forged)
    assert gb == [] and b.forged == 1
    b.receive(record)  # the real one (same counter) still opens
    assert [g[5] for g in gb] == [b"genuine"]


def test_reordered_within_window_accepted_beyond_dropped() -> None:
    a, b, _, gb = _pair()
    gb.clear()
    records = []
    for i in range(70):
        a.send_frame(DATAGRAM, 0, 8, 1, 2, bytes([i]))
        records.append(b"".join(a.data_to_send()))
    b.receive(records[69])
    b.receive(records[10])  # 59 behind: inside the 64-record window
    b.receive(records[2])  # 67 behind: outside
    assert [g[5] for g in gb] == [bytes([69]), bytes([10])]
    assert b.replayed + b.forged == 1


def test_rekey_before_nonce_exhaustion() -> None:
    a, b, _, gb = _pair(rekey_after=5)
    gb.clear()
    assert a.send is not None
    old_key = a.send.key
    for i in range(23):
        a.send_frame(DATAGRAM, 0, 8, 1, 2, bytes([i]))
        for chunk in a.data_to_send():
            b.receive(chunk)
    assert [g[5] for g in gb] == [bytes([i]) for i in range(23)]
    assert a.send.epoch == 4 and a.send.key != old_key
    assert b.recv is not None and b.recv.epoch == 4


def test_wrong_secret_fails_on_responder_at_message_three() -> None:
    ga: Got = []
    gb: Got = []
    a, b = _codec(True, ga), _codec(False, gb, secret="another-secret")
    a.start()
    for chunk in a.data_to_send():
        b.receive(chunk)
    for chunk in b.data_to_send():
        a.receive(chunk)
    with pytest.raises(LinkError) as e:
        for chunk in a.data_to_send():
            b.receive(chunk)
    assert e.value.reason == "handshake"
    assert not b.established and gb == []


def test_wrong_network_fails_at_message_one_and_responder_says_nothing() -> None:
    a, b = _codec(True, []), _codec(False, [], network="other")
    a.start()
    with pytest.raises(LinkError):
        for chunk in a.data_to_send():
            b.receive(chunk)
    assert b.data_to_send() == []


def test_psk_is_argon2id_as_the_reference_implementation_computes_it() -> None:
    # argon2-cffi wraps the reference C implementation (RFC 9106); ours goes through OpenSSL
    from argon2.low_level import Type, hash_secret_raw

    for network, secret in (("testnet", "correct horse battery"), ("home", "yjFTKuTM27if2d0ET7UxcmuR3pjq")):
        want = hash_secret_raw(
            secret.encode(), b"meshgate mesh psk v2|" + network.encode(), time_cost=2,
            memory_cost=19 * 1024, parallelism=1, hash_len=32, type=Type.ID,
        )
        assert derive_psk(network, secret) == want
    # pinned: a change of cost or salt is a change of protocol (docs/PROTOCOL.md section 1)
    assert derive_psk("testnet", "correct horse battery").hex() == (
        "939f1017d6d4bf1afdaf08244f3ddcddc9ccfdd2d61e8bf85f58b4ee847d9b7d"
    )
    assert derive_psk("testnet", "correct horse battery") != derive_psk("testnet2", "correct horse battery")


def test_a_peer_on_another_protocol_version_is_told_ours() -> None:
    # An old (version 1 or 2) initiator gets our preface back before the link closes, so both sides
    # can log the two versions instead of one side waiting on a handshake that never comes.
    responder = _codec(False, [])
    with pytest.raises(LinkError) as e:
        responder.receive(PREFACE[:4] + bytes([1, 0]) + b"\x00\x20" + bytes(32))
    assert e.value.reason == "bad_version"
    assert "peer speaks protocol version 1, this node 3" in str(e.value)
    assert responder.data_to_send() == [PREFACE] and PREFACE[4] == 3
    # an initiator that meets another version sends nothing more
    initiator = _codec(True, [])
    initiator.start()
    initiator.data_to_send()
    with pytest.raises(LinkError):
        initiator.receive(PREFACE[:4] + bytes([2, 0]))
    assert initiator.data_to_send() == []


def test_bad_magic_and_version() -> None:
    with pytest.raises(LinkError) as e:
        _codec(False, []).receive(b"GET / HTTP/1.1\r\n")
    assert e.value.reason == "bad_magic"
    with pytest.raises(LinkError) as e:
        _codec(False, []).receive(PREFACE[:4] + bytes([99, 0]))
    assert e.value.reason == "bad_version"


def test_oversized_record_length_closes() -> None:
    _, b, _, _ = _pair()
    with pytest.raises(LinkError):
        b.receive(frames.RECORD.pack(frames.MAX_RECORD + 1, 0, 0))


def test_hello_codec() -> None:
    h = Hello(0xDEADBEEF, 42, "node-ä")
    assert decode_hello(encode_hello(h)) == h
    with pytest.raises(LinkError):
        decode_hello(encode_hello(h)[:-1])


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_fuzz_iter_frames(data: bytes) -> None:
    seen: list[int] = []
    bad = iter_frames(data, lambda t, f, h, s, d, body: seen.append(len(body)))
    assert bad in (0, 1)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(min_size=1, max_size=200), max_size=5))
def test_fuzz_established_receive(chunks: list[bytes]) -> None:
    _, b, _, _ = _pair()
    try:
        for c in chunks:
            b.receive(c)
    except LinkError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300))
def test_fuzz_handshake_receive(data: bytes) -> None:
    b = _codec(False, [])
    with contextlib.suppress(LinkError):
        b.receive(PREFACE + data)
    assert not b.established


_frame = st.builds(
    lambda t, f, h, src, dst, body: FRAME.pack(t, f, h, len(body), src, dst) + body,
    st.integers(0, 255), st.integers(0, 255), st.integers(0, 255),
    st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1), st.binary(max_size=40),
)
# what a record's plaintext may hold: frames, cut short or followed by bytes that are no frame
_plaintexts = st.one_of(
    _frame,
    st.lists(_frame, max_size=3).map(b"".join),
    st.tuples(_frame, st.integers(1, 20)).map(lambda p: p[0][: -p[1]]),
    st.tuples(_frame, st.binary(min_size=1, max_size=20)).map(lambda p: p[0] + p[1]),
    st.binary(max_size=40),
)


@settings(max_examples=300, deadline=None)
@given(_plaintexts)
def test_a_record_is_parsed_as_iter_frames_parses_it(plain: bytes) -> None:
    """A record holding exactly one frame is parsed inline, without iter_frames; whatever a
    record holds (one frame, several, a header cut short or lying about its length, nothing),
    the frames handed on and the malformed count are iter_frames' own."""
    a, b, _, gb = _pair()
    gb.clear()
    want: Got = []
    bad = iter_frames(plain, lambda t, f, h, s, d, body: want.append((t, f, h, s, d, bytes(body))))
    malformed, records = b.malformed, b.records_in
    a._pending += plain  # one record with exactly this plaintext
    for chunk in a.data_to_send():
        b.receive(chunk)
    assert b.records_in == records + (1 if plain else 0)
    assert gb == want and b.malformed - malformed == bad


def test_a_record_holding_one_frame_is_parsed_without_iter_frames(monkeypatch: pytest.MonkeyPatch) -> None:
    a, b, _, gb = _pair()
    calls: list[int] = []
    real = frames.iter_frames

    def counted(plain: bytes, on_frame: frames.FrameHandler) -> int:
        calls.append(len(plain))
        return real(plain, on_frame)

    monkeypatch.setattr(frames, "iter_frames", counted)
    a.send_frame(DATAGRAM, 2, 8, 1, 99, b"h", b"x" * 64)
    for chunk in a.data_to_send():
        b.receive(chunk)
    assert gb[-1] == (DATAGRAM, 2, 8, 1, 99, b"h" + b"x" * 64) and calls == []
    a.send_frame(DATAGRAM, 0, 8, 1, 99, b"one")
    a.send_frame(DATAGRAM, 0, 8, 1, 99, b"two")  # two frames in one record: the general loop
    for chunk in a.data_to_send():
        b.receive(chunk)
    assert [g[5] for g in gb[-2:]] == [b"one", b"two"] and len(calls) == 1
