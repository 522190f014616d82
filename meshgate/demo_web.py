"""The demo's `web` service: a page that names the host that served it.

Runs with the standard library only, so the demo's lan host needs nothing
but Python: `python -m meshgate.demo_web --bind 0.0.0.0 --port 80 --name web`.
"""

from __future__ import annotations

import argparse
import contextlib
import html
import http.server
import socket


def page(name: str) -> bytes:
    n = html.escape(name)
    return (
        "<!doctype html><html><head><meta charset=utf-8>"
        f"<title>meshgate demo: {n}</title></head><body style='font-family:sans-serif'>"
        f"<h1>Hello from {n}</h1>"
        f"<p>This page was served by <b id=served-by>{n}</b> ({html.escape(socket.gethostname())}) "
        "on the demo's lan, which only the exit node can reach. "
        "You are seeing it through the meshgate SOCKS5 portal.</p></body></html>"
    ).encode()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bind", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8080)
    ap.add_argument("--name", default="web")
    args = ap.parse_args(argv)
    body = page(args.name)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *a: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer((args.bind, args.port), Handler)
    print(f"demo web '{args.name}' on http://{args.bind}:{args.port}/", flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        server.serve_forever()


if __name__ == "__main__":
    main()
