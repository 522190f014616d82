"""The mesh UDP relay's wire head: the per-datagram fast path (`head_len`, heads built once by
`encode_head`) accepts exactly what the full parser (`decode`) accepts, at the same offset."""

from __future__ import annotations

import ipaddress

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshgate.gateway.mesh_udp import UdpWireError, decode, encode_head, head_len


@pytest.mark.parametrize("addr", ["10.144.1.2", "fd00::2"])
def test_head_round_trip(addr: str) -> None:
    ip = ipaddress.ip_address(addr)
    head = encode_head(7, ip, 5353)
    data = head + b"payload"
    assert head_len(data) == len(head) == 7 + len(ip.packed)
    assoc, got_ip, port, payload = decode(data)
    assert (assoc, got_ip, port, bytes(payload)) == (7, ip, 5353, b"payload")


@pytest.mark.parametrize(
    "data",
    [b"", b"\x00" * 6, b"\x00" * 6 + b"\x05" + b"\x00" * 16, b"\x00" * 6 + b"\x04\x0a\x00",
     b"\x00" * 6 + b"\x06" + b"\x00" * 15],
    ids=["empty", "short", "bad-family", "short-v4", "short-v6"],
)
def test_malformed_heads_are_refused(data: bytes) -> None:
    assert head_len(data) == 0
    with pytest.raises(UdpWireError):
        decode(data)


# mostly well-framed heads (family 4 or 6) with any tail, so both branches are exercised
_WIRE = st.builds(
    lambda fixed, family, tail: fixed + bytes([family]) + tail,
    st.binary(min_size=6, max_size=6), st.sampled_from([4, 6, 0, 5]), st.binary(max_size=24),
) | st.binary(max_size=12)


@given(_WIRE)
def test_head_len_agrees_with_decode(data: bytes) -> None:
    n = head_len(data)
    try:
        _, _, _, payload = decode(data)
    except UdpWireError:
        assert n == 0
    else:
        assert n == len(data) - len(payload)
