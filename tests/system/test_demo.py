"""The namespace form of `meshgate demo` runs the README tour's checks (root).

portal (host namespace) -> relay -> exit -> web, each behind its own veth pair,
exactly like docker-compose.yml. Real clients: curl, headless Chromium, kdig.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import free_port, require_root, require_tool, wait_until

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--proxy-bypass-list=<-loopback>", "--hide-scrollbars",
]


def _leftovers(prefix: str) -> list[str]:
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    left = [ln.split()[0] for ln in ns.splitlines() if ln.startswith(prefix + "-")]
    if subprocess.run(["ip", "link", "show", f"{prefix}-front"], capture_output=True).returncode == 0:
        left.append(f"{prefix}-front")
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    left += [ln for ln in ps.splitlines() if "examples/demo/" in ln or "meshgate.demo_web" in ln]
    return left


@pytest.fixture(scope="module")
def demo() -> Iterator[dict[str, object]]:
    require_root()
    for tool in ("ip", "curl", "ps"):
        require_tool(tool)
    prefix = f"mgd{os.getpid() % 100000}"
    ports = {k: free_port() for k in ("socks5", "doh", "admin")}
    ports["doq"] = free_port(kind=2)  # SOCK_DGRAM
    out = Path(tempfile.mkdtemp(prefix="demo-test-")) / "demo.out"
    argv = [sys.executable, "-m", "meshgate", "demo", "--mode", "netns", "--prefix", prefix,
            "--ports", f"{ports['socks5']},{ports['doh']},{ports['doq']},{ports['admin']}"]
    with open(out, "wb") as f:
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        wait_until(lambda: "demo is up" in out.read_text() or proc.poll() is not None, 90, "the demo")
        assert proc.poll() is None, out.read_text()
        yield {"proc": proc, "ports": ports, "prefix": prefix, "out": out}
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=30)


def test_banner_tells_how_to_use_it(demo: dict[str, object]) -> None:
    text = Path(str(demo["out"])).read_text()
    ports = demo["ports"]
    assert isinstance(ports, dict)
    assert f"SOCKS5 host 127.0.0.1, port {ports['socks5']}" in text
    assert f"https://127.0.0.1:{ports['doh']}/dns-query" in text
    assert f"curl --proxy socks5h://127.0.0.1:{ports['socks5']} http://10.2.2.10/" in text
    assert "kdig +https" in text
    assert f"Console:  http://127.0.0.1:{ports['admin']}/" in text


@pytest.mark.parametrize("url", ["http://10.2.2.10/", "http://web.mesh.internal/"])
def test_curl_reaches_web_through_the_mesh(demo: dict[str, object], url: str) -> None:
    ports = demo["ports"]
    assert isinstance(ports, dict)
    r = subprocess.run(["curl", "-sS", "--max-time", "20", "--proxy", f"socks5h://127.0.0.1:{ports['socks5']}",
                        url], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "Hello from web" in r.stdout and "<b id=served-by>web</b>" in r.stdout


def test_host_link_makes_no_late_address_changes(demo: dict[str, object]) -> None:
    # A browser started after "demo is up" must not see the host's addresses change under it (a
    # CI run lost a Chromium page load to net::ERR_NETWORK_CHANGED from the veth's IPv6 DAD).
    r = subprocess.run(["ip", "-6", "addr", "show", "dev", f"{demo['prefix']}-front"],
                       capture_output=True, text=True, check=True)
    assert "inet6" not in r.stdout, r.stdout


def test_chromium_shows_the_web_page(demo: dict[str, object]) -> None:
    chromium = require_tool("chromium")
    ports = demo["ports"]
    assert isinstance(ports, dict)
    with tempfile.TemporaryDirectory() as profile, tempfile.TemporaryDirectory() as shots:
        proxy = f"--proxy-server=socks5://127.0.0.1:{ports['socks5']}"
        dom = subprocess.run([chromium, *CHROMIUM_FLAGS, proxy, f"--user-data-dir={profile}", "--dump-dom",
                              "http://10.2.2.10/"], capture_output=True, text=True, timeout=120)
        assert "Hello from web" in dom.stdout, dom.stderr[-2000:]
        shot = Path(shots) / "tour.png"
        subprocess.run([chromium, *CHROMIUM_FLAGS, proxy, f"--user-data-dir={Path(shots) / 'profile'}",
                        f"--screenshot={shot}", "--window-size=900,300", "http://10.2.2.10/"],
                       capture_output=True, timeout=120)
        assert shot.exists() and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        if os.environ.get("MESHGATE_WRITE_TOUR") == "1":  # refresh the README's picture
            shutil.copy(shot, ROOT / "docs" / "tour.png")


def test_kdig_resolves_mesh_name_over_doh(demo: dict[str, object]) -> None:
    kdig = require_tool("kdig")
    ports = demo["ports"]
    assert isinstance(ports, dict)
    r = subprocess.run([kdig, "+https", "@127.0.0.1", "-p", str(ports["doh"]), "exit.mesh.internal", "A",
                        "+short"], capture_output=True, text=True, timeout=60)
    assert r.stdout.split() == ["10.144.144.3"], r.stdout + r.stderr


def test_stop_leaves_nothing_behind(demo: dict[str, object]) -> None:
    proc = demo["proc"]
    assert isinstance(proc, subprocess.Popen)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) == 0
    prefix = str(demo["prefix"])
    wait_until(lambda: not _leftovers(prefix), 10, f"nothing left of {prefix}: {_leftovers(prefix)}")
    assert "stopped and cleaned up" in Path(str(demo["out"])).read_text()
