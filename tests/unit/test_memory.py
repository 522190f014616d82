"""memory.trim gives freed heap back: measured on a fresh interpreter's RSS."""

from __future__ import annotations

import subprocess
import sys

from meshgate import memory
from tests.helpers import async_wait_until, require

CHILD = r"""
import re
from meshgate import memory

def rss_kib():
    return int(re.search(r"VmRSS:\s+(\d+)", open("/proc/self/status").read()).group(1))

# 1 KiB objects come from malloc's heap (above pymalloc's 512 B, below the mmap
# threshold); keeping the last one pins the heap top, so only a trim that
# releases pages in the middle of the heap can give the memory back.
held = [bytes(1000) for _ in range(80_000)]
keep = held[-1]
del held
before = rss_kib()
released = memory.trim()
after = rss_kib()
print(before, after, int(released))
"""


def test_trim_returns_freed_heap_to_the_kernel() -> None:
    require(memory._malloc_trim is not None, "a C library with malloc_trim (glibc)")
    argv = [sys.executable, "-c", CHILD]
    out = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=60)
    before, after, released = map(int, out.stdout.split())
    assert released == 1
    assert before - after > 40 * 1024, (before, after)  # ~80 MB freed, most of it given back


async def test_trimmer_runs_on_its_interval_and_stops() -> None:
    calls: list[int] = []
    t = memory.Trimmer(0.01)
    real = memory._malloc_trim
    memory._malloc_trim = lambda pad: calls.append(pad) or 0  # count the calls, keep the heap alone
    try:
        t.start()
        await async_wait_until(lambda: len(calls) >= 2, timeout=5)
        t.stop()
        assert t._handle is None
    finally:
        memory._malloc_trim = real


def test_zero_interval_is_off() -> None:
    t = memory.Trimmer(0)
    t.start()  # no running loop needed: nothing is scheduled
    assert t._handle is None
