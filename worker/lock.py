"""The single-writer lock of a task (invariant 4).

A worker holds an exclusive ``flock`` on ``TASK/lock`` for its whole life. The lock dies
with the process (the kernel drops it), never with a stale file, and the descriptor is
close-on-exec so a tool's child process cannot keep it alive. The file holds the
holder's pid, for error messages and for the supervisor's adoption check.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from pathlib import Path

from worker.errors import LockBusyError
from worker.store.durable import open_private, open_regular


class TaskLock:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = -1

    def acquire(self, *, wait: float = 0.0) -> TaskLock:
        """Take the lock, retrying for up to ``wait`` seconds; LockBusyError if held."""
        fd = open_private(self.path, os.O_RDWR | os.O_CREAT)
        deadline = time.monotonic() + wait
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    holder = holder_pid(self.path)
                    os.close(fd)
                    raise LockBusyError(
                        f"{self.path} is held by process {holder}; another worker is running "
                        "this task. Wait for it to exit or stop it first.",
                        holder,
                    ) from None
                time.sleep(0.02)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> TaskLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def holder_pid(path: Path) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        return int(path.read_text().split()[0])
    return None


def is_locked(path: Path) -> bool:
    """True when some process holds the lock. Probes without taking it for long."""
    try:
        fd = open_regular(path)
    except OSError:  # none, or not a lock file (a symlink): no worker can hold it either
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False
