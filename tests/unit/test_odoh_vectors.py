"""ODoH and HPKE against published vectors: odoh-go's 16 transactions and RFC 9180 A.1.1."""

from __future__ import annotations

import json
from typing import Any

import pytest

from meshgate.dns import odoh
from tests.helpers import VECTORS

ODOH: dict[str, Any] = json.loads((VECTORS / "odoh_odoh-go_test-vectors.json").read_text())[0]
HPKE: dict[str, Any] = json.loads(
    (VECTORS / "hpke_rfc9180_A.1.1_base_x25519_hkdfsha256_aes128gcm.json").read_text()
)
TRANSACTIONS: list[dict[str, Any]] = ODOH["transactions"]


def h(s: str) -> bytes:
    return bytes.fromhex(s)


@pytest.fixture(scope="module")
def target_key() -> odoh.TargetKey:
    return odoh.TargetKey.from_seed(h(ODOH["public_key_seed"]))


def test_vector_count() -> None:
    assert len(TRANSACTIONS) == 16


def test_suite_ids_match_vector() -> None:
    assert (ODOH["kem_id"], ODOH["kdf_id"], ODOH["aead_id"]) == (
        odoh.KEM_X25519_HKDF_SHA256,
        odoh.KDF_HKDF_SHA256,
        odoh.AEAD_AES_128_GCM,
    )


def test_config_from_seed_matches(target_key: odoh.TargetKey) -> None:
    assert odoh.encode_configs([target_key.config]) == h(ODOH["odohconfigs"])
    assert odoh.TargetKeys(target_key).configs() == h(ODOH["odohconfigs"])


def test_key_id(target_key: odoh.TargetKey) -> None:
    assert target_key.key_id == h(ODOH["key_id"])
    (decoded,) = odoh.decode_configs(h(ODOH["odohconfigs"]))
    assert decoded.key_id() == h(ODOH["key_id"])
    assert decoded == target_key.config


@pytest.mark.parametrize("i", range(len(TRANSACTIONS)))
def test_transaction(i: int, target_key: odoh.TargetKey) -> None:
    t = TRANSACTIONS[i]
    keys = odoh.TargetKeys(target_key)
    query, ctx = keys.open_query(h(t["obliviousQuery"]))
    assert query == h(t["query"])
    # The plaintext kept for the response key includes the query's padding.
    assert len(ctx.query_plain) == 4 + len(query) + t["queryPaddingLength"]

    vector_response = h(t["obliviousResponse"])
    nonce = vector_response[3:19]
    sealed = ctx.seal_response(h(t["response"]), t["responsePaddingLength"], nonce=nonce)
    # Byte-exact with odoh-go, so odoh-go's client side opens what we seal.
    assert sealed == vector_response
    # And our client side opens odoh-go's response with the same context.
    assert ctx.open_response(vector_response) == h(t["response"])


def test_fresh_nonce_differs_but_opens(target_key: odoh.TargetKey) -> None:
    t = TRANSACTIONS[5]
    _, ctx = odoh.TargetKeys(target_key).open_query(h(t["obliviousQuery"]))
    a = ctx.seal_response(h(t["response"]))
    b = ctx.seal_response(h(t["response"]))
    assert a[3:19] != b[3:19]
    assert ctx.open_response(a) == ctx.open_response(b) == h(t["response"])


# --------------------------------------------------------------------------- RFC 9180 A.1.1


def test_rfc9180_a11_keys_and_seal() -> None:
    suite = odoh.SUITE
    info, ikm_r, ikm_e = h(HPKE["info"]), h(HPKE["ikmR"]), h(HPKE["ikmE"])
    recipient = odoh.TargetKey.from_seed(ikm_r)  # the same DeriveKeyPair the target uses
    assert recipient.pair.private_key.to_private_bytes() == h(HPKE["skRm"])
    assert recipient.config.public_key == h(HPKE["pkRm"])
    eph = suite.kem.derive_key_pair(ikm_e)
    assert eph.private_key.to_private_bytes() == h(HPKE["skEm"])

    enc, sender = suite.create_sender_context(recipient.pair.public_key, info=info, eks=eph)
    assert enc == h(HPKE["enc"]) == h(HPKE["pkEm"])
    receiver = suite.create_recipient_context(enc, recipient.pair.private_key, info=info)
    for e in HPKE["encryptions"]:
        ct = sender.seal(h(e["pt"]), h(e["aad"]))
        assert ct == h(e["ct"]), f"seq {e['seq']}"
        assert receiver.open(ct, h(e["aad"])) == h(e["pt"])
    for x in HPKE["exports"]:
        assert sender.export(h(x["exporter_context"]), x["L"]) == h(x["exported_value"])
        assert receiver.export(h(x["exporter_context"]), x["L"]) == h(x["exported_value"])


@pytest.mark.parametrize("i", [0, 7, 15])
def test_seal_into_buffer_matches_vector(i: int, target_key: odoh.TargetKey) -> None:
    t = TRANSACTIONS[i]
    _, ctx = odoh.TargetKeys(target_key).open_query(h(t["obliviousQuery"]))
    want = h(t["obliviousResponse"])
    out = bytearray(len(want) + 7)
    n = ctx.seal_response_into(memoryview(out)[3:], h(t["response"]), t["responsePaddingLength"],
                               nonce=want[3:19])
    assert n == len(want)
    assert bytes(out[3 : 3 + n]) == want
    with pytest.raises(ValueError):
        ctx.seal_response_into(bytearray(len(want) - 1), h(t["response"]), t["responsePaddingLength"])
