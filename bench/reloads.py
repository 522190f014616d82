"""Config reloads for the portal benchmark (bench/socks.py): the meshgate config it runs, in two
versions that differ in live keys, and a thread that makes the node reload, timing each one.

Each reload rewrites the file with the other version and POSTs /reload to the node's admin API
(loopback, no token: allowed there), so every one re-reads, validates, diffs and applies a
change (`dns.records`, `exit.deny`), as `meshgate reload` would. The time is the client's:
request to answer, the admin API's HTTP included.
"""

from __future__ import annotations

import http.client
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any


def meshgate_conf(socks: int, http: int, admin: int, flip: int, state_dir: Path) -> str:
    """SOCKS5, the HTTP proxy and the admin API on these ports; `flip` 0 or 1 picks the version.
    `state_dir` is the node's own: the default one may be held by another node on this machine."""
    records = ", ".join(f'"host{i}.bench.test" = "192.0.2.{(i + flip) % 250 + 1}"' for i in range(64))
    deny = '"198.51.100.0/24"' if flip else '"203.0.113.0/24"'
    return (
        f'log_level = "warning"\n[node]\nstate_dir = "{state_dir}"\n'
        f'[socks5]\nlisten = "127.0.0.1:{socks}"\nmax_clients = 4096\n'
        f'[http_proxy]\nenable = true\nlisten = "127.0.0.1:{http}"\n'
        f"[exit]\ndeny = [{deny}]\n"
        f"[dns]\nrecords = {{ {records} }}\n"
        f'[admin]\nlisten = "127.0.0.1:{admin}"\n'
    )


def reload_once(conf: Path, ports: tuple[int, int, int], flip: int) -> float:
    """Rewrite `conf` as version `flip`, make the node reload it; milliseconds, or an error."""
    conf.write_text(meshgate_conf(*ports, flip, conf.parent / "state"))
    t0 = time.perf_counter()
    c = http.client.HTTPConnection("127.0.0.1", ports[2], timeout=10)
    try:
        c.request("POST", "/reload", headers={"Host": "127.0.0.1"})
        body = json.loads(c.getresponse().read())
    finally:
        c.close()
    ms = (time.perf_counter() - t0) * 1e3
    if not body.get("applied"):
        raise RuntimeError(f"reload not applied: {body.get('message')}")
    return ms


class Reloader:
    """Reloads every `every` seconds until stopped, from a process of its own (a thread in the
    benchmark client would take that client's CPU and GIL, and the client's slowdown would read
    as the node's); `times` in ms once stopped."""

    def __init__(self, conf: Path, ports: tuple[int, int, int], every: float) -> None:
        self.argv = [sys.executable, __file__, str(conf), *map(str, ports), str(every)]
        self.times: list[float] = []
        self.error = ""
        self._proc: subprocess.Popen[str] | None = None

    def __enter__(self) -> Reloader:
        self._proc = subprocess.Popen(self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self._proc.stdout is not None
        self._proc.stdout.readline()  # "ready": its start-up is not part of the measurement
        return self

    def __exit__(self, *exc: object) -> None:
        proc = self._proc
        assert proc is not None and proc.stdin is not None and proc.stdout is not None
        proc.stdin.close()  # its signal to stop, answer, and leave the node as it started
        out = proc.stdout.read()
        proc.wait(30)
        got = json.loads(out or "{}")
        self.times, self.error = got.get("times", []), got.get("error", "no answer from the reloader")

    def median_ms(self) -> float:
        if self.error:
            raise RuntimeError(f"reload failed: {self.error}")
        return statistics.median(self.times) if self.times else float("nan")


def _reload_loop(conf: Path, ports: tuple[int, int, int], every: float) -> dict[str, Any]:
    """The reloader process: reload every `every` s until stdin closes; then back to version 0."""
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    print("ready", flush=True)
    times: list[float] = []
    flip = 1
    try:
        while not stop.wait(every):
            times.append(reload_once(conf, ports, flip))
            flip ^= 1
        if flip == 0:  # the node runs version 1: back to the one it started with
            reload_once(conf, ports, 0)
    except (OSError, RuntimeError, ValueError) as e:
        return {"times": times, "error": str(e)}
    return {"times": times, "error": ""}


if __name__ == "__main__":
    conf_arg, *port_args, every_arg = sys.argv[1:6]
    socks, http_port, admin = map(int, port_args)
    print(json.dumps(_reload_loop(Path(conf_arg), (socks, http_port, admin), float(every_arg))))
