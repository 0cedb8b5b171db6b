"""The PostgreSQL store's connections to its database, and the one place that tells a
database's fault from a bug (docs/design.md section 10, invariant 8).

Every statement of the store is one step on an autocommit connection (``Database.step``):
one transaction, one round trip, one WAL flush (``synchronous_commit`` is set on for every
connection, whatever the server's or role's default, so a returned write is on the
server's disk). Every database fault is a storage fault (``StorageError`` with ``EIO``),
a wait for the worker and the daemon, never a crash: ``database_fault`` tells one by its
SQLSTATE class, not by the driver's exception type (a read-only standby's 25006 comes as
an ``InternalError``), for every statement, listener and lock alike. A connection that
met a fault is dropped, so the next step reconnects by itself once the database is back.

A write whose reply was lost (its COMMIT may or may not have happened) is resolved by
reading back, by the fence, what it wrote: each write of the store either is idempotent
or, refused on a retry, looks whether the refusal is its own earlier commit
(``LostReplies`` remembers which writes may have been). The password in the URL is a
secret: it appears in no message and no repr.
"""

from __future__ import annotations

import contextlib
import errno
import re
import threading
from collections.abc import Iterator, Mapping
from enum import StrEnum
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from worker.errors import ConfigError, NotFoundError, StorageError
from worker.redactor import REDACTED, redact, without_password
from worker.spool import validate_task_id
from worker.store.base import Owner
from worker.store.durable import dump_json

if TYPE_CHECKING:
    from worker.store.pgschema import Connection

#: Idle connections kept for reuse; more are opened while more threads need one at once.
IDLE_CONNECTIONS = 8

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


def jsonb(value: Mapping[str, Any]) -> str:
    """``value`` as the text of a jsonb parameter (the statements cast it)."""
    return without_nul(dump_json(value).decode())


def without_nul(text: str) -> str:
    """JSON ``text`` that jsonb takes: jsonb cannot hold NUL, which a tool's output may
    carry into an event, so it becomes U+FFFD, as an undecodable byte does. (Journal
    records are bytea, kept byte for byte.)"""
    return _NUL.sub(r"\1\\ufffd", text)


class Database:
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
        fresh = Database(url, self._application)
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

    # -- one statement, one step -------------------------------------------------------

    def one(self, sql: str, params: Mapping[str, Any]) -> tuple[Any, ...] | None:
        """The first row ``sql`` returns, or None."""
        with self.step() as conn:
            return conn.execute(sql, params).fetchone()

    def row(self, sql: str, task_id: str, **params: Any) -> tuple[Any, ...]:
        """The one row ``sql`` returns for the task, or ``NotFoundError``."""
        row = self.one(sql, {"task": validate_task_id(task_id), **params})
        if row is None:
            raise NotFoundError(f"no task {task_id!r} in this store; create it first.")
        return row

    def done(self, sql: str, task_id: str, **params: Any) -> bool:
        """Run a write ``sql`` that has a ``done`` CTE (its RETURNING): whether it wrote,
        and ``NotFoundError`` when the task does not exist. One statement, one trip."""
        found = sql + _WROTE_AND_FOUND
        wrote, exists = self.row(found, task_id, **params)
        if not exists:
            raise NotFoundError(f"no task {task_id!r} in this store; create it first.")
        return bool(wrote)


#: What ``Database.done`` appends to its statement: whether it wrote, and whether the task exists.
_WROTE_AND_FOUND = (
    " SELECT EXISTS (SELECT 1 FROM done), EXISTS (SELECT 1 FROM tasks WHERE id = %(task)s)"
)


class LostReplies:
    """The fenced writes that move an epoch whose last try lost its reply: the fence then
    refuses the retry, which reads back whether the refusal is that try's own commit.
    Only then: a stale owner's second try is no retry, and is refused."""

    def __init__(self) -> None:
        self._lost: set[tuple[str, str, int]] = set()

    @contextlib.contextmanager
    def unsure(self, what: str, owner: Owner) -> Iterator[bool]:
        """A fenced write ``what`` of ``owner``'s: yields whether its last try lost its
        reply."""
        key = (what, owner.task_id, owner.epoch)
        unsure = key in self._lost
        try:
            yield unsure
        except StorageError as exc:
            if exc.cause in (DatabaseFault.LOST.name.lower(), DatabaseFault.SHUTDOWN.name.lower()):
                self._lost.add(key)
            raise
        self._lost.discard(key)
