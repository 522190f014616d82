"""meshgate.dns.huffman: the byte-at-a-time HPACK Huffman decoder agrees with hpack's own (the
reference) on every input, decodes RFC 7541 C.4, and is what the DoH server's HPACK decoder uses."""

from __future__ import annotations

from collections.abc import Callable

import hpack
import pytest
from hpack.exceptions import HPACKDecodingError
from hpack.huffman import HuffmanEncoder
from hpack.huffman_constants import REQUEST_CODES, REQUEST_CODES_LENGTH
from hpack.huffman_table import decode_huffman as reference
from hypothesis import given
from hypothesis import strategies as st

from meshgate.dns import h2server
from meshgate.dns.huffman import decode_huffman

_ENCODER = HuffmanEncoder(REQUEST_CODES, REQUEST_CODES_LENGTH)


def _outcome(fn: Callable[[bytes], bytes], data: bytes) -> bytes | str:
    try:
        return fn(data)
    except HPACKDecodingError:
        return "error"


@given(st.binary(max_size=300))
def test_round_trip_through_hpack_encoder(raw: bytes) -> None:
    assert decode_huffman(_ENCODER.encode(raw)) == raw


@given(st.binary(max_size=40))
def test_agrees_with_hpack_on_arbitrary_bytes(data: bytes) -> None:
    assert _outcome(decode_huffman, data) == _outcome(reference, data)


@given(st.binary(min_size=1, max_size=60), st.binary(max_size=4))
def test_agrees_with_hpack_on_encoded_strings_with_a_damaged_tail(raw: bytes, tail: bytes) -> None:
    # Valid codes then arbitrary bytes: exercises padding and EOS checks after real symbols.
    data = _ENCODER.encode(raw) + tail
    assert _outcome(decode_huffman, data) == _outcome(reference, data)


@pytest.mark.parametrize(("hexdata", "text"), [
    # RFC 7541 C.4.1-C.4.3 (request examples with Huffman coding).
    ("f1e3c2e5f23a6ba0ab90f4ff", b"www.example.com"),
    ("a8eb10649cbf", b"no-cache"),
    ("25a849e95ba97d7f", b"custom-key"),
    ("25a849e95bb8e8b4bf", b"custom-value"),
    # RFC 7541 C.6 (response examples).
    ("6402", b"302"),
    ("aec3771a4b", b"private"),
    ("d07abe941054d444a8200595040b8166e082a62d1bff", b"Mon, 21 Oct 2013 20:13:21 GMT"),
    ("9d29ad171863c78f0b97c8e9ae82ae43d3", b"https://www.example.com"),
])
def test_rfc7541_examples(hexdata: str, text: bytes) -> None:
    assert decode_huffman(bytes.fromhex(hexdata)) == text


@pytest.mark.parametrize("data", [
    b"\xff\xff\xff\xff",          # EOS (30 ones) inside the string
    b"\x07\xff",                  # '0' (00000) then 11 bits of padding: over 7 bits
    b"\x00",                      # '0' (00000) then padding 000: not all ones
    b"\xfe",                      # an incomplete code: padding 11111110 is not all ones
    b"\xff",                      # 8 bits of padding with no symbol
])
def test_rfc7541_5_2_errors(data: bytes) -> None:
    with pytest.raises(HPACKDecodingError):
        decode_huffman(data)
    with pytest.raises(HPACKDecodingError):
        reference(data)


def test_empty_and_exact_fit() -> None:
    assert decode_huffman(b"") == b""
    assert decode_huffman(memoryview(_ENCODER.encode(b"a0a0a0a0"))) == b"a0a0a0a0"  # 5-bit codes, no pad


def test_server_decoder_routes_through_it() -> None:
    # A literal header block with Huffman-coded name and value (RFC 7541 C.4.3's custom-key),
    # decoded by the server's memo decoder, and a bad Huffman string there is a decoding error.
    assert hpack.hpack.decode_huffman is decode_huffman  # type: ignore[attr-defined]
    dec = h2server._MemoDecoder()
    block = bytes.fromhex("0088" "25a849e95ba97d7f" "89" "25a849e95bb8e8b4bf")
    assert dec.decode(block, raw=True) == [(b"custom-key", b"custom-value")]
    with pytest.raises(HPACKDecodingError):
        h2server._MemoDecoder().decode(bytes.fromhex("0081ff81ff"), raw=True)
