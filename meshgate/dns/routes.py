"""Split DNS: which upstreams a name not answered locally goes to (`[[dns.route]]`).

A route sends the names at or under its suffix (label boundaries: `corp.example.` takes
`corp.example.` and `a.corp.example.`, never `xcorp.example.`) to its own upstreams; the
longest matching suffix wins; every other name goes to `dns.upstreams`. The pipeline asks the
table only on a cache miss (the cache key, the lowercased question, already fixes the route),
so a cache hit does no routing work. The lookup is one dict probe per suffix of the name, from
the longest to the shortest, skipping suffixes with more labels than any route has.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from meshgate.dns import wire
from meshgate.dns.upstream import Upstream


class UpstreamGroup:
    """Upstreams asked in order with fail-over; `preferred` is the index that answered last
    (the next question starts there)."""

    __slots__ = ("name", "preferred", "upstreams")

    def __init__(self, name: str, upstreams: list[Upstream]) -> None:
        self.name = name  # "dns.upstreams" or the route's suffix (for logs and tests)
        self.upstreams = upstreams
        self.preferred = 0


class RouteTable:
    """Wire-format suffix (lowercased) -> its UpstreamGroup, with `default` for every other name."""

    def __init__(self, default: UpstreamGroup, routes: Mapping[bytes, UpstreamGroup] | None = None) -> None:
        self.default = default
        self.routes: dict[bytes, UpstreamGroup] = dict(routes or {})
        # no route has more labels than this: longer suffixes of a name need no probe
        self.max_labels = max((len(wire.label_starts(s)) for s in self.routes), default=0)

    def group(self, name: bytes) -> UpstreamGroup:
        """The group for a lowercased wire-format name (as wire.parse_query gives it)."""
        routes = self.routes
        if not routes:
            return self.default
        starts = wire.label_starts(name)
        for start in starts[max(0, len(starts) - self.max_labels):]:  # longest suffix first
            found = routes.get(name[start:])
            if found is not None:
                return found
        return self.default

    def groups(self) -> Iterator[UpstreamGroup]:
        yield self.default
        yield from self.routes.values()

