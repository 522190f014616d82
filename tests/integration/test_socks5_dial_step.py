"""The dial of an address literal by this host's own dialer runs without a Task
(gateway/server.py DialStep): it still answers, times out with 0x06 and is abandoned when the
client leaves, and either way the socket it was connecting is closed, not left to the kernel's
SYN retries. Real sockets on loopback; a destination whose accept queue is full takes no
SYN, so a dial to it stays in progress."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import struct
from collections.abc import Iterator
from typing import Any

from meshgate.gateway.server import DIAL_STEP_ERRORS, DialStep
from tests.helpers import async_wait_until
from tests.integration.test_socks5_server import echo_server, portal, read_reply, request


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@contextlib.contextmanager
def full_listener() -> Iterator[int]:
    """A port whose listener's accept queue is full: new SYNs are dropped, connects hang."""
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(0)
    port = lsock.getsockname()[1]
    fillers = []
    try:
        for _ in range(4):  # backlog 0 queues one; the rest wait in SYN retries (non-blocking)
            s = socket.socket()
            s.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                s.connect(("127.0.0.1", port))
            fillers.append(s)
        yield port
    finally:
        for s in fillers:
            s.close()
        lsock.close()


async def dial_without_a_task(p: Any, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A client that asks the portal `p` for 127.0.0.1:`port`, once the dial is under way as a
    DialStep (not a Task)."""
    r, w = await asyncio.open_connection("127.0.0.1", p.port)
    w.write(b"\x05\x01\x00")
    assert await r.readexactly(2) == b"\x05\x00"
    w.write(request(1, 1, b"\x7f\0\0\1", port))
    await async_wait_until(
        lambda: any(isinstance(c._connect_task, DialStep) for c in p.clients),
        what="dialing without a task",
    )
    return r, w


async def test_a_literal_dial_runs_without_a_task_and_relays() -> None:
    async with portal() as p, echo_server() as (eport, _):
        r, w = await asyncio.open_connection("127.0.0.1", p.port)
        w.write(b"\x05\x01\x00")
        assert await r.readexactly(2) == b"\x05\x00"
        w.write(request(1, 1, b"\x7f\0\0\1", eport))
        rep, _, _, _ = await asyncio.wait_for(read_reply(r), 10)
        assert rep == 0
        w.write(b"ping")
        assert await asyncio.wait_for(r.readexactly(4), 10) == b"ping"
        (client,) = p.clients
        assert type(client.upstream.get_protocol()).__name__ == "BufferedUpstream"  # type: ignore[union-attr]
        w.close()


async def test_a_literal_dial_that_times_out_answers_0x06_and_closes_its_socket() -> None:
    with full_listener() as port:
        async with portal(socks5_connect_timeout=0.3) as p:
            before = open_fds()
            r, w = await dial_without_a_task(p, port)
            rep, _, _, _ = await asyncio.wait_for(read_reply(r), 10)
            assert rep == 0x06
            w.close()
            # the client's socket, its transport's and the dial's: all gone again
            await async_wait_until(lambda: open_fds() <= before, what="the dial's socket closed")


async def test_a_client_that_leaves_while_a_literal_dial_is_under_way_ends_it() -> None:
    """Reset by the client mid-dial: the dial is cancelled (its socket closed) with the client."""
    with full_listener() as port:
        async with portal(socks5_connect_timeout=30) as p:
            before = open_fds()
            _r, w = await dial_without_a_task(p, port)
            (client,) = p.clients
            step = client._connect_task
            assert isinstance(step, DialStep)
            # gone at once (a reset: after a half-close the reply would still be awaited)
            linger = struct.pack("ii", 1, 0)
            w.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger)
            w.transport.abort()
            await async_wait_until(lambda: step.done(), what="the dial ended")
            await async_wait_until(lambda: open_fds() <= before, what="the dial's socket closed")
            assert not p.clients


async def test_a_dial_step_that_raises_past_its_handlers_is_counted_and_ends() -> None:
    """What a Task's exception handler would report: counted and logged (rate-limited), and the
    step is done, so the connection's close does not cancel it again."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[None] = loop.create_future()

    async def dial() -> None:
        await fut
        raise RuntimeError("a bug after the dial")

    before = DIAL_STEP_ERRORS.value
    step = DialStep(loop, dial())
    step.start()
    assert not step.done()
    fut.set_result(None)
    await async_wait_until(step.done, what="the step ended")
    assert DIAL_STEP_ERRORS.value == before + 1
    assert not step.cancel()
