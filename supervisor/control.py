"""What operator commands change of a task and ask of the daemon, through the process's
coordination (``supervisor.coordination``: one spool's files and locks, or a shared
store's rows).

* Requests: small files in a task folder (``retry.request``, ``requeue.request``,
  ``release.request``) that the daemon applies and removes. ``change_record`` applies a
  change directly when no daemon runs (``Coordination.offline``), and leaves a request
  when one does. A cancel is not a request but a record that stays
  (``TaskDir.cancellation``, ``supervisor.decisions.record_cancel``). On a shared store
  (docs/design.md section 10) there is no one daemon to ask: a command moves the record
  itself by compare-and-set, and a task a node runs is cancelled by that node, woken by
  a ring or its next poll. A node that has stopped renewing the task's lease (frozen,
  cut off) cannot: the command takes the lease from it (``Coordination.seize``: the new
  epoch fences its worker) and says how long a call that worker was running may still
  complete (``Fenced``).
* ``paused``: stops a task's worker at a safe point and holds its lock for the length of
  an operation (rewind), so no worker writes the journal meanwhile. The daemon waits
  ``restart.stop_grace`` for the safe point (a model call is abandoned at once, a running
  tool call is waited for until its result is recorded), then kills the worker;
  ``Pause.cut_off`` tells the operation which it was. Callers check everything they can
  before they pause: a refused command never stops a worker.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from supervisor.coordination import (
    OPERATOR_WAIT,
    SEIZE_POLL,
    coordination,
    offline,
    request,
    ring,
)
from supervisor.decisions import drop_moot_cancel, record_cancel
from supervisor.operator import Operator, fields_of
from supervisor.record import Move, TaskRecord
from supervisor.status import load_state
from supervisor.stores import store_of
from worker.errors import (
    AgentdError,
    LockBusyError,
    RecordConflictError,
    StateConflictError,
)
from worker.events import Event, record_event, utc_now
from worker.protocol import FINAL_STATES, TaskStatus
from worker.spool import Spool, TaskDir
from worker.store.base import Owner, Seized
from worker.store.durable import (
    dump_json,
)

RETRY_REQUEST = "retry.request"
REQUEUE_REQUEST = "requeue.request"
#: Release a task held on its budget, once ``agentd budget`` raised it (``supervisor.budgets``).
RELEASE_REQUEST = "release.request"
#: How many times a move reads the record again after losing a compare-and-set to a node.
MOVE_ATTEMPTS = 20


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
    asked: Mapping[str, Any] | None = None,
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
    spool: Spool,
    task: TaskDir,
    wait: float,
    *,
    operator: Operator | None = None,
    grace: float | None = None,
) -> bool | Fenced:
    """Cancel ``task`` for good: True once it is cancelled, False while a running daemon
    has not applied it within ``wait`` seconds (it will: the record is durable).
    ``operator``: who cancels, kept in the cancel record and its event.

    With no daemon running, a worker that outlived a killed daemon is stopped here, as
    the daemon would stop it (``workers.stop_orphan``: TERM, ``grace`` seconds, by
    default ``wait``, then KILL of it and all below it): when the cancel returns, nothing
    of the task acts on, whatever the next daemon's start. A foreground task's worker is
    left to its `agentd run`, which applies the cancel itself.

    Under the task's operator lock, held until the outcome is known: of a cancel and a
    decision, the first wins (``record_cancel``), and no rewind or retry slips in
    between. A task that ended ``done`` or ``failed`` before the daemon could apply the
    cancel was not cancelled: the record is withdrawn and StateConflictError says so.

    On a shared store, a task whose node has stopped renewing its lease (for half of it,
    as this command watched: ``SharedStore.seize``) is cancelled here and now, its worker
    fenced: a ``Fenced`` says which node, and which of its calls may still complete
    within what is left of that node's lease."""
    co = coordination(spool)
    with co.operator_lock(task, wait=max(OPERATOR_WAIT, wait)):
        record_cancel(task, operator)
        with co.offline() as alone:
            # (on a shared store, a task a node runs is that node's to cancel)
            if alone and not co.runs_elsewhere(task):
                if not TaskRecord.load(task).foreground:
                    from supervisor.workers import stop_orphan  # noqa: PLC0415  (processes: a cancel with no daemon only)

                    killed = stop_orphan(task, wait if grace is None else grace)
                    if killed:
                        record_event(
                            store_of(task), task.id, Event.WORKER_KILLED, "warning", task=task.id
                        )
                move_record(task, TaskRecord.cancel)
                record_event(
                    store_of(task),
                    task.id,
                    Event.TASK_CANCELLED,
                    task=task.id,
                    **fields_of(operator),
                )
                return True
        co.ring(task.id)
        deadline = time.monotonic() + co.settle_time(wait)
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
            if time.monotonic() >= watched:
                watched = time.monotonic() + SEIZE_POLL
                if (seized := co.seize(task.id)) is not None:
                    done = _cancel_seized(task, seized, operator)
                    if done is not None:
                        return done
                    continue  # (it ended meanwhile: the next look says how)
            if time.monotonic() >= deadline or co.nobody_applies():
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
    co = coordination(spool)
    seen = store.events_end(task.id)
    patience = co.ask_pause(task, wait)
    co.ring(task.id)
    owner = None
    try:
        try:
            owner, seized = co.own_paused(store, task, patience)
        except LockBusyError as exc:
            where = f"worker pid {exc.holder_pid}" if exc.holder_pid else "on another node"
            raise StateConflictError(
                f"task {task.id} is running ({where}) and did not stop at a safe point "
                f"within {wait:g} s; nothing was changed. {co.busy_advice()}"
            ) from None
        fenced = seized_from(task, seized) if seized is not None else None
        events, _ = store.read_events(task.id, seen)
        killed = any(e.get("event") == Event.WORKER_KILLED for e in events)
        yield Pause(killed or fenced is not None, owner, fenced)
    finally:
        if owner is not None:
            store.release(owner)
        co.end_pause(task)
        co.ring(task.id)
