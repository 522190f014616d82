"""Blocklists (`[dns.blocklist]`): which names the pipeline answers itself with a refusal.

Pure: parse list files, build the match table, decide. The pipeline (dns/resolver.py) asks
`Blocklist.blocked(name)` only for names that are not local data (the mesh zone and
`dns.records` always answer first) and only when a blocklist is configured; it remembers the
decision with its local answers (about a second), so a cache hit of a name it decided already
does no blocklist work. `refresh(now)` re-reads a file whose mtime or size changed; a file that
cannot be read keeps its last good copy. An http(s) URL in `lists` or `allow` is downloaded in
the background (dns/blocklist_url.py: ETag/If-Modified-Since, a failure keeps the last good
copy) and joins the table when it arrives; a reload keeps the copies of URLs it still names.

Formats, detected per line:

- hosts: `0.0.0.0 ads.example`, `127.0.0.1 a.example b.example` (localhost entries ignored);
- plain domains: `ads.example`;
- adblock-style: `||ads.example^` (optionally `$important`), `@@||ok.example^` (an allow rule);
- comments: lines starting with `#` or `!` (and `[Adblock Plus 2.0]`-style headers); a `#`
  after a hosts or plain entry starts a comment too.

A domain matches itself and every name under it on label boundaries, case-insensitively. Allow
rules (from `allow` files, or `@@` lines anywhere) win over block rules. Anything else is a
malformed line: counted per list and skipped, never an exception.
"""

from __future__ import annotations

import array
import asyncio
import bisect
import heapq
import ipaddress
import itertools
import logging
import os
import re
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from meshgate.dns import wire
from meshgate.logs import RateLimitedLog
from meshgate.metrics import REGISTRY

log = logging.getLogger("meshgate.dns")
rlog = RateLimitedLog(log, interval=60.0)

BLOCK = "block"
ALLOW = "allow"

_entries = REGISTRY.gauge("meshgate_dns_blocklist_entries", "Domains loaded from a blocklist or allowlist",
                          ("list",))
_malformed = REGISTRY.gauge("meshgate_dns_blocklist_malformed_lines",
                            "Lines of a blocklist or allowlist that were skipped as malformed", ("list",))
_failures = REGISTRY.counter("meshgate_dns_blocklist_load_failures_total",
                             "Times a blocklist or allowlist could not be read (the last good copy stays)",
                             ("list",))

# hosts-file names that are the host's own, never rules
_LOCAL_NAMES = frozenset({
    "localhost", "localhost.localdomain", "local", "broadcasthost", "ip6-localhost", "ip6-loopback",
    "ip6-localnet", "ip6-mcastprefix", "ip6-allnodes", "ip6-allrouters", "ip6-allhosts", "0.0.0.0",
})
_LABEL = re.compile(r"[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?\Z")
_ADBLOCK = re.compile(r"(@@)?\|\|([^\^|$]+)\^(?:\$important)?\Z")


class Malformed(ValueError):
    """A line that is neither a comment nor a rule in any of the formats."""


def encode(domain: str) -> bytes | None:
    """`domain` (any case, optional trailing dot) as a lowercased wire-format name; None if it is
    not a domain name (labels of 1-63 letters, digits, `-`, `_`; 253 characters in all)."""
    name = domain.lower()
    if name.endswith("."):
        name = name[:-1]
    if not name or len(name) > 253 or not name.isascii():
        return None
    out = bytearray()
    for label in name.split("."):
        if not _LABEL.match(label):
            return None
        out.append(len(label))
        out += label.encode("ascii")
    out.append(0)
    return bytes(out)


def parse_line(line: str) -> tuple[str, list[bytes]] | None:
    """One line -> (BLOCK or ALLOW, wire names), or None for a blank line, a comment, or a hosts
    line that names only localhost. Raises Malformed for anything else."""
    s = line.strip()
    if not s or s[0] in "#!" or (s[0] == "[" and s[-1] == "]"):
        return None
    if s.startswith(("||", "@@")):
        m = _ADBLOCK.match(s)
        name = encode(m.group(2)) if m else None
        if m is None or name is None:
            raise Malformed("not an adblock-style ||domain^ rule")
        return (ALLOW if m.group(1) else BLOCK), [name]
    s = s.split("#", 1)[0]
    tokens = s.split()
    try:
        ipaddress.ip_address(tokens[0])
    except ValueError:
        if len(tokens) != 1:
            raise Malformed("neither a hosts line (address first) nor one domain") from None
        plain = encode(tokens[0])
        if plain is None:
            raise Malformed("not a domain name") from None
        return BLOCK, [plain]
    if len(tokens) == 1:
        raise Malformed("a hosts line with an address and no names")
    names: list[bytes] = []
    for token in tokens[1:]:
        if token.lower().rstrip(".") in _LOCAL_NAMES:
            continue
        name = encode(token)
        if name is None:
            raise Malformed(f"{token!r} is not a domain name")
        names.append(name)
    return (BLOCK, names) if names else None


class NameTable:
    """A set of wire names held as their 64-bit hashes in one sorted array: 8 bytes a name
    instead of a bytes object and a set slot (about 100 bytes a name in a set of bytes; a
    million-domain list took 132 MB that way, bench/dns.py `blocklist` section).

    `name in table` hashes the name and looks in its bucket (the hash's top 16 bits index the
    array, so a probe compares a handful of entries). A name not in the table matches only if
    its hash equals one in it: with n names about n / 2**64 per probe (5e-14 for a million).
    The hash is Python's own for bytes, keyed per process (PYTHONHASHSEED), so an outsider
    cannot aim for a collision, and a table never leaves the process that built it."""

    __slots__ = ("hashes", "index", "labels")

    BUCKET_SHIFT = 48  # 65536 buckets

    def __init__(self, hashes: array.array[int] | None = None, labels: int = 0) -> None:
        """`hashes` sorted; `labels` is the most labels any name has."""
        self.hashes = array.array("q") if hashes is None else hashes
        self.labels = labels
        # index[b] = where bucket b starts: bucket of h is (h >> 48) + 32768 (signed 64-bit h)
        index = array.array("l", bytes(8 * 65537))
        hs = self.hashes
        pos = 0
        for b in range(65536 if hs else 0):
            top = (b - 32768 + 1) << self.BUCKET_SHIFT
            pos = bisect.bisect_left(hs, top, pos)
            index[b + 1] = pos
        self.index = index

    @classmethod
    def of(cls, names: Collection[bytes]) -> NameTable:
        """The table of a set of names (distinct names: equal hashes only from a collision,
        which a duplicate entry handles)."""
        labels = max(map(_label_count, names), default=0)
        return cls(array.array("q", sorted(map(hash, names))), labels)

    @classmethod
    def of_hashes(cls, hashes: array.array[int], labels: int) -> NameTable:
        """The table of names' hashes in any order, repeats kept once (a name listed twice)."""
        ordered = sorted(hashes)
        del hashes[:]  # the caller's copy is not needed while the sorted one exists
        return cls(array.array("q", (h for h, _ in itertools.groupby(ordered))), labels)

    @classmethod
    def union(cls, tables: list[NameTable]) -> NameTable:
        if len(tables) == 1:
            return tables[0]  # one list: its own table, not a copy
        # merged in order without a list of every hash; a name in two lists is kept once
        merged = (h for h, _ in itertools.groupby(heapq.merge(*(t.hashes for t in tables))))
        return cls(array.array("q", merged), max((t.labels for t in tables), default=0))

    def __len__(self) -> int:
        return len(self.hashes)

    def __contains__(self, name: object) -> bool:
        h = hash(name)
        b = (h >> self.BUCKET_SHIFT) + 32768
        index = self.index
        hs = self.hashes
        hi = index[b + 1]
        i = bisect.bisect_left(hs, h, index[b], hi)
        return i < hi and hs[i] == h


@dataclass
class Parsed:
    """What one file's text gave: its block and allow names and how many lines were malformed.
    parse_text fills sets; a Blocklist swaps them for NameTables (`compact`) once it holds them."""

    block: set[bytes] | NameTable = field(default_factory=set)
    allow: set[bytes] | NameTable = field(default_factory=set)
    malformed: int = 0

    def compact(self) -> Parsed:
        """The same rules in NameTables (itself if they are already)."""
        if isinstance(self.block, NameTable) and isinstance(self.allow, NameTable):
            return self
        return Parsed(_table(self.block), _table(self.allow), self.malformed)


def _label_count(name: bytes) -> int:
    return len(wire.label_starts(name))


def _table(names: set[bytes] | NameTable) -> NameTable:
    return names if isinstance(names, NameTable) else NameTable.of(names)


def _rules(lines: Iterable[str], allowlist: bool) -> Iterator[tuple[bool, list[bytes]] | None]:
    """(is an allow rule, its names) per rule line, None per malformed line; comments skipped."""
    for line in lines:
        try:
            got = parse_line(line)
        except Malformed:
            yield None
            continue
        if got is not None:
            kind, names = got
            yield allowlist or kind == ALLOW, names


def parse_text(lines: Iterable[str], *, allowlist: bool = False) -> Parsed:
    """Every line of a list into sets of names; in an allowlist (`allowlist`) every rule allows."""
    block: set[bytes] = set()
    allow: set[bytes] = set()
    malformed = 0
    for rule in _rules(lines, allowlist):
        if rule is None:
            malformed += 1
        else:
            (allow if rule[0] else block).update(rule[1])
    return Parsed(block, allow, malformed)


def parse_compact(lines: Iterable[str], *, allowlist: bool = False) -> Parsed:
    """parse_text straight into NameTables: each name is hashed as its line is read, so loading
    a big list never holds a set of all its names (the peak while loading a million-domain file
    is the hashes and their sort, not ~130 MB of names)."""
    hashes = (array.array("q"), array.array("q"))  # block rules, allow rules
    labels = [0, 0]  # most labels of a block rule, of an allow rule
    malformed = 0
    for rule in _rules(lines, allowlist):
        if rule is None:
            malformed += 1
            continue
        side = int(rule[0])
        target = hashes[side]
        for name in rule[1]:
            target.append(hash(name))
            n = _label_count(name)
            if n > labels[side]:
                labels[side] = n
    return Parsed(NameTable.of_hashes(hashes[0], labels[0]), NameTable.of_hashes(hashes[1], labels[1]),
                  malformed)


class ListFile:
    """One configured file: its last good contents and what reading it cost."""

    def __init__(self, path: str, allowlist: bool) -> None:
        self.path = path
        self.allowlist = allowlist
        self.parsed = Parsed()
        self.stamp: tuple[int, int] | None = None  # (mtime_ns, size) of the copy in `parsed`
        self.loaded = False
        self.failures = 0
        self.error = ""
        self.task: asyncio.Task[None] | None = None
        self.on_change: Callable[[], None] = lambda: None

    def _read(self) -> tuple[tuple[int, int], Parsed] | None:
        """(stamp, rules) of the file if its mtime or size changed, else None; OSError as is."""
        st = os.stat(self.path)
        stamp = (st.st_mtime_ns, st.st_size)
        if stamp == self.stamp:
            return None
        with open(self.path, encoding="utf-8", errors="replace") as f:
            return stamp, parse_compact(f, allowlist=self.allowlist)

    def load(self, *, starting: bool = False) -> bool:
        """Re-read the file now if its mtime or size changed; True when `parsed` changed. A failure
        keeps the last good copy, is counted and logged (rate-limited per path)."""
        try:
            got = self._read()
        except OSError as e:
            self._failed(e, starting)
            return False
        if got is None:
            return False
        self._take(*got)
        return True

    def kick(self) -> bool:
        """Re-read a changed file in a thread (a million lines take seconds to parse, which on
        the event loop would stall every answer and the mesh); `on_change` runs once the new
        rules are in. The stat is here (cheap); only a changed file starts a thread. False when
        no event loop runs (the caller then load()s)."""
        if self.task is not None and not self.task.done():
            return True  # a read runs already
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return False
        try:
            st = os.stat(self.path)
        except OSError as e:
            self._failed(e, False)
            return True
        if (st.st_mtime_ns, st.st_size) != self.stamp:
            self.task = loop.create_task(self._refresh())
        return True

    async def _refresh(self) -> None:
        try:
            got = await asyncio.to_thread(self._read)
        except OSError as e:
            self._failed(e, False)
            return
        if got is not None:
            self._take(*got)
            self.on_change()

    def cancel(self) -> None:
        if self.task is not None:
            self.task.cancel()

    def _failed(self, e: OSError, starting: bool) -> None:
        self.failures += 1
        self.error = f"{type(e).__name__}: {e.strerror or e}"
        _failures.labels(self.path).inc()
        kept = "keeping its last good copy" if self.loaded else "nothing loaded from it"
        if starting:
            log.warning("dns.blocklist: cannot read %s (%s); %s", self.path, self.error, kept)
        else:
            rlog.warning(f"blocklist {self.path}", "dns.blocklist: cannot read %s (%s); %s",
                         self.path, self.error, kept)

    def _take(self, stamp: tuple[int, int], parsed: Parsed) -> None:
        self.parsed = parsed
        self.stamp = stamp
        self.loaded = True
        self.error = ""
        _entries.labels(self.path).set(len(parsed.block) + len(parsed.allow))
        _malformed.labels(self.path).set(parsed.malformed)
        if parsed.malformed:
            rlog.warning(f"blocklist malformed {self.path}", "dns.blocklist: %s: %d malformed lines skipped",
                         self.path, parsed.malformed)

    def status(self) -> dict[str, object]:
        return {"kind": ALLOW if self.allowlist else BLOCK, "loaded": self.loaded,
                "entries": len(self.parsed.block) + len(self.parsed.allow),
                "malformed": self.parsed.malformed, "load_failures": self.failures,
                **({"error": self.error} if self.error else {})}



class Blocklist:
    """The match table of every configured list: `blocked(name)` for a lowercased wire name."""

    def __init__(self, lists: Iterable[str], allow: Iterable[str], refresh: float, now: float = 0.0, *,
                 url_list: Callable[[str, bool], Any] | None = None,
                 previous: Blocklist | None = None) -> None:
        """`url_list(url, allowlist)` makes the list object of an http(s) URL (the pipeline passes
        blocklist_url.UrlList with its bounds; this module stays free of I/O beyond files);
        `previous` hands over the URL lists a reload still names, with their copies."""
        sources = [(p, False) for p in lists] + [(p, True) for p in allow]
        self.files: list[Any] = []  # ListFile, or blocklist_url.UrlList for a URL
        self.urls: list[Any] = []
        kept = {(u.path, u.allowlist): u for u in previous.urls} if previous is not None else {}
        # a reload keeps the lists it still names with their rules; a changed one is re-read in
        # a thread (below), so the old copy answers meanwhile and the loop never stalls
        kept_files = {(f.path, f.allowlist): f for f in previous.files
                      if isinstance(f, ListFile)} if previous is not None else {}
        reread: list[ListFile] = []
        for source, allowlist in sources:
            if "://" not in source and (source, allowlist) in kept_files:
                held = kept_files.pop((source, allowlist))
                held.on_change = self._build
                self.files.append(held)
                reread.append(held)
                continue
            if "://" in source:
                if url_list is None:
                    raise ValueError(f"{source!r}: URL lists need a url_list factory")
                url = url_list(source, allowlist)
                old = kept.pop((source, allowlist), None)
                if old is not None:  # its copy and validators, with the new bounds
                    old.timeout, old.max_bytes = url.timeout, url.max_bytes
                    url = old
                url.on_change = self._build
                self.urls.append(url)
                self.files.append(url)
            else:
                new = ListFile(source, allowlist)
                new.on_change = self._build
                self.files.append(new)
                if previous is not None:
                    reread.append(new)  # a list a reload adds: read in a thread too
                else:
                    new.load(starting=True)  # at start, before anything is answered
        for gone in [*kept.values(), *kept_files.values()]:
            gone.cancel()
        self.interval = refresh
        self.block = self.allow = NameTable()
        self.block_labels = self.allow_labels = 0
        for f in reread:
            if not f.kick():
                f.load()  # no event loop runs (tests, tools): read it now
        self._build()
        self.next_check = now + refresh
        # URL lists: downloaded now if an event loop runs, else at the first refresh() (from the
        # query path, which runs on the loop).
        if self.urls and not all([u.kick() for u in self.urls]):
            self.next_check = now

    def _build(self) -> None:
        # Each list's rules become NameTables once (its sets freed); with several lists the
        # table asked is their union, with one it is that list's own.
        for f in self.files:
            f.parsed = f.parsed.compact()
        self.block = NameTable.union([f.parsed.block for f in self.files if len(f.parsed.block)])
        self.allow = NameTable.union([f.parsed.allow for f in self.files if len(f.parsed.allow)])
        # no rule has more labels than these: longer suffixes of a name need no probe
        self.block_labels = self.block.labels
        self.allow_labels = self.allow.labels

    def refresh(self, now: float) -> bool:
        """Re-read changed files once `refresh` seconds have passed; True when the table changed."""
        if now < self.next_check:
            return False
        self.next_check = now + self.interval
        changed = False
        for f in self.files:
            # in the background (a file in a thread, a URL downloaded): the result rebuilds
            # the table; without an event loop a file is read now
            if not f.kick() and isinstance(f, ListFile):
                changed = f.load() or changed
        if changed:
            self._build()
        return changed

    def blocked(self, name: bytes) -> bool:
        """Whether a lowercased wire-format name is at or under a block rule and not at or under an
        allow rule: one set probe per suffix, at most as many as the longest rule has labels."""
        block = self.block
        if not block:
            return False
        starts = wire.label_starts(name)
        count = len(starts)
        hit = False
        for start in starts[max(0, count - self.block_labels):]:
            if name[start:] in block:
                hit = True
                break
        if not hit:
            return False
        allow = self.allow
        if allow:
            for start in starts[max(0, count - self.allow_labels):]:
                if name[start:] in allow:
                    return False
        return True

    def blocked_by(self, name: bytes) -> str | None:
        """blocked(), naming the list: the path or URL of the first list with a block rule at or
        above `name` (the query log's `blocked LIST`); None when not blocked."""
        if not self.blocked(name):
            return None
        starts = wire.label_starts(name)
        for f in self.files:
            rules = f.parsed.block
            if not f.allowlist and any(name[start:] in rules for start in starts):
                return str(f.path)
        return "?"  # the table was rebuilt between the two looks

    @property
    def entries(self) -> int:
        return len(self.block) + len(self.allow)

    def status(self) -> dict[str, object]:
        return {"entries": self.entries, "lists": {f.path: f.status() for f in self.files}}

    def close(self) -> None:
        """Stop the reads and downloads still running (the pipeline closes)."""
        for f in self.files:
            f.cancel()
