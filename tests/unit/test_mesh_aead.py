"""AEAD negotiation (docs/PROTOCOL.md section 2.6) on udp:// sessions, sans-I/O: every
combination of the two ends' capabilities, peers from before the offer (ChaCha20-Poly1305,
as before), and downgrade attempts by someone on the path who can read and re-encrypt
message 1 (its key comes from public values) or flip bits of message 2: the handshake fails,
it never completes with a weaker suite than both ends support. Also the capability
detection from /proc/cpuinfo text and the config override."""

from __future__ import annotations

import itertools

import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305

from meshgate.config import ConfigError, from_dict
from meshgate.mesh.frames import NOISE_PATTERN, PING, RECORD, LinkError, RecvCipher, SendCipher, prologue
from meshgate.mesh.noise import (
    AES_256_GCM,
    CAP_AES,
    CHACHA20_POLY1305,
    HandshakeState,
    NoiseError,
    Suite,
    SymmetricState,
    choose_suite,
    cpu_has_aes,
    local_caps,
)
from meshgate.mesh.udp_session import (
    CAP_PIECES,
    HS,
    INIT_PADDING,
    KIND_INIT,
    KIND_RESP,
    MAGIC,
    VERSION,
    UdpSession,
)

PSK = bytes(range(32))
NET = "net"
Frames = list[tuple[int, bytes]]


def sessions(a_caps: int, b_caps: int) -> tuple[UdpSession, UdpSession, Frames, Frames]:
    got_a: Frames = []
    got_b: Frames = []
    a = UdpSession(True, NET, PSK, lambda t, f, h, s, d, body: got_a.append((t, bytes(body))), 0x1111,
                   caps=a_caps)
    b = UdpSession(False, NET, PSK, lambda t, f, h, s, d, body: got_b.append((t, bytes(body))), 0x2222,
                   caps=b_caps)
    return a, b, got_a, got_b


def pump(a: UdpSession, b: UdpSession, rounds: int = 6) -> None:
    """Deliver every packet each side has, both ways, a few times (a lossless wire)."""
    for _ in range(rounds):
        for src, dst in ((a, b), (b, a)):
            for p in src.packets_to_send(0.0):
                dst.receive(p, 0.0)


def exchange_ping(a: UdpSession, b: UdpSession, got_a: Frames, got_b: Frames) -> None:
    """A reliable frame each way: the sealed channel works with the negotiated suite."""
    a.send_frame(PING, 0, 1, 0, 0, b"from-a")
    b.send_frame(PING, 0, 1, 0, 0, b"from-b")
    pump(a, b)
    assert (PING, b"from-a") in got_b and (PING, b"from-b") in got_a


@pytest.mark.parametrize(("a_caps", "b_caps"), list(itertools.product((0, CAP_AES), repeat=2)))
def test_every_capability_combination(a_caps: int, b_caps: int) -> None:
    a, b, got_a, got_b = sessions(a_caps, b_caps)
    a.start(0.0)
    pump(a, b)
    assert a.established and b.established
    want = AES_256_GCM if a_caps and b_caps else CHACHA20_POLY1305
    assert a.suite is want and b.suite is want
    assert a.send is not None and b.send is not None
    assert a.send.suite is want and b.recv is not None and b.recv.suite is want
    # the key really seals with that cipher: a's first record opens with the suite's AEAD
    # class and nonce encoding, and not with the other one
    exchange_ping(a, b, got_a, got_b)
    assert isinstance(a.send._aead, AESGCM if want is AES_256_GCM else ChaCha20Poly1305)
    assert choose_suite(a_caps, b_caps) is want


def test_sealed_records_differ_by_suite() -> None:
    """Both suites on one key: each record opens only under its own AEAD (no silent mix-up)."""
    key = bytes(range(32))
    for suite, other in ((AES_256_GCM, CHACHA20_POLY1305), (CHACHA20_POLY1305, AES_256_GCM)):
        header, ct = SendCipher(key, suite=suite).seal(b"hello")
        assert suite.make(key).decrypt(suite.nonce(0), ct, header) == b"hello"
        with pytest.raises(Exception):  # noqa: B017  (InvalidTag)
            other.make(key).decrypt(other.nonce(0), ct, header)


def old_responder_msg2(msg1: bytes) -> bytes:
    """What a version-3 responder from before the offer answers: msg2 with an empty payload."""
    hs = HandshakeState(NOISE_PATTERN, False, prologue(NET), s=bytes(32), psks=(PSK,))
    hs.read_message(msg1[HS.size:])  # the offer is read as padding and ignored
    sender = HS.unpack_from(msg1)[3]
    return HS.pack(KIND_RESP, MAGIC, VERSION, 0x2222, sender) + hs.write_message()


def test_new_initiator_with_aes_and_an_old_responder_use_chacha() -> None:
    a, _, _, _ = sessions(CAP_AES, CAP_AES)
    a.start(0.0)
    (msg1,) = a.packets_to_send(0.0)
    a.receive(old_responder_msg2(msg1), 0.0)
    assert a.established and a.suite is CHACHA20_POLY1305 and not a.pieces


def test_old_initiator_and_a_new_responder_with_aes_use_chacha() -> None:
    """An old initiator's msg1 payload is 64 zero bytes: no offer, so ChaCha20-Poly1305 and an
    empty msg2 payload, exactly what it got before (it would ignore a payload anyway)."""
    _, b, _, _ = sessions(0, CAP_AES)
    old = HandshakeState(NOISE_PATTERN, True, prologue(NET), s=bytes(range(1, 33)), psks=(PSK,))
    msg1 = HS.pack(KIND_INIT, MAGIC, VERSION, 0x1111, 0) + old.write_message(bytes(INIT_PADDING))
    b.receive(msg1, 0.0)
    (msg2,) = b.packets_to_send(0.0)
    assert old.read_message(msg2[HS.size:]) == b""
    assert b.suite is CHACHA20_POLY1305 and not b.pieces


def rewrite_offer(msg1: bytes, new_payload: bytes) -> bytes:
    """An on-path attacker's msg1: message 1's payload key and AD derive from public values
    (protocol name, prologue, the ephemeral key in the clear), so anyone, with or without the
    network secret, can decrypt the offer and re-encrypt another one that the responder accepts."""
    body = msg1[HS.size:]
    e_pub, ct = body[:32], body[32:]
    ss = SymmetricState(f"Noise_{NOISE_PATTERN}_25519_ChaChaPoly_SHA256".encode())
    ss.mix_hash(prologue(NET))
    ss.mix_hash(e_pub)
    ss.mix_key(e_pub)  # psk mode: e also keys the payload
    h = ss.h
    # the attacker reads the offer (the AEAD's bit, and udp:// links' CAP_PIECES, docs/PROTOCOL.md 2.5)
    assert ss.cs.decrypt_with_ad(h, ct)[:2] == bytes((1, CAP_AES | CAP_PIECES))
    ss.cs.n = 0
    return msg1[:HS.size] + e_pub + ss.cs.encrypt_with_ad(h, new_payload)


@pytest.mark.parametrize("forged", [bytes(INIT_PADDING), bytes((1, 0)).ljust(INIT_PADDING, b"\0")],
                         ids=["offer stripped", "aes bit cleared"])
def test_downgraded_offer_in_msg1_fails_the_handshake(forged: bytes) -> None:
    """Both ends have AES; the attacker rewrites msg1 so the responder sees no offer or no AES
    and answers ChaCha20-Poly1305. The responder accepted the forged msg1 (it cannot tell), but
    its msg2 is encrypted with the transcript hash as AD, which now differs from the
    initiator's: the initiator refuses msg2, and no session (of any suite) comes up."""
    a, b, _, _ = sessions(CAP_AES, CAP_AES)
    a.start(0.0)
    (msg1,) = a.packets_to_send(0.0)
    b.receive(rewrite_offer(msg1, forged), 0.0)
    assert b.suite is CHACHA20_POLY1305  # what the forged offer would have bought
    (msg2,) = b.packets_to_send(0.0)
    with pytest.raises(LinkError) as e:
        a.receive(msg2, 0.0)
    assert e.value.reason == "handshake"
    assert not a.established and not b.established


@pytest.mark.parametrize("offset", [-19, -18, -17, -1])
def test_flipped_answer_in_msg2_fails_the_handshake(offset: int) -> None:
    """msg2's payload (marker, chosen suite, the responder's capabilities) is sealed under keys
    from both ephemerals: flipping any of its bytes, or its tag, fails the initiator's check."""
    a, b, _, _ = sessions(CAP_AES, CAP_AES)
    a.start(0.0)
    (msg1,) = a.packets_to_send(0.0)
    b.receive(msg1, 0.0)
    (msg2,) = b.packets_to_send(0.0)
    bad = bytearray(msg2)
    bad[offset] ^= 0x01
    with pytest.raises(LinkError):
        a.receive(bytes(bad), 0.0)
    assert not a.established


@pytest.mark.parametrize("cut", ["answer bytes", "tail"])
def test_stripped_answer_in_msg2_fails_the_handshake(cut: str) -> None:
    """Making a new responder look old (msg2 without its 3-byte answer) cuts its payload's
    ciphertext: the tag no longer verifies."""
    a, b, _, _ = sessions(CAP_AES, CAP_AES)
    a.start(0.0)
    (msg1,) = a.packets_to_send(0.0)
    b.receive(msg1, 0.0)
    (msg2,) = b.packets_to_send(0.0)
    stripped = msg2[:-19] + msg2[-16:] if cut == "answer bytes" else msg2[:-3]
    with pytest.raises(LinkError):
        a.receive(stripped, 0.0)
    assert not a.established


def test_responder_choosing_against_the_rule_is_refused() -> None:
    """An authenticated peer that answers a suite the rule does not give (a broken or hostile
    responder) fails the handshake with reason bad_aead."""
    a, _, _, _ = sessions(CAP_AES, CAP_AES)
    a.start(0.0)
    (msg1,) = a.packets_to_send(0.0)
    hs = HandshakeState(NOISE_PATTERN, False, prologue(NET), s=bytes(32), psks=(PSK,))
    hs.read_message(msg1[HS.size:])
    sender = HS.unpack_from(msg1)[3]
    msg2 = HS.pack(KIND_RESP, MAGIC, VERSION, 0x2222, sender) + hs.write_message(
        bytes((1, CHACHA20_POLY1305.code, CAP_AES)))
    with pytest.raises(LinkError) as e:
        a.receive(msg2, 0.0)
    assert e.value.reason == "bad_aead"


def test_noise_handshake_refuses_a_tampered_payload() -> None:
    """The property the downgrade tests rest on, at the Noise layer: a payload changed in
    message 1 makes message 2 fail for the initiator."""
    i = HandshakeState(NOISE_PATTERN, True, b"p", s=bytes(range(1, 33)), psks=(PSK,))
    r = HandshakeState(NOISE_PATTERN, False, b"p", s=bytes(range(2, 34)), psks=(PSK,))
    m1 = bytearray(i.write_message(b"\x01\x01"))
    m1[-17] ^= 1
    with pytest.raises(NoiseError):
        r.read_message(bytes(m1))


X86 = "processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: fpu vme sse2 aes avx\n"
X86_NO = "processor\t: 0\nflags\t\t: fpu vme sse2 avx\n"
ARM = "processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32\n"
ARM_NO = "processor\t: 0\nFeatures\t: fp asimd evtstrm crc32\n"


def test_cpu_detection() -> None:
    assert cpu_has_aes(X86) and cpu_has_aes(ARM)
    assert not cpu_has_aes(X86_NO) and not cpu_has_aes(ARM_NO)
    assert not cpu_has_aes("model name\t: aes lookalike\n")  # only the flags/Features lines count
    assert not cpu_has_aes("flags\t: vaes_only\n")  # a word, not a substring


def test_config_override() -> None:
    assert local_caps("yes") == CAP_AES and local_caps("no") == 0
    assert from_dict({"limits": {"aes_instructions": "no"}}).limits.aes_instructions == "no"
    assert from_dict({}).limits.aes_instructions == "auto"
    with pytest.raises(ConfigError, match=r"limits\.aes_instructions"):
        from_dict({"limits": {"aes_instructions": "sometimes"}})


@pytest.mark.parametrize("suite", [AES_256_GCM, CHACHA20_POLY1305], ids=lambda s: s.name)
def test_seal_batch_is_seal_record_by_record(suite: Suite) -> None:
    """The udp:// bulk path seals many records in one call: the same bytes as one seal() per
    record, REKEY at the same counters (every 3 records here), each opened in order and out of
    order under the suite, a replay refused."""
    key = bytes(range(32))
    plains = [bytes([i]) * (100 + i) for i in range(10)]
    one, batch = SendCipher(key, rekey_after=3, suite=suite), SendCipher(key, rekey_after=3, suite=suite)
    expected = [b"P" + b"".join(one.seal(p)) for p in plains]
    out: list[bytes] = []
    batch.seal_batch(b"P", plains[:4], out)
    batch.seal_batch(b"P", plains[4:], out)
    assert out == expected and (batch.epoch, batch.counter) == (one.epoch, one.counter) == (3, 1)
    recv = RecvCipher(key, suite)
    order = [0, 2, 1, 3, 5, 4, 6, 7, 8, 9]  # reordered within an epoch and across one
    for i in order:
        rec = memoryview(out[i])[1:]
        _, epoch, counter = RECORD.unpack_from(rec)
        assert recv.open(rec[:RECORD.size], epoch, counter, rec[RECORD.size:]) == plains[i]
    rec = memoryview(out[9])[1:]
    assert recv.open(rec[:RECORD.size], 3, 0, rec[RECORD.size:]) is None
