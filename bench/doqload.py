"""A DoQ (RFC 9250) load client for bench/dns.py, from a client not written here: dnspython's
asyncio DoQ (dns.asyncquery.quic over dns.quic's connections, aioquic underneath), C connections
each keeping M queries in flight, N queries in all, in a process of its own so the server's CPU
is measured apart from it. Prints one JSON line: answered queries, failures, wall seconds, the
client's CPU seconds.

    .venv/bin/python bench/doqload.py PORT N [--conns 4] [--streams 16] [--name www.test]

It is Python: on a 2-core machine the client is likely the limit of the q/s it reports, not
the server (the server's CPU per query is the figure to compare).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import ssl
import sys
import time
from pathlib import Path

# bench/ holds dns.py: with it on sys.path, `import dns` would be that script, not dnspython.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

import dns.asyncquery  # noqa: E402
import dns.message  # noqa: E402
import dns.quic  # noqa: E402


async def run(port: int, n: int, conns: int, streams: int, name: str) -> dict[str, float]:
    manager = dns.quic.AsyncioQuicManager(verify_mode=ssl.CERT_NONE, server_name="localhost")
    connections = [manager.connect("127.0.0.1", port) for _ in range(conns)]
    left = [n]
    ok = [0]
    failed = [0]

    async def worker(conn: dns.quic.AsyncQuicConnection) -> None:
        while left[0] > 0:
            left[0] -= 1
            q = dns.message.make_query(name, "A")
            try:
                r = await dns.asyncquery.quic(q, "127.0.0.1", timeout=5, port=port, connection=conn)
            except Exception:
                failed[0] += 1
                continue
            if r.answer:
                ok[0] += 1
            else:
                failed[0] += 1

    # one query per connection first: the handshakes are not part of the timed run
    await asyncio.gather(*(dns.asyncquery.quic(dns.message.make_query(name, "A"), "127.0.0.1", timeout=5,
                                               port=port, connection=c) for c in connections))
    t0, cpu0 = time.perf_counter(), time.process_time()
    await asyncio.gather(*(worker(c) for c in connections for _ in range(streams)))
    seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    for c in connections:
        await c.close()
    return {"ok": ok[0], "failed": failed[0], "seconds": seconds, "client_cpu_s": cpu}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("port", type=int)
    ap.add_argument("n", type=int)
    ap.add_argument("--conns", type=int, default=4)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--name", default="www.test")
    a = ap.parse_args()
    print(json.dumps(asyncio.run(run(a.port, a.n, a.conns, a.streams, a.name))))


if __name__ == "__main__":
    main()
