"""Helpers run inside a namespace by the NAT traversal tests (python -m tests.system.nat_tools):

    sink PORT                 TCP server on 127.0.0.1:PORT: reads a connection to its end,
                              answers the sha256 (hex) and length of what came, closes; runs until killed
    send HOST PORT MIB        through the SOCKS5 portal on 127.0.0.1:1080 (RFC 1928 written
                              out here, no library): MIB MiB of pseudo-random bytes, then the
                              sink's digest; prints one JSON line {ok, match, seconds}
"""

from __future__ import annotations

import hashlib
import json
import socket
import struct
import sys
import threading
import time


def sink(port: int) -> None:
    srv = socket.create_server(("127.0.0.1", port))

    def serve(conn: socket.socket) -> None:
        h = hashlib.sha256()
        n = 0
        with conn:
            while chunk := conn.recv(1 << 16):
                h.update(chunk)
                n += len(chunk)
            conn.sendall(f"{h.hexdigest()} {n}".encode())

    while True:
        conn, _ = srv.accept()
        threading.Thread(target=serve, args=(conn,), daemon=True).start()


def _chunks(mib: int):  # type: ignore[no-untyped-def]
    block = hashlib.sha256(b"seed").digest() * 2048  # 64 KiB, varied by a counter below
    for i in range(mib * 16):
        yield struct.pack("!Q", i) + block[8:]


def send(host: str, port: int, mib: int) -> dict[str, object]:
    start = time.monotonic()
    s = socket.create_connection(("127.0.0.1", 1080), timeout=60)
    s.sendall(b"\x05\x01\x00")
    if s.recv(2) != b"\x05\x00":
        return {"ok": False, "error": "socks method"}
    s.sendall(b"\x05\x01\x00\x01" + socket.inet_aton(host) + struct.pack("!H", port))
    reply = s.recv(10)
    if len(reply) < 2 or reply[1] != 0:
        return {"ok": False, "error": f"socks reply {reply!r}"}
    h = hashlib.sha256()
    n = 0
    for c in _chunks(mib):
        n += len(c)
        h.update(c)
        s.sendall(c)
    s.shutdown(socket.SHUT_WR)
    got = b""
    while chunk := s.recv(128):
        got += chunk
    s.close()
    digest, _, count = got.decode().partition(" ")
    return {"ok": True, "match": digest == h.hexdigest() and count == str(n), "sent": n,
            "received": int(count or 0), "seconds": round(time.monotonic() - start, 3)}


def main() -> int:
    cmd, args = sys.argv[1], sys.argv[2:]
    if cmd == "sink":
        sink(int(args[0]))
        return 0
    try:
        out = send(args[0], int(args[1]), int(args[2]))
    except OSError as e:
        out = {"ok": False, "error": str(e)}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
