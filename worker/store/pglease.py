"""The three hot statements of the PostgreSQL store: the fenced append, the claim, the
lease renewal (docs/design.md section 10, invariant 10).

A task row carries its lease: the ``node`` that holds it, an ``epoch`` that every claim
bumps, and ``lease_expires``. Whoever claims a task gets the new epoch, and every step it
records carries that epoch; the database checks it in the same statement that writes the
record, so a worker whose lease was taken over can never record another step (fencing
tokens, in Kleppmann's sense). Nothing here trusts a node's clock: expiries are the
server's ``now()``, and a worker keeps its own deadline (the time before its renewal
was sent, plus the lease) to stop itself before the database has to fence it.

Each function is ONE statement on an autocommit connection: one implicit transaction, one
round trip (psycopg sends parse, bind, execute and sync in one flight, and no separate
BEGIN or COMMIT), one WAL flush with ``synchronous_commit`` on. That is why the append is
a data-modifying CTE rather than an UPDATE then an INSERT: the INSERT only sees the rows
the fence UPDATE let through, so a moved fence inserts nothing without a second trip.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING

from worker.errors import FencedError, NotFoundError

if TYPE_CHECKING:
    from worker.store.pgschema import Connection


@functools.lru_cache(maxsize=64)
def append_sql(count: int) -> str:
    """The fenced append of ``count`` records: the fence (the writer's epoch, and the seq
    it appends after) and the records, in one statement; it returns how many records it
    wrote, 0 when the fence moved. The records are a VALUES list rather than an array
    (``unnest`` materializes its rows, which costs as much again as the step: measured),
    so there is one statement text per record count, each prepared once."""
    rows = ", ".join(f"({n}, %s::bytea)" for n in range(1, count + 1))
    return f"""
WITH fence AS (
    UPDATE tasks SET seq = %s, updated_at = now()
    WHERE id = %s AND epoch = %s AND seq = %s
    RETURNING id
), written AS (
    INSERT INTO journal (task, seq, epoch, record)
    SELECT fence.id, %s + r.n, %s, r.record
    FROM fence, (VALUES {rows}) AS r (n, record)
    RETURNING 1
)
SELECT count(*) FROM written
"""  # noqa: S608  (only placeholders are formatted in; every value is a parameter)


#: Why an append wrote nothing: the task's fence now, and what this epoch wrote after.
_FENCE_NOW = """
SELECT epoch, seq, ARRAY(
    SELECT record FROM journal
    WHERE task = %(task)s AND epoch = %(epoch)s AND seq > %(after)s ORDER BY seq
) FROM tasks WHERE id = %(task)s
"""

#: The claim: runnable tasks nobody holds a live lease on, oldest first, up to ``limit``;
#: rows another node is claiming right now are skipped, not waited for.
CLAIM = """
WITH picked AS (
    SELECT id FROM tasks
    WHERE state IN ('queued', 'backoff', 'running')
      AND runnable_at <= now()
      AND (lease_expires IS NULL OR (%(expired)s AND lease_expires < now()))
      AND (paused_until IS NULL OR paused_until <= now())
      AND NOT (id = ANY(%(exclude)s::text[]))
      AND (%(registered)s::bigint IS NULL OR EXISTS (SELECT 1 FROM nodes n WHERE
          n.name = %(node)s AND n.epoch = %(registered)s AND n.pid = %(pid)s))
    ORDER BY runnable_at, id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
UPDATE tasks AS t
SET state = 'running', node = %(node)s, epoch = t.epoch + 1,
    lease_expires = now() + make_interval(secs => %(lease)s),
    record = jsonb_set(t.record, '{state}', '"running"'),
    version = t.version + 1, updated_at = now()
FROM picked WHERE t.id = picked.id
RETURNING t.id, t.epoch, t.seq, t.lease_expires
"""

#: The renewal: only while the epoch is still the holder's.
RENEW = """
UPDATE tasks SET lease_expires = now() + make_interval(secs => %(lease)s)
WHERE id = %(task)s AND epoch = %(epoch)s
RETURNING lease_expires
"""


@dataclass(frozen=True)
class Lease:
    """The right to run one task, as a claim granted it: every append carries ``epoch``;
    ``seq`` is the journal's last record at the claim (the new owner appends after it);
    ``expires`` is the server's time."""

    task_id: str
    node: str
    epoch: int
    seq: int
    expires: datetime


def append(conn: Connection, task_id: str, epoch: int, after: int, records: Sequence[bytes]) -> int:
    """Record ``records`` as the journal's seqs ``after + 1 ...``, fenced by ``epoch``;
    returns the new last seq.

    ``FencedError`` (nothing written) when the task's epoch is no longer ``epoch`` or its
    journal moved past ``after``. Retrying an append whose commit was lost with the
    connection is safe: the same records already there under the same epoch are taken
    as written."""
    last = after + len(records)
    if not records:
        return last
    fence = (last, task_id, epoch, after, after, epoch, *records)
    row = conn.execute(append_sql(len(records)), fence).fetchone()
    if row is not None and row[0] == len(records):
        return last
    now = conn.execute(_FENCE_NOW, {"task": task_id, "epoch": epoch, "after": after}).fetchone()
    if now is None:
        raise NotFoundError(f"task {task_id} no longer exists in the database")
    epoch_now, seq_now, ours = now
    if epoch_now == epoch and seq_now >= last and list(ours[: len(records)]) == list(records):
        return last  # our own append, committed though its reply was lost
    if epoch_now != epoch:
        why = f"its lease moved to epoch {epoch_now} (this writer holds {epoch})"
    else:
        why = f"its journal is at seq {seq_now}, not {after}"
    raise FencedError(f"task {task_id} was not advanced: {why}; this worker stops")


def claim(
    conn: Connection,
    node: str,
    limit: int,
    lease: float,
    exclude: Sequence[str] = (),
    *,
    expired: bool = True,
    registered: tuple[int, int] | None = None,
) -> list[Lease]:
    """Take up to ``limit`` runnable tasks for ``node`` for ``lease`` seconds: queued ones,
    ones whose backoff is over, and (with ``expired``) ones whose holder let its lease
    expire (but none of ``exclude``). Each comes with a new epoch, which fences every
    earlier holder, and its record says ``running``. Never blocks on another claim. With
    ``registered`` (the node's registration epoch and the daemon's pid), nothing is
    claimed once another daemon registered the name."""
    if limit <= 0:
        return []
    epoch, pid = registered if registered is not None else (None, 0)
    params = {"node": node, "limit": limit, "lease": lease, "exclude": list(exclude)}
    params["expired"] = expired
    params |= {"registered": epoch, "pid": pid}
    rows = conn.execute(CLAIM, params).fetchall()
    return [Lease(task, node, epoch, seq, expires) for task, epoch, seq, expires in rows]


def renew(conn: Connection, lease: Lease, seconds: float) -> Lease:
    """Extend ``lease`` by ``seconds`` from the server's now; ``FencedError`` once another
    claim took the task (its epoch moved), however recently this holder renewed."""
    row = conn.execute(
        RENEW, {"task": lease.task_id, "epoch": lease.epoch, "lease": seconds}
    ).fetchone()
    if row is None:
        raise FencedError(
            f"task {lease.task_id}'s lease (epoch {lease.epoch}) was taken over: this worker stops"
        )
    return Lease(lease.task_id, lease.node, lease.epoch, lease.seq, row[0])
