"""Give freed heap back to the kernel after a burst of traffic.

glibc keeps freed memory in its arenas: after a bulk transfer or a burst of
connections the process holds its peak RSS long after the buffers are gone
(glibc raises its mmap threshold dynamically, so later large buffers come
from the heap and are not unmapped on free). `malloc_trim(0)` releases the
free pages, including those in the middle of the heap. A node calls it on a
timer (`limits.memory_trim_interval`); with a quiet heap it is a cheap walk of
the free lists. On a libc without malloc_trim (musl, macOS) it does nothing.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
from collections.abc import Callable

log = logging.getLogger("meshgate.memory")


def _load_trim() -> Callable[[int], int] | None:
    # The symbols already loaded into this process (libc among them): no find_library, which
    # would run ldconfig in a subprocess at every start.
    try:
        fn = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


_malloc_trim = _load_trim()


def trim() -> bool:
    """Release free heap pages to the kernel; True if the C library released any."""
    return bool(_malloc_trim(0)) if _malloc_trim is not None else False


class Trimmer:
    """Calls `trim()` every `interval` seconds on the running loop (0 = never)."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self._handle: asyncio.TimerHandle | None = None

    def start(self) -> None:
        if self.interval > 0 and _malloc_trim is not None:
            self._handle = asyncio.get_running_loop().call_later(self.interval, self._tick)

    def _tick(self) -> None:
        trim()
        self._handle = asyncio.get_running_loop().call_later(self.interval, self._tick)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
