"""The DoH server's memoizing HPACK encoder emits exactly what hpack's own encoder would."""

from __future__ import annotations

import hpack
from hypothesis import given, settings
from hypothesis import strategies as st

from meshgate.dns.h2server import _MemoEncoder

NAMES = [b":status", b"content-type", b"cache-control", b"content-length", b"x-secret"]
VALUES = [b"200", b"400", b"application/dns-message", b"max-age=300", b"max-age=299", b"113", b"x" * 300]

header = st.tuples(st.sampled_from(NAMES), st.sampled_from(VALUES))
step = st.one_of(
    st.lists(header, min_size=1, max_size=5).map(lambda hs: ("encode", hs)),
    st.lists(header, min_size=1, max_size=3).map(lambda hs: ("never", hs)),
    st.sampled_from([100, 256, 4096]).map(lambda n: ("resize", n)),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(step, min_size=1, max_size=40))
def test_memo_encoder_matches_hpack_byte_for_byte(steps: list[tuple[str, object]]) -> None:
    memo, plain = _MemoEncoder(), hpack.Encoder()
    decoder: hpack.Decoder | None = hpack.Decoder()
    for kind, arg in steps:
        if kind == "resize":
            memo.header_table_size = plain.header_table_size = arg  # type: ignore[assignment]
            decoder = None  # hpack disagrees with itself after some resizes: compare bytes only
            continue
        hs = list(arg)  # type: ignore[call-overload]
        if kind == "never":  # sensitive: must never be served from a plain tuple's memo
            hs = [hpack.NeverIndexedHeaderTuple(n, v) for n, v in hs]
        for _ in range(2):  # the second time is the memo's chance
            a, b = memo.encode(list(hs)), plain.encode(list(hs))
            assert a == b
            if decoder is not None:
                assert decoder.decode(a, raw=True) == [(n, v) for n, v in hs]
        assert list(memo.header_table.dynamic_entries) == list(plain.header_table.dynamic_entries)


def test_memo_serves_repeated_blocks() -> None:
    memo = _MemoEncoder()
    hs = [(b":status", b"200"), (b"content-type", b"application/dns-message")]
    first = memo.encode(list(hs))  # adds content-type to the table: not remembered yet
    second = memo.encode(list(hs))
    assert first != second and memo.encode(list(hs)) is second  # the third is the memo's
