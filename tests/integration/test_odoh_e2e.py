"""ODoH end to end over TLS on loopback: client -> proxy -> target in separate processes.

Two `meshgate run` processes share one module-scoped set-up:

* "target" node: ODoH target on T (allow_doh, so plain DoH works on the same
  listener for comparison) and a second target on T2 with no DoH and a short
  key rotation;
* "proxy" node: an ODoH proxy on P (allow-list: the target, and an in-test
  server that redirects) and a dual listener on D (IP targets allowed).

The client is `meshgate dns query --odoh` as a third process. Tests that must
look inside a role (what the proxy received, what the target saw) run that
role in the test process instead, with the other two still separate.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from meshgate import config
from meshgate.dns import odoh
from meshgate.dns.h2client import H2ClientConnection, H2Response, client_ssl_context, connect
from meshgate.dns.resolver import Pipeline
from meshgate.tls import ensure_self_signed
from tests.helpers import async_wait_until, free_port, wait_until

ROOT = Path(__file__).resolve().parents[2]
NAME = "secret-name.example"
NAME_WIRE = b"\x0bsecret-name\x07example\x00"
ADDR = "10.9.8.7"
MEDIA = odoh.MEDIA_TYPE.encode()

# Queries are only ever for local records: the pipeline's one upstream is a
# dead loopback port, so nothing leaves the machine.
RECORDS = f'records = {{ "{NAME}." = "{ADDR}", "v6.example." = "fd00::7" }}'


@dataclass
class Net:
    tmp: Path
    cert: Path
    key: Path
    target: int
    target2: int
    proxy: int
    dual: int
    redirect: int
    procs: list[subprocess.Popen[bytes]]


def _config(tmp: Path, name: str, listeners: str) -> Path:
    path = tmp / f"{name}.toml"
    path.write_text(
        f'log_level = "warning"\n[node]\nname = "{name}"\nstate_dir = "{tmp / name}"\n'
        f'[socks5]\nenable = false\n[admin]\nenable = false\n'
        f'[dns]\nupstreams = ["udp://127.0.0.1:9"]\n{RECORDS}\n{listeners}'
    )
    return path


def _listener(port: int, cert: Path, key: Path, **kw: Any) -> str:
    out = f'[[dns.listener]]\nprotocol = "odoh"\nlisten = "127.0.0.1:{port}"\n'
    out += f'cert = "{cert}"\nkey = "{key}"\n'
    for k, v in kw.items():
        if isinstance(v, bool):
            out += f"{k} = {'true' if v else 'false'}\n"
        elif isinstance(v, list):
            out += f"{k} = [{', '.join(repr(x).replace(chr(39), chr(34)) for x in v)}]\n"
        else:
            out += f'{k} = {v if isinstance(v, float) else chr(34) + str(v) + chr(34)}\n'
    return out


def _start(cfg: Path, log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with open(log, "wb") as f:
        return subprocess.Popen(
            [sys.executable, "-m", "meshgate", "run", "-c", str(cfg)],
            stdout=f, stderr=subprocess.STDOUT, cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT), **env},
        )


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


@pytest.fixture(scope="module")
def net(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Net]:
    tmp = tmp_path_factory.mktemp("odoh")
    # One self-signed certificate (SAN localhost, 127.0.0.1) for every role, so
    # one --cafile / SSL_CERT_FILE trusts them all.
    cert, key = ensure_self_signed(tmp / "pki")
    ports = [free_port() for _ in range(5)]
    t, t2, p, d, r = ports
    target_cfg = _config(
        tmp, "target",
        _listener(t, cert, key, mode="target", allow_doh=True)
        + _listener(t2, cert, key, mode="target", key_rotation=1.0),
    )
    proxy_cfg = _config(
        tmp, "proxy",
        _listener(p, cert, key, mode="proxy", targets=[f"localhost:{t}", f"localhost:{r}"])
        + _listener(d, cert, key, mode="dual", allow_ip_targets=True),
    )
    env = {"SSL_CERT_FILE": str(cert)}  # the proxy trusts the target's certificate
    procs = [_start(target_cfg, tmp / "target.log", env), _start(proxy_cfg, tmp / "proxy.log", env)]
    net = Net(tmp, cert, key, t, t2, p, d, r, procs)
    try:
        for port in (t, t2, p, d):
            wait_until(lambda port=port: _listening(port) or any(x.poll() is not None for x in procs),
                       30, f"listener on {port}")
        for x, name in zip(procs, ("target", "proxy"), strict=True):
            assert x.poll() is None, (tmp / f"{name}.log").read_text()
        yield net
    finally:
        for x in procs:
            x.terminate()
        for x in procs:
            try:
                x.wait(10)
            except subprocess.TimeoutExpired:
                x.kill()
                x.wait()
    # A clean stop (exit 0) and no traceback in either node's output.
    for x, name in zip(procs, ("target", "proxy"), strict=True):
        text = (tmp / f"{name}.log").read_text()
        assert "Traceback" not in text, text
        assert x.returncode == 0, text


async def _cli(*args: str, cafile: Path) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "meshgate", "dns", "query", *args, "--cafile", str(cafile), "--timeout", "10",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def _answer_section(text: str) -> list[str]:
    lines = text.splitlines()
    if ";; ANSWER SECTION:" not in lines:
        return []
    i = lines.index(";; ANSWER SECTION:") + 1
    out = []
    while i < len(lines) and lines[i]:
        out.append(lines[i])
        i += 1
    return out


def _status_line(text: str) -> str:
    return next(line for line in text.splitlines() if "status:" in line).split("status:")[1].split(",")[0]


async def _h2(port: int, cert: Path) -> H2ClientConnection:
    return await connect("127.0.0.1", port, client_ssl_context(cafile=str(cert)), "localhost", 10)


async def _req(conn: H2ClientConnection, method: bytes, path: str, body: bytes = b"",
               headers: list[tuple[bytes, bytes]] | None = None) -> H2Response:
    if headers is None:
        headers = [(b"content-type", MEDIA)] if body else []
    _, fut = conn.request(method, b"localhost", path.encode(), headers, body)
    return await asyncio.wait_for(fut, 15)


def _query_wire() -> bytes:
    import dns.message

    q = dns.message.make_query(NAME, "A", use_edns=0)
    q.id = 0
    return q.to_wire()


async def _config_of(port: int, cert: Path) -> odoh.ObliviousDoHConfigContents:
    conn = await _h2(port, cert)
    try:
        r = await _req(conn, b"GET", odoh.CONFIGS_PATH)
        assert r.status == 200
        return odoh.decode_configs(r.body)[0]
    finally:
        conn.close()


# --------------------------------------------------------------------------- happy paths


@pytest.mark.parametrize("qtype", ["A", "AAAA"])
async def test_odoh_answers_match_plain_doh(net: Net, qtype: str) -> None:
    name = NAME if qtype == "A" else "v6.example"
    rc, out, err = await _cli(
        name, qtype, "--odoh", "--proxy", f"https://localhost:{net.proxy}/dns-query",
        "--target", f"https://localhost:{net.target}/dns-query", cafile=net.cert,
    )
    assert rc == 0, err
    # 127.0.0.1, not localhost: dnspython would look the name up in DNS.
    rc2, plain, err2 = await _cli(name, qtype, "--server", f"https://127.0.0.1:{net.target}/dns-query",
                                  cafile=net.cert)
    assert rc2 == 0, err2
    odoh_answers = _answer_section(out)
    assert odoh_answers and odoh_answers == _answer_section(plain)
    assert (ADDR if qtype == "A" else "fd00::7") in odoh_answers[0]


async def test_nxdomain_through_dual_proxy(net: Net) -> None:
    # The dual listener proxies (IP targets allowed there) and is itself a target.
    rc, out, err = await _cli(
        "nope.mesh.internal", "A", "--odoh", "--proxy", f"https://127.0.0.1:{net.dual}/dns-query",
        "--target", f"https://localhost:{net.target}/dns-query", cafile=net.cert,
    )
    assert rc == 0, err
    assert _status_line(out).strip() == "NXDOMAIN"
    rc, out, err = await _cli(
        NAME, "A", "--odoh", "--proxy", f"https://localhost:{net.proxy}/dns-query",
        "--target", f"https://localhost:{net.dual}/dns-query", cafile=net.cert,
    )
    assert rc == 2  # the proxy's allow-list does not name the dual listener
    assert "403" in err and "http_request_denied" in err


async def test_key_rotation_changes_config(net: Net) -> None:
    first = await _config_of(net.target2, net.cert)
    seen: list[odoh.ObliviousDoHConfigContents] = []

    async def rotated() -> bool:
        seen.append(await _config_of(net.target2, net.cert))
        return seen[-1] != first

    await async_wait_until(rotated, 15, "the target to rotate its key (key_rotation = 1)")
    assert seen[-1].key_id() != first.key_id()


# --------------------------------------------------------------------------- bad input at the target


async def test_target_bad_input(net: Net) -> None:
    cfg = await _config_of(net.target2, net.cert)
    conn = await _h2(net.target2, net.cert)
    try:
        wire, ctx = odoh.seal_query(cfg, _query_wire())
        r = await _req(conn, b"POST", "/dns-query", wire)
        assert r.status == 200 and r.header(b"content-type") == MEDIA
        # The answer opens, and it is ours.
        assert NAME_WIRE in ctx.open_response(r.body)

        assert (await _req(conn, b"GET", "/dns-query")).status == 405  # no allow_doh here
        assert (await _req(conn, b"PUT", "/dns-query", wire)).status == 405
        r = await _req(conn, b"POST", "/dns-query", wire, [(b"content-type", b"application/dns-message")])
        assert r.status == 415
        assert (await _req(conn, b"POST", odoh.CONFIGS_PATH, wire)).status == 405
        assert (await _req(conn, b"POST", "/elsewhere", wire)).status == 404

        stranger = odoh.seal_query(odoh.TargetKey.generate().config, _query_wire())[0]
        assert (await _req(conn, b"POST", "/dns-query", stranger)).status == 401

        tampered = bytearray(wire)
        tampered[-3] ^= 0x40
        assert (await _req(conn, b"POST", "/dns-query", bytes(tampered))).status == 400

        wrong_type = bytearray(wire)
        wrong_type[0] = odoh.RESPONSE
        assert (await _req(conn, b"POST", "/dns-query", bytes(wrong_type))).status == 400

        assert (await _req(conn, b"POST", "/dns-query", _nonzero_padding(cfg))).status == 400
        assert (await _req(conn, b"POST", "/dns-query", b"\x01\x00")).status == 400

        assert (await _req(conn, b"POST", "/dns-query", bytes(70000))).status == 413

        # After all that the connection still serves.
        wire, ctx = odoh.seal_query(cfg, _query_wire())
        r = await _req(conn, b"POST", "/dns-query", wire)
        assert r.status == 200 and NAME_WIRE in ctx.open_response(r.body)
    finally:
        conn.close()


def _nonzero_padding(cfg: odoh.ObliviousDoHConfigContents) -> bytes:
    import struct

    q = _query_wire()
    plain = struct.pack(">H", len(q)) + q + struct.pack(">H", 8) + b"\x00" * 7 + b"\x01"
    pk = odoh.SUITE.kem.deserialize_public_key(cfg.public_key)
    enc, sender = odoh.SUITE.create_sender_context(pk, info=b"odoh query")
    kid = cfg.key_id()
    aad = struct.pack(">BH", odoh.QUERY, len(kid)) + kid
    return odoh.ObliviousMessage(odoh.QUERY, kid, enc + sender.seal(plain, aad)).encode()


# --------------------------------------------------------------------------- bad input at the proxy


async def test_proxy_bad_input(net: Net) -> None:
    cfg = await _config_of(net.target, net.cert)
    wire, ctx = odoh.seal_query(cfg, _query_wire())
    conn = await _h2(net.proxy, net.cert)
    good = f"/dns-query?targethost=localhost:{net.target}&targetpath=/dns-query"
    try:
        r = await _req(conn, b"POST", good, wire)
        assert r.status == 200 and r.header(b"proxy-status") == b"meshgate; received-status=200"
        assert NAME_WIRE in ctx.open_response(r.body)

        r = await _req(conn, b"GET", good)
        assert r.status == 405 and r.header(b"proxy-status") is not None
        r = await _req(conn, b"POST", good, wire, [(b"content-type", b"application/dns-message")])
        assert r.status == 415
        r = await _req(conn, b"POST", good, bytes(70000))
        assert r.status == 413

        for host in (f"127.0.0.1:{net.target}", f"[::1]:{net.target}", f"2130706433:{net.target}"):
            r = await _req(conn, b"POST", f"/dns-query?targethost={host}&targetpath=/dns-query", wire)
            assert r.status == 403, host
            assert b"error=destination_ip_prohibited" in (r.header(b"proxy-status") or b""), host
        r = await _req(conn, b"POST", "/dns-query?targethost=odoh.example&targetpath=/dns-query", wire)
        assert r.status == 403 and b"http_request_denied" in (r.header(b"proxy-status") or b"")
        r = await _req(conn, b"POST", f"/dns-query?targethost=localhost:{net.target}", wire)
        assert r.status == 400 and b"http_request_error" in (r.header(b"proxy-status") or b"")

        # The target's own answers (here 401) come back unmodified, with Proxy-Status.
        stranger = odoh.seal_query(odoh.TargetKey.generate().config, _query_wire())[0]
        r = await _req(conn, b"POST", good, stranger)
        assert r.status == 401 and r.header(b"proxy-status") == b"meshgate; received-status=401"
    finally:
        conn.close()


async def test_proxy_refuses_to_follow_redirects(net: Net) -> None:
    """A target answering 3xx gets a 502 with Proxy-Status, and the Location is never fetched."""
    from meshgate.config import LimitsConfig
    from meshgate.dns.h2server import start_h2
    from meshgate.dns.stats import ListenerStats
    from meshgate.tls import server_context

    hits: list[str] = []

    def handler(method: str, path: str, headers: list[tuple[str, str]], body: bytes) -> Any:
        hits.append(path)
        return (307, [("location", f"https://localhost:{net.target}/dns-query")], b"")

    server, conns = await start_h2(handler, ListenerStats("redirector"), LimitsConfig(), "127.0.0.1",
                                   net.redirect, server_context(net.cert, net.key, ["h2"]))
    conn = await _h2(net.proxy, net.cert)
    try:
        cfg = await _config_of(net.target, net.cert)
        wire, _ = odoh.seal_query(cfg, _query_wire())
        r = await _req(conn, b"POST", f"/dns-query?targethost=localhost:{net.redirect}&targetpath=/q", wire)
        assert r.status == 502
        status = r.header(b"proxy-status") or b""
        assert b"error=http_protocol_error" in status and b"received-status=307" in status
        assert hits == ["/q"]
        assert r.body == b""
    finally:
        conn.close()
        server.close()
        for c in list(conns):  # the proxy's pooled connection to us ends with this test
            if c.transport is not None:
                c.transport.close()
        await server.wait_closed()


async def test_proxy_unreachable_target_is_502(net: Net) -> None:
    conn = await _h2(net.dual, net.cert)
    try:
        dead = free_port()
        r = await _req(conn, b"POST", f"/dns-query?targethost=127.0.0.1:{dead}&targetpath=/dns-query", b"x")
        assert r.status == 502
        assert (r.header(b"proxy-status") or b"").startswith(b"meshgate; error=connection_refused")
    finally:
        conn.close()


# --------------------------------------------------------------------------- one role in process


def _node(listener: dict[str, Any], tmp: Path) -> types.SimpleNamespace:
    cfg = config.from_dict({"node": {"state_dir": str(tmp)}, "dns": {"listener": [listener]}})
    return types.SimpleNamespace(config=cfg)


async def test_proxy_never_sees_query_in_clear(net: Net, tmp_path: Path) -> None:
    from meshgate.dns.odoh_server import build_listener

    port = free_port()
    node = _node({"protocol": "odoh", "listen": f"127.0.0.1:{port}", "mode": "proxy", "cert": str(net.cert),
                  "key": str(net.key), "targets": [f"localhost:{net.target}"]}, tmp_path)
    listener = await build_listener(node.config, node.config.dns.listeners[0],
                                    Pipeline(node.config, upstreams=[]))
    assert listener.app is not None and listener.app.proxy is not None
    proxy = listener.app.proxy
    proxy.pool.ssl_ctx = client_ssl_context(cafile=str(net.cert))
    proxy.debug_capture = []
    try:
        rc, out, err = await _cli(
            NAME, "A", "--odoh", "--proxy", f"https://localhost:{port}/dns-query",
            "--target", f"https://localhost:{net.target}/dns-query", cafile=net.cert,
        )
        assert rc == 0, err
        assert ADDR in "".join(_answer_section(out))
    finally:
        await listener.close()
    assert len(proxy.debug_capture) == 1
    body = proxy.debug_capture[0]
    assert NAME_WIRE not in body and b"secret-name" not in body and NAME.encode() not in body
    assert body[0] == odoh.QUERY


async def test_target_never_sees_client_address_or_headers(net: Net, tmp_path: Path) -> None:
    from meshgate.dns.h2server import current_peer, start_h2
    from meshgate.dns.odoh_server import OdohApp
    from meshgate.dns.stats import ListenerStats
    from meshgate.tls import server_context

    # The target in process, on the port the proxy process allow-lists, with a
    # spy in front of the ODoH app (what the HTTP layer hands it) and on the
    # pipeline front end (what the resolver is told about the asker).
    node = _node({"protocol": "odoh", "listen": f"127.0.0.1:{net.redirect}", "mode": "target"}, tmp_path)
    lcfg = node.config.dns.listeners[0]
    stats = ListenerStats("odoh-target-spy")
    app = OdohApp(lcfg, node.config.limits, Pipeline(node.config, upstreams=[]), stats)
    assert app.target is not None
    seen: list[tuple[Any, list[tuple[str, str]]]] = []
    peers: list[object] = []

    def spy(method: str, path: str, headers: list[tuple[str, str]], body: bytes) -> Any:
        seen.append((current_peer.get(), headers))
        return app(method, path, headers, body)

    frontend = app.target.frontend
    inner_query = frontend.query

    def query_spy(data: Any, now: float, peer: object, **kw: Any) -> Any:
        peers.append(peer)
        return inner_query(data, now, peer, **kw)

    frontend.query = query_spy  # type: ignore[method-assign]
    server, conns = await start_h2(spy, stats, node.config.limits, "127.0.0.1", net.redirect,
                                   server_context(net.cert, net.key, ["h2"]))
    try:
        cfg = odoh.decode_configs(app.target.configs()[2])[0]  # type: ignore[arg-type]
        wire, ctx = odoh.seal_query(cfg, _query_wire())
        conn = await _h2(net.proxy, net.cert)
        assert conn.transport is not None
        client_addr = conn.transport.get_extra_info("sockname")
        identifying = [
            (b"user-agent", b"client-identity/1.0"),
            (b"x-forwarded-for", b"198.51.100.77"),
            (b"forwarded", b"for=198.51.100.77"),
            (b"cookie", b"session=client-secret"),
            (b"authorization", b"Bearer client-secret"),
        ]
        r = await _req(conn, b"POST",
                       f"/dns-query?targethost=localhost:{net.redirect}&targetpath=/dns-query", wire,
                       [(b"content-type", MEDIA), *identifying])
        conn.close()
        assert r.status == 200, r.header(b"proxy-status")
        assert NAME_WIRE in ctx.open_response(r.body)
    finally:
        server.close()
        for c in list(conns):
            if c.transport is not None:
                c.transport.close()
        await server.wait_closed()
        app.close()
    assert len(seen) == 1
    peer, headers = seen[0]
    names = {k for k, _ in headers}
    assert names <= {":authority", ":scheme", "content-type", "accept", "content-length"}, names
    text = repr(headers)
    assert "client-identity" not in text and "198.51.100.77" not in text and "client-secret" not in text
    # The connection the target saw is the proxy's, not the client's.
    assert tuple(peer[:2]) != tuple(client_addr[:2])
    # And the resolver pipeline was given no address at all.
    assert peers == ["odoh-client"]




async def test_pipeline_odoh_upstream(net: Net) -> None:
    """The resolver pipeline with an odoh:// upstream (through the proxy process)."""
    from meshgate.dns import wire
    from meshgate.dns.upstream import parse_upstream

    url = f"odoh://localhost:{net.target}/dns-query?proxy=https://localhost:{net.proxy}/dns-query"
    up = parse_upstream(url, verify=str(net.cert))
    cfg = config.from_dict({"dns": {"upstreams": [url]}})
    pipeline = Pipeline(cfg, upstreams=[up])
    try:
        qname = wire.encode_name(NAME)
        q = wire.Query(0x1234, wire.FLAG_RD, qname + b"\x00\x01\x00\x01", qname, wire.TYPE_A, wire.CLASS_IN)
        ans = await pipeline.resolve(q)
        assert ans is not None and ans.rcode == wire.NOERROR
        assert [a for _t, a in wire.answer_addresses(ans)] == [bytes([10, 9, 8, 7])]
    finally:
        up.close()  # type: ignore[attr-defined]
