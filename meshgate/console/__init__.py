"""The web console: one page the admin API serves at `/` (docs/OPERATIONS.md, "The console").

Three static files kept in this package (index.html, console.js, console.css: plain HTML,
CSS and JavaScript, no library, no build step, nothing fetched from elsewhere) read once with
importlib.resources. The page polls the admin API's JSON (/status, /peers, /routes,
/console/stats, /config) every 2 s and keeps about 5 minutes of samples in the browser for its
charts; the server keeps no history. The files hold no data, so they are served without the
token (still behind the Host check); the JSON behind them keeps the API's rules.
"""

from __future__ import annotations

import functools
from importlib import resources

# path -> (file in this package, Content-Type)
ASSETS: dict[str, tuple[str, str]] = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/console.js": ("console.js", "text/javascript; charset=utf-8"),
    "/console.css": ("console.css", "text/css; charset=utf-8"),
}

# Every admin API answer carries these: the page loads nothing but its own files and talks only
# to the API that served it; no framing, no sniffing, nothing cached (the JSON is live state).
SECURITY_HEADERS = (
    ("Content-Security-Policy",
     "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self';"
     " object-src 'none'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"),
    ("X-Content-Type-Options", "nosniff"),
    ("Cache-Control", "no-store"),
    ("X-Frame-Options", "DENY"),
    ("Referrer-Policy", "no-referrer"),
)


@functools.cache
def asset(path: str) -> tuple[bytes, str] | None:
    """(body, content type) of a console file by its URL path; None for any other path."""
    entry = ASSETS.get(path)
    if entry is None:
        return None
    name, ctype = entry
    return resources.files(__name__).joinpath(name).read_bytes(), ctype
