"""Who owns a task in the PostgreSQL store (docs/design.md section 10, invariant 10): the
lease on the task row, with an epoch that every write carries (``pglease``).

``acquire`` takes a lease when none is held, or one this process saw stand still for its
length (``pglease.LeaseWatch``: no wall clock decides), and bumps the epoch, which fences
every earlier owner; ``renew`` bumps its renewal count while the epoch is still the
owner's, ``release`` clears it. A cluster's node claims runnable tasks (``claim``), renews
its leases with its registration (``renew_all``), hands a lease to its next worker
(``handover``), and puts the task record as it releases a task (``put_record``); an
operator's command takes a frozen node's lease (``seize``). A write that moves the epoch
and lost its reply reads back, on its retry, whether the fence's refusal is its own
commit (``LostReplies``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import TYPE_CHECKING

from worker.errors import LockBusyError, StorageError, SupersededError
from worker.spool import validate_task_id
from worker.store import pglease
from worker.store.base import JSON, Owner, Seized
from worker.store.pgdatabase import LostReplies, jsonb
from worker.store.pgschema import state_of

if TYPE_CHECKING:
    from worker.store.pgdatabase import Database
    from worker.store.pgnodes import NodeRegistry


class TaskLeases:
    """The leases node ``node`` takes, renews and gives up, each ``lease`` seconds long,
    judged by this process's ``LeaseWatch`` on ``clock`` (monotonic); renewed with the
    node's registration in ``nodes`` while it holds one."""

    def __init__(
        self,
        db: Database,
        nodes: NodeRegistry,
        node: str,
        lease: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._db = db
        self._nodes = nodes
        self._node = node
        self._lease = lease
        # how long each held lease has stood still, as this process has seen it: the
        # one judge of a lease's end (claims, acquisitions, an operator's seizure)
        self._watch = pglease.LeaseWatch(clock=clock, gap=lease / 2)
        self._watch_guard = threading.Lock()
        self._lost_replies = LostReplies()

    # -- one task's lease --------------------------------------------------------------

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
        limit = (
            after if after is not None else (held.lease or self._lease) + pglease.TAKEOVER_MARGIN
        )
        return held if seconds >= limit else None

    def _take(
        self, task_id: str, stale: pglease.Held | None
    ) -> tuple[Owner | None, pglease.Held | None]:
        """One try at the task's lease: taken when free, or when it still stands as
        ``stale`` (a compare-and-set on the epoch and the count). Else the lease as it is
        now, watched (``_watch``)."""
        row = self._db.row(
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
            node=self._node,
            lease=self._lease,
            epoch=stale.epoch if stale is not None else -1,
            renewals=stale.renewals if stale is not None else -1,
        )
        taken, node, epoch, renewals, length, held = row
        if taken is not None:
            with self._watch_guard:
                self._watch.note(None, task_id)
            return Owner(task_id, self._node, int(taken)), None
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
            length = still[0].lease or self._lease
            if still[1] >= pglease.STALLED * length:
                stale, seconds = still
        owner, _ = self._take(task_id, stale)
        return None if owner is None else pglease.seized(owner, stale, seconds, self._lease)

    def renew(self, owner: Owner) -> None:
        lease = pglease.Lease(owner.task_id, self._node, owner.epoch, 0, _NEVER)
        with self._db.step() as conn:
            pglease.renew(conn, lease, self._lease)

    def release(self, owner: Owner) -> None:
        """Clear the lease, if it is still ``owner``'s (a stale release takes nothing), and
        move the epoch on: the released owner is fenced at once, not when a node next
        claims the task."""
        self._db.done(
            "WITH done AS (UPDATE tasks SET lease_expires = NULL, epoch = epoch + 1, "
            "updated_at = now() "
            "WHERE id = %(task)s AND epoch = %(epoch)s RETURNING 1)",
            owner.task_id,
            epoch=owner.epoch,
        )

    def owned(self, task_id: str) -> bool:
        """Whether a lease is held: until its holder releases it or another takes it over
        (no clock says it ended: ``pglease``)."""
        (held,) = self._db.row(
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
        mine = self._nodes.registration
        registered = (mine[0], mine[1]) if mine is not None else None
        try:
            with self._watch_guard, self._db.step() as conn:
                leases = pglease.claim(
                    conn,
                    self._node,
                    limit,
                    self._lease,
                    exclude,
                    watch=self._watch,
                    expired=expired,
                    registered=registered,
                )
        except StorageError:
            with self._watch_guard:  # nobody could renew meanwhile: that time does not count
                self._watch.blind()
            raise
        return [Owner(x.task_id, self._node, x.epoch, previous=x.previous) for x in leases]

    def handover(self, owner: Owner) -> Owner:
        """A new epoch for the same node; refused (``FencedError``) once the task or the
        node's registration moved."""
        mine = self._nodes.registration
        with self._lost_replies.unsure("handover", owner) as unsure:
            row = self._db.one(
                "UPDATE tasks SET epoch = epoch + 1, updated_at = now(), "
                "renewals = renewals + 1, lease_seconds = %(lease)s, "
                "lease_expires = now() + make_interval(secs => %(lease)s) "
                "WHERE id = %(task)s AND epoch = %(epoch)s AND (%(registered)s::bigint IS NULL "
                "OR EXISTS (SELECT 1 FROM nodes WHERE name = %(node)s AND epoch = %(registered)s "
                "AND pid = %(pid)s)) RETURNING epoch",
                {
                    "task": owner.task_id,
                    "epoch": owner.epoch,
                    "lease": self._lease,
                    "node": self._node,
                    "registered": mine[0] if mine is not None else None,
                    "pid": mine[1] if mine is not None else 0,
                },
            )
        if row is None and unsure:
            row = self._db.one(  # this handover's own commit, whose reply was lost?
                "SELECT epoch FROM tasks WHERE id = %(task)s AND epoch = %(epoch)s + 1 "
                "AND node = %(node)s AND lease_expires IS NOT NULL",
                {"task": owner.task_id, "epoch": owner.epoch, "node": self._node},
            )
        if row is None:
            raise pglease.fenced(owner)
        return Owner(owner.task_id, self._node, int(row[0]))

    def renew_all(self, owners: Sequence[Owner]) -> list[Owner]:
        if self._nodes.registration is not None:
            return self._renew_node(owners, self._nodes.registration)
        if not owners:
            return []
        with self._db.step() as conn:
            kept = {
                (task, epoch)
                for task, epoch in conn.execute(
                    "UPDATE tasks AS t SET lease_expires = now() + make_interval(secs => %s), "
                    "renewals = t.renewals + 1 "
                    "FROM unnest(%s::text[], %s::bigint[]) AS o (id, epoch) "
                    "WHERE t.id = o.id AND t.epoch = o.epoch RETURNING t.id, t.epoch",
                    (self._lease, [o.task_id for o in owners], [o.epoch for o in owners]),
                )
            }
        return [o for o in owners if (o.task_id, o.epoch) not in kept]

    def _renew_node(
        self, owners: Sequence[Owner], registration: tuple[int, int, str, int]
    ) -> list[Owner]:
        """The node's renewal and its leases', in one statement: the leases are renewed
        only while the node's registration is still this process's."""
        epoch, pid, host, workers = registration
        with self._db.step() as conn:
            row = conn.execute(
                _RENEW_NODE,
                {
                    "node": self._node,
                    "epoch": epoch,
                    "pid": pid,
                    "host": host,
                    "workers": workers,
                    "lease": self._lease,
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
                f"node {self._node!r} was {holder} since this daemon registered it (epoch "
                f"{epoch}); its workers stop, and it registers again once the name is free.",
                epoch,
                now,
            )
        kept = set(zip(ids, epochs, strict=True))
        return [o for o in owners if (o.task_id, o.epoch) not in kept]

    def put_record(
        self, owner: Owner, record: JSON, *, release: bool, runnable_in: float = 0.0
    ) -> None:
        with self._lost_replies.unsure("release", owner) as unsure:
            wrote = self._db.done(
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
                record=jsonb(record),
                state=state_of(record),
                release=release,
                delay=max(0.0, runnable_in),
                epoch=owner.epoch,
            )
        if not wrote and not (release and unsure and self._released_so(owner, record)):
            raise pglease.fenced(owner)

    def _released_so(self, owner: Owner, record: JSON) -> bool:
        """Whether the task is as ``owner``'s release of it with ``record`` left it: that
        release's commit, whose reply was lost (a claim since would have moved the epoch
        again, and changed the node or the record)."""
        return bool(
            self._db.one(
                "SELECT 1 FROM tasks WHERE id = %(task)s AND epoch = %(epoch)s + 1 "
                "AND node = %(node)s AND lease_expires IS NULL AND record = %(record)s::jsonb",
                {
                    "task": owner.task_id,
                    "epoch": owner.epoch,
                    "node": self._node,
                    "record": jsonb(record),
                },
            )
        )

    def orphans(self) -> list[tuple[Owner, JSON]]:
        """The leases held under this node's name on running tasks, each with its
        worker's latest beat: what a daemon started again on this node may adopt."""
        with self._db.step() as conn:
            rows = conn.execute(
                "SELECT t.id, t.epoch, h.beat FROM tasks t JOIN heartbeats h ON h.task = t.id "
                "WHERE t.node = %s AND t.lease_expires IS NOT NULL AND t.state = 'running' "
                "ORDER BY t.id",
                (self._node,),
            ).fetchall()
        return [(Owner(task, self._node, int(epoch)), dict(beat)) for task, epoch, beat in rows]

    def leases(self) -> dict[str, str]:
        with self._db.step() as conn:
            rows = conn.execute("SELECT id, node FROM tasks WHERE lease_expires IS NOT NULL")
            return {task: node for task, node in rows}


#: A node's renewal (``TaskLeases._renew_node``): its row, then its leases only if the
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
