"""Small network tools the TUN system tests run inside their namespaces.

    python -m tests.system.tun_tools ping DST [--count N] [--size BYTES] [--timeout S] [--ttl N]
    python -m tests.system.tun_tools echo-server --tcp HOST:PORT --udp HOST:PORT
    python -m tests.system.tun_tools tcp DST PORT TEXT     (prints the echo: "<peer seen by server>|TEXT")
    python -m tests.system.tun_tools udp DST PORT TEXT
    python -m tests.system.tun_tools df-udp DST PORT SIZE  (one UDP datagram with DF set, for PMTU tests)
    python -m tests.system.tun_tools raw-syn SRC DST PORT  (one IPv4 TCP SYN from any source address)

Each client prints one JSON line. The echo server answers "<client address it saw>|<data>",
so a test can tell whether the owner node masqueraded. No ping binary is needed:
ICMP echo goes through a raw socket (the tests run as root).
"""

from __future__ import annotations

import argparse
import json
import selectors
import socket
import struct
import sys
import time


def _csum(b: bytes) -> int:
    if len(b) % 2:
        b += b"\x00"
    t: int = sum(struct.unpack(f"!{len(b) // 2}H", b))
    while t >> 16:
        t = (t & 0xFFFF) + (t >> 16)
    return ~t & 0xFFFF


def ping(dst: str, count: int, size: int, timeout: float, ttl: int = 0) -> dict[str, object]:
    v6 = ":" in dst
    s = socket.socket(socket.AF_INET6 if v6 else socket.AF_INET, socket.SOCK_RAW,
                      socket.IPPROTO_ICMPV6 if v6 else socket.IPPROTO_ICMP)
    if ttl:
        if v6:
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_UNICAST_HOPS, ttl)
        else:
            s.setsockopt(socket.IPPROTO_IP, socket.IP_TTL, ttl)
    ident = 0x4D47
    replies, errors, rtts = 0, [], []
    for seq in range(count):
        msg = struct.pack("!BBHHH", 128 if v6 else 8, 0, 0, ident, seq) + b"m" * size
        if not v6:  # the kernel fills the ICMPv6 checksum; ICMPv4 is ours to compute
            msg = msg[:2] + struct.pack("!H", _csum(msg)) + msg[4:]
        t0 = time.monotonic()
        try:
            s.sendto(msg, (dst, 0))
        except OSError as e:
            errors.append(f"send:{e.strerror}")
            continue
        deadline = t0 + timeout
        while (left := deadline - time.monotonic()) > 0:
            s.settimeout(left)
            try:
                data, addr = s.recvfrom(65535)
            except TimeoutError:
                break
            if not v6:
                data = data[(data[0] & 0x0F) * 4 :]
            if data[0] in (0, 129) and struct.unpack_from("!HH", data, 4) == (ident, seq):
                replies += 1
                rtts.append((time.monotonic() - t0) * 1000)
                break
            if data[0] not in (8, 128):  # not our own echo request looping back: an error
                errors.append(f"icmp:{data[0]}/{data[1]}:{addr[0]}")
    return {"replies": replies, "sent": count, "errors": errors, "rtt_ms": rtts}


def echo_server(tcp: str, udp: str) -> None:
    sel = selectors.DefaultSelector()

    def addr(text: str) -> tuple[int, tuple[str, int]]:
        host, _, port = text.rpartition(":")
        host = host.strip("[]")
        return (socket.AF_INET6 if ":" in host else socket.AF_INET), (host, int(port))

    for spec in tcp.split(",") if tcp else []:
        fam, a = addr(spec)
        ls = socket.socket(fam, socket.SOCK_STREAM)
        ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if fam == socket.AF_INET6:
            ls.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)  # 0.0.0.0 has its own socket
        ls.bind(a)
        ls.listen(64)
        sel.register(ls, selectors.EVENT_READ, "accept")
    for spec in udp.split(",") if udp else []:
        fam, a = addr(spec)
        us = socket.socket(fam, socket.SOCK_DGRAM)
        if fam == socket.AF_INET6:
            us.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        us.bind(a)
        sel.register(us, selectors.EVENT_READ, "udp")
    print(json.dumps({"ready": True}), flush=True)
    while True:
        for key, _ in sel.select():
            sock = key.fileobj
            assert isinstance(sock, socket.socket)
            if key.data == "accept":
                conn, peer = sock.accept()
                conn.settimeout(5)
                try:
                    data = b""
                    while chunk := conn.recv(65536):  # the client half-closes after sending
                        data += chunk
                    conn.sendall(peer[0].encode() + b"|" + data)
                except OSError:
                    pass
                conn.close()
            else:
                data, peer = sock.recvfrom(65536)
                sock.sendto(peer[0].encode() + b"|" + data, peer)


def tcp_client(dst: str, port: int, text: str, timeout: float) -> dict[str, object]:
    t0 = time.monotonic()
    try:
        with socket.create_connection((dst, port), timeout=timeout) as c:
            c.sendall(text.encode())
            c.shutdown(socket.SHUT_WR)
            out = b""
            while chunk := c.recv(65536):
                out += chunk
        return {"ok": True, "reply": out.decode(), "seconds": time.monotonic() - t0}
    except OSError as e:
        return {"ok": False, "error": type(e).__name__, "errno": e.errno, "seconds": time.monotonic() - t0}


def udp_client(dst: str, port: int, text: str, timeout: float) -> dict[str, object]:
    fam = socket.AF_INET6 if ":" in dst else socket.AF_INET
    with socket.socket(fam, socket.SOCK_DGRAM) as c:
        c.settimeout(timeout)
        for _ in range(3):  # UDP through a fresh path may lose the first datagram: retry, bounded
            c.sendto(text.encode(), (dst, port))
            try:
                data, _ = c.recvfrom(65536)
                return {"ok": True, "reply": data.decode()}
            except TimeoutError:
                continue
    return {"ok": False, "error": "timeout"}


def df_udp(dst: str, port: int, size: int, timeout: float = 3.0) -> dict[str, object]:
    """Send one DF datagram of `size` bytes (IP header included) on a connected socket and report
    the path MTU the kernel learns from the ICMP answer (the socket must live to receive it)."""
    v6 = ":" in dst
    with socket.socket(socket.AF_INET6 if v6 else socket.AF_INET, socket.SOCK_DGRAM) as c:
        level, discover, mtu_opt = (socket.IPPROTO_IPV6, 23, 24) if v6 else (socket.IPPROTO_IP, 10, 14)
        c.setsockopt(level, discover, 2)  # IP(V6)_MTU_DISCOVER = PMTUDISC_DO: DF set, no fragmenting
        c.connect((dst, port))
        header = 48 if v6 else 28
        try:
            c.send(b"d" * (size - header))
        except OSError as e:
            return {"sent": False, "error": e.strerror}
        deadline = time.monotonic() + timeout
        mtu = c.getsockopt(level, mtu_opt)
        while mtu >= size and time.monotonic() < deadline:
            time.sleep(0.02)
            mtu = c.getsockopt(level, mtu_opt)
    return {"sent": True, "mtu": mtu}


def raw_syn(src: str, dst: str, port: int) -> dict[str, object]:
    """One TCP SYN with a source address of our choosing (a member forging another's address)."""
    s4, d4 = socket.inet_aton(src), socket.inet_aton(dst)
    tcp = bytearray(struct.pack("!HHIIBBHHH", 40123, port, 1, 0, 0x50, 0x02, 65535, 0, 0))
    struct.pack_into("!H", tcp, 16, _csum(s4 + d4 + struct.pack("!BBH", 0, 6, len(tcp)) + bytes(tcp)))
    ip = bytearray(struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(tcp), 1, 0x4000, 64, 6, 0, s4, d4))
    struct.pack_into("!H", ip, 10, _csum(bytes(ip)))
    with socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW) as s:  # IP_HDRINCL implied
        s.sendto(bytes(ip + tcp), (dst, 0))
    return {"sent": True}


def main() -> int:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("ping")
    p.add_argument("dst")
    p.add_argument("--count", type=int, default=3)
    p.add_argument("--size", type=int, default=56)
    p.add_argument("--timeout", type=float, default=1.0)
    p.add_argument("--ttl", type=int, default=0, help="IP TTL / hop limit (0: the system default)")
    e = sub.add_parser("echo-server")
    e.add_argument("--tcp", default="")
    e.add_argument("--udp", default="")
    for name in ("tcp", "udp"):
        c = sub.add_parser(name)
        c.add_argument("dst")
        c.add_argument("port", type=int)
        c.add_argument("text")
        c.add_argument("--timeout", type=float, default=5.0)
    d = sub.add_parser("df-udp")
    d.add_argument("dst")
    d.add_argument("port", type=int)
    d.add_argument("size", type=int)
    r = sub.add_parser("raw-syn")
    r.add_argument("src")
    r.add_argument("dst")
    r.add_argument("port", type=int)
    a = ap.parse_args()
    if a.cmd == "ping":
        out = ping(a.dst, a.count, a.size, a.timeout, a.ttl)
    elif a.cmd == "echo-server":
        echo_server(a.tcp, a.udp)
        return 0
    elif a.cmd == "tcp":
        out = tcp_client(a.dst, a.port, a.text, a.timeout)
    elif a.cmd == "udp":
        out = udp_client(a.dst, a.port, a.text, a.timeout)
    elif a.cmd == "raw-syn":
        out = raw_syn(a.src, a.dst, a.port)
    else:
        out = df_udp(a.dst, a.port, a.size)
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
