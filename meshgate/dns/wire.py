"""DNS wire format, sans-I/O: parse queries, walk responses, pack answers into buffers.

Only what the hot path needs is parsed by hand (header, question, EDNS OPT);
everything else stays as wire bytes. An `Answer` is a complete response held
as bytes *without* its OPT record, plus the offsets of every TTL in it, so a
cached answer is served by copying it into a pooled buffer and patching the
ID, the question's letter case and the aged TTLs in place (no dnspython
objects, no re-encoding). The OPT record the client is owed (UDP size, DO
bit, RFC 7830 padding) is appended per client.

No clock reads here: callers pass `now`.
"""

from __future__ import annotations

import struct
from typing import Final

from meshgate.buffers import Buffer

# Types, classes, rcodes, options (RFC 1035, 6891, 7830, 7828, 8914).
TYPE_A: Final = 1
TYPE_NS: Final = 2
TYPE_CNAME: Final = 5
TYPE_SOA: Final = 6
TYPE_AAAA: Final = 28
TYPE_OPT: Final = 41
CLASS_IN: Final = 1

NOERROR: Final = 0
FORMERR: Final = 1
SERVFAIL: Final = 2
NXDOMAIN: Final = 3
NOTIMP: Final = 4
REFUSED: Final = 5
BADVERS: Final = 16

OPCODE_QUERY: Final = 0
OPCODE_NOTIFY: Final = 4

OPT_KEEPALIVE: Final = 11
OPT_PADDING: Final = 12
OPT_EDE: Final = 15
EDE_TOO_EARLY: Final = 26

FLAG_QR: Final = 0x8000
FLAG_AA: Final = 0x0400
FLAG_TC: Final = 0x0200
FLAG_RD: Final = 0x0100
FLAG_RA: Final = 0x0080
FLAG_CD: Final = 0x0010
EDNS_DO: Final = 0x8000

RESPONSE_PAD_BLOCK: Final = 468  # RFC 8467: pad responses to a multiple of 468 bytes
OUR_UDP_SIZE: Final = 1232  # what we advertise (DNS flag day 2020)
MAX_TTL: Final = 86400  # cap on what we cache, RFC 8767 style sanity bound
MAX_MESSAGE: Final = 65535

RCODE_NAMES: Final = {
    0: "NOERROR", 1: "FORMERR", 2: "SERVFAIL", 3: "NXDOMAIN", 4: "NOTIMP", 5: "REFUSED", 16: "BADVERS",
}

_HEADER = struct.Struct(">HHHHHH")
_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
_RR_FIXED = struct.Struct(">HHIH")  # type, class, ttl, rdlength
_OPT_HEAD = struct.Struct(">BHHBBHH")  # root name, type, udp size, ext rcode, version, flags, rdlen
_OPTION = struct.Struct(">HH")
_ZEROS = memoryview(bytes(RESPONSE_PAD_BLOCK + 16))
_OPT_SIZE: Final = 11


class WireError(ValueError):
    """The message cannot be answered at all (too short, or a response): drop it."""


class FormError(ValueError):
    """The message is a query we can answer only with an error rcode."""

    def __init__(self, reason: str, qid: int, flags: int, rcode: int = FORMERR,
                 question: bytes | None = None, edns: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.qid = qid
        self.flags = flags
        self.rcode = rcode
        self.question = question
        self.edns = edns


class Query:
    """A parsed query. `question` is the client's own question bytes (letter case kept);
    `key` is (lowercased wire name, qtype, qclass) for the cache and the zone lookup."""

    __slots__ = ("do", "edns", "flags", "id", "keepalive", "name", "opcode", "padding", "qclass",
                 "qtype", "question", "udp_size")

    def __init__(self, qid: int, flags: int, question: bytes, name: bytes, qtype: int, qclass: int) -> None:
        self.id = qid
        self.flags = flags
        self.opcode = (flags >> 11) & 0xF
        self.question = question
        self.name = name  # lowercased wire-format name
        self.qtype = qtype
        self.qclass = qclass
        self.edns = False
        self.udp_size = 512
        self.do = False
        self.padding = False
        self.keepalive = False

    @property
    def key(self) -> tuple[bytes, int, int]:
        return (self.name, self.qtype, self.qclass)


def _name_end(data: bytes | bytearray | memoryview, off: int, allow_pointers: bool) -> int:
    """Offset just past the name starting at `off` (compression pointers end a name)."""
    n = len(data)
    total = 0
    while True:
        if off >= n:
            raise ValueError("name runs past the end")
        ln = data[off]
        if ln == 0:
            return off + 1
        if ln & 0xC0 == 0xC0:
            if not allow_pointers:
                raise ValueError("compression pointer in question")
            if off + 2 > n:
                raise ValueError("truncated pointer")
            return off + 2
        if ln & 0xC0:
            raise ValueError("unknown label type")
        total += ln + 1
        if total > 254:
            raise ValueError("name longer than 255 bytes")
        off += ln + 1


def parse_query(data: bytes | bytearray | memoryview) -> Query:
    """Parse a query. Raises WireError (drop) or FormError (answer with its rcode)."""
    if len(data) < 12:
        raise WireError("shorter than a DNS header")
    qid, flags, qdcount, ancount, nscount, arcount = _HEADER.unpack_from(data, 0)
    if flags & FLAG_QR:
        raise WireError("a response, not a query")  # never answer answers (reflection loops)
    opcode = (flags >> 11) & 0xF
    if qdcount != 1:
        raise FormError(f"QDCOUNT={qdcount}", qid, flags)
    try:
        qend = _name_end(data, 12, allow_pointers=False)
    except ValueError as e:
        raise FormError(f"bad question name: {e}", qid, flags) from None
    if qend + 4 > len(data):
        raise FormError("truncated question", qid, flags)
    qtype, qclass = struct.unpack_from(">HH", data, qend)
    question = bytes(data[12 : qend + 4])
    q = Query(qid, flags, question, question[: qend - 12].lower(), qtype, qclass)
    off = qend + 4
    try:
        for _ in range(ancount + nscount):
            off = _skip_rr(data, off)
        for _ in range(arcount):
            start = off
            off = _name_end(data, off, allow_pointers=True)
            if off + 10 > len(data):
                raise ValueError("truncated record")
            rtype, rclass, ttl, rdlen = _RR_FIXED.unpack_from(data, off)
            off += 10
            if off + rdlen > len(data):
                raise ValueError("truncated rdata")
            if rtype == TYPE_OPT:
                if q.edns:
                    raise ValueError("more than one OPT record")
                if data[start] != 0:
                    raise ValueError("OPT owner is not the root")
                q.edns = True
                q.udp_size = max(rclass, 512)
                q.do = bool(ttl & EDNS_DO)
                version = (ttl >> 16) & 0xFF
                _parse_options(q, data, off, off + rdlen)
                if version != 0:
                    raise FormError("EDNS version", qid, flags, BADVERS, question, edns=True)
            off += rdlen
    except FormError:
        raise
    except (ValueError, struct.error) as e:
        raise FormError(str(e), qid, flags, FORMERR, question, edns=q.edns) from None
    if off != len(data):
        raise FormError("trailing bytes", qid, flags, FORMERR, question, edns=q.edns)
    if opcode != OPCODE_QUERY:
        raise FormError(f"opcode {opcode}", qid, flags, NOTIMP, question, edns=q.edns)
    return q


def _parse_options(q: Query, data: bytes | bytearray | memoryview, off: int, end: int) -> None:
    while off < end:
        if off + 4 > end:
            raise ValueError("truncated EDNS option")
        code, ln = _OPTION.unpack_from(data, off)
        off += 4
        if off + ln > end:
            raise ValueError("EDNS option runs past OPT")
        if code == OPT_PADDING:
            q.padding = True
        elif code == OPT_KEEPALIVE:
            q.keepalive = True
        off += ln


def _skip_rr(data: bytes | bytearray | memoryview, off: int) -> int:
    off = _name_end(data, off, allow_pointers=True)
    if off + 10 > len(data):
        raise ValueError("truncated record")
    rdlen = _U16.unpack_from(data, off + 8)[0]
    off += 10 + rdlen
    if off > len(data):
        raise ValueError("truncated rdata")
    return off


# --------------------------------------------------------------------------- answers


class Answer:
    """A response without OPT, ready to be patched per client.

    `ttl_offsets`/`ttls`: where each TTL lives and its value when stored;
    `ttl` is how long the whole answer stays valid (cache lifetime and the
    DoH max-age); `stored` is when; `aging` is False for authoritative local
    data, which always carries its full TTL.
    """

    __slots__ = ("aged", "aging", "rcode", "stored", "ttl", "ttl_offsets", "ttls", "wire")

    def __init__(self, wire: bytes, ttl_offsets: tuple[int, ...], ttls: tuple[int, ...], ttl: int,
                 rcode: int, stored: float = 0.0, aging: bool = True) -> None:
        self.wire = wire
        self.ttl_offsets = ttl_offsets
        self.ttls = ttls
        self.ttl = ttl
        self.rcode = rcode
        self.stored = stored
        self.aging = aging
        # (age in seconds, `wire` with every TTL aged by it): a cache hit within the same second
        # copies it instead of patching each TTL again.
        self.aged: tuple[int, bytes] | None = None

    def remaining(self, now: float) -> int:
        if not self.aging:
            return self.ttl
        return max(self.ttl - int(now - self.stored), 0)


def encode_name(name: str) -> bytes:
    """Text name -> lowercased wire name (the zone and record keys)."""
    name = name.rstrip(".")
    if not name:
        return b"\x00"
    out = bytearray()
    for label in name.split("."):
        b = label.encode("idna") if not label.isascii() else label.encode()
        if not 0 < len(b) < 64:
            raise ValueError(f"bad label {label!r} in {name!r}")
        out.append(len(b))
        out += b
    out.append(0)
    if len(out) > 255:
        raise ValueError(f"name {name!r} is too long")
    return bytes(out).lower()


def label_starts(wire_name: bytes) -> list[int]:
    """Offsets of each label of an uncompressed wire-format name, so `name[off:]` is each of its
    suffixes, longest first (split DNS and blocklists look suffixes up with these)."""
    starts: list[int] = []
    off = 0
    n = len(wire_name)
    while off < n and wire_name[off]:
        starts.append(off)
        off += wire_name[off] + 1
    return starts


def decode_name(wire: bytes) -> str:
    """Uncompressed wire name -> text with trailing dot."""
    labels: list[str] = []
    off = 0
    while wire[off]:
        ln = wire[off]
        labels.append(wire[off + 1 : off + 1 + ln].decode("ascii", "replace"))
        off += ln + 1
    return ".".join(labels) + "."


def build_answer(q_question: bytes, rcode: int, *, aa: bool,
                 answers: list[tuple[int, int, bytes]] = (),  # type: ignore[assignment]
                 authority: list[tuple[bytes, int, int, bytes]] = (),  # type: ignore[assignment]
                 ttl: int | None = None, aging: bool = False, stored: float = 0.0) -> Answer:
    """Pack a response for `q_question` (name+type+class wire bytes).

    answers: (type, ttl, rdata) owned by the question name (compressed to offset 12);
    authority: (owner wire name, type, ttl, rdata). `ttl` defaults to the smallest
    answer TTL, or for a negative answer min(SOA TTL, SOA MINIMUM) (RFC 2308).
    """
    flags = FLAG_QR | FLAG_RA | rcode | (FLAG_AA if aa else 0)
    out = bytearray(_HEADER.pack(0, flags, 1, len(answers), len(authority), 0))
    out += q_question
    qclass = _U16.unpack_from(q_question, len(q_question) - 2)[0]
    offsets: list[int] = []
    ttls: list[int] = []
    for rtype, rttl, rdata in answers:
        out += b"\xc0\x0c"
        offsets.append(len(out) + 4)
        ttls.append(rttl)
        out += _RR_FIXED.pack(rtype, qclass, rttl, len(rdata))
        out += rdata
    neg_ttl: int | None = None
    for owner, rtype, rttl, rdata in authority:
        out += owner
        offsets.append(len(out) + 4)
        ttls.append(rttl)
        out += _RR_FIXED.pack(rtype, qclass, rttl, len(rdata))
        out += rdata
        if rtype == TYPE_SOA and len(rdata) >= 20:
            neg_ttl = min(rttl, _U32.unpack_from(rdata, len(rdata) - 4)[0])
    if ttl is None:
        ttl = min(a[1] for a in answers) if answers else (neg_ttl if neg_ttl is not None else 0)
    return Answer(bytes(out), tuple(offsets), tuple(ttls), ttl, rcode, stored, aging)


def soa_rdata(mname: bytes, rname: bytes, serial: int, refresh: int, retry: int, expire: int,
              minimum: int) -> bytes:
    return mname + rname + struct.pack(">IIIII", serial, refresh, retry, expire, minimum)


def parse_response(wire: bytes | bytearray | memoryview, query_id: int | None, key: tuple[bytes, int, int],
                   now: float) -> Answer:
    """Validate an upstream response for the question `key` and turn it into an Answer.

    Raises ValueError when it is not an answer to that question (wrong ID,
    not a response, other question: routedns #595), so it is neither cached
    nor served. The OPT record is removed (we add our own per client).
    """
    if len(wire) < 12:
        raise ValueError("short response")
    qid, flags, qdcount, ancount, nscount, arcount = _HEADER.unpack_from(wire, 0)
    if not flags & FLAG_QR:
        raise ValueError("not a response")
    if query_id is not None and qid != query_id:
        raise ValueError("ID mismatch")
    if qdcount != 1:
        raise ValueError(f"QDCOUNT={qdcount} in response")
    qend = _name_end(wire, 12, allow_pointers=False)
    if qend + 4 > len(wire):
        raise ValueError("truncated question")
    name = bytes(wire[12:qend]).lower()
    qtype, qclass = struct.unpack_from(">HH", wire, qend)
    if (name, qtype, qclass) != key:
        raise ValueError("response is for another question")
    rcode = flags & 0xF
    off = qend + 4
    offsets: list[int] = []
    ttls: list[int] = []
    min_answer: int | None = None
    neg_ttl: int | None = None
    opt: tuple[int, int] | None = None
    buf = bytearray(wire)
    total = ancount + nscount + arcount
    for i in range(total):
        start = off
        off = _name_end(wire, off, allow_pointers=True)
        if off + 10 > len(wire):
            raise ValueError("truncated record")
        rtype, _rclass, rttl, rdlen = _RR_FIXED.unpack_from(wire, off)
        ttl_off = off + 4
        off += 10
        if off + rdlen > len(wire):
            raise ValueError("truncated rdata")
        if rtype == TYPE_OPT:
            if i < ancount + nscount or opt is not None:
                raise ValueError("misplaced OPT")
            opt = (start, off + rdlen)
        else:
            if rttl > 0x7FFFFFFF:
                rttl = 0  # RFC 2181 8: treat as zero
            rttl = min(rttl, MAX_TTL)
            _U32.pack_into(buf, ttl_off, rttl)
            offsets.append(ttl_off)
            ttls.append(rttl)
            if i < ancount:
                min_answer = rttl if min_answer is None else min(min_answer, rttl)
            elif i < ancount + nscount and rtype == TYPE_SOA and rdlen >= 22:
                minimum = _U32.unpack_from(wire, off + rdlen - 4)[0]
                neg_ttl = min(rttl, minimum)
        off += rdlen
    if opt is not None:
        a, b = opt
        if b != off:
            raise ValueError("OPT is not the last record")
        del buf[a:b]
        _U16.pack_into(buf, 10, arcount - 1)
    del buf[off if opt is None else opt[0] :]  # ignore trailing bytes
    if flags & FLAG_TC:
        ttl = 0
    elif rcode == NOERROR and min_answer is not None:
        ttl = min_answer
    elif rcode in (NOERROR, NXDOMAIN) and neg_ttl is not None:
        ttl = neg_ttl  # RFC 2308 negative caching
    else:
        ttl = 0  # SERVFAIL, REFUSED, negative without SOA: not cached
    _U16.pack_into(buf, 0, 0)
    _U16.pack_into(buf, 2, flags | FLAG_RA)  # we recurse for our clients
    return Answer(bytes(buf), tuple(offsets), tuple(ttls), ttl, rcode, now, True)


def answer_addresses(ans: Answer) -> list[tuple[int, bytes]]:
    """(type, rdata) of every A/AAAA record in the answer section (CNAME chains included)."""
    wire = ans.wire
    _, _, qdcount, ancount, _, _ = _HEADER.unpack_from(wire, 0)
    off = 12
    for _ in range(qdcount):
        off = _name_end(wire, off, allow_pointers=True) + 4
    out: list[tuple[int, bytes]] = []
    for _ in range(ancount):
        off = _name_end(wire, off, allow_pointers=True)
        rtype, _c, _t, rdlen = _RR_FIXED.unpack_from(wire, off)
        off += 10
        if (rtype == TYPE_A and rdlen == 4) or (rtype == TYPE_AAAA and rdlen == 16):
            out.append((rtype, wire[off : off + rdlen]))
        off += rdlen
    return out


# --------------------------------------------------------------------------- packing


def _opt_size(pad_to: int, ede: int | None) -> int:
    return _OPT_SIZE + (6 if ede is not None else 0) + (4 if pad_to else 0)


def _append_opt(data: bytearray, base: int, end: int, q_do: bool, ext_rcode: int, pad_to: int,
                ede: int | None) -> int:
    """Write our OPT record at `end`; returns the new end. Pads the message to `pad_to`."""
    rdlen = 0
    opt_at = end
    end += _OPT_SIZE
    if ede is not None:
        _OPTION.pack_into(data, end, OPT_EDE, 2)
        _U16.pack_into(data, end + 4, ede)
        end += 6
        rdlen += 6
    if pad_to:
        pad = (-(end - base + 4)) % pad_to
        _OPTION.pack_into(data, end, OPT_PADDING, pad)
        end += 4
        data[end : end + pad] = _ZEROS[:pad]
        end += pad
        rdlen += 4 + pad
    _OPT_HEAD.pack_into(data, opt_at, 0, TYPE_OPT, OUR_UDP_SIZE, ext_rcode, 0, EDNS_DO if q_do else 0, rdlen)
    return end


def packed_size(ans: Answer, q: Query, pad: bool) -> int:
    """Upper bound of what pack_answer writes (to pick a pooled or a one-off buffer)."""
    n = len(ans.wire)
    if q.edns:
        n += _opt_size(RESPONSE_PAD_BLOCK if pad else 0, None) + (RESPONSE_PAD_BLOCK if pad else 0)
    return n


def pack_answer(buf: Buffer, ans: Answer, q: Query, now: float, *, limit: int = MAX_MESSAGE,
                pad: bool = False) -> int:
    """Write `ans` for `q` into `buf`: ID, question case, aged TTLs, OPT. Returns the
    remaining TTL (DoH max-age). A response over `limit` (UDP) is truncated to
    header + question with TC set."""
    wire = ans.wire
    n = len(wire)
    remaining = ans.ttl
    if ans.aging:
        age = int(now - ans.stored)
        if age > 0:
            remaining = max(remaining - age, 0)
            aged = ans.aged
            if aged is None or aged[0] != age:
                patched = bytearray(wire)
                for off, ttl in zip(ans.ttl_offsets, ans.ttls, strict=True):
                    _U32.pack_into(patched, off, ttl - age if ttl > age else 0)
                aged = ans.aged = (age, bytes(patched))
            wire = aged[1]
    base = buf.headroom
    data = buf.data
    data[base : base + n] = wire
    buf.start = base
    _U16.pack_into(data, base, q.id)
    flags = _U16.unpack_from(wire, 2)[0]
    _U16.pack_into(data, base + 2, (flags & ~(FLAG_RD | FLAG_CD)) | (q.flags & (FLAG_RD | FLAG_CD)))
    qlen = len(q.question)
    data[base + 12 : base + 12 + qlen] = q.question  # the client's letter case (0x20)
    end = base + n
    pad_to = RESPONSE_PAD_BLOCK if pad and q.edns else 0
    if q.edns:
        needed = end + _opt_size(pad_to, None) + pad_to
        if needed > len(data):
            pad_to = 0  # no room to pad: an unpadded answer beats none
        end = _append_opt(data, base, end, q.do, 0, pad_to, None)
        _U16.pack_into(data, base + 10, _U16.unpack_from(data, base + 10)[0] + 1)
    length = end - base
    if length > limit:
        end = base + 12 + qlen
        _HEADER.pack_into(data, base, q.id, _U16.unpack_from(data, base + 2)[0] | FLAG_TC, 1, 0, 0, 0)
        if q.edns:
            end = _append_opt(data, base, end, q.do, 0, 0, None)
            _U16.pack_into(data, base + 10, 1)
        length = end - base
    buf.length = length
    return remaining


def pack_error(buf: Buffer, qid: int, qflags: int, rcode: int, question: bytes | None, *,
               edns: bool = False, do: bool = False, pad: bool = False, ede: int | None = None,
               tc: bool = False) -> None:
    """FORMERR/SERVFAIL/NOTIMP/REFUSED/BADVERS for a query (question echoed when known); with
    `tc`, the empty truncated answer a rate-limited UDP client gets (retry over TCP)."""
    data = buf.data
    base = buf.headroom
    flags = FLAG_QR | FLAG_RA | (qflags & (0x7800 | FLAG_RD | FLAG_CD)) | (rcode & 0xF)
    if tc:
        flags |= FLAG_TC
    qd = 1 if question is not None else 0
    _HEADER.pack_into(data, base, qid, flags, qd, 0, 0, 1 if edns else 0)
    end = base + 12
    if question is not None:
        data[end : end + len(question)] = question
        end += len(question)
    if edns:
        end = _append_opt(data, base, end, do, rcode >> 4, RESPONSE_PAD_BLOCK if pad else 0, ede)
    buf.start = base
    buf.length = end - base


def error_for(buf: Buffer, err: FormError, pad: bool = False) -> None:
    pack_error(buf, err.qid, err.flags, err.rcode, err.question, edns=err.edns, pad=pad)


def build_query(qid: int, name: bytes, qtype: int, qclass: int, *, do: bool = False) -> bytes:
    """A recursive query with EDNS (what we send upstream)."""
    out = bytearray(_HEADER.pack(qid, FLAG_RD, 1, 0, 0, 1))
    out += name
    out += struct.pack(">HH", qtype, qclass)
    out += _OPT_HEAD.pack(0, TYPE_OPT, OUR_UDP_SIZE, 0, 0, EDNS_DO if do else 0, 0)
    return bytes(out)
