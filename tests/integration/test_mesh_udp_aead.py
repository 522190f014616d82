"""AEAD negotiation on real udp:// links (loopback sockets, in-process nodes): a line A—B—C
whose nodes claim AES instructions or not (limits.aes_instructions) gets AES-256-GCM on the
link where both ends have them and ChaCha20-Poly1305 where one does not, and so does the
end-to-end session between A and C (its offer travels in the E2E_INIT frame's flags through
B); streams over both links arrive intact."""

from __future__ import annotations

import hashlib
import os

import pytest

from meshgate.mesh.link_udp import UdpLink
from meshgate.mesh.noise import AES_256_GCM, CHACHA20_POLY1305
from meshgate.mesh.service import MeshService
from meshgate.metrics import REGISTRY
from tests.helpers import async_wait_until
from tests.mesh_testing import converged, node_config, sha_server, start_node, stop_all, stream_sha


def _suites(node: MeshService) -> dict[int, str]:
    """Peer node id -> the suite of this node's udp:// link to it."""
    return {link.peer.node_id: link.session.suite.name for links in node.links.values() for link in links
            if isinstance(link, UdpLink) and link.peer is not None}


@pytest.mark.parametrize("c_aes", ["no", "yes"])
async def test_line_negotiates_per_link_and_carries_a_stream(c_aes: str) -> None:
    before = {name: REGISTRY.value("meshgate_mesh_udp_link_sessions_total", name)
              for name in (AES_256_GCM.name, CHACHA20_POLY1305.name)}
    b = await start_node(node_config("b", "10.9.4.2/24", listen=["udp://127.0.0.1:0"],
                                     limits={"aes_instructions": "yes"}))
    url = b.listen_addrs[0]
    a = await start_node(node_config("a", "10.9.4.1/24", peers=[url], limits={"aes_instructions": "yes"}))
    c = await start_node(node_config("c", "10.9.4.3/24", peers=[url], limits={"aes_instructions": c_aes}))
    c_suite = AES_256_GCM if c_aes == "yes" else CHACHA20_POLY1305
    nodes = [a, b, c]
    srv, port = await sha_server()
    try:
        await async_wait_until(lambda: converged(nodes), 15, "routes over udp:// links")
        assert _suites(a) == {b.node_id: AES_256_GCM.name}
        assert _suites(b) == {a.node_id: AES_256_GCM.name, c.node_id: c_suite.name}
        assert _suites(c) == {b.node_id: c_suite.name}
        # both ends of each link count its session by suite (what an operator sees in /metrics)
        counted = {name: REGISTRY.value("meshgate_mesh_udp_link_sessions_total", name) - was
                   for name, was in before.items()}
        assert counted == ({AES_256_GCM.name: 4, CHACHA20_POLY1305.name: 0} if c_aes == "yes"
                           else {AES_256_GCM.name: 2, CHACHA20_POLY1305.name: 2})
        data = os.urandom(8 << 20)
        assert await stream_sha(a, c.node_id, port, data) == hashlib.sha256(data).digest()
        assert await stream_sha(c, a.node_id, port, data[:1 << 20]) == hashlib.sha256(data[:1 << 20]).digest()
        # relayed through B: sealed end to end with the suite A and C negotiated
        assert a.e2e.sessions[c.node_id].suite is c_suite and c.e2e.sessions[a.node_id].suite is c_suite
        assert a.e2e.sessions[c.node_id].established
    finally:
        srv.close()
        await stop_all(nodes)
