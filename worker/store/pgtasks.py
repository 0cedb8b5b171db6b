"""A task's rows in the PostgreSQL store (docs/design.md section 10), but for its journal,
snapshot and lease: its creation, spec and script, the operator's decisions and cancel,
the task record, and what its worker reports as it runs (events, heartbeats, its exit).

Decisions are exactly once by their primary key, a cancel by ``cancel IS NULL``, the
record a compare-and-set on its version (the row's ``state`` column, which the claim
scans, follows the record's state). An event takes its number from the task row's
counter, whose lock lasts until the commit, so numbers follow commits. jsonb holds no
NUL: one in an event becomes U+FFFD.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from psycopg import errors as pgerrors

from worker.errors import RecordConflictError, StateConflictError
from worker.identity import clock_id
from worker.records import RecordKind
from worker.redactor import redact
from worker.spool import TaskSpec, validate_call_id, validate_task_id
from worker.store.base import JSON, START, Cursor, Unreadable, Version, record_bytes
from worker.store.journal import JOURNAL_VERSION
from worker.store.pgdatabase import jsonb, without_nul
from worker.store.pgschema import state_of

if TYPE_CHECKING:
    from worker.store.pgdatabase import Database
    from worker.store.pgview import TaskView


class TaskRows:
    """Each task's row and the rows beside it, but for its journal, snapshot and lease:
    read and written through ``db``, and, while a ``read_all`` lasts, read from ``view``.
    ``node`` stamps a heartbeat published while no lease names one."""

    def __init__(self, db: Database, view: TaskView, node: str) -> None:
        self.db = db
        self._view = view
        self._node = node

    # -- creation ----------------------------------------------------------------------

    def create(
        self,
        spec: TaskSpec,
        record: JSON,
        script: bytes | None,
        journal: Sequence[JSON],
        prepare: Callable[[Path | None], None] | None,
    ) -> None:
        """One transaction makes the task; ``prepare`` runs before it, so a failed
        ``prepare`` leaves no task (and a refused insert leaves what it made)."""
        validate_task_id(spec.id)
        header = {"k": RecordKind.HEADER, "v": JOURNAL_VERSION, "task": spec.id}
        items = [record_bytes(header), *(record_bytes(r) for r in journal)] if journal else []
        params: list[Any] = [spec.id, jsonb(spec.to_json()), script, jsonb(record)]
        params += [state_of(record), len(items), *items]
        sql = _create_sql(len(items))
        if prepare is not None:
            prepare(None)
        try:
            with self.db.step() as conn:
                conn.execute(sql, params)
        except pgerrors.UniqueViolation:
            if self.db.one(
                _MADE_SO,
                {
                    "task": spec.id,
                    "spec": params[1],
                    "record": params[3],
                    "script": script,
                    "seq": len(items),
                },
            ):
                return  # this very create, whose commit's reply was lost: made
            raise StateConflictError(
                f"a task named {spec.id!r} already exists; pick another --name."
            ) from None

    # -- the tasks there are, their spec and script ------------------------------------

    def task_ids(self) -> list[str]:
        seen = self._view.task_ids()
        if seen is not None:
            return seen
        with self.db.step() as conn:
            return sorted(row[0] for row in conn.execute("SELECT id FROM tasks"))

    def rest_mark(self, task_id: str, now_ns: int | None = None) -> tuple[int, ...] | None:
        return None  # (no cheap mark: a rescan reads the task)

    def exists(self, task_id: str) -> bool:
        if self._view.seen(task_id) is not None:
            return True
        row = self.db.one(
            "SELECT EXISTS (SELECT 1 FROM tasks WHERE id = %(task)s)",
            {"task": validate_task_id(task_id)},
        )
        return bool(row and row[0])

    def load_spec(self, task_id: str) -> TaskSpec:
        seen = self._view.seen(task_id)
        if seen is not None:
            spec = seen.spec
        else:
            (spec,) = self.db.row("SELECT spec FROM tasks WHERE id = %(task)s", task_id)
        return TaskSpec.from_json(spec, where=f"task {task_id}'s spec in the database")

    def load_script(self, task_id: str) -> bytes:
        (script,) = self.db.row("SELECT script FROM tasks WHERE id = %(task)s", task_id)
        if script is None:
            raise FileNotFoundError(f"task {task_id} has no script")
        return bytes(script)

    # -- operator decisions and the cancel ---------------------------------------------

    def record_decision(
        self, task_id: str, key: str, attempt: int, decision: Mapping[str, Any]
    ) -> bool:
        """One winner by the primary key (task, key, attempt): the losers' inserts find
        the row there and do nothing."""
        params = {"key": validate_call_id(key), "attempt": attempt, "decision": jsonb(decision)}
        won = self.db.done(
            """
            WITH done AS (
                INSERT INTO decisions (task, key, attempt, decision)
                SELECT id, %(key)s, %(attempt)s, %(decision)s::jsonb FROM tasks
                WHERE id = %(task)s
                ON CONFLICT DO NOTHING RETURNING 1
            )
            """,
            task_id,
            **params,
        )
        return won or self.db.done(  # the winner is this very decision (a lost reply)?
            "WITH done AS (SELECT 1 FROM decisions WHERE task = %(task)s AND key = %(key)s "
            "AND attempt = %(attempt)s AND decision = %(decision)s::jsonb)",
            task_id,
            **params,
        )

    def read_decision(self, task_id: str, key: str, attempt: int) -> JSON | None:
        validate_call_id(key)
        (decision,) = self.db.row(
            "SELECT (SELECT decision FROM decisions WHERE task = %(task)s AND key = %(key)s "
            "AND attempt = %(attempt)s) FROM tasks WHERE id = %(task)s",
            task_id,
            key=key,
            attempt=attempt,
        )
        if decision is None:
            return None
        if not isinstance(decision, dict):
            where = self.decision_name(task_id, key, attempt)
            raise Unreadable(where, "the decision is not a JSON object")
        return decision

    def decision_name(self, task_id: str, key: str, attempt: int) -> str:
        return f"decision {validate_call_id(key)}/{attempt} of task {validate_task_id(task_id)}"

    def request_cancel(self, task_id: str, stamp: JSON) -> bool:
        """The first cancel wins; one whose stamp is there already is that first one, whose
        commit's reply was lost."""
        return self.db.done(
            "WITH asked AS (UPDATE tasks SET cancel = %(stamp)s::jsonb, updated_at = now() "
            "WHERE id = %(task)s AND cancel IS NULL RETURNING 1), "
            "done AS (SELECT 1 FROM asked UNION ALL "
            "SELECT 1 FROM tasks WHERE id = %(task)s AND cancel = %(stamp)s::jsonb)",
            task_id,
            stamp=jsonb(stamp),
        )

    def cancel_requested(self, task_id: str) -> bool:
        (asked,) = self.db.row("SELECT cancel IS NOT NULL FROM tasks WHERE id = %(task)s", task_id)
        return bool(asked)

    def read_cancel(self, task_id: str) -> JSON | None:
        (stamp,) = self.db.row("SELECT cancel FROM tasks WHERE id = %(task)s", task_id)
        return stamp if isinstance(stamp, dict) or stamp is None else {}

    def withdraw_cancel(self, task_id: str) -> None:
        self.db.done(
            "WITH done AS (UPDATE tasks SET cancel = NULL WHERE id = %(task)s RETURNING 1)",
            task_id,
        )

    # -- the task record ---------------------------------------------------------------

    def get_record(self, task_id: str) -> tuple[JSON | None, Version]:
        seen = self._view.seen(task_id)
        if seen is not None:
            record, version = seen.record, seen.version
        else:
            record, version = self.db.row(
                "SELECT record, version FROM tasks WHERE id = %(task)s", task_id
            )
        if not isinstance(record, dict):
            raise ValueError(f"task {task_id}'s record in the database is not a JSON object")
        return record, Version(str(version))

    def record_version(self, task_id: str) -> Version:
        (version,) = self.db.row("SELECT version FROM tasks WHERE id = %(task)s", task_id)
        return Version(str(version))

    def record_name(self, task_id: str) -> str:
        return f"task {validate_task_id(task_id)}'s record in the database"

    def cas_record(
        self, task_id: str, expected: Version, record: JSON, *, durable: bool = True
    ) -> Version:
        """Replace the record while its version is ``expected``; the row's ``state``
        column (what the claim scans) follows the record's state when it is one."""
        token = int(expected.token) if expected.token.isdigit() else -1
        row = self.db.row(
            """
            WITH done AS (
                UPDATE tasks SET record = %(record)s::jsonb, version = version + 1,
                    state = coalesce(%(state)s, state), updated_at = now()
                WHERE id = %(task)s AND version = %(expected)s
                RETURNING version
            )
            SELECT (SELECT version FROM done) FROM tasks WHERE id = %(task)s
            """,
            task_id,
            record=jsonb(record),
            state=state_of(record),
            expected=token,
        )
        if row[0] is None:
            row = self.db.row(  # this very write, whose commit's reply was lost?
                "SELECT (SELECT version FROM tasks WHERE id = %(task)s AND version = "
                "%(expected)s + 1 AND record = %(record)s::jsonb)",
                task_id,
                record=jsonb(record),
                expected=token,
            )
        if row[0] is None:
            raise RecordConflictError(
                f"the record of task {task_id} changed since it was read; read it again."
            )
        return Version(str(row[0]))

    # -- events, heartbeats and exits --------------------------------------------------

    def append_event(self, task_id: str, event: Mapping[str, Any]) -> None:
        """The event's number is taken by the UPDATE of the task row, whose lock lasts
        until the commit: numbers follow commits, so a reader never skips one. An event
        that is the task's last one already is not appended again: it is this very event,
        whose commit's reply was lost (every event carries its time)."""
        clean = without_nul(json.dumps(redact.clean_mapping(event), default=str))
        self.db.done(
            """
            WITH n AS (
                UPDATE tasks t SET events = events + 1 WHERE id = %(task)s AND NOT EXISTS (
                    SELECT 1 FROM events e WHERE e.task = t.id AND e.n = t.events
                    AND e.event = %(event)s::jsonb
                ) RETURNING events
            ), done AS (
                INSERT INTO events (task, n, event) SELECT %(task)s, n.events, %(event)s::jsonb
                FROM n RETURNING 1
            )
            """,
            task_id,
            event=clean,
        )

    def read_events(self, task_id: str, after: Cursor = START) -> tuple[list[JSON], Cursor]:
        (events,) = self.db.row(
            "SELECT ARRAY(SELECT jsonb_build_array(n, event) FROM events WHERE task = %(task)s "
            "AND n > %(after)s ORDER BY n) FROM tasks WHERE id = %(task)s",
            task_id,
            after=after.position,
        )
        if not events:
            return [], after
        return [dict(e[1]) for e in events], Cursor(int(events[-1][0]))

    def events_end(self, task_id: str) -> Cursor:
        (count,) = self.db.row("SELECT events FROM tasks WHERE id = %(task)s", task_id)
        return Cursor(int(count))

    def publish_heartbeat(self, task_id: str, beat: JSON) -> None:
        """Replace the beat, stamped with the lease (epoch, node) the task has now."""
        self.db.done(
            """
            WITH done AS (
                INSERT INTO heartbeats (task, epoch, node, beat)
                SELECT id, epoch, coalesce(node, %(node)s), %(beat)s::jsonb FROM tasks
                WHERE id = %(task)s
                ON CONFLICT (task) DO UPDATE SET epoch = excluded.epoch, node = excluded.node,
                    beat = excluded.beat, at = now()
                RETURNING 1
            )
            """,
            task_id,
            node=self._node,
            beat=jsonb(beat),
        )

    def read_heartbeat(self, task_id: str) -> JSON | None:
        """The beat, its monotonic instants on this process's clock (``_beat_here``)."""
        seen = self._view.seen(task_id)
        if seen is not None:
            return None if seen.beat is None else _beat_here(dict(seen.beat), seen.beat_age)
        (beat, age) = self.db.row(
            "SELECT h.beat, extract(epoch FROM now() - h.at)::float8 FROM tasks t "
            "LEFT JOIN heartbeats h ON h.task = t.id WHERE t.id = %(task)s",
            task_id,
        )
        return None if beat is None else _beat_here(dict(beat), age)

    def publish_exit(self, task_id: str, outcome: Mapping[str, Any]) -> None:
        self.db.done(
            """
            WITH done AS (
                INSERT INTO exits (task, outcome) SELECT id, %(outcome)s::jsonb FROM tasks
                WHERE id = %(task)s
                ON CONFLICT (task) DO UPDATE SET outcome = excluded.outcome, at = now()
                RETURNING 1
            )
            """,
            task_id,
            outcome=jsonb(outcome),
        )

    def read_exit(self, task_id: str) -> JSON | None:
        return self._latest("exits", "outcome", task_id)

    def _latest(self, table: str, column: str, task_id: str) -> JSON | None:
        (value,) = self.db.row(
            f"SELECT (SELECT {column} FROM {table} WHERE task = %(task)s) "  # noqa: S608  (names are constants)
            "FROM tasks WHERE id = %(task)s",
            task_id,
        )
        return None if value is None else dict(value)


def _beat_here(beat: JSON, age: float | None) -> JSON:
    """A worker's beat as this process can judge it: its monotonic instants (``at_mono``,
    ``phase_started_mono``) are kept when the worker read this very clock (same boot, same
    time namespace: ``worker.identity.clock_id``); else they are put on this process's
    clock from the database's own age of the beat (its ``now()`` less when it took the
    beat: one clock's difference), never from two machines' clocks."""
    here = clock_id()
    written, started = beat.get("at_mono"), beat.get("phase_started_mono")
    if not isinstance(written, int | float) or age is None:
        return beat  # no monotonic instant to put right
    if here and beat.get("clock") == here:
        return beat
    at_mono = time.monotonic() - max(0.0, float(age))
    told = {**beat, "at_mono": at_mono}
    if isinstance(started, int | float):
        told["phase_started_mono"] = at_mono - max(0.0, float(written) - float(started))
    return told


@functools.lru_cache(maxsize=8)
def _create_sql(count: int) -> str:
    """The creation of a task row and, for a fork, its first ``count`` journal records:
    one statement, so a fork is all there or not at all."""
    task = (
        "INSERT INTO tasks (id, spec, script, record, state, seq) "
        "VALUES (%s, %s::jsonb, %s, %s::jsonb, coalesce(%s, 'queued'), %s)"
    )
    if not count:
        return task
    rows = ", ".join(f"({n}, %s::bytea)" for n in range(1, count + 1))
    return f"""
WITH made AS ({task} RETURNING id)
INSERT INTO journal (task, seq, epoch, record)
SELECT made.id, r.n, 0, r.record FROM made, (VALUES {rows}) AS r (n, record)
"""  # noqa: S608  (only placeholders are formatted in; every value is a parameter)


#: Whether the task is as a ``create`` made it, one whose commit's reply was lost.
_MADE_SO = """
SELECT 1 FROM tasks WHERE id = %(task)s AND spec = %(spec)s::jsonb
    AND record = %(record)s::jsonb AND script IS NOT DISTINCT FROM %(script)s::bytea
    AND seq = %(seq)s AND epoch = 0
"""
