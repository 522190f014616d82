"""`meshgate run` as a subprocess: SIGHUP and `meshgate reload` re-read its config file."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

from tests.helpers import free_port, wait_until

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def toml(tmp: Path, admin: int, socks: int, users: str, extra: str = "") -> str:
    return (f'[node]\nname = "h"\nstate_dir = "{tmp / "state"}"\n'
            f'[socks5]\nlisten = "127.0.0.1:{socks}"\nusers = [{users}]\n'
            f'[admin]\nlisten = "127.0.0.1:{admin}"\n{extra}')


def status(port: int) -> dict[str, Any] | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=5) as r:
            out: dict[str, Any] = json.loads(r.read())
            return out
    except OSError:
        return None


def auth(port: int) -> str | None:
    st = status(port)
    return None if st is None else str(st["services"]["socks5"]["auth"])


def reload_cli(port: int, *extra: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "meshgate", "reload", "--admin", f"127.0.0.1:{port}", *extra]
    return subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=30)


def test_sighup_and_meshgate_reload(tmp_path: Path) -> None:
    admin, socks = free_port(), free_port()
    cfg = tmp_path / "node.toml"
    cfg.write_text(toml(tmp_path, admin, socks, ""))
    err = (tmp_path / "stderr.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "meshgate", "run", "-c", str(cfg), "--name", "flagged"],
                            stdout=subprocess.DEVNULL, stderr=err, text=True, cwd=ROOT, env=ENV)
    log = tmp_path / "stderr.log"
    try:
        wait_until(lambda: auth(admin) is not None or proc.poll() is not None, 30, "admin API")
        assert proc.poll() is None, log.read_text()
        assert auth(admin) == "none"

        # SIGHUP: a user added is applied and logged (key names only, never the password)
        cfg.write_text(toml(tmp_path, admin, socks, '{ name = "bob", password = "pw-hup" }'))
        proc.send_signal(signal.SIGHUP)
        wait_until(lambda: auth(admin) == "username/password", 20, "SIGHUP to apply socks5.users")
        wait_until(lambda: "reload: applied: socks5.users" in log.read_text(), 20, "the reload logged")
        # the --name override is kept: without it node.name would change and refuse the reload
        assert status(admin)["name"] == "flagged"  # type: ignore[index]

        # SIGHUP with a non-live key: refused, logged, nothing applied
        cfg.write_text(toml(tmp_path, admin, free_port(), ""))
        proc.send_signal(signal.SIGHUP)
        wait_until(lambda: "restart to change: socks5.listen" in log.read_text(), 20, "refusal logged")
        assert auth(admin) == "username/password"

        # meshgate reload: exit 1 and the reason when refused ...
        r = reload_cli(admin)
        assert r.returncode == 1 and "restart to change: socks5.listen" in r.stderr, r
        # ... 1 and FILE:KEY: problem for an invalid file ...
        cfg.write_text(toml(tmp_path, admin, socks, "", extra="[limits]\nadmin_max_clients = -1\n"))
        r = reload_cli(admin)
        assert r.returncode == 1 and f"{cfg}:limits.admin_max_clients:" in r.stderr, r
        # ... 0 and what was applied
        cfg.write_text(toml(tmp_path, admin, socks, ""))
        r = reload_cli(admin)
        assert r.returncode == 0 and "applied: socks5.users" in r.stdout, r
        assert auth(admin) == "none"
        assert proc.poll() is None
        assert "pw-hup" not in log.read_text()
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
        err.close()


def test_meshgate_reload_with_a_token(tmp_path: Path) -> None:
    admin, socks = free_port(), free_port()
    token = "cli-reload-token-0123456789abcdef"
    cfg = tmp_path / "node.toml"
    extra = f'token = "{token}"\n'
    cfg.write_text(toml(tmp_path, admin, socks, "", extra))
    proc = subprocess.Popen([sys.executable, "-m", "meshgate", "run", "-c", str(cfg)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT, env=ENV)
    try:
        wait_until(lambda: auth(admin) is not None or proc.poll() is not None, 30, "admin API")
        assert proc.poll() is None
        cfg.write_text(toml(tmp_path, admin, socks, '{ name = "bob", password = "pw" }', extra))
        r = reload_cli(admin)
        assert r.returncode == 2 and "answered 401" in r.stderr, r
        assert auth(admin) == "none"
        tf = tmp_path / "token"
        tf.write_text(token + "\n")
        r = reload_cli(admin, "--token-file", str(tf))
        assert r.returncode == 0 and "applied: socks5.users" in r.stdout, r
        assert auth(admin) == "username/password"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
