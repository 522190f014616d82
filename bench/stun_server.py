"""A minimal STUN Binding responder (RFC 5389 §7, §15.1-15.2) for the NAT traversal bench:
EasyTier learns its reflexive address and NAT type from STUN servers, and inside the bench's
namespaces there are none. Answers every Binding request on each address given (port 3478)
with XOR-MAPPED-ADDRESS and MAPPED-ADDRESS; anything else is ignored.

    python bench/stun_server.py 198.51.100.2 198.51.100.3
"""

from __future__ import annotations

import selectors
import socket
import struct
import sys

MAGIC = 0x2112A442
BINDING_REQUEST, BINDING_SUCCESS = 0x0001, 0x0101
XOR_MAPPED_ADDRESS, MAPPED_ADDRESS = 0x0020, 0x0001
HEADER = struct.Struct("!HHI12s")


def answer(request: bytes, ip: str, port: int) -> bytes | None:
    if len(request) < HEADER.size:
        return None
    mtype, _length, magic, tid = HEADER.unpack_from(request)
    if mtype != BINDING_REQUEST or magic != MAGIC:
        return None
    raw = socket.inet_aton(ip)
    xored = struct.pack("!I", struct.unpack("!I", raw)[0] ^ MAGIC)
    body = (struct.pack("!HHBBH", XOR_MAPPED_ADDRESS, 8, 0, 1, port ^ (MAGIC >> 16)) + xored
            + struct.pack("!HHBBH", MAPPED_ADDRESS, 8, 0, 1, port) + raw)
    return HEADER.pack(BINDING_SUCCESS, len(body), MAGIC, tid) + body


def serve(addresses: list[str], port: int = 3478) -> None:
    sel = selectors.DefaultSelector()
    for a in addresses:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.bind((a, port))
        sel.register(s, selectors.EVENT_READ)
    while True:
        for key, _ in sel.select():
            sock = key.fileobj
            assert isinstance(sock, socket.socket)
            data, (ip, p) = sock.recvfrom(2048)
            reply = answer(data, ip, p)
            if reply is not None:
                sock.sendto(reply, (ip, p))


if __name__ == "__main__":
    serve(sys.argv[1:])
