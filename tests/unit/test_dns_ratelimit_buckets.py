"""dns/ratelimit.py, pure: token buckets per client prefix, slip, the bounded table, the default
(on off loopback)."""

from __future__ import annotations

from meshgate.config import DnsListenerConfig, HostPort
from meshgate.dns.ratelimit import DROP, OK, SLIP, ClientRateLimit, enabled


def test_burst_then_slip_every_nth_then_refill() -> None:
    rl = ClientRateLimit(rate=2.0, burst=3, slip=3)
    peer = ("192.0.2.7", 5353)
    assert [rl.check(peer, 0.0) for _ in range(3)] == [OK] * 3
    assert [rl.check(peer, 0.0) for _ in range(6)] == [DROP, DROP, SLIP, DROP, DROP, SLIP]
    assert rl.check(peer, 0.5) == OK  # one token back after 1/rate seconds
    assert rl.check(peer, 0.5) == DROP
    assert [rl.check(peer, 100.0) for _ in range(4)] == [OK, OK, OK, DROP]  # refilled to the burst only


def test_slip_zero_always_drops_and_non_socket_peers_pass() -> None:
    rl = ClientRateLimit(rate=1.0, burst=1, slip=0)
    assert rl.check(("192.0.2.1", 1), 0.0) == OK
    assert {rl.check(("192.0.2.1", 1), 0.0) for _ in range(10)} == {DROP}
    assert rl.check("anonymous", 0.0) == OK and rl.check(None, 0.0) == OK


def test_prefixes_share_a_bucket() -> None:
    rl = ClientRateLimit(rate=1.0, burst=1, slip=0, prefix_v4=24, prefix_v6=56)
    assert rl.check(("192.0.2.1", 1), 0.0) == OK
    assert rl.check(("192.0.2.200", 1), 0.0) == DROP  # same /24
    assert rl.check(("192.0.3.1", 1), 0.0) == OK
    assert rl.check(("2001:db8:0:1::1", 1, 0, 0), 0.0) == OK
    assert rl.check(("2001:db8:0:ff::2", 1, 0, 0), 0.0) == DROP  # same /56
    assert rl.check(("2001:db8:0:100::1", 1, 0, 0), 0.0) == OK
    assert rl.key("2001:db8:0:1::1") == "2001:db8::/56"


def test_table_is_bounded() -> None:
    rl = ClientRateLimit(rate=1.0, burst=2, slip=0, max_clients=100)
    for i in range(1000):
        rl.check((f"10.0.{i // 256}.{i % 256}", 1), 0.0)
        assert len(rl) <= 100
    # Idle (refilled) buckets go first: a client active now keeps its state.
    rl = ClientRateLimit(rate=1.0, burst=2, slip=0, max_clients=3)
    for h in ("10.0.0.1", "10.0.0.2", "10.0.0.3"):
        rl.check((h, 1), 0.0)
    rl.check(("10.0.0.3", 1), 5.0)
    rl.check(("10.0.0.3", 1), 5.0)
    rl.check(("10.0.0.4", 1), 5.0)  # table full: 10.0.0.1 and .2 are idle and go
    assert rl.check(("10.0.0.3", 1), 5.0) == DROP


def test_default_is_on_off_loopback() -> None:
    def cfg(host: str, rate_limit: bool | None = None) -> DnsListenerConfig:
        return DnsListenerConfig("udp", HostPort(host, 53), rate_limit=rate_limit)

    assert not enabled(cfg("127.0.0.1")) and not enabled(cfg("::1")) and not enabled(cfg("localhost"))
    assert enabled(cfg("0.0.0.0")) and enabled(cfg("192.0.2.1")) and enabled(cfg("::"))
    assert enabled(cfg("127.0.0.1", True)) and not enabled(cfg("0.0.0.0", False))
