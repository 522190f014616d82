"""dns/querylog.py: the ring, `since`, the JSON and the CLI line; [dns.query_log] config."""

from __future__ import annotations

import pytest

from meshgate.config import ConfigError, from_dict
from meshgate.dns import wire
from meshgate.dns.querylog import QueryLog, answer, format_line


def test_since_and_the_bound() -> None:
    log = QueryLog(3)
    assert log.since(0) == []
    for i in range(5):
        log.add(("127.0.0.1", 5353), wire.encode_name(f"n{i}.example"), 1, 0, "cache", 0.5, now=100.0 + i)
    assert [e[0] for e in log.since(0)] == [3, 4, 5]
    assert [e[0] for e in log.since(3)] == [4, 5]
    assert log.since(5) == [] and log.since(99) == []
    assert log.since(0)[0] == (3, 102.0, "127.0.0.1", "n2.example.", 1, 0, "cache", 0.5)


def test_answer_json_and_line() -> None:
    log = QueryLog(10)
    log.add("::1", wire.encode_name("www.example"), 28, 3, "udp://127.0.0.1:53", 12.345, now=1.5)
    got = answer(log, True, 0)
    assert got["last"] == 1 and got["entries"][0] == {
        "seq": 1, "time": 1.5, "client": "::1", "name": "www.example.", "type": "AAAA",
        "rcode": "NXDOMAIN", "via": "udp://127.0.0.1:53", "ms": 12.345}
    line = format_line(got["entries"][0])
    assert line.endswith(" ::1 www.example. AAAA NXDOMAIN udp://127.0.0.1:53 12.3ms")
    assert answer(None, False, 0) == {"enabled": False, "size": 0, "last": 0, "entries": []}


def test_config_defaults_and_problems() -> None:
    cfg = from_dict({})
    assert cfg.dns.query_log.enable is False and cfg.dns.query_log.size == 1000
    cfg = from_dict({"dns": {"query_log": {"enable": True, "size": 5}}})
    assert cfg.dns.query_log.enable is True and cfg.dns.query_log.size == 5
    for bad in ({"size": 0}, {"size": 10**7}, {"enable": "maybe"}, {"colour": 1}):
        with pytest.raises(ConfigError, match=r"dns\.query_log"):
            from_dict({"dns": {"query_log": bad}})
