"""Three `meshgate run` processes over TCP on loopback; a fourth with a wrong secret never joins."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

from tests.helpers import free_port, wait_until

ROOT = Path(__file__).resolve().parents[2]


def _config(tmp: Path, name: str, ip: str, mesh_port: int, admin: int, peers: list[int], secret: str) -> Path:
    peer_list = ", ".join(f'"tcp://127.0.0.1:{p}"' for p in peers)
    path = tmp / f"{name}.toml"
    path.write_text(
        f"""
[node]
name = "{name}"
network = "proc-test"
secret = "{secret}"
ipv4 = "{ip}/24"
state_dir = "{tmp / name}"
[mesh]
listen = ["tcp://127.0.0.1:{mesh_port}"]
peers = [{peer_list}]
[socks5]
enable = false
[admin]
listen = "127.0.0.1:{admin}"
"""
    )
    return path


def _get(admin: int, path: str) -> Any:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{admin}{path}", timeout=2) as r:
            return json.loads(r.read())
    except OSError:
        return None


def test_three_processes_converge_and_a_wrong_secret_never_appears(tmp_path: Path) -> None:
    mesh = [free_port() for _ in range(4)]
    admin = [free_port() for _ in range(4)]
    good = "process test secret"
    specs = [
        ("a", "10.77.0.1", [], good),
        ("b", "10.77.0.2", [mesh[0]], good),
        ("c", "10.77.0.3", [mesh[1]], good),  # a-b-c line: c reaches a only through b
        ("evil", "10.77.0.4", [mesh[0], mesh[1], mesh[2]], "not the secret"),
    ]
    procs = []
    try:
        for i, (name, ip, peers, secret) in enumerate(specs):
            cfg = _config(tmp_path, name, ip, mesh[i], admin[i], peers, secret)
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "meshgate", "run", "-c", str(cfg), "--log-level", "warning"],
                    cwd=ROOT,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                )
            )

        def names(i: int) -> set[str]:
            routes = _get(admin[i], "/routes")
            return {r["name"] for r in routes} if routes else set()

        wait_until(lambda: all(names(i) == {"a", "b", "c"} for i in range(3)), 60, "a, b and c to converge")
        c_routes = {r["name"]: r for r in _get(admin[2], "/routes")}
        assert c_routes["a"]["hops"] == 2 and c_routes["a"]["next_hop"] == c_routes["b"]["id"]
        # the wrong-secret node has tried every peer by now (it keeps retrying with backoff)
        wait_until(
            lambda: (
                "failed_closed"
                in urllib.request.urlopen(f"http://127.0.0.1:{admin[3]}/metrics").read().decode()
            ),
            60,
            "the evil node's failed handshakes",
        )
        for i in range(3):
            assert "evil" not in names(i)
        assert names(3) == {"evil"}
        assert _get(admin[3], "/peers") == []
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
            assert p.stderr is not None
            p.stderr.close()
    assert all(p.returncode == 0 for p in procs), [p.returncode for p in procs]
