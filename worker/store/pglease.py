"""The three hot statements of the PostgreSQL store: the fenced append, the claim, the
lease renewal (docs/design.md section 10, invariant 10).

A task row carries its lease: the ``node`` that holds it, an ``epoch`` that every claim
bumps, ``renewals`` that every renewal bumps, ``lease_seconds`` (the holder's length of
it) and ``lease_expires`` (set while the lease is held). Whoever claims a task gets the
new epoch, and every step it records carries that epoch; the database checks it in the
same statement that writes the record, so a worker whose lease was taken over can never
record another step (fencing tokens, in Kleppmann's sense).

No wall clock decides when a lease ends, neither a node's nor the database's: a wall
clock stepped by two minutes must move no lease. A taker judges a lease by how long it
has itself seen the lease's (epoch, renewals) stand still, on its own monotonic clock
(``LeaseWatch``): once that is the holder's lease plus ``TAKEOVER_MARGIN``, the holder's
worker has stopped itself (at 0.8 of the lease after it sent its last renewal) or been
killed by the kernel (at 0.9: ``worker.killtimer``), since that renewal was sent before
the taker saw it. The claim then takes the lease only if it still stands as seen (a
compare-and-set on the epoch and the count, in the statement that claims). Time a
process could not read the leases (the database away, or the process itself too busy)
does not count: a holder could not renew then either. ``lease_expires`` is the server's
time, shown to people and never compared.

Each function is ONE statement on an autocommit connection: one implicit transaction, one
round trip (psycopg sends parse, bind, execute and sync in one flight, and no separate
BEGIN or COMMIT), one WAL flush with ``synchronous_commit`` on. That is why the append is
a data-modifying CTE rather than an UPDATE then an INSERT: the INSERT only sees the rows
the fence UPDATE let through, so a moved fence inserts nothing without a second trip.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from worker.errors import FencedError, NotFoundError
from worker.protocol import CLAIMABLE
from worker.store.base import Owner, Previous, Seized
from worker.store.pgschema import sql_states

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

#: The claim: runnable tasks nobody holds a lease on, or whose lease this node saw stand
#: still for long enough (``expired``: as it was seen, by epoch and renewal count), oldest
#: first, up to ``limit``; rows another node is claiming right now are skipped, not waited
#: for. The same statement reads every lease held, for the node's ``LeaseWatch``: the
#: claimed rows come first (``claimed`` true), with what lease each was taken from. Only a
#: backoff waits for its ``runnable_at``: a queued task, or a running one whose lease
#: stood still, is runnable whatever it says (the server's clock stepped back since it
#: was written must neither hold the queue up nor keep a dead node's task from the others).
CLAIM = f"""
WITH held AS (
    SELECT id, node, epoch, renewals, lease_seconds FROM tasks
    WHERE lease_expires IS NOT NULL AND state IN {sql_states(CLAIMABLE)}
), expired AS (
    SELECT * FROM unnest(%(ids)s::text[], %(epochs)s::bigint[], %(counts)s::bigint[])
        AS e (id, epoch, renewals)
), picked AS (
    SELECT t.id, t.lease_expires IS NOT NULL AS taken, t.node AS was_node, t.epoch AS was_epoch
    FROM tasks t
    WHERE t.state IN {sql_states(CLAIMABLE)}
      AND (t.state <> 'backoff' OR t.runnable_at <= now())
      AND (t.lease_expires IS NULL OR EXISTS (SELECT 1 FROM expired e
          WHERE e.id = t.id AND e.epoch = t.epoch AND e.renewals = t.renewals))
      AND (t.paused_until IS NULL OR t.paused_until <= now())
      AND NOT (t.id = ANY(%(exclude)s::text[]))
      AND (%(registered)s::bigint IS NULL OR EXISTS (SELECT 1 FROM nodes n WHERE
          n.name = %(node)s AND n.epoch = %(registered)s AND n.pid = %(pid)s))
    ORDER BY t.runnable_at, t.id
    LIMIT %(limit)s
    FOR UPDATE OF t SKIP LOCKED
), claimed AS (
    UPDATE tasks AS t
    SET state = 'running', node = %(node)s, epoch = t.epoch + 1, renewals = t.renewals + 1,
        lease_seconds = %(lease)s, lease_expires = now() + make_interval(secs => %(lease)s),
        record = jsonb_set(t.record, '{{state}}', '"running"'),
        version = t.version + 1, updated_at = now()
    FROM picked WHERE t.id = picked.id
    RETURNING t.id, t.epoch, t.seq, picked.taken, picked.was_node, picked.was_epoch
)
SELECT true, id, epoch, seq, taken, was_node, was_epoch, NULL::bigint, NULL::float8
FROM claimed
UNION ALL
SELECT false, id, epoch, NULL, NULL, node, NULL, renewals, lease_seconds FROM held
"""  # noqa: S608  (its lists of states are TaskStatus values: no input)

#: The renewal: only while the epoch is still the holder's; the count moves with it.
RENEW = """
UPDATE tasks SET lease_expires = now() + make_interval(secs => %(lease)s),
    renewals = renewals + 1, lease_seconds = %(lease)s
WHERE id = %(task)s AND epoch = %(epoch)s
RETURNING lease_expires
"""

#: How much longer than a lease a taker waits once it last saw the lease renewed (at least
#: 0.5 s, docs/design.md section 10): the holder's kernel kill comes at 0.9 of the lease
#: after it sent that renewal, which was before the taker saw it; the margin covers the
#: rest (the kill's delivery, two machines' clocks running at slightly different rates).
TAKEOVER_MARGIN = 0.5
#: The part of its lease a holder may leave a lease unrenewed before an operator's command
#: takes it from it (``PostgresStore.seize``): renewals come every third of a lease, so
#: a holder that let half of it pass without one is frozen, or cut off from the database.
STALLED = 0.5


def fenced(owner: Owner) -> FencedError:
    """What a write of ``owner``'s says once the task's epoch moved past it."""
    return FencedError(
        f"task {owner.task_id} is no longer owned by {owner.holder} (epoch "
        f"{owner.epoch}); its worker stops, and the task's new owner carries on."
    )


def seized(owner: Owner, stale: Held | None, seconds: float, lease: float) -> Seized:
    """An operator's seizure as ``owner``: of a free lease (``stale`` None), or of
    ``stale``, seen standing still for ``seconds``: its holder's tool may still run for
    the rest of the holder's lease (``lease`` where the row does not say)."""
    if stale is None:
        return Seized(owner, None, 0, 0.0)
    ends_in = max(0.0, (stale.lease or lease) - seconds)
    return Seized(owner, stale.node, stale.epoch, ends_in)


@dataclass(frozen=True)
class Held:
    """A lease as one read saw it: its task, holder, epoch and renewal count, and the
    holder's length of it (None: a row of an older release, judged by the reader's)."""

    task_id: str
    node: str
    epoch: int
    renewals: int
    lease: float | None


class LeaseWatch:
    """When this process first saw each held lease as it stands (its epoch and renewal
    count), on its own monotonic clock, and so how long each has stood still: the one
    judge of a lease's end (the module docstring). ``observe`` takes a read of every held
    lease, ``note`` a read of one.

    Only time this process watched counts. The time from a read that failed (``blind``:
    the database away, whose holders could not renew either) to the next, and a pause
    between reads past ``gap`` (a node too busy to look, or stopped itself: the database
    may have been away meanwhile, unseen), do not: every lease's standing still is put
    forward by that time at the next read, so a holder that waited for the database with
    a call's result in hand gets to renew before it is judged (a holder renews within a
    third of its lease, and half of one unseen leaves it the rest). Until that read, no
    lease is judged over."""

    def __init__(
        self, clock: Callable[[], float] = time.monotonic, gap: float = float("inf")
    ) -> None:
        self.clock = clock
        self.gap = gap
        self._seen: dict[str, tuple[Held, float]] = {}
        self._read_at = -float("inf")  # the last ``observe``
        self._blind = False  # a read failed since

    def observe(self, held: Iterable[Held], at: float | None = None) -> None:
        """A read of every lease held now (those not in it are held no more)."""
        now = self.clock() if at is None else at
        unseen = now - self._read_at if self._read_at > -float("inf") else 0.0
        uncounted = unseen if self._blind else max(0.0, unseen - self.gap)
        if uncounted:
            self._seen = {t: (h, since + uncounted) for t, (h, since) in self._seen.items()}
        self._read_at, self._blind = now, False
        seen: dict[str, tuple[Held, float]] = {}
        for lease in held:
            seen[lease.task_id] = self._kept(lease, now)
        self._seen = seen

    def note(self, lease: Held | None, task_id: str, at: float | None = None) -> None:
        """A read of one task's lease (None: not held), the others left as they were."""
        now = self.clock() if at is None else at
        if lease is None:
            self._seen.pop(task_id, None)
        else:
            self._seen[task_id] = self._kept(lease, now)

    def _kept(self, lease: Held, now: float) -> tuple[Held, float]:
        before = self._seen.get(lease.task_id)
        if before is not None and _same(before[0], lease):
            return before[0], before[1]
        return lease, now

    def blind(self) -> None:
        """A read failed: the time until the next read does not count."""
        self._blind = True

    def still(self, task_id: str, at: float | None = None) -> tuple[Held, float] | None:
        """The task's lease as last seen, and for how many seconds it has stood still as
        far as this process knows; None when it saw none held."""
        found = self._seen.get(task_id)
        if found is None:
            return None
        now = self.clock() if at is None else at
        return found[0], max(0.0, now - found[1])

    def expired(self, lease: float, at: float | None = None) -> list[Held]:
        """The leases that stood still for their holder's length (``lease`` where a row
        does not say) plus ``TAKEOVER_MARGIN``: the ones a claim may take (none before a
        read that follows a failed one, or a pause in the reads longer than ``gap``)."""
        now = self.clock() if at is None else at
        if self._blind or now - self._read_at > self.gap:
            return []
        return [
            held
            for held, since in self._seen.values()
            if now - since >= (held.lease or lease) + TAKEOVER_MARGIN
        ]


def _same(a: Held, b: Held) -> bool:
    return (a.node, a.epoch, a.renewals) == (b.node, b.epoch, b.renewals)


@dataclass(frozen=True)
class Lease:
    """The right to run one task, as a claim granted it: every append carries ``epoch``;
    ``seq`` is the journal's last record at the claim (the new owner appends after it);
    ``expires`` is the server's time (shown, never compared)."""

    task_id: str
    node: str
    epoch: int
    seq: int
    expires: datetime | None = None
    previous: Previous | None = None  # the lease this claim took over, if it took one


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
    watch: LeaseWatch | None = None,
    expired: bool = True,
    registered: tuple[int, int] | None = None,
) -> list[Lease]:
    """Take up to ``limit`` runnable tasks for ``node`` for ``lease`` seconds: queued ones,
    ones whose backoff is over, and (with ``expired``) ones whose lease ``watch`` saw stand
    still for its length and the margin (none of ``exclude``). Each comes with a new epoch,
    which fences every earlier holder, and its record says ``running``; the leases held
    now go to ``watch``. Never blocks on another claim. With ``registered`` (the node's
    registration epoch and the daemon's pid), nothing is claimed once another daemon
    registered the name. Without ``watch``, a watch of this one read: it takes only
    tasks no lease holds."""
    watch = watch or LeaseWatch()
    now = watch.clock()
    stale = watch.expired(lease, now) if expired and limit > 0 else []
    epoch, pid = registered if registered is not None else (None, 0)
    params: dict[str, Any] = {"node": node, "limit": max(0, limit), "lease": lease}
    params |= {"exclude": list(exclude), "registered": epoch, "pid": pid}
    params |= {
        "ids": [h.task_id for h in stale],
        "epochs": [h.epoch for h in stale],
        "counts": [h.renewals for h in stale],
    }
    rows = conn.execute(CLAIM, params).fetchall()
    seen = watch.clock()
    ended = {h.task_id: h for h in stale}
    leases, held = [], []
    for claimed, task, epoch_now, seq, taken, was_node, was_epoch, renewals, length in rows:
        if not claimed:
            held.append(Held(task, was_node, int(epoch_now), int(renewals), length))
            continue
        previous = None
        if taken and task in ended:
            still = watch.still(task, now)
            over = (still[1] - (ended[task].lease or lease)) if still is not None else 0.0
            previous = Previous(str(was_node), int(was_epoch), wall_ago(max(0.0, over)))
        leases.append(Lease(task, node, int(epoch_now), int(seq), previous=previous))
    watch.observe(held, seen)
    return leases


def wall_ago(seconds: float) -> str:
    """The wall-clock time ``seconds`` ago, as events stamp theirs (UTC, ISO 8601)."""
    stamp = time.time() - seconds
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(stamp)) + f".{int(stamp % 1 * 1000):03d}Z"


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
