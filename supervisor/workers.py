"""Worker processes: starting them, watching them die, and killing what they leave.

Each worker runs in its own session, so its process group holds it and every process a
tool started; killing the group leaves nothing acting for a worker that is gone. Exits
are seen through a pidfd (readable the moment the process ends), for children and for
workers adopted from an earlier daemon alike.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from worker.durable import open_private, read_json
from worker.errors import JournalCorruptError
from worker.journal import scan
from worker.lock import holder_pid, is_locked
from worker.spool import Spool, TaskDir

SIGNAL_NAMES = {int(s): s.name for s in signal.Signals}


@dataclass
class WorkerProcess:
    task: TaskDir
    pid: int
    pidfd: int
    popen: subprocess.Popen[bytes] | None  # None for a worker adopted from an earlier daemon
    started: float = field(default_factory=time.monotonic)
    journal_size: int = 0
    kill_reason: str | None = None  # hung, stalled, cancel, stop
    term_deadline: float | None = None

    def exit_status(self) -> tuple[int | None, str | None]:
        """(exit code, signal name) once the process has ended; reaps a child."""
        if self.popen is not None:
            code = self.popen.wait()
            return (None, SIGNAL_NAMES.get(-code, str(-code))) if code < 0 else (code, None)
        with contextlib.suppress(OSError, ValueError):
            data = read_json(self.task.exit)
            if isinstance(data, dict) and data.get("pid") == self.pid:
                return int(data["code"]), None
        return None, "unknown"

    def signal_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, sig)

    def signal_worker(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, sig)

    def close(self) -> None:
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1


def spawn(task: TaskDir, config_path: Path | None, env: dict[str, str]) -> WorkerProcess:
    cmd = [sys.executable, "-m", "worker", str(task.path)]
    if config_path is not None:
        cmd += ["--config", str(config_path)]
    out = open_private(task.output, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        popen = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            env=env,
            start_new_session=True,
            close_fds=True,
        )
    finally:
        os.close(out)
    return WorkerProcess(task, popen.pid, os.pidfd_open(popen.pid), popen, journal_size=_size(task))


def _size(task: TaskDir) -> int:
    try:
        return task.journal.stat().st_size
    except OSError:
        return 0


#: Records that move a task forward. A re-run's intent (or a hold, or an applied
#: decision) is written before the work: a worker that crashes again right after it has
#: made no progress, and the restart policy must back off rather than restart at once.
PROGRESS_RECORDS = frozenset({"turn", "result", "user", "end", "rewind"})


def journal_grew(worker: WorkerProcess) -> bool:
    """Whether the worker recorded progress (a turn, a tool result...) in its life."""
    try:
        with open(worker.task.journal, "rb") as f:
            f.seek(worker.journal_size)
            tail = f.read()
    except OSError:
        return False
    try:
        found = scan(tail, name=str(worker.task.journal)).records
    except JournalCorruptError:
        found = []
    if not found:  # not aligned on a frame (a torn tail was cut first): judge by size
        return bool(tail) and _size(worker.task) > worker.journal_size
    return any(record.get("k") in PROGRESS_RECORDS for record, _ in found)


def process_started(pid: int) -> float | None:
    with contextlib.suppress(psutil.Error):
        return psutil.Process(pid).create_time()
    return None


def adopt(task: TaskDir, pid: int | None, started: float | None) -> WorkerProcess | None:
    """Re-attach to a worker an earlier daemon started, if it is provably that worker:
    same pid, same start time, and it holds the task lock."""
    if pid is None or started is None:
        return None
    if process_started(pid) != started or holder_pid(task.lock) != pid:
        return None
    if not is_locked(task.lock):
        return None
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return None
    return WorkerProcess(task, pid, pidfd, None, journal_size=_size(task))


def find_workers(spool: Spool) -> dict[str, int]:
    """Live worker processes of ``spool`` by task id, found by their command line
    (``python -m worker SPOOL/tasks/ID``): what an earlier daemon left running, including
    a worker it started and died before recording."""
    prefix = str(spool.tasks_dir) + os.sep
    found: dict[int, tuple[str, int]] = {}  # pid -> (task id, parent pid)
    for proc in psutil.process_iter(["cmdline", "status", "ppid"]):
        cmd = proc.info["cmdline"] or []
        if proc.info["status"] == psutil.STATUS_ZOMBIE or cmd[1:3] != ["-m", "worker"]:
            continue
        if len(cmd) > 3 and cmd[3].startswith(prefix):
            found[proc.pid] = (cmd[3][len(prefix) :], proc.info["ppid"])
    # a worker's child between fork and exec (git, a tool's shell) has its command line too
    return {task: pid for pid, (task, parent) in found.items() if parent not in found}


def adopt_found(task: TaskDir, pid: int) -> WorkerProcess | None:
    """Re-attach to a worker of ``task`` that ``find_workers`` saw, if it still is one."""
    try:
        pidfd = os.pidfd_open(pid)
    except (ProcessLookupError, PermissionError):
        return None
    try:  # the pidfd pins the process: check that it is (still) this task's worker
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE or str(task.path) not in proc.cmdline():
            raise psutil.NoSuchProcess(pid)
    except psutil.Error:
        os.close(pidfd)
        return None
    return WorkerProcess(task, pid, pidfd, None, journal_size=_size(task))


def trim_output(task: TaskDir, limit: int) -> None:
    """Keep a worker's captured output under ``limit``: the older part moves to .1."""
    try:
        size = task.output.stat().st_size
    except OSError:
        return
    if size <= limit:
        return
    with contextlib.suppress(OSError):
        with open(task.output, "rb") as f:
            f.seek(max(0, size - limit // 2))
            tail = f.read()
        old = task.output.with_name(task.output.name + ".1")
        fd = open_private(old, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        with os.fdopen(fd, "wb") as f:
            f.write(tail)
        os.truncate(task.output, 0)
