"""Counters, gauges and histograms with Prometheus text exposition.

Updates take a lock per metric so counts stay exact when several threads
update one metric (the event loop plus executor threads for blocking work).
Per-packet paths should not call `inc()` per packet: accumulate in a local
int and flush once per batch (`inc(n)`), or keep a `LocalCounter` and
`flush()` it every N events, the way EasyTier batches its counters.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Iterable, Sequence
from typing import Any


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _fmt(v: float) -> str:
    if v == math.inf:
        return "+Inf"
    if float(v).is_integer():
        return str(int(v))
    return repr(float(v))


class Counter:
    __slots__ = ("_lock", "_value")

    def __init__(self) -> None:
        self._value = 0
        self._lock = threading.Lock()

    def inc(self, n: int = 1) -> None:
        with self._lock:
            self._value += n

    @property
    def value(self) -> int:
        return self._value


class Gauge:
    __slots__ = ("_lock", "_value")

    def __init__(self) -> None:
        self._value = 0.0
        self._lock = threading.Lock()

    def set(self, v: float) -> None:
        with self._lock:
            self._value = v

    def inc(self, n: float = 1) -> None:
        with self._lock:
            self._value += n

    def dec(self, n: float = 1) -> None:
        with self._lock:
            self._value -= n

    @property
    def value(self) -> float:
        return self._value


DEFAULT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class Histogram:
    __slots__ = ("_counts", "_lock", "_sum", "buckets")

    def __init__(self, buckets: Sequence[float] = DEFAULT_BUCKETS) -> None:
        self.buckets = tuple(sorted(buckets))
        self._counts = [0] * (len(self.buckets) + 1)
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, v: float) -> None:
        i = bisect.bisect_left(self.buckets, v)
        with self._lock:
            self._counts[i] += 1
            self._sum += v

    def snapshot(self) -> tuple[list[int], float]:
        with self._lock:
            return list(self._counts), self._sum

    @property
    def count(self) -> int:
        return sum(self._counts)


class LocalCounter:
    """Single-thread accumulator for hot paths; flushes into a Counter every `every` events."""

    __slots__ = ("every", "pending", "target")

    def __init__(self, target: Counter, every: int = 128) -> None:
        self.target = target
        self.every = every
        self.pending = 0

    def add(self, n: int = 1) -> None:
        self.pending += n
        if self.pending >= self.every:
            self.flush()

    def flush(self) -> None:
        if self.pending:
            self.target.inc(self.pending)
            self.pending = 0


class _Family:
    kind = ""

    def __init__(self, name: str, help: str, labelnames: tuple[str, ...]) -> None:
        self.name = name
        self.help = help
        self.labelnames = labelnames
        self._children: dict[tuple[str, ...], object] = {}
        self._lock = threading.Lock()

    def _child(self, values: tuple[str, ...], make: type) -> object:
        if len(values) != len(self.labelnames):
            raise ValueError(f"{self.name} takes labels {self.labelnames}, got {values}")
        child = self._children.get(values)
        if child is None:
            with self._lock:
                child = self._children.setdefault(values, make())
        return child

    def forget(self, first: str) -> None:
        """Drop the series whose first label value is `first` (a stopped listener's): a later
        one labelled the same (the same address bound again in this process) starts at zero."""
        with self._lock:
            for values in [v for v in self._children if v and v[0] == first]:
                del self._children[values]

    def _label_text(self, values: tuple[str, ...], extra: str = "") -> str:
        parts = [f'{k}="{_escape(v)}"' for k, v in zip(self.labelnames, values, strict=True)]
        if extra:
            parts.append(extra)
        return "{" + ",".join(parts) + "}" if parts else ""

    def expose(self) -> Iterable[str]:
        yield f"# HELP {self.name} {self.help}"
        yield f"# TYPE {self.name} {self.kind}"


class CounterFamily(_Family):
    kind = "counter"

    def labels(self, *values: str) -> Counter:
        c = self._child(values, Counter)
        assert isinstance(c, Counter)
        return c

    def inc(self, n: int = 1) -> None:
        self.labels().inc(n)

    @property
    def value(self) -> int:
        return self.labels().value

    def children(self) -> list[tuple[tuple[str, ...], Counter]]:
        """(label values, counter) pairs: for per-listener views and merging other processes' counts."""
        return [(k, c) for k, c in list(self._children.items()) if isinstance(c, Counter)]

    def expose(self) -> Iterable[str]:
        yield from super().expose()
        for values, c in sorted(self._children.items()):
            assert isinstance(c, Counter)
            yield f"{self.name}{self._label_text(values)} {c.value}"


class GaugeFamily(_Family):
    kind = "gauge"

    def labels(self, *values: str) -> Gauge:
        g = self._child(values, Gauge)
        assert isinstance(g, Gauge)
        return g

    def set(self, v: float) -> None:
        self.labels().set(v)

    def inc(self, n: float = 1) -> None:
        self.labels().inc(n)

    def dec(self, n: float = 1) -> None:
        self.labels().dec(n)

    @property
    def value(self) -> float:
        return self.labels().value

    def expose(self) -> Iterable[str]:
        yield from super().expose()
        for values, g in sorted(self._children.items()):
            assert isinstance(g, Gauge)
            yield f"{self.name}{self._label_text(values)} {_fmt(g.value)}"


class HistogramFamily(_Family):
    kind = "histogram"

    def __init__(
        self, name: str, help: str, labelnames: tuple[str, ...], buckets: Sequence[float]
    ) -> None:
        super().__init__(name, help, labelnames)
        self.bucket_bounds = tuple(buckets)

    def labels(self, *values: str) -> Histogram:
        h = self._child(values, lambda: Histogram(self.bucket_bounds))  # type: ignore[arg-type]
        assert isinstance(h, Histogram)
        return h

    def observe(self, v: float) -> None:
        self.labels().observe(v)

    def expose(self) -> Iterable[str]:
        yield from super().expose()
        for values, h in sorted(self._children.items()):
            assert isinstance(h, Histogram)
            counts, total = h.snapshot()
            cumulative = 0
            for bound, n in zip((*h.buckets, math.inf), counts, strict=True):
                cumulative += n
                le = 'le="' + _fmt(bound) + '"'
                yield f"{self.name}_bucket{self._label_text(values, le)} {cumulative}"
            yield f"{self.name}_sum{self._label_text(values)} {_fmt(total)}"
            yield f"{self.name}_count{self._label_text(values)} {cumulative}"


class Registry:
    """Metric families by name; asking twice for one name returns the same family."""

    def __init__(self) -> None:
        self._families: dict[str, _Family] = {}
        self._lock = threading.Lock()

    def _get(self, name: str, make: type[_Family], *args: Any) -> _Family:
        with self._lock:
            fam = self._families.get(name)
            if fam is None:
                fam = make(name, *args)
                self._families[name] = fam
            elif not isinstance(fam, make):
                raise ValueError(f"metric {name} already registered as a {fam.kind}")
            return fam

    def counter(self, name: str, help: str, labelnames: tuple[str, ...] = ()) -> CounterFamily:
        fam = self._get(name, CounterFamily, help, labelnames)
        assert isinstance(fam, CounterFamily)
        return fam

    def gauge(self, name: str, help: str, labelnames: tuple[str, ...] = ()) -> GaugeFamily:
        fam = self._get(name, GaugeFamily, help, labelnames)
        assert isinstance(fam, GaugeFamily)
        return fam

    def histogram(
        self,
        name: str,
        help: str,
        labelnames: tuple[str, ...] = (),
        buckets: Sequence[float] = DEFAULT_BUCKETS,
    ) -> HistogramFamily:
        fam = self._get(name, HistogramFamily, help, labelnames, buckets)
        assert isinstance(fam, HistogramFamily)
        return fam

    def counter_families(self) -> list[CounterFamily]:
        with self._lock:
            return [f for f in self._families.values() if isinstance(f, CounterFamily)]

    def expose(self) -> str:
        with self._lock:
            families = sorted(self._families.values(), key=lambda f: f.name)
        lines: list[str] = []
        for fam in families:
            lines.extend(fam.expose())
        return "\n".join(lines) + "\n"

    def value(self, name: str, *labels: str) -> float:
        """Current value of a counter or gauge child (0 if never touched): for tests and status."""
        fam = self._families.get(name)
        if isinstance(fam, CounterFamily):
            c = fam._children.get(labels)
            return c.value if isinstance(c, Counter) else 0
        if isinstance(fam, GaugeFamily):
            g = fam._children.get(labels)
            return g.value if isinstance(g, Gauge) else 0
        return 0


# One process-wide registry: a node is one process; in-process multi-node tests
# read deltas, or label by node where it matters.
REGISTRY = Registry()
