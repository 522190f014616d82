"""End-to-end sessions, sans-I/O (meshgate/mesh/e2e.py)."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshgate.mesh.e2e import E2e, E2eError
from meshgate.mesh.frames import DATAGRAM, DATAGRAM_SEALED, E2E_INIT, SEALED, STREAM_DATA, SendCipher
from meshgate.mesh.identity import Identity


def _pair(**kw: int) -> tuple[Identity, E2e, Identity, E2e]:
    ia, ib = Identity.generate(), Identity.generate()
    a = E2e(ia, "net", b"", lambda src, pub, cert: None, **kw)
    b = E2e(ib, "net", b"", lambda src, pub, cert: None, **kw)
    return ia, a, ib, b


def _up(ia: Identity, a: E2e, ib: Identity, b: E2e) -> list[tuple[int, bytes]]:
    """a sends one stream frame to b: the handshake runs; returns what b received opened."""
    frames, queued = a.seal(ib.node_id, ib.dh_public, STREAM_DATA, 1, b"hello", 0.0, False)
    assert queued and [t for t, _ in frames] == [E2E_INIT]
    resp, flush_b = b.on_init(ia.node_id, frames[0][1], 0.0)
    assert resp is not None and flush_b == []
    flushed = a.on_resp(ib.node_id, resp)
    return [(t, body) for t, body in flushed]


def test_handshake_then_sealed_frames_both_ways() -> None:
    ia, a, ib, b = _pair()
    flushed = _up(ia, a, ib, b)
    assert [t for t, _ in flushed] == [SEALED]
    assert b.open(ia.node_id, memoryview(flushed[0][1]), False) == (STREAM_DATA, 1, b"hello")
    (t, body), = b.seal(ia.node_id, ia.dh_public, DATAGRAM, 0, b"\x00\x07back", 1.0, True)[0]
    assert t == DATAGRAM_SEALED and b"back" not in body
    assert a.open(ib.node_id, memoryview(body), True) == (DATAGRAM, 0, b"\x00\x07back")
    with pytest.raises(E2eError) as e:
        a.open(ib.node_id, memoryview(body), True)  # the same record again
    assert e.value.reason == "forged_or_replayed"


def test_the_responder_checks_who_the_initiator_is() -> None:
    ia, ib, mallory = Identity.generate(), Identity.generate(), Identity.generate()
    a = E2e(ia, "net", b"", lambda src, pub, cert: None)
    refusing = E2e(ib, "net", b"", lambda src, pub, cert: "key_changed")
    b = E2e(ib, "net", b"", lambda src, pub, cert: None)
    frames, _ = a.seal(ib.node_id, ib.dh_public, STREAM_DATA, 0, b"x", 0.0, False)
    init = frames[0][1]
    with pytest.raises(E2eError) as e:
        b.on_init(mallory.node_id, init, 0.0)  # a's message 1 replayed under another source id
    assert e.value.reason == "bad_node_id"
    with pytest.raises(E2eError) as e:
        refusing.on_init(ia.node_id, init, 0.0)
    assert e.value.reason == "key_changed"
    # message 1 for another node's key: nothing to open
    other = E2e(mallory, "net", b"", lambda src, pub, cert: None)
    with pytest.raises(E2eError) as e:
        other.on_init(ia.node_id, init, 0.0)
    assert e.value.reason == "handshake"


def test_crossed_initiations_end_in_one_session() -> None:
    ia, a, ib, b = _pair()
    fa, _ = a.seal(ib.node_id, ib.dh_public, STREAM_DATA, 0, b"from a", 0.0, False)
    fb, _ = b.seal(ia.node_id, ia.dh_public, STREAM_DATA, 0, b"from b", 0.0, False)
    low, high = (a, b) if ia.node_id < ib.node_id else (b, a)
    low_id = ia.node_id if low is a else ib.node_id
    high_id = ib.node_id if low is a else ia.node_id
    low_init = fa[0][1] if low is a else fb[0][1]
    high_init = fb[0][1] if low is a else fa[0][1]
    assert low.on_init(high_id, high_init, 0.0) == (None, [])  # the lower id keeps its own
    resp, flushed = high.on_init(low_id, low_init, 0.0)  # the higher one answers, and sends its queue
    assert resp is not None and len(flushed) == 1
    mine = low.on_resp(high_id, resp)
    assert len(mine) == 1
    assert low.open(high_id, memoryview(flushed[0][1]), False)[2] in (b"from a", b"from b")
    assert high.open(low_id, memoryview(mine[0][1]), False)[2] in (b"from a", b"from b")


def test_queue_and_table_are_bounded() -> None:
    _, a, ib, _ = _pair(queue_bytes=100, max_sessions=2)
    a.seal(ib.node_id, ib.dh_public, DATAGRAM, 0, b"x" * 60, 0.0, True)
    _, queued = a.seal(ib.node_id, ib.dh_public, DATAGRAM, 0, b"x" * 60, 0.0, True)
    assert not queued and a.counts["queue_full"] == 1
    others = [Identity.generate() for _ in range(3)]
    for o in others:
        a.seal(o.node_id, o.dh_public, STREAM_DATA, 0, b"x", 0.0, False)
    assert len(a.sessions) == 2 and a.counts["evicted"] == 2
    assert list(a.sessions) == [others[1].node_id, others[2].node_id]


def test_an_unanswered_handshake_is_resent_then_given_up() -> None:
    _, a, ib, _ = _pair()
    a.seal(ib.node_id, ib.dh_public, STREAM_DATA, 0, b"x", 0.0, False)
    frames, _ = a.seal(ib.node_id, ib.dh_public, STREAM_DATA, 0, b"y", 0.5, False)
    assert frames == []
    frames, _ = a.seal(ib.node_id, ib.dh_public, STREAM_DATA, 0, b"z", 1.5, False)
    assert [t for t, _ in frames] == [E2E_INIT]
    frames, queued = a.seal(ib.node_id, ib.dh_public, STREAM_DATA, 0, b"w", 11.0, False)
    assert not queued and a.counts["handshake_timeout"] == 4 and ib.node_id not in a.sessions


_SAMPLE = _pair()


@settings(max_examples=3000, deadline=None, database=None)
@given(st.binary(max_size=300), st.sampled_from(["init", "resp", "stream", "datagram"]))
def test_fuzz_never_raises_anything_but_its_own_error(data: bytes, kind: str) -> None:
    ia, a, ib, b = _SAMPLE
    with contextlib.suppress(E2eError):
        if kind == "init":
            b.on_init(ia.node_id, data, 0.0)
        elif kind == "resp":
            a.on_resp(ib.node_id, data)
        else:
            b.open(ia.node_id, memoryview(data), kind == "datagram")


def test_seal_now_is_seal_in_two_parts_and_only_once_the_session_is_up() -> None:
    """The send path's fast seal (E2e.seal_now) gives the bytes `seal` gives, as (index and
    record header, ciphertext); with no session, or one still being set up, it gives nothing
    and `seal` (which queues and sets up) has to be used."""
    ia, a, ib, b = _pair()
    assert a.seal_now(ib.node_id, STREAM_DATA, 1, b"\x00\x00\x00\x07", b"x") is None  # no session
    frames, _ = a.seal(ib.node_id, ib.dh_public, STREAM_DATA, 1, b"hello", 0.0, False)
    assert a.seal_now(ib.node_id, STREAM_DATA, 1, b"\x00\x00\x00\x07", b"x") is None  # setting up
    resp, _ = b.on_init(ia.node_id, frames[0][1], 0.0)
    assert resp is not None
    b.open(ia.node_id, memoryview(a.on_resp(ib.node_id, resp)[0][1]), False)
    send = a.sessions[ib.node_id].send
    assert send is not None
    twin = SendCipher(send.key, send.rekey_after, send.suite)  # the same key and counter: the same record
    twin.counter, twin.epoch = send.counter, send.epoch
    parts = a.seal_now(ib.node_id, STREAM_DATA, 1, b"\x00\x00\x00\x07", memoryview(b"payload"))
    assert parts is not None
    a.sessions[ib.node_id].send = twin
    body = b"\x00\x00\x00\x07payload"
    (t, whole), = a.seal(ib.node_id, ib.dh_public, STREAM_DATA, 1, body, 1.0, False)[0]
    assert t == SEALED and parts[0] + parts[1] == whole
    assert b.open(ia.node_id, memoryview(parts[0] + parts[1]), False) == (STREAM_DATA, 1, body)


def _told_pair(check: bool = True) -> tuple[Identity, E2e, Identity, E2e, list[tuple[int, int, int]]]:
    """a and b that tell their process (session, start version); b records what it was asked
    to accept and accepts only processes of a started after version 100 (`check`)."""
    ia, ib = Identity.generate(), Identity.generate()
    asked: list[tuple[int, int, int]] = []

    def current(node: int, session: int, start: int) -> bool:
        asked.append((node, session, start))
        return not check or start > 100

    a = E2e(ia, "net", b"", lambda src, pub, cert: None, process=(0xA1, 1000))
    b = E2e(ib, "net", b"", lambda src, pub, cert: None, process=(0xB1, 2000), check_process=current)
    return ia, a, ib, b, asked


def test_each_end_learns_which_process_of_the_other_it_has_a_session_with() -> None:
    ia, a, ib, b, asked = _told_pair()
    frames, _ = a.seal(ib.node_id, ib.dh_public, STREAM_DATA, 1, b"hi", 0.0, False, tell=True)
    resp, _ = b.on_init(ia.node_id, frames[0][1], 0.0)
    assert resp is not None
    a.on_resp(ib.node_id, resp)
    assert b.sessions[ia.node_id].process == (0xA1, 1000) and asked == [(ia.node_id, 0xA1, 1000)]
    assert a.sessions[ib.node_id].process == (0xB1, 2000)


def test_told_only_to_a_responder_that_reads_it_and_answered_only_when_told() -> None:
    # not told (the responder's record lacks the flag): message 1 and 2 are the plain ones, which
    # nodes from before this read; nothing learned either way
    ia, a, ib, b, asked = _told_pair()
    frames, _ = a.seal(ib.node_id, ib.dh_public, STREAM_DATA, 1, b"hi", 0.0, False)
    plain_a = E2e(ia, "net", b"", lambda src, pub, cert: None)  # no process to tell at all
    frames_plain, _ = plain_a.seal(ib.node_id, ib.dh_public, STREAM_DATA, 1, b"hi", 0.0, False, tell=True)
    assert len(frames[0][1]) == len(frames_plain[0][1])
    resp, _ = b.on_init(ia.node_id, frames[0][1], 0.0)
    assert resp is not None
    a.on_resp(ib.node_id, resp)
    assert b.sessions[ia.node_id].process is None and a.sessions[ib.node_id].process is None
    assert asked == []
    # told: message 1 is longer by exactly the process
    ia, a, ib, b, _ = _told_pair()
    told, _ = a.seal(ib.node_id, ib.dh_public, STREAM_DATA, 1, b"hi", 0.0, False, tell=True)
    assert len(told[0][1]) == len(frames[0][1]) + 12


def test_message_1_of_an_older_process_is_refused() -> None:
    """A late message 1 from a process older than one already heard of must not replace the
    session with the newer one."""
    ia, ib = Identity.generate(), Identity.generate()
    old = E2e(ia, "net", b"", lambda src, pub, cert: None, process=(0xA0, 50))
    b = E2e(ib, "net", b"", lambda src, pub, cert: None, process=(0xB1, 2000),
            check_process=lambda node, session, start: start > 100)
    frames, _ = old.seal(ib.node_id, ib.dh_public, STREAM_DATA, 1, b"hi", 0.0, False, tell=True)
    with pytest.raises(E2eError) as e:
        b.on_init(ia.node_id, frames[0][1], 0.0)
    assert e.value.reason == "old_process" and ia.node_id not in b.sessions


def test_a_message_1_payload_of_another_length_is_malformed() -> None:
    ia, ib = Identity.generate(), Identity.generate()
    a = E2e(ia, "net", b"", lambda src, pub, cert: None, process=(0xA1, 1000))
    a.process += b"\x00"  # one byte more than a process
    b = E2e(ib, "net", b"", lambda src, pub, cert: None)
    frames, _ = a.seal(ib.node_id, ib.dh_public, STREAM_DATA, 1, b"hi", 0.0, False, tell=True)
    with pytest.raises(E2eError) as e:
        b.on_init(ia.node_id, frames[0][1], 0.0)
    assert e.value.reason == "malformed"
