"""AEAD negotiation on byte-pipe links (tcp://, quic://, ring://: the LinkCodec, docs/PROTOCOL.md
section 2.6), sans-I/O: every pair of capabilities and of `limits.aes_instructions` settings,
peers from before the offer on either side (their empty Noise payloads, as that codec sends
them), downgrade attempts by someone on the path who holds the network secret, and REKEY under
both suites."""

from __future__ import annotations

import itertools

import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305

from meshgate.mesh.frames import (
    DATAGRAM,
    NOISE_PATTERN,
    PING,
    PREFACE,
    LinkCodec,
    LinkError,
    RecvCipher,
    SendCipher,
    iter_frames,
    prologue,
)
from meshgate.mesh.noise import (
    AES_256_GCM,
    CAP_AES,
    CHACHA20_POLY1305,
    HandshakeState,
    Suite,
    SymmetricState,
    local_caps,
    rekey_key,
)

PSK = bytes(range(32))  # the network secret's PSK: the attacker below holds it too
NET = "net"
Got = list[tuple[int, bytes]]


def codec(initiator: bool, caps: int, got: Got, **kw: int) -> LinkCodec:
    return LinkCodec(initiator, NET, PSK, lambda t, f, h, s, d, body: got.append((t, bytes(body))),
                     caps=caps, **kw)


def pump(a: LinkCodec, b: LinkCodec) -> None:
    for _ in range(6):
        for x, y in ((a, b), (b, a)):
            for chunk in x.data_to_send():
                y.receive(chunk)


def pair(a_caps: int, b_caps: int, **kw: int) -> tuple[LinkCodec, LinkCodec, Got, Got]:
    ga: Got = []
    gb: Got = []
    a, b = codec(True, a_caps, ga, **kw), codec(False, b_caps, gb, **kw)
    a.start()
    pump(a, b)
    return a, b, ga, gb


def assert_suite(c: LinkCodec, want: Suite) -> None:
    assert c.suite is want
    assert c.send is not None and c.recv is not None
    assert c.send.suite is want and c.recv.suite is want
    assert isinstance(c.send._aead, AESGCM if want is AES_256_GCM else ChaCha20Poly1305)


def exchange(a: LinkCodec, b: LinkCodec, ga: Got, gb: Got) -> None:
    """A frame each way: the records seal and open under the negotiated suite."""
    a.send_frame(PING, 0, 1, 0, 0, b"from-a")
    b.send_frame(PING, 0, 1, 0, 0, b"from-b")
    pump(a, b)
    assert (PING, b"from-a") in gb and (PING, b"from-b") in ga


@pytest.mark.parametrize(("a_caps", "b_caps"), list(itertools.product((0, CAP_AES), repeat=2)))
def test_every_capability_combination(a_caps: int, b_caps: int) -> None:
    a, b, ga, gb = pair(a_caps, b_caps)
    assert a.established and b.established
    want = AES_256_GCM if a_caps and b_caps else CHACHA20_POLY1305
    assert_suite(a, want)
    assert_suite(b, want)
    exchange(a, b, ga, gb)


def test_records_of_the_negotiated_suite_open_only_under_it() -> None:
    """An AES-256-GCM link's record does not open as ChaCha20-Poly1305 under the same key: the
    suite really changed the cipher on the wire (not just a label)."""
    a, b, _, _ = pair(CAP_AES, CAP_AES)
    assert a.send is not None and b.recv is not None
    a.send_frame(PING, 0, 1, 0, 0, b"x")
    header, ct = a.data_to_send()
    chacha = RecvCipher(b.recv.key, CHACHA20_POLY1305)
    assert chacha.open(header, 0, 0, memoryview(ct)) is None
    assert b.recv.open(header, 0, 0, memoryview(ct)) is not None


@pytest.mark.parametrize(("a_set", "b_set"), list(itertools.product(("yes", "no", "auto"), repeat=2)))
def test_every_aes_instructions_setting(a_set: str, b_set: str) -> None:
    """limits.aes_instructions on each end: "no" on either forces ChaCha20-Poly1305, "yes" on
    both gives AES-256-GCM, "auto" claims what /proc/cpuinfo says of this CPU."""
    a, b, ga, gb = pair(local_caps(a_set), local_caps(b_set))
    here = local_caps("auto") == CAP_AES
    claims = {"yes": True, "no": False, "auto": here}
    want = AES_256_GCM if claims[a_set] and claims[b_set] else CHACHA20_POLY1305
    assert_suite(a, want)
    assert_suite(b, want)
    exchange(a, b, ga, gb)


# ------------------------------------------------------------------ peers from before the offer
# The codec before the offer sent every Noise payload empty and ignored the ones it read;
# its records were ChaCha20-Poly1305 (SendCipher/RecvCipher's default). These drive a Noise
# handshake exactly so, framed as on the wire (preface, u16 length).


def frame_hs(msg: bytes, preface: bool) -> bytes:
    return (PREFACE if preface else b"") + len(msg).to_bytes(2, "big") + msg


def unframe_hs(data: bytes, preface: bool) -> bytes:
    if preface:
        assert data.startswith(PREFACE)
        data = data[len(PREFACE):]
    n = int.from_bytes(data[:2], "big")
    assert len(data) == 2 + n
    return data[2:]


def old_keys(hs: HandshakeState, initiator: bool) -> tuple[SendCipher, RecvCipher]:
    i2r, r2i = hs.split()
    assert i2r.k is not None and r2i.k is not None
    send, recv = (i2r.k, r2i.k) if initiator else (r2i.k, i2r.k)
    return SendCipher(send), RecvCipher(recv)


def old_records_round_trip(new: LinkCodec, got: Got, send: SendCipher, recv: RecvCipher) -> None:
    header, ct = send.seal(b"".join((bytes((PING, 0, 1, 0, 0, 3)), bytes(8), b"old")))
    new.receive(header + ct)
    assert got == [(PING, b"old")]
    new.send_frame(PING, 0, 1, 0, 0, b"new")
    hdr, body = new.data_to_send()
    plain = recv.open(hdr, 0, 0, memoryview(body))
    assert plain is not None
    seen: list[bytes] = []
    iter_frames(plain, lambda t, f, h, s, d, b: seen.append(bytes(b)))
    assert seen == [b"new"]


def test_old_initiator_and_a_new_responder_with_aes_use_chacha() -> None:
    got: Got = []
    b = codec(False, CAP_AES, got)
    old = HandshakeState(NOISE_PATTERN, True, prologue(NET), s=bytes(range(1, 33)), psks=(PSK,))
    b.receive(frame_hs(old.write_message(), preface=True))
    (msg2,) = b.data_to_send()
    # an empty answer, exactly what it got before (it would ignore a payload anyway)
    assert old.read_message(unframe_hs(msg2, preface=True)) == b""
    b.receive(frame_hs(old.write_message(), preface=False))
    assert b.established
    assert_suite(b, CHACHA20_POLY1305)
    old_records_round_trip(b, got, *old_keys(old, True))


def test_new_initiator_with_aes_and_an_old_responder_use_chacha() -> None:
    got: Got = []
    a = codec(True, CAP_AES, got)
    a.start()
    (msg1,) = a.data_to_send()
    old = HandshakeState(NOISE_PATTERN, False, prologue(NET), s=bytes(range(2, 34)), psks=(PSK,))
    assert old.read_message(unframe_hs(msg1, preface=True))[:2] == bytes((1, CAP_AES))  # ignored
    a.receive(frame_hs(old.write_message(), preface=True))
    (msg3,) = a.data_to_send()
    old.read_message(unframe_hs(msg3, preface=False))
    assert a.established
    assert_suite(a, CHACHA20_POLY1305)
    old_records_round_trip(a, got, *old_keys(old, False))


# ------------------------------------------------------------------ downgrade attempts


def rewrite_offer(msg1: bytes, new_payload: bytes, network: str = NET) -> bytes:
    """An on-path attacker's msg1 (it holds the network secret, which does not help here): the
    payload key and AD of message 1 come from public values (protocol name, prologue, the
    ephemeral key in the clear), so it can read the offer and re-encrypt another one, which the
    responder accepts."""
    body = unframe_hs(msg1, preface=True)
    e_pub, ct = body[:32], body[32:]
    ss = SymmetricState(f"Noise_{NOISE_PATTERN}_25519_ChaChaPoly_SHA256".encode())
    ss.mix_hash(prologue(network))
    ss.mix_hash(e_pub)
    ss.mix_key(e_pub)  # psk mode: e also keys the payload
    h = ss.h
    assert ss.cs.decrypt_with_ad(h, ct) == bytes((1, CAP_AES))  # the attacker reads the offer
    ss.cs.n = 0
    return frame_hs(e_pub + ss.cs.encrypt_with_ad(h, new_payload), preface=True)


@pytest.mark.parametrize("forged", [b"", bytes((1, 0))], ids=["offer stripped", "aes bit cleared"])
def test_downgraded_offer_in_msg1_fails_the_handshake(forged: bytes) -> None:
    """Both ends have AES; the attacker rewrites msg1 so the responder sees an old initiator or
    one without AES, and answers ChaCha20-Poly1305. The responder cannot tell, but its msg2 is
    encrypted with the transcript hash as AD, which now differs from the initiator's: the
    initiator refuses msg2 and no link (of any suite) comes up."""
    ga: Got = []
    gb: Got = []
    a, b = codec(True, CAP_AES, ga), codec(False, CAP_AES, gb)
    a.start()
    (msg1,) = a.data_to_send()
    b.receive(rewrite_offer(msg1, forged))
    assert b.suite is CHACHA20_POLY1305  # what the forged offer would have bought
    (msg2,) = b.data_to_send()
    with pytest.raises(LinkError) as e:
        a.receive(msg2)
    assert e.value.reason == "handshake"
    assert not a.established and not b.established


def new_msg2() -> tuple[LinkCodec, bytes]:
    a, b = codec(True, CAP_AES, []), codec(False, CAP_AES, [])
    a.start()
    (msg1,) = a.data_to_send()
    b.receive(msg1)
    (msg2,) = b.data_to_send()
    return a, msg2


def reframe(msg2: bytes, body: bytes) -> bytes:
    return frame_hs(body, preface=True) if msg2 else b""


@pytest.mark.parametrize("offset", [-19, -18, -17, -1])
def test_flipped_answer_in_msg2_fails_the_handshake(offset: int) -> None:
    """msg2's payload (marker, chosen suite, the responder's bits) is sealed under keys from
    both ephemerals, which the network secret does not give: flipping any of its bytes or its
    tag fails the initiator's check."""
    a, msg2 = new_msg2()
    body = bytearray(unframe_hs(msg2, preface=True))
    body[offset] ^= 0x01
    with pytest.raises(LinkError) as e:
        a.receive(reframe(msg2, bytes(body)))
    assert e.value.reason == "handshake"
    assert not a.established


@pytest.mark.parametrize("cut", ["answer bytes", "tail"])
def test_stripped_answer_in_msg2_fails_the_handshake(cut: str) -> None:
    """Making a new responder look old (msg2 without its 3-byte answer, length fixed up) cuts its
    payload's ciphertext: the tag no longer verifies."""
    a, msg2 = new_msg2()
    body = unframe_hs(msg2, preface=True)
    stripped = body[:-19] + body[-16:] if cut == "answer bytes" else body[:-3]
    with pytest.raises(LinkError) as e:
        a.receive(reframe(msg2, stripped))
    assert e.value.reason == "handshake"
    assert not a.established


def test_responder_choosing_against_the_rule_is_refused() -> None:
    """A responder that completes the handshake (it holds the network secret) but answers a suite
    the rule does not give for both ends' bits is refused with reason bad_aead, before msg3."""
    a = codec(True, CAP_AES, [])
    a.start()
    (msg1,) = a.data_to_send()
    rogue = HandshakeState(NOISE_PATTERN, False, prologue(NET), s=bytes(range(2, 34)), psks=(PSK,))
    rogue.read_message(unframe_hs(msg1, preface=True))
    msg2 = rogue.write_message(bytes((1, CHACHA20_POLY1305.code, CAP_AES)))
    with pytest.raises(LinkError) as e:
        a.receive(frame_hs(msg2, preface=True))
    assert e.value.reason == "bad_aead"
    assert a.data_to_send() == [] and not a.established  # no msg3 went out


@pytest.mark.parametrize("answer", [bytes((1, 2)), bytes((2, 1, 0)), bytes((1, 1, 0, 0))],
                         ids=["short", "unknown marker", "long"])
def test_malformed_answer_is_refused(answer: bytes) -> None:
    a = codec(True, 0, [])
    a.start()
    (msg1,) = a.data_to_send()
    rogue = HandshakeState(NOISE_PATTERN, False, prologue(NET), s=bytes(range(2, 34)), psks=(PSK,))
    rogue.read_message(unframe_hs(msg1, preface=True))
    with pytest.raises(LinkError) as e:
        a.receive(frame_hs(rogue.write_message(answer), preface=True))
    assert e.value.reason == "bad_aead"


# ------------------------------------------------------------------ REKEY


@pytest.mark.parametrize("caps", [0, CAP_AES], ids=["chacha20-poly1305", "aes-256-gcm"])
def test_rekey_under_each_suite(caps: int) -> None:
    """SendCipher.next_epoch / RecvCipher follow REKEY with the negotiated suite: 23 records at
    5 per key cross 4 epochs in both directions, every frame arrives in order."""
    a, b, ga, gb = pair(caps, caps, rekey_after=5)
    want = AES_256_GCM if caps else CHACHA20_POLY1305
    ga.clear()
    gb.clear()
    assert a.send is not None and b.send is not None
    keys = (a.send.key, b.send.key)
    for i in range(23):
        a.send_frame(DATAGRAM, 0, 8, 1, 2, bytes([i]))
        b.send_frame(DATAGRAM, 0, 8, 2, 1, bytes([i]))
        pump(a, b)
    assert [g[1] for g in gb] == [bytes([i]) for i in range(23)]
    assert [g[1] for g in ga] == [bytes([i]) for i in range(23)]
    assert a.send.epoch == b.send.epoch == 4 and (a.send.key, b.send.key) != keys
    assert b.recv is not None and b.recv.epoch == 4 and b.recv.suite is want
    assert a.send.suite is want and isinstance(a.send._aead, AESGCM if caps else ChaCha20Poly1305)
    # the key chain is the suite's REKEY (AES-256-GCM's own for an AES link), four times
    k = keys[0]
    for _ in range(4):
        k = rekey_key(k, want)
    assert a.send.key == k
