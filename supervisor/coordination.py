"""How operator commands and daemons agree about a task: the ``Coordination`` of one
spool (``SpoolCoordination``) or of a shared store (``ClusterCoordination``, docs/design.md
section 10), chosen once per process by ``coordination``, so that no command asks which
it is.

* **The operator lock.** The commands that settle what becomes of a task (a decision, a
  cancel, a rewind, a retry) check and write under it, one at a time: each sees what the
  one before it did. On a spool it is an flock on the task's ``operator.lock`` (a killed
  command drops it); on a shared store a lock in the database, every node's commands one.
* **A ring.** A command tells whoever runs the task that it changed: a file in the
  spool's inbox, which the daemon watches; on a shared store a NOTIFY to every node (a
  wake-up is advisory: each node polls too).
* **Offline.** Whether a command may write task records itself: on a spool while it
  holds the supervisor lock (no daemon runs), else it leaves a request for the daemon; on
  a shared store always, the database's compare-and-set settling who wins.
* **A pause.** A task's worker is asked to stop at a safe point, and the command owns the
  task for the block: on a spool through ``pause.request`` (the pid of the command that
  asked) and the task's worker lock; on a shared store a pause row seen by every node
  and every claim, and the task's lease, taken once its node let it go or seized from a
  node that stopped renewing it (``SharedStore.seize``: its worker is fenced).

The spool's primitives live here too: the supervisor lock and the daemon it names
(``SupervisorLock``, ``running_pid``, ``supervisor_info``), and the small request files
a command leaves in a task's folder (``request``, ``take_request``).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

from worker.errors import LockBusyError, StateConflictError, StorageError, storage_fault
from worker.events import utc_now
from worker.lock import TaskLock, is_locked
from worker.spool import Spool, TaskDir
from worker.store.base import Owner, Seized, SharedStore, TaskStore
from worker.store.durable import atomic_write, open_private, read_json

OPERATOR_LOCK = "operator.lock"  # in the task folder: see ``Coordination.operator_lock``
OPERATOR_WAIT = 30.0  # seconds a command waits for another one on the same task
PAUSE_REQUEST = "pause.request"
#: Seconds a pause on a shared store outlasts the wait for the safe point: the operation
#: done under it (a rewind) is quick, and a pause whose command died ends by itself.
PAUSE_SLACK = 60.0
#: Seconds between two looks of a command at a lease it waits for (``SharedStore.seize``).
SEIZE_POLL = 0.1
#: How long a pause on a spool with no daemon waits for the task's worker lock: a worker
#: no daemon runs (an `agentd run`) is not asked to stop.
NO_DAEMON_PATIENCE = 0.2


class Coordination(Protocol):
    """What commands and daemons agree through (module docstring)."""

    def operator_lock(
        self, task: TaskDir, wait: float = OPERATOR_WAIT
    ) -> contextlib.AbstractContextManager[None]:
        """Hold ``task``'s operator lock for the block; StateConflictError when another
        command holds it past ``wait`` seconds."""
        ...

    def ring(self, task_id: str) -> None:
        """Tell whoever runs ``task_id`` that it changed (harmless when nobody does)."""
        ...

    def offline(self) -> contextlib.AbstractContextManager[bool]:
        """True for the block while this command may write task records itself."""
        ...

    def runs_elsewhere(self, task: TaskDir) -> bool:
        """Whether a node runs ``task`` (its lease held): only that node may cancel it."""
        ...

    def settle_time(self, wait: float) -> float:
        """How long a command that asked for a change waits for it to be applied."""
        ...

    def nobody_applies(self) -> bool:
        """Whether no daemon is there to apply what a command asked (it will not be)."""
        ...

    def seize(self, task_id: str) -> Seized | None:
        """The task's lease taken from a node that stopped renewing it, or None."""
        ...

    def ask_pause(self, task: TaskDir, wait: float) -> float:
        """Ask ``task``'s worker to stop at a safe point; the seconds to wait for it."""
        ...

    def own_paused(
        self, store: TaskStore, task: TaskDir, patience: float
    ) -> tuple[Owner, Seized | None]:
        """Own the paused task (and the lease seized with it, if one was): LockBusyError
        when its worker did not let go within ``patience`` seconds."""
        ...

    def end_pause(self, task: TaskDir) -> None: ...

    def pause_requested(self, task: TaskDir) -> bool:
        """True while a live command has asked for ``task`` to stay paused."""
        ...

    def busy_advice(self) -> str:
        """What to do when a paused task's worker did not stop in time."""
        ...


def coordination(spool: Spool) -> Coordination:
    """The coordination of ``spool``: its shared store's when it is on one
    (``Spool.on``), else its own. The one place that asks which."""
    cluster = spool.shared
    return SpoolCoordination(spool) if cluster is None else ClusterCoordination(cluster)


def ring(spool: Spool, task_id: str) -> None:
    """``Coordination.ring`` of the process's coordination."""
    coordination(spool).ring(task_id)


def offline(spool: Spool) -> contextlib.AbstractContextManager[bool]:
    """``Coordination.offline`` of the process's coordination."""
    return coordination(spool).offline()


def operator_lock(
    task: TaskDir, wait: float = OPERATOR_WAIT
) -> contextlib.AbstractContextManager[None]:
    """``Coordination.operator_lock`` of the process's coordination."""
    return coordination(task.spool).operator_lock(task, wait)


# -- one spool ---------------------------------------------------------------------------


class SpoolCoordination:
    """One spool's coordination: flocks and files, and the daemon its lock names."""

    def __init__(self, spool: Spool) -> None:
        self.spool = spool

    @contextlib.contextmanager
    def operator_lock(self, task: TaskDir, wait: float = OPERATOR_WAIT) -> Iterator[None]:
        lock = TaskLock(task.path / OPERATOR_LOCK)
        try:
            lock.acquire(wait=wait)
        except LockBusyError as exc:
            raise StateConflictError(
                f"another command on task {task.id} (pid {exc.holder_pid}) did not end within "
                f"{wait:g} s; try again once it has."
            ) from None
        try:
            yield
        finally:
            lock.release()

    def ring(self, task_id: str) -> None:
        self.spool.ring(task_id)

    @contextlib.contextmanager
    def offline(self) -> Iterator[bool]:
        lock = SupervisorLock(self.spool)
        try:
            lock.acquire()
        except LockBusyError:
            yield False
            return
        try:
            yield True
        finally:
            lock.release()

    def runs_elsewhere(self, task: TaskDir) -> bool:
        return False

    def settle_time(self, wait: float) -> float:
        return wait

    def nobody_applies(self) -> bool:
        return running_pid(self.spool) is None

    def seize(self, task_id: str) -> Seized | None:
        return None  # (a worker on a spool holds no lease)

    def ask_pause(self, task: TaskDir, wait: float) -> float:
        request(task, PAUSE_REQUEST, f"{os.getpid()}\n")
        return wait if running_pid(self.spool) is not None else NO_DAEMON_PATIENCE

    def own_paused(
        self, store: TaskStore, task: TaskDir, patience: float
    ) -> tuple[Owner, Seized | None]:
        return store.acquire(task.id, wait=patience), None

    def end_pause(self, task: TaskDir) -> None:
        take_request(task, PAUSE_REQUEST)

    def pause_requested(self, task: TaskDir) -> bool:
        try:
            pid = int((task.path / PAUSE_REQUEST).read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return False
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def busy_advice(self) -> str:
        if running_pid(self.spool) is not None:
            return "Try again."
        return "Start the daemon or stop the worker."


# -- a shared store --------------------------------------------------------------------


class ClusterCoordination:
    """A shared store's coordination: the database's rows, seen by every node."""

    def __init__(self, cluster: SharedStore) -> None:
        self.cluster = cluster

    @contextlib.contextmanager
    def operator_lock(self, task: TaskDir, wait: float = OPERATOR_WAIT) -> Iterator[None]:
        with contextlib.ExitStack() as held:
            try:
                held.enter_context(self.cluster.operator_lock(task.id, wait))
            except LockBusyError:
                raise StateConflictError(
                    f"another command on task {task.id} did not end within {wait:g} s; try "
                    "again once it has."
                ) from None
            yield

    def ring(self, task_id: str) -> None:
        with contextlib.suppress(StorageError):  # a wake-up is advisory: the poll is the truth
            self.cluster.wake(task_id)

    @contextlib.contextmanager
    def offline(self) -> Iterator[bool]:
        # the database settles who wins (``move_record``'s compare-and-set), and no node's
        # daemon takes a request file of another's
        yield True

    def runs_elsewhere(self, task: TaskDir) -> bool:
        return self.cluster.owned(task.id)

    def settle_time(self, wait: float) -> float:
        return max(wait, self.cluster.lease)  # a frozen node's lease may be seized by then

    def nobody_applies(self) -> bool:
        return False  # some node claims it, or this command seizes it

    def seize(self, task_id: str) -> Seized | None:
        return self.cluster.seize(task_id)

    def ask_pause(self, task: TaskDir, wait: float) -> float:
        # seen by every node, and by every claim (``pglease.CLAIM``)
        self.cluster.request_pause(task.id, wait + PAUSE_SLACK)
        return wait

    def own_paused(
        self, store: TaskStore, task: TaskDir, patience: float
    ) -> tuple[Owner, Seized | None]:
        """The task's lease once its node let it go at a safe point, or seized from a node
        that stopped renewing it; else LockBusyError after ``patience`` seconds (a lease
        at least)."""
        deadline = time.monotonic() + max(patience, self.cluster.lease)
        while (seized := self.cluster.seize(task.id)) is None:
            if time.monotonic() >= deadline:
                raise LockBusyError(f"task {task.id}'s lease is held by a node that renews it")
            time.sleep(SEIZE_POLL)
        return seized.owner, seized

    def end_pause(self, task: TaskDir) -> None:
        self.cluster.end_pause(task.id)

    def pause_requested(self, task: TaskDir) -> bool:
        try:
            return self.cluster.pause_requested(task.id)
        except StorageError:
            return False

    def busy_advice(self) -> str:
        return "Try again."


# -- the spool's primitives --------------------------------------------------------------


class SupervisorLock:
    """An flock on ``SPOOL/supervisor.lock``, held for the holder's life."""

    def __init__(self, spool: Spool) -> None:
        self.spool = spool
        self.fd = -1

    @property
    def path(self) -> Path:
        return self.spool.root / "supervisor.lock"

    def acquire(self) -> None:
        self.spool.ensure()
        fd = open_private(self.path, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise already_running(self.spool, running_pid(self.spool)) from None
        self.fd = fd

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def already_running(spool: Spool, pid: int | None) -> LockBusyError:
    """The one refusal of a second supervisor on a spool, from ``start`` and ``--detach``."""
    return LockBusyError(
        f"agentd is already running on {spool.root} (pid {pid}); "
        "use `agentd stop` first or pick another --spool.",
        pid,
    )


def supervisor_info(spool: Spool) -> dict[str, Any] | None:
    with contextlib.suppress(OSError, ValueError):
        data = read_json(spool.root / "supervisor.json")
        if isinstance(data, dict):
            return data
    return None


def running_pid(spool: Spool) -> int | None:
    """The pid of the supervisor running on ``spool``, or None."""
    if not is_locked(spool.root / "supervisor.lock"):
        return None
    info = supervisor_info(spool) or {}
    pid = info.get("pid")
    return pid if isinstance(pid, int) else None


def request(task: TaskDir, name: str, body: str | None = None) -> None:
    atomic_write(task.path / name, (body or utc_now()).encode())


def take_request(task: TaskDir, name: str) -> bool:
    """Consume the request file ``name`` of ``task``: True if there was one. A request
    that a storage fault keeps from being removed (a read-only spool refuses even the
    unlink of a file that is not there) waits for the disk, like any other write."""
    return taken_request(task, name) is not None


def taken_request(task: TaskDir, name: str) -> dict[str, Any] | None:
    """``take_request``, returning what the request said (``change_record``'s ``asked``:
    who asked, docs/design.md section 15; ``{}`` for a request of an earlier release,
    whose body is a time stamp), or None when there was none to take."""
    path = task.path / name
    try:
        body = read_json(path)
    except FileNotFoundError:  # none: the usual case, seen without a second syscall
        return None
    except (OSError, ValueError):  # one it cannot read is taken all the same
        body = {}
    try:
        path.unlink()
    except FileNotFoundError:
        return None
    except OSError as exc:
        if storage_fault(exc) is None:
            raise
        return None
    return body if isinstance(body, dict) else {}
