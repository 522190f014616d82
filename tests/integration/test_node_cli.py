"""`meshgate run` as a separate process: admin API, exit codes, clean stop."""

import json
import os
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.helpers import free_port, wait_until

ROOT = Path(__file__).resolve().parents[2]


def start(tmp_path: Path, text: str) -> subprocess.Popen[str]:
    cfg = tmp_path / "node.toml"
    cfg.write_text(text)
    return subprocess.Popen(
        [sys.executable, "-m", "meshgate", "run", "-c", str(cfg)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


def get(url: str) -> tuple[int, bytes]:
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.status, r.read()


def admin_up(port: int) -> bool:
    try:
        return get(f"http://127.0.0.1:{port}/status")[0] == 200
    except OSError:
        return False


def test_admin_api_and_clean_stop(tmp_path: Path) -> None:
    port = free_port()
    proc = start(tmp_path, f'[node]\nname = "alpha"\n[socks5]\nenable = false\n'
                           f'[admin]\nlisten = "127.0.0.1:{port}"\n')
    try:
        wait_until(lambda: admin_up(port) or proc.poll() is not None, 30, "admin API")
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        status = json.loads(get(f"http://127.0.0.1:{port}/status")[1])
        assert status["name"] == "alpha" and "uptime" in status and status["version"]
        code, metrics = get(f"http://127.0.0.1:{port}/metrics")
        assert code == 200 and b"# TYPE meshgate_admin_requests_total counter" in metrics
        assert json.loads(get(f"http://127.0.0.1:{port}/peers")[1]) == []
        # an oversized request head is dropped without an answer; the API keeps serving
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(b"GET /status HTTP/1.1\r\nX-Junk: " + b"a" * 20000 + b"\r\n\r\n")
            try:
                answer = s.recv(100)
            except ConnectionResetError:  # closed with our bytes unread: also no answer
                answer = b""
            assert answer == b""
        assert get(f"http://127.0.0.1:{port}/status")[0] == 200
        with pytest.raises(urllib.error.HTTPError) as ei:
            get(f"http://127.0.0.1:{port}/nope")
        assert ei.value.code == 404
        # The CLI reads the same API.
        out = subprocess.run(
            [sys.executable, "-m", "meshgate", "status", "--admin", f"127.0.0.1:{port}"],
            capture_output=True, text=True, timeout=30, cwd=ROOT,
        )
        assert out.returncode == 0 and "alpha" in out.stdout
        stats = subprocess.run(
            [sys.executable, "-m", "meshgate", "stats", "--admin", f"127.0.0.1:{port}"],
            capture_output=True, text=True, timeout=30, cwd=ROOT,
        )
        assert "meshgate_admin_requests_total" in stats.stdout
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    # listeners are closed after exit
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0


def test_port_in_use_exits_2_naming_the_address(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = start(tmp_path, f'[socks5]\nenable = false\n[admin]\nlisten = "127.0.0.1:{port}"\n')
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert f"admin.listen: cannot listen on 127.0.0.1:{port}" in err
    assert "Traceback" not in err


def test_config_error_exits_1(tmp_path: Path) -> None:
    proc = start(tmp_path, '[socks5]\nlisten = "127.0.0.1:http"\n')
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert "node.toml:socks5.listen:" in err and "Traceback" not in err


def test_sigint_is_clean_too(tmp_path: Path) -> None:
    port = free_port()
    proc = start(tmp_path, f'[socks5]\nenable = false\n[admin]\nlisten = "127.0.0.1:{port}"\n')
    wait_until(lambda: admin_up(port) or proc.poll() is not None, 30, "admin API")
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) == 0


def test_a_second_node_on_one_state_dir_exits_2_naming_it(tmp_path: Path) -> None:
    # Two nodes sharing a state dir would share a node id and never link; the second must stop.
    state = tmp_path / "state"
    ports = free_port(), free_port()
    first_dir, second_dir = tmp_path / "first", tmp_path / "second"
    first_dir.mkdir()
    second_dir.mkdir()
    text = '[node]\nstate_dir = "{state}"\n[socks5]\nenable = false\n[admin]\nlisten = "127.0.0.1:{port}"\n'
    first = start(first_dir, text.format(state=state, port=ports[0]))
    try:
        wait_until(lambda: admin_up(ports[0]) or first.poll() is not None, 30, "first node's admin API")
        assert first.poll() is None
        second = start(second_dir, text.format(state=state, port=ports[1]))
        _, err = second.communicate(timeout=60)
        assert second.returncode == 2
        assert f"node.state_dir: {state} is in use by another running meshgate node (pid {first.pid})" in err
        assert "Traceback" not in err
        assert first.poll() is None  # the first node runs on, undisturbed
    finally:
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=30) == 0
    # once the first has stopped, the directory is free again
    third = start(second_dir, text.format(state=state, port=ports[1]))
    try:
        wait_until(lambda: admin_up(ports[1]) or third.poll() is not None, 30, "third node's admin API")
        assert third.poll() is None
    finally:
        third.send_signal(signal.SIGTERM)
        assert third.wait(timeout=30) == 0


def _meshgate(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "meshgate", *args], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60)


def test_secret_new_is_random_and_check_config_warns_about_weak_ones(tmp_path: Path) -> None:
    made = [_meshgate("secret", "new") for _ in range(2)]
    secrets_made = [m.stdout.strip() for m in made]
    assert all(m.returncode == 0 for m in made) and secrets_made[0] != secrets_made[1]
    assert all(len(s) == 43 and s.replace("-", "").replace("_", "").isalnum() for s in secrets_made)
    cfg = tmp_path / "mesh.toml"
    for secret, weak in ((secrets_made[0], False), ("sunshine1", True), ("aaaaaaaaaaaaaaaaaaaaaaaa", True)):
        cfg.write_text(f'[node]\nsecret = "{secret}"\n[mesh]\nlisten = ["tcp://127.0.0.1:0"]\n')
        run = _meshgate("check-config", str(cfg))
        assert run.returncode == 0 and f"{cfg}: ok" in run.stdout  # a warning, not a refusal
        assert ("node.secret: warning: weak" in run.stderr) is weak, run.stderr
        assert secret not in run.stdout + run.stderr  # the secret itself is never printed


def test_a_secret_on_the_command_line_is_warned_about(tmp_path: Path) -> None:
    port = free_port()
    cfg = tmp_path / "node.toml"
    cfg.write_text(f'[node]\nstate_dir = "{tmp_path / "state"}"\n[socks5]\nenable = false\n'
                   f'[admin]\nlisten = "127.0.0.1:{port}"\n')
    secret = "on-the-command-line-" + "z" * 20
    proc = subprocess.Popen(
        [sys.executable, "-m", "meshgate", "run", "-c", str(cfg), "--secret", secret],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        wait_until(lambda: admin_up(port) or proc.poll() is not None, 30, "admin API")
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert "--secret: the secret shows in ps and shell history" in err
    assert secret not in err


def test_the_demo_makes_a_random_secret_unless_given(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from meshgate.demo import Demo, Ports

    monkeypatch.delenv("MESHGATE_SECRET", raising=False)
    made = [Demo("loopback", Ports(), "t", tmp_path, log_dir=tmp_path).secret for _ in range(2)]
    assert made[0] != made[1] and len(made[0]) >= 43
    monkeypatch.setenv("MESHGATE_SECRET", "given-" + "s" * 20)
    assert Demo("loopback", Ports(), "t", tmp_path, log_dir=tmp_path).secret == "given-" + "s" * 20
    assert "given-" not in repr(Demo("loopback", Ports(), "t", tmp_path, log_dir=tmp_path))
