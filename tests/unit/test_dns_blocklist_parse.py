"""dns/blocklist.py: the three list formats, comments, malformed lines, matching on label
boundaries with allow rules winning, re-reading changed files and keeping the last good copy;
the `[dns.blocklist]` config. Real files in tmp_path."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshgate.config import ConfigError, from_dict
from meshgate.dns import wire
from meshgate.dns.blocklist import Blocklist, Malformed, encode, parse_line, parse_text
from meshgate.metrics import REGISTRY

MIXED = """\
# hosts format
0.0.0.0 ads.example
127.0.0.1 a.test B.Test c.test   # three at once, a comment after
127.0.0.1 localhost
::1 localhost ip6-localhost ip6-loopback
0.0.0.0 0.0.0.0
! adblock-style
[Adblock Plus 2.0]
||Tracker.Example^
||important.example^$important
@@||ok.tracker.example^
plain.example
trailing.dot.example.

garbage line with words
||broken^^
||third-party.example^$third-party
0.0.0.0
0.0.0.0 bad..name
-leading.example
\u00e9t\u00e9.example
"""


def w(name: str) -> bytes:
    out = encode(name)
    assert out is not None
    return out


def test_each_format_comments_and_localhost_entries() -> None:
    parsed = parse_text(MIXED.splitlines())
    assert parsed.block == {w(n) for n in ("ads.example", "a.test", "b.test", "c.test", "tracker.example",
                                            "important.example", "plain.example", "trailing.dot.example")}
    assert parsed.allow == {w("ok.tracker.example")}
    # the garbage, ||broken^^, an unsupported $modifier, an address alone, bad..name, -leading, non-ASCII
    assert parsed.malformed == 7


def test_an_allowlist_file_allows_every_rule_in_any_format() -> None:
    parsed = parse_text(["0.0.0.0 a.example", "b.example", "||c.example^", "@@||d.example^"], allowlist=True)
    assert parsed.block == set()
    assert parsed.allow == {w("a.example"), w("b.example"), w("c.example"), w("d.example")}


@pytest.mark.parametrize("line", ["", "   ", "# x", "! x", "127.0.0.1 localhost", "[Adblock]"])
def test_not_rules(line: str) -> None:
    assert parse_line(line) is None


@pytest.mark.parametrize("line", ["a b", "||x", "||^", "@@x.example", "0.0.0.0", "x" * 64 + ".example",
                                  ".example", "a.-b.example", "1.2.3.4 a/b"])
def test_malformed(line: str) -> None:
    with pytest.raises(Malformed):
        parse_line(line)


@settings(max_examples=400, deadline=None)
@given(st.lists(st.text(max_size=80), max_size=20))
def test_random_lines_never_raise(lines: list[str]) -> None:
    parsed = parse_text(lines)
    assert parsed.malformed <= len(lines)
    for name in parsed.block | parsed.allow:
        assert name.endswith(b"\x00") and len(name) <= 255


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(["0.0.0.0 ", "127.0.0.1 ", "||", "@@||", "^", "$important", ".", "a", "Z",
                                 "-", "_", " ", "#", "!", "\t", "::1 ", "localhost", "\x00", "é"]),
                max_size=30).map("".join))
def test_random_rule_like_lines_never_raise(line: str) -> None:
    parse_text([line])


def table(tmp_path: Path, lists: dict[str, str], allow: dict[str, str] | None = None,
          refresh: float = 3600.0) -> Blocklist:
    paths = []
    for name, text in lists.items():
        (tmp_path / name).write_text(text)
        paths.append(str(tmp_path / name))
    allow_paths = []
    for name, text in (allow or {}).items():
        (tmp_path / name).write_text(text)
        allow_paths.append(str(tmp_path / name))
    return Blocklist(paths, allow_paths, refresh, now=0.0)


def test_a_domain_blocks_itself_and_names_under_it_on_label_boundaries(tmp_path: Path) -> None:
    bl = table(tmp_path, {"ads.txt": MIXED})
    assert bl.blocked(w("ads.example"))
    assert bl.blocked(w("x.y.ads.example"))
    assert not bl.blocked(w("xads.example"))  # not a label boundary
    assert not bl.blocked(w("example"))
    assert not bl.blocked(w("ads.example.org"))
    assert bl.blocked(w("tracker.example"))  # ||Tracker.Example^: case-insensitive
    assert bl.blocked(w("deep.TRACKER.example".lower()))
    assert not bl.blocked(w("ok.tracker.example"))  # @@ wins
    assert not bl.blocked(w("a.ok.tracker.example"))
    assert not bl.blocked(b"\x00")  # the root
    assert bl.block_labels == 3


def test_allowlists_win_and_long_names_probe_only_as_far_as_the_longest_rule(tmp_path: Path) -> None:
    bl = table(tmp_path, {"a.txt": "example\n", "b.txt": "0.0.0.0 t.example.org\n"},
               allow={"allow.txt": "good.example\n"})
    assert bl.blocked(w("x.example")) and bl.blocked(w("example"))
    assert not bl.blocked(w("good.example")) and not bl.blocked(w("a.good.example"))
    assert bl.blocked(w("t.example.org")) and not bl.blocked(w("example.org"))
    long = ".".join(["l"] * 100) + ".example"
    assert bl.blocked(w(long))
    assert bl.block_labels == 3 and bl.allow_labels == 2


def test_a_changed_file_is_read_again_after_refresh_and_a_deleted_one_keeps_its_last_copy(
        tmp_path: Path) -> None:
    bl = table(tmp_path, {"ads.txt": "one.example\n"}, refresh=5.0)
    path = str(tmp_path / "ads.txt")
    failures = REGISTRY.counter("meshgate_dns_blocklist_load_failures_total", "", ("list",)).labels(path)
    assert bl.blocked(w("one.example")) and not bl.blocked(w("two.example"))
    (tmp_path / "ads.txt").write_text("two.example\n# and a comment\n")
    os.utime(tmp_path / "ads.txt", ns=(1, 1))  # a different mtime even on a coarse clock
    assert not bl.refresh(4.9)  # not yet
    assert bl.blocked(w("one.example"))
    assert bl.refresh(5.0)
    assert bl.blocked(w("two.example")) and not bl.blocked(w("one.example"))
    assert not bl.refresh(10.0)  # unchanged: not re-read
    before = failures.value
    (tmp_path / "ads.txt").unlink()
    assert not bl.refresh(15.0)
    assert failures.value == before + 1
    assert bl.blocked(w("two.example"))  # the last good copy
    status = bl.status()["lists"]
    assert isinstance(status, dict)
    assert status[path]["load_failures"] == 1 and "FileNotFoundError" in status[path]["error"]


def test_a_missing_list_at_start_is_a_warning_and_loads_once_it_appears(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "later.txt"
    with caplog.at_level("WARNING", logger="meshgate.dns"):
        bl = Blocklist([str(path)], [], 1.0, now=0.0)
    assert str(path) in caplog.text
    assert not bl.blocked(w("late.example"))
    path.write_text("late.example\ngarbage garbage\n")
    assert bl.refresh(1.0)
    assert bl.blocked(w("late.example"))
    lists = bl.status()["lists"]
    assert isinstance(lists, dict)
    assert lists[str(path)]["malformed"] == 1 and lists[str(path)]["entries"] == 1


# --------------------------------------------------------------------------- config


def problems(raw: dict[str, object]) -> dict[str, str]:
    with pytest.raises(ConfigError) as ei:
        from_dict(raw)
    return {p.key: p.message for p in ei.value.problems}


def test_config_defaults_and_values() -> None:
    cfg = from_dict({"dns": {"blocklist": {"lists": ["/etc/meshgate/ads.txt"], "allow": ["/a.txt"],
                                           "answer": "zero", "refresh": 60}}}).dns.blocklist
    assert cfg.lists == ("/etc/meshgate/ads.txt",) and cfg.allow == ("/a.txt",)
    assert cfg.answer == "zero" and cfg.refresh == 60.0 and cfg.enabled
    default = from_dict({"dns": {"blocklist": {"lists": ["/x"]}}}).dns.blocklist
    assert default.answer == "nxdomain" and default.refresh == 3600.0
    assert not from_dict({}).dns.blocklist.enabled


def test_config_errors_name_the_key() -> None:
    got = problems({"dns": {"blocklist": {"lists": ["ftp://example.com/ads.txt", ""], "answer": "drop",
                                          "refresh": 0, "refesh": 1}}})
    assert "http(s) URL" in got["dns.blocklist.lists[0]"]
    assert "dns.blocklist.lists[1]" in got
    assert "nxdomain" in got["dns.blocklist.answer"]
    assert "positive" in got["dns.blocklist.refresh"]
    assert "did you mean 'refresh'" in got["dns.blocklist.refesh"]
    assert "needs a host" in problems({"dns": {"blocklist": {"lists": ["/x"],
                                                             "allow": ["http:///a"]}}})["dns.blocklist.allow[0]"]
    urls = from_dict({"dns": {"blocklist": {"lists": ["https://example.com/ads.txt"], "allow": ["http://h/a"],
                                            "fetch_timeout": 5, "max_bytes": 1000}}}).dns.blocklist
    assert urls.lists == ("https://example.com/ads.txt",) and urls.allow == ("http://h/a",)
    assert urls.fetch_timeout == 5.0 and urls.max_bytes == 1000
    assert "dns.blocklist.lists" in problems({"dns": {"blocklist": {"allow": ["/a"]}}})
    assert "dns.blocklist" in problems({"dns": {"blocklist": ["/x"]}})
    assert "expected a list" in problems({"dns": {"blocklist": {"lists": "/x"}}})["dns.blocklist.lists"]


def test_name_table_holds_hashes_and_a_union_keeps_a_shared_name_once(tmp_path: Path) -> None:
    from meshgate.dns.blocklist import NameTable

    names = {w(f"n{i}.example") for i in range(5000)}
    t = NameTable.of(names)
    assert len(t) == 5000 and t.hashes.itemsize == 8 and t.labels == 2
    assert all(n in t for n in names)
    assert sum(w(f"m{i}.example") in t for i in range(5000)) == 0
    u = NameTable.union([t, NameTable.of({w("n1.example"), w("other.test")})])
    assert len(u) == 5001 and w("other.test") in u and w("n4999.example") in u
    assert NameTable.union([t]) is t
    # two list files: blocked_by names the first that has a rule at or above the name
    (tmp_path / "a.txt").write_text("ads.example\n")
    (tmp_path / "b.txt").write_text("tracker.example\nads.example\n")
    bl = Blocklist([str(tmp_path / "a.txt"), str(tmp_path / "b.txt")], [], 60.0)
    assert bl.entries == 2
    assert bl.blocked_by(w("x.tracker.example")) == str(tmp_path / "b.txt")
    assert bl.blocked_by(w("ads.example")) == str(tmp_path / "a.txt")
    assert bl.blocked_by(w("fine.example")) is None


def test_parse_compact_matches_parse_text() -> None:
    from meshgate.dns.blocklist import parse_compact

    lines = [*MIXED.splitlines(), "ads.example", "0.0.0.0 ads.example"]  # repeats counted once
    text, compact = parse_text(lines), parse_compact(lines)
    assert (len(compact.block), len(compact.allow), compact.malformed) == (
        len(text.block), len(text.allow), text.malformed)
    assert all(n in compact.block for n in text.block) and all(n in compact.allow for n in text.allow)
    assert not any(n in compact.block for n in text.allow)
    assert compact.block.labels == max(len(wire.label_starts(n)) for n in text.block)
