"""`meshgate demo`: the docker-compose topology on one machine, without Docker.

    host ── portal ──front── relay ──back── exit ──lan── web

netns mode (root on Linux): relay, exit and web each get a network
namespace joined by veth pairs with the compose file's addresses; the portal
runs in the host namespace (its listeners on 127.0.0.1, exactly the ports
compose publishes), linked to the relay by the `front` veth pair.

loopback mode (anyone): the same three nodes as processes on 127.0.0.1, and
the web page on 127.0.0.10, which the exit proxies under the same mapped
prefix, so http://10.2.2.10:PORT/ and web.mesh.internal work the same way.

Both use examples/demo/*.toml; the differences are CLI overrides, printed.
Ctrl-C (or SIGTERM) stops every process and removes what was created.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from meshgate.netsecret import new_secret

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "demo"


def free(host: str = "127.0.0.1") -> int:
    """A port nobody listens on right now (the demo starts its nodes on these)."""
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class Ports:
    socks5: int = 1080
    doh: int = 8443
    doq: int = 8853
    admin: int = 15888


@dataclass
class Demo:
    mode: str
    ports: Ports
    prefix: str
    configs: Path
    procs: list[tuple[str, subprocess.Popen[bytes]]] = field(default_factory=list)
    netns: list[str] = field(default_factory=list)
    host_links: list[str] = field(default_factory=list)
    web_port: int = 80
    log_dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="meshgate-demo-")))
    # $MESHGATE_SECRET if given, else a new random one for this run: a fixed fallback would let
    # anyone who knows meshgate's source join every demo mesh on a shared network
    secret: str = field(default_factory=lambda: os.environ.get("MESHGATE_SECRET") or new_secret(), repr=False)

    # ------------------------------------------------------------------ processes
    def spawn(self, name: str, argv: list[str], netns: str | None = None) -> None:
        env = {**os.environ, "MESHGATE_SECRET": self.secret}
        env["PYTHONPATH"] = str(EXAMPLES.parent.parent) + os.pathsep + env.get("PYTHONPATH", "")
        if netns:
            argv = ["ip", "netns", "exec", netns, *argv]
        log = open(self.log_dir / f"{name}.log", "wb")  # noqa: SIM115 - lives as long as the process
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.procs.append((name, proc))

    def node(self, name: str, overrides: list[str], netns: str | None = None) -> None:
        argv = [sys.executable, "-m", "meshgate", "run", "-c", str(self.configs / f"{name}.toml")]
        self.spawn(name, argv + overrides, netns)

    def stop(self) -> None:
        for _name, proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for _name, proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self.procs.clear()
        for link in self.host_links:
            subprocess.run(["ip", "link", "del", link], capture_output=True)
        for ns in self.netns:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.host_links.clear()
        self.netns.clear()

    # ------------------------------------------------------------------ topologies
    def start_netns(self) -> None:
        p = self.prefix
        ns = {role: f"{p}-{role}" for role in ("relay", "exit", "web")}
        # Leftovers of a demo that was killed: remove them first.
        for name in ns.values():
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        subprocess.run(["ip", "link", "del", f"{p}-front"], capture_output=True)

        def ip(*args: str) -> None:
            subprocess.run(["ip", *args], check=True, capture_output=True)

        for name in ns.values():
            ip("netns", "add", name)
            self.netns.append(name)
            ip("-n", name, "link", "set", "lo", "up")
        # front: host (portal) <-> relay
        ip("link", "add", f"{p}-front", "type", "veth", "peer", "name", "front0", "netns", ns["relay"])
        self.host_links.append(f"{p}-front")
        ip("addr", "add", "172.28.1.2/24", "dev", f"{p}-front")
        # No IPv6 link-local on the host's side: its DAD finishing a second after the link comes up is
        # an address change, and browsers abort page loads that straddle one (net::ERR_NETWORK_CHANGED).
        ip("link", "set", "dev", f"{p}-front", "addrgenmode", "none")
        ip("link", "set", f"{p}-front", "up")
        ip("-n", ns["relay"], "addr", "add", "172.28.1.3/24", "dev", "front0")
        ip("-n", ns["relay"], "link", "set", "front0", "up")
        # back: relay <-> exit
        ip("-n", ns["relay"], "link", "add", "back0", "type", "veth", "peer", "name", "back0",
           "netns", ns["exit"])
        ip("-n", ns["relay"], "addr", "add", "172.28.2.3/24", "dev", "back0")
        ip("-n", ns["relay"], "link", "set", "back0", "up")
        ip("-n", ns["exit"], "addr", "add", "172.28.2.4/24", "dev", "back0")
        ip("-n", ns["exit"], "link", "set", "back0", "up")
        # lan: exit <-> web
        ip("-n", ns["exit"], "link", "add", "lan0", "type", "veth", "peer", "name", "lan0",
           "netns", ns["web"])
        ip("-n", ns["exit"], "addr", "add", "10.1.2.2/24", "dev", "lan0")
        ip("-n", ns["exit"], "link", "set", "lan0", "up")
        ip("-n", ns["web"], "addr", "add", "10.1.2.10/24", "dev", "lan0")
        ip("-n", ns["web"], "link", "set", "lan0", "up")

        self.spawn("web", [sys.executable, "-m", "meshgate.demo_web", "--bind", "0.0.0.0",
                           "--port", "80", "--name", "web"], ns["web"])
        self.node("exit", [], ns["exit"])
        self.node("relay", [], ns["relay"])
        self.node("portal", self.portal_overrides())

    def start_loopback(self) -> None:
        relay_port, exit_port, exit_dns = free(), free(), free()
        web_port = free("127.0.0.10")
        self.spawn("web", [sys.executable, "-m", "meshgate.demo_web", "--bind", "127.0.0.10",
                           "--port", str(web_port), "--name", "web"])
        self.node("exit", ["--listen", f"tcp://127.0.0.1:{exit_port}",
                           "--proxy-cidr", "127.0.0.0/24->10.2.2.0/24",
                           "--dns", f"127.0.0.1:{exit_dns}", "--admin", f"127.0.0.1:{free()}",
                           # the portal's DNS upstream is this resolver, at the exit's virtual IP
                           "--serve", f"{exit_dns}=127.0.0.1:{exit_dns}"])
        self.node("relay", ["--listen", f"tcp://127.0.0.1:{relay_port}",
                            "--peer", f"tcp://127.0.0.1:{exit_port}", "--admin", f"127.0.0.1:{free()}"])
        self.node("portal", [*self.portal_overrides(), "--peer", f"tcp://127.0.0.1:{relay_port}",
                             "--upstream", f"tcp://10.144.144.3:{exit_dns}"])
        self.web_port = web_port

    def portal_overrides(self) -> list[str]:
        pt = self.ports
        return ["--socks5", f"127.0.0.1:{pt.socks5}", "--doh", f"127.0.0.1:{pt.doh}",
                "--doq", f"127.0.0.1:{pt.doq}", "--admin", f"127.0.0.1:{pt.admin}"]

    # ------------------------------------------------------------------ readiness
    def web_listening(self) -> bool:
        """demo_web prints its line once its socket listens (a separate process: not implied by routes)."""
        try:
            return "demo web " in (self.log_dir / "web.log").read_text(errors="replace")
        except OSError:
            return False

    def wait_ready(self, timeout: float = 60.0) -> bool:
        """Ready when the portal's admin API lists the exit (and the lan it proxies) as reachable
        and the web page's server listens."""
        deadline = time.monotonic() + timeout
        url = f"http://127.0.0.1:{self.ports.admin}/routes"
        while time.monotonic() < deadline:
            for name, proc in self.procs:
                if proc.poll() is not None:
                    print(f"demo: {name} exited with {proc.returncode}; see {self.log_dir}/{name}.log",
                          file=sys.stderr)
                    return False
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    routes = json.loads(r.read())
            except (OSError, ValueError):
                routes = []
            # the exit's record carries both its exit offer and the mapped lan
            if self.web_listening() and any(
                rt.get("name") == "exit" and "10.2.2.0/24" in rt.get("proxy_cidrs", []) for rt in routes
            ):
                return True
            time.sleep(0.2)
        return False

    def url(self, host: str) -> str:
        return f"http://{host}/" if self.web_port == 80 else f"http://{host}:{self.web_port}/"

    def banner(self) -> str:
        pt = self.ports
        return f"""
meshgate demo is up ({self.mode} mode): portal -> relay -> exit -> web

  Browser:  SOCKS5 host 127.0.0.1, port {pt.socks5}, SOCKS v5, "proxy DNS" (remote DNS) on
            (Chromium: chromium --proxy-server=socks5://127.0.0.1:{pt.socks5})
            then open {self.url("10.2.2.10")}  or  {self.url("web.mesh.internal")}
  DoH URL:  https://127.0.0.1:{pt.doh}/dns-query   (DoQ: quic://127.0.0.1:{pt.doq})
            a browser uses it once it trusts the portal's local CA:
            meshgate tls trust --state-dir /tmp/meshgate-demo/portal

  Try:
    curl --proxy socks5h://127.0.0.1:{pt.socks5} {self.url("10.2.2.10")}
    kdig +https @127.0.0.1 -p {pt.doh} exit.mesh.internal A

  Console:  http://127.0.0.1:{pt.admin}/   (the portal's mesh, peers, routes, DNS, config)
  Inspect:  meshgate routes --admin 127.0.0.1:{pt.admin}     logs: {self.log_dir}
  Stop:     Ctrl-C (removes everything the demo created)
"""


def main(args: argparse.Namespace) -> int:
    mode = args.mode
    if mode == "auto":
        mode = "netns" if os.geteuid() == 0 and shutil.which("ip") and sys.platform == "linux" else "loopback"
    ports = Ports(*(int(x) for x in args.ports.split(","))) if getattr(args, "ports", None) else Ports()
    demo = Demo(mode, ports, getattr(args, "prefix", None) or "mgdemo", EXAMPLES)
    stop = False

    def on_signal(_sig: int, _frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        demo.start_netns() if mode == "netns" else demo.start_loopback()
        if not demo.wait_ready():
            print(f"demo: the mesh did not come up; logs in {demo.log_dir}", file=sys.stderr)
            return 2
        print(demo.banner(), flush=True)
        while not stop and all(p.poll() is None for _, p in demo.procs):
            time.sleep(0.5)
        dead = [n for n, p in demo.procs if p.poll() is not None]
        if dead and not stop:
            print(f"demo: {', '.join(dead)} stopped; logs in {demo.log_dir}", file=sys.stderr)
            return 2
        return 0
    except subprocess.CalledProcessError as e:
        print(f"demo: setting up namespaces failed: {' '.join(map(str, e.cmd))}: "
              f"{(e.stderr or b'').decode().strip()}", file=sys.stderr)
        return 2
    finally:
        demo.stop()
        print("demo: stopped and cleaned up", flush=True)
