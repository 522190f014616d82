"""Sans-I/O IPv4/IPv6 packet handling for the TUN path.

Bytes in, bytes out; no sockets, no clock. The TUN adapter (meshgate/mesh/tun.py)
calls these per packet, so the common path (`parse`, `decrement_ttl`) stays a
few slicing operations; the ICMP builders run only on errors.

What the mesh does to a packet, as a router would:

* `parse` validates the header against the packet length (a TUN read yields one
  whole packet) and yields version, addresses, protocol and TTL/hop limit.
  Anything malformed raises `PacketError` with a short reason for the counter.
* The mesh counts as one router hop: the ingress node decrements TTL/hop limit
  once (IPv4 header checksum patched incrementally, RFC 1624) and answers a
  packet that would expire with ICMP Time Exceeded, so loops through the kernel
  of a proxy owner still terminate and traceroute shows the mesh hop.
* A packet larger than the MTU it must cross is answered with ICMP
  "fragmentation needed" (IPv4 with DF) or ICMPv6 "packet too big", or, for
  IPv4 without DF, fragmented (RFC 791). Never dropped without an answer.
* No ICMP error is sent about an ICMP error, a non-first fragment, or a packet
  from an unspecified/multicast/broadcast source (RFC 1122 3.2.2, RFC 4443 2.4).
"""

from __future__ import annotations

import struct
from typing import NamedTuple

PROTO_ICMP = 1
PROTO_TCP = 6
PROTO_UDP = 17
PROTO_ICMPV6 = 58

IPV4_HEADER = 20
IPV6_HEADER = 40
IPV6_MIN_MTU = 1280
IPV4_MIN_MTU = 68
# RFC 1812 4.3.2.3: an ICMPv4 error quotes as much as fits in 576 bytes.
ICMPV4_ERROR_MAX = 576

# virtio-net header in front of every packet on a TUN opened with IFF_VNET_HDR (offloads):
# flags u8, gso_type u8, hdr_len u16, gso_size u16, csum_start u16, csum_offset u16 (host order)
VNET_HDR_LEN = 10
VNET_F_NEEDS_CSUM = 0x01  # the transport checksum is partial: csum_start/csum_offset say where
VNET_GSO_NONE = 0
VNET_ZERO = bytes(VNET_HDR_LEN)  # a plain, fully checksummed packet

_V4 = struct.Struct("!BBHHHBBH4s4s")
_V6 = struct.Struct("!IHBB16s16s")
_ICMP_HEAD = struct.Struct("!BBHI")  # type, code, checksum, rest-of-header (u32)

# ICMP error kinds: (IPv4 type, code), (IPv6 type, code)
TIME_EXCEEDED = ((11, 0), (3, 0))
NO_ROUTE = ((3, 0), (1, 0))  # net unreachable / no route to destination
ADMIN_PROHIBITED = ((3, 13), (1, 1))
TOO_BIG = ((3, 4), (2, 0))  # fragmentation needed and DF set / packet too big

_ICMPV4_ERRORS = frozenset((3, 4, 5, 11, 12))


class PacketError(ValueError):
    """A malformed packet; `reason` is a short label for the drop counter."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Packet(NamedTuple):  # a NamedTuple: built per packet, ~5x cheaper than a frozen dataclass
    version: int  # 4 or 6
    src: bytes  # 4 or 16 bytes
    dst: bytes
    proto: int  # IPv4 protocol / IPv6 next header
    length: int  # total length in bytes, headers included
    header_len: int
    ttl: int  # TTL / hop limit
    dont_fragment: bool  # IPv4 DF; always True for IPv6 (routers never fragment it)
    first_fragment: bool  # offset 0 (IPv6: no fragment header is looked for: always True)


def parse(pkt: bytes | bytearray | memoryview, off: int = 0) -> Packet:
    """Validate and describe the IP packet at `pkt[off:]`; raises PacketError.

    `off` skips a virtio-net header (TUN offloads) without copying the packet.
    """
    n = len(pkt) - off
    if n < 1:
        raise PacketError("empty")
    version = pkt[off] >> 4
    if version == 4:
        if n < IPV4_HEADER:
            raise PacketError("short_header")
        vihl, _tos, total, _ident, frag, ttl, proto, _csum, src, dst = _V4.unpack_from(pkt, off)
        hlen = (vihl & 0x0F) * 4
        if hlen < IPV4_HEADER:
            raise PacketError("bad_header_length")
        if total < hlen or total > n:
            raise PacketError("bad_total_length")
        return Packet(4, src, dst, proto, total, hlen, ttl, bool(frag & 0x4000), (frag & 0x1FFF) == 0)
    if version == 6:
        if n < IPV6_HEADER:
            raise PacketError("short_header")
        _vtcfl, plen, nxt, hop, src, dst = _V6.unpack_from(pkt, off)
        if plen + IPV6_HEADER > n:
            raise PacketError("bad_total_length")
        if plen == 0 and nxt == 0:
            raise PacketError("jumbogram")  # hop-by-hop jumbo option: never on a TUN of this MTU
        return Packet(6, src, dst, nxt, plen + IPV6_HEADER, IPV6_HEADER, hop, True, True)
    raise PacketError("bad_version")


def parse_quote(pkt: bytes | bytearray | memoryview, off: int, end: int) -> Packet:
    """The IP packet an ICMP error quotes, at `pkt[off:end]`: its header whole and at least
    8 bytes after it (RFC 792), its length cut to what is quoted. Raises PacketError."""
    n = end - off
    if n < 1:
        raise PacketError("short_quote")
    version = pkt[off] >> 4
    if version == 4:
        if n < IPV4_HEADER:
            raise PacketError("short_quote")
        vihl, _tos, total, _ident, frag, ttl, proto, _csum, src, dst = _V4.unpack_from(pkt, off)
        hlen = (vihl & 0x0F) * 4
        if hlen < IPV4_HEADER or n < hlen + 8 or total < hlen:
            raise PacketError("short_quote")
        return Packet(4, src, dst, proto, min(total, n), hlen, ttl, bool(frag & 0x4000), (frag & 0x1FFF) == 0)
    if version == 6:
        if n < IPV6_HEADER + 8:
            raise PacketError("short_quote")
        _vtcfl, plen, nxt, hop, src, dst = _V6.unpack_from(pkt, off)
        return Packet(6, src, dst, nxt, min(plen + IPV6_HEADER, n), IPV6_HEADER, hop, True, True)
    raise PacketError("bad_version")


# --------------------------------------------------------------------------- checksums


def checksum(data: bytes | bytearray | memoryview, initial: int = 0) -> int:
    """RFC 1071 Internet checksum (ones' complement of the ones' complement sum)."""
    if len(data) % 2:
        data = bytes(data) + b"\x00"
    total: int = initial + sum(struct.unpack(f"!{len(data) // 2}H", data))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def _pseudo6(src: bytes, dst: bytes, length: int, nxt: int) -> int:
    hdr = src + dst + struct.pack("!IxxxB", length, nxt)
    return sum(struct.unpack("!20H", hdr))


def icmpv6_checksum(src: bytes, dst: bytes, message: bytes | bytearray) -> int:
    return checksum(message, _pseudo6(src, dst, len(message), PROTO_ICMPV6))


def decrement_ttl(pkt: bytearray, off: int = 0) -> int:
    """Decrement TTL/hop limit of the packet at `pkt[off:]` in place (IPv4 checksum patched,
    RFC 1624); returns the new value.

    The caller checks the TTL first: a packet whose TTL is 0 or 1 is answered
    with Time Exceeded instead of being decremented. Transport checksums do not
    cover the TTL, so a partial (offloaded) TCP/UDP checksum stays valid.
    """
    if pkt[off] >> 4 == 4:
        # TTL is the high byte of its 16-bit word: the word drops by 0x0100, so the checksum
        # rises by 0x0100 in ones' complement arithmetic (RFC 1624; Linux ip_decrease_ttl)
        pkt[off + 8] -= 1
        hc = ((pkt[off + 10] << 8) | pkt[off + 11]) + 0x0100
        hc = (hc & 0xFFFF) + (hc >> 16)
        pkt[off + 10] = hc >> 8
        pkt[off + 11] = hc & 0xFF
        return pkt[off + 8]
    pkt[off + 7] -= 1
    return pkt[off + 7]


# --------------------------------------------------------------------------- ICMP errors


def _unicast_source(p: Packet) -> bool:
    if p.version == 4:
        first = p.src[0]
        return p.src != b"\x00\x00\x00\x00" and p.src != b"\xff\xff\xff\xff" and not 224 <= first <= 239
    return p.src != bytes(16) and p.src[0] != 0xFF


def may_answer(pkt: bytes | bytearray | memoryview, p: Packet) -> bool:
    """Whether an ICMP error about this packet is allowed (RFC 1122 3.2.2, RFC 4443 2.4(e))."""
    if not p.first_fragment or not _unicast_source(p):
        return False
    if p.version == 4:
        if p.dst[0] >= 224:  # multicast or broadcast destination
            return False
        if p.proto == PROTO_ICMP and p.length > p.header_len:
            return pkt[p.header_len] not in _ICMPV4_ERRORS
        return True
    if p.dst[0] == 0xFF:
        # RFC 4443 2.4(e) lets Packet Too Big answer multicast; meshgate routes no
        # multicast, so every error about a multicast destination is suppressed.
        return False
    if p.proto == PROTO_ICMPV6 and p.length > IPV6_HEADER:
        return pkt[IPV6_HEADER] >= 128  # types 0-127 are errors
    return True


def icmp_error(
    pkt: bytes | bytearray | memoryview,
    p: Packet,
    kind: tuple[tuple[int, int], tuple[int, int]],
    src: bytes,
    mtu: int = 0,
) -> bytes | None:
    """An ICMP/ICMPv6 error about `pkt`, from `src` (4/16 bytes) to the packet's source.

    `mtu` is the next-hop MTU for TOO_BIG. Returns None when RFC rules forbid an
    answer (see `may_answer`) or `src` is of the wrong family.
    """
    if not may_answer(pkt, p):
        return None
    if p.version == 4:
        if len(src) != 4:
            return None
        icmp_type, code = kind[0]
        rest = (mtu & 0xFFFF) if kind is TOO_BIG else 0
        quote = bytes(pkt[: min(p.length, ICMPV4_ERROR_MAX - IPV4_HEADER - _ICMP_HEAD.size)])
        body = bytearray(_ICMP_HEAD.pack(icmp_type, code, 0, rest)) + quote
        struct.pack_into("!H", body, 2, checksum(body))
        return _ipv4(src, p.src, PROTO_ICMP, bytes(body))
    if len(src) != 16:
        return None
    icmp_type, code = kind[1]
    rest = mtu if kind is TOO_BIG else 0
    quote = bytes(pkt[: min(p.length, IPV6_MIN_MTU - IPV6_HEADER - _ICMP_HEAD.size)])
    body = bytearray(_ICMP_HEAD.pack(icmp_type, code, 0, rest)) + quote
    struct.pack_into("!H", body, 2, icmpv6_checksum(src, p.src, body))
    return _ipv6(src, p.src, PROTO_ICMPV6, bytes(body))


def _ipv4(src: bytes, dst: bytes, proto: int, payload: bytes, ttl: int = 64) -> bytes:
    hdr = bytearray(_V4.pack(0x45, 0, IPV4_HEADER + len(payload), 0, 0, ttl, proto, 0, src, dst))
    struct.pack_into("!H", hdr, 10, checksum(hdr))
    return bytes(hdr) + payload


def _ipv6(src: bytes, dst: bytes, nxt: int, payload: bytes, hop: int = 64) -> bytes:
    return _V6.pack(6 << 28, len(payload), nxt, hop, src, dst) + payload


# --------------------------------------------------------------------------- fragmentation


def fragment_v4(pkt: bytes | bytearray | memoryview, p: Packet, mtu: int) -> list[bytes]:
    """Split an IPv4 packet without DF into fragments of at most `mtu` bytes (RFC 791).

    Options are copied into every fragment (simplification: RFC 791 copies only
    options with the copy bit; a TUN sees options almost never).
    """
    if p.version != 4 or p.dont_fragment:
        raise PacketError("cannot_fragment")
    hlen = p.header_len
    step = (mtu - hlen) // 8 * 8
    if step < 8:
        raise PacketError("mtu_too_small")
    header = bytearray(pkt[:hlen])
    base_frag = struct.unpack_from("!H", pkt, 6)[0]
    base_off = base_frag & 0x1FFF
    more_after = base_frag & 0x2000
    payload = memoryview(pkt)[hlen : p.length]
    out: list[bytes] = []
    for start in range(0, len(payload), step):
        chunk = payload[start : start + step]
        last = start + step >= len(payload)
        flags = 0 if last and not more_after else 0x2000
        struct.pack_into("!H", header, 2, hlen + len(chunk))
        struct.pack_into("!H", header, 6, flags | (base_off + start // 8))
        struct.pack_into("!H", header, 10, 0)
        struct.pack_into("!H", header, 10, checksum(header))
        out.append(bytes(header) + bytes(chunk))
    return out
