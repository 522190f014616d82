"""Requests a node sends other nodes as mesh datagrams, and the answers that come back.

Both DNS features that ask another node (dns/mesh_dns.py, dns/mesh_odoh.py) send a datagram
with a u32 request id, resend it while no answer came (datagrams are unreliable: a loss costs
a share of the timeout, as DNS over UDP's retries do), and take an answer only for an id in
flight and only from the node that id was sent to. Bounded: at most `max_pending` in flight.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Container
from typing import Generic, TypeVar

from meshgate.dns.upstream_pool import UpstreamError
from meshgate.logs import RateLimitedLog
from meshgate.metrics import Counter

log = logging.getLogger("meshgate.dns.mesh")
_rlog = RateLimitedLog(log)

SENDS_PER_TIMEOUT = 3
T = TypeVar("T")


class MeshRequests(Generic[T]):
    def __init__(self, max_pending: int, dropped: Callable[[str], Counter], what: str) -> None:
        self.max_pending = max_pending
        self.dropped = dropped  # reason -> the feature's own drop counter
        self.what = what  # for errors and logs: "mesh DNS", "mesh ODoH"
        self._pending: dict[int, tuple[int, asyncio.Future[T]]] = {}
        self._next = 1

    def __len__(self) -> int:
        return len(self._pending)

    def new_id(self, taken: Container[int] = ()) -> int:
        """An id in flight nowhere: not here, and not in `taken` (ids the caller uses otherwise)."""
        rid = self._next
        while rid in self._pending or rid in taken:
            rid = rid % 0xFFFFFFFF + 1
        self._next = rid % 0xFFFFFFFF + 1
        return rid

    async def ask(self, node_id: int, rid: int, send: Callable[[], bool], timeout: float, url: str) -> T:
        """Send (by calling `send`) up to SENDS_PER_TIMEOUT times within `timeout` until the
        answer to `rid` arrives; UpstreamError when nothing could be sent, TimeoutError at the end."""
        if len(self._pending) >= self.max_pending:
            self.dropped("client_full").inc()
            raise UpstreamError(f"{url}: {self.max_pending} {self.what} requests in flight")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()
        self._pending[rid] = (node_id, fut)
        deadline = loop.time() + timeout
        try:
            for i in range(SENDS_PER_TIMEOUT):
                left = deadline - loop.time()
                if left <= 0:
                    break
                if not send():
                    raise UpstreamError(f"{url}: no mesh route to {node_id:08x}, or its link is congested")
                try:
                    return await asyncio.wait_for(asyncio.shield(fut), left / (SENDS_PER_TIMEOUT - i))
                except TimeoutError:
                    continue
            raise TimeoutError
        finally:
            del self._pending[rid]
            fut.cancel()

    def answer(self, src: int, rid: int, value: T) -> None:
        entry = self._pending.get(rid)
        if entry is None:
            self.dropped("stray").inc()  # late (a resend was answered already) or never asked
            return
        node_id, fut = entry
        if node_id != src:
            self.dropped("wrong_source").inc()
            _rlog.debug(f"{self.what}-src:{src}", "%s: answer from %08x to a request sent to %08x",
                        self.what, src, node_id)
            return
        if not fut.done():
            fut.set_result(value)

    def close(self) -> None:
        for _, fut in self._pending.values():
            fut.cancel()
