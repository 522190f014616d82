"""A link handshake behind a slow peer (issue 18 item 5: 125 nodes on one loop, eight such
processes on two cores): each step comes late, but it comes. The handshake timeout is counted
from the peer's last message, at most HANDSHAKE_EXTENSIONS times, so such a link comes up; a
peer that says nothing still fails at the timeout."""

from __future__ import annotations

import asyncio
import time

from meshgate.config import LinkUrl
from tests.helpers import async_wait_until
from tests.mesh_testing import node_config, start_node, stop_all

TIMEOUT = 0.5
DELAY = 0.3  # each chunk from the dialer waits this long: two of them outlast TIMEOUT


async def _slow_proxy(target: int) -> tuple[asyncio.Server, int]:
    """Forwards to 127.0.0.1:`target`, holding each chunk from the dialer for DELAY (the
    slowness under test, not a wait); the other way at once."""

    async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter, delay: float) -> None:
        try:
            while data := await r.read(65536):
                if delay:
                    await asyncio.sleep(delay)
                w.write(data)
                await w.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            w.close()

    async def serve(cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        ur, uw = await asyncio.open_connection("127.0.0.1", target)
        await asyncio.gather(pipe(cr, uw, DELAY), pipe(ur, cw, 0.0))

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def test_a_handshake_whose_steps_come_late_still_comes_up() -> None:
    limits = {"handshake_timeout": TIMEOUT}
    hub = await start_node(node_config("hub", "10.9.0.1/24", listen=["tcp://127.0.0.1:0"], limits=limits))
    port = int(hub.listen_addrs[0].rsplit(":", 1)[1])
    server, via = await _slow_proxy(port)
    dialer = await start_node(node_config("dialer", "10.9.0.2/24", limits=limits))
    try:
        dialer.set_peers((LinkUrl("tcp", "127.0.0.1", via),))
        await async_wait_until(lambda: hub.node_id in dialer.links and dialer.node_id in hub.links, 10,
                               "the link up")
        for node in (hub, dialer):
            assert node.stats["handshake_failed_timeout"] == 0, node.name
    finally:
        server.close()
        await stop_all([hub, dialer])


async def test_a_peer_that_says_nothing_still_fails_at_the_timeout() -> None:
    limits = {"handshake_timeout": TIMEOUT}
    hub = await start_node(node_config("hub", listen=["tcp://127.0.0.1:0"], limits=limits))
    port = int(hub.listen_addrs[0].rsplit(":", 1)[1])
    r, w = await asyncio.open_connection("127.0.0.1", port)
    try:
        assert await asyncio.wait_for(r.read(), 5) == b""  # closed by the hub, nothing sent
        assert hub.stats["handshake_failed_timeout"] == 1 and not hub.links
    finally:
        w.close()
        await stop_all([hub])


async def test_a_timer_that_ran_late_looks_again_after_the_loop_has_read() -> None:
    """The loop blocked past the handshake timeout (a busy host): uvloop runs the due timer
    before it reads what came meanwhile, so the timer looks once more after a read. A peer that
    sent nothing still fails then."""
    limits = {"handshake_timeout": TIMEOUT}
    hub = await start_node(node_config("hub", listen=["tcp://127.0.0.1:0"], limits=limits))
    port = int(hub.listen_addrs[0].rsplit(":", 1)[1])
    r, w = await asyncio.open_connection("127.0.0.1", port)
    try:
        await async_wait_until(lambda: bool(hub.pending), 5, "the handshake pending")
        (link,) = hub.pending
        time.sleep(TIMEOUT + 0.5)  # the starvation under test, not a wait
        assert await asyncio.wait_for(r.read(), 5) == b""
        assert hub.stats["handshake_failed_timeout"] == 1
        assert link._extensions == 1  # looked at again once, then failed: nothing had come
    finally:
        w.close()
        await stop_all([hub])
