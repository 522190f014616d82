"""meshgate/reload.py: which dotted keys changed between two configs, which can change live."""

from __future__ import annotations

import dataclasses
from typing import Any

from meshgate.admin import check_request
from meshgate.config import Config, from_dict
from meshgate.reload import LIVE, VALUE_TYPES, changed_keys, diff

BASE: dict[str, Any] = {
    "node": {"secret": "s3cret-old"}, "socks5": {"users": [{"name": "a", "password": "pw-old"}]},
}


def cfg(**sections: Any) -> Config:
    raw: dict[str, Any] = {k: dict(v) for k, v in BASE.items()}
    for k, v in sections.items():
        if isinstance(v, dict):
            raw.setdefault(k, {}).update(v)
        else:
            raw[k] = v
    return from_dict(raw)


def all_keys(obj: Any, prefix: str = "") -> set[str]:
    out: set[str] = set()
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if dataclasses.is_dataclass(v) and not isinstance(v, VALUE_TYPES):
            out |= all_keys(v, f"{prefix}{f.name}.")
        else:
            out.add(prefix + f.name)
    return out


def test_the_same_config_has_no_changes() -> None:
    assert diff(cfg(), cfg()).changed == ()
    assert diff(cfg(), cfg()).ok


def test_live_keys_are_applied() -> None:
    new = cfg(log_level="debug", socks5={"users": [{"name": "b", "password": "pb"}]},
              dns={"records": {"x.test": "10.0.0.1"}}, exit={"deny": ["10.9.0.0/16"], "allow_private": True})
    plan = diff(cfg(), new)
    assert plan.ok and set(plan.changed) == {"log_level", "socks5.users", "dns.records", "exit.deny",
                                             "exit.allow_private"}
    assert diff(cfg(), cfg(exit={"allow": ["192.0.2.0/24"]})).changed == ("exit.allow",)


def test_offers_exits_dns_upstreams_blocklists_and_portal_limits_are_live() -> None:
    new = cfg(mesh={"proxy_cidrs": ["10.1.0.0/16"], "exit_node": True, "exit_nodes": ["auto"],
                    "direct_fallback": False},
              dns={"upstreams": ["udp://192.0.2.53"], "route": [{"suffix": "corp.", "upstreams": ["udp://192.0.2.54"]}],
                   "blocklist": {"lists": ["/tmp/x"], "answer": "zero", "refresh": 60}},
              limits={"socks5_handshake_timeout": 2, "socks5_idle_timeout": 30,
                      "socks5_max_clients_per_source": 4})
    plan = diff(cfg(), new)
    assert plan.ok, plan.restart
    assert set(plan.changed) == {
        "mesh.proxy_cidrs", "mesh.exit_node", "mesh.exit_nodes", "mesh.direct_fallback", "dns.upstreams",
        "dns.routes", "dns.blocklist.lists", "dns.blocklist.answer", "dns.blocklist.refresh",
        "limits.socks5_handshake_timeout", "limits.socks5_idle_timeout",
        "limits.socks5_max_clients_per_source"}


def test_other_keys_refuse_naming_each_one_dotted() -> None:
    new = cfg(socks5={"listen": "127.0.0.1:1081", "users": []}, dns={"query_log": {"size": 60}},
              limits={"dns_timeout": 1.0, "socks5_idle_timeout": 30})
    plan = diff(cfg(), new)
    assert not plan.ok
    # a HostPort is one value, not a section: socks5.listen, never socks5.listen.port
    assert plan.restart == ("socks5.listen", "dns.query_log.size", "limits.dns_timeout")
    assert "limits.socks5_idle_timeout" in plan.changed  # live: [limits] is not one key
    assert "socks5.users" in plan.changed and "socks5.users" not in plan.restart


def test_secrets_are_named_never_shown() -> None:
    new = cfg(node={"secret": "s3cret-new"}, admin={"token": "tok-new-0123456789"},
              socks5={"users": [{"name": "a", "password": "pa-new"}]})
    plan = diff(cfg(), new)
    assert plan.changed == ("node.secret", "socks5.users", "admin.token")
    text = repr(plan) + str(plan)
    for secret in ("s3cret-old", "s3cret-new", "tok-new", "pw-old", "pa-new"):
        assert secret not in text


def test_live_names_real_keys_and_the_walk_sees_every_field() -> None:
    keys = all_keys(Config())
    assert keys >= LIVE
    assert {"socks5.listen", "mesh.peers", "dns.blocklist.lists", "limits.dns_timeout"} <= keys
    assert changed_keys(Config(), Config()) == []


def head(method: str, path: str, auth: str = "") -> bytes:
    extra = f"Authorization: {auth}\r\n" if auth else ""
    return f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{extra}\r\n".encode()


def test_reload_is_post_only_and_needs_the_token_when_there_is_one() -> None:
    tok = "t" * 32
    # a token configured: needed on loopback too (need_token False is the read-only rule there)
    assert check_request(head("POST", "/reload"), (), tok, False) == (401, "/reload")
    assert check_request(head("POST", "/reload", "Bearer " + "x" * 32), (), tok, False) == (401, "/reload")
    assert check_request(head("POST", "/reload", "Bearer " + tok), (), tok, False) == (0, "/reload")
    assert check_request(head("GET", "/reload", "Bearer " + tok), (), tok, False) == (405, "/reload")
    assert check_request(head("GET", "/status"), (), tok, False) == (0, "/status")  # reading still free
    assert check_request(head("POST", "/status"), (), tok, False) == (405, "/status")
    # no token: allowed on a loopback API, 403 on one listening off loopback
    assert check_request(head("POST", "/reload"), (), "", False) == (0, "/reload")
    assert check_request(head("POST", "/reload"), (), "", False, api_on_loopback=False) == (403, "/reload")
    assert check_request(head("GET", "/status"), (), "", False, api_on_loopback=False) == (0, "/status")
