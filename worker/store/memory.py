"""An in-memory ``TaskStore``: for tests, and for users who test their own tools.

It keeps every promise of the Protocol (the conformance suite runs on it unchanged):
records are stored as their JSON, so what could not be written to a real store cannot be
written here either; decisions and cancels have one winner; the task record has a
version; ownership is a lease with an epoch, so a stale owner is fenced exactly as a
database would fence it. Nothing survives the process, which is the point.

    store = MemoryStore()
    store.create(spec, {"state": "queued"})
    owner = store.acquire(spec.id)
    writer, records = store.open_journal(owner, header={"task": spec.id})
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from worker.errors import (
    FencedError,
    LockBusyError,
    NotFoundError,
    RecordConflictError,
    StateConflictError,
)
from worker.records import RecordKind
from worker.redactor import redact
from worker.spool import TaskSpec, validate_call_id, validate_task_id
from worker.state import TaskState, scene_json
from worker.store.base import (
    JSON,
    START,
    Cursor,
    HeldInMemory,
    Owner,
    Snapshot,
    Version,
    check_journal,
    read_records,
    record_bytes,
)
from worker.store.durable import dump_json, load_json
from worker.store.journal import JOURNAL_VERSION


@dataclass
class _Task:
    spec: TaskSpec
    script: bytes | None
    record: bytes
    version: int = 1
    journal: list[bytes] = field(default_factory=list)
    seq: int = 0  # the records appended, counted apart from them: what the journal must hold
    volume: list[int] = field(default_factory=lambda: [0])  # bytes before record i
    snapshot: bytes | None = None
    decisions: dict[tuple[str, int], bytes] = field(default_factory=dict)
    cancel: bytes | None = None
    events: list[JSON] = field(default_factory=list)
    heartbeat: bytes | None = None
    exit: bytes | None = None
    owner: Owner | None = None
    expires: float = float("inf")
    epoch: int = 0


class MemoryJournal(HeldInMemory):
    """A ``JournalWriter`` on a ``MemoryStore``: its cursors count records."""

    def __init__(self, store: MemoryStore, owner: Owner) -> None:
        self._store = store
        self._owner = owner
        self._held: list[bytes] = []

    @property
    def owner(self) -> Owner:
        return self._owner

    @property
    def cursor(self) -> Cursor:
        with self._store.guard:
            return Cursor(len(self._store.get(self._owner.task_id).journal))

    def volume_since(self, cursor: Cursor) -> int:
        with self._store.guard:
            volume = self._store.get(self._owner.task_id).volume
            return volume[-1] - volume[min(cursor.position, len(volume) - 1)]

    def append(self, records: Iterable[JSON], *, sync: bool = True) -> None:
        data = self._held + [record_bytes(r) for r in records]
        with self._store.guard:
            task = self._store.fenced(self._owner)
            for item in data:
                task.journal.append(item)
                task.volume.append(task.volume[-1] + len(item))
            task.seq += len(data)
        self._held = []

    def hold(self, records: Iterable[JSON]) -> None:
        with self._store.guard:
            self._store.fenced(self._owner)
        self._held += [record_bytes(r) for r in records]


class MemoryStore:
    """The ``TaskStore`` in this process's memory. ``lease`` (seconds, None: for ever)
    is how long an acquisition lasts without a ``renew``; ``clock`` says what time it is."""

    def __init__(
        self, *, lease: float | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.guard = threading.Condition(threading.RLock())
        self._tasks: dict[str, _Task] = {}
        self._lease = lease
        self._clock = clock

    def get(self, task_id: str) -> _Task:
        """The task's data (the caller holds ``guard``)."""
        task = self._tasks.get(validate_task_id(task_id))
        if task is None:
            raise NotFoundError(f"no task {task_id!r} in this store; create it first.")
        return task

    def fenced(self, owner: Owner) -> _Task:
        """The task's data if ``owner`` still owns it, else ``FencedError``."""
        task = self.get(owner.task_id)
        if task.owner != owner or task.expires <= self._clock():
            raise FencedError(
                f"task {owner.task_id} is no longer owned by {owner.holder} (epoch "
                f"{owner.epoch}); its worker stops, and the task's new owner carries on."
            )
        return task

    # -- tasks ------------------------------------------------------------------------

    def create(
        self,
        spec: TaskSpec,
        record: JSON,
        *,
        script: bytes | None = None,
        journal: Sequence[JSON] = (),
        prepare: Callable[[Path | None], None] | None = None,
    ) -> None:
        header = record_bytes({"k": RecordKind.HEADER, "v": JOURNAL_VERSION, "task": spec.id})
        items = [header, *(record_bytes(r) for r in journal)] if journal else []
        with self.guard:
            if validate_task_id(spec.id) in self._tasks:
                raise StateConflictError(
                    f"a task named {spec.id!r} already exists; pick another --name."
                )
            if prepare is not None:
                prepare(None)
            task = _Task(spec, script, dump_json(record))
            for item in items:
                task.journal.append(item)
                task.volume.append(task.volume[-1] + len(item))
            task.seq = len(items)
            self._tasks[spec.id] = task

    def read_all(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()  # (reads are local: nothing to gather)

    def task_ids(self) -> list[str]:
        with self.guard:
            return sorted(self._tasks)

    def rest_mark(self, task_id: str, now_ns: int | None = None) -> tuple[int, ...] | None:
        return None  # (no cheap mark: a rescan reads the task)

    def exists(self, task_id: str) -> bool:
        with self.guard:
            return validate_task_id(task_id) in self._tasks

    def load_spec(self, task_id: str) -> TaskSpec:
        with self.guard:
            return self.get(task_id).spec

    def load_script(self, task_id: str) -> bytes:
        with self.guard:
            script = self.get(task_id).script
        if script is None:
            raise FileNotFoundError(f"task {task_id} has no script")
        return script

    # -- ownership --------------------------------------------------------------------

    def acquire(self, task_id: str, *, wait: float = 0.0) -> Owner:
        deadline = time.monotonic() + wait
        with self.guard:
            while True:
                task = self.get(task_id)
                if task.owner is None or task.expires <= self._clock():
                    task.epoch += 1
                    task.owner = Owner(task_id, f"thread {threading.get_ident()}", task.epoch)
                    task.expires = self._expiry()
                    return task.owner
                left = deadline - time.monotonic()
                if left <= 0:
                    raise LockBusyError(
                        f"task {task_id} is owned by {task.owner.holder}; another worker is "
                        "running this task. Wait for it to exit or stop it first."
                    )
                self.guard.wait(min(left, 0.05))

    def _expiry(self) -> float:
        return float("inf") if self._lease is None else self._clock() + self._lease

    def renew(self, owner: Owner) -> None:
        with self.guard:
            self.fenced(owner).expires = self._expiry()

    def release(self, owner: Owner) -> None:
        with self.guard:
            task = self.get(owner.task_id)
            if task.owner == owner:
                task.owner = None
                self.guard.notify_all()

    def owned(self, task_id: str) -> bool:
        with self.guard:
            task = self.get(task_id)
            return task.owner is not None and task.expires > self._clock()

    def owner_pid(self, task_id: str) -> int | None:
        """This process's while the task is owned: every owner is one of its threads."""
        return os.getpid() if self.owned(task_id) else None

    # -- the journal ------------------------------------------------------------------

    def open_journal(
        self, owner: Owner, *, after: Cursor = START, header: Mapping[str, Any] | None = None
    ) -> tuple[MemoryJournal, list[JSON]]:
        with self.guard:
            task = self.fenced(owner)
            writer = MemoryJournal(self, owner)
            if not task.seq:
                first = {"k": RecordKind.HEADER, "v": JOURNAL_VERSION, **(header or {})}
                writer.append([first])
                return writer, [first]
            return writer, self._records(task, after)

    def replay(self, task_id: str, after: Cursor = START) -> list[JSON]:
        with self.guard:
            task = self.get(task_id)
            return self._records(task, after) if task.seq else []

    def journal_end(self, task_id: str) -> Cursor:
        """After the last record recorded so far (``FileStore.journal_end``)."""
        with self.guard:
            return Cursor(len(self.get(task_id).journal))

    @staticmethod
    def _records(task: _Task, after: Cursor) -> list[JSON]:
        name = f"the journal of task {task.spec.id}"
        check_journal(name, len(task.journal), task.seq, after.position)
        return read_records(name, task.journal[after.position :], after.position + 1)

    # -- snapshots --------------------------------------------------------------------

    def get_snapshot(self, task_id: str) -> Snapshot | None:
        with self.guard:
            task = self.get(task_id)
            data = task.snapshot
            if data is None:
                return None
        state, position = TaskState.from_snapshot(load_json(data))
        return Snapshot(Cursor(position), state, len(data))

    def put_snapshot(self, owner: Owner, snapshot: Snapshot) -> int:
        data = scene_json(snapshot.state, snapshot.cursor.position)
        with self.guard:
            self.fenced(owner).snapshot = data
        return len(data)

    # -- operator decisions and the cancel ----------------------------------------------

    def record_decision(
        self, task_id: str, key: str, attempt: int, decision: Mapping[str, Any]
    ) -> bool:
        slot = (validate_call_id(key), attempt)
        with self.guard:
            decisions = self.get(task_id).decisions
            if slot in decisions:
                return False
            decisions[slot] = dump_json(decision)
            return True

    def decision_name(self, task_id: str, key: str, attempt: int) -> str:
        return f"decision {validate_call_id(key)}/{attempt} of task {validate_task_id(task_id)}"

    def read_decision(self, task_id: str, key: str, attempt: int) -> JSON | None:
        slot = (validate_call_id(key), attempt)
        with self.guard:
            data = self.get(task_id).decisions.get(slot)
        return None if data is None else dict(load_json(data))

    def request_cancel(self, task_id: str, stamp: JSON) -> bool:
        with self.guard:
            task = self.get(task_id)
            if task.cancel is not None:
                return False
            task.cancel = dump_json(stamp)
            return True

    def cancel_requested(self, task_id: str) -> bool:
        with self.guard:
            return self.get(task_id).cancel is not None

    def read_cancel(self, task_id: str) -> JSON | None:
        with self.guard:
            data = self.get(task_id).cancel
        return None if data is None else dict(load_json(data))

    def withdraw_cancel(self, task_id: str) -> None:
        with self.guard:
            self.get(task_id).cancel = None

    # -- the task record --------------------------------------------------------------

    def get_record(self, task_id: str) -> tuple[JSON | None, Version]:
        with self.guard:
            task = self.get(task_id)
            return dict(load_json(task.record)), Version(str(task.version))

    def record_version(self, task_id: str) -> Version:
        with self.guard:
            return Version(str(self.get(task_id).version))

    def record_name(self, task_id: str) -> str:
        return f"the record of task {validate_task_id(task_id)}"

    def cas_record(
        self, task_id: str, expected: Version, record: JSON, *, durable: bool = True
    ) -> Version:
        data = dump_json(record)
        with self.guard:
            task = self.get(task_id)
            if expected != Version(str(task.version)):
                raise RecordConflictError(
                    f"the record of task {task_id} changed since it was read; read it again."
                )
            task.record, task.version = data, task.version + 1
            return Version(str(task.version))

    # -- events, heartbeats and exits -------------------------------------------------

    def append_event(self, task_id: str, event: Mapping[str, Any]) -> None:
        clean = json.loads(json.dumps(redact.clean_mapping(event), default=str))
        with self.guard:
            self.get(task_id).events.append(clean)

    def read_events(self, task_id: str, after: Cursor = START) -> tuple[list[JSON], Cursor]:
        with self.guard:
            events = self.get(task_id).events
            return [dict(e) for e in events[after.position :]], Cursor(len(events))

    def events_end(self, task_id: str) -> Cursor:
        """After the last event appended so far (``FileStore.events_end``)."""
        with self.guard:
            return Cursor(len(self.get(task_id).events))

    def publish_heartbeat(self, task_id: str, beat: JSON) -> None:
        data = dump_json(beat)
        with self.guard:
            self.get(task_id).heartbeat = data

    def read_heartbeat(self, task_id: str) -> JSON | None:
        with self.guard:
            data = self.get(task_id).heartbeat
        return None if data is None else dict(load_json(data))

    def publish_exit(self, task_id: str, outcome: Mapping[str, Any]) -> None:
        data = dump_json(outcome)
        with self.guard:
            self.get(task_id).exit = data

    def read_exit(self, task_id: str) -> JSON | None:
        with self.guard:
            data = self.get(task_id).exit
        return None if data is None else dict(load_json(data))
