"""dns/querylog.py: the ring, `since`, the JSON and the CLI line, client_ip, the rotating file;
[dns.query_log] config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshgate.config import ConfigError, from_dict
from meshgate.dns import wire
from meshgate.dns.querylog import Formatter, QueryLog, RotatingFile, anonymize, answer, format_line


def a_answer(rcode: int = wire.NOERROR, *addrs: bytes) -> wire.Answer:
    q = wire.encode_name("www.example") + b"\x00\x01\x00\x01"
    rr = [(wire.TYPE_A if len(a) == 4 else wire.TYPE_AAAA, 60, a) for a in addrs]
    return wire.build_answer(q, rcode, aa=False, answers=rr)


def test_since_and_the_bound() -> None:
    log = QueryLog(3)
    assert log.since(0) == []
    ans = a_answer()
    for i in range(5):
        log.add(("127.0.0.1", 5353), "udp://x", wire.encode_name(f"n{i}.example"), 1, ans, "cache", 0.5,
                now=100.0 + i)
    assert [e[0] for e in log.since(0)] == [3, 4, 5]
    assert [e[0] for e in log.since(3)] == [4, 5]
    assert log.since(5) == [] and log.since(99) == []
    first = log.as_dict(log.since(0)[0])
    assert (first["seq"], first["time"], first["name"]) == (3, 102.0, "n2.example.")


def test_answer_json_and_line() -> None:
    log = QueryLog(10)
    log.add(("::1", 53, 0, 0), "udp://[::1]:53", wire.encode_name("www.example"), 28,
            a_answer(wire.NOERROR, bytes([192, 0, 2, 1]), bytes(15) + b"\x01"), "udp://127.0.0.1:53",
            12.345, now=1.5)
    got = answer(log, True, 0)
    assert got["last"] == 1 and got["entries"][0] == {
        "seq": 1, "time": 1.5, "client": "::1", "listener": "udp://[::1]:53", "name": "www.example.",
        "type": "AAAA", "rcode": "NOERROR", "answers": ["192.0.2.1", "::1"],
        "source": "udp://127.0.0.1:53", "latency_ms": 12.345}
    line = format_line(got["entries"][0])
    assert line.endswith(" ::1 udp://[::1]:53 www.example. AAAA NOERROR 192.0.2.1,::1"
                         " udp://127.0.0.1:53 12.3ms")
    assert answer(None, False, 0) == {"enabled": False, "size": 0, "last": 0, "entries": []}


def test_anonymize_zeroes_ipv4_24_and_ipv6_48() -> None:
    assert anonymize("192.0.2.77") == "192.0.2.0"
    assert anonymize("2001:db8:1234:5678::9") == "2001:db8:1234::"
    assert anonymize("::ffff:198.51.100.9") == "198.51.100.0"
    assert anonymize("fe80::1%eth0") == "fe80::"
    assert anonymize("not-an-address") == "not-an-address"
    assert Formatter("anonymized").client(("10.1.2.3", 999)) == "10.1.2.0"
    assert Formatter("none").client(("10.1.2.3", 999)) == ""
    assert Formatter("full").client(("10.1.2.3", 999)) == "10.1.2.3"


def test_a_none_log_never_holds_the_peer() -> None:
    log = QueryLog(2, client_ip="none")
    log.add(("10.1.2.3", 1), "udp://x", wire.encode_name("a.example"), 1, a_answer(), "cache", 0.1)
    assert log.entries[0][2] is None and log.as_dict(log.entries[0])["client"] == ""


def test_rotating_file_rotates_before_a_line_would_pass_max_bytes(tmp_path: Path) -> None:
    path = tmp_path / "log"
    f = RotatingFile(str(path), max_bytes=100, keep=2)
    for i in range(10):
        f.write(json.dumps({"i": i, "pad": "x" * 20}).encode() + b"\n")  # 40 bytes a line: 2 to a file
    f.close()
    files = [Path(f"{path}.2"), Path(f"{path}.1"), path]
    assert not Path(f"{path}.3").exists()
    got = [[json.loads(line)["i"] for line in p.read_text().splitlines()] for p in files]
    assert got == [[4, 5], [6, 7], [8, 9]]
    assert all(p.stat().st_size <= 100 for p in files)


def test_config_defaults_and_problems() -> None:
    cfg = from_dict({})
    q = cfg.dns.query_log
    assert (q.enable, q.size, q.path, q.max_bytes, q.keep, q.client_ip, q.queue) == (
        False, 1000, "", 10_000_000, 5, "full", 10_000)
    cfg = from_dict({"dns": {"query_log": {"enable": True, "size": 5, "path": "/var/log/q.jsonl",
                                           "max_bytes": 4096, "keep": 2, "client_ip": "anonymized",
                                           "queue": 50}}})
    q = cfg.dns.query_log
    assert (q.enable, q.size, q.path, q.max_bytes, q.keep, q.client_ip, q.queue) == (
        True, 5, "/var/log/q.jsonl", 4096, 2, "anonymized", 50)
    for bad in ({"size": 0}, {"size": 10**7}, {"enable": "maybe"}, {"colour": 1},
                {"path": "/tmp/q"}, {"enable": True, "client_ip": "half"}, {"enable": True, "keep": 0},
                {"enable": True, "keep": 1000}, {"enable": True, "queue": 10**7},
                {"enable": True, "max_bytes": -1}):
        with pytest.raises(ConfigError, match=r"dns\.query_log"):
            from_dict({"dns": {"query_log": bad}})


def test_a_file_line_is_the_record_as_json() -> None:
    f = Formatter("anonymized")
    ans = a_answer(wire.NXDOMAIN, bytes([10, 0, 0, 1]))
    for name in ("www.example", 'odd"\\name.example'):
        wname = b"".join(bytes([len(x)]) + x.encode() for x in name.split(".")) + b"\x00"
        e = (7, 1700000000.1234, ("2001:db8:1:2::5", 53), "udp://[::]:53", wname, 65, ans,
             'route ex. udp://"x"', 0.0004)
        line = f.line(e)
        assert line.endswith(b"\n") and line.count(b"\n") == 1
        assert json.loads(line) == f.record(e)
    assert json.loads(line)["client"] == "2001:db8:1::" and json.loads(line)["answers"] == ["10.0.0.1"]


def test_lines_built_from_remembered_fragments_stay_each_entrys_own() -> None:
    """Formatter.line remembers the fragments of an Answer, a name and a string: lines for many
    entries that share them, and for new Answers in between (a cache refilled), are still each
    entry's own record, past the memos' bound too."""
    f = Formatter("full")
    answers = [a_answer(wire.NOERROR, bytes([192, 0, 2, i % 250])) for i in range(300)]
    for i in range(10_000):
        # now and then a fresh Answer, gone after its line: its id is soon another's
        ans = answers[i % 300] if i % 7 else a_answer(wire.NOERROR, bytes([198, 51, 100, i % 256]))
        name = wire.encode_name(f"h{i % 5000}.example.")
        e = (i, 1700000000.5 + i, (f"192.0.2.{i % 200}", 53), f"udp://127.0.0.1:{i % 3}", name, 1, ans,
             f"cache{i % 4}", i / 1000)
        assert json.loads(f.line(e)) == f.record(e)
