"""The single-writer lock of a task (invariant 4).

A worker holds an exclusive ``flock`` on ``TASK/lock`` for its whole life. The lock dies
with the process (the kernel drops it), never with a stale file, and the descriptor is
close-on-exec so a tool's child process cannot keep it alive. The file holds the
holder's pid, for error messages and for the supervisor's adoption check: written over
the last holder's before the file is cut to its length, so that it is never seen empty
once a pid was in it. A reader that finds no pid (a new file, one emptied or garbled by
hand) is told "pid unknown" (None), never an error: nothing in a spool stops the daemon.
"""

from __future__ import annotations

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
        # the pid over the last holder's, then the rest cut off: never an empty file
        pid = f"{os.getpid()}\n".encode()
        os.pwrite(fd, pid, 0)
        os.ftruncate(fd, len(pid))
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


#: More than a pid and its newline: what a lock file holds past this is not read.
_PID_BYTES = 32


def holder_pid(path: Path) -> int | None:
    """The pid the lock file at ``path`` names, or None when it names none (a new file
    not written yet, one emptied, garbled or not a regular file) or cannot be read."""
    try:
        fd = open_regular(path)
    except OSError:
        return None
    try:
        head = os.pread(fd, _PID_BYTES, 0)
    except OSError:
        return None
    finally:
        os.close(fd)
    words = head.split(maxsplit=1)
    if not words or not words[0].isdigit() or not int(words[0]):
        return None
    return int(words[0])


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
