"""ODoH benchmark: client -> proxy -> target on loopback, beside plain DoH to the same target.

Two `meshgate run` processes (uvloop): a target (ODoH target listener with
`allow_doh`, so plain DoH is served by the same listener and pipeline) and a
proxy. One in-process load generator drives each variant with the same
concurrency over one HTTP/2 connection, in alternating rounds
(bench/common.py):

* doh          plain DoH POST to the target (the baseline);
* odoh-direct  ODoH straight to the target (encryption cost, no proxy hop);
* odoh-proxy   ODoH through the proxy to the target (the real deployment).

Per round: queries/s, p50/p99 latency (ms, client-observed, including the
client's own seal/open), and CPU microseconds per query in the target and
in the proxy process (from /proc). Queries are for a local record, so the
pipeline answers from memory and the figures are protocol cost, not
upstream latency; nothing leaves loopback.

A second table measures the ODoH crypto in process: the target's work per
query (HPKE open of the query + seal of the response into a buffer) and the
client's (seal the query + open the response), in CPU microseconds.

    .venv/bin/python bench/odoh.py [--queries N] [--concurrency C] [--rounds R] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

# bench/ holds dns.py, which would shadow dnspython's `dns` if bench/ stayed on
# sys.path (it is sys.path[0] when this runs as a script): swap it for the root.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

from bench.common import (  # noqa: E402
    Metrics,
    Peer,
    Runner,
    add_args,
    free_port,
    measure_in_process,
    report,
    selected,
)
from meshgate.dns import odoh  # noqa: E402
from meshgate.dns.h2client import H2ClientConnection, client_ssl_context, connect  # noqa: E402
from meshgate.tls import ensure_self_signed  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
NAME = "bench-name.example"
MEDIA = odoh.MEDIA_TYPE.encode()


def _query() -> bytes:
    import dns.message

    q = dns.message.make_query(NAME, "A", use_edns=0)
    q.id = 0
    return q.to_wire()


def _write_config(tmp: Path, role: str, port: int, cert: Path, key: Path, extra: str) -> Path:
    path = tmp / f"{role}.toml"
    path.write_text(
        f'log_level = "warning"\n[node]\nname = "{role}"\nstate_dir = "{tmp / role}"\n'
        f'[socks5]\nenable = false\n[admin]\nenable = false\n'
        f'[dns]\nupstreams = ["udp://127.0.0.1:9"]\nrecords = {{ "{NAME}." = "10.1.2.3" }}\n'
        f'[[dns.listener]]\nprotocol = "odoh"\nlisten = "127.0.0.1:{port}"\n'
        f'cert = "{cert}"\nkey = "{key}"\n{extra}'
    )
    return path


Request = Callable[[H2ClientConnection], Awaitable[None]]


async def _drive(port: int, cafile: Path, make: Callable[[], Request], n: int, concurrency: int
                 ) -> tuple[float, list[float]]:
    conn = await connect("127.0.0.1", port, client_ssl_context(cafile=str(cafile)), "localhost", 10,
                         max_streams=concurrency)
    lat: list[float] = []
    per_worker = n // concurrency

    async def worker() -> None:
        req = make()
        for _ in range(per_worker):
            t0 = time.perf_counter()
            await req(conn)
            lat.append(time.perf_counter() - t0)

    # Warm-up (TLS, caches, first config) outside the timed part.
    await make()(conn)
    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    conn.close()
    return wall, lat


async def _post(conn: H2ClientConnection, path: bytes, ctype: bytes, body: bytes) -> bytes:
    _, fut = conn.request(b"POST", b"localhost", path, [(b"content-type", ctype), (b"accept", ctype)], body)
    r = await asyncio.wait_for(fut, 10)
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status} {r.header(b'proxy-status')!r}")
    return r.body


def doh_request() -> Request:
    q = _query()

    async def req(conn: H2ClientConnection) -> None:
        await _post(conn, b"/dns-query", b"application/dns-message", q)

    return req


def odoh_request(config: odoh.ObliviousDoHConfigContents, path: bytes) -> Callable[[], Request]:
    def make() -> Request:
        q = _query()

        async def req(conn: H2ClientConnection) -> None:
            sealed, ctx = odoh.seal_query(config, q, odoh_padding(len(q)))
            ctx.open_response(await _post(conn, path, MEDIA, sealed))

        return req

    return make


def odoh_padding(n: int) -> int:
    from meshgate.dns.odoh_client import padding_for

    return padding_for(n)


async def _fetch_config(port: int, cafile: Path) -> odoh.ObliviousDoHConfigContents:
    conn = await connect("127.0.0.1", port, client_ssl_context(cafile=str(cafile)), "localhost", 10)
    _, fut = conn.request(b"GET", b"localhost", odoh.CONFIGS_PATH.encode(), [], b"")
    r = await asyncio.wait_for(fut, 10)
    conn.close()
    return odoh.decode_configs(r.body)[0]


def _variant(port: int, cafile: Path, make: Callable[[], Request], n: int, conc: int,
             peers: dict[str, Peer]) -> Callable[[], Metrics]:
    def run() -> Metrics:
        cpu0 = {k: p.cpu_seconds() for k, p in peers.items()}
        wall, lat = asyncio.run(_drive(port, cafile, make, n, conc))
        done = len(lat)
        lat.sort()
        out: Metrics = {
            "q/s": done / wall,
            "p50_ms": statistics.median(lat) * 1e3,
            "p99_ms": lat[min(done - 1, int(done * 0.99))] * 1e3,
        }
        for k, p in peers.items():
            out[f"{k}_cpu_us/q"] = (p.cpu_seconds() - cpu0[k]) / done * 1e6
        return out

    return run


def crypto_runner(rounds: int, ops: int) -> Runner:
    key = odoh.TargetKey.generate()
    keys = odoh.TargetKeys(key)
    q = _query()
    answer = q[:2] + b"\x81\x80" + q[4:]  # a same-sized stand-in answer
    sealed = [odoh.seal_query(key.config, q, odoh_padding(len(q)))[0] for _ in range(ops)]
    out = bytearray(4096)

    def target_side() -> None:
        mv = memoryview(out)
        for s in sealed:
            _, ctx = keys.open_query(s)
            ctx.seal_response_into(mv, answer, 468 - 4 - len(answer))

    pairs = [odoh.seal_query(key.config, q)[1] for _ in range(ops)]
    responses = [c.seal_response(answer) for c in pairs]

    def client_side() -> None:
        for ctx, resp in zip(pairs, responses, strict=True):
            odoh.seal_query(key.config, q, odoh_padding(len(q)))
            ctx.open_response(resp)

    r = Runner("ODoH crypto per query, in process (HPKE + AES-GCM)", rounds=rounds)
    r.add("target: open query + seal answer", lambda: measure_in_process(target_side, ops, False))
    r.add("client: seal query + open answer", lambda: measure_in_process(client_side, ops, False))
    return r


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(p)
    p.add_argument("--queries", type=int, default=4000, help="queries per round and variant")
    p.add_argument("--concurrency", type=int, default=32, help="queries in flight")
    p.add_argument("--crypto-ops", type=int, default=2000)
    args = p.parse_args()

    with tempfile.TemporaryDirectory(prefix="meshgate-bench-odoh-") as td:
        tmp = Path(td)
        cert, key = ensure_self_signed(tmp / "pki")
        tport, pport = free_port(), free_port()
        tcfg = _write_config(tmp, "target", tport, cert, key, 'mode = "target"\nallow_doh = true\n')
        pcfg = _write_config(tmp, "proxy", pport, cert, key,
                             f'mode = "proxy"\ntargets = ["localhost:{tport}"]\n')
        exe = [sys.executable, "-m", "meshgate", "run", "-c"]
        env = {"PYTHONPATH": str(ROOT), "SSL_CERT_FILE": str(cert)}
        target = Peer("target", [*exe, str(tcfg)], port=tport, env=env, cwd=str(ROOT))
        proxy = Peer("proxy", [*exe, str(pcfg)], port=pport, env=env, cwd=str(ROOT))
        with target, proxy:
            config = asyncio.run(_fetch_config(tport, cert))
            n, c = args.queries, args.concurrency
            both = {"target": target, "proxy": proxy}
            via = f"/dns-query?targethost=localhost:{tport}&targetpath=/dns-query".encode()
            r = Runner(f"ODoH vs DoH on loopback ({n} queries x {c} in flight per round)",
                       rounds=args.rounds, baseline="doh")
            if selected(args, "doh"):
                r.add("doh", _variant(tport, cert, doh_request, n, c, both))
            if selected(args, "odoh-direct"):
                r.add("odoh-direct", _variant(tport, cert, odoh_request(config, b"/dns-query"), n, c, both))
            if selected(args, "odoh-proxy"):
                r.add("odoh-proxy", _variant(pport, cert, odoh_request(config, via), n, c, both))
            r.run()
            trss = target.peak_rss_kib()
            prss = proxy.peak_rss_kib()
    crypto = crypto_runner(args.rounds, args.crypto_ops)
    crypto.run()
    report([r, crypto], json_path=args.json, ratio_metrics=["q/s", "p50_ms", "target_cpu_us/q"])
    print(f"peak RSS: target {trss / 1024:.1f} MiB, proxy {prss / 1024:.1f} MiB")


if __name__ == "__main__":
    main()
