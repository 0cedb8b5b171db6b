"""Worker processes: starting them, watching them die, and killing what they leave.

Each worker runs in its own session, so its process group holds it and every process a
tool started that stayed in the group; killing the group leaves nothing acting for a
worker that is gone. A process that left the group (``setsid``) stays the worker's
descendant, the worker being a subreaper, and the worker kills it when it ends; if the
worker is killed first, such processes pass to the daemon, which kills every child it
did not start on purpose (``supervisor.strays``). Exits are seen through a pidfd (readable the
moment the process ends, after the kernel has re-parented the dead worker's children),
for children and for workers adopted from an earlier daemon alike.

Workers start from the fork server when it is ready (a warm process with the SDK
imported: supervisor/forkserver.py) and from a fresh interpreter otherwise. Either way
the daemon, a child subreaper, is their parent and reaps them, so it reads their exit
status directly. A worker is found again after a daemon restart through its task lock,
whose holder wrote its pid there: that is the one proof of "this is the task's worker"
that does not depend on how the worker was started. On a shared store no lock file
holds it: a claim's worker is found by its heartbeat, which names its process
(``adopt_claimed``).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from supervisor.exits import KillReason, WorkerExit
from supervisor.status import load_state
from supervisor.stores import store_of
from worker.credentials import Credentials, start_process
from worker.descendants import KILL_PATIENCE, dies_with, kill_tree
from worker.errors import AgentdError, JournalCorruptError, SpoolError, StorageError
from worker.identity import ProcessId
from worker.protocol import VERDICT_EXITS, ExitCode, exit_record_reason
from worker.records import RecordKind
from worker.spool import TaskDir
from worker.store.base import JSON, START, Cursor, Owner
from worker.store.durable import open_private

SIGNAL_NAMES = {int(s): s.name for s in signal.Signals}
REPARENT_WAIT = 0.2  # seconds a forked worker's exit may wait for it to become our child


@dataclass
class WorkerProcess:
    task: TaskDir
    pid: int
    pidfd: int
    popen: subprocess.Popen[bytes] | None  # set when started from a fresh interpreter
    started: float = field(default_factory=time.monotonic)
    journal_at: Cursor = START  # the journal's end when it started (``journal_end``)
    kill_reason: KillReason | None = None  # why its supervisor ended it, if it did
    term_deadline: float | None = None
    beat_due: float = 0.0  # monotonic time before which no liveness verdict can fall due
    forked: bool = False  # by the fork server: our child once its intermediate parent exits

    def exit_status(self) -> tuple[int | None, str | None]:
        """(exit code, signal name) once the process has ended; reaps it if it is our
        child (no one else reaps a live worker: the sweep of strays spares it)."""
        if self.popen is not None:
            code = self.popen.wait()
            return (None, SIGNAL_NAMES.get(-code, str(-code))) if code < 0 else (code, None)
        status = self._wait()
        if status is not None:
            code = os.waitstatus_to_exitcode(status)
            return (None, SIGNAL_NAMES.get(-code, str(-code))) if code < 0 else (code, None)
        with contextlib.suppress(ValueError):  # not our child: its last words
            data = store_of(self.task).read_exit(self.task.id)
            if data is not None and data.get("pid") == self.pid:
                return int(data["code"]), None
        return None, "unknown"

    def exited(self) -> bool:
        """Whether the process has ended, its exit handled or not (its pidfd is readable).
        A daemon that was stopped (SIGSTOP) wakes with exits and due verdicts at once: a
        worker that ended meanwhile is an exit to settle, never a hang to punish."""
        return self.ended_within(0)

    def ended_within(self, seconds: float) -> bool:
        """Whether the process ends within ``seconds`` (waits on its pidfd)."""
        if self.pidfd < 0:
            return True
        poller = select.poll()
        poller.register(self.pidfd, select.POLLIN)
        return bool(poller.poll(max(0, int(seconds * 1000))))

    def _wait(self) -> int | None:
        """Reap the worker if it is our child. One the fork server forked is ours only
        once its intermediate parent has exited, microseconds after the fork; a worker that
        ends at once (a full disk stops it in milliseconds) can be faster than that, so it
        is waited for up to ``REPARENT_WAIT``: an exit status read as "unknown" would be
        taken for a crash when exit.json could not be written either."""
        deadline = time.monotonic() + (REPARENT_WAIT if self.forked else 0.0)
        while True:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                if time.monotonic() >= deadline:
                    return None
                time.sleep(0.001)
                continue
            return status if pid else None

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


def spawn(
    task: TaskDir,
    config_path: Path | None,
    env: dict[str, str],
    credentials: Credentials | None = None,
    *,
    dies_with_parent: bool = False,
) -> WorkerProcess:
    """Start a worker for ``task`` in a fresh interpreter (the fork server's path is the
    daemon's ``_start``, which asks it without waiting). ``env`` holds no secret: the
    worker gets ``credentials`` through a handover pipe. ``dies_with_parent``: the worker
    is killed when this process ends, however it ends (``agentd run``)."""
    start = journal_end(task)
    cmd = [sys.executable, "-m", "worker", str(task.path)]
    if config_path is not None:
        cmd += ["--config", str(config_path)]
    out = open_output(task)
    try:
        popen = start_process(
            cmd,
            credentials or Credentials(),
            env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            start_new_session=True,
            close_fds=True,
            # (preexec_fn: agentd run starts its worker from its only thread)
            preexec_fn=dies_with(os.getpid()) if dies_with_parent else None,
        )
    finally:
        os.close(out)
    return WorkerProcess(task, popen.pid, os.pidfd_open(popen.pid), popen, journal_at=start)


def open_output(task: TaskDir) -> int:
    """A descriptor for a new worker's stdout and stderr: its ``worker.log``, which the
    worker bounds itself (``worker.output``), or /dev/null when a full or read-only spool
    refuses the file (the worker still runs, and its exit code tells the storage fault)."""
    try:
        return open_private(task.output, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    except OSError:
        return os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)


def journal_end(task: TaskDir) -> Cursor:
    """Where the task's journal ends now: ``TaskStore.journal_end`` (``START`` when a
    shared store cannot say: a worker started then has every record counted as its own)."""
    try:
        return store_of(task).journal_end(task.id)
    except StorageError:
        return START


#: Records that move a task forward. A re-run's intent (or a hold, or an applied
#: decision) is written before the work: a worker that crashes again right after it has
#: made no progress, and the restart policy must back off rather than restart at once.
PROGRESS_RECORDS = frozenset(
    {RecordKind.TURN, RecordKind.RESULT, RecordKind.USER, RecordKind.END, RecordKind.REWIND}
)


@dataclass(frozen=True)
class Progress:
    """What a worker recorded in its life: any progress, and the turn it reached (None
    when it recorded no turn or rewind: it never left the turn it started at)."""

    grew: bool
    turn: int | None = None


def journal_progress(worker: WorkerProcess) -> Progress:
    """Read what the worker appended to its journal (for a crash: the heartbeat's turn
    may be up to an interval old, the journal's is exact)."""
    store = store_of(worker.task)
    try:
        found = store.replay(worker.task.id, worker.journal_at)
    except JournalCorruptError:
        found = []
    except (OSError, SpoolError):
        return Progress(False)
    if not found:  # not aligned on a frame (a torn tail was cut first): judge by size
        return Progress(journal_end(worker.task) > worker.journal_at)
    turn = None
    for record in found:
        if record["k"] in (RecordKind.TURN, RecordKind.REWIND):
            turn = record.get("turn" if record["k"] == RecordKind.TURN else "to")
    grew = any(record["k"] in PROGRESS_RECORDS for record in found)
    return Progress(grew, turn if isinstance(turn, int) else None)


def worker_exit(
    worker: WorkerProcess, code: int | None, sig: str | None, beat_turn: int
) -> WorkerExit:
    """How ``worker`` ended, as ``exits.settle`` judges it: what it said in its exit record
    (a verdict exit's reason), and what its journal shows (read only for an exit that is
    no verdict of the worker's own, or a storage fault: a crash is judged by them). Words
    the store could not give are ``unread``, with why."""
    said = unread = None
    if code in VERDICT_EXITS:
        try:
            said = last_words(worker, code)
        except StorageError as exc:
            unread = str(exc)
    progressed, turn = False, beat_turn
    if code not in VERDICT_EXITS or code == ExitCode.STORAGE:
        progress = journal_progress(worker)
        progressed = progress.grew
        turn = beat_turn if progress.turn is None else progress.turn
    return WorkerExit(code, sig, worker.kill_reason, said, progressed, turn, unread)


def last_words(worker: WorkerProcess, code: int | None) -> str | None:
    """The reason ``worker`` gave in its exit record (None when it wrote none), or
    ``StorageError`` when the store cannot say (a shared store away). A worker that says its
    task ended but could not write the record (a full disk) leaves the end in its journal:
    that reason, with a word on the record."""
    said = exit_record_reason(store_of(worker.task).read_exit(worker.task.id), worker.pid)
    if said is not None or code not in (ExitCode.DONE, ExitCode.FAILED, ExitCode.CONFIG):
        return said
    try:
        ended = load_state(worker.task, full=False).ended
    except (AgentdError, OSError, ValueError):
        ended = None
    missing = "the worker left no exit record (could it write to its spool?)"
    if ended is not None and ended.get("reason"):
        return f"{ended['reason']}; {missing}"
    return missing


def process_started(pid: int) -> float | None:
    """When process ``pid`` started, or None when it cannot be seen. psutil raises a bare
    ``FileNotFoundError`` for a process that turns visible again between its two reads (a
    /proc with ``hidepid``, as ``ProtectProc=invisible`` mounts it, hides a process while
    it is not dumpable, and an exec makes it dumpable again)."""
    with contextlib.suppress(psutil.Error, OSError):
        return psutil.Process(pid).create_time()
    return None


def adopt(task: TaskDir) -> WorkerProcess | None:
    """Re-attach to the process that holds ``task``'s lock (a worker an earlier daemon
    started, recorded or not), or None when no live process holds it."""
    store = store_of(task)
    pid = store.owner_pid(task.id)
    if pid is None or pid == os.getpid() or not store.owned(task.id):
        return None
    try:
        pidfd = os.pidfd_open(pid)
    except (ProcessLookupError, PermissionError):
        return None
    # the pidfd pins the process; make sure it is still the holder, not a pid reused
    if not store.owned(task.id) or store.owner_pid(task.id) != pid:
        os.close(pidfd)
        return None
    return WorkerProcess(task, pid, pidfd, None, journal_at=journal_end(task))


def stop_orphan(task: TaskDir, grace: float) -> bool | None:
    """Stop the worker that holds ``task``'s lock while no daemon runs (one that outlived
    a killed daemon), as a daemon's cancel would: TERM to its group, its running tool
    too, and the worker kills what is left below it as it ends; one still running after
    ``grace`` seconds is stopped and killed with every process below it
    (``descendants.kill_tree``). Returns once it has ended: None when no worker held the
    lock, else whether it had to be killed."""
    worker = adopt(task)
    if worker is None:
        return None
    try:
        worker.signal_group(signal.SIGTERM)
        if worker.ended_within(grace):
            return False
        kill_tree(worker.pid)
        worker.ended_within(KILL_PATIENCE)
        return True
    finally:
        worker.close()


def adopt_claimed(task: TaskDir, owner: Owner, beat: JSON) -> WorkerProcess | None:
    """Re-attach to the worker that runs ``task`` under ``owner``, a claim of this node
    that an earlier daemon made on a shared store (it was killed, its workers were not),
    or None when no such worker runs on this machine. No lock file proves it there: its
    latest heartbeat names it (``worker.identity``), and each part must hold: the beat is
    of ``owner``'s epoch (the lease is still the worker's), its process is of this boot
    of this machine and started at the clock tick the beat says (a pid reused since
    started at another), and its title names this task in this spool (a worker of
    another node on this machine has another spool). Checked again once the pidfd pins
    the process."""
    process = ProcessId.from_json(beat.get("process"))
    if beat.get("epoch") != owner.epoch or process is None or process.pid == os.getpid():
        return None
    if not (process.alive_here() and _titled(process.pid, task)):
        return None
    try:
        pidfd = os.pidfd_open(process.pid)
    except OSError:
        return None
    if not (process.alive_here() and _titled(process.pid, task)):
        os.close(pidfd)
        return None
    return WorkerProcess(task, process.pid, pidfd, None, journal_at=journal_end(task))


def _titled(pid: int, task: TaskDir) -> bool:
    """Whether process ``pid``'s title is the one a worker of ``task`` gives itself
    (``worker.proctitle``: the task and its spool)."""
    with contextlib.suppress(psutil.Error, OSError):
        title = " ".join(psutil.Process(pid).cmdline())
        return title.startswith(f"agentd: worker {task.id} in {task.root}")
    return False
