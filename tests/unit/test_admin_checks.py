"""The admin API's request checks (pure): Host header, token, request line."""

from __future__ import annotations

from meshgate.admin import check_request, host_allowed


def head(
    host: str | None = "127.0.0.1:15888", auth: str | None = None, line: str = "GET /status HTTP/1.1"
) -> bytes:
    lines = [line]
    if host is not None:
        lines.append(f"Host: {host}")
    if auth is not None:
        lines.append(f"Authorization: {auth}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def test_host_names_a_rebinding_page_could_use_are_refused() -> None:
    names = ("node-a.lan",)
    for ok in ("127.0.0.1:15888", "[::1]:15888", "localhost:15888", "LOCALHOST", "10.0.0.5",
               "node-a.lan:15888", "Node-A.lan.", None):
        assert host_allowed(ok, names), ok
    for bad in ("evil.example:15888", "127.0.0.1.nip.io", "localhost.evil.example", "node-a.lan.evil", ""):
        assert not host_allowed(bad, names), bad
    assert check_request(head("evil.example:15888"), names, "", False) == (403, "/status")


def test_the_token_is_required_where_asked_and_must_match() -> None:
    token = "t" * 32
    assert check_request(head(), (), token, True) == (401, "/status")
    assert check_request(head(auth="Bearer " + "u" * 32), (), token, True) == (401, "/status")
    assert check_request(head(auth="Basic " + token), (), token, True) == (401, "/status")
    assert check_request(head(auth="Bearer " + token), (), token, True) == (0, "/status")
    assert check_request(head(), (), token, False) == (0, "/status")  # on loopback, read-only: no token


def test_bad_requests() -> None:
    assert check_request(head(line="GARBAGE"), (), "", False)[0] == 400
    assert check_request(head(line="GET /status SPDY/3"), (), "", False)[0] == 400
    assert check_request(head(line="POST /status HTTP/1.1"), (), "", False) == (405, "/status")
    # a foreign Host is refused before the method is looked at
    assert check_request(head("evil.example", line="POST /x HTTP/1.1"), (), "", False) == (403, "/x")
