"""Blocklists from http(s) URLs (`[dns.blocklist] lists = ["https://..."]`, issue 16 item 5).

`UrlList` is a list the Blocklist (dns/blocklist.py) holds beside its files, with the same
face (`parsed`, `loaded`, `failures`, `status()`), but loaded in the background: `kick()`
starts one download unless one is running (the Blocklist kicks every URL list on its refresh
interval, from the query path, and once at start). The download and the parse run in a thread
(a million lines must not stall the event loop); the result is swapped in on the loop and
`on_change()` rebuilds the match table.

A download sends `If-None-Match` (the last ETag) and `If-Modified-Since` (the last
Last-Modified): 304 keeps the copy. It follows at most urllib's redirects, reads at most
`max_bytes` (more is a failure, not a truncated list), and ends after `timeout` seconds. A
failed download (network, HTTP status other than 200/304, too big, not text) keeps the last
good copy, is counted (`meshgate_dns_blocklist_load_failures_total{list}` and
`meshgate_dns_blocklist_fetches_total{list,result}`) and logged rate-limited; the lists are
operator-chosen sources, so no SSRF filter applies.
"""

from __future__ import annotations

import asyncio
import logging
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass

from meshgate.dns.blocklist import Parsed, _entries, _failures, _malformed, parse_compact, rlog
from meshgate.metrics import REGISTRY

log = logging.getLogger("meshgate.dns")

_fetches = REGISTRY.counter("meshgate_dns_blocklist_fetches_total",
                            "Downloads of URL blocklists, by result (ok, not_modified, failed)",
                            ("list", "result"))

USER_AGENT = "meshgate-blocklist/1"


def is_url(source: str) -> bool:
    scheme, sep, _ = source.partition("://")
    return bool(sep) and scheme.lower() in ("http", "https")


@dataclass
class Fetched:
    status: int  # 200 or 304
    parsed: Parsed | None  # None for 304
    etag: str
    last_modified: str


class FetchError(Exception):
    pass


def fetch(url: str, etag: str, last_modified: str, *, allowlist: bool, timeout: float,
          max_bytes: int) -> Fetched:
    """Download and parse `url` (blocking: run it in a thread)."""
    req = urllib.request.Request(url, headers={"User-Agent": USER_AGENT})
    if etag:
        req.add_header("If-None-Match", etag)
    if last_modified:
        req.add_header("If-Modified-Since", last_modified)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:  # config allows only http(s) URLs
            if resp.status != 200:
                raise FetchError(f"HTTP {resp.status}")
            body = resp.read(max_bytes + 1)
            if len(body) > max_bytes:
                raise FetchError(f"over {max_bytes} bytes (dns.blocklist.max_bytes)")
            new_etag = resp.headers.get("ETag", "") or ""
            new_lm = resp.headers.get("Last-Modified", "") or ""
    except urllib.error.HTTPError as e:
        if e.code == 304:
            return Fetched(304, None, etag, last_modified)
        raise FetchError(f"HTTP {e.code}") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        raise FetchError(f"{type(e).__name__}: {reason}") from None
    text = body.decode("utf-8", errors="replace")
    return Fetched(200, parse_compact(text.splitlines(), allowlist=allowlist), new_etag, new_lm)


class UrlList:
    """One configured URL: its last good contents, validators and what loading it cost."""

    def __init__(self, url: str, allowlist: bool, *, timeout: float, max_bytes: int) -> None:
        self.path = url  # the name the Blocklist's status and counters use
        self.allowlist = allowlist
        self.timeout = timeout
        self.max_bytes = max_bytes
        self.parsed = Parsed()
        self.loaded = False
        self.failures = 0
        self.fetches = 0
        self.not_modified = 0
        self.error = ""
        self.etag = ""
        self.last_modified = ""
        self.task: asyncio.Task[None] | None = None
        self.on_change: Callable[[], None] = lambda: None

    def kick(self) -> bool:
        """Start a download now unless one runs (or no event loop runs: the next kick does)."""
        if self.task is not None and not self.task.done():
            return False
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return False
        self.task = loop.create_task(self._refresh())
        return True

    async def _refresh(self) -> None:
        try:
            got = await asyncio.to_thread(fetch, self.path, self.etag, self.last_modified,
                                          allowlist=self.allowlist, timeout=self.timeout,
                                          max_bytes=self.max_bytes)
        except FetchError as e:
            self._failed(str(e))
            return
        self.fetches += 1
        self.error = ""
        if got.parsed is None:
            self.not_modified += 1
            _fetches.labels(self.path, "not_modified").inc()
            return
        _fetches.labels(self.path, "ok").inc()
        self.parsed = got.parsed
        self.etag, self.last_modified = got.etag, got.last_modified
        self.loaded = True
        _entries.labels(self.path).set(len(got.parsed.block) + len(got.parsed.allow))
        _malformed.labels(self.path).set(got.parsed.malformed)
        if got.parsed.malformed:
            rlog.warning(f"blocklist malformed {self.path}", "dns.blocklist: %s: %d malformed lines skipped",
                         self.path, got.parsed.malformed)
        self.on_change()

    def _failed(self, error: str) -> None:
        self.failures += 1
        self.error = error
        _failures.labels(self.path).inc()
        _fetches.labels(self.path, "failed").inc()
        kept = "keeping its last good copy" if self.loaded else "nothing loaded from it"
        rlog.warning(f"blocklist {self.path}", "dns.blocklist: cannot download %s (%s); %s",
                     self.path, error, kept)

    def cancel(self) -> None:
        if self.task is not None:
            self.task.cancel()

    def status(self) -> dict[str, object]:
        return {"kind": "allow" if self.allowlist else "block", "loaded": self.loaded,
                "entries": len(self.parsed.block) + len(self.parsed.allow),
                "malformed": self.parsed.malformed, "load_failures": self.failures,
                "downloads": self.fetches, "not_modified": self.not_modified,
                **({"etag": self.etag} if self.etag else {}), **({"error": self.error} if self.error else {})}
