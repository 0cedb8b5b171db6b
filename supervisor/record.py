"""The supervisor's own record of a task (``state.json``): its state, restarts, last exit
and reason.

Only the holder of the supervisor lock writes it: the running daemon, or a CLI command
while no daemon runs (``supervisor.control.change_record``). The moves an operator makes
(cancel, retry, requeue, release a hold) are methods of the record, so the daemon and the
CLI, which both make them, make them the same way and refuse them the same way: a refused
move raises ``StateConflictError`` (exit 3) with the one line the CLI prints, and leaves
the record as it was.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from supervisor.stores import store_of
from worker.errors import StateConflictError
from worker.events import Event, utc_now
from worker.protocol import FINAL_STATES, HeartbeatData, TaskStatus
from worker.spool import TaskDir
from worker.store.base import NOT_A_RECORD, PROGRESS, Unreadable, recorded_progress

CANCEL_REASON = "cancelled by operator"
_STATES = frozenset(TaskStatus)

#: The lifecycle event a task's arrival in a state is (docs/design.md section 8), with its
#: level: whoever moves a record there logs it, from ``arrival``, never beside the move.
ARRIVALS: dict[TaskStatus, tuple[Event, str]] = {
    TaskStatus.DONE: (Event.TASK_DONE, "info"),
    TaskStatus.FAILED: (Event.TASK_FAILED, "error"),
    TaskStatus.CANCELLED: (Event.TASK_CANCELLED, "info"),
}


def legal(old: TaskStatus, new: TaskStatus) -> bool:
    """Whether a task may move from ``old`` to ``new``: freely between the states of a
    live task; out of ``done`` or ``failed`` only back into the queue (a retry, a rewind);
    out of ``cancelled`` never (a cancel is final)."""
    if old == new or old not in FINAL_STATES:
        return True
    return old != TaskStatus.CANCELLED and new == TaskStatus.QUEUED


def arrival(old: TaskStatus, new: TaskStatus) -> tuple[Event, str] | None:
    """The event (name, level) of a move from ``old`` to ``new``; None: no event of its own
    (the state stays, or the arrival is told by what led to it: ``worker_spawned``,
    ``dangling_held``, ``restart_scheduled``...)."""
    return ARRIVALS.get(new) if new != old else None


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _optional(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda value: value is None or check(value)


#: What each field of a stored record must hold: a record of another shape is not ours.
FIELD_SHAPES: dict[str, Callable[[Any], bool]] = {
    "reason": _optional(lambda v: isinstance(v, str)),
    "restarts": _whole,
    "last_exit": _optional(lambda v: isinstance(v, dict)),
    "pid": _optional(_whole),
    "pid_started": _optional(lambda v: _whole(v) or isinstance(v, float)),
    "retries": _whole,
    "crashes": lambda v: isinstance(v, list) and all(isinstance(c, dict) for c in v),
    PROGRESS: _optional(_whole),
    "foreground": lambda v: isinstance(v, bool),
    "updated_at": lambda v: isinstance(v, str),
}


@dataclass
class TaskRecord:
    state: TaskStatus = TaskStatus.QUEUED
    reason: str | None = None
    restarts: int = 0
    last_exit: dict[str, Any] | None = None
    pid: int | None = None
    pid_started: float | None = None  # the worker's process start time, for adoption
    crashes: list[dict[str, Any]] = field(default_factory=list)  # recent: {turn, at}
    retries: int = 0  # an operator's retries: what reopens a journal that ended failed
    updated_at: str = ""
    # ``PROGRESS``: the journal position its workers' heartbeats last said was durable
    # (None: unknown, a record of an earlier release, or no worker ran yet)
    journal: int | None = None
    # ``agentd run`` runs the task's worker, not a daemon (docs/design.md section 16): a
    # daemon leaves the task alone until ``retry`` hands it over (``hand_over``)
    foreground: bool = False

    def move_to(self, state: TaskStatus, task_id: str) -> None:
        """The one way a record's state changes: ``StateConflictError`` (nothing changed)
        for a move ``legal`` refuses. The daemon's verdicts, ``agentd run``'s and the
        operators' moves below all come here."""
        if not legal(self.state, state):
            raise StateConflictError(f"task {task_id} is {self.state}; it cannot become {state}.")
        self.state = state

    def progressed(self, beat: HeartbeatData | None) -> None:
        """Keep the progress a worker's heartbeat reports, if it is further on."""
        self.journal = recorded_progress(beat, asdict(self))

    @classmethod
    def load(cls, task: TaskDir) -> TaskRecord:
        """The task's record through its store (``TaskStore.get_record``); one that cannot
        be read, or is not a record, loads as a failed task that names it."""
        store = store_of(task)
        try:
            data, _ = store.get_record(task.id)
        except Unreadable as exc:
            return cls(state=TaskStatus.FAILED, reason=f"{exc.where} is {exc.reason}")
        if data is None:
            return cls()
        state = data.get("state")
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        # (a field of the wrong type would fail in the daemon's arithmetic)
        shaped = all(FIELD_SHAPES[k](v) for k, v in known.items() if k != "state")
        if isinstance(state, str) and state in _STATES and shaped:
            return cls(**{**known, "state": TaskStatus(state)})
        reason = f"{store.record_name(task.id)} is {NOT_A_RECORD}"
        return cls(state=TaskStatus.FAILED, reason=reason)

    def save(self, task: TaskDir, *, durable: bool = True) -> None:
        """Replace the record (``TaskStore.cas_record``); ``durable=False`` skips the
        fsyncs, for a state that recovery never trusts anyway (``running``: the task lock
        decides). Only the holder of the supervisor lock writes a record, so the last
        write wins, as it always did: the version compared is the one just read."""
        store = store_of(task)
        store.cas_record(task.id, store.record_version(task.id), self.stamped(), durable=durable)

    def stamped(self) -> dict[str, Any]:
        """The record as it is stored, stamped with the time now (``updated_at``)."""
        self.updated_at = utc_now()
        return asdict(self)

    # -- an operator's moves (task_id only names the task in a refusal) -----------------

    def check_cancel(self, task_id: str) -> None:
        """Refuse a cancel of a task that has ended: there is nothing left to cancel."""
        if self.state in FINAL_STATES:
            raise StateConflictError(f"task {task_id} is already {self.state}; nothing to cancel.")

    def cancel(self, task_id: str) -> None:
        """Cancel for good: no decision, rewind or retry is taken after it."""
        self.check_cancel(task_id)
        self.move_to(TaskStatus.CANCELLED, task_id)
        self.reason = CANCEL_REASON

    def check_retry(self, task_id: str) -> None:
        """Refuse a retry of a task that has not failed (a foreground task that has not
        ended is retried too: the retry hands it to the daemon)."""
        if self.state == TaskStatus.FAILED:
            return
        if self.foreground and self.state in (TaskStatus.QUEUED, TaskStatus.HELD):
            return
        raise StateConflictError(
            f"task {task_id} is {self.state}; only a failed task can be retried."
        )

    def retry(self, task_id: str) -> None:
        """Queue a failed task again, with a clean crash history (a crash loop that made it
        fail would otherwise fail it again at its first crash). A foreground task is
        handed to the daemon: it loses its mark, and one that had not failed keeps its
        state (a held one waits for its decisions as any other)."""
        self.check_retry(task_id)
        handing_over, self.foreground = self.foreground, False
        if handing_over and self.state != TaskStatus.FAILED:
            return
        self.retries += 1
        self._queue(task_id)

    def check_resume(self, task_id: str) -> None:
        """Refuse ``agentd run --resume`` of a cancelled task: a cancel is final."""
        if self.state == TaskStatus.CANCELLED:
            raise StateConflictError(
                f"task {task_id} was cancelled; a cancelled task takes no resume. "
                f"`agentd fork {task_id} --at TURN` starts a new task from it."
            )

    def take_foreground(self, task_id: str) -> None:
        """``agentd run --resume``: the task is run in the foreground from here on. A
        failed one is retried (a fresh crash budget, its journal reopened)."""
        self.check_resume(task_id)
        if self.state == TaskStatus.FAILED:
            self.retry(task_id)
        self.foreground = True

    def requeue(self, task_id: str) -> None:
        """Queue the task on a scene an operator changed (a rewind), from whatever state it
        was in, with a clean crash history; never a cancelled one (a cancel is final)."""
        if self.state == TaskStatus.CANCELLED:
            raise StateConflictError(
                f"task {task_id} was cancelled; a cancelled task takes no requeue."
            )
        self._queue(task_id)

    def release_hold(self, task_id: str) -> None:
        """Queue a held task whose held calls are all decided: its worker carries the
        decisions out. Its crash history stays: the hold was no recovery from a crash."""
        if self.state != TaskStatus.HELD:
            raise StateConflictError(
                f"task {task_id} is {self.state}, not held; no hold to release."
            )
        self.move_to(TaskStatus.QUEUED, task_id)
        self.reason = None

    def moves(self) -> dict[str, bool]:
        """Which of an operator's moves this record allows, as the checks above answer
        (the console offers these alone): ``cancel``, ``retry``, ``rewind`` (never after a
        cancel, which is final), ``fork`` (always: a fork is a new task), ``continue`` (a
        done task) and ``say`` (a task that has not ended)."""

        def allowed(check: Callable[[str], None]) -> bool:
            try:
                check("")
            except StateConflictError:
                return False
            return True

        return {
            "cancel": allowed(self.check_cancel),
            "retry": allowed(self.check_retry),
            "rewind": self.state != TaskStatus.CANCELLED,
            "fork": True,
            # docs/design.md section 19: a done task continues, a live one is told
            "continue": self.state == TaskStatus.DONE,
            "say": self.state not in FINAL_STATES,
        }

    def _queue(self, task_id: str) -> None:
        self.move_to(TaskStatus.QUEUED, task_id)
        self.reason, self.crashes = None, []


#: One of the moves above, as ``TaskRecord.retry``: applied to a record with its task's id.
Move = Callable[[TaskRecord, str], None]
