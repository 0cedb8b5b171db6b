"""An in-memory ``SharedStore``: a cluster in one process, for tests of cluster logic that
need no database server (docs/design.md section 10).

A ``MemoryCluster`` is what the PostgreSQL database is to its nodes: the tasks, their
leases, the node table, the tokens, the operator locks and the wake-ups. Each node's
``MemorySharedStore`` is one daemon's view of it (``MemoryCluster.store``), as each
daemon has its own ``PostgresStore``; the task data is ``MemoryStore``'s, so every
``TaskStore`` promise is kept as it keeps it. The cluster conformance suite
(``worker.testing.shared_conformance``) runs on it and on PostgreSQL unchanged.

The leases are judged as the PostgreSQL store judges them (``pglease``): a claim, an
acquisition or a seizure takes a held lease only once this view watched it stand still
(its epoch and renewal count) for its length and the margin, on the cluster's ``clock``,
which a test moves by hand, so no test sleeps through a lease. Every epoch fences the
ones before it; a release moves the epoch on. Nothing is persisted, which is the point.

    cluster = MemoryCluster(clock=clock)
    a, b = cluster.store("a", lease=30.0), cluster.store("b", lease=30.0)
    (owner,) = a.claim(1)
"""

from __future__ import annotations

import contextlib
import itertools
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from worker.config import ClusterConfig
from worker.errors import (
    ConfigError,
    LockBusyError,
    RecordConflictError,
    SupersededError,
)
from worker.protocol import CLAIMABLE, TaskStatus
from worker.spool import TaskSpec, validate_task_id
from worker.store import pglease
from worker.store.base import JSON, NodeInfo, Owner, Previous, Seized, Version
from worker.store.durable import dump_json, load_json
from worker.store.memory import MemoryStore, _Task


def state_of(record: Mapping[str, Any]) -> str | None:
    """The record's state when it is one a task's row takes, else None (kept as it was)."""
    state = record.get("state")
    return state if isinstance(state, str) and state in tuple(TaskStatus) else None


@dataclass
class _Lease:
    """A task's lease and queue place: what PostgreSQL keeps on the task's row."""

    runnable_at: float
    order: int  # ties of ``runnable_at`` (one clock reading): the older first
    state: str = TaskStatus.QUEUED
    node: str | None = None
    held: bool = False
    renewals: int = 0
    length: float | None = None
    paused_until: float | None = None


@dataclass
class _Node:
    """A node's registration: the daemon (host and pid) that registered it (pid 0: left)."""

    host: str
    pid: int
    max_workers: int
    epoch: int
    seen_at: float


class MemoryCluster:
    """What every node of one in-memory cluster shares, under one lock; ``clock`` (a
    monotonic clock, seconds) judges leases, backoffs, pauses and node liveness."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.guard = threading.Condition(threading.RLock())
        self.tasks: dict[str, _Task] = {}
        self.leases: dict[str, _Lease] = {}
        self.nodes: dict[str, _Node] = {}
        self.tokens: dict[str, JSON] = {}
        self.locks: set[str] = set()
        self.listeners: list[threading.Event] = []
        self._order = itertools.count()

    def store(
        self, node: str, *, lease: float = ClusterConfig().lease, pid: int | None = None
    ) -> MemorySharedStore:
        """A new view of the cluster, as node ``node``, with ``lease`` seconds, for the
        daemon of process ``pid`` (default: this one's; another stands for a daemon of
        another process, whose live registration of a name refuses this one's)."""
        return MemorySharedStore(self, node=node, lease=lease, pid=pid)

    def queued(self, at: float | None = None) -> _Lease:
        """A queue place from now (or ``at``), behind every place given before."""
        return _Lease(self.clock() if at is None else at, next(self._order))

    def wake(self) -> None:
        with self.guard:
            for woken in self.listeners:
                woken.set()

    @contextlib.contextmanager
    def operator_lock(self, task_id: str, wait: float) -> Iterator[None]:
        key = validate_task_id(task_id)
        deadline = time.monotonic() + wait  # (a command's real wait, not the leases' clock)
        with self.guard:
            while key in self.locks:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise LockBusyError(f"another command holds task {task_id}'s operator lock")
                self.guard.wait(min(left, 0.05))
            self.locks.add(key)
        try:
            yield
        finally:
            with self.guard:
                self.locks.discard(key)
                self.guard.notify_all()


class MemorySharedStore(MemoryStore):
    """One node's ``SharedStore`` on a ``MemoryCluster`` (module docstring): the cluster's
    tasks, with its leases judged by this view's ``LeaseWatch``."""

    def __init__(
        self, cluster: MemoryCluster, *, node: str, lease: float, pid: int | None = None
    ) -> None:
        super().__init__(clock=cluster.clock)
        self.guard = cluster.guard  # (the tasks are the cluster's, under its one lock)
        self._tasks = cluster.tasks
        self._cluster = cluster
        self.node = node
        self.lease = lease
        self._watch = pglease.LeaseWatch(clock=cluster.clock, gap=lease / 2)
        self._registration: int | None = None  # this view's epoch as its node, once joined
        self._workers = 0  # the max_workers it registered with
        self._daemon = (socket.gethostname(), os.getpid() if pid is None else pid)

    def __repr__(self) -> str:
        return f"MemorySharedStore(node={self.node!r})"

    def close(self) -> None:
        """(Nothing to close.)"""

    def relogin(self, url: str) -> None:
        """(No login.)"""

    def _lease_of(self, task_id: str) -> tuple[_Task, _Lease]:
        """The task and its lease (the caller holds ``guard``); ``NotFoundError``."""
        return self.get(task_id), self._cluster.leases[validate_task_id(task_id)]

    # -- the task data: ``MemoryStore``'s, with the row's state kept beside it ------------

    def create(
        self,
        spec: TaskSpec,
        record: JSON,
        *,
        script: bytes | None = None,
        journal: Sequence[JSON] = (),
        prepare: Callable[[Path | None], None] | None = None,
    ) -> None:
        with self.guard:
            super().create(spec, record, script=script, journal=journal, prepare=prepare)
            place = self._cluster.queued()
            place.state = state_of(record) or TaskStatus.QUEUED
            self._cluster.leases[spec.id] = place

    def cas_record(
        self, task_id: str, expected: Version, record: JSON, *, durable: bool = True
    ) -> Version:
        with self.guard:
            version = super().cas_record(task_id, expected, record, durable=durable)
            lease = self._cluster.leases[task_id]
            lease.state = state_of(record) or lease.state
            return version

    def _put(self, task: _Task, lease: _Lease, record: JSON) -> None:
        task.record, task.version = dump_json(record), task.version + 1
        lease.state = state_of(record) or lease.state

    # -- one task's lease ----------------------------------------------------------------

    def fenced(self, owner: Owner) -> _Task:
        """The task's data while ``owner``'s epoch is still the task's, else ``FencedError``."""
        task = self.get(owner.task_id)
        if task.epoch != owner.epoch:
            raise pglease.fenced(owner)
        return task

    def check_fence(self, owner: Owner) -> None:
        with self.guard:
            self.fenced(owner)

    def _take(self, task_id: str, stale: pglease.Held | None) -> Owner | None:
        """The task's lease, taken when none is held or when it still stands as ``stale``
        (its epoch and count); else None, the lease as it is now watched."""
        task, lease = self._lease_of(task_id)
        if lease.held and not (
            stale is not None and (stale.epoch, stale.renewals) == (task.epoch, lease.renewals)
        ):
            held = pglease.Held(task_id, str(lease.node), task.epoch, lease.renewals, lease.length)
            self._watch.note(held, task_id)
            return None
        task.epoch += 1
        lease.node, lease.held, lease.length = self.node, True, self.lease
        lease.renewals += 1
        self._watch.note(None, task_id)
        return Owner(task_id, self.node, task.epoch)

    def acquire(self, task_id: str, *, wait: float = 0.0) -> Owner:
        deadline = time.monotonic() + wait
        with self.guard:
            while True:
                stale = None
                still = self._watch.still(task_id)
                if still is not None:
                    length = still[0].lease or self.lease
                    stale = still[0] if still[1] >= length + pglease.TAKEOVER_MARGIN else None
                owner = self._take(task_id, stale)
                if owner is not None:
                    return owner
                left = deadline - time.monotonic()
                if left <= 0:
                    holder = self._cluster.leases[task_id].node
                    raise LockBusyError(
                        f"task {task_id} is owned by {holder}; another worker is running "
                        "this task. Wait for it to exit or stop it first."
                    )
                self.guard.wait(min(left, 0.05))

    def seize(self, task_id: str) -> Seized | None:
        with self.guard:
            still = self._watch.still(task_id)
            stale, seconds = None, 0.0
            if still is not None and still[1] >= pglease.STALLED * (still[0].lease or self.lease):
                stale, seconds = still
            owner = self._take(task_id, stale)
        return None if owner is None else pglease.seized(owner, stale, seconds, self.lease)

    def renew(self, owner: Owner) -> None:
        with self.guard:
            self.fenced(owner)
            lease = self._cluster.leases[owner.task_id]
            lease.renewals, lease.length = lease.renewals + 1, self.lease

    def release(self, owner: Owner) -> None:
        """Clear the lease if it is still ``owner``'s, and move the epoch on."""
        with self.guard:
            task, lease = self._lease_of(owner.task_id)
            if task.epoch == owner.epoch:
                task.epoch += 1
                lease.held = False
                self.guard.notify_all()

    def owned(self, task_id: str) -> bool:
        with self.guard:
            return self._lease_of(task_id)[1].held

    def owner_pid(self, task_id: str) -> int | None:
        """None: a lease names the node that holds it, not a process."""
        validate_task_id(task_id)
        return None

    # -- the cluster -------------------------------------------------------------------

    def _registered(self) -> bool:
        """Whether this view may claim: not joined, or still the node's registration."""
        if self._registration is None:
            return True
        row = self._cluster.nodes.get(self.node)
        return row is not None and (row.host, row.pid, row.epoch) == (
            *self._daemon,
            self._registration,
        )

    def claim(
        self, limit: int, *, exclude: Sequence[str] = (), expired: bool = True
    ) -> list[Owner]:
        with self.guard:
            now = self._cluster.clock()
            stale = {
                h.task_id: h
                for h in (self._watch.expired(self.lease, now) if expired and limit > 0 else [])
            }
            rows = [(t, self._tasks[t], lease) for t, lease in self._cluster.leases.items()]
            held = [
                pglease.Held(t, str(lease.node), task.epoch, lease.renewals, lease.length)
                for t, task, lease in rows
                if lease.held and lease.state in CLAIMABLE
            ]
            picked = sorted(
                (
                    (lease.runnable_at, lease.order, t)
                    for t, task, lease in rows
                    if lease.state in CLAIMABLE
                    and (lease.state != TaskStatus.BACKOFF or lease.runnable_at <= now)
                    and (not lease.held or self._stood_still(stale.get(t), task, lease))
                    and (lease.paused_until is None or lease.paused_until <= now)
                    and t not in exclude
                )
            )[: max(0, limit) if self._registered() else 0]
            owners = [self._claimed(t, stale.get(t), now) for _, _, t in picked]
            self._watch.observe(held, now)
            return owners

    @staticmethod
    def _stood_still(seen: pglease.Held | None, task: _Task, lease: _Lease) -> bool:
        return seen is not None and (seen.epoch, seen.renewals) == (task.epoch, lease.renewals)

    def _claimed(self, task_id: str, stale: pglease.Held | None, now: float) -> Owner:
        """Claim the task for this node: a new epoch, a lease, its record says running."""
        task, lease = self._lease_of(task_id)
        previous = None
        if lease.held and stale is not None:
            still = self._watch.still(task_id, now)
            over = still[1] - (stale.lease or self.lease) if still is not None else 0.0
            previous = Previous(str(lease.node), task.epoch, pglease.wall_ago(max(0.0, over)))
        record = dict(load_json(task.record))
        self._put(task, lease, {**record, "state": TaskStatus.RUNNING})
        task.epoch += 1
        lease.node, lease.held, lease.length = self.node, True, self.lease
        lease.renewals += 1
        return Owner(task_id, self.node, task.epoch, previous=previous)

    def handover(self, owner: Owner) -> Owner:
        with self.guard:
            task, lease = self._lease_of(owner.task_id)
            if task.epoch != owner.epoch or not self._registered():
                raise pglease.fenced(owner)
            task.epoch += 1
            lease.held, lease.length, lease.renewals = True, self.lease, lease.renewals + 1
            return Owner(owner.task_id, self.node, task.epoch)

    def renew_all(self, owners: Sequence[Owner]) -> list[Owner]:
        with self.guard:
            if self._registration is not None:
                row = self._cluster.nodes.get(self.node)
                if row is None or not self._registered():
                    self._superseded(row)
                row.seen_at = self._cluster.clock()
                row.max_workers = self._workers
            moved = []
            for owner in owners:
                task = self._tasks.get(owner.task_id)
                if task is None or task.epoch != owner.epoch:
                    moved.append(owner)
                    continue
                self._cluster.leases[owner.task_id].renewals += 1
            return moved

    def _superseded(self, row: _Node | None) -> NoReturn:
        epoch = self._registration or 0
        now = None if row is None else (row.epoch, row.pid, row.host)
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

    def put_record(
        self, owner: Owner, record: JSON, *, release: bool, runnable_in: float = 0.0
    ) -> None:
        with self.guard:
            task, lease = self._lease_of(owner.task_id)
            if task.epoch != owner.epoch:
                raise pglease.fenced(owner)
            self._put(task, lease, record)
            if release:
                place = self._cluster.queued(self._cluster.clock() + max(0.0, runnable_in))
                lease.runnable_at, lease.order = place.runnable_at, place.order
                lease.held = False
                task.epoch += 1
                self.guard.notify_all()

    def leases(self) -> dict[str, str]:
        with self.guard:
            return {t: str(x.node) for t, x in self._cluster.leases.items() if x.held}

    def orphans(self) -> list[tuple[Owner, JSON]]:
        with self.guard:
            return [
                (Owner(t, self.node, self._tasks[t].epoch), dict(load_json(beat)))
                for t, lease in sorted(self._cluster.leases.items())
                if lease.held
                and lease.node == self.node
                and lease.state == TaskStatus.RUNNING
                and (beat := self._tasks[t].heartbeat) is not None
            ]

    # -- the nodes -----------------------------------------------------------------------

    def join(self, max_workers: int) -> int:
        with self.guard:
            now = self._cluster.clock()
            row = self._cluster.nodes.get(self.node)
            if row is not None and row.seen_at > now - self.lease:
                mine = (row.host, row.pid) == self._daemon
                if not mine or self._registration not in (None, row.epoch):
                    raise ConfigError(
                        f"node name {self.node!r} is in use by a live node (pid {row.pid} on "
                        f"{row.host}); give this node another name with --node or `node`."
                    )
            epoch = 1 if row is None else row.epoch + 1
            host, pid = self._daemon
            self._cluster.nodes[self.node] = _Node(host, pid, max_workers, epoch, now)
            self._registration, self._workers = epoch, max_workers
            return epoch

    def leave(self) -> None:
        """The name is free; its epoch is kept, so the next registration takes the next."""
        with self.guard:
            self._registration = None
            row = self._cluster.nodes.get(self.node)
            if row is not None and (row.host, row.pid) == self._daemon:
                row.pid, row.seen_at = 0, -float("inf")

    def nodes(self) -> list[NodeInfo]:
        with self.guard:
            now = self._cluster.clock()
            held = [x.node for x in self._cluster.leases.values() if x.held]
            return [
                NodeInfo(
                    name,
                    row.host,
                    row.pid,
                    row.max_workers,
                    held.count(name),
                    max(0.0, now - row.seen_at),
                    now - row.seen_at <= self.lease,
                    row.epoch,
                )
                for name, row in sorted(self._cluster.nodes.items())
                if row.pid > 0
            ]

    # -- coordination ----------------------------------------------------------------------

    def operator_lock(self, task_id: str, wait: float) -> contextlib.AbstractContextManager[None]:
        return self._cluster.operator_lock(task_id, wait)

    def request_pause(self, task_id: str, seconds: float) -> None:
        with self.guard:
            self._lease_of(task_id)[1].paused_until = self._cluster.clock() + seconds

    def end_pause(self, task_id: str) -> None:
        with self.guard:
            self._lease_of(task_id)[1].paused_until = None

    def pause_requested(self, task_id: str) -> bool:
        with self.guard:
            until = self._lease_of(task_id)[1].paused_until
            return until is not None and until > self._cluster.clock()

    def wake(self, task_id: str) -> None:
        validate_task_id(task_id)
        self._cluster.wake()

    def listen(self, on_wake: Callable[[], None]) -> Callable[[], None]:
        """``on_wake`` is called from a thread of its own: once at the start (as a
        listener that connects), then after every wake."""
        woken, stop = threading.Event(), threading.Event()
        woken.set()
        with self.guard:
            self._cluster.listeners.append(woken)

        def run() -> None:
            while not stop.is_set():
                if woken.wait(0.5) and not stop.is_set():
                    woken.clear()
                    on_wake()

        def stop_listening() -> None:
            stop.set()
            with self.guard:
                if woken in self._cluster.listeners:
                    self._cluster.listeners.remove(woken)

        threading.Thread(target=run, name="agentd-listen", daemon=True).start()
        return stop_listening

    # -- the console's API tokens ------------------------------------------------------------

    def add_token(self, token: JSON) -> None:
        with self.guard:
            kept = self._cluster.tokens
            if token["id"] in kept or any(t["digest"] == token["digest"] for t in kept.values()):
                raise RecordConflictError(f"an API token {token['id']} exists already")
            kept[token["id"]] = {k: token[k] for k in ("id", "digest", "by", "created_at")}

    def tokens(self) -> list[JSON]:
        with self.guard:
            found = sorted(self._cluster.tokens.values(), key=lambda t: (t["created_at"], t["id"]))
            return [dict(t) for t in found]

    def token(self, digest: str) -> JSON | None:
        with self.guard:
            found = [t for t in self._cluster.tokens.values() if t["digest"] == digest]
            return dict(found[0]) if found else None

    def revoke_token(self, token_id: str) -> bool:
        with self.guard:
            return self._cluster.tokens.pop(token_id, None) is not None
