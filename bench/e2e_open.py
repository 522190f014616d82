"""What an end-to-end session costs a new connection through two hops (issue #14).

In one process, A - B - C on ring links (no sockets between nodes, so the mesh's own CPU is
what is measured); C serves an echo on its loopback. Each connection: A opens a mesh stream to
it, sends one byte, reads it back, closes. `warm`: the A-C end-to-end session (Noise IK,
mesh/e2e.py) is already up, as for every connection after the first between two nodes;
`fresh`: both ends drop it before each connection, so every one pays the handshake (two
X25519 operations more per side, one extra relayed round trip before the OPEN goes).
Alternating rounds, medians: connections/s and CPU µs per connection (all three nodes, one
core), paired ratios against warm.

    .venv/bin/python bench/e2e_open.py [--rounds 5] [--count 300]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import Metrics, Runner, add_args, report, self_cpu_seconds
from meshgate.mesh.service import MeshService
from tests.mesh_testing import Collector, ring_line, stop_all


async def _echo_server() -> tuple[asyncio.Server, int]:
    async def echo(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while data := await r.read(65536):
            w.write(data)
            await w.drain()
        w.close()

    srv = await asyncio.start_server(echo, "127.0.0.1", 0)
    return srv, srv.sockets[0].getsockname()[1]


async def _connections(a: MeshService, c: MeshService, port: int, count: int, fresh: bool) -> Metrics:
    cpu0, t0 = self_cpu_seconds(), time.perf_counter()
    for _ in range(count):
        if fresh:
            a.e2e.drop(c.node_id)
            c.e2e.drop(a.node_id)
        transport, proto = await a.open_stream(c.node_id, "127.0.0.1", port, Collector)
        assert isinstance(proto, Collector) and proto.transport is not None
        proto.transport.write(b"x")
        while not proto.buf:
            await asyncio.sleep(0)
        transport.close()
    wall, cpu = time.perf_counter() - t0, self_cpu_seconds() - cpu0
    return {"conn/s": count / wall, "cpu us/conn": cpu / count * 1e6}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(p, rounds=5)
    p.add_argument("--count", type=int, default=300)
    args = p.parse_args()

    async def bench() -> None:
        nodes = await ring_line()
        a, _b, c = nodes
        srv, port = await _echo_server()
        loop = asyncio.get_running_loop()
        try:
            await _connections(a, c, port, 20, fresh=False)  # warm-up
            r = Runner("e2e-open", rounds=args.rounds, baseline="warm")
            for name, fresh in (("warm", False), ("fresh", True)):
                r.add(name, lambda fresh=fresh: asyncio.run_coroutine_threadsafe(  # type: ignore[misc]
                    _connections(a, c, port, args.count, fresh), loop).result())
            await loop.run_in_executor(None, r.run)
            report([r], json_path=args.json, ratio_metrics=["conn/s", "cpu us/conn"])
        finally:
            srv.close()
            await stop_all(nodes)

    asyncio.run(bench())


if __name__ == "__main__":
    main()
