"""AEAD negotiation of end-to-end sessions (docs/PROTOCOL.md section 11), sans-I/O: every
pair of capabilities, responders and initiators from before it (ChaCha20-Poly1305), and a relay
that clears or sets the E2E_INIT frame's offer bit (it is outside the Noise message, so a relay
can change it): the initiator refuses the answer, no session comes up with another suite."""

from __future__ import annotations

import itertools

import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305

from meshgate.mesh.e2e import PROLOGUE, E2e, E2eError
from meshgate.mesh.frames import E2E_INIT, FLAG_AES, SEALED, STREAM_DATA
from meshgate.mesh.identity import Identity
from meshgate.mesh.noise import AES_256_GCM, CAP_AES, CHACHA20_POLY1305, HandshakeState


def _pair(a_caps: int, b_caps: int) -> tuple[Identity, E2e, Identity, E2e]:
    ia, ib = Identity.generate(), Identity.generate()
    a = E2e(ia, "net", b"", lambda src, pub, cert: None, caps=a_caps)
    b = E2e(ib, "net", b"", lambda src, pub, cert: None, caps=b_caps)
    return ia, a, ib, b


def _init(a: E2e, ib: Identity) -> bytes:
    frames, queued = a.seal(ib.node_id, ib.dh_public, STREAM_DATA, 1, b"hello", 0.0, False)
    assert queued and [t for t, _ in frames] == [E2E_INIT]
    return frames[0][1]


@pytest.mark.parametrize(("a_caps", "b_caps"), list(itertools.product((0, CAP_AES), repeat=2)))
def test_every_capability_combination(a_caps: int, b_caps: int) -> None:
    ia, a, ib, b = _pair(a_caps, b_caps)
    body = _init(a, ib)
    assert a.init_flags == (FLAG_AES if a_caps else 0)
    resp, _ = b.on_init(ia.node_id, body, 0.0, a.init_flags)  # the flags the service sends it with
    assert resp is not None
    flushed = a.on_resp(ib.node_id, resp)
    want = AES_256_GCM if a_caps and b_caps else CHACHA20_POLY1305
    sa, sb = a.sessions[ib.node_id], b.sessions[ia.node_id]
    assert sa.suite is want and sb.suite is want
    assert sa.send is not None
    assert isinstance(sa.send._aead, AESGCM if want is AES_256_GCM else ChaCha20Poly1305)
    assert [t for t, _ in flushed] == [SEALED]
    assert b.open(ia.node_id, memoryview(flushed[0][1]), False) == (STREAM_DATA, 1, b"hello")
    (_t, back), = b.seal(ia.node_id, ia.dh_public, STREAM_DATA, 0, b"back", 1.0, False)[0]
    assert a.open(ib.node_id, memoryview(back), False) == (STREAM_DATA, 0, b"back")


@pytest.mark.parametrize(("a_caps", "b_caps", "flags"), [(CAP_AES, CAP_AES, 0), (0, CAP_AES, FLAG_AES),
                                                      (0, 0, FLAG_AES)],
                         ids=["bit cleared", "bit set", "bit set, same suite"])
def test_a_relay_changing_the_offer_is_refused(a_caps: int, b_caps: int, flags: int) -> None:
    """Both ends have AES and a relay clears the bit (a downgrade to ChaCha20-Poly1305), or the
    initiator has none and a relay sets it: the responder answers what it saw, sealed; the
    initiator refuses (bad_aead): the suite is not what the rule gives for both ends' bits, and
    the echo of the offer is not what it sent (the last case: a changed offer that would not
    change the suite is refused all the same). The responder's session is of no use (nothing
    it seals opens at the initiator)."""
    ia, a, ib, b = _pair(a_caps, b_caps)
    body = _init(a, ib)
    resp, _flushed_b = b.on_init(ia.node_id, body, 0.0, flags)
    assert resp is not None
    with pytest.raises(E2eError) as e:
        a.on_resp(ib.node_id, resp)
    assert e.value.reason == "bad_aead"
    assert not a.sessions[ib.node_id].established
    with pytest.raises(E2eError) as e:
        a.on_resp(ib.node_id, resp)  # the same answer again changes nothing
    assert e.value.reason == "unknown_session"
    (_t, sealed), = b.seal(ia.node_id, ia.dh_public, STREAM_DATA, 0, b"x", 1.0, False)[0]
    with pytest.raises(E2eError):
        a.open(ib.node_id, memoryview(sealed), False)


def test_an_old_responder_gets_chacha() -> None:
    """A responder from before the negotiation answers message 2 with an empty payload (and
    ignores the flag): the initiator, AES or not, uses ChaCha20-Poly1305."""
    _ia, a, ib, _ = _pair(CAP_AES, CAP_AES)
    body = _init(a, ib)
    peer_index, msg1 = int.from_bytes(body[:4], "big"), body[4:]
    hs = HandshakeState("IK", False, PROLOGUE + b"net", s=ib.dh_private)
    hs.read_message(msg1)
    resp = peer_index.to_bytes(4, "big") + (77).to_bytes(4, "big") + hs.write_message(b"")
    a.on_resp(ib.node_id, resp)
    assert a.sessions[ib.node_id].suite is CHACHA20_POLY1305


def test_an_old_initiator_gets_chacha() -> None:
    """An initiator from before sends no flag and ignores message 2's payload: the responder,
    even with AES, uses ChaCha20-Poly1305, which is what the old initiator seals with."""
    ia, old, ib, b = _pair(0, CAP_AES)
    body = _init(old, ib)
    resp, _ = b.on_init(ia.node_id, body, 0.0, 0)
    assert resp is not None and b.sessions[ia.node_id].suite is CHACHA20_POLY1305


def test_a_flipped_answer_fails_its_tag() -> None:
    ia, a, ib, b = _pair(CAP_AES, CAP_AES)
    body = _init(a, ib)
    resp, _ = b.on_init(ia.node_id, body, 0.0, FLAG_AES)
    assert resp is not None
    bad = bytearray(resp)
    bad[-17] ^= 0x01  # the last answer byte (the echo), before the tag
    with pytest.raises(E2eError) as e:
        a.on_resp(ib.node_id, bytes(bad))
    assert e.value.reason == "handshake"
