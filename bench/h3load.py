"""A DoH-over-HTTP/3 load client for bench/dns.py (h2load here has no QUIC): aioquic's h3
client, C connections each keeping M GET requests in flight, N requests in all (the requests
of one loop tick leave in one transmit, so they share packets), run in its own process so the
server's CPU is measured apart from it. Prints one JSON line: requests that got
a 200, failures, wall seconds.

    .venv/bin/python bench/h3load.py PORT N [--conns 4] [--streams 16] [--path /dns-query?dns=...]

It is Python: on a 2-core machine the client is likely the limit of the queries/s it reports,
not the server (bench/dns.py says so beside the row).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import ssl
import time
from typing import Any

from aioquic.asyncio.client import connect
from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.h3.connection import H3Connection
from aioquic.h3.events import DataReceived, HeadersReceived
from aioquic.quic import events
from aioquic.quic.configuration import QuicConfiguration


class Client(QuicConnectionProtocol):
    def __init__(self, *a: Any, **k: Any) -> None:
        super().__init__(*a, **k)
        self.h3 = H3Connection(self._quic)
        self.waiting: dict[int, asyncio.Future[int]] = {}
        self.status: dict[int, int] = {}
        self.scheduled = False

    def _flush(self) -> None:
        self.scheduled = False
        self.transmit()

    def quic_event_received(self, event: events.QuicEvent) -> None:
        if isinstance(event, events.ConnectionTerminated):
            for pending in self.waiting.values():
                if not pending.done():
                    pending.set_result(0)
        for ev in self.h3.handle_event(event):
            if isinstance(ev, HeadersReceived):
                self.status[ev.stream_id] = int(dict(ev.headers).get(b":status", b"0"))
            if isinstance(ev, HeadersReceived | DataReceived) and ev.stream_ended:
                f = self.waiting.get(ev.stream_id)
                if f is not None and not f.done():
                    del self.waiting[ev.stream_id]
                    f.set_result(self.status.pop(ev.stream_id, 0))

    async def get(self, path: bytes) -> int:
        sid = self._quic.get_next_available_stream_id()
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.waiting[sid] = fut
        self.h3.send_headers(sid, [(b":method", b"GET"), (b":scheme", b"https"),
                                   (b":authority", b"localhost"), (b":path", path)], end_stream=True)
        # Requests made in one loop tick leave together (shared packets), as a browser's would.
        if not self.scheduled:
            self.scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)
        return await fut


async def run(port: int, n: int, conns: int, streams: int, path: bytes) -> dict[str, float]:
    cfg = QuicConfiguration(is_client=True, alpn_protocols=["h3"])
    cfg.verify_mode = ssl.CERT_NONE
    left = n
    ok = failed = 0

    async def worker(c: Client) -> None:
        nonlocal left, ok, failed
        while left > 0:
            left -= 1
            if await c.get(path) == 200:
                ok += 1
            else:
                failed += 1

    clients = [connect("127.0.0.1", port, configuration=cfg, create_protocol=Client) for _ in range(conns)]
    opened = [await c.__aenter__() for c in clients]
    t0 = time.perf_counter()
    await asyncio.gather(*(worker(c) for c in opened for _ in range(streams)))  # type: ignore[arg-type]
    seconds = time.perf_counter() - t0
    for c in clients:
        await c.__aexit__(None, None, None)
    return {"ok": ok, "failed": failed, "seconds": seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("port", type=int)
    ap.add_argument("n", type=int)
    ap.add_argument("--conns", type=int, default=4)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--path", required=True)
    a = ap.parse_args()
    print(json.dumps(asyncio.run(run(a.port, a.n, a.conns, a.streams, a.path.encode()))))


if __name__ == "__main__":
    main()
