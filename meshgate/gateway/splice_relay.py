"""A bulk relay between two sockets that the kernel moves: splice(2) through a pipe each way.

The portal's relay (server.py) reads each chunk into Python and writes it out
again: two copies through user space per byte. Once a relay between two TCP
sockets shows bulk (a read filled the whole read buffer) and neither side has
anything queued in its transport, `SpliceRelay` takes both directions over:
socket -> pipe -> socket with `os.splice`, so the bytes never enter the
process (issue 18 item 3, "bulk >= 80% of direct loopback").

Each direction owns a pipe (F_SETPIPE_SZ raised to PIPE_SIZE when allowed): at
most that much is in flight per direction, so server.py uses the relay only when
limits.socks5_write_high_water (the bound of the Python relay) is at least that.
Back-pressure is the relay's usual rule: while the pipe cannot be emptied into
the destination (EAGAIN), the source is not read (its reader is removed and
the destination's writer waits). EOF on a source is passed on with
shutdown(SHUT_WR) once its pipe is empty (half-close); the relay ends when
both directions have, or at the first error (both sides aborted).

The transports stay open, paused, as owners of the sockets (their connection_lost
does the bookkeeping when the relay closes them); the relay works on duplicates
of their descriptors and closes those itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import socket
from collections.abc import Callable

PIPE_SIZE = 1 << 20  # bytes a pipe may hold (the kernel caps it at /proc/sys/fs/pipe-max-size)
CHUNK = PIPE_SIZE
_FLAGS = os.SPLICE_F_MOVE | os.SPLICE_F_NONBLOCK


class _Direction:
    __slots__ = ("dst", "eof", "pending", "pr", "pw", "reading", "shut", "src", "writing")

    def __init__(self, src: int, dst: int) -> None:
        self.src, self.dst = src, dst
        self.pr, self.pw = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        with contextlib.suppress(OSError):
            fcntl.fcntl(self.pw, fcntl.F_SETPIPE_SZ, PIPE_SIZE)
        self.pending = 0  # bytes in the pipe
        self.eof = False  # the source ended
        self.shut = False  # the end was passed on
        self.reading = False
        self.writing = False


class SpliceRelay:
    """Both directions of one client <-> destination relay, moved by the kernel.

    `moved(direction, n)`: n bytes went client -> destination (direction 0) or back (1);
    `done(error)`: the relay is over (None: both ends finished cleanly)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, client_fd: int, dest_fd: int,
                 moved: Callable[[int, int], None], done: Callable[[OSError | None], None]) -> None:
        self.loop = loop
        self.moved = moved
        self.done = done
        self.closed = False
        self._fds: list[int] = []
        try:
            c, d = os.dup(client_fd), os.dup(dest_fd)
            self._fds += [c, d]
            self.dirs = (_Direction(c, d), _Direction(d, c))
        except OSError:
            self._close_fds()
            raise
        for dr in self.dirs:
            self._fds += [dr.pr, dr.pw]
        for i in (0, 1):
            self._read_on(i)

    # ------------------------------------------------------------ polling

    def _read_on(self, i: int) -> None:
        dr = self.dirs[i]
        if not dr.reading and not dr.eof:
            dr.reading = True
            self.loop.add_reader(dr.src, self._readable, i)

    def _read_off(self, i: int) -> None:
        dr = self.dirs[i]
        if dr.reading:
            dr.reading = False
            self.loop.remove_reader(dr.src)

    def _write_on(self, i: int) -> None:
        dr = self.dirs[i]
        if not dr.writing:
            dr.writing = True
            self.loop.add_writer(dr.dst, self._writable, i)

    def _write_off(self, i: int) -> None:
        dr = self.dirs[i]
        if dr.writing:
            dr.writing = False
            self.loop.remove_writer(dr.dst)

    # ------------------------------------------------------------ moving

    def _readable(self, i: int) -> None:
        dr = self.dirs[i]
        try:
            n = os.splice(dr.src, dr.pw, CHUNK, flags=_FLAGS)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            self._fail(e)
            return
        if n == 0:
            dr.eof = True
            self._read_off(i)
        else:
            dr.pending += n
        self._drain(i)

    def _writable(self, i: int) -> None:
        self._drain(i)

    def _drain(self, i: int) -> None:
        dr = self.dirs[i]
        while dr.pending:
            try:
                m = os.splice(dr.pr, dr.dst, dr.pending, flags=_FLAGS)
            except (BlockingIOError, InterruptedError):
                # the destination is full: stop reading the source until it takes more
                self._read_off(i)
                self._write_on(i)
                return
            except OSError as e:
                self._fail(e)
                return
            dr.pending -= m
            self.moved(i, m)
        self._write_off(i)
        if dr.eof:
            if not dr.shut:
                dr.shut = True
                try:
                    _shutdown_write(dr.dst)
                except OSError as e:
                    self._fail(e)
                    return
            if all(d.shut for d in self.dirs):
                self._finish(None)
        else:
            self._read_on(i)

    # ------------------------------------------------------------ ending

    def _fail(self, e: OSError) -> None:
        self._finish(e)

    def _finish(self, error: OSError | None) -> None:
        if self.closed:
            return
        self.close()
        self.done(error)

    def close(self) -> None:
        """Stop moving and close what the relay owns (its duplicates and pipes)."""
        if self.closed:
            return
        self.closed = True
        for i in (0, 1):
            with contextlib.suppress(Exception):
                self._read_off(i)
            with contextlib.suppress(Exception):
                self._write_off(i)
        self._close_fds()

    def _close_fds(self) -> None:
        for fd in self._fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds = []


def _shutdown_write(fd: int) -> None:
    s = socket.socket(fileno=fd)
    try:
        s.shutdown(socket.SHUT_WR)
    finally:
        s.detach()  # the descriptor stays the relay's
