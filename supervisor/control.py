"""How operator commands and the daemon coordinate through the spool.

* ``SupervisorLock``: one supervisor per spool. Whoever holds it (the daemon, or a CLI
  command while no daemon runs) is the only writer of task records (``state.json``).
* ``ring``: CLI commands drop a file in ``SPOOL/inbox`` after a change; the daemon
  watches that folder and acts within milliseconds.
* Requests: small files in a task folder (``retry.request``, ``requeue.request``,
  ``release.request``) that
  the daemon applies and removes. ``change_record`` applies a change directly when no
  daemon runs, and leaves a request when one does. A cancel is not a request but a
  record that stays (``TaskDir.cancellation``, ``supervisor.decisions.record_cancel``).
  On a shared store (docs/design.md section 10) there is no one daemon to ask: a command
  moves the record itself by compare-and-set, and a task a node runs is cancelled by
  that node, woken by ``ring`` (NOTIFY) or its next poll. A node that has stopped
  renewing the task's lease (frozen, cut off) cannot: the command takes the lease from
  it (``SharedStore.seize``: the new epoch fences its worker) and says how long a call
  that worker was running may still complete (``Fenced``).
* ``paused``: stops a task's worker at a safe point and holds its lock for the length of
  an operation (rewind), so no worker writes the journal meanwhile. The daemon waits
  ``restart.stop_grace`` for the safe point (a model call is abandoned at once, a running
  tool call is waited for until its result is recorded), then kills the worker;
  ``Pause.cut_off`` tells the operation which it was. Callers check everything they can
  before they pause: a refused command never stops a worker.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from supervisor.decisions import OPERATOR_WAIT, drop_moot_cancel, operator_lock, record_cancel
from supervisor.operator import Operator, fields_of
from supervisor.record import Move, TaskRecord
from supervisor.status import load_state
from supervisor.stores import shared, store_of
from worker.errors import (
    AgentdError,
    LockBusyError,
    RecordConflictError,
    StateConflictError,
    StorageError,
    storage_fault,
)
from worker.events import Event, record_event, utc_now
from worker.lock import is_locked
from worker.protocol import FINAL_STATES, TaskStatus
from worker.spool import Spool, TaskDir
from worker.store.base import Owner, Seized, SharedStore
from worker.store.durable import (
    atomic_write,
    dump_json,
    open_private,
    read_json,
)

RETRY_REQUEST = "retry.request"
REQUEUE_REQUEST = "requeue.request"
#: Release a task held on its budget, once ``agentd budget`` raised it (``supervisor.budgets``).
RELEASE_REQUEST = "release.request"
PAUSE_REQUEST = "pause.request"
#: How many times a move reads the record again after losing a compare-and-set to a node.
MOVE_ATTEMPTS = 20
#: Seconds a pause on a shared store outlasts the wait for the safe point: the operation
#: done under it (a rewind) is quick, and a pause whose command died ends by itself.
PAUSE_SLACK = 60.0
#: Seconds between two looks of a command at a lease it waits for (``SharedStore.seize``).
SEIZE_POLL = 0.1


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


def ring(spool: Spool, task_id: str) -> None:
    """Tell a running daemon that ``task_id`` changed (harmless when none runs); on a
    shared store, every node (``SharedStore.wake``)."""
    if (cluster := shared()) is not None:
        with contextlib.suppress(StorageError):  # a wake-up is advisory: the poll is the truth
            cluster.wake(task_id)
        return
    spool.ring(task_id)


@contextlib.contextmanager
def offline(spool: Spool) -> Iterator[bool]:
    """Yield True while holding the supervisor lock (no daemon runs), else False. On a
    shared store always True: the database settles who wins (``move_record``'s
    compare-and-set), and no node's daemon takes a request file of another's."""
    if shared() is not None:
        yield True
        return
    lock = SupervisorLock(spool)
    try:
        lock.acquire()
    except LockBusyError:
        yield False
        return
    try:
        yield True
    finally:
        lock.release()


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


def move_record(task: TaskDir, move: Move) -> None:
    """Make ``move`` (``TaskRecord.retry``, say) on the task record and save it, if the
    record did not change meanwhile (else read it again and decide again: on a shared
    store a node may write it); the caller holds the supervisor lock, on the spool's
    files. A refused move raises and writes nothing."""
    store = store_of(task)
    for _ in range(MOVE_ATTEMPTS):
        version = store.record_version(task.id)
        record = TaskRecord.load(task)
        move(record, task.id)
        try:
            store.cas_record(task.id, version, record.stamped())
        except RecordConflictError:
            continue
        return
    raise StateConflictError(
        f"task {task.id}'s record kept changing while it was being moved; try again."
    )


def change_record(
    spool: Spool,
    task: TaskDir,
    request_name: str,
    move: Move,
    *,
    asked: dict[str, Any] | None = None,
) -> bool:
    """Make ``move`` on the task record now if no daemon runs (True), else leave
    ``request_name`` for the daemon, which makes the same move (False). ``asked``: what
    the request carries besides its time (who asked: ``by`` and ``via``)."""
    with offline(spool) as alone:
        if alone:
            move_record(task, move)
            return True
    request(task, request_name, dump_json({"at": utc_now(), **(asked or {})}).decode())
    ring(spool, task.id)
    return False


def cancel(
    spool: Spool, task: TaskDir, wait: float, *, operator: Operator | None = None
) -> bool | Fenced:
    """Cancel ``task`` for good: True once it is cancelled, False while a running daemon
    has not applied it within ``wait`` seconds (it will: the record is durable).
    ``operator``: who cancels, kept in the cancel record and its event.

    Under the task's operator lock, held until the outcome is known: of a cancel and a
    decision, the first wins (``record_cancel``), and no rewind or retry slips in
    between. A task that ended ``done`` or ``failed`` before the daemon could apply the
    cancel was not cancelled: the record is withdrawn and StateConflictError says so.

    On a shared store, a task whose node has stopped renewing its lease (for half of it,
    as this command watched: ``SharedStore.seize``) is cancelled here and now, its worker
    fenced: a ``Fenced`` says which node, and which of its calls may still complete
    within what is left of that node's lease."""
    cluster = shared()
    with operator_lock(task, wait=max(OPERATOR_WAIT, wait)):
        record_cancel(task, operator)
        with offline(spool) as alone:
            # (on a shared store, a task a node runs is that node's to cancel)
            if alone and not (cluster is not None and store_of(task).owned(task.id)):
                move_record(task, TaskRecord.cancel)
                record_event(
                    store_of(task),
                    task.id,
                    Event.TASK_CANCELLED,
                    task=task.id,
                    **fields_of(operator),
                )
                return True
        ring(spool, task.id)
        deadline = time.monotonic() + (max(wait, cluster.lease) if cluster else wait)
        watched = 0.0  # (the lease is looked at every SEIZE_POLL: each look is a write)
        while True:
            record = TaskRecord.load(task)
            if record.state == TaskStatus.CANCELLED:
                return True
            if record.state in FINAL_STATES:
                drop_moot_cancel(task, record)
                raise StateConflictError(
                    f"task {task.id} ended {record.state} ({record.reason}) before the cancel "
                    "took effect; nothing was cancelled."
                )
            if cluster is not None and time.monotonic() >= watched:
                watched = time.monotonic() + SEIZE_POLL
                if (seized := cluster.seize(task.id)) is not None:
                    done = _cancel_seized(task, seized, operator)
                    if done is not None:
                        return done
                    continue  # (it ended meanwhile: the next look says how)
            if time.monotonic() >= deadline or (cluster is None and running_pid(spool) is None):
                return False
            time.sleep(0.02)


def _cancel_seized(
    task: TaskDir, seized: Seized, operator: Operator | None
) -> bool | Fenced | None:
    """Cancel ``task`` under the lease a cancel seized, then let the lease go; None when
    the task ended meanwhile (it was not cancelled)."""
    store = store_of(task)
    try:
        if TaskRecord.load(task).state in FINAL_STATES:
            return None
        told = seized_from(task, seized)  # (the journal as the fenced worker left it)
        move_record(task, TaskRecord.cancel)
    finally:
        store.release(seized.owner)
    fields: dict[str, Any] = {"task": task.id, **fields_of(operator)}
    if told is not None:  # (taken from a node that stopped renewing: what may still run)
        fields |= {"fenced_node": told.node, "running_call": told.call}
    record_event(store, task.id, Event.TASK_CANCELLED, **fields)
    return told or True


def pause_holder_alive(task: TaskDir) -> bool:
    """True while a live process has asked for ``task`` to stay paused (on a shared
    store: while the pause some node's command asked for lasts)."""
    if (cluster := shared()) is not None:
        try:
            return cluster.pause_requested(task.id)
        except StorageError:
            return False
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


@dataclass(frozen=True)
class Fenced:
    """A task an operator's command took from a node that has stopped renewing its lease
    (``SharedStore.seize``): the node, how long its lease may still last (at the latest:
    its worker is killed by then, ``worker.killtimer``), and the call its worker was
    running, which may still complete until then (its outcome unknown)."""

    node: str
    ends_in: float
    call: str | None

    def told(self) -> str:
        return f"node {self.node} has not renewed its lease (ends in {self.ends_in:.1f} s)"

    def to_json(self) -> dict[str, Any]:
        return {"node": self.node, "ends_in": round(self.ends_in, 1), "running_call": self.call}


def seized_from(task: TaskDir, seized: Seized) -> Fenced | None:
    """What a command tells of the lease it seized (None: no node held it)."""
    if seized.holder is None:
        return None
    try:
        running = [c.call_id for c in load_state(task).dangling()]
    except (AgentdError, OSError, ValueError):
        running = []
    return Fenced(seized.holder, seized.ends_in, running[-1] if running else None)


@dataclass(frozen=True)
class Pause:
    """How a pause began: ``cut_off`` when the worker did not reach a safe point within
    ``restart.stop_grace`` and the daemon killed it (its running call has no result).
    ``owner``: the task's ownership, held for the block, for what the pauser records."""

    cut_off: bool
    owner: Owner
    fenced: Fenced | None = None  # taken from a node that stopped renewing its lease


@contextlib.contextmanager
def paused(spool: Spool, task: TaskDir, wait: float) -> Iterator[Pause]:
    """Own ``task`` (``TaskStore.acquire``: its worker lock) for the block; a running
    worker is first asked (through the daemon) to stop at a safe point. Raises
    StateConflictError if it does not."""
    store = store_of(task)
    cluster = shared()
    seen = store.events_end(task.id)
    if cluster is not None:  # seen by every node, and by every claim (``pglease.CLAIM``)
        cluster.request_pause(task.id, wait + PAUSE_SLACK)
        patience = wait
    else:
        request(task, PAUSE_REQUEST, f"{os.getpid()}\n")
        patience = wait if running_pid(spool) is not None else 0.2
    ring(spool, task.id)
    owner = None
    try:
        try:
            if cluster is not None:
                owner, fenced = _seize(cluster, task, patience)
            else:
                owner, fenced = store.acquire(task.id, wait=patience), None
        except LockBusyError as exc:
            where = f"worker pid {exc.holder_pid}" if exc.holder_pid else "on another node"
            advice = (
                "Try again."
                if cluster is not None or running_pid(spool)
                else "Start the daemon or stop the worker."
            )
            raise StateConflictError(
                f"task {task.id} is running ({where}) and did not stop at a safe point "
                f"within {wait:g} s; nothing was changed. {advice}"
            ) from None
        events, _ = store.read_events(task.id, seen)
        killed = any(e.get("event") == Event.WORKER_KILLED for e in events)
        yield Pause(killed or fenced is not None, owner, fenced)
    finally:
        if owner is not None:
            store.release(owner)
        if cluster is not None:
            cluster.end_pause(task.id)
        else:
            take_request(task, PAUSE_REQUEST)
        ring(spool, task.id)


def _seize(cluster: SharedStore, task: TaskDir, wait: float) -> tuple[Owner, Fenced | None]:
    """The task's lease for a pause on a shared store: once its node let it go at a safe
    point, or taken from a node that stopped renewing it (``SharedStore.seize``); else
    ``LockBusyError`` after ``wait`` seconds."""
    deadline = time.monotonic() + max(wait, cluster.lease)
    while (seized := cluster.seize(task.id)) is None:
        if time.monotonic() >= deadline:
            raise LockBusyError(f"task {task.id}'s lease is held by a node that renews it")
        time.sleep(SEIZE_POLL)
    return seized.owner, seized_from(task, seized)
