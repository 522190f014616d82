"""`[dns] workers = 2`: the main process and one worker process share the UDP and DoH listeners
(SO_REUSEPORT). Real clients (dnsperf, dnspython) on loopback; real worker processes."""

from __future__ import annotations

import asyncio
import ipaddress
import os
import signal
import subprocess
import sys
import types
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import dns.asyncquery
import dns.exception
import dns.message
import dns.query
import dns.rcode
import pytest

from meshgate.admin import fetch
from meshgate.config import from_dict
from meshgate.dns.service import DnsService
from meshgate.metrics import REGISTRY
from meshgate.node import Node
from tests.helpers import async_wait_until, free_port, require_tool, wait_until

ROOT = Path(__file__).resolve().parents[2]
WWW = "192.0.2.7"


def _config(tmp_path: Path, admin_port: int = 0) -> Any:
    return from_dict({
        "node": {"name": "alpha", "ipv4": "10.144.144.1/24", "state_dir": str(tmp_path / "state")},
        "socks5": {"enable": False},
        "admin": {"enable": admin_port > 0, "listen": f"127.0.0.1:{admin_port or 1}"},
        "dns": {"workers": 2, "records": {"www.test": WWW},
                # Never used (every name asked here is local); a dead loopback port, not resolv.conf.
                "upstreams": ["udp://127.0.0.1:9"],
                "listener": [{"protocol": "udp", "listen": "127.0.0.1:0"},
                             {"protocol": "doh", "listen": "127.0.0.1:0"}]},
    })


class Env:
    def __init__(self, node: Node) -> None:
        self.node = node
        svc = next(s for s in node.services if s.name == "dns")
        assert isinstance(svc, DnsService)
        self.svc = svc
        self.udp_url = next(u for u in svc.urls if u.startswith("udp://"))
        self.doh_url = next(u for u in svc.urls if u.startswith("https://"))
        self.udp_port = int(self.udp_url.rsplit(":", 1)[1])

    def totals(self, url: str) -> int:
        q = self.svc.stats[url].snapshot()["queries"]
        assert isinstance(q, int)
        return q

    def worker_queries(self, url: str) -> int:
        return int(self.svc.status()["workers"]["1"]["queries"].get(url, 0))

    def worker_pid(self) -> int:
        pid = self.svc.status()["workers"]["1"]["pid"]
        assert isinstance(pid, int)
        return pid


@pytest.fixture
async def env(tmp_path: Path) -> AsyncIterator[Env]:
    node = Node(_config(tmp_path, free_port()))
    await node.start()
    try:
        yield Env(node)
    finally:
        await node.stop()


async def _udp_burst(port: int, name: str, n: int, tries: int = 1) -> list[str]:
    """n queries, each from its own socket (its own source port, so the kernel's SO_REUSEPORT hash
    spreads them over the processes); the first address of each answer. `tries` > 1 retries a
    timed-out query the way a stub resolver does."""

    async def one() -> str:
        for attempt in range(tries):
            try:
                return await _one(port, name, timeout=5.0 if tries == 1 else 1.0)
            except dns.exception.Timeout:
                if attempt + 1 == tries:
                    raise
        raise AssertionError("unreachable")

    out: list[str] = []
    for _ in range(n // 32):
        out += await asyncio.gather(*(one() for _ in range(32)))
    return out


def _doh_burst(url: str, n: int) -> list[str]:
    """n DoH queries, each on a new HTTPS connection (the kernel spreads connections)."""
    out = []
    for _ in range(n):
        r = dns.query.https(dns.message.make_query("www.test", "A"), url, timeout=5.0, verify=False)
        out.append(next(rr.address for rrset in r.answer for rr in rrset))
    return out


async def test_udp_and_doh_bursts_are_answered_in_full_by_both_processes(env: Env, tmp_path: Path) -> None:
    dnsperf = require_tool("dnsperf")
    # process-wide family: earlier tests' workers (also "1") counted into it too
    worker_metric0 = REGISTRY.value("meshgate_dns_worker_queries_total", "1")
    data = tmp_path / "q.txt"
    data.write_text("www.test A\nalpha.mesh.internal A\n")
    # dnsperf: 16 sockets, 2000 queries, every one answered.
    out = await asyncio.to_thread(
        subprocess.run, [dnsperf, "-s", "127.0.0.1", "-p", str(env.udp_port), "-d", str(data), "-c", "16",
                         "-n", "1000", "-t", "10", "-q", "64"], capture_output=True, text=True, timeout=60)
    assert "Queries completed:    2000 (100.00%)" in out.stdout, out.stdout + out.stderr
    assert "Queries lost:         0 " in out.stdout, out.stdout

    answers = await _udp_burst(env.udp_port, "www.test", 128)
    assert answers == [WWW] * 128
    doh = await asyncio.to_thread(_doh_burst, env.doh_url, 24)
    assert doh == [WWW] * 24

    # Every query is counted once in the totals (the worker's counts merged into the main
    # process's families), and each process answered part of each listener's queries.
    await async_wait_until(lambda: env.totals(env.udp_url) == 2000 + 128, timeout=10,
                           what=f"udp totals {env.totals(env.udp_url)} {env.svc.status()}")
    await async_wait_until(lambda: env.totals(env.doh_url) == 24, timeout=10, what="doh totals")
    for url in (env.udp_url, env.doh_url):
        worker = env.worker_queries(url)
        assert 0 < worker < env.totals(url), (url, worker, env.totals(url))

    # The admin API's /metrics shows the totals and the worker's share.
    code, body = await fetch(str(env.node.config.admin.listen), "/metrics")
    assert code == 200
    text = body.decode()
    assert f'meshgate_dns_queries_total{{listener="{env.udp_url}"}} {2000 + 128}' in text
    share = env.worker_queries(env.udp_url) + env.worker_queries(env.doh_url)
    assert f'meshgate_dns_worker_queries_total{{worker="1"}} {worker_metric0 + share}' in text


async def test_a_mesh_name_added_after_start_resolves_in_every_process(env: Env) -> None:
    assert await _udp_burst(env.udp_port, "beta.mesh.internal", 32) == ["NXDOMAIN"] * 32
    table = {"alpha": (ipaddress.IPv4Address("10.144.144.1"), None),
             "beta": (ipaddress.IPv4Address("10.144.144.2"), None)}
    # What the mesh's name table gives the resolver; the main process pushes changes to workers.
    env.node.mesh = types.SimpleNamespace(name_table=lambda: table)
    before = env.worker_queries(env.udp_url), env.totals(env.udp_url)

    async def beta_answered() -> bool:
        return await _one(env.udp_port, "beta.mesh.internal") == "10.144.144.2"

    await async_wait_until(beta_answered, timeout=10, what="beta")
    answers = await _udp_burst(env.udp_port, "beta.mesh.internal", 128)
    assert answers == ["10.144.144.2"] * 128
    await async_wait_until(lambda: env.totals(env.udp_url) >= before[1] + 128, timeout=10, what="counts")
    assert env.worker_queries(env.udp_url) > before[0]  # the worker answered some of the 128
    env.node.mesh = None


async def _one(port: int, name: str, timeout: float = 5.0) -> str:
    r = await dns.asyncquery.udp(dns.message.make_query(name, "A"), "127.0.0.1", port=port, timeout=timeout)
    addrs = [rr.address for rrset in r.answer for rr in rrset]
    return addrs[0] if addrs else dns.rcode.to_text(r.rcode())


async def test_a_killed_worker_is_restarted_and_stop_leaves_no_worker(tmp_path: Path) -> None:
    node = Node(_config(tmp_path))
    await node.start()
    try:
        env = Env(node)
        first = env.worker_pid()
        os.kill(first, signal.SIGKILL)
        # Once the process is gone its socket is closed (queries already in its receive queue are
        # lost, as with any UDP server that dies), and the listener keeps answering from the main
        # process while the worker is down: the kernel moves its share.
        wait_until(lambda: _dead(first), timeout=10, what="the killed worker to exit")
        # A stub resolver's retry covers a datagram caught in the restart (the new worker binds
        # into the group meanwhile).
        answers = await _udp_burst(env.udp_port, "www.test", 64, tries=3)
        assert answers == [WWW] * 64
        pool = env.svc.pool
        await async_wait_until(lambda: env.worker_pid() != first and pool.pids() == [env.worker_pid()],
                               timeout=15, what="a new worker")
        assert env.svc.status()["workers"]["1"]["restarts"] == 1
        second = env.worker_pid()
        before = env.worker_queries(env.udp_url)

        async def new_worker_answers() -> bool:
            assert await _udp_burst(env.udp_port, "www.test", 32, tries=3) == [WWW] * 32
            return env.worker_queries(env.udp_url) > before

        await async_wait_until(new_worker_answers, timeout=15, what="the restarted worker answering")
    finally:
        await node.stop()
    for pid in (first, second):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


async def test_a_restart_that_fails_is_retried_with_backoff(tmp_path: Path) -> None:
    node = Node(_config(tmp_path))
    await node.start()
    try:
        env = Env(node)
        pool = env.svc.pool
        cert = tmp_path / "state" / "dns-selfsigned.crt"
        hidden = cert.with_suffix(".hidden")
        cert.rename(hidden)  # the next worker cannot load the DoH certificate: it fails to start
        first = env.worker_pid()
        os.kill(first, signal.SIGKILL)
        await async_wait_until(lambda: env.svc.status()["workers"]["1"]["restarts"] >= 2, timeout=15,
                               what="a failed restart")
        hidden.rename(cert)
        before = env.worker_queries(env.udp_url)

        async def back() -> bool:
            assert await _udp_burst(env.udp_port, "www.test", 32, tries=3) == [WWW] * 32
            return env.worker_queries(env.udp_url) > before and len(pool.pids()) == 1

        await async_wait_until(back, timeout=20, what="a worker answering again")
    finally:
        await node.stop()


def _dead(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except FileNotFoundError:
        return True


def test_workers_die_with_the_main_process(tmp_path: Path) -> None:
    """SIGKILL on `meshgate run` (no chance to stop anything): its worker goes too."""
    cfg = tmp_path / "node.toml"
    udp = free_port()
    cfg.write_text(f"""
[node]
name = "alpha"
state_dir = "{tmp_path / 'state'}"
[socks5]
enable = false
[admin]
enable = false
[dns]
workers = 2
upstreams = ["udp://127.0.0.1:9"]
records = {{ "www.test" = "{WWW}" }}
[[dns.listener]]
protocol = "udp"
listen = "127.0.0.1:{udp}"
""")
    proc = subprocess.Popen([sys.executable, "-m", "meshgate", "run", "-c", str(cfg)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None
        assert "meshgate" in proc.stdout.readline()  # the banner: started, workers ready

        def children() -> list[int]:
            path = Path(f"/proc/{proc.pid}/task/{proc.pid}/children")
            return [int(p) for p in path.read_text().split()] if path.exists() else []

        kids = children()
        assert len(kids) == 1
        r = dns.query.udp(dns.message.make_query("www.test", "A"), "127.0.0.1", port=udp, timeout=3)
        assert r.answer[0][0].address == WWW
        proc.kill()
        proc.wait(10)

        wait_until(lambda: _dead(kids[0]), timeout=10, what="the worker to exit")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def test_workers_go_upstream_through_the_main_process_and_its_mesh(tmp_path: Path) -> None:
    """The upstream is a resolver at another node's virtual IP, reachable only over the mesh. Every
    process answers it: a worker sends its cache misses to the main process, which asks over a mesh
    stream (a worker dialling 10.144.9.2 itself would find no route and answer SERVFAIL)."""
    from tests.integration.test_portal_mesh import cfg, start

    dns_port = free_port()
    b = await start(cfg("b", "10.144.9.2/24", node={"state_dir": str(tmp_path / "b")},
                        mesh={"listen": ["tcp://127.0.0.1:0"]},
                        dns={"records": {f"n{i}.far.example.": WWW for i in range(128)},
                             "listener": [{"protocol": "tcp", "listen": f"127.0.0.1:{dns_port}"}]},
                        serve={str(dns_port): f"127.0.0.1:{dns_port}"}))  # b publishes its resolver
    a = await start(cfg("a", "10.144.9.1/24", node={"state_dir": str(tmp_path / "a")},
                        mesh={"peers": [b.mesh.listen_addrs[0]], "direct_fallback": False},
                        dns={"workers": 2, "upstreams": [f"tcp://10.144.9.2:{dns_port}"],
                             "listener": [{"protocol": "udp", "listen": "127.0.0.1:0"}]}))
    try:
        await async_wait_until(lambda: b.mesh.node_id in a.mesh.table.hop_paths, 15, "a route to b")
        env = Env.__new__(Env)
        env.svc = next(s for s in a.services if s.name == "dns")  # type: ignore[assignment]
        udp_url = next(u for u in env.svc.urls if u.startswith("udp://"))
        port = int(udp_url.rsplit(":", 1)[1])
        # distinct names: every query is a cache miss in whichever process gets it
        answers: list[str] = []
        for batch in range(4):
            answers += await asyncio.gather(*(_one(port, f"n{batch * 32 + i}.far.example", timeout=5.0)
                                              for i in range(32)))
        assert answers == [WWW] * len(answers)
        await async_wait_until(lambda: env.worker_queries(udp_url) > 0, 10, "the worker's counters")
        assert env.worker_queries(udp_url) > 0  # the worker answered some of them itself
    finally:
        await a.stop()
        await b.stop()


async def test_workers_do_not_inherit_the_secret(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The node read MESHGATE_SECRET at config time; the worker processes it starts must not carry it.
    secret, token = "worker-env-secret-" + "x" * 16, "worker-env-admin-token-" + "y" * 16
    monkeypatch.setenv("MESHGATE_SECRET", secret)
    monkeypatch.setenv("MESHGATE_ADMIN_TOKEN", token)
    node = Node(_config(tmp_path, free_port()))
    await node.start()
    try:
        pid = Env(node).worker_pid()
        environ = Path(f"/proc/{pid}/environ").read_bytes()
        assert b"MESHGATE_SECRET=" not in environ and b"MESHGATE_ADMIN_TOKEN=" not in environ
        assert secret.encode() not in environ and token.encode() not in environ
        assert b"PYTHONPATH=" in environ  # the environment itself was passed, only scrubbed
    finally:
        await node.stop()
