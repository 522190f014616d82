"""NAT traversal's sans-I/O core (meshgate/mesh/traversal.py): probes, calls, pair state."""

from __future__ import annotations

import contextlib

import pytest
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from hypothesis import given, settings
from hypothesis import strategies as st

from meshgate.mesh.identity import Identity
from meshgate.mesh.traversal import (
    KIND_PROBE,
    LOCAL,
    MAX_ENDPOINTS,
    PING,
    PONG,
    PROBE_ROUNDS,
    REFLEXIVE,
    Pair,
    Pairs,
    Replays,
    TraversalError,
    decode_call,
    encode_call,
    open_probe,
    probe_key,
    probe_sender,
    seal_probe,
)

A, B, C = Identity.generate(), Identity.generate(), Identity.generate()
NOW = 1_700_000_000_000


def _aead(x: Identity, y: Identity, network: str = "net") -> ChaCha20Poly1305:
    return ChaCha20Poly1305(probe_key(x.dh_private, y.public[32:], network))


def _reason(fn: object) -> str:
    with pytest.raises(TraversalError) as e:
        fn()  # type: ignore[operator]
    return e.value.reason


def test_both_ends_derive_one_key_and_only_they_do() -> None:
    assert probe_key(A.dh_private, B.public[32:], "net") == probe_key(B.dh_private, A.public[32:], "net")
    assert probe_key(A.dh_private, B.public[32:], "net") != probe_key(A.dh_private, B.public[32:], "other")
    assert probe_key(A.dh_private, B.public[32:], "net") != probe_key(C.dh_private, B.public[32:], "net")


def test_ping_and_pong_round_trip() -> None:
    ping = seal_probe(_aead(A, B), A.node_id, PING, b"t" * 8, NOW, B.node_id)
    assert ping[0] == KIND_PROBE and probe_sender(ping) == A.node_id
    got = open_probe(_aead(B, A), ping, B.node_id, NOW + 5, Replays())
    assert (got.sender, got.ptype, got.tx, got.observed) == (A.node_id, PING, b"t" * 8, None)
    for seen in (("203.0.113.7", 41641), ("2001:db8::7", 9)):
        pong = seal_probe(_aead(B, A), B.node_id, PONG, b"t" * 8, NOW, A.node_id, seen)
        assert open_probe(_aead(A, B), pong, A.node_id, NOW, Replays()).observed == seen


def test_forged_altered_misdirected_stale_and_replayed_probes_are_refused() -> None:
    ping = seal_probe(_aead(A, B), A.node_id, PING, b"t" * 8, NOW, B.node_id)
    # C (a member with its own key) claiming to be A: B opens with A's key and fails
    forged = seal_probe(_aead(C, B), A.node_id, PING, b"t" * 8, NOW, B.node_id)
    assert _reason(lambda: open_probe(_aead(B, A), forged, B.node_id, NOW, Replays())) == "bad_seal"
    for i in range(len(ping)):  # any bit changed anywhere fails
        bad = bytearray(ping)
        bad[i] ^= 0x01
        with pytest.raises(TraversalError):
            probe_sender(bad)
            open_probe(_aead(B, A), bad, B.node_id, NOW, Replays())
    # a probe for B answered by C (C holds a key with A too): wrong receiver
    to_c = seal_probe(_aead(A, C), A.node_id, PING, b"t" * 8, NOW, B.node_id)
    assert _reason(lambda: open_probe(_aead(C, A), to_c, C.node_id, NOW, Replays())) == "wrong_receiver"
    assert _reason(lambda: open_probe(_aead(B, A), ping, B.node_id, NOW + 31_000, Replays())) == "stale"
    replays = Replays()
    open_probe(_aead(B, A), ping, B.node_id, NOW, replays)
    assert _reason(lambda: open_probe(_aead(B, A), ping, B.node_id, NOW, replays)) == "replayed"


def test_the_replay_table_is_bounded() -> None:
    r = Replays(size=4)
    for i in range(10):
        assert r.check(bytes([i]) * 12)
    assert len(r._seen) == 4
    assert not r.check(bytes([9]) * 12) and r.check(bytes([0]) * 12)  # the oldest fell out


def test_calls_round_trip_and_bad_calls_are_refused() -> None:
    eps = [(LOCAL, ("10.1.0.2", 41641)), (REFLEXIVE, ("203.0.113.2", 50000)), (REFLEXIVE, ("2001:db8::1", 7))]
    assert decode_call(encode_call(eps, True)) == (eps, True)
    assert decode_call(encode_call(eps, False)) == (eps, False)
    many = [(LOCAL, (f"10.0.0.{i}", 1000 + i)) for i in range(20)]
    assert len(decode_call(encode_call(many, True))[0]) == MAX_ENDPOINTS  # bounded at the sender
    good = encode_call(eps, True)
    for bad in (b"", good[:-1], good + b"\0", b"\x02" + good[1:], good[:2] + b"\x09" + good[3:],
                bytes((1, 1, 1, 3, 4)) + bytes(6),  # kind 3
                bytes((1, 1, 1, 1, 5)) + bytes(6)):  # family 5
        assert _reason(lambda b=bad: decode_call(b)) == "malformed"


@settings(max_examples=2000, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_never_raise_anything_but_traversal_error(data: bytes) -> None:
    for fn in (lambda: decode_call(data), lambda: probe_sender(data),
               lambda: open_probe(_aead(B, A), bytes([KIND_PROBE]) + data, B.node_id, NOW, Replays())):
        with contextlib.suppress(TraversalError):
            fn()


def test_a_pair_probes_in_rounds_within_its_budget_and_backs_off() -> None:
    p = Pair(1)
    assert p.can_start(0.0)
    p.start(10.0)
    assert not p.can_start(10.0)
    assert p.due_rounds(10.0) == 1 and p.due_rounds(10.05) == 0
    assert p.due_rounds(10.0 + PROBE_ROUNDS[-1]) == len(PROBE_ROUNDS) - 1
    assert not p.expired(13.9) and p.expired(14.0)
    for _ in range(60):
        p.spend(10.0)
    assert p.budget(10.0, 60) == 0 and p.budget(69.9, 60) == 0 and p.budget(70.0, 60) == 60
    p.failed(14.0, backoff_max=300.0)
    assert not p.can_start(18.9) and p.can_start(19.0)  # 5 s
    p.start(19.0)
    p.failed(23.0, backoff_max=300.0)
    assert not p.can_start(32.9) and p.can_start(33.0)  # 10 s
    for _ in range(10):
        p.start(0.0)
        p.failed(1000.0, backoff_max=300.0)
    assert p.not_before == 1300.0  # capped
    p.succeeded()
    assert p.can_start(0.0) and p.failures == 0


def test_pairs_are_bounded_least_recently_used_out() -> None:
    pairs = Pairs(3)
    for nid in (1, 2, 3):
        pairs.get(nid)
    pairs.get(1)  # touched
    pairs.get(4)
    assert list(pairs.table) == [3, 1, 4]
    assert pairs.get(2, create=False) is None
