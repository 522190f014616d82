"""Batched datagram system calls: recvmmsg(2) and sendmmsg(2) through ctypes (Linux, glibc/musl).

CPython's socket module reads and sends one datagram per call (`recvfrom`, `sendto`), and each
call costs a system call, a fresh bytes object sized for the largest datagram, and an address
tuple built (recvfrom) or parsed (sendto). A listener that answers many small datagrams, each
with one reply to its sender (DNS over UDP), can instead read up to `count` datagrams with one
`recvmmsg` and send all the replies of that batch with one `sendmmsg`; the sender's address
goes from the receive header to the send header as raw bytes, never through a tuple.

`DatagramBatch.open(sock, count)` gives None where the C library lacks the calls (or ctypes
cannot load it): the caller then keeps its one-call-per-datagram loop. Both must answer alike.

Memory is fixed at construction and bounded: `count` slots of `slot_size` bytes in one
anonymous mmap (pages the kernel never wrote stay unallocated, so RSS is what datagrams
touched), plus the headers. A reply is written into the slot of its position in the send
vector, over a datagram that `recv()` has already copied out, so replies need no memory of
their own. A reply that repeats bytes the caller keeps (a `Pinned` buffer: a preformed DNS
answer) is not copied at all: its send header points at the datagram's 2-byte ID, copied to
the header's own place, and at the pinned bytes, which the batch holds until sent.

Only this module knows the C layouts (x86-64 and aarch64 Linux; musl's int+padding fields read
the same for the small values written here). It imports nothing from meshgate.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import socket
import struct
import sys
from typing import Any

_MMSGHDR = 64  # struct mmsghdr on LP64 Linux: the msghdr (56), unsigned msg_len, padding
_IOVEC = 16
_NAME = 32  # room for a sockaddr_in6 (28 bytes) per slot, 8-aligned
# uint32 indexes within one mmsghdr (stride 16): msg_len at byte 56
_U32_LEN, _U32_STRIDE = 14, 16
# a send header's two iovecs as uint64s (stride 4): the first's base and length, the second's
_U64_BASE0, _U64_LEN0, _U64_BASE1, _U64_LEN1 = 0, 1, 2, 3

_AGAIN = (errno.EAGAIN, errno.EWOULDBLOCK, errno.EINTR)
_NO_FAILURES: list[tuple[Any, OSError]] = []  # shared: send() returns a new list only on failure


class _Iovec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


class _Msghdr(ctypes.Structure):
    _fields_ = [("msg_name", ctypes.c_void_p), ("msg_namelen", ctypes.c_uint32),
                ("msg_iov", ctypes.c_void_p), ("msg_iovlen", ctypes.c_size_t),
                ("msg_control", ctypes.c_void_p), ("msg_controllen", ctypes.c_size_t),
                ("msg_flags", ctypes.c_int)]


class _Mmsghdr(ctypes.Structure):
    _fields_ = [("msg_hdr", _Msghdr), ("msg_len", ctypes.c_uint)]


class Pinned:
    """Bytes at an address that stays put: a bytearray that cannot be resized or freed while this
    lives, so a send header can point at it. `data` may be changed in place (same length)."""

    __slots__ = ("_pin", "address", "data", "size")

    def __init__(self, data: bytes | bytearray | memoryview) -> None:
        self.data = bytearray(data)
        self.size = len(self.data)
        self._pin = ctypes.c_char.from_buffer(self.data) if self.size else None
        self.address = ctypes.addressof(self._pin) if self._pin is not None else 0


def _libc_calls() -> tuple[Any, Any] | None:
    """libc's recvmmsg and sendmmsg with their prototypes, or None where there are none."""
    if not sys.platform.startswith("linux") or struct.calcsize("P") != 8:
        return None
    if ctypes.sizeof(_Mmsghdr) != _MMSGHDR or ctypes.sizeof(_Iovec) != _IOVEC:  # not the layout assumed
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)  # the process's own C library
        recvmmsg, sendmmsg = libc.recvmmsg, libc.sendmmsg
    except (OSError, AttributeError):
        return None
    # int recvmmsg(int fd, struct mmsghdr *v, unsigned vlen, int flags, struct timespec *timeout)
    recvmmsg.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_uint, ctypes.c_int, ctypes.c_void_p]
    recvmmsg.restype = ctypes.c_int
    # int sendmmsg(int fd, struct mmsghdr *v, unsigned vlen, int flags)
    sendmmsg.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_uint, ctypes.c_int]
    sendmmsg.restype = ctypes.c_int
    return recvmmsg, sendmmsg


_CALLS = _libc_calls()


def available() -> bool:
    """Whether this process can batch (Linux, 64-bit, a C library with both calls)."""
    return _CALLS is not None


def _address(family: int, name: bytes | bytearray | memoryview) -> tuple[Any, ...]:
    """The address tuple socket.recvfrom gives for a raw sockaddr of `family`."""
    port = (name[2] << 8) | name[3]
    if family == socket.AF_INET:
        return socket.inet_ntop(socket.AF_INET, bytes(name[4:8])), port
    flowinfo, = struct.unpack_from(">I", name, 4)
    scope, = struct.unpack_from("=I", name, 24)
    host = socket.inet_ntop(socket.AF_INET6, bytes(name[8:24]))
    if scope:  # recvfrom's text comes from getnameinfo, which names a link-local scope ("%eth0")
        flags = socket.NI_NUMERICHOST | socket.NI_NUMERICSERV
        host = socket.getnameinfo((host, port, flowinfo, scope), flags)[0]
    return host, port, flowinfo, scope


class DatagramBatch:
    """Up to `count` datagrams read from one UDP socket per `recv()`, and replies to their
    senders sent per `send()`. Not thread-safe; one per socket."""

    def __init__(self, sock: socket.socket, count: int, slot_size: int) -> None:
        assert _CALLS is not None
        self._recvmmsg, self._sendmmsg = _CALLS
        self.sock = sock
        self.fd = sock.fileno()
        self.family = sock.family
        self.count = count
        self.slot_size = slot_size
        stride = (slot_size + 7) & ~7  # slots start 8-aligned, so a datagram's ID reads as one u16
        self._stride = stride
        # the socket's address length: every header has room for it, the kernel writes the same
        # length back into a receive header (one family per socket), and a reply carries it
        namelen = 16 if sock.family == socket.AF_INET else 28
        self._data = mmap.mmap(-1, count * stride)
        self._names = bytearray(count * _NAME)
        self._ids = bytearray(2 * count)  # a pinned reply's ID, at its send position
        self._recv = (_Mmsghdr * count)()
        self._send = (_Mmsghdr * count)()
        self._recv_iov = (_Iovec * count)()
        self._send_iov = (_Iovec * (2 * count))()  # two per reply: its bytes, or ID + pinned bytes
        # held: while these views live the mmap cannot be closed nor the bytearrays resized, so
        # the addresses the kernel is given stay valid
        self._pins: tuple[ctypes.c_char, ...] = (ctypes.c_char.from_buffer(self._data),
                                                 ctypes.c_char.from_buffer(self._names),
                                                 ctypes.c_char.from_buffer(self._ids))
        data_at, names_at, ids_at = (ctypes.addressof(pin) for pin in self._pins)
        for i in range(count):
            iov = self._recv_iov[i]
            iov.iov_base = data_at + i * stride
            iov.iov_len = slot_size
            for h, iov_at, iovlen in ((self._recv[i].msg_hdr, ctypes.addressof(iov), 1),
                                      (self._send[i].msg_hdr, ctypes.addressof(self._send_iov[2 * i]), 2)):
                h.msg_name = names_at + i * _NAME
                h.msg_namelen = namelen
                h.msg_iov = iov_at
                h.msg_iovlen = iovlen
        self._recv_at = ctypes.addressof(self._recv)
        self._send_at = ctypes.addressof(self._send)
        self._recv_u32 = memoryview(self._recv).cast("B").cast("I")
        self._send_iov_u64 = memoryview(self._send_iov).cast("B").cast("Q")
        self._data_u16 = memoryview(self._data).cast("H")
        self._ids_u16 = memoryview(self._ids).cast("H")
        self._slot_at = [data_at + i * stride for i in range(count)]
        self._id_at = [ids_at + 2 * j for j in range(count)]
        # what pinned replies point at, kept until the position is used again (so past send())
        self._held: list[Pinned | None] = [None] * count
        self._offsets = range(0, count * stride, stride)
        self._lens: list[int] = []
        self.received = 0  # datagrams in the last recv()
        self.queued = 0  # replies waiting for send()

    @classmethod
    def open(cls, sock: socket.socket, count: int, slot_size: int = 65535) -> DatagramBatch | None:
        """A batch for `sock` (AF_INET or AF_INET6, SOCK_DGRAM, non-blocking), or None where
        this process cannot batch."""
        if _CALLS is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
            return None
        return cls(sock, count, slot_size)

    def recv(self, skip: int = 0) -> list[bytes]:
        """The datagrams waiting on the socket, at most `count`, read with one system call
        (empty: none waiting), each without its first `skip` bytes (`datagram(i)` gives it
        whole). An error the socket reports (an ICMP error from an earlier send) raises
        OSError, as recvfrom does. Clears the replies of the last batch."""
        self.queued = 0
        n = self._recvmmsg(self.fd, self._recv_at, self.count, 0, None)
        if n <= 0:
            self.received = 0
            if n == 0:
                return []
            err = ctypes.get_errno()
            if err in _AGAIN:
                return []
            raise OSError(err, os.strerror(err))
        self.received = n
        self._lens = lens = self._recv_u32[_U32_LEN:n * _U32_STRIDE:_U32_STRIDE].tolist()
        data = self._data
        return [data[o + skip:o + k] for o, k in zip(self._offsets, lens, strict=False)]

    def datagram(self, i: int) -> bytes:
        """Datagram `i` of the last recv(), whole."""
        o = i * self._stride
        return self._data[o:o + self._lens[i]]

    def address(self, i: int) -> tuple[Any, ...]:
        """The sender of datagram `i` of the last recv(), as recvfrom gives it."""
        return _address(self.family, memoryview(self._names)[i * _NAME:(i + 1) * _NAME])

    def _header(self, i: int) -> int:
        """The send position of a reply to datagram `i`, its sender's address moved there."""
        j = self.queued
        if j != i:  # this reply's header is slot j's: move the sender's address there
            names = self._names
            names[j * _NAME:(j + 1) * _NAME] = names[i * _NAME:(i + 1) * _NAME]
        self.queued = j + 1
        return j

    def reply(self, i: int, data: bytes | bytearray | memoryview) -> bool:
        """Queue `data` for the sender of datagram `i` of the last recv() (replies queued
        before it must be to datagrams before it); False: too big for a slot, send it yourself."""
        n = len(data)
        if n > self.slot_size:
            return False
        j = self._header(i)
        at = j * self._stride
        self._data[at:at + n] = data
        v = self._send_iov_u64
        k = 4 * j
        v[k + _U64_BASE0] = self._slot_at[j]
        v[k + _U64_LEN0] = n
        v[k + _U64_LEN1] = 0
        return True

    def reply_pinned(self, i: int, tail: Pinned) -> None:
        """Queue datagram `i`'s own first two bytes (a DNS ID) followed by `tail`, for its
        sender, without copying `tail`: the batch holds it until send()."""
        j = self._header(i)
        self._ids_u16[j] = self._data_u16[i * self._stride >> 1]
        v = self._send_iov_u64
        k = 4 * j
        v[k + _U64_BASE0] = self._id_at[j]
        v[k + _U64_LEN0] = 2
        v[k + _U64_BASE1] = tail.address
        v[k + _U64_LEN1] = tail.size
        self._held[j] = tail

    def send(self) -> list[tuple[Any, OSError]]:
        """Send the queued replies, one system call for all unless one fails: the kernel then
        stops there (UDP sends each whole or not at all), and the rest are sent again from the
        one after it. Returns (address, error) for each reply not sent."""
        total = self.queued
        self.queued = 0
        if not total:
            return _NO_FAILURES
        sendmmsg, fd, at = self._sendmmsg, self.fd, self._send_at
        sent = sendmmsg(fd, at, total, 0)
        if sent == total:
            return _NO_FAILURES
        failures: list[tuple[Any, OSError]] = []
        start = 0
        while True:
            if sent <= 0:  # the reply at `start` failed: name it and go on after it
                err = ctypes.get_errno() or errno.EIO
                failures.append((self._sent_to(start), OSError(err, os.strerror(err))))
                start += 1
            else:
                start += sent
            if start >= total:
                return failures
            # a partial count loses the error of the reply that stopped it: ask again from
            # there, so that one is either sent or fails with its own error
            sent = sendmmsg(fd, at + start * _MMSGHDR, total - start, 0)

    def _sent_to(self, j: int) -> tuple[Any, ...]:
        return _address(self.family, memoryview(self._names)[j * _NAME:(j + 1) * _NAME])

    def close(self) -> None:
        """Free the slots (the socket is the caller's); the batch is not used after this."""
        for view in (self._recv_u32, self._send_iov_u64, self._data_u16, self._ids_u16):
            view.release()
        self._held = []
        self._pins = ()
        self._data.close()
