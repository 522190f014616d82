"""A mesh forming delivers each version of a record from every neighbour, mostly before
the table checks it (RouteTable.settle runs with the throttled builds): a copy whose
bytes are already waiting is acknowledged without decoding; a copy with the same header
and other bytes (forged) is decoded and checked beside the genuine one, never hides it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from meshgate.mesh import routing
from meshgate.mesh.identity import Identity, verify
from meshgate.mesh.routing import Record, RouteTable, encode_records


def _signed(ident: Identity, version: int) -> Record:
    rec = Record(ident.node_id, 7, version, "far", key=ident.public, neighbours=((1, 100),))
    return replace(rec, signature=ident.sign(rec.signed_part))


def _check(rec: Record, held: Record | None) -> str | None:
    return None if verify(rec.key[:32], rec.signature, rec.signed_part) else "bad_signature"


def test_a_copy_waiting_for_its_check_is_not_decoded_again_and_a_forged_one_is(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    decoded: list[int] = []
    decode = routing.decode_one

    def counted(data: bytes | memoryview) -> Record:
        decoded.append(1)
        return decode(data)

    monkeypatch.setattr(routing, "decode_one", counted)
    far = Identity.generate()
    table = RouteTable(Record(1, 1, 1, "me", neighbours=((2, 100), (3, 100), (4, 100))), accept=_check)
    for nid in (2, 3, 4):
        table.neighbour_up(nid)
    genuine = _signed(far, 5)
    forged = replace(genuine, signature=bytes(64))  # same header, other bytes
    body = encode_records([genuine], 60000)[0]

    assert table.receive_body(2, body, 0.0) == [(far.node_id, 5)]
    assert len(decoded) == table.records_decoded == 1
    assert table.receive_body(3, body, 0.0) == [(far.node_id, 5)]  # acknowledged as well
    assert len(decoded) == 1  # but not decoded again
    assert table.receive_body(4, encode_records([forged], 60000)[0], 0.0) == [(far.node_id, 5)]
    assert len(decoded) == 2  # the forged copy is decoded and held beside
    # neighbour 3 is never sent back what it sent
    assert far.node_id not in {r.origin for r in table.records_to_send(3, 0.0)}

    assert table.settle() == 1
    assert table.records[far.node_id].signature == genuine.signature
    assert table.refused == 0  # the genuine one (first by arrival) passed; the forged one waits no more
