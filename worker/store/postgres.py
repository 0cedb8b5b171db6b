"""The ``TaskStore`` on PostgreSQL (docs/design.md section 10): every node of a cluster shares
one database, and the conformance suite (``tests/store/``) runs on it unchanged.

The tables are ``worker.store.pgschema``'s; the fenced append and the lease renewal are
``worker.store.pglease``'s. Each method is one statement on an autocommit connection:
one transaction, one round trip, one WAL flush (``synchronous_commit`` is set on for
every connection, whatever the server's or role's default, so a returned append is on
the server's disk). How each promise of the Protocol is kept:

- ownership is the lease on the task row: ``acquire`` takes it when no lease is held, or
  one this process saw stand still for its length (``pglease.LeaseWatch``: no wall clock
  decides), and bumps the epoch; ``renew`` bumps its renewal count while the epoch is
  still the owner's, ``release`` clears it;
- an append checks the owner's epoch and the journal's seq in the statement that writes
  the records, so a moved fence writes nothing and raises ``FencedError``; snapshots are
  fenced the same way;
- decisions are exactly once by their primary key, cancels by ``cancel IS NULL``, the
  task record is a compare-and-set on its version;
- events are numbered under the task row's lock, so their order is the order of commits.

Cursors are sequence numbers (a journal ``seq``, an events ``n``). Every database fault
is a storage fault (``StorageError`` with ``EIO``), a wait for the worker and the daemon
(invariant 8), never a crash: ``database_fault`` tells one by its SQLSTATE class, not by
the driver's exception type (a read-only standby's 25006 comes as an ``InternalError``),
for every statement, listener and lock alike. A write whose reply was lost (its COMMIT
may or may not have happened) is resolved by reading back, by the fence, what it wrote:
each write below either is idempotent or, refused on a retry, looks whether the refusal
is its own earlier commit. The password in the URL is a secret: it appears in no
message and no repr. This is the one module that imports psycopg.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

import psycopg
from psycopg import errors as pgerrors
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from worker.config import ClusterConfig
from worker.errors import (
    ConfigError,
    FencedError,
    LockBusyError,
    NotFoundError,
    RecordConflictError,
    StateConflictError,
    StorageError,
    SupersededError,
)
from worker.identity import clock_id
from worker.redactor import REDACTED, redact, without_password
from worker.spool import TaskSpec, validate_call_id, validate_task_id
from worker.state import TaskState, scene_json
from worker.store import pglease, pgschema
from worker.store.base import (
    JSON,
    START,
    Cursor,
    HeldInMemory,
    NodeInfo,
    Owner,
    Seized,
    Snapshot,
    Unreadable,
    Version,
    check_journal,
    read_records,
    record_bytes,
)
from worker.store.durable import dump_json, load_json
from worker.store.journal import JOURNAL_VERSION

if TYPE_CHECKING:
    from worker.store.pgschema import Connection

#: How long an acquisition lasts without a ``renew`` (``[cluster] lease``), seconds.
DEFAULT_LEASE = ClusterConfig().lease

#: Idle connections kept for reuse; more are opened while more threads need one at once.
IDLE_CONNECTIONS = 8
#: The NOTIFY channel that wakes nodes (``SharedStore.wake``), and how often a listener
#: looks whether it is to stop.
WAKE_CHANNEL = "agentd_wake"
#: The advisory-lock key space of operator locks (``operator_lock``): "op" in ASCII.
OPERATOR_LOCKS = 0x6F70
LISTEN_POLL = 1.0

#: libpq settings a URL may give, and what they are when it does not: how long a
#: connection attempt may take, and how soon a connection whose packets vanish (a cut
#: network, a frozen server) counts as lost, so a step fails in seconds, a storage fault,
#: rather than hanging for the kernel's retransmission timeout.
CONNECTION_DEFAULTS = {
    "connect_timeout": "5",
    "tcp_user_timeout": "10000",  # milliseconds
    "keepalives_idle": "5",
    "keepalives_interval": "2",
    "keepalives_count": "3",
}


#: The password as written in a URL's user information, up to its last ``@``: what libpq
#: may quote back, or misread as a host or a port when it holds a ``/`` or a space.
_WRITTEN_PASSWORD = re.compile(r"^[a-z][a-z0-9+.-]*://[^:/@\s]*:(.*)@", re.IGNORECASE | re.DOTALL)


#: What libpq says when the server refuses the login itself (no SQLSTATE comes with it).
LOGIN_REFUSED = re.compile(
    r'password authentication failed for user "[^"]*"|no password supplied|'
    r'no pg_hba\.conf entry[^.;]*|role "[^"]*" does not exist'
)


class DatabaseFault(StrEnum):
    """Why the database refused a statement, when that is the database's to end (a wait,
    invariant 8), as ``database_fault`` reads it from the SQLSTATE."""

    LOST = "cannot be reached"  # class 08, or libpq's own failure (no SQLSTATE)
    READ_ONLY = "is read-only (a standby, or default_transaction_read_only)"  # 25006
    CONFLICT = "aborted the transaction (a serialization failure or a deadlock)"  # 40001, 40P01
    RESOURCES = "is out of resources (connections, memory or disk)"  # class 53
    SHUTDOWN = "is shutting down or restarting"  # 57P01-57P05 (57P04: the database dropped)
    LOGIN = "refused the login"  # class 28, or libpq's refusal of the password

    @property
    def connection_gone(self) -> bool:
        """Whether the connection that met it is of no more use (nor the idle ones)."""
        return self in (DatabaseFault.LOST, DatabaseFault.SHUTDOWN, DatabaseFault.LOGIN)


#: The SQLSTATEs that are faults, by their exact code or their two-character class.
_FAULT_STATES = {
    "25006": DatabaseFault.READ_ONLY,
    "40001": DatabaseFault.CONFLICT,
    "40P01": DatabaseFault.CONFLICT,
}
_FAULT_CLASSES = {
    "08": DatabaseFault.LOST,
    "28": DatabaseFault.LOGIN,
    "53": DatabaseFault.RESOURCES,
}


#: What a refused connection's FATAL line says, for the faults it can be.
_CONNECT_REFUSALS = (
    (LOGIN_REFUSED, DatabaseFault.LOGIN),
    (re.compile(r"too many connections|remaining connection slots"), DatabaseFault.RESOURCES),
    (
        re.compile(r"the database system is (starting up|shutting down|in recovery)"),
        DatabaseFault.SHUTDOWN,
    ),
)


def database_fault(exc: BaseException) -> DatabaseFault | None:
    """The fault ``exc`` (a driver error) is, or None when it is not one: a constraint, a
    statement of ours the server refused (a bug, raised as it is). The one classifier of
    the store: by SQLSTATE, since the driver's exception types do not follow it."""
    if not isinstance(exc, psycopg.Error):
        return None
    state = exc.sqlstate
    if state is None:  # libpq's own: a connection that failed or broke (no SQLSTATE comes
        # with a refused connection: the server's FATAL line is all it says)
        for words, fault in _CONNECT_REFUSALS:
            if words.search(str(exc)):
                return fault
        lost = isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError)
        return DatabaseFault.LOST if lost else None
    if state.startswith("57P"):
        return DatabaseFault.SHUTDOWN
    return _FAULT_STATES.get(state) or _FAULT_CLASSES.get(state[:2])


#: A NUL character in a JSON string (after an even run of backslashes): jsonb refuses it.
_NUL = re.compile(r"(?<!\\)((?:\\\\)*)\\u0000")


#: The API tokens, each with its columns in the order ``_token`` reads them.
_SELECT_TOKENS = (
    "SELECT id, digest, by_user, to_char(created_at AT TIME ZONE 'UTC', "
    '\'YYYY-MM-DD"T"HH24:MI:SS.MS"Z"\') FROM console_tokens'
)


def _token(row: tuple[Any, ...]) -> JSON:
    token_id, digest, by, created_at = row
    return {"id": token_id, "digest": digest, "by": by, "created_at": created_at}


def _jsonb(value: Mapping[str, Any]) -> str:
    """``value`` as the text of a jsonb parameter (the statements cast it)."""
    return _without_nul(dump_json(value).decode())


def _without_nul(text: str) -> str:
    """JSON ``text`` that jsonb takes: jsonb cannot hold NUL, which a tool's output may
    carry into an event, so it becomes U+FFFD, as an undecodable byte does. (Journal
    records are bytea, kept byte for byte.)"""
    return _NUL.sub(r"\1\\ufffd", text)


class _Database:
    """The connections of one store to one database, and the one place that turns a
    driver error into the repo's: ``step`` lends an autocommit connection for one
    statement, opening one when none is idle (so threads step in parallel), and drops a
    connection that failed, so the next step reconnects by itself once the database is
    back."""

    def __init__(self, url: str, application: str) -> None:
        bad_url = ConfigError(  # never with the driver's words: they quote the password
            "the store URL cannot be parsed; write it as "
            "postgresql://USER:PASSWORD@HOST:PORT/DATABASE, with the password's special "
            "characters (such as / @ : % and spaces) percent-encoded, or leave the password "
            "out of the URL and give it by PGPASSFILE or PGPASSWORD."
        )
        try:
            params = conninfo_to_dict(url)
        except psycopg.ProgrammingError:
            raise bad_url from None
        written = _WRITTEN_PASSWORD.match(url)
        if written and unquote(written.group(1)) != params.get("password"):
            raise bad_url  # libpq read the password as something else: a host, a port...
        self._application = application
        given = {"application_name": application, **CONNECTION_DEFAULTS}
        self._conninfo = make_conninfo(url, **{k: v for k, v in given.items() if k not in params})
        self._secret = str(params.get("password") or "")
        shown = {k: str(v) for k, v in params.items() if k in ("host", "port", "dbname", "user")}
        self.shown = make_conninfo(**shown) or "the default database"  # no password in it
        self._idle: list[Connection] = []
        self._guard = threading.Lock()

    def scrub(self, text: str) -> str:
        """``text`` without the password (a driver's message may quote the URL)."""
        text = text.replace(self._secret, REDACTED) if self._secret else text
        return redact.clean_text(without_password(text))

    def relogin(self, url: str) -> None:
        """Use ``url``'s login from the next connection on (SIGHUP read the store's URL
        again: a password changed). The address is this store's still."""
        fresh = _Database(url, self._application)
        self._conninfo, self._secret, self.shown = fresh._conninfo, fresh._secret, fresh.shown
        self.close()  # the idle ones logged in with the old password

    def fault(self, exc: BaseException) -> StorageError | None:
        """``exc`` as the storage fault it is (``database_fault``), saying which, or None."""
        fault = database_fault(exc)
        if fault is None:
            return None
        return StorageError(
            f"the PostgreSQL store ({self.shown}) {fault.value}: "
            f"{self.scrub(str(exc)).strip()}. The worker waits, and goes on from what the "
            "database recorded once it is back.",
            errno.EIO,
            cause=fault.name.lower(),
        )

    @contextlib.contextmanager
    def faults(self) -> Iterator[None]:
        """Within the block, a driver error that is a fault is raised as its
        ``StorageError``; any other as it is."""
        try:
            yield
        except psycopg.Error as exc:
            fault = self.fault(exc)
            if fault is None:
                raise
            raise fault from None

    def connect(self) -> Connection:
        """A new autocommit connection of the caller's own (a listener's, a lock's): its
        statements go through ``faults`` too."""
        with self.faults():
            return psycopg.connect(self._conninfo, autocommit=True)

    def _connect(self) -> Connection:
        conn = psycopg.connect(self._conninfo, autocommit=True)
        conn.execute("SET synchronous_commit = on")
        return conn

    @contextlib.contextmanager
    def step(self) -> Iterator[Connection]:
        with self._guard:
            conn = self._idle.pop() if self._idle else None
        try:
            if conn is None:
                conn = self._connect()
            yield conn
        except psycopg.Error as exc:
            kind = database_fault(exc)
            gone = kind is not None and kind.connection_gone
            if conn is not None and (gone or conn.broken or conn.closed):
                conn.close()
            elif conn is not None:
                self._give_back(conn)  # autocommit: a failed statement leaves it idle
            if gone:
                self.close()  # the idle ones went the same way (a restarted server, a cut link)
            fault = self.fault(exc)
            if fault is None:
                raise
            raise fault from None
        except BaseException:
            if conn is not None:
                self._give_back(conn)
            raise
        else:
            self._give_back(conn)

    def _give_back(self, conn: Connection) -> None:
        with self._guard:
            if not conn.closed and len(self._idle) < IDLE_CONNECTIONS:
                self._idle.append(conn)
                return
        conn.close()

    def close(self) -> None:
        with self._guard:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


class PostgresJournal(HeldInMemory):
    """A ``JournalWriter`` on a ``PostgresStore``: its cursor is the seq of the last
    record it wrote, and every append is one fenced statement (``pglease.append``)."""

    def __init__(self, store: PostgresStore, owner: Owner, seq: int, sizes: Sequence[int]) -> None:
        self._store = store
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
        before = self._store.volume_between(self._owner.task_id, cursor.position, self._base)
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
            with self._store.db.step() as conn:
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
        self._store.check_fence(self._owner)
        self._held += [record_bytes(r) for r in records]


class PostgresStore:
    """The ``TaskStore`` in one PostgreSQL database (the schema of the URL's search_path).

    ``node`` names this node in leases and messages (default: the hostname); ``lease`` is
    how long, in seconds, an acquisition lasts without a ``renew``. ``migrate`` creates or
    upgrades the schema (``agentd start``, ``agentd store init``); without it a database
    this release cannot use is refused at once (``SchemaVersionError``). A login the
    server refuses is ``ConfigError`` (exit 78), or with ``waits`` (a running node's
    worker) the ``StorageError`` every unreachable store is."""

    def __init__(
        self,
        url: str,
        *,
        node: str | None = None,
        lease: float = DEFAULT_LEASE,
        migrate: bool = False,
        waits: bool = False,
    ) -> None:
        self.node = node or socket.gethostname()
        self.db = _Database(url, application=f"agentd {self.node}")
        self.lease = lease
        # this process's registration as the node (``join``): (epoch, pid, host, workers)
        self._registration: tuple[int, int, str, int] | None = None
        self._reading = threading.local()  # a view of every task, while ``read_all`` lasts
        # how long each held lease has stood still, as this process has seen it: the
        # one judge of a lease's end (claims, acquisitions, an operator's seizure)
        self._watch = pglease.LeaseWatch(gap=lease / 2)
        self._watch_guard = threading.Lock()
        self._lost_replies: set[tuple[str, str, int]] = set()  # (``_unsure``)
        try:
            with self.db.step() as conn:
                if migrate:
                    pgschema.migrate(conn)
                else:
                    pgschema.check(conn)
        except StorageError as exc:
            # a login refused when a command or the daemon opens the store is a setting
            # to fix (exit 78, so systemd does not restart it every two seconds); once the
            # node runs (``waits``: its workers), it is the database's to end: a wait
            refused = LOGIN_REFUSED.search(str(exc))
            if exc.cause != DatabaseFault.LOGIN.name.lower() or waits:
                raise
            why = refused.group(0) if refused else "authentication failed"
            raise ConfigError(
                f"the PostgreSQL store ({self.db.shown}) refused the login: "
                f"{why}; fix the user or password of the store URL (--store, "
                "AGENTD_STORE, AGENTD_STORE_FILE, or PGPASSFILE) and start again."
            ) from None

    def __repr__(self) -> str:
        return f"PostgresStore({self.db.shown!r}, node={self.node!r})"

    def close(self) -> None:
        """Close the idle connections (the store reconnects if it is used again)."""
        self.db.close()

    def _one(self, sql: str, params: Mapping[str, Any]) -> tuple[Any, ...] | None:
        with self.db.step() as conn:
            return conn.execute(sql, params).fetchone()

    def _row(self, sql: str, task_id: str, **params: Any) -> tuple[Any, ...]:
        """The one row ``sql`` returns for the task, or ``NotFoundError``."""
        row = self._one(sql, {"task": validate_task_id(task_id), **params})
        if row is None:
            raise NotFoundError(f"no task {task_id!r} in this store; create it first.")
        return row

    def _done(self, sql: str, task_id: str, **params: Any) -> bool:
        """Run a write ``sql`` that has a ``done`` CTE (its RETURNING): whether it wrote,
        and ``NotFoundError`` when the task does not exist. One statement, one trip."""
        found = sql + _WROTE_AND_FOUND
        wrote, exists = self._row(found, task_id, **params)
        if not exists:
            raise NotFoundError(f"no task {task_id!r} in this store; create it first.")
        return bool(wrote)

    def _fenced_refusal(self, owner: Owner) -> FencedError:
        return FencedError(
            f"task {owner.task_id} is no longer owned by {owner.holder} (epoch "
            f"{owner.epoch}); its worker stops, and the task's new owner carries on."
        )

    def check_fence(self, owner: Owner) -> None:
        """``FencedError`` unless ``owner``'s epoch is still the task's (a read: no WAL)."""
        (epoch,) = self._row("SELECT epoch FROM tasks WHERE id = %(task)s", owner.task_id)
        if epoch != owner.epoch:
            raise self._fenced_refusal(owner)

    def volume_between(self, task_id: str, after: int, upto: int) -> int:
        """Bytes of the journal records after seq ``after`` up to seq ``upto``."""
        row = self._one(
            "SELECT coalesce(sum(octet_length(record)), 0) FROM journal "
            "WHERE task = %(task)s AND seq > %(after)s AND seq <= %(upto)s",
            {"task": validate_task_id(task_id), "after": after, "upto": upto},
        )
        return int(row[0]) if row else 0

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
        """One transaction makes the task; ``prepare`` runs before it, so a failed
        ``prepare`` leaves no task (and a refused insert leaves what it made)."""
        validate_task_id(spec.id)
        header = {"k": "header", "v": JOURNAL_VERSION, "task": spec.id}
        items = [record_bytes(header), *(record_bytes(r) for r in journal)] if journal else []
        params: list[Any] = [spec.id, _jsonb(spec.to_json()), script, _jsonb(record)]
        params += [_state_of(record), len(items), *items]
        sql = _create_sql(len(items))
        if prepare is not None:
            prepare(None)
        try:
            with self.db.step() as conn:
                conn.execute(sql, params)
        except pgerrors.UniqueViolation:
            if self._one(
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

    # -- one read of every task (status) -----------------------------------------------

    @contextlib.contextmanager
    def read_all(self) -> Iterator[None]:
        """For the block, this thread's reads of what status shows of a task (its spec,
        record, heartbeat, snapshot and the journal after it) are answered from ONE
        statement made first: the whole cluster in one round trip, not six a task. The
        view is of the moment it was read; writes, and reads of anything else, go to the
        database as ever."""
        with self.db.step() as conn:
            rows = conn.execute(_READ_ALL).fetchall()
        self._reading.view = {row[0]: _Seen(*row[1:]) for row in rows}
        try:
            yield
        finally:
            self._reading.view = None

    def _seen(self, task_id: str) -> _Seen | None:
        view: dict[str, _Seen] | None = getattr(self._reading, "view", None)
        return None if view is None else view.get(task_id)

    def task_ids(self) -> list[str]:
        view: dict[str, _Seen] | None = getattr(self._reading, "view", None)
        if view is not None:
            return sorted(view)
        with self.db.step() as conn:
            return sorted(row[0] for row in conn.execute("SELECT id FROM tasks"))

    def rest_mark(self, task_id: str, now_ns: int | None = None) -> tuple[int, ...] | None:
        return None  # (no cheap mark: a rescan reads the task)

    def exists(self, task_id: str) -> bool:
        if self._seen(task_id) is not None:
            return True
        row = self._one(
            "SELECT EXISTS (SELECT 1 FROM tasks WHERE id = %(task)s)",
            {"task": validate_task_id(task_id)},
        )
        return bool(row and row[0])

    def load_spec(self, task_id: str) -> TaskSpec:
        seen = self._seen(task_id)
        if seen is not None:
            spec = seen.spec
        else:
            (spec,) = self._row("SELECT spec FROM tasks WHERE id = %(task)s", task_id)
        return TaskSpec.from_json(spec, where=f"task {task_id}'s spec in the database")

    def load_script(self, task_id: str) -> bytes:
        (script,) = self._row("SELECT script FROM tasks WHERE id = %(task)s", task_id)
        if script is None:
            raise FileNotFoundError(f"task {task_id} has no script")
        return bytes(script)

    # -- ownership --------------------------------------------------------------------

    def acquire(self, task_id: str, *, wait: float = 0.0) -> Owner:
        """Take the lease when none is held, or when its holder let it stand still for its
        length and the margin as this process watched it (so a wait shorter than that never
        takes a held one), bumping the epoch (which fences every earlier owner); poll until
        ``wait`` runs out."""
        deadline = time.monotonic() + wait
        while True:
            owner, held = self._take(task_id, self._expired_one(task_id))
            if owner is not None:
                return owner
            if time.monotonic() >= deadline:
                raise LockBusyError(
                    f"task {task_id} is owned by {held.node if held else None}; another "
                    "worker is running this task. Wait for it to exit or stop it first."
                )
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))

    def _expired_one(self, task_id: str, after: float | None = None) -> pglease.Held | None:
        """The task's lease as this process last saw it, if it has stood still for
        ``after`` seconds (default: its holder's lease and the margin)."""
        with self._watch_guard:
            still = self._watch.still(task_id)
        if still is None:
            return None
        held, seconds = still
        limit = after if after is not None else (held.lease or self.lease) + pglease.TAKEOVER_MARGIN
        return held if seconds >= limit else None

    def _take(
        self, task_id: str, stale: pglease.Held | None
    ) -> tuple[Owner | None, pglease.Held | None]:
        """One try at the task's lease: taken when free, or when it still stands as
        ``stale`` (a compare-and-set on the epoch and the count). Else the lease as it is
        now, watched (``_watch``)."""
        row = self._row(
            """
            WITH done AS (
                UPDATE tasks SET epoch = epoch + 1, node = %(node)s, updated_at = now(),
                    renewals = renewals + 1, lease_seconds = %(lease)s,
                    lease_expires = now() + make_interval(secs => %(lease)s)
                WHERE id = %(task)s AND (lease_expires IS NULL
                    OR (epoch = %(epoch)s AND renewals = %(renewals)s))
                RETURNING epoch
            )
            SELECT (SELECT epoch FROM done), node, epoch, renewals, lease_seconds,
                lease_expires IS NOT NULL FROM tasks WHERE id = %(task)s
            """,
            task_id,
            node=self.node,
            lease=self.lease,
            epoch=stale.epoch if stale is not None else -1,
            renewals=stale.renewals if stale is not None else -1,
        )
        taken, node, epoch, renewals, length, held = row
        if taken is not None:
            with self._watch_guard:
                self._watch.note(None, task_id)
            return Owner(task_id, self.node, int(taken)), None
        lease = None
        if held:
            lease = pglease.Held(task_id, str(node), int(epoch), int(renewals), length)
        with self._watch_guard:
            self._watch.note(lease, task_id)
        return None, lease

    def seize(self, task_id: str) -> Seized | None:
        """For an operator's command: take the task's lease when none is held, or from a
        holder that has not renewed it for ``pglease.STALLED`` of its length as this
        process watched it (a frozen or cut-off node); None while it is renewed, or
        watched for less. The new epoch fences the holder at once; a tool of its may
        still run until the holder's own lease ends, at the latest ``ends_in`` seconds
        from now (the renewal it last saw was sent before it saw it)."""
        with self._watch_guard:
            still = self._watch.still(task_id)
        stale, seconds = None, 0.0
        if still is not None:
            length = still[0].lease or self.lease
            if still[1] >= pglease.STALLED * length:
                stale, seconds = still
        owner, _ = self._take(task_id, stale)
        if owner is None:
            return None
        if stale is None:
            return Seized(owner, None, 0, 0.0)
        ends_in = max(0.0, (stale.lease or self.lease) - seconds)
        return Seized(owner, stale.node, stale.epoch, ends_in)

    def renew(self, owner: Owner) -> None:
        lease = pglease.Lease(owner.task_id, self.node, owner.epoch, 0, _NEVER)
        with self.db.step() as conn:
            pglease.renew(conn, lease, self.lease)

    def release(self, owner: Owner) -> None:
        """Clear the lease, if it is still ``owner``'s (a stale release takes nothing), and
        move the epoch on: the released owner is fenced at once, not when a node next
        claims the task."""
        self._done(
            "WITH done AS (UPDATE tasks SET lease_expires = NULL, epoch = epoch + 1, "
            "updated_at = now() "
            "WHERE id = %(task)s AND epoch = %(epoch)s RETURNING 1)",
            owner.task_id,
            epoch=owner.epoch,
        )

    def owned(self, task_id: str) -> bool:
        """Whether a lease is held: until its holder releases it or another takes it over
        (no clock says it ended: ``pglease``)."""
        (held,) = self._row(
            "SELECT lease_expires IS NOT NULL FROM tasks WHERE id = %(task)s", task_id
        )
        return bool(held)

    def owner_pid(self, task_id: str) -> int | None:
        """None: a lease names the node that holds it, not a process."""
        validate_task_id(task_id)
        return None

    # -- the cluster (``SharedStore``) -------------------------------------------------

    def claim(
        self, limit: int, *, exclude: Sequence[str] = (), expired: bool = True
    ) -> list[Owner]:
        mine = self._registration
        registered = (mine[0], mine[1]) if mine is not None else None
        try:
            with self._watch_guard, self.db.step() as conn:
                leases = pglease.claim(
                    conn,
                    self.node,
                    limit,
                    self.lease,
                    exclude,
                    watch=self._watch,
                    expired=expired,
                    registered=registered,
                )
        except StorageError:
            with self._watch_guard:  # nobody could renew meanwhile: that time does not count
                self._watch.blind()
            raise
        return [Owner(x.task_id, self.node, x.epoch, previous=x.previous) for x in leases]

    @contextlib.contextmanager
    def _unsure(self, what: str, owner: Owner) -> Iterator[bool]:
        """A fenced write of ``owner``'s that moves its epoch: yields whether the last try
        of it lost its reply (the fence then refuses its retry: read back whether the
        refusal is that try's own commit). Only then: a stale owner's second try is no
        retry, and is refused."""
        key = (what, owner.task_id, owner.epoch)
        unsure = key in self._lost_replies
        try:
            yield unsure
        except StorageError as exc:
            if exc.cause in (DatabaseFault.LOST.name.lower(), DatabaseFault.SHUTDOWN.name.lower()):
                self._lost_replies.add(key)
            raise
        self._lost_replies.discard(key)

    def handover(self, owner: Owner) -> Owner:
        """A new epoch for the same node; refused (``FencedError``) once the task or the
        node's registration moved."""
        mine = self._registration
        with self._unsure("handover", owner) as unsure:
            row = self._one(
                "UPDATE tasks SET epoch = epoch + 1, updated_at = now(), "
                "renewals = renewals + 1, lease_seconds = %(lease)s, "
                "lease_expires = now() + make_interval(secs => %(lease)s) "
                "WHERE id = %(task)s AND epoch = %(epoch)s AND (%(registered)s::bigint IS NULL "
                "OR EXISTS (SELECT 1 FROM nodes WHERE name = %(node)s AND epoch = %(registered)s "
                "AND pid = %(pid)s)) RETURNING epoch",
                {
                    "task": owner.task_id,
                    "epoch": owner.epoch,
                    "lease": self.lease,
                    "node": self.node,
                    "registered": mine[0] if mine is not None else None,
                    "pid": mine[1] if mine is not None else 0,
                },
            )
        if row is None and unsure:
            row = self._one(  # this handover's own commit, whose reply was lost?
                "SELECT epoch FROM tasks WHERE id = %(task)s AND epoch = %(epoch)s + 1 "
                "AND node = %(node)s AND lease_expires IS NOT NULL",
                {"task": owner.task_id, "epoch": owner.epoch, "node": self.node},
            )
        if row is None:
            raise self._fenced_refusal(owner)
        return Owner(owner.task_id, self.node, int(row[0]))

    def renew_all(self, owners: Sequence[Owner]) -> list[Owner]:
        if self._registration is not None:
            return self._renew_node(owners, self._registration)
        if not owners:
            return []
        with self.db.step() as conn:
            kept = {
                (task, epoch)
                for task, epoch in conn.execute(
                    "UPDATE tasks AS t SET lease_expires = now() + make_interval(secs => %s), "
                    "renewals = t.renewals + 1 "
                    "FROM unnest(%s::text[], %s::bigint[]) AS o (id, epoch) "
                    "WHERE t.id = o.id AND t.epoch = o.epoch RETURNING t.id, t.epoch",
                    (self.lease, [o.task_id for o in owners], [o.epoch for o in owners]),
                )
            }
        return [o for o in owners if (o.task_id, o.epoch) not in kept]

    def _renew_node(
        self, owners: Sequence[Owner], registration: tuple[int, int, str, int]
    ) -> list[Owner]:
        """The node's renewal and its leases', in one statement: the leases are renewed
        only while the node's registration is still this process's."""
        epoch, pid, host, workers = registration
        with self.db.step() as conn:
            row = conn.execute(
                _RENEW_NODE,
                {
                    "node": self.node,
                    "epoch": epoch,
                    "pid": pid,
                    "host": host,
                    "workers": workers,
                    "lease": self.lease,
                    "ids": [o.task_id for o in owners],
                    "epochs": [o.epoch for o in owners],
                },
            ).fetchone()
        renewed, now_epoch, now_pid, now_host, ids, epochs = row  # type: ignore[misc]  # (one row: the LEFT JOIN)
        if not renewed:
            now = None if now_epoch is None else (int(now_epoch), int(now_pid), str(now_host))
            holder = (
                f"registered again by pid {now[1]} on {now[2]} (epoch {now[0]})"
                if now is not None
                else "no longer registered"
            )
            raise SupersededError(
                f"node {self.node!r} was {holder} since this daemon registered it (epoch "
                f"{epoch}); its workers stop, and it registers again once the name is free.",
                epoch,
                now,
            )
        kept = set(zip(ids, epochs, strict=True))
        return [o for o in owners if (o.task_id, o.epoch) not in kept]

    def put_record(
        self, owner: Owner, record: JSON, *, release: bool, runnable_in: float = 0.0
    ) -> None:
        with self._unsure("release", owner) as unsure:
            wrote = self._done(
                """
                WITH done AS (
                    UPDATE tasks SET record = %(record)s::jsonb, version = version + 1,
                        state = coalesce(%(state)s, state), updated_at = now(),
                        lease_expires = CASE WHEN %(release)s THEN NULL ELSE lease_expires END,
                        epoch = CASE WHEN %(release)s THEN epoch + 1 ELSE epoch END,
                        runnable_at = CASE WHEN %(release)s
                            THEN now() + make_interval(secs => %(delay)s) ELSE runnable_at END
                    WHERE id = %(task)s AND epoch = %(epoch)s
                    RETURNING 1
                )
                """,
                owner.task_id,
                record=_jsonb(record),
                state=_state_of(record),
                release=release,
                delay=max(0.0, runnable_in),
                epoch=owner.epoch,
            )
        if not wrote and not (release and unsure and self._released_so(owner, record)):
            raise self._fenced_refusal(owner)

    def _released_so(self, owner: Owner, record: JSON) -> bool:
        """Whether the task is as ``owner``'s release of it with ``record`` left it: that
        release's commit, whose reply was lost (a claim since would have moved the epoch
        again, and changed the node or the record)."""
        return bool(
            self._one(
                "SELECT 1 FROM tasks WHERE id = %(task)s AND epoch = %(epoch)s + 1 "
                "AND node = %(node)s AND lease_expires IS NULL AND record = %(record)s::jsonb",
                {
                    "task": owner.task_id,
                    "epoch": owner.epoch,
                    "node": self.node,
                    "record": _jsonb(record),
                },
            )
        )

    def orphans(self) -> list[tuple[Owner, JSON]]:
        """The leases held under this node's name on running tasks, each with its
        worker's latest beat: what a daemon started again on this node may adopt."""
        with self.db.step() as conn:
            rows = conn.execute(
                "SELECT t.id, t.epoch, h.beat FROM tasks t JOIN heartbeats h ON h.task = t.id "
                "WHERE t.node = %s AND t.lease_expires IS NOT NULL AND t.state = 'running' "
                "ORDER BY t.id",
                (self.node,),
            ).fetchall()
        return [(Owner(task, self.node, int(epoch)), dict(beat)) for task, epoch, beat in rows]

    def leases(self) -> dict[str, str]:
        with self.db.step() as conn:
            rows = conn.execute("SELECT id, node FROM tasks WHERE lease_expires IS NOT NULL")
            return {task: node for task, node in rows}

    def join(self, max_workers: int) -> int:
        """Register this process as the node, under the name's next epoch; a live daemon
        of another process that holds the name refuses it (``ConfigError``), and so does
        another registration of this one's (``SupersededError``'s: one that came after)."""
        host, pid = socket.gethostname(), os.getpid()
        mine = self._registration[0] if self._registration is not None else None
        with self.db.step() as conn:
            other = conn.execute(
                "SELECT host, pid FROM nodes WHERE name = %s AND seen_at > now() - "
                "make_interval(secs => %s) AND CASE WHEN %s::bigint IS NULL THEN "
                "(host, pid) <> (%s, %s) ELSE (host, pid, epoch) <> (%s, %s, %s) END",
                (self.node, self.lease, mine, host, pid, host, pid, mine),
            ).fetchone()
            if other is not None and not (other[0] == host and not _pid_alive(int(other[1]))):
                # (a row of this host whose process is gone: this node's last life, which
                # crashed; a service manager restarts it at once, before a lease is over)
                raise ConfigError(
                    f"node name {self.node!r} is in use by a live node (pid {other[1]} on "
                    f"{other[0]}); give this node another name with --node or `node`."
                )
            epoch = conn.execute(
                "INSERT INTO nodes (name, host, pid, max_workers, schema_version, epoch) "
                "VALUES (%s, %s, %s, %s, %s, 1) ON CONFLICT (name) DO UPDATE SET "
                "host = excluded.host, pid = excluded.pid, max_workers = excluded.max_workers, "
                "schema_version = excluded.schema_version, seen_at = now(), "
                "epoch = nodes.epoch + 1, "
                "started_at = CASE WHEN (nodes.host, nodes.pid) = (excluded.host, excluded.pid) "
                "THEN nodes.started_at ELSE now() END RETURNING epoch",
                (self.node, host, pid, max_workers, pgschema.SCHEMA_VERSION),
            ).fetchone()[0]  # type: ignore[index]  # (an upsert returns its row)
        self._registration = (int(epoch), pid, host, max_workers)
        return int(epoch)

    def leave(self) -> None:
        """The name is free: its row stays (pid 0, never seen), so that the next daemon to
        register it takes the next epoch, never one a frozen daemon may still hold."""
        self._registration = None
        with self.db.step() as conn:
            conn.execute(
                "UPDATE nodes SET pid = 0, seen_at = '-infinity' "
                "WHERE name = %s AND (host, pid) = (%s, %s)",
                (self.node, socket.gethostname(), os.getpid()),
            )

    def relogin(self, url: str) -> None:
        self.db.relogin(url)

    # -- the console's API tokens ------------------------------------------------------

    def add_token(self, token: JSON) -> None:
        try:
            with self.db.step() as conn:
                conn.execute(
                    "INSERT INTO console_tokens (id, digest, by_user, created_at) "
                    "VALUES (%(id)s, %(digest)s, %(by)s, %(created_at)s)",
                    {k: token[k] for k in ("id", "digest", "by", "created_at")},
                )
        except pgerrors.UniqueViolation:
            raise RecordConflictError(f"an API token {token['id']} exists already") from None

    def tokens(self) -> list[JSON]:
        with self.db.step() as conn:
            rows = conn.execute(_SELECT_TOKENS + " ORDER BY created_at, id").fetchall()
        return [_token(row) for row in rows]

    def token(self, digest: str) -> JSON | None:
        row = self._one(
            _SELECT_TOKENS + " WHERE digest = %(digest)s",
            {"digest": digest},
        )
        return _token(row) if row is not None else None

    def revoke_token(self, token_id: str) -> bool:
        row = self._one(
            "DELETE FROM console_tokens WHERE id = %(id)s RETURNING 1", {"id": token_id}
        )
        return row is not None

    def nodes(self) -> list[NodeInfo]:
        with self.db.step() as conn:
            rows = conn.execute(
                "SELECT n.name, n.host, n.pid, n.max_workers, "
                "extract(epoch FROM now() - n.seen_at)::float8, "
                "(SELECT count(*) FROM tasks t "
                "WHERE t.node = n.name AND t.lease_expires IS NOT NULL), "
                "n.epoch FROM nodes n WHERE n.pid > 0 ORDER BY n.name"
            ).fetchall()
        return [
            NodeInfo(
                name, host, pid, workers, int(tasks), max(0.0, age), age <= self.lease, int(epoch)
            )
            for name, host, pid, workers, age, tasks, epoch in rows
        ]

    @contextlib.contextmanager
    def operator_lock(self, task_id: str, wait: float) -> Iterator[None]:
        """A session advisory lock on a connection of its own: closing it (a killed
        command's too, once the server sees it gone) releases the lock."""
        key = validate_task_id(task_id)
        conn = self.db.connect()
        try:
            deadline = time.monotonic() + wait
            while True:
                with self.db.faults():
                    row = conn.execute(
                        "SELECT pg_try_advisory_lock(%s, hashtext(%s))", (OPERATOR_LOCKS, key)
                    ).fetchone()
                if row is not None and row[0]:
                    break
                if time.monotonic() >= deadline:
                    raise LockBusyError(f"another command holds task {task_id}'s operator lock")
                time.sleep(0.05)
            yield
        finally:
            conn.close()

    def request_pause(self, task_id: str, seconds: float) -> None:
        self._row(
            "UPDATE tasks SET paused_until = now() + make_interval(secs => %(secs)s) "
            "WHERE id = %(task)s RETURNING 1",
            task_id,
            secs=seconds,
        )

    def end_pause(self, task_id: str) -> None:
        self._row("UPDATE tasks SET paused_until = NULL WHERE id = %(task)s RETURNING 1", task_id)

    def pause_requested(self, task_id: str) -> bool:
        (paused,) = self._row(
            "SELECT coalesce(paused_until > now(), false) FROM tasks WHERE id = %(task)s", task_id
        )
        return bool(paused)

    def wake(self, task_id: str) -> None:
        with self.db.step() as conn:
            conn.execute("SELECT pg_notify(%s, %s)", (WAKE_CHANNEL, validate_task_id(task_id)))

    def listen(self, on_wake: Callable[[], None]) -> Callable[[], None]:
        stop = threading.Event()
        thread = threading.Thread(
            target=self._listen, args=(on_wake, stop), name="agentd-listen", daemon=True
        )
        thread.start()
        return stop.set

    def _listen(self, on_wake: Callable[[], None], stop: threading.Event) -> None:
        """LISTEN on a connection of its own; a lost one is made again a second later, and
        wakes the node once (what it missed meanwhile is the poll's, as always)."""
        while not stop.is_set():
            try:
                with self.db.connect() as conn, self.db.faults():
                    conn.execute(f"LISTEN {WAKE_CHANNEL}")
                    on_wake()
                    while not stop.is_set():
                        for _ in conn.notifies(timeout=LISTEN_POLL):
                            on_wake()
            except StorageError:
                stop.wait(1.0)

    # -- the journal ------------------------------------------------------------------

    _RECORDS = """
    SELECT epoch, seq, ARRAY(
        SELECT record FROM journal WHERE task = %(task)s AND seq > %(after)s ORDER BY seq
    ) FROM tasks WHERE id = %(task)s
    """

    def _records(self, task_id: str, after: Cursor) -> tuple[int, int, list[bytes]]:
        epoch, seq, records = self._row(self._RECORDS, task_id, after=after.position)
        found = [bytes(r) for r in records]
        _check_rows(task_id, int(seq), after.position, found)
        return int(epoch), int(seq), found

    def open_journal(
        self, owner: Owner, *, after: Cursor = START, header: Mapping[str, Any] | None = None
    ) -> tuple[PostgresJournal, list[JSON]]:
        epoch, seq, records = self._records(owner.task_id, after)
        if epoch != owner.epoch:
            raise self._fenced_refusal(owner)
        writer = PostgresJournal(self, owner, seq, [len(r) for r in records])
        if seq == 0:
            first = {"k": "header", "v": JOURNAL_VERSION, **(header or {})}
            writer.append([first])
            return writer, [first]
        return writer, read_records(_journal_name(owner.task_id), records, after.position + 1)

    def replay(self, task_id: str, after: Cursor = START) -> list[JSON]:
        seen = self._seen(task_id)
        if seen is not None and seen.records is not None and after.position == seen.after:
            _check_rows(task_id, seen.seq, seen.after, seen.records)
            return read_records(_journal_name(task_id), seen.records, seen.after + 1)
        _, seq, records = self._records(task_id, after)
        return read_records(_journal_name(task_id), records, after.position + 1) if seq else []

    def journal_end(self, task_id: str) -> Cursor:
        (seq,) = self._row("SELECT seq FROM tasks WHERE id = %(task)s", task_id)
        return Cursor(int(seq))

    # -- snapshots --------------------------------------------------------------------

    def get_snapshot(self, task_id: str) -> Snapshot | None:
        seen = self._seen(task_id)
        row = (
            (seen.snapshot,)
            if seen is not None
            else self._one(
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
        wrote = self._done(
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
            raise self._fenced_refusal(owner)
        return len(data)

    # -- operator decisions and the cancel ----------------------------------------------

    def record_decision(self, task_id: str, key: str, attempt: int, decision: JSON) -> bool:
        """One winner by the primary key (task, key, attempt): the losers' inserts find
        the row there and do nothing."""
        params = {"key": validate_call_id(key), "attempt": attempt, "decision": _jsonb(decision)}
        won = self._done(
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
        return won or self._done(  # the winner is this very decision (a lost reply)?
            "WITH done AS (SELECT 1 FROM decisions WHERE task = %(task)s AND key = %(key)s "
            "AND attempt = %(attempt)s AND decision = %(decision)s::jsonb)",
            task_id,
            **params,
        )

    def read_decision(self, task_id: str, key: str, attempt: int) -> JSON | None:
        validate_call_id(key)
        (decision,) = self._row(
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
        return self._done(
            "WITH asked AS (UPDATE tasks SET cancel = %(stamp)s::jsonb, updated_at = now() "
            "WHERE id = %(task)s AND cancel IS NULL RETURNING 1), "
            "done AS (SELECT 1 FROM asked UNION ALL "
            "SELECT 1 FROM tasks WHERE id = %(task)s AND cancel = %(stamp)s::jsonb)",
            task_id,
            stamp=_jsonb(stamp),
        )

    def cancel_requested(self, task_id: str) -> bool:
        (asked,) = self._row("SELECT cancel IS NOT NULL FROM tasks WHERE id = %(task)s", task_id)
        return bool(asked)

    def read_cancel(self, task_id: str) -> JSON | None:
        (stamp,) = self._row("SELECT cancel FROM tasks WHERE id = %(task)s", task_id)
        return stamp if isinstance(stamp, dict) or stamp is None else {}

    def withdraw_cancel(self, task_id: str) -> None:
        self._done(
            "WITH done AS (UPDATE tasks SET cancel = NULL WHERE id = %(task)s RETURNING 1)",
            task_id,
        )

    # -- the task record --------------------------------------------------------------

    def get_record(self, task_id: str) -> tuple[JSON | None, Version]:
        seen = self._seen(task_id)
        if seen is not None:
            record, version = seen.record, seen.version
        else:
            record, version = self._row(
                "SELECT record, version FROM tasks WHERE id = %(task)s", task_id
            )
        if not isinstance(record, dict):
            raise ValueError(f"task {task_id}'s record in the database is not a JSON object")
        return record, Version(str(version))

    def record_version(self, task_id: str) -> Version:
        (version,) = self._row("SELECT version FROM tasks WHERE id = %(task)s", task_id)
        return Version(str(version))

    def record_name(self, task_id: str) -> str:
        return f"task {validate_task_id(task_id)}'s record in the database"

    def cas_record(
        self, task_id: str, expected: Version, record: JSON, *, durable: bool = True
    ) -> Version:
        """Replace the record while its version is ``expected``; the row's ``state``
        column (what the claim scans) follows the record's state when it is one."""
        token = int(expected.token) if expected.token.isdigit() else -1
        row = self._row(
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
            record=_jsonb(record),
            state=_state_of(record),
            expected=token,
        )
        if row[0] is None:
            row = self._row(  # this very write, whose commit's reply was lost?
                "SELECT (SELECT version FROM tasks WHERE id = %(task)s AND version = "
                "%(expected)s + 1 AND record = %(record)s::jsonb)",
                task_id,
                record=_jsonb(record),
                expected=token,
            )
        if row[0] is None:
            raise RecordConflictError(
                f"the record of task {task_id} changed since it was read; read it again."
            )
        return Version(str(row[0]))

    # -- events, heartbeats and exits -------------------------------------------------

    def append_event(self, task_id: str, event: Mapping[str, Any]) -> None:
        """The event's number is taken by the UPDATE of the task row, whose lock lasts
        until the commit: numbers follow commits, so a reader never skips one. An event
        that is the task's last one already is not appended again: it is this very event,
        whose commit's reply was lost (every event carries its time)."""
        clean = _without_nul(json.dumps(redact.clean_mapping(event), default=str))
        self._done(
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
        (events,) = self._row(
            "SELECT ARRAY(SELECT jsonb_build_array(n, event) FROM events WHERE task = %(task)s "
            "AND n > %(after)s ORDER BY n) FROM tasks WHERE id = %(task)s",
            task_id,
            after=after.position,
        )
        if not events:
            return [], after
        return [dict(e[1]) for e in events], Cursor(int(events[-1][0]))

    def events_end(self, task_id: str) -> Cursor:
        (count,) = self._row("SELECT events FROM tasks WHERE id = %(task)s", task_id)
        return Cursor(int(count))

    def publish_heartbeat(self, task_id: str, beat: JSON) -> None:
        """Replace the beat, stamped with the lease (epoch, node) the task has now."""
        self._done(
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
            node=self.node,
            beat=_jsonb(beat),
        )

    def read_heartbeat(self, task_id: str) -> JSON | None:
        """The beat, its monotonic instants on this process's clock (``_beat_here``)."""
        seen = self._seen(task_id)
        if seen is not None:
            return None if seen.beat is None else _beat_here(dict(seen.beat), seen.beat_age)
        (beat, age) = self._row(
            "SELECT h.beat, extract(epoch FROM now() - h.at)::float8 FROM tasks t "
            "LEFT JOIN heartbeats h ON h.task = t.id WHERE t.id = %(task)s",
            task_id,
        )
        return None if beat is None else _beat_here(dict(beat), age)

    def publish_exit(self, task_id: str, outcome: JSON) -> None:
        self._done(
            """
            WITH done AS (
                INSERT INTO exits (task, outcome) SELECT id, %(outcome)s::jsonb FROM tasks
                WHERE id = %(task)s
                ON CONFLICT (task) DO UPDATE SET outcome = excluded.outcome, at = now()
                RETURNING 1
            )
            """,
            task_id,
            outcome=_jsonb(outcome),
        )

    def read_exit(self, task_id: str) -> JSON | None:
        return self._latest("exits", "outcome", task_id)

    def _latest(self, table: str, column: str, task_id: str) -> JSON | None:
        (value,) = self._row(
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


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _journal_name(task_id: str) -> str:
    return f"the journal of task {task_id}"


def _check_rows(task_id: str, seq: int, after: int, rows: Sequence[bytes]) -> None:
    """The rows read after seq ``after`` must reach the task's ``seq``, which the same
    statement as every append moved: fewer is a journal that lost recorded rows."""
    check_journal(_journal_name(task_id), after + len(rows), seq, after)


@dataclass(frozen=True)
class _Seen:
    """One task as ``read_all`` saw it: ``records`` are the journal's after seq ``after``
    (the snapshot's, else 0); None for a running task with a heartbeat, which status shows
    from its beat."""

    spec: Any
    record: Any
    version: int
    beat: Any
    beat_age: float | None  # the database's: now() less when it took the beat
    snapshot: bytes | None
    after: int
    records: list[bytes] | None
    seq: int  # the task's: what the journal holds


#: What ``read_all`` reads: every task, in one statement.
_READ_ALL = """
SELECT t.id, t.spec, t.record, t.version, h.beat, extract(epoch FROM now() - h.at)::float8,
    s.state, coalesce(s.seq, 0),
    CASE WHEN t.state = 'running' AND h.beat IS NOT NULL THEN NULL ELSE ARRAY(
        SELECT j.record FROM journal j
        WHERE j.task = t.id AND j.seq > coalesce(s.seq, 0) ORDER BY j.seq
    ) END, t.seq
FROM tasks t
LEFT JOIN heartbeats h ON h.task = t.id
LEFT JOIN snapshots s ON s.task = t.id
"""


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

#: What ``_done`` appends to its statement: whether it wrote, and whether the task exists.
_WROTE_AND_FOUND = (
    " SELECT EXISTS (SELECT 1 FROM done), EXISTS (SELECT 1 FROM tasks WHERE id = %(task)s)"
)

#: A node's renewal (``PostgresStore._renew_node``): its row, then its leases only if the
#: row was still its registration's; what the name's registration is now, either way.
_RENEW_NODE = """
WITH node AS (
    UPDATE nodes SET seen_at = now(), max_workers = %(workers)s
    WHERE name = %(node)s AND epoch = %(epoch)s AND pid = %(pid)s AND host = %(host)s
    RETURNING 1
), kept AS (
    UPDATE tasks AS t SET lease_expires = now() + make_interval(secs => %(lease)s),
        renewals = t.renewals + 1
    FROM unnest(%(ids)s::text[], %(epochs)s::bigint[]) AS o (id, epoch)
    WHERE t.id = o.id AND t.epoch = o.epoch AND EXISTS (SELECT 1 FROM node)
    RETURNING t.id, t.epoch
)
SELECT EXISTS (SELECT 1 FROM node), n.epoch, n.pid, n.host,
    ARRAY(SELECT id FROM kept), ARRAY(SELECT epoch FROM kept)
FROM (SELECT 1) AS one LEFT JOIN nodes n ON n.name = %(node)s
"""

#: A lease's expiry that ``pglease.renew`` replaces with the server's (never compared).
_NEVER = datetime.max


def _state_of(record: Mapping[str, Any]) -> str | None:
    """The record's state when it is one the task row's ``state`` column takes, else None."""
    state = record.get("state")
    return state if isinstance(state, str) and state in pgschema.STATES else None
