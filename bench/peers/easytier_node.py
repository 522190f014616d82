#!/usr/bin/env python3
"""Run one EasyTier node (the Rust core, from PyPI `easytier-pyo3`) in the foreground, as a
side-by-side peer for benchmarks. No TUN, no root needed for the node itself.

    python easytier_node.py --name a --ip 10.144.144.1 --listen tcp://127.0.0.1:21010 --socks5 127.0.0.1:21080
    python easytier_node.py --name b --ip 10.144.144.2 --peer tcp://127.0.0.1:21010
    python easytier_node.py --baseline      # the interpreter and the import only, no node

In no-TUN mode a node rewrites its own virtual IP to 127.0.0.1, so a server on 127.0.0.1:PORT
"behind" node b is reached through a's portal as 10.144.144.2:PORT.

EasyTier's defaults contact public STUN servers. This script points every STUN list at
loopback and refuses to start unless the process sits in a network namespace that has only
loopback: run it (and the benchmark that talks to it) under bench/peers/isolated.
Prints one JSON line {"ready": true, ...} once it has at least --expect-routes routes
(or immediately with --expect-routes 0), then runs until SIGTERM/SIGINT.

`--baseline` imports `easytier_pyo3` the same way, prints the same ready line and idles
without starting a node: its RSS is what the Python interpreter hosting the core costs, so a
benchmark can report EasyTier's RSS with and without it (bench/portal.py does).
"""
import argparse
import json
import signal
import sys
import threading
import time


def only_loopback() -> bool:
    with open("/proc/self/net/dev") as f:
        names = [line.split(":")[0].strip() for line in f.readlines()[2:]]
    return names == ["lo"]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", action="store_true",
                    help="import easytier_pyo3 and idle, no node (the interpreter's own RSS)")
    ap.add_argument("--name")
    ap.add_argument("--ip", help="virtual IPv4, e.g. 10.144.144.1")
    ap.add_argument("--listen", action="append", default=[], help="e.g. tcp://127.0.0.1:21010")
    ap.add_argument("--peer", action="append", default=[], help="e.g. tcp://127.0.0.1:21010")
    ap.add_argument("--socks5", help="portal address, e.g. 127.0.0.1:21080")
    ap.add_argument("--proxy-cidr", action="append", default=[])
    ap.add_argument("--exit-node", action="store_true", help="offer this node as an exit")
    ap.add_argument("--exit-nodes", default="", help="comma-separated virtual IPs to use as exits")
    ap.add_argument("--network", default="bench")
    ap.add_argument("--secret", default="bench-secret")
    ap.add_argument("--expect-routes", type=int, default=0)
    a = ap.parse_args()
    if not only_loopback():
        print("easytier_node: not in a loopback-only network namespace; run under bench/peers/isolated",
              file=sys.stderr)
        return 2
    import easytier_pyo3 as et

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    if a.baseline:
        print(json.dumps({"ready": True, "version": et.version(), "baseline": True}), flush=True)
        stop.wait()
        return 0
    if not a.name or not a.ip:
        ap.error("--name and --ip are required (unless --baseline)")

    cfg = {
        "instance_name": a.name,
        "hostname": a.name,
        "network_identity": {"network_name": a.network, "network_secret": a.secret},
        "ipv4": f"{a.ip}/24",
        "listeners": a.listen,
        "peer": [{"uri": u} for u in a.peer],
        "stun_servers": ["127.0.0.1:3478"],
        "tcp_stun_servers": ["127.0.0.1:3478"],
        "stun_servers_v6": ["[::1]:3478"],
        "flags": {"no_tun": True, "bind_device": False, "disable_upnp": True,
                  "enable_exit_node": a.exit_node},
    }
    if a.socks5:
        cfg["socks5_proxy"] = f"socks5://{a.socks5}"
    if a.proxy_cidr:
        cfg["proxy_network"] = [{"cidr": c} for c in a.proxy_cidr]
    if a.exit_nodes:
        cfg["exit_nodes"] = a.exit_nodes.split(",")
    node = et.Node(cfg)
    node.start()
    deadline = time.monotonic() + 60
    while len(node.routes()) < a.expect_routes and time.monotonic() < deadline:
        time.sleep(0.01)
    print(json.dumps({"ready": len(node.routes()) >= a.expect_routes, "version": et.version(),
                      "peer_id": node.peer_id(), "routes": len(node.routes())}), flush=True)
    stop.wait()
    node.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
