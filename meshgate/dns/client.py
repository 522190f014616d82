"""`meshgate dns query NAME [TYPE] --server URL`: one query over udp/tcp/tls/https/quic, printed like dig."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import ssl
import sys
import time
from typing import Any

import dns.exception
import dns.flags
import dns.message
import dns.opcode
import dns.query
import dns.rcode
import dns.rdatatype

from meshgate.dns.upstream import split_host_port
from meshgate.tls import client_context

DEFAULT_SERVER = "udp://127.0.0.1:5353"


def _verify(args: argparse.Namespace) -> bool | str:
    if getattr(args, "insecure", False):
        return False
    cafile: str | None = getattr(args, "cafile", None)
    return cafile if cafile else True


def exchange(q: dns.message.Message, server: str, timeout: float, verify: bool | str) -> dns.message.Message:
    scheme, sep, rest = server.partition("://")
    if not sep:
        scheme, rest = "udp", server
    if scheme == "https":
        return dns.query.https(q, server, timeout=timeout, verify=verify)
    hostport, _, sni = rest.partition("#")
    hostport = hostport.split("/")[0]
    default_port = 853 if scheme in ("tls", "quic") else 53
    host, port = split_host_port(hostport, default_port)
    if scheme == "udp":
        return dns.query.udp_with_fallback(q, host, timeout=timeout, port=port)[0]
    if scheme == "tcp":
        return dns.query.tcp(q, host, timeout=timeout, port=port)
    if scheme == "tls":
        ctx = client_context(verify, ["dot"])
        return dns.query.tls(q, host, timeout=timeout, port=port, ssl_context=ctx,
                             server_hostname=sni or host)
    if scheme == "quic":
        return dns.query.quic(q, host, timeout=timeout, port=port, verify=verify,
                              server_hostname=sni or host)
    raise ValueError(f"unsupported scheme {scheme!r}: use udp://, tcp://, tls://, https:// or quic://")


def format_answer(r: dns.message.Message, server: str, elapsed: float) -> str:
    flags = dns.flags.to_text(r.flags).lower()
    lines = [
        f";; ->>HEADER<<- opcode: {dns.opcode.to_text(r.opcode())}, status: {dns.rcode.to_text(r.rcode())}, "
        f"id: {r.id}",
        f";; flags: {flags}; QUERY: {len(r.question)}, ANSWER: {len(r.answer)}, "
        f"AUTHORITY: {len(r.authority)}, ADDITIONAL: {len(r.additional)}",
        "",
        ";; QUESTION SECTION:",
        *(f";{rr.to_text()}" for rr in r.question),
    ]
    for title, section in (("ANSWER", r.answer), ("AUTHORITY", r.authority), ("ADDITIONAL", r.additional)):
        if section:
            lines += ["", f";; {title} SECTION:", *(rr.to_text() for rr in section)]
    lines += ["", f";; Query time: {elapsed * 1000:.1f} msec", f";; SERVER: {server}"]
    return "\n".join(lines)


def main(args: Any) -> int:
    if getattr(args, "odoh", False):
        if importlib.util.find_spec("meshgate.dns.odoh_client") is None:
            print("meshgate: ODoH client is not available in this build", file=sys.stderr)
            return 2
        rc: int = importlib.import_module("meshgate.dns.odoh_client").main(args)
        return rc
    server = args.server or DEFAULT_SERVER
    try:
        rdtype = dns.rdatatype.from_text(args.qtype)
    except dns.rdatatype.UnknownRdatatype:
        print(f"meshgate: unknown record type {args.qtype!r}", file=sys.stderr)
        return 1
    q = dns.message.make_query(args.qname, rdtype, use_edns=0)
    start = time.monotonic()
    try:
        r = exchange(q, server, args.timeout, _verify(args))
    except (OSError, dns.exception.DNSException, ValueError, ssl.SSLError) as e:
        print(f"meshgate: query to {server} failed: {e or type(e).__name__}", file=sys.stderr)
        return 2
    print(format_answer(r, server, time.monotonic() - start))
    return 0 if r.rcode() in (dns.rcode.NOERROR, dns.rcode.NXDOMAIN) else 3
