"""The journal and the snapshot of a task in the PostgreSQL store (docs/design.md
section 10): the fenced append (``pglease.append``) behind a ``JournalWriter``, the replay,
and the snapshot, an upsert fenced by the same epoch, so a stale owner writes nothing and
gets ``FencedError``. Cursors are journal ``seq`` numbers."""

from __future__ import annotations

import errno
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from worker.errors import NotFoundError, StorageError
from worker.records import RecordKind
from worker.spool import validate_task_id
from worker.state import TaskState, scene_json
from worker.store import pglease
from worker.store.base import (
    JSON,
    START,
    Cursor,
    HeldInMemory,
    Owner,
    Snapshot,
    check_journal,
    read_records,
    record_bytes,
)
from worker.store.durable import load_json
from worker.store.journal import JOURNAL_VERSION

if TYPE_CHECKING:
    from worker.store.pgdatabase import Database
    from worker.store.pgview import TaskView


class PostgresJournal(HeldInMemory):
    """A ``JournalWriter`` on the PostgreSQL store: its cursor is the seq of the last
    record it wrote, and every append is one fenced statement (``pglease.append``)."""

    def __init__(self, rows: JournalRows, owner: Owner, seq: int, sizes: Sequence[int]) -> None:
        self._rows = rows
        self._owner = owner
        self._seq = seq
        self._base = seq - len(sizes)  # volume[i]: bytes recorded after seq base + i
        self._volume = [0]
        for size in sizes:
            self._volume.append(self._volume[-1] + size)
        self._held: list[bytes] = []
        self._failed: str | None = None

    @property
    def owner(self) -> Owner:
        return self._owner

    @property
    def cursor(self) -> Cursor:
        return Cursor(self._seq)

    def volume_since(self, cursor: Cursor) -> int:
        at = cursor.position - self._base
        if at >= 0:
            return self._volume[-1] - self._volume[min(at, len(self._volume) - 1)]
        before = self._rows.volume_between(self._owner.task_id, cursor.position, self._base)
        return before + self._volume[-1]

    def append(self, records: Iterable[JSON], *, sync: bool = True) -> None:
        """Record the held records and ``records`` in one fenced statement. ``sync`` is
        moot: a commit with ``synchronous_commit`` on is durable when it returns."""
        data = self._held + [record_bytes(r) for r in records]
        if not data:
            return
        if self._failed is not None:
            raise StorageError(
                f"task {self._owner.task_id}'s journal refuses appends after a failed "
                f"write ({self._failed}); reopen it.",
                errno.EIO,
            )
        try:
            with self._rows.db.step() as conn:
                self._seq = pglease.append(
                    conn, self._owner.task_id, self._owner.epoch, self._seq, data
                )
        except StorageError as exc:
            if exc.fault:
                self._failed = str(exc)
            raise
        self._held = []
        for item in data:
            self._volume.append(self._volume[-1] + len(item))

    def hold(self, records: Iterable[JSON]) -> None:
        self._rows.check_fence(self._owner)
        self._held += [record_bytes(r) for r in records]


class JournalRows:
    """The journal and the snapshot of each task: what ``PostgresStore`` reads and writes
    of them, through ``db``, and, while a ``read_all`` lasts, from ``view``."""

    def __init__(self, db: Database, view: TaskView) -> None:
        self.db = db
        self._view = view

    def check_fence(self, owner: Owner) -> None:
        """``FencedError`` unless ``owner``'s epoch is still the task's (a read: no WAL)."""
        (epoch,) = self.db.row("SELECT epoch FROM tasks WHERE id = %(task)s", owner.task_id)
        if epoch != owner.epoch:
            raise pglease.fenced(owner)

    def volume_between(self, task_id: str, after: int, upto: int) -> int:
        """Bytes of the journal records after seq ``after`` up to seq ``upto``."""
        row = self.db.one(
            "SELECT coalesce(sum(octet_length(record)), 0) FROM journal "
            "WHERE task = %(task)s AND seq > %(after)s AND seq <= %(upto)s",
            {"task": validate_task_id(task_id), "after": after, "upto": upto},
        )
        return int(row[0]) if row else 0

    _RECORDS = """
    SELECT epoch, seq, ARRAY(
        SELECT record FROM journal WHERE task = %(task)s AND seq > %(after)s ORDER BY seq
    ) FROM tasks WHERE id = %(task)s
    """

    def _records(self, task_id: str, after: Cursor) -> tuple[int, int, list[bytes]]:
        epoch, seq, records = self.db.row(self._RECORDS, task_id, after=after.position)
        found = [bytes(r) for r in records]
        _check_rows(task_id, int(seq), after.position, found)
        return int(epoch), int(seq), found

    def open_journal(
        self, owner: Owner, *, after: Cursor = START, header: Mapping[str, Any] | None = None
    ) -> tuple[PostgresJournal, list[JSON]]:
        epoch, seq, records = self._records(owner.task_id, after)
        if epoch != owner.epoch:
            raise pglease.fenced(owner)
        writer = PostgresJournal(self, owner, seq, [len(r) for r in records])
        if seq == 0:
            first = {"k": RecordKind.HEADER, "v": JOURNAL_VERSION, **(header or {})}
            writer.append([first])
            return writer, [first]
        return writer, read_records(_journal_name(owner.task_id), records, after.position + 1)

    def replay(self, task_id: str, after: Cursor = START) -> list[JSON]:
        seen = self._view.seen(task_id)
        if seen is not None and seen.records is not None and after.position == seen.after:
            _check_rows(task_id, seen.seq, seen.after, seen.records)
            return read_records(_journal_name(task_id), seen.records, seen.after + 1)
        _, seq, records = self._records(task_id, after)
        return read_records(_journal_name(task_id), records, after.position + 1) if seq else []

    def journal_end(self, task_id: str) -> Cursor:
        (seq,) = self.db.row("SELECT seq FROM tasks WHERE id = %(task)s", task_id)
        return Cursor(int(seq))

    def get_snapshot(self, task_id: str) -> Snapshot | None:
        seen = self._view.seen(task_id)
        row = (
            (seen.snapshot,)
            if seen is not None
            else self.db.one(
                "SELECT s.state FROM tasks t LEFT JOIN snapshots s ON s.task = t.id "
                "WHERE t.id = %(task)s",
                {"task": validate_task_id(task_id)},
            )
        )
        if row is None:
            raise NotFoundError(f"no task {task_id!r} in this store; create it first.")
        if row[0] is None:
            return None
        data = bytes(row[0])
        state, position = TaskState.from_snapshot(load_json(data))
        return Snapshot(Cursor(position), state, len(data))

    def put_snapshot(self, owner: Owner, snapshot: Snapshot) -> int:
        data = scene_json(snapshot.state, snapshot.cursor.position)
        wrote = self.db.done(
            """
            WITH done AS (
                INSERT INTO snapshots (task, seq, state)
                SELECT id, %(seq)s, %(state)s FROM tasks WHERE id = %(task)s AND epoch = %(epoch)s
                ON CONFLICT (task) DO UPDATE SET seq = excluded.seq, state = excluded.state,
                    at = now()
                RETURNING 1
            )
            """,
            owner.task_id,
            seq=snapshot.cursor.position,
            state=data,
            epoch=owner.epoch,
        )
        if not wrote:
            raise pglease.fenced(owner)
        return len(data)


def _journal_name(task_id: str) -> str:
    return f"the journal of task {task_id}"


def _check_rows(task_id: str, seq: int, after: int, rows: Sequence[bytes]) -> None:
    """The rows read after seq ``after`` must reach the task's ``seq``, which the same
    statement as every append moved: fewer is a journal that lost recorded rows."""
    check_journal(_journal_name(task_id), after + len(rows), seq, after)
