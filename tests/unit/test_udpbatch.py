"""meshgate/udpbatch.py on real loopback sockets: what one recvmmsg reads (every datagram, in
order, whole, with the sender recvfrom would name) and where one sendmmsg's replies go,
including a reply the kernel refuses in the middle of the batch."""

from __future__ import annotations

import errno
import gc
import socket
import struct
from collections.abc import Iterator

import pytest

from meshgate import udpbatch
from meshgate.udpbatch import DatagramBatch
from tests.helpers import require


@pytest.fixture(autouse=True)
def _calls() -> None:
    require(udpbatch.available(), "recvmmsg/sendmmsg in the C library (Linux, 64-bit)")

FAMILIES = [(socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")]


def _udp(family: int, host: str) -> socket.socket:
    s = socket.socket(family, socket.SOCK_DGRAM)
    s.bind((host, 0))
    return s


@pytest.fixture(params=FAMILIES, ids=["v4", "v6"])
def family(request: pytest.FixtureRequest) -> tuple[int, str]:
    fam, host = request.param
    try:
        _udp(fam, host).close()
    except OSError:
        require(False, f"a {host} loopback address")
    return fam, host


@pytest.fixture
def server(family: tuple[int, str]) -> Iterator[socket.socket]:
    s = _udp(*family)
    s.setblocking(False)
    yield s
    s.close()


def _clients(family: tuple[int, str], n: int) -> list[socket.socket]:
    out = []
    for _ in range(n):
        c = _udp(*family)
        c.settimeout(5)
        out.append(c)
    return out


def _open(server: socket.socket, count: int, slot_size: int = 65535) -> DatagramBatch:
    batch = DatagramBatch.open(server, count, slot_size)
    assert batch is not None
    return batch


def test_one_call_reads_what_is_waiting_in_order_whole_and_named(family: tuple[int, str],
                                                                  server: socket.socket) -> None:
    batch = _open(server, 8)
    assert batch.recv() == []  # nothing waiting: no datagram, no error
    clients = _clients(family, 2)
    # an empty datagram and the largest IPv4 allows among them, from two senders in turn
    sizes = [0, 1, 12, 2048, 65507, 3, 4096, 2049, 100, 7]
    sent = []
    for k, size in enumerate(sizes):
        payload = bytes([k]) * size
        clients[k % 2].sendto(payload, server.getsockname())
        sent.append((payload, clients[k % 2].getsockname()))
    got = batch.recv()
    got_from = [batch.address(i) for i in range(len(got))]
    got += batch.recv()  # the two that did not fit in the first
    got_from += [batch.address(i) for i in range(len(got) - 8)]
    assert batch.recv() == []
    assert got == [p for p, _ in sent]
    assert got_from == [a for _, a in sent]
    for c in clients:
        c.close()
    batch.close()


def test_replies_go_to_each_datagrams_sender(family: tuple[int, str], server: socket.socket) -> None:
    """Replies to some datagrams of the batch and not others: each reaches the sender of the
    datagram it answers, in order, with its own bytes."""
    batch = _open(server, 16)
    clients = _clients(family, 3)
    for k in range(12):
        clients[k % 3].sendto(b"q%d" % k, server.getsockname())
    got = batch.recv()
    assert len(got) == 12
    answered = [1, 2, 4, 5, 8, 11]  # never the first: every reply sits in a slot before its datagram's
    for i in answered:
        assert batch.reply(i, b"answer to " + got[i] + b"." * i)
    assert batch.send() == []
    for n, c in enumerate(clients):
        want = [b"answer to q%d" % i + b"." * i for i in answered if i % 3 == n]
        assert [c.recv(100) for _ in want] == want
        c.settimeout(0.05)
        with pytest.raises(TimeoutError):  # and nothing else
            c.recv(100)
        c.close()
    batch.close()


def test_pinned_replies_carry_their_datagrams_id_and_bytes_not_copied(
        family: tuple[int, str], server: socket.socket) -> None:
    """Pinned replies (a datagram's first two bytes, then bytes the caller keeps) mixed with
    copied ones: each sender gets its own ID and the pinned bytes as they were when queued, also
    when a copied reply is written over the slot the pinned reply's datagram was read into, and
    when the caller has let go of the pinned buffer before the send."""
    batch = _open(server, 16)
    (c,) = _clients(family, 1)
    for k in range(6):
        c.sendto(bytes([0xA0 + k, k]) + b"rest%d" % k, server.getsockname())
    keys = batch.recv(2)
    assert keys == [b"rest%d" % k for k in range(6)]  # each after its first two bytes
    assert batch.datagram(3) == bytes([0xA3, 3]) + b"rest3"  # and whole
    kept = udpbatch.Pinned(b"-kept")
    # datagram 0 has no reply, so each reply's send position is the slot before its datagram's:
    # 1 pinned (position 0), 2 copied over slot 1 (position 1), 3 pinned (2), 4 copied over slot 3
    batch.reply_pinned(1, kept)
    assert batch.reply(2, b"copied over slot one, which held the first pinned reply's ID")
    batch.reply_pinned(3, udpbatch.Pinned(b"-dropped by the caller"))  # only the batch holds it
    gc.collect()
    assert batch.reply(4, b"x" * 300)
    batch.reply_pinned(5, kept)
    assert batch.send() == []
    assert [c.recv(1000) for _ in range(5)] == [
        bytes([0xA1, 1]) + b"-kept",
        b"copied over slot one, which held the first pinned reply's ID",
        bytes([0xA3, 3]) + b"-dropped by the caller",
        b"x" * 300,
        bytes([0xA5, 5]) + b"-kept",
    ]
    # the next batch's copied reply to datagram 0 takes position 0 again: no pinned bytes behind it
    c.sendto(b"\x00\x01again", server.getsockname())
    assert batch.recv() == [b"\x00\x01again"]
    assert batch.reply(0, b"plain")
    assert batch.send() == []
    assert c.recv(1000) == b"plain"
    c.close()
    batch.close()


def test_a_reply_too_big_for_a_slot_is_refused(family: tuple[int, str], server: socket.socket) -> None:
    batch = _open(server, 4, slot_size=512)
    (c,) = _clients(family, 1)
    c.sendto(b"q", server.getsockname())
    assert batch.recv() == [b"q"]
    assert not batch.reply(0, bytes(513))
    assert batch.reply(0, bytes(512))
    assert batch.send() == []
    assert c.recv(1000) == bytes(512)
    c.close()
    batch.close()


@pytest.fixture
def server_v4() -> Iterator[socket.socket]:
    s = _udp(socket.AF_INET, "127.0.0.1")
    s.setblocking(False)
    yield s
    s.close()


def test_a_refused_reply_is_named_and_the_others_still_go(server_v4: socket.socket) -> None:
    """The kernel refuses one reply (65,535 bytes: too long for a UDP datagram over IPv4): that
    one comes back with its error and its sender's address; those before and after it are sent."""
    server = server_v4
    batch = _open(server, 8)
    clients = _clients((socket.AF_INET, "127.0.0.1"), 2)
    for k in range(5):
        clients[k % 2].sendto(b"q%d" % k, server.getsockname())
    got = batch.recv()
    assert len(got) == 5
    for i in range(5):
        assert batch.reply(i, bytes(65535) if i in (1, 4) else b"a%d" % i)
    failures = batch.send()
    assert [(addr, e.errno) for addr, e in failures] == [(clients[1].getsockname(), errno.EMSGSIZE),
                                                         (clients[0].getsockname(), errno.EMSGSIZE)]
    assert [clients[0].recv(100), clients[0].recv(100)] == [b"a0", b"a2"]
    assert clients[1].recv(100) == b"a3"
    for c in clients:
        c.close()
    batch.close()


def test_an_error_on_the_socket_raises_as_recvfrom_does() -> None:
    """A connected socket whose peer's port is closed: the ICMP error comes back from recv()."""
    gone = _udp(socket.AF_INET, "127.0.0.1")
    port = gone.getsockname()[1]
    gone.close()
    s = _udp(socket.AF_INET, "127.0.0.1")
    s.setblocking(False)
    s.connect(("127.0.0.1", port))
    batch = _open(s, 4)
    s.send(b"x")
    with pytest.raises(ConnectionRefusedError):  # loopback delivers the ICMP error within send()
        batch.recv()
    assert batch.recv() == []  # reported once
    batch.close()
    s.close()


def test_a_link_local_sender_is_named_with_its_scope_as_recvfrom_names_it() -> None:
    """recvfrom's text for an IPv6 address comes from getnameinfo, which adds "%<interface>"
    to a link-local address with a scope (no such address on loopback, so the raw form here)."""
    lo = socket.if_nametoindex("lo")
    raw = (struct.pack("=H", socket.AF_INET6) + struct.pack(">HI", 5353, 7)
           + socket.inet_pton(socket.AF_INET6, "fe80::1") + struct.pack("=I", lo) + bytes(4))
    assert udpbatch._address(socket.AF_INET6, raw) == ("fe80::1%lo", 5353, 7, lo)
    raw = raw[:24] + bytes(8)
    assert udpbatch._address(socket.AF_INET6, raw) == ("fe80::1", 5353, 7, 0)


def test_no_batch_where_it_cannot_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    assert DatagramBatch.open(s, 4) is None  # only IP sockets
    s.close()
    monkeypatch.setattr(udpbatch, "_CALLS", None)  # a C library without the calls
    s = _udp(socket.AF_INET, "127.0.0.1")
    assert DatagramBatch.open(s, 4) is None
    s.close()
