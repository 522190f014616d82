"""The local CA with real clients: curl and openssl verify the DoH listener's chain against
ca.crt alone (no -k), `meshgate tls show|trust` with certutil writes the NSS databases Chromium
and Firefox read, and headless Chromium, with our DoH endpoint as its only resolver (managed
policy, bound over /etc/chromium in a private mount namespace), loads a page by a name only
our DoH answers."""

from __future__ import annotations

import asyncio
import base64
import functools
import json
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import dns.message
import dns.rrset
import pytest

from meshgate import tls
from meshgate.config import from_dict
from meshgate.dns import service
from tests.helpers import require, require_root, require_tool, write_firefox_prefs

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
NODE = "tlsnode"
PAGE = b"<html><body>Hello through our DoH</body></html>"
CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--hide-scrollbars",
]


@dataclass
class Node:
    svc: service.DnsService
    state: Path
    doh_port: int
    http_port: int
    page_hits: list[bytes]  # request heads the page server answered

    @property
    def ca(self) -> Path:
        return self.state / "ca.crt"

    @property
    def doh(self) -> str:
        return f"https://127.0.0.1:{self.doh_port}/dns-query"


async def _serve_page(hits: list[bytes], reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        hits.append(await reader.readuntil(b"\r\n\r\n"))
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/html\r\nConnection: close\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(PAGE), PAGE))
        await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[Node]:
    hits: list[bytes] = []
    page = await asyncio.start_server(functools.partial(_serve_page, hits), "127.0.0.1", 0)
    http_port = page.sockets[0].getsockname()[1]
    state = tmp_path / "state"
    cfg = from_dict({
        "node": {"name": NODE, "state_dir": str(state)},
        "dns": {"upstreams": ["udp://127.0.0.1:9"],  # nothing there: only our own names answer
                "records": {"web.mesh.internal.": "127.0.0.1"},
                "listener": [{"protocol": "doh", "listen": "127.0.0.1:0"}]},
    })
    svc = service.DnsService(cfg, service.Pipeline(cfg))
    await svc.start()
    try:
        yield Node(svc, state, svc.listeners[0].port, http_port, hits)
    finally:
        await svc.stop()
        page.close()
        await page.wait_closed()


async def _run(*argv: str, env: dict[str, str] | None = None, timeout: float = 120) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE, env=env)
    out, err = await asyncio.wait_for(proc.communicate(), timeout)
    assert proc.returncode is not None
    return proc.returncode, out.decode(errors="replace"), err.decode(errors="replace")


def _query(name: str) -> str:
    wire = dns.message.make_query(name, "A", id=0).to_wire()
    return base64.urlsafe_b64encode(wire).rstrip(b"=").decode()


async def test_curl_and_openssl_verify_the_chain_with_only_the_ca(node: Node, tmp_path: Path) -> None:
    curl, openssl = require_tool("curl"), require_tool("openssl")
    answer = tmp_path / "answer.bin"
    # The same listener by its IP, by localhost and by the node's mesh name; ca.crt is the only
    # trust anchor (the leaf is CA:FALSE: a client trusting just the leaf would refuse it).
    for url, extra in ((node.doh, []), (f"https://localhost:{node.doh_port}/dns-query", []),
                       (f"https://{NODE}.mesh.internal:{node.doh_port}/dns-query",
                        ["--resolve", f"{NODE}.mesh.internal:{node.doh_port}:127.0.0.1"])):
        rc, out, err = await _run(curl, "-sS", "--cacert", str(node.ca), *extra, "-o", str(answer),
                                  "-w", "%{http_code}", f"{url}?dns={_query('web.mesh.internal')}")
        assert (rc, out) == (0, "200"), f"{url}: rc {rc} {out} {err}"
        msg = dns.message.from_wire(answer.read_bytes())
        assert [r.to_text() for r in msg.answer[0]] == ["127.0.0.1"]
    leaf = node.state / "dns-selfsigned.crt"
    rc, out, err = await _run(openssl, "verify", "-CAfile", str(node.ca), "-purpose", "sslserver",
                              "-x509_strict", str(leaf))
    assert rc == 0 and "OK" in out, out + err
    rc, out, err = await _run(openssl, "s_client", "-connect", f"127.0.0.1:{node.doh_port}",
                              "-CAfile", str(node.ca), "-verify_return_error", "-verify_ip", "127.0.0.1",
                              "-servername", "localhost", timeout=30)
    assert rc == 0 and "Verify return code: 0 (ok)" in out, out[-2000:] + err[-2000:]


def _meshgate(*args: str) -> list[str]:
    return [sys.executable, "-m", "meshgate", *args]


def _env(home: Path, path: str | None = None) -> dict[str, str]:
    env = {**os.environ, "HOME": str(home), "PYTHONPATH": str(ROOT)}
    if path is not None:
        env["PATH"] = path
    return env


async def test_tls_show_prints_the_ca_and_its_fingerprint(node: Node, tmp_path: Path) -> None:
    openssl = require_tool("openssl")
    rc, out, err = await _run(*_meshgate("tls", "show", "--state-dir", str(node.state)),
                              env=_env(tmp_path))
    assert rc == 0, err
    _, fp, _ = await _run(openssl, "x509", "-in", str(node.ca), "-noout", "-fingerprint", "-sha256")
    assert f"CA certificate: {node.ca}" in out
    assert f"SHA-256 fingerprint: {fp.strip().split('=', 1)[1]}" in out


def _listed(certutil: str, db: Path) -> list[str]:
    r = subprocess.run([certutil, "-L", "-d", f"sql:{db}"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return [line for line in r.stdout.splitlines() if "meshgate local CA" in line]


async def test_tls_trust_adds_the_ca_to_chromium_and_firefox(node: Node, tmp_path: Path) -> None:
    certutil = require_tool("certutil")
    home = tmp_path / "home"
    profile = home / ".mozilla" / "firefox" / "abcd1234.default-release"
    profile.mkdir(parents=True)
    subprocess.run([certutil, "-N", "-d", f"sql:{profile}", "--empty-password"], check=True, timeout=60)
    (home / ".mozilla" / "firefox" / "no-db-here").mkdir()  # not a profile with a database: skipped
    for _ in range(2):  # trusting again replaces the entry
        rc, out, err = await _run(*_meshgate("tls", "trust", "--state-dir", str(node.state)),
                                  env=_env(home))
        assert rc == 0, out + err
    nssdb = home / ".pki" / "nssdb"
    assert (nssdb / "cert9.db").exists()
    for db in (nssdb, profile):
        entries = _listed(certutil, db)
        assert len(entries) == 1, entries
        assert entries[0].split()[-1] == "C,,", entries
        assert f"meshgate local CA ({NODE})" in entries[0]
        pem = subprocess.run([certutil, "-L", "-d", f"sql:{db}", "-n", f"meshgate local CA ({NODE})", "-a"],
                             capture_output=True, text=True, timeout=60, check=True).stdout
        assert pem.split() == node.ca.read_text().split()  # the CA itself, not the leaf
    assert not (home / ".mozilla" / "firefox" / "no-db-here" / "cert9.db").exists()

    # A new CA for the node (rotation: the old files removed): trusting it replaces the old entry.
    old_pem = node.ca.read_text()
    node.ca.unlink()
    (node.state / "ca.key").unlink()
    tls.ensure_ca(node.state, NODE)  # what the node does at its next start
    rc, out, err = await _run(*_meshgate("tls", "trust", "--state-dir", str(node.state)), env=_env(home))
    assert rc == 0, out + err
    assert node.ca.read_text() != old_pem
    for db in (nssdb, profile):
        assert len(_listed(certutil, db)) == 1, (db, _listed(certutil, db), out)
        pem = subprocess.run([certutil, "-L", "-d", f"sql:{db}", "-n", f"meshgate local CA ({NODE})", "-a"],
                             capture_output=True, text=True, timeout=60, check=True).stdout
        assert pem.split() == node.ca.read_text().split()


async def test_tls_trust_without_certutil_prints_the_commands(node: Node, tmp_path: Path) -> None:
    bare = tmp_path / "bin"
    bare.mkdir()
    rc, out, err = await _run(*_meshgate("tls", "trust", "--state-dir", str(node.state)),
                              env=_env(tmp_path, path=str(bare)))
    assert rc != 0
    assert "certutil not found" in err and "libnss3-tools" in err
    nssdb = tmp_path / ".pki" / "nssdb"
    assert f"certutil -N -d sql:{nssdb} --empty-password" in out
    assert f"certutil -A -d sql:{nssdb} -n 'meshgate local CA ({NODE})' -t C,, -i {node.ca}" in out
    assert not nssdb.exists()


def _chromium_script(etc: Path, home: Path, profile: Path, chromium: str, url: str) -> list[str]:
    """Chromium in a private mount namespace with our policies over /etc/chromium (the host's
    /etc is not touched: the bind mount exists only in that namespace)."""
    cmd = shlex.join([chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--dump-dom", url])
    return ["unshare", "-m", "--propagation", "private", "sh", "-c",
            f"mount --bind {shlex.quote(str(etc))} /etc/chromium && HOME={shlex.quote(str(home))} exec {cmd}"]


async def test_chromium_resolves_a_mesh_name_through_our_doh(node: Node, tmp_path: Path) -> None:
    chromium = require_tool("chromium")
    require_tool("certutil")
    require_tool("unshare")
    require_root()
    require(Path("/etc/chromium").is_dir(), "/etc/chromium (the chromium package makes it)")
    etc = tmp_path / "etc-chromium"
    shutil.copytree("/etc/chromium", etc, symlinks=True)
    managed = etc / "policies" / "managed"
    managed.mkdir(parents=True, exist_ok=True)
    for old in managed.glob("*.json"):
        old.unlink()
    (managed / "meshgate-doh.json").write_text(json.dumps({
        "DnsOverHttpsMode": "secure",  # DoH only: no fallback to the system resolver
        "DnsOverHttpsTemplates": node.doh,
    }))
    url = f"http://web.mesh.internal:{node.http_port}/"  # a name only our DoH answers

    untrusted = tmp_path / "untrusted-home"
    untrusted.mkdir()
    _, out, err = await _run(*_chromium_script(etc, untrusted, tmp_path / "p1", chromium, url))
    assert "Hello through our DoH" not in out  # without the CA trusted: the README's old symptom
    assert "ERR_NAME_NOT_RESOLVED" in err, err[-3000:]

    home = tmp_path / "home"
    home.mkdir()
    rc, out, err = await _run(*_meshgate("tls", "trust", "--state-dir", str(node.state)),
                              env=_env(home))
    assert rc == 0, out + err
    before = node.svc.stats[node.svc.urls[0]].snapshot()
    _, out, err = await _run(*_chromium_script(etc, home, tmp_path / "p2", chromium, url))
    assert "Hello through our DoH" in out, err[-3000:]
    after = node.svc.stats[node.svc.urls[0]].snapshot()
    assert after != before  # the name went through our DoH listener


async def test_tls_show_with_a_state_dir_and_no_ca_yet_says_so(tmp_path: Path) -> None:
    rc, out, err = await _run(*_meshgate("tls", "show", "--state-dir", str(tmp_path / "empty")),
                              env=_env(tmp_path))
    assert rc == 1 and "no local CA" in err and "-c CONFIG" in err
    assert not (tmp_path / "empty").exists()
    cfg = tmp_path / "node.toml"
    cfg.write_text(f'[node]\nname = "gw"\nstate_dir = "{tmp_path / "gw-state"}"\n')
    rc, out, err = await _run(*_meshgate("tls", "show", "-c", str(cfg)), env=_env(tmp_path))
    assert rc == 0, err
    assert f"CA certificate: {tmp_path / 'gw-state' / 'ca.crt'}" in out and "(gw)" in out


async def test_tls_show_reads_a_mesh_config_without_its_secret(tmp_path: Path) -> None:
    cfg = tmp_path / "node.toml"
    cfg.write_text(f'[node]\nname = "edge"\nstate_dir = "{tmp_path / "st"}"\n'
                   '[mesh]\npeers = ["tcp://127.0.0.1:11010"]\n')  # its secret: $MESHGATE_SECRET at run
    env = {k: v for k, v in _env(tmp_path).items() if k != "MESHGATE_SECRET"}
    rc, out, err = await _run(*_meshgate("tls", "show", "-c", str(cfg)), env=env)
    assert rc == 0, err
    assert "(edge)" in out and str(tmp_path / "st" / "ca.crt") in out


FIREFOX_DOH_PREFS: dict[str, object] = {
    "network.trr.mode": 3,  # DoH only: no fallback to the system resolver
    "network.trr.confirmationNS": "skip",  # no confirmation lookup of a public name first
    "network.trr.allow-rfc1918": True,  # our answer is a loopback address
    "network.proxy.type": 0,
    "browser.shell.checkDefaultBrowser": False,
    "datareporting.policy.dataSubmissionEnabled": False,
    "toolkit.telemetry.reportingpolicy.firstRun": False,
    "app.update.auto": False,
    "network.captive-portal-service.enabled": False,
    "network.connectivity-service.enabled": False,
    "browser.safebrowsing.malware.enabled": False,
    "browser.safebrowsing.phishing.enabled": False,
    "network.dns.disablePrefetch": True,
}


def _firefox_profile(home: Path, doh: str, certutil: str) -> Path:
    """A profile where `meshgate tls trust` finds it (HOME/.mozilla/firefox/*, with an NSS
    database), our DoH endpoint as its only resolver."""
    profile = home / ".mozilla" / "firefox" / "test.default-release"
    profile.mkdir(parents=True)
    subprocess.run([certutil, "-N", "-d", f"sql:{profile}", "--empty-password"], check=True, timeout=60)
    write_firefox_prefs(profile, {**FIREFOX_DOH_PREFS, "network.trr.uri": doh})
    return profile


async def test_firefox_resolves_a_mesh_name_through_our_doh(node: Node, tmp_path: Path) -> None:
    """Headless Firefox with network.trr.mode = 3 and our DoH URI: a page by a name only our
    DoH answers loads once `meshgate tls trust` put the CA into the profile, and not before."""
    firefox, certutil = require_tool("firefox-esr"), require_tool("certutil")
    url = f"http://web.mesh.internal:{node.http_port}/"

    async def run_firefox(home: Path, profile: Path, shot: Path, timeout: float) -> str:
        # --screenshot loads the page, waits for its load event, then exits; a page that does
        # not load (a name that does not resolve) keeps it waiting: stopped after `timeout`
        proc = await asyncio.create_subprocess_exec(
            firefox, "--headless", "--no-remote", "--profile", str(profile), "--screenshot", str(shot), url,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env={"HOME": str(home)},
            start_new_session=True,
        )
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), timeout)
        except TimeoutError:
            os.killpg(proc.pid, 9)
            out, _ = await proc.communicate()
        return out.decode(errors="replace")

    stats = node.svc.stats[node.svc.urls[0]]
    untrusted = tmp_path / "untrusted"
    p1 = _firefox_profile(untrusted, node.doh, certutil)
    out = await run_firefox(untrusted, p1, tmp_path / "untrusted.png", 20)
    # without the CA, Firefox refuses our DoH server's certificate: no answer, no page
    assert node.page_hits == [], out[-2000:]

    home = tmp_path / "home"
    p2 = _firefox_profile(home, node.doh, certutil)
    rc, out, err = await _run(*_meshgate("tls", "trust", "--state-dir", str(node.state)), env=_env(home))
    assert rc == 0, out + err
    before = stats.snapshot()
    out = await run_firefox(home, p2, tmp_path / "trusted.png", 90)
    assert len(node.page_hits) == 1 and node.page_hits[0].startswith(b"GET / HTTP/1.1"), (
        node.page_hits, out[-2000:])
    assert b"web.mesh.internal" in node.page_hits[0]  # the browser asked for it by that name
    assert stats.snapshot() != before  # and the name went through our DoH listener
