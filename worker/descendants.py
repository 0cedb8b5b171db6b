"""The processes below this one: a subreaper keeps them, and they die before it does.

A tool's command may leave processes behind that left its process group: ``setsid``, a
double fork, ``nohup ... &``, a daemon that ignores SIGTERM. Killing the worker's group
does not reach them, and when their parent exits the kernel hands them to the nearest
*child subreaper* above them (``PR_SET_CHILD_SUBREAPER``), or to PID 1.

So a worker makes itself a subreaper (``contained``): whatever its tools leave stays its
descendant while it lives, and when it leaves the block (done, failed, held, stopped at a
safe point, a storage fault, a crash that raised) it kills every descendant it still has
(``kill_all``) before it releases its task's lock. A background process may live from
one call to the next (a server a later call talks to), never past its worker. A worker
killed outright cannot do this; its descendants then pass to the daemon, itself a
subreaper for that reason, which kills every child it did not start on purpose
(``supervisor.workers.sweep_strays``, built on ``children`` here).

Children are read from ``/proc/PID/task/TID/children`` (one small file per thread, not a
scan of every process on the machine), with psutil where the kernel lacks that file. The
kernel lists a child until its parent reaps it, so the list of this process's own
children, which only this process reaps, is exact; a deeper list may miss a process
whose sibling is reaped meanwhile, which the next round of ``kill_all`` finds again.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import time
from collections.abc import Callable, Iterator

PR_SET_CHILD_SUBREAPER = 36
#: How long ``kill_all`` keeps killing: a process in uninterruptible sleep may take a
#: while to die; what is left after this passes to the daemon with the worker's exit.
KILL_PATIENCE = 2.0
_ROUND = 0.005  # seconds between rounds while killed processes are still dying


def become_subreaper() -> bool:
    """Make this process the reaper of its orphaned descendants; False if refused."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


PR_SET_PDEATHSIG = 1


def dies_with(parent: int) -> Callable[[], None]:
    """A ``preexec_fn`` that has the child killed (SIGKILL) the moment ``parent`` ends
    (``PR_SET_PDEATHSIG``), or exits at once when ``parent`` ended before it could ask:
    how ``agentd run``'s worker dies with it, even of a kill -9. (The signal fires when the
    parent's thread that started the child ends: ``agentd run`` starts it from its main
    thread.)"""

    def arm() -> None:
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:
            os._exit(1)

    return arm


def children(pid: int) -> list[int]:
    """The direct children of process ``pid`` (zombies included: a child is listed until
    its parent reaps it); none once ``pid`` is gone."""
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    found: list[int] = []
    for tid in threads:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                found += [int(child) for child in f.read().split()]
        except FileNotFoundError:
            if not os.path.exists(f"/proc/{pid}/task/{tid}"):
                continue  # the thread ended
            return _children_by_scan(pid)  # a kernel without CONFIG_PROC_CHILDREN
        except (OSError, ValueError):
            continue
    return found


def _children_by_scan(pid: int) -> list[int]:
    import psutil  # noqa: PLC0415  (a kernel without the children files only)

    with contextlib.suppress(psutil.Error, OSError):
        return [child.pid for child in psutil.Process(pid).children()]
    return []


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``, parents before their children."""
    found: list[int] = []
    parents = [pid]
    while parents:
        below = [child for parent in parents for child in children(parent)]
        found += below
        parents = below
    return found


def reap(pid: int) -> int | None:
    """Reap child ``pid`` if it has ended: its wait status, or None (still running, or
    not a child of this process)."""
    with contextlib.suppress(ChildProcessError):
        reaped, status = os.waitpid(pid, os.WNOHANG)
        return status if reaped else None
    return None


def kill_all(patience: float = KILL_PATIENCE) -> list[int]:
    """SIGKILL every descendant of this process and reap its children, round after round
    until none is left (a killed process's children come to this subreaper, and one
    that forks while it is killed adds more) or ``patience`` runs out. Returns the pids
    killed (a child that had ended already is only reaped)."""
    me = os.getpid()
    killed: dict[int, None] = {}  # in the order killed, each once
    deadline = time.monotonic() + patience
    while True:
        for pid in children(me):
            reap(pid)
        found = descendants(me)
        if not found or time.monotonic() >= deadline:
            return list(killed)
        for pid in found:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
            killed[pid] = None
        time.sleep(_ROUND)


def _zombie(pid: int) -> bool:
    """Whether process ``pid`` has ended (a zombie, or gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return True
    return stat[stat.rfind(b")") + 2 :].startswith(b"Z")


def kill_tree(pid: int, patience: float = KILL_PATIENCE) -> list[int]:
    """SIGKILL process ``pid`` (not a child of this one: a worker that outlived its daemon)
    and every process below it, none of which can pass out of reach: ``pid`` is stopped
    first (SIGSTOP), so it starts nothing more, and a subreaper (a worker) keeps what its
    killed children leave below it; its descendants are killed round after round until
    none is left or ``patience`` runs out, then its group and ``pid`` itself. Returns the
    descendants' pids killed."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGSTOP)
    killed: dict[int, None] = {}
    deadline = time.monotonic() + patience
    while time.monotonic() < deadline:
        found = [p for p in descendants(pid) if not _zombie(p)]
        if not found:
            break
        for child in found:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(child, signal.SIGKILL)
            killed[child] = None
        time.sleep(_ROUND)
    for kill in (os.killpg, os.kill):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            kill(pid, signal.SIGKILL)
    return list(killed)


@contextlib.contextmanager
def contained(on_killed: Callable[[list[int]], None] | None = None) -> Iterator[None]:
    """Inside the block this process is a child subreaper; leaving it, however, kills
    every process still below it, and tells ``on_killed`` their pids (the worker records
    ``processes_killed`` in its task's events)."""
    become_subreaper()
    try:
        yield
    finally:
        killed = kill_all()
        if killed and on_killed is not None:
            on_killed(killed)
