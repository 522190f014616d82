"""A tiny HTTP server for namespace tests: answers "NAME|CLIENT_IP" so a test sees
both which host served it and which source address reached it.

    python -m tests.system.http_probe HOST PORT NAME
"""

from __future__ import annotations

import http.server
import sys


def main() -> None:
    host, port, name = sys.argv[1], int(sys.argv[2]), sys.argv[3]

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = f"<html><body><p id=probe>{name}|{self.client_address[0]}</p></body></html>".encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass

    family_server = http.server.ThreadingHTTPServer
    if ":" in host:
        import socket

        class V6(http.server.ThreadingHTTPServer):
            address_family = socket.AF_INET6

        family_server = V6
    family_server((host, port), Handler).serve_forever()


if __name__ == "__main__":
    main()
