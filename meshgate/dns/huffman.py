"""HPACK Huffman decoding (RFC 7541 5.2, Appendix B) one input byte per step.

The hpack package walks its state machine a nibble at a time with flag checks on each step:
two table lookups and up to four branches per input byte, ~44% of the server's CPU for
dnsperf -m doh, whose GET paths change with every query (so no memo helps). Here one lookup per
byte gives the next state and the bytes that byte completes; errors are checked once, at the end:

- a state is an internal node of the code tree (the bits read since the last symbol); there are
  256 of them (257 symbols), plus FAIL, which every byte leads back to;
- decoding EOS (the 30-bit all-ones code) leads to FAIL: RFC 7541 5.2 makes EOS in a string an
  error;
- the string is complete only in a node reached from the root by at most 7 one-bits: padding
  longer than 7 bits, or not all ones, ends anywhere else.

Errors raise hpack's HPACKDecodingError, as hpack's own decoder does, so the connection still gets
COMPRESSION_ERROR. The tables are built once at import from the code table hpack ships as data
(hpack.huffman_constants), by composing two nibble steps (tens of milliseconds).
"""

from __future__ import annotations

from hpack.exceptions import HPACKDecodingError
from hpack.huffman_constants import REQUEST_CODES, REQUEST_CODES_LENGTH

_EOS = 256


def _build() -> tuple[list[int], list[bytes], frozenset[int]]:
    # The code tree: internal nodes numbered from 0 (the root); child[node][bit] is an internal
    # node, or -1 - symbol for a leaf.
    child: list[list[int]] = [[0, 0]]
    for sym, (code, length) in enumerate(zip(REQUEST_CODES, REQUEST_CODES_LENGTH, strict=True)):
        node = 0
        for i in range(length - 1, -1, -1):
            bit = (code >> i) & 1
            if i == 0:
                child[node][bit] = -1 - sym
            else:
                nxt = child[node][bit]
                if nxt <= 0:  # 0 is the root, never anyone's child: an unset slot
                    child.append([0, 0])
                    nxt = child[node][bit] = len(child) - 1
                node = nxt
    fail = len(child)

    # One nibble from each state: (next state, bytes emitted).
    def nibble(state: int, value: int) -> tuple[int, bytes]:
        if state == fail:
            return fail, b""
        out = bytearray()
        for i in (3, 2, 1, 0):
            nxt = child[state][(value >> i) & 1]
            if nxt < 0:
                sym = -1 - nxt
                if sym == _EOS:
                    return fail, b""
                out.append(sym)
                nxt = 0
            state = nxt
        return state, bytes(out)

    step4 = [[nibble(s, v) for v in range(16)] for s in range(fail + 1)]
    # Flat tables indexed by state * 256 + byte; states are stored pre-multiplied by 256.
    nxt_table: list[int] = []
    out_table: list[bytes] = []
    for s in range(fail + 1):
        row = step4[s]
        for hi in range(16):
            s1, o1 = row[hi]
            row1 = step4[s1]
            for lo in range(16):
                s2, o2 = row1[lo]
                nxt_table.append(s2 << 8)
                out_table.append(o1 + o2 if o2 else o1)

    # Complete: after 0..7 one-bits from the root (no code is that many ones, so all are internal).
    accept = {0}
    node = 0
    for _ in range(7):
        node = child[node][1]
        accept.add(node << 8)
    return nxt_table, out_table, frozenset(accept)


_NEXT, _OUT, _ACCEPT = _build()


def decode_huffman(huffman_string: bytes | bytearray | memoryview | None) -> bytes:
    """The bytes a Huffman-coded HPACK string literal stands for; HPACKDecodingError if it holds
    EOS or its padding is over 7 bits or not all ones (what hpack's decode_huffman does)."""
    if not huffman_string:
        return b""
    nxt = _NEXT
    out = _OUT
    state = 0
    chunks: list[bytes] = []
    append = chunks.append
    for byte in huffman_string:
        i = state | byte
        state = nxt[i]
        append(out[i])
    if state not in _ACCEPT:
        raise HPACKDecodingError("Invalid Huffman string")
    return b"".join(chunks)
