"""A DNS query through a SOCKS5 UDP ASSOCIATE relay, written from RFC 1928 section 7
(not the server's own code). Prints the answer's addresses as JSON.

    python -m tests.system.socks_udp_dns PROXY_HOST PROXY_PORT DNS_HOST DNS_PORT NAME
"""

from __future__ import annotations

import json
import socket
import struct
import sys

import dns.message
import dns.rdatatype


def main() -> None:
    phost, pport, dhost, dport, name = sys.argv[1:6]
    pport, dport = int(pport), int(dport)
    ctl = socket.create_connection((phost, pport), timeout=10)
    ctl.sendall(b"\x05\x01\x00")
    assert ctl.recv(2) == b"\x05\x00"
    ctl.sendall(b"\x05\x03\x00\x01" + bytes(6))  # UDP ASSOCIATE from 0.0.0.0:0
    reply = ctl.recv(10)
    assert reply[1] == 0, reply
    relay = (socket.inet_ntoa(reply[4:8]), struct.unpack("!H", reply[8:10])[0])
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.settimeout(10)
    header = b"\x00\x00\x00\x01" + socket.inet_aton(dhost) + struct.pack("!H", dport)
    query = dns.message.make_query(name, "A")
    udp.sendto(header + query.to_wire(), relay)
    data, _ = udp.recvfrom(65535)
    assert data[: len(header)] == header, data[:10]
    answer = dns.message.from_wire(data[len(header) :])
    addrs = [r.address for rrset in answer.answer for r in rrset if r.rdtype == dns.rdatatype.A]
    print(json.dumps({"rcode": answer.rcode(), "addresses": addrs}))
    ctl.close()


if __name__ == "__main__":
    main()
