"""ODoH message framing, padding checks, key rotation and the error statuses."""

from __future__ import annotations

import contextlib
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshgate.dns import odoh

QUERY = bytes.fromhex("000001000001000000000000076578616d706c6503636f6d0000010001")


@pytest.fixture(scope="module")
def key() -> odoh.TargetKey:
    return odoh.TargetKey.from_seed(b"\x01" * 32)


def _seal_raw_plaintext(key: odoh.TargetKey, plain: bytes) -> bytes:
    """Seal an arbitrary plaintext (e.g. with bad padding) the way a client would."""
    suite = odoh.SUITE
    enc, ctx = suite.create_sender_context(key.pair.public_key, info=b"odoh query")
    aad = struct.pack(">BH", odoh.QUERY, len(key.key_id)) + key.key_id
    return odoh.ObliviousMessage(odoh.QUERY, key.key_id, enc + ctx.seal(plain, aad)).encode()


def test_round_trip_with_padding(key: odoh.TargetKey) -> None:
    keys = odoh.TargetKeys(key)
    wire, client_ctx = odoh.seal_query(key.config, QUERY, padding=37)
    assert QUERY not in wire
    got, server_ctx = keys.open_query(wire)
    assert got == QUERY
    answer = QUERY + b"\x00" * 12
    resp = server_ctx.seal_response(answer, padding=100)
    assert answer not in resp
    assert client_ctx.open_response(resp) == answer


def test_unknown_key_id_is_401(key: odoh.TargetKey) -> None:
    other = odoh.TargetKey.from_seed(b"\x02" * 32)
    wire, _ = odoh.seal_query(other.config, QUERY)
    with pytest.raises(odoh.UnknownKeyId) as e:
        odoh.TargetKeys(key).open_query(wire)
    assert e.value.status == 401


def test_tampered_ciphertext_is_400(key: odoh.TargetKey) -> None:
    wire = bytearray(odoh.seal_query(key.config, QUERY)[0])
    wire[-1] ^= 1
    with pytest.raises(odoh.DecryptError) as e:
        odoh.TargetKeys(key).open_query(bytes(wire))
    assert e.value.status == 400


def test_tampered_enc_is_400(key: odoh.TargetKey) -> None:
    wire = bytearray(odoh.seal_query(key.config, QUERY)[0])
    # enc starts after type(1) + len(2) + key id(32) + len(2)
    wire[37:69] = bytes(32)  # the all-zero (low-order) point: X25519 refuses it
    with pytest.raises(odoh.DecryptError):
        odoh.TargetKeys(key).open_query(bytes(wire))


def test_nonzero_padding_is_400(key: odoh.TargetKey) -> None:
    plain = struct.pack(">H", len(QUERY)) + QUERY + struct.pack(">H", 4) + b"\x00\x00\x01\x00"
    with pytest.raises(odoh.MalformedMessage, match="padding"):
        odoh.TargetKeys(key).open_query(_seal_raw_plaintext(key, plain))
    good = struct.pack(">H", len(QUERY)) + QUERY + struct.pack(">H", 4) + bytes(4)
    assert odoh.TargetKeys(key).open_query(_seal_raw_plaintext(key, good))[0] == QUERY


def test_padding_length_mismatch_is_400(key: odoh.TargetKey) -> None:
    plain = struct.pack(">H", len(QUERY)) + QUERY + struct.pack(">H", 9) + bytes(4)
    with pytest.raises(odoh.MalformedMessage):
        odoh.TargetKeys(key).open_query(_seal_raw_plaintext(key, plain))


def test_wrong_type_is_400(key: odoh.TargetKey) -> None:
    wire = bytearray(odoh.seal_query(key.config, QUERY)[0])
    wire[0] = odoh.RESPONSE
    with pytest.raises(odoh.MalformedMessage, match="type") as e:
        odoh.TargetKeys(key).open_query(bytes(wire))
    assert e.value.status == 400


def test_response_type_checked(key: odoh.TargetKey) -> None:
    wire, ctx = odoh.seal_query(key.config, QUERY)
    _, sctx = odoh.TargetKeys(key).open_query(wire)
    resp = bytearray(sctx.seal_response(QUERY))
    resp[0] = odoh.QUERY
    with pytest.raises(odoh.MalformedMessage):
        ctx.open_response(bytes(resp))
    resp[0] = odoh.RESPONSE
    resp[-1] ^= 0x80
    with pytest.raises(odoh.DecryptError):
        ctx.open_response(bytes(resp))


def test_rotation_keeps_previous_for_overlap(key: odoh.TargetKey) -> None:
    keys = odoh.TargetKeys(key)
    old_wire, _ = odoh.seal_query(key.config, QUERY)
    second = odoh.TargetKey.generate()
    keys.rotate(second)
    assert odoh.decode_configs(keys.configs()) == [second.config]
    assert keys.open_query(old_wire)[0] == QUERY  # previous key still accepted
    assert keys.open_query(odoh.seal_query(second.config, QUERY)[0])[0] == QUERY
    keys.rotate(odoh.TargetKey.generate())
    with pytest.raises(odoh.UnknownKeyId):
        keys.open_query(old_wire)


def test_fresh_keys_differ_and_seed_is_stable() -> None:
    assert odoh.TargetKey.generate().key_id != odoh.TargetKey.generate().key_id
    assert odoh.TargetKey.from_seed(b"s" * 16).key_id == odoh.TargetKey.from_seed(b"s" * 16).key_id


def test_configs_skip_unknown_version_and_suite(key: odoh.TargetKey) -> None:
    good = key.config.encode()
    other_suite = odoh.ObliviousDoHConfigContents(0x0010, 1, 1, b"\x04" * 65).encode()
    body = (
        struct.pack(">HH", 0x0002, len(good)) + good  # unknown version: skipped
        + struct.pack(">HH", 1, len(other_suite)) + other_suite  # P-256: skipped
        + struct.pack(">HH", 1, len(good)) + good
    )
    assert odoh.decode_configs(struct.pack(">H", len(body)) + body) == [key.config]


@pytest.mark.parametrize(
    "data", [b"", b"\x00", b"\x00\x05abc", b"\x00\x04\x00\x01\x00\x09", b"\x00\x02\x00\x01"]
)
def test_configs_framing_errors(data: bytes) -> None:
    with pytest.raises(odoh.MalformedMessage):
        odoh.decode_configs(data)


@given(st.binary(max_size=300))
def test_configs_decode_never_crashes(data: bytes) -> None:
    with contextlib.suppress(odoh.MalformedMessage):
        odoh.decode_configs(data)


@given(st.binary(max_size=400))
def test_open_query_never_crashes(data: bytes) -> None:
    keys = odoh.TargetKeys(odoh.TargetKey.from_seed(b"\x01" * 32))
    try:
        keys.open_query(data)
    except odoh.OdohError as e:
        assert e.status in (400, 401)


@given(st.binary(max_size=200), st.integers(0, 300))
def test_plaintext_round_trip(msg: bytes, pad: int) -> None:
    assert odoh.decode_plaintext(odoh.encode_plaintext(msg, pad)) == msg


@given(st.binary(max_size=100))
def test_decode_plaintext_never_crashes(data: bytes) -> None:
    with contextlib.suppress(odoh.MalformedMessage):
        odoh.decode_plaintext(data)


@given(st.integers(0, 255), st.binary(max_size=40), st.binary(max_size=80))
def test_message_round_trip(t: int, kid: bytes, enc: bytes) -> None:
    m = odoh.ObliviousMessage(t, kid, enc)
    assert odoh.ObliviousMessage.decode(m.encode(), t) == m
