import threading

from meshgate.metrics import LocalCounter, Registry


def test_counts_exact_across_threads() -> None:
    reg = Registry()
    c = reg.counter("t_total", "test", ("kind",)).labels("a")
    h = reg.histogram("t_seconds", "test")
    n_threads, per_thread = 8, 20_000

    def work() -> None:
        for _ in range(per_thread):
            c.inc()
            h.observe(0.001)

    threads = [threading.Thread(target=work) for _ in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert c.value == n_threads * per_thread
    assert h.labels().count == n_threads * per_thread


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
