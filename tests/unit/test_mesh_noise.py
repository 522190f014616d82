"""Noise handshakes against the published cacophony vectors, plus failure behaviour."""

from __future__ import annotations

import contextlib
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshgate.mesh.noise import PATTERNS, CipherState, HandshakeState, NoiseError, generate_private
from tests.helpers import VECTORS as VECTOR_DIR

VECTORS = VECTOR_DIR / "noise_25519_chachapoly_sha256.json"


def _vectors() -> list[dict[str, Any]]:
    data = json.loads(VECTORS.read_text())
    out = []
    for v in data["vectors"]:
        pattern = v["protocol_name"].split("_")[1]
        if pattern in PATTERNS:
            out.append(v)
    return out


def _h(v: dict[str, Any], key: str) -> bytes | None:
    return bytes.fromhex(v[key]) if key in v else None


def test_vectors_cover_the_mesh_pattern() -> None:
    names = {v["protocol_name"] for v in _vectors()}
    assert "Noise_XXpsk3_25519_ChaChaPoly_SHA256" in names
    assert {"Noise_NN_25519_ChaChaPoly_SHA256", "Noise_XX_25519_ChaChaPoly_SHA256"} <= names
    assert len(names) == 8


@pytest.mark.parametrize("v", _vectors(), ids=lambda v: v["protocol_name"])
def test_vector(v: dict[str, Any]) -> None:
    pattern = v["protocol_name"].split("_")[1]
    init = HandshakeState(
        pattern,
        True,
        _h(v, "init_prologue") or b"",
        s=_h(v, "init_static"),
        e=_h(v, "init_ephemeral"),
        rs=_h(v, "init_remote_static"),
        psks=tuple(bytes.fromhex(p) for p in v.get("init_psks", [])),
    )
    resp = HandshakeState(
        pattern,
        False,
        _h(v, "resp_prologue") or b"",
        s=_h(v, "resp_static"),
        e=_h(v, "resp_ephemeral"),
        psks=tuple(bytes.fromhex(p) for p in v.get("resp_psks", [])),
    )
    ciphers: dict[bool, CipherState] = {}
    for i, m in enumerate(v["messages"]):
        payload, expected = bytes.fromhex(m["payload"]), bytes.fromhex(m["ciphertext"])
        sender_is_init = i % 2 == 0
        if not init.finished:
            w, r = (init, resp) if sender_is_init else (resp, init)
            ct = w.write_message(payload)
            assert ct == expected, f"message {i}"
            assert r.read_message(ct) == payload
            if init.finished:
                assert resp.finished
                assert init.handshake_hash == resp.handshake_hash == bytes.fromhex(v["handshake_hash"])
                i2r, r2i = init.split()
                j2r, r2j = resp.split()
                ciphers = {True: i2r, False: r2j}
                readers = {True: j2r, False: r2i}
        else:
            ct = ciphers[sender_is_init].encrypt_with_ad(b"", payload)
            assert ct == expected, f"transport message {i}"
            assert readers[sender_is_init].decrypt_with_ad(b"", ct) == payload


def _pair(
    prologue_a: bytes = b"p", prologue_b: bytes = b"p", psk_a: bytes = b"k" * 32, psk_b: bytes = b"k" * 32
) -> tuple[HandshakeState, HandshakeState]:
    a = HandshakeState("XXpsk3", True, prologue_a, s=generate_private(), psks=(psk_a,))
    b = HandshakeState("XXpsk3", False, prologue_b, s=generate_private(), psks=(psk_b,))
    return a, b


def test_wrong_prologue_fails_at_message_one() -> None:
    # psk mode mixes `e` into the key, so message 1's empty payload carries a tag
    # bound to the prologue: the responder rejects before revealing anything.
    a, b = _pair(prologue_b=b"other network")
    with pytest.raises(NoiseError):
        b.read_message(a.write_message())


def test_wrong_psk_fails_at_message_three() -> None:
    a, b = _pair(psk_b=b"x" * 32)
    b.read_message(a.write_message())
    a.read_message(b.write_message())
    with pytest.raises(NoiseError):
        b.read_message(a.write_message(b"identity"))


def test_out_of_turn_raises_noise_error() -> None:
    a, b = _pair()
    with pytest.raises(NoiseError):
        a.read_message(b"x" * 48)
    with pytest.raises(NoiseError):
        b.write_message()


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
def test_fuzz_responder_first_message(data: bytes) -> None:
    _, b = _pair()
    with contextlib.suppress(NoiseError):
        b.read_message(data)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
def test_fuzz_initiator_second_message(data: bytes) -> None:
    a, _ = _pair()
    a.write_message()
    with pytest.raises(NoiseError):
        a.read_message(data)
