"""The spool: the embedded ``TaskStore``, one folder per task (``SPOOL/tasks/ID/``).

Every file keeps the name, format and durability of the releases before the store seam
(the layout is in docs/ARCHITECTURE.md), so a spool written by an older release resumes:

* the journal is ``worker.store.journal``'s framed file (crc, durable marks, torn tail);
* the snapshot is ``worker.state``'s sealed scene, its cursor the journal offset inside it;
* decisions and the cancel are created exclusively (``write_exclusive``): one winner;
* the task record (``state.json``) is replaced atomically; ``cas_record`` compares and
  sets it under an ``flock`` of the task folder, its ``Version`` the file's identity;
* ownership is the task's ``flock`` (``worker.lock``): it dies with its process, and the
  kernel lets one process hold it at a time. ``Owner.epoch`` counts this store's
  acquisitions, and an owner that released the lock is fenced here, before any write.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from worker.errors import FencedError, RecordConflictError, SpoolError, StateConflictError
from worker.events import TaskEventLog, read_events_from
from worker.lock import TaskLock, holder_pid, is_locked
from worker.spool import Spool, TaskDir, TaskSpec
from worker.state import parse_snapshot, snapshot_bytes
from worker.store.base import (
    JSON,
    NOT_A_RECORD,
    START,
    UNREADABLE,
    Cursor,
    Owner,
    Snapshot,
    Unreadable,
    Version,
    recorded_progress,
)
from worker.store.durable import (
    atomic_write,
    atomic_write_json,
    load_json,
    move_exclusive,
    open_regular,
    private_dir,
    read_bytes,
    read_json,
    write_exclusive,
)
from worker.store.journal import Journal, read_file, refuse_shorter

#: Nanoseconds within which a file's change time may hide another change (``rest_mark``).
RACY_NS = 2_000_000_000


class FileJournal:
    """A ``JournalWriter`` on an open ``Journal``: its cursors are byte offsets."""

    def __init__(self, store: FileStore, owner: Owner, journal: Journal) -> None:
        self._store = store
        self._owner = owner
        self.journal = journal

    @property
    def owner(self) -> Owner:
        return self._owner

    @property
    def cursor(self) -> Cursor:
        return Cursor(self.journal.size)

    @property
    def durable(self) -> Cursor:
        return Cursor(self.journal.durable)

    def volume_since(self, cursor: Cursor) -> int:
        return self.journal.size - cursor.position

    def append(self, records: Iterable[JSON], *, sync: bool = True) -> None:
        self._store.check(self._owner)
        self.journal.append(records, sync=sync)

    def hold(self, records: Iterable[JSON]) -> None:
        self._store.check(self._owner)
        self.journal.hold(records)

    def sync(self) -> None:
        self._store.check(self._owner)  # it writes what is held: a step like an append
        self.journal.sync()

    def sync_in_background(self) -> None:
        self._store.check(self._owner)
        self.journal.sync_in_background()

    def close(self) -> None:
        if not self._store.holds(self._owner):
            self.journal.drop_held()  # a fenced owner's held records are never written
        self.journal.close()


class FileStore:
    """The ``TaskStore`` of one spool folder."""

    @classmethod
    def of(cls, task: TaskDir) -> FileStore:
        """The store of the spool ``task`` lives in: one per spool in a process, so that
        the daemon and the commands share its ownership epochs (``spool_store``)."""
        return spool_store(task.root)

    def __init__(self, root: Path, *, ring_on_events: bool = False) -> None:
        self.spool = Spool(root)
        #: a worker's store: each event it appends also rings a daemon on the spool about
        #: its task (``Spool.ring``), which relays it into its log at once
        self.ring_on_events = ring_on_events
        self._guard = threading.Lock()
        self._reading = threading.local()  # what ``read_all`` has read, while it lasts
        self._owners: dict[str, tuple[Owner, TaskLock]] = {}
        self._epochs: dict[str, int] = {}

    def task(self, task_id: str) -> TaskDir:
        """The folder of ``task_id`` (the id is checked first): for what lives beside the
        store's files, the workspace and the worker's output."""
        return self.spool.task(task_id)

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
        """Make the whole folder in ``SPOOL/tmp/.submit-XXXX`` (``prepare`` adds what lives
        beside the store's files there: a fork's workspace), the spec last, then move it
        to ``SPOOL/tasks/ID`` in one step (``move_exclusive``): the task appears whole or
        not at all, and of two submits of one name exactly one succeeds."""
        self.spool.ensure()
        task = self.task(spec.id)
        refuse_symlinks(task)
        import tempfile  # noqa: PLC0415  (only a submit stages a folder: a reader starts without it)

        staging = Path(tempfile.mkdtemp(prefix=".submit-", dir=private_dir(self.spool.tmp_dir)))
        try:
            if script is not None:
                atomic_write(staging / task.script.name, script)
            atomic_write_json(staging / task.state.name, record)
            if journal:
                opened, _ = Journal.open(staging / task.journal.name, task=task.id)
                with opened:
                    opened.append(journal)
            if prepare is not None:
                prepare(staging)
            atomic_write_json(staging / task.spec.name, spec.to_json())
            if not move_exclusive(staging, task.path):
                # an empty folder (a submit killed in ``move_exclusive``'s fallback) is no
                # task: it gives way, once
                with contextlib.suppress(OSError):
                    task.path.rmdir()
                if not move_exclusive(staging, task.path):
                    raise _taken(task)
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    @contextlib.contextmanager
    def read_all(self) -> Iterator[None]:
        """For the block, this thread reads each task's record and heartbeat once: a status
        row reads both, and its journal's fold reads them again for the progress recorded
        (``progress``), which at 500 tasks was a fifth of what ``agentd status`` spent. A
        write of either through this store drops the copy read; the rest is read as ever."""
        if getattr(self._reading, "seen", None) is not None:  # (an inner block: the outer's)
            yield
            return
        self._reading.seen = _Seen()
        try:
            yield
        finally:
            self._reading.seen = None

    def _seen(self) -> _Seen | None:
        seen: _Seen | None = getattr(self._reading, "seen", None)
        return seen

    def task_ids(self) -> list[str]:
        return self.spool.task_ids()

    def exists(self, task_id: str) -> bool:
        return self.task(task_id).exists()

    def rest_mark(self, task_id: str, now_ns: int | None = None) -> tuple[int, ...] | None:
        """The inode, size and change time of the task's folder (a request, a cancel, a
        pause or a record written there moves it), its events, its decisions folder and
        its journal; None when one of them changed within ``RACY_NS`` of ``now_ns`` (a
        change in the same tick of the file system's clock would leave its time as it
        was), or cannot be read."""
        task = self.task(task_id)
        now_ns = time.time_ns() if now_ns is None else now_ns
        mark: list[int] = []
        for path in (task.path, task.events, task.decisions, task.journal):
            try:
                found = os.stat(path, follow_symlinks=False)
            except FileNotFoundError:
                mark += (0, 0, 0)
                continue
            except OSError:
                return None
            if now_ns - found.st_ctime_ns < RACY_NS:
                return None
            mark += (found.st_ino, found.st_size, found.st_ctime_ns)
        return tuple(mark)

    def load_spec(self, task_id: str) -> TaskSpec:
        return self.task(task_id).load_spec()

    def load_script(self, task_id: str) -> bytes:
        return read_bytes(self.task(task_id).script)

    # -- ownership --------------------------------------------------------------------

    def acquire(self, task_id: str, *, wait: float = 0.0) -> Owner:
        lock = TaskLock(self.task(task_id).lock).acquire(wait=wait)
        with self._guard:
            epoch = self._epochs.get(task_id, 0) + 1
            self._epochs[task_id] = epoch
            owner = Owner(task_id, f"pid {os.getpid()}", epoch)
            self._owners[task_id] = (owner, lock)
        return owner

    def holds(self, owner: Owner) -> bool:
        """Whether ``owner`` still holds its task's lock."""
        with self._guard:
            held = self._owners.get(owner.task_id)
        return held is not None and held[0] == owner

    def check(self, owner: Owner) -> None:
        """``FencedError`` unless ``owner`` still holds its task's lock."""
        if not self.holds(owner):
            raise FencedError(
                f"task {owner.task_id} is no longer owned by {owner.holder} (epoch "
                f"{owner.epoch}); its worker stops, and the task's new owner carries on."
            )

    def renew(self, owner: Owner) -> None:
        self.check(owner)

    def release(self, owner: Owner) -> None:
        with self._guard:
            held = self._owners.get(owner.task_id)
            if held is None or held[0] != owner:
                return
            del self._owners[owner.task_id]
        held[1].release()

    def owned(self, task_id: str) -> bool:
        return is_locked(self.task(task_id).lock)

    def owner_pid(self, task_id: str) -> int | None:
        """The pid the task's lock names (its last holder's, live or not; None if none):
        for the daemon to re-attach to a worker an earlier daemon started (``adopt``)."""
        return holder_pid(self.task(task_id).lock)

    # -- the journal ------------------------------------------------------------------

    def open_journal(
        self, owner: Owner, *, after: Cursor = START, header: Mapping[str, Any] | None = None
    ) -> tuple[FileJournal, list[JSON]]:
        self.check(owner)
        task = self.task(owner.task_id)
        journal, records = Journal.open(
            task.journal, after.position, recorded=self.progress(task.id), **(header or {})
        )
        return FileJournal(self, owner, journal), records

    def replay(self, task_id: str, after: Cursor = START) -> list[JSON]:
        """The records after ``after``; ``JournalCorruptError`` when the journal ends
        before the progress recorded (``progress``), as the worker would refuse it."""
        path = self.task(task_id).journal
        try:
            scan = read_file(path, after.position)
        except FileNotFoundError:
            refuse_shorter(path, 0, self.progress(task_id))
            return []
        refuse_shorter(path, scan.good_end, self.progress(task_id))
        return [record for record, _ in scan.records]

    def progress(self, task_id: str) -> int | None:
        """The journal size the task's workers reported durable: the furthest of the
        record's (the daemon's copy, written durably at each exit) and the heartbeat's
        (the last worker's, at most a beat old); None when neither says."""
        try:
            record, _ = self.get_record(task_id)
        except Unreadable:
            record = None
        return recorded_progress(record, self.read_heartbeat(task_id))

    def journal_end(self, task_id: str) -> Cursor:
        """After the last record recorded so far (a torn tail's bytes too), read-only:
        where a new worker starts, to tell afterwards what it recorded (``START`` when
        the task has no journal yet)."""
        try:
            return Cursor(self.task(task_id).journal.stat().st_size)
        except OSError:
            return START

    # -- snapshots --------------------------------------------------------------------

    def get_snapshot(self, task_id: str) -> Snapshot | None:
        task = self.task(task_id)
        try:
            data = read_bytes(task.snapshot)
            journal_size = task.journal.stat().st_size
        except FileNotFoundError:
            return None
        state, offset = parse_snapshot(data)
        if offset > journal_size:  # the journal was cut or restored: the cache is stale
            return None
        return Snapshot(Cursor(offset), state, len(data))

    def put_snapshot(self, owner: Owner, snapshot: Snapshot) -> int:
        self.check(owner)
        data = snapshot_bytes(snapshot.state, snapshot.cursor.position)
        atomic_write(self.task(owner.task_id).snapshot, data)
        return len(data)

    # -- operator decisions and the cancel ----------------------------------------------

    def record_decision(
        self, task_id: str, key: str, attempt: int, decision: Mapping[str, Any]
    ) -> bool:
        task = self.task(task_id)
        path = task.decision_file(key, attempt)
        refuse_symlinks(task)
        private_dir(task.decisions)
        return write_exclusive(path, json.dumps(decision).encode())

    def decision_name(self, task_id: str, key: str, attempt: int) -> str:
        """What names a decision in a message: its file's name."""
        return self.task(task_id).decision_file(key, attempt).name

    def read_decision(self, task_id: str, key: str, attempt: int) -> JSON | None:
        task = self.task(task_id)
        path = task.decision_file(key, attempt)
        if task.decisions.is_symlink():  # it leads out of the spool: never read it
            raise Unreadable(str(path), "symlink")
        try:
            data = read_json(path)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            raise Unreadable(str(path), str(exc)) from None
        return data if isinstance(data, dict) else {}

    def request_cancel(self, task_id: str, stamp: JSON) -> bool:
        return write_exclusive(self.task(task_id).cancellation, json.dumps(stamp).encode())

    def cancel_requested(self, task_id: str) -> bool:
        return self.task(task_id).cancellation.exists()

    def read_cancel(self, task_id: str) -> JSON | None:
        try:
            data = read_json(self.task(task_id).cancellation)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise ValueError(f"{self.task(task_id).cancellation}: {exc}") from None
        return data if isinstance(data, dict) else {}

    def withdraw_cancel(self, task_id: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.task(task_id).cancellation.unlink()

    # -- the task record --------------------------------------------------------------

    def get_record(self, task_id: str) -> tuple[JSON | None, Version]:
        """``Unreadable`` (``where`` the file) when it cannot be read or parsed
        (``UNREADABLE``) or is no JSON object (``NOT_A_RECORD``)."""
        seen = self._seen()
        if seen is None:
            return self._read_record(task_id)
        if task_id not in seen.records:
            seen.records[task_id] = self._read_record(task_id)
        data, version = seen.records[task_id]
        return (dict(data) if data is not None else None), version

    def _read_record(self, task_id: str) -> tuple[JSON | None, Version]:
        path = self.task(task_id).state
        try:
            fd = open_regular(path)
        except FileNotFoundError:
            return None, Version()
        except PermissionError as exc:  # the folder or the file is another user's
            raise Unreadable(
                str(path),
                f"{UNREADABLE} ({exc.strerror}): give the task folder to the user agentd runs "
                "as, or remove it",
            ) from None
        except OSError:
            raise Unreadable(str(path), UNREADABLE) from None
        try:
            with os.fdopen(fd, "rb") as f:
                version = _version(os.fstat(f.fileno()))
                data = load_json(f.read())
        except (OSError, ValueError):
            raise Unreadable(str(path), UNREADABLE) from None
        if not isinstance(data, dict):
            raise Unreadable(str(path), NOT_A_RECORD)
        return data, version

    def record_version(self, task_id: str) -> Version:
        """The record's version as it is now, without reading it: for a writer that holds
        the right to write it alone (the supervisor lock), whose write replaces whatever
        is there, a damaged record too."""
        return _current_version(self.task(task_id).state)

    def record_name(self, task_id: str) -> str:
        """What names the task record in a message: its file."""
        return str(self.task(task_id).state)

    def cas_record(
        self, task_id: str, expected: Version, record: JSON, *, durable: bool = True
    ) -> Version:
        task = self.task(task_id)
        with _folder_locked(task.path):
            current = _current_version(task.state)
            if current != expected:
                raise RecordConflictError(
                    f"the record of task {task_id} changed since it was read; read it again."
                )
            atomic_write_json(task.state, record, durable=durable)
            if (seen := self._seen()) is not None:
                seen.records.pop(task_id, None)
            return _current_version(task.state)

    # -- events, heartbeats and exits -------------------------------------------------

    def append_event(self, task_id: str, event: Mapping[str, Any]) -> None:
        TaskEventLog(self.task(task_id).events).append(event)
        if self.ring_on_events:
            self.spool.ring(task_id, once=True)

    def read_events(self, task_id: str, after: Cursor = START) -> tuple[list[JSON], Cursor]:
        events, end = read_events_from(self.task(task_id).events, after.position)
        return events, Cursor(end)

    def events_end(self, task_id: str) -> Cursor:
        """After the last event appended so far, without reading any: where a reader that
        wants only what comes next starts (``START`` when there are none)."""
        try:
            return Cursor(os.stat(self.task(task_id).events, follow_symlinks=False).st_size)
        except OSError:
            return START

    def publish_heartbeat(self, task_id: str, beat: JSON) -> None:
        atomic_write_json(self.task(task_id).heartbeat, beat, durable=False)
        if (seen := self._seen()) is not None:
            seen.beats.pop(task_id, None)

    def read_heartbeat(self, task_id: str) -> JSON | None:
        seen = self._seen()
        if seen is None:
            return _read_object(self.task(task_id).heartbeat)
        if task_id not in seen.beats:
            seen.beats[task_id] = _read_object(self.task(task_id).heartbeat)
        beat = seen.beats[task_id]
        return dict(beat) if beat is not None else None

    def publish_exit(self, task_id: str, outcome: Mapping[str, Any]) -> None:
        atomic_write_json(self.task(task_id).exit, outcome)

    def read_exit(self, task_id: str) -> JSON | None:
        return _read_object(self.task(task_id).exit)


@dataclass
class _Seen:
    """What one ``read_all`` block has read: records (with their versions) and
    heartbeats, by task id. Each caller gets a copy of its own."""

    records: dict[str, tuple[JSON | None, Version]] = field(default_factory=dict)
    beats: dict[str, JSON | None] = field(default_factory=dict)


_stores: dict[Path, FileStore] = {}
_stores_guard = threading.Lock()


def spool_store(root: Path) -> FileStore:
    """The one ``FileStore`` of the spool at ``root`` in this process."""
    with _stores_guard:
        store = _stores.get(root)
        if store is None:
            store = _stores[root] = FileStore(root)
        return store


def _taken(task: TaskDir) -> StateConflictError:
    if task.exists():
        return StateConflictError(f"a task named {task.id!r} already exists; pick another --name.")
    return StateConflictError(
        f"{task.path} exists and is no task (it has no spec.json); remove it, or pick "
        "another --name."
    )


def refuse_symlinks(task: TaskDir) -> None:
    """A task folder (or its decisions folder) that is a symlink leads out of the spool:
    agentd never follows one."""
    for path in (task.path, task.decisions):
        if path.is_symlink():
            raise SpoolError(
                f"{path} is a symlink; agentd does not follow links out of the spool. "
                "Remove the link (or move the real folder into the spool)."
            )


def _read_object(path: Path) -> JSON | None:
    """A JSON object file, or None when there is none or it is not one (advisory files)."""
    try:
        data = read_json(path)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _version(st: os.stat_result) -> Version:
    # every replacement is a new file (rename of a temp file): a new inode and times
    return Version(f"{st.st_ino}:{st.st_ctime_ns}:{st.st_size}")


def _current_version(path: Path) -> Version:
    try:
        return _version(os.stat(path, follow_symlinks=False))
    except FileNotFoundError:
        return Version()


@contextlib.contextmanager
def _folder_locked(folder: Path) -> Iterator[None]:
    """An exclusive ``flock`` of the task folder itself (no file of its own), for the one
    compare-and-set of the task record; it is dropped with the descriptor."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
