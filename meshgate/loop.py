"""The event loop a meshgate process runs on: uvloop unless asked otherwise.

One factory for the node (`meshgate run --loop`) and its DNS worker
processes, so both run the loop the config names.
"""

from __future__ import annotations

import asyncio


def new_loop(kind: str) -> asyncio.AbstractEventLoop:
    """A new loop of `kind` ("uvloop" or "asyncio"); asyncio's when uvloop is not installed."""
    if kind == "uvloop":
        try:
            import uvloop  # optional: the standard loop works everywhere, just slower
        except ImportError:
            pass
        else:
            return uvloop.new_event_loop()
    return asyncio.new_event_loop()
