"""What the network-secret KDF costs: the node once per start, an offline guesser per guess.

Each variant runs in a fresh interpreter (so peak RSS is the KDF's own), alternating per round:
`argon2id` is the PSK derivation of protocol version 2 (meshgate.mesh.frames.derive_psk);
`hkdf-v1` is version 1's HKDF-SHA256, for the ratio an attacker who answers one dial now pays.
Prints wall and CPU milliseconds per derivation and the peak-RSS growth it causes (medians);
the ratio is the median of per-round ratios against hkdf-v1.

    .venv/bin/python bench/psk.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = r"""
import json, resource, sys, time
kind, n = sys.argv[1], int(sys.argv[2])
if kind == "argon2id":
    from meshgate.mesh.frames import derive_psk
    def derive(i):
        return derive_psk.__wrapped__("bench-net", f"guess-{i}")  # uncached: one guess each
else:
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF
    def derive(i):
        return HKDF(algorithm=hashes.SHA256(), length=32, salt=b"bench-net",
                    info=b"meshgate mesh psk v1").derive(f"guess-{i}".encode())
rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # modules loaded, nothing derived yet
derive(-1)  # first use outside the timing
w0, c0 = time.perf_counter(), time.process_time()
for i in range(n):
    derive(i)
w1, c1 = time.perf_counter(), time.process_time()
rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"wall_ms": (w1 - w0) * 1e3 / n, "cpu_ms": (c1 - c0) * 1e3 / n,
                  "peak_rss_growth_mib": (rss1 - rss0) / 1024}))
"""

# derivations per measurement: enough for a stable mean, bounded in time
COUNTS = {"argon2id": 20, "hkdf-v1": 20000}


def measure(kind: str) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, kind, str(COUNTS[kind])], capture_output=True, text=True,
        check=True, cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, timeout=300,
    ).stdout
    result: dict[str, float] = json.loads(out)
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    kinds = ["argon2id", "hkdf-v1"]
    rows: dict[str, list[dict[str, float]]] = {k: [] for k in kinds}
    ratios: list[float] = []
    for r in range(args.rounds):
        order = kinds if r % 2 == 0 else kinds[::-1]
        got = {k: measure(k) for k in order}
        for k in kinds:
            rows[k].append(got[k])
        ratios.append(got["argon2id"]["cpu_ms"] / got["hkdf-v1"]["cpu_ms"])
    print(f"{'variant':10} {'wall ms':>10} {'cpu ms':>10} {'peak RSS +MiB':>14}   (medians of {args.rounds})")
    for k in kinds:
        med = {m: statistics.median(x[m] for x in rows[k]) for m in rows[k][0]}
        print(f"{k:10} {med['wall_ms']:10.4f} {med['cpu_ms']:10.4f} {med['peak_rss_growth_mib']:14.1f}")
    print(f"CPU per guess, argon2id / hkdf-v1: {statistics.median(ratios):,.0f}x (median of paired rounds)")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "ratios": ratios}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
