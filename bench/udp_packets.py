"""Per-packet CPU of a udp:// link session, in process (no sockets): what udp_session costs
to send and to receive one 1,472-byte packet, sealing and opening included.

    .venv/bin/python bench/udp_packets.py [--rounds 5] [--packets 40000] [--ab REF] [--json FILE]

Two sessions are joined in memory (handshake included); the sender queues work, the packets
it produces are handed to the receiver, whose ACKs go back. Workloads:

* `tun`: 32 KiB DATAGRAM frames (the TUN device's super-packets), each sealed as one record
  and cut into KIND_PIECE packets (a REF from before CAP_PIECES: DFRAG pieces in sealed
  packets), reassembled (TCP through TUN over udp:// links).
* `stream`: 16 KiB STREAM_DATA frames on the reliable channel (mesh streams, SOCKS5).

First table: what the AEAD alone costs per 1,414-byte record (one full udp:// packet's
plaintext), sealing and opening, AES-256-GCM beside ChaCha20-Poly1305.

Variants: `aes` and `chacha` (limits.aes_instructions yes / no on both ends: the
negotiated suite); with `--ab REF` also `REF` (udp_session as of git REF, offering AES where
REF negotiates it, else ChaCha20-Poly1305 as it then was), in a child process with REF's
package first on sys.path; ratios are then against it. Reported: µs of CPU per packet to
send (queue + packets_to_send) and to receive (the ACKs it sends back included), as process
CPU time; each run in a fresh child process. The receiver gets the packets as UDP GRO reads
(runs of up to 64 equal-size packets) through `receive_batch`, one call per read as link_udp
makes it; a REF from before receive_batch gets one `receive` call per packet (its adapter's
per-packet calls above the session, listener and link, are not counted).

`--bytecodes`: instead of CPU time, the bytecodes meshgate's own modules execute per packet
sent and received (sys.settrace opcode events; the AEAD and other C calls count as the one
bytecode that calls them). A count, the same under any load: on a shared machine where CPU
time per packet moves ±20% between runs, it shows what a change to the per-packet Python did.
"""

from __future__ import annotations

import argparse
import functools
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import Metrics, Runner, add_args, git_tree, report, selected

ROOT = Path(__file__).resolve().parent.parent


def measure(workload: str, packets: int, caps: int | None, bytecodes: bool = False) -> Metrics:
    """One run in this process with whatever `meshgate` sys.path finds first. `bytecodes`:
    count the bytecodes meshgate's own code executes per packet instead of timing it."""
    import inspect

    from meshgate.mesh.frames import DATAGRAM, PING, STREAM_DATA
    from meshgate.mesh.udp_session import UdpSession

    psk = bytes(range(32))
    got = [0]

    def on_frame(ftype: int, flags: int, hop: int, src: int, dst: int, body: memoryview) -> None:
        got[0] += len(body)

    extra: dict[str, Any] = {}
    if caps is not None and "caps" in inspect.signature(UdpSession).parameters:
        extra["caps"] = caps
    a = UdpSession(True, "bench", psk, on_frame, 1, window=4 << 20, **extra)
    b = UdpSession(False, "bench", psk, on_frame, 2, window=4 << 20, **extra)
    now = 0.0
    a.start(now)
    a.send_frame(PING, 0, 1, 0, 0, bytes(8))  # datagrams wait for the first reliable frame (the HELLO)
    for _ in range(6):
        for p in a.packets_to_send(now):
            b.receive(p, now)
        for p in b.packets_to_send(now):
            a.receive(p, now)
    assert a.established and b.established
    batch = hasattr(b, "receive_batch")  # a tree from before it: one receive call per packet
    body = bytes(32768) if workload == "tun" else bytes(4) + bytes(16384)
    ftype = DATAGRAM if workload == "tun" else STREAM_DATA
    send_cpu = recv_cpu = 0.0
    sent = 0
    clock = time.process_time
    ops = [0, 0]  # bytecodes while sending, while receiving
    phase = [0]
    if bytecodes:
        sys.settrace(_opcode_counter(ops, phase))
    while sent < packets:
        phase[0] = 0
        t0 = clock()
        for _ in range(8):
            a.send_frame(ftype, 0, 8, 1, 2, body)
        out = a.packets_to_send(now)
        reads = gro_reads(out) if batch else None
        t1 = clock()
        phase[0] = 1
        if reads is not None:
            for view, n, step in reads:  # what link_udp hands the session: one call per read
                b.receive_batch(view, n, step, now)
        else:
            for p in out:
                b.receive(p, now)
        acks = b.packets_to_send(now)
        t2 = clock()
        phase[0] = 0
        for p in acks:
            a.receive(p, now)
        t3 = clock()
        send_cpu += (t1 - t0) + (t3 - t2)
        recv_cpu += t2 - t1
        sent += len(out)
        now += 0.001
    sys.settrace(None)
    if got[0] < sent * 1000:
        raise RuntimeError(f"{got[0]} bytes delivered for {sent} packets")
    if bytecodes:
        return {"send_ops/pkt": ops[0] / sent, "recv_ops/pkt": ops[1] / sent}
    return {"send_us/pkt": send_cpu / sent * 1e6, "recv_us/pkt": recv_cpu / sent * 1e6,
            "delivered_MB": got[0] / 1e6}


def _opcode_counter(ops: list[int], phase: list[int]) -> Any:
    """A sys.settrace hook counting the bytecodes of frames of meshgate's modules into
    ops[phase[0]]: a count that does not move with the machine's load, unlike CPU time."""

    def opcodes(frame: Any, event: str, arg: Any) -> Any:
        if event == "opcode":
            ops[phase[0]] += 1
        return opcodes

    def calls(frame: Any, event: str, arg: Any) -> Any:
        if event == "call" and "/meshgate/" in frame.f_code.co_filename:
            frame.f_trace_opcodes = True
            return opcodes
        return None

    return calls


def aead_cost(name: str, n: int = 20000) -> Metrics:
    """µs of CPU to seal and to open one 1,414-byte record with one suite (frames.SendCipher /
    RecvCipher, as a udp:// link uses them)."""
    from meshgate.mesh.frames import RECORD, RecvCipher, SendCipher
    from meshgate.mesh.noise import AES_256_GCM, CHACHA20_POLY1305

    suite = AES_256_GCM if name == "aes" else CHACHA20_POLY1305
    key, plain = bytes(range(32)), bytes(1414)
    send, recv = SendCipher(key, suite=suite), RecvCipher(key, suite)
    clock = time.process_time
    t0 = clock()
    records = [send.seal(plain) for _ in range(n)]
    t1 = clock()
    for header, ct in records:
        _, epoch, counter = RECORD.unpack(header)
        recv.open(header, epoch, counter, memoryview(ct))
    t2 = clock()
    return {"seal_us": (t1 - t0) / n * 1e6, "open_us": (t2 - t1) / n * 1e6}


def gro_reads(packets: list[bytes]) -> list[tuple[memoryview, int, int]]:
    """The packets as UDP GRO would deliver them: runs of equal size (the last of a run may be
    shorter), at most 64 and 65,535 bytes a read, each run one buffer (built before the clock
    starts)."""
    reads = []
    i = 0
    while i < len(packets):
        size = len(packets[i])
        j = i + 1
        while (j < len(packets) and j - i < 64 and len(packets[j - 1]) == size and len(packets[j]) <= size
               and (j - i) * size + len(packets[j]) <= 65535):
            j += 1
        buf = b"".join(packets[i:j])
        reads.append((memoryview(buf), len(buf), size))
        i = j
    return reads


def in_child(tree: Path, workload: str, packets: int, caps: int, bytecodes: bool = False) -> Metrics:
    """One run in a fresh child process whose `meshgate` is the one under `tree` (every variant
    alike, so the checkout and REF start equal)."""
    # meshgate imported before bench.udp_packets, which puts the checkout first on sys.path
    # (before this, a REF's rows measured the checkout)
    code = (f"import sys, json; sys.path.insert(0, {str(tree)!r}); import meshgate; "
            f"sys.path.insert(1, {str(ROOT)!r}); from bench.udp_packets import measure; "
            f"assert meshgate.__file__.startswith({str(tree)!r}), meshgate.__file__; "
            f"print(json.dumps(measure({workload!r}, {packets}, {caps}, {bytecodes})))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tree)
    result: Metrics = json.loads(r.stdout.strip().splitlines()[-1])
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(ap)
    ap.add_argument("--packets", type=int, default=40000, help="packets per measurement")
    ap.add_argument("--ab", metavar="REF", help="also udp_session as of git REF (child process)")
    ap.add_argument("--bytecodes", action="store_true",
                    help="count meshgate's bytecodes per packet (sys.settrace) instead of CPU time")
    args = ap.parse_args()
    bc = args.bytecodes
    from meshgate.mesh.noise import CAP_AES

    tree = git_tree(args.ab, tempfile.mkdtemp(prefix="meshgate-bench-udp-")) if args.ab else None
    runners: list[Runner] = []
    if not bc:
        r = Runner("AEAD per 1,414-byte record (seal, open)", rounds=args.rounds, baseline="chacha")
        for name in ("aes", "chacha"):
            r.add(name, functools.partial(aead_cost, name))
        r.run()
        runners.append(r)
    for workload in ("tun", "stream"):
        baseline = args.ab if args.ab else "chacha"
        r = Runner(f"udp session per packet: {workload}", rounds=args.rounds, baseline=baseline)
        variants: list[tuple[str, Any]] = [
            ("aes", lambda w=workload: in_child(ROOT, w, args.packets, CAP_AES, bc)),
            ("chacha", lambda w=workload: in_child(ROOT, w, args.packets, 0, bc)),
        ]
        if tree is not None:
            variants.append((args.ab, lambda w=workload: in_child(tree, w, args.packets, CAP_AES, bc)))
        for name, fn in variants:
            if selected(args, name) or name == baseline:
                r.add(name, fn)
        r.run()
        runners.append(r)
    report(runners, json_path=args.json, ratio_metrics=["send_us/pkt", "recv_us/pkt", "seal_us", "open_us",
                                                        "send_ops/pkt", "recv_ops/pkt"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
