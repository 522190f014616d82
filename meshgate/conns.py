"""What every listener does with its connections: a cap on how many are live, and an idle timer.

`admit(conns, conn, limit)` adds a new connection to its listener's live set unless `limit`
are already there (the caller counts and logs a refusal its own way, then aborts).

`IdleTimer` closes a connection once nothing happened on it for `timeout` seconds and it has
nothing in flight: one timer handle per connection, re-armed only when it fires (never per read
or per query), so marking activity (`touch()`) is one clock read and one store. When it fires
early (there was activity), it sleeps again for what is left of the period, at least
MIN_REARM seconds.

A ground module: asyncio only, no imports from the rest of meshgate.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

MIN_REARM = 0.05

T = TypeVar("T")


def admit(conns: set[T], conn: T, limit: int) -> bool:
    """Add `conn` to `conns` unless `limit` connections are live; False means refuse it."""
    if len(conns) >= limit:
        return False
    conns.add(conn)
    return True


class IdleTimer:
    """Calls `expire()` once `timeout` seconds passed since the last `touch()` (or `start()`)
    while `busy()` is false; a busy connection is checked again a period later."""

    __slots__ = ("_busy", "_expire", "_handle", "_loop", "last", "timeout")

    def __init__(self, loop: asyncio.AbstractEventLoop, timeout: float, expire: Callable[[], None],
                 busy: Callable[[], object] | None = None) -> None:
        self._loop = loop
        self.timeout = timeout
        self._expire = expire
        self._busy = busy
        self._handle: asyncio.TimerHandle | None = None
        self.last = loop.time()

    def start(self) -> None:
        """Arm the timer (the connection is up): idle from now."""
        self.last = self._loop.time()
        if self._handle is None:
            self._handle = self._loop.call_later(self.timeout, self._fire)

    def touch(self) -> None:
        """Activity: the idle period starts again (no timer work)."""
        self.last = self._loop.time()

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _fire(self) -> None:
        self._handle = None
        idle = self._loop.time() - self.last
        if idle >= self.timeout and (self._busy is None or not self._busy()):
            self._expire()
            return
        self._handle = self._loop.call_later(max(self.timeout - idle, MIN_REARM), self._fire)
