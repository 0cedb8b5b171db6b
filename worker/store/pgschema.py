"""The PostgreSQL store's schema (docs/design.md section 10): its version, its tables, and the
one migration path that creates or upgrades it.

Every node of a cluster shares one database, so the schema is a contract between nodes
of possibly different releases. ``SCHEMA_VERSION`` is the version this release writes;
``MIGRATIONS[n]`` takes a database from version ``n`` to ``n + 1`` (``MIGRATIONS[0]``
creates it), so ``SCHEMA_VERSION == len(MIGRATIONS)`` by construction and the docs refer
to the constant, never restate its value. ``migrate`` runs what is missing in one
transaction (all of it or none) under an advisory lock, so two nodes starting at once
migrate once; ``check`` refuses a database this release cannot safely use, in one line.

The tables, one row per what the ``TaskStore`` Protocol keeps::

    agentd_schema  the version (one row)
    nodes          one row per node: name, host, pid, max_workers, seen_at, epoch (its
                   registrations)
    tasks          spec, script, record (+ version: compare-and-set), state, the lease
                   (node, epoch, renewals, lease_seconds; lease_expires: held while set),
                   seq (the last journal record's),
                   runnable_at (backoff), cancel, events (the last event's number),
                   paused_until (an operator's pause: no claim before it)
    journal        (task, seq) -> record bytes, and the epoch of the lease that wrote it
    snapshots      task -> state bytes as of seq (a cache: replay is the truth)
    decisions      (task, key, attempt) -> decision: the primary key is the exactly-once
    events         (task, n) -> event: n is taken under the task row's lock, so the
                   order of n is the order of commits (a follower never skips one)
    heartbeats     task -> the latest beat, with the epoch and node that sent it
    exits          task -> the worker's exit record
    console_tokens the console's API tokens (id, SHA-256 digest, who minted them, when):
                   every node's console accepts them (docs/design.md section 12)

Positions are sequence numbers: a journal cursor is a ``seq``, an events cursor an ``n``.
The lease and the fence live on the task row (``worker.store.pglease``), so a step is
one statement that checks the writer's epoch and writes its record together.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeAlias

from worker.errors import SchemaVersionError
from worker.protocol import CLAIMABLE, TaskStatus

if TYPE_CHECKING:
    import psycopg
    from psycopg.rows import TupleRow

    Connection: TypeAlias = psycopg.Connection[TupleRow]

#: The states a task row may hold (docs/design.md section 3): ``TaskStatus``, the one list.
STATES = tuple(TaskStatus)


def sql_states(states: Iterable[TaskStatus]) -> str:
    """``states`` as SQL's list of them: ``('queued', 'backoff')``. Every list of states
    in the schema and the statements is rendered from ``TaskStatus`` by this."""
    return "(" + ", ".join(f"'{s}'" for s in states) + ")"


def state_of(record: Mapping[str, Any]) -> str | None:
    """The record's state when it is one the task row's ``state`` column takes, else None."""
    state = record.get("state")
    return state if isinstance(state, str) and state in STATES else None


_CREATE = f"""
CREATE TABLE nodes (
    name          text PRIMARY KEY,
    host          text NOT NULL,
    pid           integer NOT NULL,
    max_workers   integer NOT NULL,
    schema_version integer NOT NULL,
    started_at    timestamptz NOT NULL DEFAULT now(),
    seen_at       timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE tasks (
    id            text PRIMARY KEY CHECK (id ~ '^[a-z0-9][a-z0-9._-]{{0,63}}$'),
    spec          jsonb NOT NULL,
    script        bytea,
    record        jsonb NOT NULL DEFAULT '{{}}',
    version       bigint NOT NULL DEFAULT 1,
    state         text NOT NULL DEFAULT 'queued'
                  CHECK (state IN {sql_states(STATES)}),
    node          text,
    epoch         bigint NOT NULL DEFAULT 0,
    lease_expires timestamptz,
    seq           bigint NOT NULL DEFAULT 0 CHECK (seq >= 0),
    runnable_at   timestamptz NOT NULL DEFAULT now(),
    cancel        jsonb,
    events        bigint NOT NULL DEFAULT 0,
    created_at    timestamptz NOT NULL DEFAULT now(),
    updated_at    timestamptz NOT NULL DEFAULT now()
);
-- What a claim scans: only rows that may be runnable, oldest first.
CREATE INDEX tasks_claimable ON tasks (runnable_at, id)
    WHERE state IN {sql_states(CLAIMABLE)};

CREATE TABLE journal (
    task          text NOT NULL REFERENCES tasks (id) ON DELETE CASCADE,
    seq           bigint NOT NULL CHECK (seq > 0),
    epoch         bigint NOT NULL,
    record        bytea NOT NULL,
    PRIMARY KEY (task, seq)
);

CREATE TABLE snapshots (
    task          text PRIMARY KEY REFERENCES tasks (id) ON DELETE CASCADE,
    seq           bigint NOT NULL,
    state         bytea NOT NULL,
    at            timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE decisions (
    task          text NOT NULL REFERENCES tasks (id) ON DELETE CASCADE,
    key           text NOT NULL,
    attempt       integer NOT NULL,
    decision      jsonb NOT NULL,
    at            timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (task, key, attempt)
);

CREATE TABLE events (
    task          text NOT NULL REFERENCES tasks (id) ON DELETE CASCADE,
    n             bigint NOT NULL,
    event         jsonb NOT NULL,
    PRIMARY KEY (task, n)
);

CREATE TABLE heartbeats (
    task          text PRIMARY KEY REFERENCES tasks (id) ON DELETE CASCADE,
    epoch         bigint NOT NULL,
    node          text NOT NULL,
    beat          jsonb NOT NULL,
    at            timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE exits (
    task          text PRIMARY KEY REFERENCES tasks (id) ON DELETE CASCADE,
    outcome       jsonb NOT NULL,
    at            timestamptz NOT NULL DEFAULT now()
);
"""

#: Version 2: an operator's pause (a rewind of a task any node may be running), which
#: holds claims off until it ends or runs out (``SharedStore.request_pause``).
_PAUSE = """
ALTER TABLE tasks ADD COLUMN paused_until timestamptz;
"""

#: Version 3: leases that no clock step moves and one live daemon per node name. A
#: task's ``renewals`` counts its lease's renewals (a taker judges expiry by how long it
#: has seen the count stand still, on its own monotonic clock); a node's ``epoch`` counts
#: its registrations (a daemon that finds it moved was superseded).
_CLUSTER = """
ALTER TABLE tasks ADD COLUMN renewals bigint NOT NULL DEFAULT 0;
ALTER TABLE nodes ADD COLUMN epoch bigint NOT NULL DEFAULT 0;
"""

#: Version 4: the console's API tokens (``agentd console --token``), stored as the SHA-256
#: of the token, never the token: any node's console accepts a token minted on any node.
_CONSOLE_TOKENS = """
CREATE TABLE console_tokens (
    id            text PRIMARY KEY,
    digest        text NOT NULL UNIQUE,
    by_user       text NOT NULL,
    created_at    timestamptz NOT NULL DEFAULT now()
);
"""

#: Version 5: each lease's length as its holder counts it (``lease_seconds``), so that a
#: taker waits out the holder's lease, not its own, whatever each node's ``[cluster] lease``.
_LEASE_LENGTH = """
ALTER TABLE tasks ADD COLUMN lease_seconds double precision;
"""

#: ``MIGRATIONS[n]`` takes the schema from version n to n + 1; append, never edit.
MIGRATIONS: tuple[str, ...] = (_CREATE, _PAUSE, _CLUSTER, _CONSOLE_TOKENS, _LEASE_LENGTH)

#: The schema version this release writes and reads.
SCHEMA_VERSION = len(MIGRATIONS)

#: Serializes migrators across nodes (``pg_advisory_xact_lock``): "agentd" in ASCII.
_MIGRATION_LOCK = 0x6167656E7464

_VERSION_TABLE = """
CREATE TABLE IF NOT EXISTS agentd_schema (
    singleton   boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    version     integer NOT NULL,
    migrated_at timestamptz NOT NULL DEFAULT now()
)
"""


def stored_version(conn: Connection) -> int | None:
    """The schema version recorded in the database (of the connection's search_path),
    or None when it holds no agentd schema."""
    row = conn.execute("SELECT to_regclass('agentd_schema') IS NOT NULL").fetchone()
    if not row or not row[0]:
        return None
    found = conn.execute("SELECT version FROM agentd_schema").fetchone()
    return int(found[0]) if found else None


def _refuse_newer(version: int, latest: int) -> None:
    if version > latest:
        raise SchemaVersionError(
            f"the database's agentd schema is version {version}, newer than this "
            f"release's {latest}: upgrade agentd on this node before starting it"
        )


def migrate(conn: Connection, migrations: Sequence[str] = MIGRATIONS) -> int:
    """Create the schema or bring it up to ``len(migrations)``, in one transaction (a
    failure leaves the database as it was); returns the version it is at now.

    ``SchemaVersionError`` when the database is newer than this release: an older node
    never touches a newer schema. Runs in its own transaction, so call it outside one."""
    latest = len(migrations)
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK,))
        conn.execute(_VERSION_TABLE)
        version = stored_version(conn) or 0
        _refuse_newer(version, latest)
        for step in migrations[version:]:
            conn.execute(step.encode())
        if version == 0:
            conn.execute("INSERT INTO agentd_schema (version) VALUES (%s)", (latest,))
        elif version < latest:
            conn.execute("UPDATE agentd_schema SET version = %s, migrated_at = now()", (latest,))
    return latest


def check(conn: Connection, latest: int = SCHEMA_VERSION) -> None:
    """Refuse, in one line, a database this release cannot use as it is: no schema or an
    older one (``agentd store init`` migrates it), or a newer one (upgrade this node)."""
    version = stored_version(conn)
    if version is None:
        raise SchemaVersionError(
            "the database holds no agentd schema: create it with `agentd store init` "
            "(`agentd start` does it too)"
        )
    _refuse_newer(version, latest)
    if version < latest:
        raise SchemaVersionError(
            f"the database's agentd schema is version {version}, older than this "
            f"release's {latest}: migrate it with `agentd store init`"
        )
