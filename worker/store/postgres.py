"""The ``TaskStore`` and ``SharedStore`` on PostgreSQL (docs/design.md section 10): every
node of a cluster shares one database, and the conformance suite (``tests/store/``) runs
on it unchanged.

``PostgresStore`` is the Protocols' face; each promise is kept by one part, and every part
is handed the same ``Database`` (the connections, and the one place a driver error
becomes a storage fault)::

    PostgresStore
      Database       worker.store.pgdatabase      connections, faults, lost replies
      TaskView       worker.store.pgview          one read of every task (read_all)
      TaskRows       worker.store.pgtasks         create, spec, record, decisions, cancel,
                                                  events, heartbeats, exits
      JournalRows    worker.store.pgjournal       the fenced journal, the snapshot
      TaskLeases     worker.store.pgownership     acquire, claim, renew, release, seize
      NodeRegistry   worker.store.pgnodes         join, leave, nodes
      Coordination   worker.store.pgcoordination  operator lock, pause, wake, listen
      ConsoleTokens  worker.store.pgtokens        the console's API tokens

The tables are ``worker.store.pgschema``'s; the fenced append, the claim and the lease
renewal are ``worker.store.pglease``'s. Each method is one statement on an autocommit
connection: one transaction, one round trip, one WAL flush. How each promise of the
Protocol is kept:

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
(invariant 8), never a crash (``pgdatabase.database_fault``). A write whose reply was
lost is resolved by reading back, by the fence, what it wrote. The password in the URL
is a secret: it appears in no message and no repr. Only these ``pg*`` modules import
psycopg, and only once a PostgreSQL store is used.
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from worker.config import ClusterConfig
from worker.errors import ConfigError, StorageError
from worker.spool import TaskSpec
from worker.store import pgschema
from worker.store.base import (
    JSON,
    START,
    Cursor,
    NodeInfo,
    Owner,
    Seized,
    Snapshot,
    Version,
)
from worker.store.pgcoordination import Coordination
from worker.store.pgdatabase import LOGIN_REFUSED, Database, DatabaseFault
from worker.store.pgjournal import JournalRows, PostgresJournal
from worker.store.pgnodes import NodeRegistry
from worker.store.pgownership import TaskLeases
from worker.store.pgtasks import TaskRows
from worker.store.pgtokens import ConsoleTokens
from worker.store.pgview import TaskView

#: How long an acquisition lasts without a ``renew`` (``[cluster] lease``), seconds.
DEFAULT_LEASE = ClusterConfig().lease


class PostgresStore:
    """The ``TaskStore`` and ``SharedStore`` in one PostgreSQL database (the schema of the
    URL's search_path), kept by the parts the module docstring draws.

    ``node`` names this node in leases and messages (default: the hostname); ``lease`` is
    how long, in seconds, an acquisition lasts without a ``renew``. ``migrate`` creates or
    upgrades the schema (``agentd start``, ``agentd store init``); without it a database
    this release cannot use is refused at once (``SchemaVersionError``). A login the
    server refuses is ``ConfigError`` (exit 78), or with ``waits`` (a running node's
    worker) the ``StorageError`` every unreachable store is. ``clock`` is the monotonic
    clock this process judges other holders' leases by (a test's, to move by hand)."""

    def __init__(
        self,
        url: str,
        *,
        node: str | None = None,
        lease: float = DEFAULT_LEASE,
        migrate: bool = False,
        waits: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.node = node or socket.gethostname()
        self.db = Database(url, application=f"agentd {self.node}")
        self.lease = lease
        view = TaskView(self.db)
        self._view = view
        self._tasks = TaskRows(self.db, view, self.node)
        self._journals = JournalRows(self.db, view)
        self._nodes = NodeRegistry(self.db, self.node, lease)
        self._leases = TaskLeases(self.db, self._nodes, self.node, lease, clock)
        self._coordination = Coordination(self.db)
        self._tokens = ConsoleTokens(self.db)
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

    def relogin(self, url: str) -> None:
        self.db.relogin(url)

    # -- tasks (``TaskRows``) ----------------------------------------------------------

    def create(
        self,
        spec: TaskSpec,
        record: JSON,
        *,
        script: bytes | None = None,
        journal: Sequence[JSON] = (),
        prepare: Callable[[Path | None], None] | None = None,
    ) -> None:
        self._tasks.create(spec, record, script, journal, prepare)

    def read_all(self) -> contextlib.AbstractContextManager[None]:
        """For the block, this thread's reads of what status shows of a task are answered
        from ONE statement made first (``pgview``)."""
        return self._view.reading()

    def task_ids(self) -> list[str]:
        return self._tasks.task_ids()

    def rest_mark(self, task_id: str, now_ns: int | None = None) -> tuple[int, ...] | None:
        return self._tasks.rest_mark(task_id, now_ns)

    def exists(self, task_id: str) -> bool:
        return self._tasks.exists(task_id)

    def load_spec(self, task_id: str) -> TaskSpec:
        return self._tasks.load_spec(task_id)

    def load_script(self, task_id: str) -> bytes:
        return self._tasks.load_script(task_id)

    def record_decision(
        self, task_id: str, key: str, attempt: int, decision: Mapping[str, Any]
    ) -> bool:
        return self._tasks.record_decision(task_id, key, attempt, decision)

    def read_decision(self, task_id: str, key: str, attempt: int) -> JSON | None:
        return self._tasks.read_decision(task_id, key, attempt)

    def decision_name(self, task_id: str, key: str, attempt: int) -> str:
        return self._tasks.decision_name(task_id, key, attempt)

    def request_cancel(self, task_id: str, stamp: JSON) -> bool:
        return self._tasks.request_cancel(task_id, stamp)

    def cancel_requested(self, task_id: str) -> bool:
        return self._tasks.cancel_requested(task_id)

    def read_cancel(self, task_id: str) -> JSON | None:
        return self._tasks.read_cancel(task_id)

    def withdraw_cancel(self, task_id: str) -> None:
        self._tasks.withdraw_cancel(task_id)

    def get_record(self, task_id: str) -> tuple[JSON | None, Version]:
        return self._tasks.get_record(task_id)

    def record_version(self, task_id: str) -> Version:
        return self._tasks.record_version(task_id)

    def record_name(self, task_id: str) -> str:
        return self._tasks.record_name(task_id)

    def cas_record(
        self, task_id: str, expected: Version, record: JSON, *, durable: bool = True
    ) -> Version:
        return self._tasks.cas_record(task_id, expected, record, durable=durable)

    def append_event(self, task_id: str, event: Mapping[str, Any]) -> None:
        self._tasks.append_event(task_id, event)

    def read_events(self, task_id: str, after: Cursor = START) -> tuple[list[JSON], Cursor]:
        return self._tasks.read_events(task_id, after)

    def events_end(self, task_id: str) -> Cursor:
        return self._tasks.events_end(task_id)

    def publish_heartbeat(self, task_id: str, beat: JSON) -> None:
        self._tasks.publish_heartbeat(task_id, beat)

    def read_heartbeat(self, task_id: str) -> JSON | None:
        return self._tasks.read_heartbeat(task_id)

    def publish_exit(self, task_id: str, outcome: Mapping[str, Any]) -> None:
        self._tasks.publish_exit(task_id, outcome)

    def read_exit(self, task_id: str) -> JSON | None:
        return self._tasks.read_exit(task_id)

    # -- the journal and the snapshot (``JournalRows``) --------------------------------

    def check_fence(self, owner: Owner) -> None:
        self._journals.check_fence(owner)

    def volume_between(self, task_id: str, after: int, upto: int) -> int:
        return self._journals.volume_between(task_id, after, upto)

    def open_journal(
        self, owner: Owner, *, after: Cursor = START, header: Mapping[str, Any] | None = None
    ) -> tuple[PostgresJournal, list[JSON]]:
        return self._journals.open_journal(owner, after=after, header=header)

    def replay(self, task_id: str, after: Cursor = START) -> list[JSON]:
        return self._journals.replay(task_id, after)

    def journal_end(self, task_id: str) -> Cursor:
        return self._journals.journal_end(task_id)

    def get_snapshot(self, task_id: str) -> Snapshot | None:
        return self._journals.get_snapshot(task_id)

    def put_snapshot(self, owner: Owner, snapshot: Snapshot) -> int:
        return self._journals.put_snapshot(owner, snapshot)

    # -- ownership and the cluster's leases (``TaskLeases``) ---------------------------

    def acquire(self, task_id: str, *, wait: float = 0.0) -> Owner:
        return self._leases.acquire(task_id, wait=wait)

    def seize(self, task_id: str) -> Seized | None:
        return self._leases.seize(task_id)

    def renew(self, owner: Owner) -> None:
        self._leases.renew(owner)

    def release(self, owner: Owner) -> None:
        self._leases.release(owner)

    def owned(self, task_id: str) -> bool:
        return self._leases.owned(task_id)

    def owner_pid(self, task_id: str) -> int | None:
        return self._leases.owner_pid(task_id)

    def claim(
        self, limit: int, *, exclude: Sequence[str] = (), expired: bool = True
    ) -> list[Owner]:
        return self._leases.claim(limit, exclude=exclude, expired=expired)

    def handover(self, owner: Owner) -> Owner:
        return self._leases.handover(owner)

    def renew_all(self, owners: Sequence[Owner]) -> list[Owner]:
        return self._leases.renew_all(owners)

    def put_record(
        self, owner: Owner, record: JSON, *, release: bool, runnable_in: float = 0.0
    ) -> None:
        self._leases.put_record(owner, record, release=release, runnable_in=runnable_in)

    def orphans(self) -> list[tuple[Owner, JSON]]:
        return self._leases.orphans()

    def leases(self) -> dict[str, str]:
        return self._leases.leases()

    # -- the nodes (``NodeRegistry``) --------------------------------------------------

    def join(self, max_workers: int) -> int:
        return self._nodes.join(max_workers)

    def leave(self) -> None:
        self._nodes.leave()

    def nodes(self) -> list[NodeInfo]:
        return self._nodes.nodes()

    # -- coordination (``Coordination``) -----------------------------------------------

    def operator_lock(self, task_id: str, wait: float) -> contextlib.AbstractContextManager[None]:
        return self._coordination.operator_lock(task_id, wait)

    def request_pause(self, task_id: str, seconds: float) -> None:
        self._coordination.request_pause(task_id, seconds)

    def end_pause(self, task_id: str) -> None:
        self._coordination.end_pause(task_id)

    def pause_requested(self, task_id: str) -> bool:
        return self._coordination.pause_requested(task_id)

    def wake(self, task_id: str) -> None:
        self._coordination.wake(task_id)

    def listen(self, on_wake: Callable[[], None]) -> Callable[[], None]:
        return self._coordination.listen(on_wake)

    # -- the console's API tokens (``ConsoleTokens``) ----------------------------------

    def add_token(self, token: JSON) -> None:
        self._tokens.add_token(token)

    def tokens(self) -> list[JSON]:
        return self._tokens.tokens()

    def token(self, digest: str) -> JSON | None:
        return self._tokens.token(digest)

    def revoke_token(self, token_id: str) -> bool:
        return self._tokens.revoke_token(token_id)
