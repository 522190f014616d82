"""The node's state directory, held by one running node at a time.

Two nodes on one `node.state_dir` would share its node id (and, with
identities, its keys): they never link to each other and each one's records
overwrite the other's. A node takes an exclusive `flock` on STATE_DIR/lock
for as long as it runs and writes its pid there, so a second node on the
same directory stops at start-up (exit status 2) naming the directory and the
pid that holds it. The kernel drops the lock when the holder exits, however
it exits, so a crash leaves nothing to clean up.
"""

from __future__ import annotations

import fcntl
import logging
import os
from pathlib import Path

from meshgate.errors import StartupError

log = logging.getLogger("meshgate.node")

LOCK_NAME = "lock"


class StateDirLock:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    def acquire(self) -> None:
        """Hold the directory; StartupError (naming node.state_dir and the holder's pid) if
        another node does. A directory this process cannot write is used without a lock, as
        before, with a warning: the node can still run, only without the guard."""
        try:
            self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(self.path / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as e:
            log.warning("node.state_dir: cannot create a lock in %s (%s); running without one",
                        self.path, e.strerror or e)
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_pid(fd)
            os.close(fd)
            raise StartupError(
                f"node.state_dir: {self.path} is in use by another running meshgate node "
                f"(pid {holder}); give each node its own state_dir"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None


def _read_pid(fd: int) -> str:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return "unknown"
    return text if text.isdigit() else "unknown"
