"""A peer on another protocol version, over a real TCP link: refused clearly, counted, logged."""

from __future__ import annotations

import asyncio
import logging

import pytest

from meshgate.mesh.frames import MAGIC, PREFACE
from tests.helpers import async_wait_until
from tests.mesh_testing import node_config, start_node, stop_all


async def test_a_version_1_peer_gets_our_preface_a_close_and_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    node = await start_node(node_config("a", listen=["tcp://127.0.0.1:0"]))
    try:
        host, port = node.listen_addrs[0].removeprefix("tcp://").rsplit(":", 1)
        before = node.stats["handshake_failed_bad_version"]
        with caplog.at_level(logging.WARNING, logger="meshgate.mesh.links"):
            reader, writer = await asyncio.open_connection(host, int(port))
            # what a version-1 node sends first: its preface and Noise message 1 (an ephemeral key)
            writer.write(MAGIC + bytes([1, 0]) + (32).to_bytes(2, "big") + bytes(range(32)))
            answer = await asyncio.wait_for(reader.read(), 10)  # everything, up to the close
            writer.close()
            await async_wait_until(
                lambda: node.stats["handshake_failed_bad_version"] == before + 1, 10, "the refusal counted"
            )
        assert answer == PREFACE  # our version, and nothing else: no handshake message
        assert answer[4] == 3
        assert any("peer speaks protocol version 1, this node 3" in r.getMessage() for r in caplog.records)
        assert node.links == {}
    finally:
        await stop_all([node])
