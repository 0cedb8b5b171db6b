"""A worker's captured output (``TASK/worker.log``), bounded by its writer.

The daemon (or the fork server) starts a worker with its standard output and error on
``worker.log``. A file descriptor has no size cap of its own: a tool module that writes
1 GB to stdout puts 1 GB on the disk before any trimming from outside could catch up. So
the worker moves its descriptors 1 and 2 onto a pipe as it starts (``BoundedOutput.
install``), and a thread of its own copies the pipe to ``worker.log``, moving the file
to ``worker.log.1`` whenever the next chunk would take it past ``OUTPUT_LIMIT``. That
keeps at most two files of ``OUTPUT_LIMIT`` each, whatever is written, by the worker or
by any process that inherited its output, for one thread blocked in ``read`` and no
cost on the paths that do not print.

The pipe also makes a full disk harmless to whoever prints: a write to a pipe never
fails for want of space. A chunk the copy cannot write (ENOSPC, EIO, a read-only spool)
is dropped and counted; output is advisory, the journal is the record.

The daemon's own log file (``supervisor.log``, ``--log-file``) and the fork server's
(``forkserver.log``, its standard error only: its standard output is its reply pipe) are
bounded the same way, by the process that writes them, with their own limits
(``LOG_FILE_LIMIT``). A file found past its limit is moved aside before the first write.

What can be lost: the last pipe buffer (64 KiB at most) when the worker is killed with
SIGKILL. On every other exit ``close`` drains the pipe first, then points descriptors 1
and 2 at the file itself, so the interpreter's last words (a traceback) still land.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from pathlib import Path

from worker.store.durable import open_private

#: The size past which ``worker.log`` is moved to ``worker.log.1`` (so at most twice this
#: is kept).
OUTPUT_LIMIT = 1024 * 1024
#: The same for the daemon's and the fork server's own log files.
LOG_FILE_LIMIT = 8 * 1024 * 1024
_CHUNK = 64 * 1024
_DRAIN_WAIT = 1.0  # seconds ``close`` waits for the copy (a process may still hold the pipe)


class BoundedOutput:
    """The copy of what this process writes on ``fds`` (stdout and stderr) to ``path``,
    rotated at ``limit`` bytes."""

    def __init__(
        self, path: Path, limit: int = OUTPUT_LIMIT, *, fds: tuple[int, ...] = (1, 2)
    ) -> None:
        self.path = path
        self.limit = max(limit, _CHUNK)
        self.dropped = 0  # bytes that could not be written
        self._fds = fds
        self._lock = threading.Lock()  # the copy's writes, and ``reopen``
        self._fd = open_private(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        self.size = os.fstat(self._fd).st_size
        if self.size >= self.limit:
            self._rotate()
        self._read, write = os.pipe()  # both close-on-exec; fds 1 and 2 are inheritable
        self._thread = threading.Thread(target=self._copy, name="output", daemon=True)
        try:  # the copy runs before the descriptors move: no thread, nothing moved
            self._thread.start()
        except RuntimeError:  # (no thread to be had: the worker says so on the file)
            for fd in (self._read, write, self._fd):
                os.close(fd)
            raise
        for fd in fds:
            os.dup2(write, fd)
        os.close(write)

    @classmethod
    def install(
        cls, path: Path, limit: int = OUTPUT_LIMIT, *, fds: tuple[int, ...] = (1, 2)
    ) -> BoundedOutput | None:
        """Take over ``fds`` when they are ``path`` (the worker was started by the daemon);
        None otherwise (run by hand, or by a test that reads a pipe)."""
        try:
            ours, given = os.stat(path), os.fstat(fds[0])
        except OSError:
            return None
        if (ours.st_dev, ours.st_ino) != (given.st_dev, given.st_ino):
            return None
        try:
            return cls(path, limit, fds=fds)
        except OSError:  # the file cannot be opened again (a read-only spool): leave it be
            return None
        except RuntimeError:  # no thread to be had: left unbounded, and the worker, which
            return None  # needs more threads, stops for want of resources (exit 8)

    def _copy(self) -> None:
        while data := os.read(self._read, _CHUNK):
            with self._lock:
                self._write(data)
        os.close(self._read)

    def reopen(self) -> None:
        """Write to a file opened by the name again (after logrotate moved the old one
        away); OSError when it cannot be opened, and the old one stays."""
        fd = open_private(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        with self._lock:
            os.close(self._fd)
            self._fd = fd
            self.size = os.fstat(fd).st_size

    def _write(self, data: bytes) -> None:
        if self.size and self.size + len(data) > self.limit and not self._rotate():
            self.dropped += len(data)  # never past the limit, even when rotation fails
            return
        view = memoryview(data)
        try:
            while view:
                written = os.write(self._fd, view)
                self.size += written
                view = view[written:]
        except OSError:
            self.dropped += len(view)

    def _rotate(self) -> bool:
        """Move the file to ``.1`` and start a new one (or, where a rename is refused, empty
        it); False when neither can be done."""
        try:
            os.replace(self.path, self.path.with_name(self.path.name + ".1"))
            fd = open_private(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_TRUNC)
        except OSError:
            try:
                os.ftruncate(self._fd, 0)
            except OSError:
                return False
        else:
            os.close(self._fd)
            self._fd = fd
        self.size = 0
        return True

    def close(self) -> None:
        """Drain the pipe into the file, then write to the file directly (for what the
        interpreter still says on its way out)."""
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        null = os.open(os.devnull, os.O_WRONLY)
        for fd in self._fds:
            os.dup2(null, fd)
        os.close(null)
        self._thread.join(_DRAIN_WAIT)
        for fd in self._fds:
            os.dup2(self._fd, fd)
