"""Mesh datagram channels: one table, so two features never share a number.

A DATAGRAM frame's channel selects the receiver's handler
(`MeshService.on_datagram`); docs/PROTOCOL.md section 6 lists the same table.
"""

L3 = 1  # TUN: one raw IP packet
SOCKS_UDP = 2  # SOCKS5 UDP ASSOCIATE, portal -> egress node
L3_VNET = 3  # TUN: an IP packet behind a virtio-net header (GSO super-packet)
L3_BUNDLE = 4  # TUN: several packets for one node from one read batch
SOCKS_UDP_REPLY = 5  # SOCKS5 UDP ASSOCIATE, egress node -> portal
DNS_QUERY = 6  # split DNS through the mesh: request id + DNS query (dns/mesh_dns.py)
DNS_ANSWER = 7  # its answer, request id + DNS message
ODOH = 8  # oblivious DNS through the mesh: asker, proxy and target messages (dns/mesh_odoh.py)
