"""Worker processes: starting them, watching them die, and killing what they leave.

Each worker runs in its own session, so its process group holds it and every process a
tool started; killing the group leaves nothing acting for a worker that is gone. Exits
are seen through a pidfd (readable the moment the process ends), for children and for
workers adopted from an earlier daemon alike.

Workers start from the fork server when it is ready (a warm process with the SDK
imported: supervisor/forkserver.py) and from a fresh interpreter otherwise. Either way
the daemon, a child subreaper, is their parent and reaps them, so it reads their exit
status directly. A worker is found again after a daemon restart through its task lock,
whose holder wrote its pid there: that is the one proof of "this is the task's worker"
that does not depend on how the worker was started.
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
from worker.spool import TaskDir

SIGNAL_NAMES = {int(s): s.name for s in signal.Signals}


@dataclass
class WorkerProcess:
    task: TaskDir
    pid: int
    pidfd: int
    popen: subprocess.Popen[bytes] | None  # set when started from a fresh interpreter
    started: float = field(default_factory=time.monotonic)
    journal_size: int = 0
    kill_reason: str | None = None  # hung, stalled, cancel, stop
    term_deadline: float | None = None
    beat_due: float = 0.0  # wall time before which no liveness verdict can fall due

    def exit_status(self, reaped: dict[int, int]) -> tuple[int | None, str | None]:
        """(exit code, signal name) once the process has ended; reaps it if it is our
        child. ``reaped`` holds wait statuses the orphan reaper already collected."""
        status = reaped.pop(self.pid, None)
        if status is None and self.popen is not None:
            code = self.popen.wait()
            return (None, SIGNAL_NAMES.get(-code, str(-code))) if code < 0 else (code, None)
        if status is None:
            with contextlib.suppress(ChildProcessError):
                pid, status = os.waitpid(self.pid, os.WNOHANG)
                status = status if pid else None
        if status is not None:
            code = os.waitstatus_to_exitcode(status)
            return (None, SIGNAL_NAMES.get(-code, str(-code))) if code < 0 else (code, None)
        with contextlib.suppress(OSError, ValueError):  # not our child: its last words
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
    """Start a worker for ``task`` in a fresh interpreter (the fork server's path is the
    daemon's ``_start``, which asks it without waiting)."""
    size = journal_size(task)
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
    return WorkerProcess(task, popen.pid, os.pidfd_open(popen.pid), popen, journal_size=size)


def journal_size(task: TaskDir) -> int:
    try:
        return task.journal.stat().st_size
    except OSError:
        return 0


#: Records that move a task forward. A re-run's intent (or a hold, or an applied
#: decision) is written before the work: a worker that crashes again right after it has
#: made no progress, and the restart policy must back off rather than restart at once.
PROGRESS_RECORDS = frozenset({"turn", "result", "user", "end", "rewind"})


@dataclass(frozen=True)
class Progress:
    """What a worker recorded in its life: any progress, and the turn it reached (None
    when it recorded no turn or rewind: it never left the turn it started at)."""

    grew: bool
    turn: int | None = None


def journal_progress(worker: WorkerProcess) -> Progress:
    """Read what the worker appended to its journal (for a crash: the heartbeat's turn
    may be up to an interval old, the journal's is exact)."""
    try:
        with open(worker.task.journal, "rb") as f:
            f.seek(worker.journal_size)
            tail = f.read()
    except OSError:
        return Progress(False)
    try:
        found = [
            record
            for record, _ in scan(
                tail, name=str(worker.task.journal), base=worker.journal_size
            ).records
        ]
    except JournalCorruptError:
        found = []
    if not found:  # not aligned on a frame (a torn tail was cut first): judge by size
        return Progress(bool(tail) and journal_size(worker.task) > worker.journal_size)
    turn = None
    for record in found:
        if record["k"] in ("turn", "rewind"):
            turn = record.get("turn" if record["k"] == "turn" else "to")
    grew = any(record["k"] in PROGRESS_RECORDS for record in found)
    return Progress(grew, turn if isinstance(turn, int) else None)


def process_started(pid: int) -> float | None:
    with contextlib.suppress(psutil.Error):
        return psutil.Process(pid).create_time()
    return None


def adopt(task: TaskDir) -> WorkerProcess | None:
    """Re-attach to the process that holds ``task``'s lock (a worker an earlier daemon
    started, recorded or not), or None when no live process holds it."""
    pid = holder_pid(task.lock)
    if pid is None or pid == os.getpid() or not is_locked(task.lock):
        return None
    try:
        pidfd = os.pidfd_open(pid)
    except (ProcessLookupError, PermissionError):
        return None
    # the pidfd pins the process; make sure it is still the holder, not a pid reused
    if not is_locked(task.lock) or holder_pid(task.lock) != pid:
        os.close(pidfd)
        return None
    return WorkerProcess(task, pid, pidfd, None, journal_size=journal_size(task))


def reap_orphans(keep: set[int], reaped: dict[int, int]) -> None:
    """Reap exited children that are not ``keep`` (a tool's process re-parented to the
    subreaper when its worker died). A worker reaped here by chance has its status kept
    in ``reaped`` for ``WorkerProcess.exit_status``."""
    with contextlib.suppress(psutil.Error):
        for child in psutil.Process().children():
            if child.pid in keep:
                continue
            with contextlib.suppress(ChildProcessError):
                pid, status = os.waitpid(child.pid, os.WNOHANG)
                if pid:
                    reaped[pid] = status


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
