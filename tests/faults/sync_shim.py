"""``python -m tests.faults.sync_shim TASK_DIR``: the worker, with a fault on the journal's
background fdatasync.

The journal makes a tool's result durable with an fdatasync in a thread of its own
(``journal-sync``) while the worker waits on the model. strace counts the calls of each
thread apart, and a new thread starts at one, so it cannot aim at the k-th background
sync; this shim does, in the worker process itself:

* ``FAULTS_BG_SYNC=K:KILL``: SIGKILL the worker on entry to the K-th background sync;
* ``FAULTS_BG_SYNC=K:EIO`` (or ENOSPC; ``K+:EIO``: the K-th and every later one): the
  sync fails with that error, without syncing;
* ``FAULTS_BG_LOG=FILE``: one line per fdatasync of any thread and per write to the
  journal: ``THREAD CALL PATH RESULT``, for the never-retried check;
* ``FAULTS_JOURNAL_KILL=N``: SIGKILL the worker on entry to the N-th write or fdatasync
  of the journal, of whichever thread (the power-loss campaign stops a task there).
"""

from __future__ import annotations

import errno
import os
import runpy
import signal
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from _typeshed import FileDescriptorLike

BACKGROUND = "journal-sync"


def _path(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return "?"


def install(spec: str, log_path: str | None, journal_kill: int = 0) -> None:
    when, _, action = spec.partition(":")
    persistent = when.endswith("+")
    target = int(when.rstrip("+") or 0)
    lock = threading.Lock()
    count = 0
    journal_calls = 0
    real_sync: Callable[[int], None] = os.fdatasync
    real_write: Callable[[int, Any], int] = os.write

    def log(line: str) -> None:
        if log_path:
            with open(log_path, "a") as f:
                f.write(line + "\n")

    def journal_call(path: str) -> None:
        nonlocal journal_calls
        if not path.endswith("/journal"):
            return
        with lock:
            journal_calls += 1
            hit = journal_calls == journal_kill
        if hit:
            os.kill(os.getpid(), signal.SIGKILL)

    def fdatasync(fd: FileDescriptorLike) -> None:  # os.fdatasync's own signature
        nonlocal count
        fd = fd if isinstance(fd, int) else fd.fileno()
        journal_call(_path(fd))
        thread = threading.current_thread().name
        hit = False
        if thread == BACKGROUND:
            with lock:
                count += 1
                hit = target > 0 and (count == target or (persistent and count > target))
        if hit and action == "KILL":
            os.kill(os.getpid(), signal.SIGKILL)
        if hit:
            code = getattr(errno, action)
            log(f"{thread} fdatasync {_path(fd)} -1 {action} (INJECTED)")
            raise OSError(code, os.strerror(code))
        try:
            real_sync(fd)
        except OSError as exc:
            log(f"{thread} fdatasync {_path(fd)} -1 {errno.errorcode.get(exc.errno or 0)}")
            raise
        log(f"{thread} fdatasync {_path(fd)} 0")

    def write(fd: int, data: Any) -> int:
        path = _path(fd)
        journal_call(path)
        if path.endswith("/journal"):
            log(f"{threading.current_thread().name} write {path} {len(data)}")
        return real_write(fd, data)

    os.fdatasync = fdatasync
    os.write = write


def main() -> None:
    install(
        os.environ.get("FAULTS_BG_SYNC", ""),
        os.environ.get("FAULTS_BG_LOG"),
        int(os.environ.get("FAULTS_JOURNAL_KILL", "0")),
    )
    sys.argv = ["worker", *sys.argv[1:]]
    runpy.run_module("worker", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
