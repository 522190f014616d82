"""The `meshgate` command (README.md "Commands" lists what a user types)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import logging
import os
import signal
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from meshgate import __version__, config, logs
from meshgate.loop import new_loop

log = logging.getLogger("meshgate")

if TYPE_CHECKING:  # `meshgate check-config` and the queries load no services
    from meshgate.node import Node

EXIT_OK, EXIT_CONFIG, EXIT_STARTUP = 0, 1, 2


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    """CLI flags as a nested dict in config-file shape; they win over the file."""
    o: dict[str, dict[str, Any]] = {}

    def put(section: str, key: str, value: Any) -> None:
        if value is not None:
            o.setdefault(section, {})[key] = value

    put("node", "name", args.name)
    put("node", "network", args.network)
    put("node", "secret", args.secret)
    put("node", "ipv4", args.ipv4)
    put("mesh", "listen", args.listen)
    put("mesh", "peers", args.peer)
    put("mesh", "proxy_cidrs", args.proxy_cidr)
    put("dns", "upstreams", args.upstream)
    for item in args.serve or ():  # PORT=IP:PORT, as [serve] PORT = "IP:PORT"
        port, _, target = item.partition("=")
        o.setdefault("serve", {})[port.strip()] = target.strip()
    if args.exit_node:
        put("mesh", "exit_node", True)
    if args.exit_nodes:
        put("mesh", "exit_nodes", [s.strip() for s in args.exit_nodes.split(",") if s.strip()])
    put("socks5", "listen", args.socks5)
    put("admin", "listen", args.admin)
    out: dict[str, Any] = dict(o)
    if args.log_level:
        out["log_level"] = args.log_level
    return out


def _listener_overrides(cfg: config.Config, args: argparse.Namespace) -> config.Config:
    """`--doh/--doq/--dns ADDR` move the listener of that protocol (or add one).

    Applied after loading so a file's other listeners stay as written; the
    demo uses this to run one config both in containers and on loopback.
    """
    wanted = {"doh": args.doh, "doq": args.doq, "udp": args.dns, "tcp": args.dns}
    listeners = list(cfg.dns.listeners)
    for protocol, addr in wanted.items():
        if addr is None:
            continue
        hp = config.parse_host_port(addr, 53)
        idx = [i for i, lst in enumerate(listeners) if lst.protocol == protocol]
        if idx:
            for i in idx:
                listeners[i] = replace(listeners[i], listen=hp)
        else:
            listeners.append(config.DnsListenerConfig(protocol, hp))
    return replace(cfg, dns=replace(cfg.dns, listeners=tuple(listeners)))


def _print_config_error(e: config.ConfigError) -> None:
    for p in e.problems:
        print(p.render(e.source), file=sys.stderr)


def cmd_check_config(args: argparse.Namespace) -> int:
    status = EXIT_OK
    for path in args.files:
        try:
            cfg = config.load(path)
        except config.ConfigError as e:
            _print_config_error(e)
            status = EXIT_CONFIG
        else:
            for w in config.warnings(cfg):
                print(f"{path}:{w.key}: warning: {w.message}", file=sys.stderr)
            print(f"{path}: ok")
    return status


async def _serve(cfg: config.Config, args: argparse.Namespace | None = None) -> int:
    from meshgate.errors import StartupError
    from meshgate.node import Node

    if args is not None:  # `reload` and SIGHUP re-read this file with the same flags
        node = Node(cfg, config_path=args.config, overrides=_overrides(args),
                    adjust=functools.partial(_listener_overrides, args=args))
    else:
        node = Node(cfg)
    try:
        await node.start()
    except StartupError as e:
        print(f"meshgate: {e}", file=sys.stderr)
        return EXIT_STARTUP
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, node.reload)  # it logs what it applied, or why not
    _print_banner(node)
    await stop.wait()
    await node.stop()
    return EXIT_OK


def _print_banner(node: Node) -> None:
    cfg = node.config
    lines = [f"meshgate {__version__}: node {cfg.node.name!r} on network {cfg.node.network!r}"]
    for name, st in node.status()["services"].items():
        listen = st.get("listen")
        if listen:
            lines.append(f"  {name}: {listen}")
        for extra in st.get("notes", []):
            if not listen or extra not in listen:  # a note that only repeats an address adds nothing
                lines.append(f"  {name}: {extra}")
    print("\n".join(lines), flush=True)


def cmd_run(args: argparse.Namespace) -> int:
    try:
        cfg = _listener_overrides(config.load(args.config, _overrides(args)), args)
    except config.ConfigError as e:
        _print_config_error(e)
        return EXIT_CONFIG
    except ValueError as e:
        print(f"meshgate: --doh/--doq/--dns: {e}", file=sys.stderr)
        return EXIT_CONFIG
    logs.setup(cfg.log_level)
    for w in config.warnings(cfg):
        log.warning("%s: %s", w.key, w.message)
    if args.secret:
        log.warning("--secret: the secret shows in ps and shell history to every user of this host;"
                    " use node.secret_file or $MESHGATE_SECRET")
    loop = new_loop(args.loop)
    try:
        return loop.run_until_complete(_serve(cfg, args))
    finally:
        loop.close()


def _admin_token(args: argparse.Namespace) -> str | None:
    """--token-file's token, else $MESHGATE_ADMIN_TOKEN; None (and a message) if unreadable."""
    token = os.environ.get("MESHGATE_ADMIN_TOKEN", "")
    if args.token_file:
        try:
            token = Path(args.token_file).expanduser().read_text().strip()
        except OSError as e:
            print(f"meshgate: --token-file: cannot read {args.token_file}: {e.strerror}", file=sys.stderr)
            return None
    return token


def _ask_admin(args: argparse.Namespace, path: str, method: str = "GET") -> tuple[int, bytes] | int:
    """(code, body) from the admin API, or the exit status when it could not be asked."""
    from meshgate.admin import fetch

    token = _admin_token(args)
    if token is None:
        return EXIT_CONFIG
    try:
        code, body = asyncio.run(fetch(args.admin, path, token=token, method=method))
    except (OSError, TimeoutError) as e:
        print(f"meshgate: cannot reach the admin API at {args.admin}: {e}", file=sys.stderr)
        return EXIT_STARTUP
    if code != 200:
        print(f"meshgate: admin API at {args.admin} answered {code} for {path}", file=sys.stderr)
        return EXIT_STARTUP
    return code, body


def cmd_reload(args: argparse.Namespace) -> int:
    """`meshgate reload`: POST /reload; prints what was applied or why not (0 applied or
    nothing to change, 1 refused or invalid, 2 the API could not be asked)."""
    got = _ask_admin(args, "/reload", "POST")
    if isinstance(got, int):
        return got
    answer = json.loads(got[1])
    refused = bool(answer["problems"] or answer["restart"])
    print(answer["message"], file=sys.stderr if refused else sys.stdout)
    return EXIT_CONFIG if refused else EXIT_OK


def cmd_admin(args: argparse.Namespace) -> int:
    path = {"status": "/status", "peers": "/peers", "routes": "/routes", "stats": "/metrics"}[
        args.command
    ]
    got = _ask_admin(args, path)
    if isinstance(got, int):
        return got
    body = got[1]
    if args.command == "stats" or args.json:
        sys.stdout.write(body.decode())
        return EXIT_OK
    data = json.loads(body)
    print(_format_table(args.command, data))
    return EXIT_OK


def _format_table(kind: str, data: Any) -> str:
    if kind == "status":
        lines = []
        for k, v in data.items():
            if k == "services":
                continue
            if isinstance(v, list):  # one line each (links), the key on the first
                lines += [f"{k if i == 0 else '':10} {x}" for i, x in enumerate(v)] or [f"{k:10} -"]
            else:
                lines.append(f"{k:10} {v}")
        return "\n".join(lines)
    if not data:
        return f"(no {kind})"
    cols = list(data[0].keys())
    rows = [[_cell(r.get(c)) for c in cols] for r in data]
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
    out = ["  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True))]
    out += ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(out)


def _cell(v: Any) -> str:
    if isinstance(v, list):
        return ",".join(str(x) for x in v) or "-"
    if isinstance(v, dict):
        return json.dumps(v)
    return "-" if v is None else str(v)


def cmd_secret(args: argparse.Namespace) -> int:
    from meshgate import netsecret

    print(netsecret.new_secret())
    return EXIT_OK


def cmd_key(args: argparse.Namespace) -> int:
    """`meshgate key show`: the node's public key (made on first use), for `meshgate ca sign --pub`."""
    from meshgate.mesh.identity import IdentityError, load_or_create, public_text

    cfg = _state_config(args)
    if cfg is None:
        return EXIT_CONFIG
    try:
        ident = load_or_create(cfg.state_path)
    except IdentityError as e:
        print(f"meshgate: {e}", file=sys.stderr)
        return EXIT_STARTUP
    print(public_text(ident.public))
    print(f"fingerprint: {ident.fingerprint}", file=sys.stderr)
    print(f"node id: {ident.node_id:08x}", file=sys.stderr)
    return EXIT_OK


def cmd_ca(args: argparse.Namespace) -> int:
    """`meshgate ca init|sign|revoke|show` (meshgate/mesh/authority.py, docs/OPERATIONS.md)."""
    from meshgate.mesh import authority, certs

    try:
        if args.ca_command == "init":
            ca = authority.init(args.network, Path(args.out), authority.parse_duration(args.valid))
            print(f"CA for network {ca.network!r} in {args.out}: {authority.CA_CERT} (give it to every"
                  f" node as node.ca), {authority.CA_KEY} (keep it offline)")
            print(f"fingerprint: {ca.fingerprint}")
        elif args.ca_command == "sign":
            cert = authority.sign(
                Path(args.ca), name=args.name, public=args.pub, ip=args.ip, ip6=args.ip6,
                cidrs=tuple(args.cidr or ()), exit=args.exit, dns=tuple(args.dns or ()),
                groups=tuple(g for g in (args.groups or "").split(",") if g),
                valid=authority.parse_duration(args.valid),
            )
            Path(args.out).write_text(certs.armor(certs.CERT_LABEL, cert.raw))
            print(f"certificate for {cert.name} in {args.out}; fingerprint {cert.fingerprint}")
        elif args.ca_command == "revoke":
            rl = authority.revoke(Path(args.ca), args.target)
            print(f"{Path(args.ca) / authority.REVOKED}: serial {rl.serial}, {len(rl.revoked)} revoked;"
                  " copy it to any node's node.revocation_list (the mesh carries it to the rest)")
        else:
            print(authority.describe(Path(args.file).read_text()))
    except (authority.AuthorityError, certs.CertError) as e:
        print(f"meshgate: {e}", file=sys.stderr)
        return EXIT_CONFIG
    except OSError as e:
        print(f"meshgate: {e.filename}: {e.strerror or e}", file=sys.stderr)
        return EXIT_CONFIG
    return EXIT_OK


def cmd_acl(args: argparse.Namespace) -> int:
    """`meshgate acl test FROM TO PORT`: which [[acl]] rule of a config decides (egress/acl.py)."""
    import ipaddress as ipa

    from meshgate.egress.acl import Source
    from meshgate.egress.rules import ExitRules

    try:
        cfg = config.load(args.config)
    except config.ConfigError as e:
        _print_config_error(e)
        return EXIT_CONFIG
    name, groups, ip = "", tuple(g for g in (args.groups or "").split(",") if g), None
    if args.source.startswith("node:"):
        name = args.source[5:]
    elif args.source.startswith("group:"):
        groups += (args.source[6:],)
    else:
        try:
            ip = ipa.ip_address(args.source)
        except ValueError:
            print("meshgate: FROM is node:NAME, group:NAME or a virtual IP", file=sys.stderr)
            return EXIT_CONFIG
    try:
        dest = None if args.dest == "self" else ipa.ip_address(args.dest)
    except ValueError:
        print("meshgate: TO is self (this node's virtual IP) or an address", file=sys.stderr)
        return EXIT_CONFIG
    acl = ExitRules(cfg).acl
    d = acl.decide(Source(1, name, groups, ip), dest, args.port, args.proto)
    if not acl.active:
        print("allowed: no [[acl]] rules (every member reaches what this node serves)")
    elif d.allowed:
        assert d.rule is not None
        rule = cfg.acl[d.rule]
        print(f"allowed by acl[{d.rule}] (proto {rule.proto})")
    else:
        print("denied: no [[acl]] rule allows it")
    return EXIT_OK if d.allowed else EXIT_CONFIG


def cmd_dns(args: argparse.Namespace) -> int:
    from meshgate.dns import client

    return client.main(args)


def cmd_dns_log(args: argparse.Namespace) -> int:
    """`meshgate dns log [--follow]`: the node's [dns.query_log], one line per question; with
    --follow, polls /dns/log?since=<last seq> every second until Ctrl-C."""
    import time

    from meshgate.dns.querylog import format_line

    if args.file:
        return _dns_log_file(args.file, args.follow)
    since = 0
    try:
        while True:
            got = _ask_admin(args, f"/dns/log?since={since}")
            if isinstance(got, int):
                return got
            answer = json.loads(got[1])
            if not answer["enabled"]:
                print("meshgate: the query log is off ([dns.query_log] enable = true)", file=sys.stderr)
                return EXIT_CONFIG
            for e in answer["entries"]:
                print(format_line(e), flush=True)
            since = max(since, int(answer["last"]))
            if not args.follow:
                return EXIT_OK
            time.sleep(1.0)
    except KeyboardInterrupt:
        return EXIT_OK


def _rotated_after(path: str, held: int) -> list[str]:
    """The rotated files newer than the one whose inode is `held` (path.K), newest last."""
    import os

    found: list[str] = []
    for k in range(1, 101):  # dns.query_log.keep is at most 100
        try:
            if os.stat(f"{path}.{k}").st_ino == held:
                return list(reversed(found))
        except OSError:
            return []  # not among them (truncated in place, or rotated away): nothing to add
        found.append(f"{path}.{k}")
    return []


def _dns_log_file(path: str, follow: bool) -> int:
    """`meshgate dns log --file PATH [--follow]`: the lines of a [dns.query_log] path file; with
    --follow, the lines added to it (and to the new file once it rotates) until Ctrl-C."""
    import os
    import time

    from meshgate.dns.querylog import format_line

    def show(raw: bytes) -> None:
        try:
            e = json.loads(raw)
        except ValueError:
            e = None
        if isinstance(e, dict):
            print(format_line(e), flush=True)
        else:
            print(f"meshgate: {path}: skipped a line that is not a query log entry", file=sys.stderr)

    try:
        f = open(path, "rb")  # noqa: SIM115 - reopened when the writer rotates it
    except OSError as e:
        print(f"meshgate: cannot read {path}: {e.strerror or e}", file=sys.stderr)
        return EXIT_CONFIG
    partial = b""

    def feed(chunk: bytes) -> None:
        nonlocal partial
        lines = (partial + chunk).split(b"\n")
        partial = lines.pop()  # a line the writer has not finished yet
        for raw in lines:
            if raw.strip():
                show(raw)

    try:
        while True:
            chunk = f.read(65536)
            if chunk:
                feed(chunk)
                continue
            if not follow:
                if partial.strip():
                    show(partial)
                return EXIT_OK
            time.sleep(0.5)
            try:
                st = os.stat(path)
            except OSError:
                continue  # between the writer's rename and its new file: look again
            held = os.fstat(f.fileno()).st_ino
            if st.st_ino != held or st.st_size < f.tell():
                # rotated (a new file at the path) or truncated: the rest of the old one, the
                # files rotated after it (it is now path.K: path.K-1 ... path.1, when the writer
                # rotated more than once between two looks), then the new one from its start
                feed(f.read())
                f.close()
                for newer in _rotated_after(path, held):
                    with contextlib.suppress(OSError), open(newer, "rb") as g:
                        partial = b""
                        feed(g.read())
                f = open(path, "rb")  # noqa: SIM115
                partial = b""
    except KeyboardInterrupt:
        return EXIT_OK
    finally:
        f.close()


def cmd_demo(args: argparse.Namespace) -> int:
    from meshgate import demo

    return demo.main(args)


def _state_config(args: argparse.Namespace) -> config.Config | None:
    """The config `meshgate tls` and `key` read: -c FILE, or the defaults with --state-dir. Without the
    mesh part (a file whose secret comes from $MESHGATE_SECRET at `run` loads without it)."""
    try:
        cfg = config.load(args.config, {"mesh": {"listen": [], "peers": []}})
    except config.ConfigError as e:
        _print_config_error(e)
        return None
    if args.state_dir:
        cfg = replace(cfg, node=replace(cfg.node, state_dir=args.state_dir))
    return cfg


def cmd_tls(args: argparse.Namespace) -> int:
    """`meshgate tls show|trust`: the node's local CA (made if missing, with -c; only read when
    there), and adding it to the NSS databases Chromium and Firefox read (meshgate/tls.py,
    docs/OPERATIONS.md)."""
    from meshgate import tls

    cfg = _state_config(args)
    if cfg is None:
        return EXIT_CONFIG
    ca = cfg.state_path / tls.CA_CERT_NAME
    try:
        if not ca.exists():
            if args.state_dir:  # made here it would carry the default node name
                print(f"meshgate: no local CA in {cfg.state_path} yet: start the node once, or use"
                      " -c CONFIG", file=sys.stderr)
                return EXIT_CONFIG
            ca, _key = tls.ensure_ca(cfg.state_path, cfg.node.name, cfg.dns.zone)
        fingerprint, nickname = tls.fingerprint(ca), tls.ca_nickname(ca)
    except OSError as e:
        print(f"meshgate: {ca}: {e.strerror or e} (run this as the node's user, or as a user who can"
              " read its state directory)", file=sys.stderr)
        return EXIT_STARTUP
    if args.tls_command == "show":
        print(f"CA certificate: {ca}")
        print(f"SHA-256 fingerprint: {fingerprint}")
        print(f"nickname: {nickname}")
        leaf = cfg.state_path / tls.CERT_NAME
        if leaf.exists():
            print(f"listener certificate: {leaf}")
        return EXIT_OK
    return tls.trust(ca, Path.home())


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="meshgate", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="start a node")
    run.add_argument("-c", "--config", help="TOML config file (default: built-in defaults)")
    run.add_argument("--name")
    run.add_argument("--network")
    run.add_argument("--secret", help="shows in ps: prefer node.secret_file or $MESHGATE_SECRET")
    run.add_argument("--ipv4")
    run.add_argument("--listen", action="append", help="mesh listener URL (repeatable)")
    run.add_argument("--peer", action="append", help="mesh peer URL (repeatable)")
    run.add_argument("--socks5", metavar="ADDR")
    run.add_argument("--doh", metavar="ADDR", help="DoH listener address")
    run.add_argument("--doq", metavar="ADDR", help="DoQ listener address")
    run.add_argument("--dns", metavar="ADDR", help="plain DNS (UDP and TCP) listener address")
    run.add_argument("--upstream", action="append", help="DNS upstream URL (repeatable)")
    run.add_argument("--exit-node", action="store_true")
    run.add_argument("--exit-nodes", metavar="IP,...")
    run.add_argument("--proxy-cidr", action="append")
    run.add_argument("--serve", action="append", metavar="PORT=IP:PORT",
                     help="publish a local service on this node's virtual IP (repeatable)")
    run.add_argument("--admin", metavar="ADDR")
    run.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    run.add_argument("--loop", choices=["uvloop", "asyncio"], default="uvloop")
    run.set_defaults(func=cmd_run)

    cc = sub.add_parser("check-config", help="validate config files")
    cc.add_argument("files", nargs="+")
    cc.set_defaults(func=cmd_check_config)

    for name in ("status", "peers", "routes", "stats"):
        a = sub.add_parser(name, help=f"ask a running node for its {name}")
        a.add_argument("--admin", default="127.0.0.1:15888")
        a.add_argument("--token-file", help="admin token (default: $MESHGATE_ADMIN_TOKEN)")
        a.add_argument("--json", action="store_true")
        a.set_defaults(func=cmd_admin)

    rl = sub.add_parser("reload", help="make a running node re-read its config file (as SIGHUP does)")
    rl.add_argument("--admin", default="127.0.0.1:15888")
    rl.add_argument("--token-file", help="admin token (default: $MESHGATE_ADMIN_TOKEN)")
    rl.set_defaults(func=cmd_reload)

    dns = sub.add_parser("dns", help="DNS tools")
    dsub = dns.add_subparsers(dest="dns_command", required=True)
    q = dsub.add_parser("query", help="send one query")
    q.add_argument("qname")
    q.add_argument("qtype", nargs="?", default="A")
    q.add_argument("--server", help="udp://, tcp://, tls://, https://, quic:// URL")
    q.add_argument("--odoh", action="store_true")
    q.add_argument("--proxy")
    q.add_argument("--target")
    q.add_argument("--insecure", "-k", action="store_true", help="do not verify TLS certificates")
    q.add_argument("--cafile")
    q.add_argument("--timeout", type=float, default=5.0)
    q.set_defaults(func=cmd_dns)
    dl = dsub.add_parser("log", help="show a running node's recent DNS questions ([dns.query_log])")
    dl.add_argument("--follow", "-f", action="store_true", help="keep polling every second until Ctrl-C")
    dl.add_argument("--admin", default="127.0.0.1:15888")
    dl.add_argument("--file", metavar="PATH",
                    help="read a [dns.query_log] path file (JSON lines) instead of the node's ring")
    dl.add_argument("--token-file", help="admin token (default: $MESHGATE_ADMIN_TOKEN)")
    dl.set_defaults(func=cmd_dns_log)

    demo = sub.add_parser("demo", help="start the demo mesh on this machine")
    demo.add_argument("--mode", choices=["auto", "netns", "loopback"], default="auto")
    demo.add_argument("--ports", metavar="SOCKS5,DOH,DOQ,ADMIN", help="default 1080,8443,8853,15888")
    demo.add_argument("--prefix", default="mgdemo", help="name prefix for namespaces and links")
    demo.set_defaults(func=cmd_demo)

    sec = sub.add_parser("secret", help="network secrets")
    ssub = sec.add_subparsers(dest="secret_command", required=True)
    sn = ssub.add_parser("new", help="print a new random network secret (256 bits)")
    sn.set_defaults(func=cmd_secret)

    acl = sub.add_parser("acl", help="access rules ([[acl]])")
    aclsub = acl.add_subparsers(dest="acl_command", required=True)
    at = aclsub.add_parser("test", help="say which [[acl]] rule decides a connection (exit 0 allowed)")
    at.add_argument("source", metavar="FROM", help="node:NAME, group:NAME or the source's virtual IP")
    at.add_argument("dest", metavar="TO", help="self (this node's virtual IP) or an address")
    at.add_argument("port", type=int, metavar="PORT")
    at.add_argument("-c", "--config", required=True, help="the node's TOML config file")
    at.add_argument("--proto", choices=["tcp", "udp", "icmp"], default="tcp",
                    help="icmp: PORT is ignored (give 0); rules with ports never match it")
    at.add_argument("--groups", metavar="a,b", help="the source's certificate groups")
    acl.set_defaults(func=cmd_acl)

    k = sub.add_parser("key", help="the node's identity key")
    ksub = k.add_subparsers(dest="key_command", required=True)
    ks = ksub.add_parser("show", help="print the node's public key (made on first use)")
    where = ks.add_mutually_exclusive_group()
    where.add_argument("--state-dir", metavar="DIR", help="the node's state directory")
    where.add_argument("-c", "--config", help="TOML config file (its node.state_dir)")
    ks.set_defaults(func=cmd_key)

    ca = sub.add_parser("ca", help="the network authority: certificates and revocation (offline)")
    casub = ca.add_subparsers(dest="ca_command", required=True)
    ci = casub.add_parser("init", help="make a CA key and certificate")
    ci.add_argument("--network", required=True, help="the network name (node.network)")
    ci.add_argument("--out", required=True, metavar="DIR")
    ci.add_argument("--valid", default="3y", help="e.g. 3y, 365d (default 3y)")
    cs = casub.add_parser("sign", help="issue a node certificate")
    cs.add_argument("--ca", required=True, metavar="DIR")
    cs.add_argument("--name", required=True)
    cs.add_argument("--pub", required=True, metavar="KEY", help="from `meshgate key show` on the node")
    cs.add_argument("--ip", required=True, metavar="ADDR/PREFIX",
                    help="its virtual IPv4, e.g. 10.144.144.5/24")
    cs.add_argument("--ip6", metavar="ADDR/PREFIX")
    cs.add_argument("--cidr", action="append", metavar="CIDR|REAL->MAPPED",
                    help="a proxy CIDR it may advertise")
    cs.add_argument("--exit", action="store_true", help="it may offer itself as an exit node")
    cs.add_argument("--dns", action="append", metavar="SUFFIX",
                    help="a DNS suffix it may answer for the mesh (dns.serve_suffixes), e.g. lan.example.")
    cs.add_argument("--groups", metavar="a,b")
    cs.add_argument("--valid", default="90d")
    cs.add_argument("--out", required=True, metavar="FILE")
    cr = casub.add_parser("revoke", help="revoke a certificate (DIR/revoked, serial + 1)")
    cr.add_argument("--ca", required=True, metavar="DIR")
    cr.add_argument("target", metavar="CERT_OR_FINGERPRINT")
    csh = casub.add_parser("show", help="print a certificate or revocation list in words")
    csh.add_argument("file", metavar="FILE")
    ca.set_defaults(func=cmd_ca)

    t = sub.add_parser("tls", help="the node's local CA: show it, trust it in browsers")
    tsub = t.add_subparsers(dest="tls_command", required=True)
    for name, helptext in (("show", "print the CA certificate's path and SHA-256 fingerprint"),
                           ("trust", "add the CA to this user's NSS databases (Chromium, Firefox)")):
        tc = tsub.add_parser(name, help=helptext)
        where = tc.add_mutually_exclusive_group()
        where.add_argument("--state-dir", metavar="DIR", help="the node's state directory")
        where.add_argument("-c", "--config", help="TOML config file (its node.state_dir)")
        tc.set_defaults(func=cmd_tls)

    v = sub.add_parser("version")
    v.set_defaults(func=lambda _a: print(f"meshgate {__version__}") or 0)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    rc: int = args.func(args)
    return rc


if __name__ == "__main__":
    sys.exit(main())
