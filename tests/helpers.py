"""Shared test helpers: tool requirements, condition waits, loopback servers.

One place for these so every suite uses the same rules: a missing external
tool skips locally but fails under MESHGATE_REQUIRE_E2E=1 (CI), and waits
poll a condition against a deadline instead of sleeping a fixed time.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import os
import random
import shutil
import socket
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from types import ModuleType

import pytest

REQUIRE_E2E = os.environ.get("MESHGATE_REQUIRE_E2E") == "1"

# Published test vectors, carried in the repository (tests/vectors/README.md names each source).
VECTORS = Path(__file__).resolve().parent / "vectors"


def require(ok: bool, what: str) -> None:
    """Skip when the machine lacks `what`; under MESHGATE_REQUIRE_E2E=1 (CI) fail instead,
    so a gap in the environment never passes for a green run."""
    if not ok:
        if REQUIRE_E2E:
            pytest.fail(f"required by this test: {what}")
        pytest.skip(f"missing: {what}")


def require_tool(name: str) -> str:
    """Path of an external tool; skip (or fail under MESHGATE_REQUIRE_E2E=1) if missing."""
    path = shutil.which(name)
    require(path is not None, f"{name} (make test installs it when run as root)")
    assert path is not None
    return path


def require_module(name: str) -> ModuleType:
    """An optional Python module; skip (or fail under MESHGATE_REQUIRE_E2E=1) if it is missing.
    Instead of pytest.importorskip, which skips even in CI."""
    try:
        return importlib.import_module(name)
    except ImportError:
        require(False, f"Python module {name} (pip install -e '.[test]')")
        raise  # not reached: require skipped or failed


def require_root() -> None:
    require(os.geteuid() == 0, "root (network namespaces)")


def can_bind(host: str) -> bool:
    """Whether a loopback address (::1, 127.0.0.2, ...) is usable on this host."""
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(fam, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
        return True
    except OSError:
        return False


def wait_until(cond: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    delay = 0.001
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


async def async_wait_until(
    cond: Callable[[], bool | Awaitable[bool]], timeout: float = 10.0, what: str = "condition"
) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    delay = 0.001
    while True:
        r = cond()
        if not isinstance(r, bool):
            r = await r
        if r:
            return
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.05)


def _ports_outside_ephemeral_range() -> list[int]:
    try:
        lo, hi = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        return []
    return [p for p in (*range(20000, lo), *range(hi + 1, 65536)) if p >= 20000]


_CANDIDATES = _ports_outside_ephemeral_range()
_handed_out: set[int] = set()
_rng = random.Random()  # seeded from urandom: concurrent test runs do not walk the same ports


def free_port(kind: int = socket.SOCK_STREAM, host: str = "127.0.0.1") -> int:
    """A port nothing is bound to now, for a listener another process will open later.

    Taken from outside the kernel's ephemeral range when it leaves room: a port from that range
    (what bind(0) returns) can be given as the local port of some outgoing connection between
    this check and the listener's bind, which then fails with EADDRINUSE. Never the same port
    twice in one test run."""
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    for _ in range(200):
        if not _CANDIDATES:
            break
        port = _rng.choice(_CANDIDATES)
        if port in _handed_out:
            continue
        with socket.socket(fam, kind) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket(fam, kind) as s:
        s.bind((host, 0))
        port = int(s.getsockname()[1])
    _handed_out.add(port)
    return port


def write_firefox_prefs(profile: Path, prefs: Mapping[str, object]) -> None:
    """A Firefox profile's user.js: one user_pref line per preference (bool, int or string)."""
    lines = []
    for key, value in prefs.items():
        text = ("true" if value else "false") if isinstance(value, bool) else (
            str(value) if isinstance(value, int) else f'"{value}"')
        lines.append(f'user_pref("{key}", {text});')
    (profile / "user.js").write_text("\n".join(lines) + "\n")


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


class UdpEcho:
    """A loopback UDP echo server on a raw socket (asyncio's sendto skips empty datagrams):
    sends each datagram back to its source behind `prefix`, and remembers what it received
    (`received`) and from where (`peers`)."""

    def __init__(self, host: str = "127.0.0.1", prefix: bytes = b"", port: int = 0) -> None:
        fam = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(fam, socket.SOCK_DGRAM)
        self.sock.bind((host, port))
        self.sock.setblocking(False)
        self.address: tuple[str, int] = self.sock.getsockname()[:2]
        self.port = self.address[1]
        self.prefix = prefix
        self.received: list[bytes] = []
        self.peers: list[tuple[str, int]] = []
        self.loop = asyncio.get_running_loop()
        self.loop.add_reader(self.sock.fileno(), self._read)

    def _read(self) -> None:
        while True:
            try:
                data, addr = self.sock.recvfrom(65536)
            except BlockingIOError:
                return
            self.received.append(data)
            self.peers.append(addr[:2])
            self.sock.sendto(self.prefix + data, addr)

    def close(self) -> None:
        self.loop.remove_reader(self.sock.fileno())
        self.sock.close()


class Metric:
    """A counter's change since construction (the registry is process-wide)."""

    def __init__(self, name: str, *labels: str) -> None:
        from meshgate.metrics import REGISTRY

        self.registry = REGISTRY
        self.name, self.labels = name, labels
        self.start = REGISTRY.value(name, *labels)

    @property
    def delta(self) -> float:
        return self.registry.value(self.name, *self.labels) - self.start


@pytest.fixture(params=["asyncio", "uvloop"])
def both_loops(request: pytest.FixtureRequest) -> asyncio.AbstractEventLoopPolicy:
    """Every test of a module that imports this as `event_loop_policy` runs on both loops:
    `meshgate run` uses uvloop, whose transports differ from asyncio's in type and callback order."""
    if request.param == "uvloop":
        uvloop = require_module("uvloop")
        return uvloop.EventLoopPolicy()  # type: ignore[no-any-return]
    return asyncio.DefaultEventLoopPolicy()
