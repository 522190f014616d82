import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import CodeType, FrameType
from typing import Any

from meshgate import metrics
from meshgate.metrics import LocalCounter, Registry


@contextmanager
def preemptive_updates(*funcs: Callable[..., Any]) -> Iterator[None]:
    """Let threads switch between any two bytecodes of `funcs` (the metric update methods).

    CPython 3.11 hands the GIL over only at function entry, backward jumps and calls, and an
    unlocked `self._value += n` on ints has none of those between its load and its store: it
    never loses an update there, whatever sys.setswitchinterval says, so a thread test of the
    bare code cannot tell a locked counter from an unlocked one. Tracing those methods opcode
    by opcode runs a Python trace function between their bytecodes, and each call is a point
    where the GIL can pass to another thread; with a 1 us switch interval it does, often.
    That is the interleaving a free-threaded build (or any later interpreter) may produce,
    and only the metric's lock keeps counts exact under it. Only threads started inside this
    block are traced, and only in `funcs`' frames (the rest runs untraced, at full speed)."""
    codes: set[CodeType] = {f.__code__ for f in funcs}

    def local(frame: FrameType, event: str, arg: object) -> Callable[..., Any]:
        return local

    def tracer(frame: FrameType, event: str, arg: object) -> Callable[..., Any] | None:
        if frame.f_code in codes:
            frame.f_trace_opcodes = True
            return local
        return None

    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    threading.settrace(tracer)
    try:
        yield
    finally:
        threading.settrace(None)
        sys.setswitchinterval(old_interval)


N_THREADS, PER_THREAD = 8, 5_000


def _hammer(update: Callable[[], None], method: Callable[..., Any]) -> None:
    start = threading.Barrier(N_THREADS)  # all threads update at once, none runs alone first

    def work() -> None:
        start.wait()
        for _ in range(PER_THREAD):
            update()

    with preemptive_updates(method):
        threads = [threading.Thread(target=work) for _ in range(N_THREADS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)


# One metric per run: a thread waiting on another metric's lock is not updating this one, so
# hammering several at once hides most of the lost updates an unlocked one would show.
def test_counter_exact_across_threads() -> None:
    c = Registry().counter("t_total", "test", ("kind",)).labels("a")
    _hammer(c.inc, metrics.Counter.inc)
    assert c.value == N_THREADS * PER_THREAD


def test_gauge_exact_across_threads() -> None:
    g = Registry().gauge("t_inflight", "test").labels()
    _hammer(g.inc, metrics.Gauge.inc)
    assert g.value == N_THREADS * PER_THREAD


def test_histogram_exact_across_threads() -> None:
    h = Registry().histogram("t_seconds", "test").labels()
    _hammer(lambda: h.observe(0.5), metrics.Histogram.observe)  # 0.5 sums exactly in floats
    counts, total = h.snapshot()
    assert (sum(counts), total) == (N_THREADS * PER_THREAD, N_THREADS * PER_THREAD * 0.5)


def test_local_counter_batches() -> None:
    reg = Registry()
    fam = reg.counter("b_total", "batched")
    local = LocalCounter(fam.labels(), every=100)
    for _ in range(250):
        local.add()
    assert fam.value == 200  # two flushes so far
    local.flush()
    assert fam.value == 250


def test_prometheus_text() -> None:
    reg = Registry()
    reg.counter("req_total", "Requests", ("code",)).labels('4"00').inc(3)
    reg.gauge("clients", "Connected clients").set(2)
    reg.histogram("lat_seconds", "Latency", buckets=(0.1, 1)).observe(0.5)
    text = reg.expose()
    assert "# TYPE req_total counter" in text
    assert 'req_total{code="4\\"00"} 3' in text
    assert "clients 2" in text
    assert 'lat_seconds_bucket{le="0.1"} 0' in text
    assert 'lat_seconds_bucket{le="1"} 1' in text
    assert 'lat_seconds_bucket{le="+Inf"} 1' in text
    assert "lat_seconds_count 1" in text


def test_same_name_same_family() -> None:
    reg = Registry()
    assert reg.counter("x_total", "x") is reg.counter("x_total", "x")
