"""Placement: where the daemon's tasks come from, and whose record is whose to write
(docs/design.md sections 7 and 10). One Protocol, two roles of the daemon:

* ``LocalPlacement``: the tasks are the spool's folders. It scans them (the tasks a
  doorbell names, and all of them every ``RESCAN_INTERVAL`` seconds), adopts the worker a
  task's lock names or resumes the task, and starts the oldest that may run as places
  free up.
* ``ClusterPlacement``: the tasks are a shared store's queue (``SharedStore``). This node
  claims what it has room for, each claim an epoch and a lease that its workers renew and
  that it renews for them every third of a lease; its writes are fenced by the claim, and
  a claim taken over is let go at once. A database at fault is a wait (invariant 8); a
  node whose name another daemon registered stops its workers and waits for the name.

Both read and move the daemon's slots on its loop, through its one transition
(``Supervisor.save``, ``Supervisor.move``) and its one way to start a worker
(``Supervisor.start``). The daemon never asks which placement it has: every difference
between one machine and a cluster is here.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from supervisor.decisions import pending_decisions
from supervisor.exits import KillReason
from supervisor.record import TaskRecord
from supervisor.slot import TaskSlot
from supervisor.workers import adopt, adopt_claimed, process_started
from worker.config import node_name
from worker.errors import AgentdError, ConfigError, FencedError, StorageError, SupersededError
from worker.events import Event
from worker.protocol import FINAL_STATES, LEASE_ENV, NODE_ENV, TaskStatus
from worker.store.base import Owner, SharedStore

if TYPE_CHECKING:
    from supervisor.daemon import Supervisor

#: Seconds between two scans of the whole spool when nothing rang the doorbell (inotify
#: reports each change at once; the scan makes sure a missed one never strands a task).
RESCAN_INTERVAL = 5.0
#: A task whose worker runs is looked at by one rescan in this many: its worker's events
#: and every command on it ring its doorbell, so the scan is only the net for a lost one
#: (a minute, spread over the rescans; a spool of idle workers is not read every 5 s).
WORKER_RESCAN_STRIDE = 12
#: On a shared store: seconds between two claims of a node that is not woken (NOTIFY
#: wakes it at once; polling is the truth), and how long a task whose workspace this node
#: cannot see is left to the other nodes before it is tried here again.
CLAIM_POLL = 0.25
UNSEEN_PATIENCE = 30.0


class Placement(Protocol):
    """Where a daemon's tasks come from (the spool, or a shared store's queue), and how
    their records are written."""

    #: Whether the tasks are a shared store's (the sandbox's mode, an exit's verdict).
    clustered: bool
    #: Seconds the loop waits for a wake-up before it looks for work again.
    poll: float
    #: (monotonic) when the store was last at fault: no hang is judged within a timeout
    #: of it, for a worker could not beat then (``Supervisor._check``).
    away_at: float

    @property
    def node(self) -> str:
        """This node's name (hooks, ``supervisor.json``)."""
        ...

    def worker_env(self) -> dict[str, str]:
        """What every worker's environment carries for this placement."""
        ...

    def join(self, wake: Callable[[], None]) -> dict[str, Any]:
        """Before the first scan: join (a cluster's node registers; ``ConfigError`` when
        its name is taken) and have ``wake`` called, from any thread, when work may have
        come. Returns what ``supervisor_started`` says of it."""
        ...

    def adopt(self) -> None:
        """At the start, before the first scan: take back the workers an earlier daemon
        left running."""
        ...

    def leave(self) -> None:
        """At the stop, whatever happened: let the node's name go."""
        ...

    def rescan(self) -> None:
        """Bring every task of this daemon's into its view, relay the events other
        processes wrote, and apply pending requests."""
        ...

    def rescan_due(self, elapsed: float) -> bool:
        """Whether a whole rescan is due ``elapsed`` seconds after the last one, when the
        loop's wait (``poll``) ran out with no wake-up."""
        ...

    def ring(self, tasks: set[str] | None) -> None:
        """A doorbell: the tasks a command or a worker named (None: all of them)."""
        ...

    def schedule(self, free: int, now: float) -> None:
        """Start workers for up to ``free`` tasks that may run now."""
        ...

    def writer(self, slot: TaskSlot, write: Callable[[], None]) -> Callable[[], None] | None:
        """The write of ``slot``'s record (``write``: to the spool's files), or None when it
        is not this daemon's to write."""
        ...

    def fenced(self, slot: TaskSlot) -> None:
        """``slot``'s worker stopped because it lost (or could not renew) its lease."""
        ...

    def new_epoch(self, slot: TaskSlot) -> bool:
        """Before ``slot``'s task is restarted here at once: False if it is no longer this
        node's."""
        ...

    def tick(self, now: float) -> None:
        """The daemon's tick: what must be done every so often whatever happens."""
        ...

    def relogin(self, secret: str) -> None:
        """The store's credential changed (SIGHUP): use it from the next login on."""
        ...

    def nodes_alive(self) -> int | None:
        """The live nodes of the cluster (a metric), or None."""
        ...


class LocalPlacement:
    """The tasks of one spool, run on this machine (module docstring)."""

    clustered = False
    poll = RESCAN_INTERVAL

    def __init__(self, daemon: Supervisor) -> None:
        self.daemon = daemon
        self.away_at = -math.inf
        self._scanned = False  # the first rescan is done: tasks found later are new
        self._unreadable: set[str] = set()  # task folders it was refused (warned once each)
        # tasks at rest when last scanned, and their mark then (``TaskStore.rest_mark``)
        self._resting: dict[str, tuple[int, ...]] = {}
        self._rescans = 0
        self._every_worker = False  # this rescan looks at every running worker's task

    @property
    def node(self) -> str:
        return node_name()

    def worker_env(self) -> dict[str, str]:
        return {}

    def join(self, wake: Callable[[], None]) -> dict[str, Any]:
        return {}  # (the inbox's watch wakes the daemon: ``supervisor.inbox``)

    def adopt(self) -> None:
        """Nothing ahead of the scan: the first scan adopts each task's worker
        (``_recover``)."""

    def leave(self) -> None:
        pass

    def rescan(self, *, every_worker: bool = False) -> None:
        """Look at the spool's tasks: those at rest whose folder changed, and a running
        worker's at its turn (``_net_turn``), or each (``every_worker``: a doorbell for
        every task, which may stand for a command on any of them)."""
        self._rescans += 1
        self._every_worker = every_worker
        try:
            for task_id in self.daemon.store.task_ids():
                self._look_at(task_id, rung=False)
        finally:
            self._every_worker = False
        self._scanned = True

    def rescan_due(self, elapsed: float) -> bool:
        return True

    def ring(self, tasks: set[str] | None) -> None:
        if tasks is None:
            self.rescan(every_worker=True)
            return
        for task_id in sorted(tasks):
            self._look_at(task_id, rung=True)

    def _look_at(self, task_id: str, *, rung: bool) -> None:
        """``_scan`` one task of the spool (``rung``: its doorbell rang); a folder it
        cannot read (another user's) is warned about once, and the rest go on."""
        try:
            self._scan(task_id, rung=rung)
        except OSError as exc:
            if task_id not in self._unreadable:
                self._unreadable.add(task_id)
                where = exc.filename or self.daemon.spool.task(task_id).path
                self.daemon.log.warning(
                    Event.TASK_UNREADABLE,
                    task=task_id,
                    reason=f"{where}: {exc.strerror or exc}",
                    hint="give the task folder to the user agentd runs as, or remove it",
                )
        else:
            self._unreadable.discard(task_id)

    def _scan(self, task_id: str, *, rung: bool) -> None:
        """Bring one task into the view: its record the first time (``_recover``), the
        events other processes wrote, the requests and decisions waiting for it. A task at
        rest (no worker, none starting, no pause) is skipped by a rescan while nothing of it
        changed since its last scan (``TaskStore.rest_mark``, taken first): the rescan of a
        spool that keeps thousands of finished or held tasks reads none of them, and a
        change whose doorbell was lost is still found by the next rescan."""
        daemon = self.daemon
        slot = daemon.slots.get(task_id)
        if not rung and slot is not None and not self._net_turn(slot):
            return
        task = slot.task if slot is not None else daemon.spool.task(task_id)
        mark = daemon.store.rest_mark(task_id) if slot is None or at_rest(slot) else None
        if mark is not None and not rung and self._resting.get(task_id) == mark:
            return
        self._resting.pop(task_id, None)
        if not daemon.store.exists(task_id):
            if slot is not None:
                daemon.housekeeper.forget(task_id)  # removed (`agentd prune`)
            return
        if slot is None:
            slot = daemon.slots[task.id] = TaskSlot(task, TaskRecord.load(task))
            daemon.relay.track(task.id, from_end=not self._scanned)
            self._recover(slot)
        elif slot.record.foreground and slot.worker is None:
            slot.record = TaskRecord.load(task)  # `agentd run` writes it, not this daemon
        daemon.relay.pull(task.id)
        daemon.requests.apply(slot)
        if slot.record.foreground:
            pass  # its `agentd run` carries out its decisions
        elif slot.record.state == TaskStatus.HELD and pending_decisions(task):
            daemon.move(slot, TaskRecord.release_hold)
        if mark is not None and at_rest(slot):
            self._resting[task_id] = mark

    def _net_turn(self, slot: TaskSlot) -> bool:
        """Whether a rescan looks at ``slot`` now: always, but at a running worker's task
        only at its turn, one rescan in ``WORKER_RESCAN_STRIDE`` (its doorbell rings)."""
        worker = slot.worker
        if worker is None or slot.paused or worker.kill_reason is not None or self._every_worker:
            return True
        return (self._rescans + worker.pid) % WORKER_RESCAN_STRIDE == 0

    def _recover(self, slot: TaskSlot) -> None:
        """A task seen for the first time by this daemon: adopt the worker that holds its
        lock (one an earlier daemon started, recorded or not), or resume it. A worker that
        outlived a killed daemon and whose task was cancelled meanwhile is adopted too, to be
        stopped (``Supervisor.apply_requests``): a cancelled task runs nothing more. A
        foreground task is left alone: ``agentd run`` runs its worker (docs/design.md
        section 16)."""
        daemon = self.daemon
        if slot.record.foreground:
            return
        final = slot.record.state in FINAL_STATES
        if final and not daemon.store.cancel_requested(slot.task.id):
            return
        worker = adopt(slot.task)
        if worker is not None:
            daemon.launcher.attach(slot, worker)
            if not final:  # (a cancelled task's worker is adopted only to be stopped)
                started = process_started(worker.pid)
                daemon.save(slot, TaskStatus.RUNNING, pid=worker.pid, pid_started=started)
            daemon.emit(Event.WORKER_ADOPTED, slot, pid=worker.pid)
        elif final:
            return
        elif daemon.store.owned(slot.task.id):
            slot.waiting_lock = True
            daemon.emit(Event.WORKER_LOCK_WAIT, slot, level="warning")
        elif slot.record.state in (TaskStatus.RUNNING, TaskStatus.BACKOFF):
            daemon.save(slot, TaskStatus.QUEUED)

    def schedule(self, free: int, now: float) -> None:
        """The tasks that could start, oldest first (a spool keeps every finished task)."""
        daemon = self.daemon
        waiting = [
            slot
            for slot in daemon.slots.values()
            if slot.worker is None
            and not slot.starting
            and not slot.paused
            and not slot.record.foreground  # `agentd run` starts it, or `retry` hands it over
            and (slot.waiting_lock or slot.record.state in (TaskStatus.BACKOFF, TaskStatus.QUEUED))
        ]
        for slot in sorted(waiting, key=lambda s: s.record.updated_at):
            if free <= 0:
                break
            state = slot.record.state
            if slot.waiting_lock:
                if daemon.store.owned(slot.task.id):
                    continue
                slot.waiting_lock = False
            elif state == TaskStatus.BACKOFF:
                if now < slot.due:
                    continue
            elif state != TaskStatus.QUEUED:
                continue
            daemon.launcher.start(slot)
            free -= 1

    def writer(self, slot: TaskSlot, write: Callable[[], None]) -> Callable[[], None] | None:
        return write

    def fenced(self, slot: TaskSlot) -> None:
        """(A worker on the spool's files holds no lease.)"""

    def new_epoch(self, slot: TaskSlot) -> bool:
        return True

    def tick(self, now: float) -> None:
        """(A worker rings for its own events: ``Spool.ring``.)"""

    def relogin(self, secret: str) -> None:
        pass

    def nodes_alive(self) -> int | None:
        return None


def at_rest(slot: TaskSlot) -> bool:
    """Whether nothing but a change in its folder can move ``slot``'s task: no worker,
    none being started, no pause (whose holder may die: looked at each rescan)."""
    return slot.worker is None and not slot.starting and not slot.paused


class ClusterPlacement:
    """This node's part of a cluster on a shared store (module docstring)."""

    clustered = True
    poll = CLAIM_POLL

    def __init__(self, daemon: Supervisor, shared: SharedStore) -> None:
        self.daemon = daemon
        self.shared = shared  # the queue, the leases and the nodes
        self.away_at = -math.inf
        self._unseen: dict[str, float] = {}  # task -> when this node tries its workspace again
        self._renewed = 0.0  # when this node last renewed its leases (and said it is alive)
        self._away = False  # the shared store could not be reached by the last claim or renewal
        self._claim_expired_at = 0.0  # (monotonic) no claim of a lease that ran out before
        # another daemon registered this node's name (``_superseded``): this one runs
        # nothing and claims nothing until it can register the name again
        self._superseded_by: SupersededError | None = None
        self._stop_listening: Callable[[], None] | None = None

    @property
    def node(self) -> str:
        return self.shared.node

    def worker_env(self) -> dict[str, str]:
        # (the store's URL travels with the other secrets)
        return {NODE_ENV: self.shared.node, LEASE_ENV: f"{self.shared.lease}"}

    def join(self, wake: Callable[[], None]) -> dict[str, Any]:
        epoch = self.shared.join(self.daemon.config.max_workers)  # (ConfigError: taken)
        self._stop_listening = self.shared.listen(wake)
        return {"node": self.shared.node, "epoch": epoch, "store": repr(self.shared)}

    def leave(self) -> None:
        if self._stop_listening is not None:
            self._stop_listening()
        with contextlib.suppress(StorageError):
            self.shared.leave()

    def adopt(self) -> None:
        """A node started again on a shared store (its last daemon killed, its workers
        not): adopt each worker that still runs one of its claims, as ``LocalPlacement``
        does on a spool (``workers.adopt_claimed`` says how one is told); a claim whose
        worker is gone runs out, and the task is claimed again."""
        daemon = self.daemon
        try:
            orphans = self.shared.orphans()
        except StorageError:
            return  # the database is away: those claims run out, as a dead node's do
        for owner, beat in orphans:
            task = daemon.spool.task(owner.task_id)
            worker = adopt_claimed(task, owner, beat)
            if worker is None:
                continue
            try:
                record = TaskRecord.load(task)
            except StorageError:
                worker.close()
                continue
            slot = daemon.slots[task.id] = TaskSlot(task, record, owner=owner)
            daemon.relay.track(task.id, from_end=True)
            daemon.launcher.attach(slot, worker)
            pid_started = process_started(worker.pid)
            daemon.save(slot, TaskStatus.RUNNING, pid=worker.pid, pid_started=pid_started)
            daemon.emit(Event.WORKER_ADOPTED, slot, pid=worker.pid, epoch=owner.epoch)

    def rescan(self) -> None:
        """The view is the tasks this node claimed (``_claim``): the others are other
        nodes' or the queue's, and operators' moves on them are the CLI's (compare-and-set
        in the database)."""
        daemon = self.daemon
        for mine in list(daemon.slots.values()):
            daemon.relay.pull(mine.task.id)
            with contextlib.suppress(StorageError):  # the database is away: next time
                daemon.requests.apply(mine)

    def rescan_due(self, elapsed: float) -> bool:
        # (the loop comes round every CLAIM_POLL to claim: a dead node's lease ends
        # unannounced; the whole view is looked at every RESCAN_INTERVAL)
        return elapsed >= RESCAN_INTERVAL

    def ring(self, tasks: set[str] | None) -> None:
        self.rescan()

    def schedule(self, free: int, now: float) -> None:
        if self._superseded_by is None:
            self._claim(free, now)

    def _claim(self, free: int, now: float) -> None:
        """Take up to ``free`` runnable tasks from the shared queue and start a worker for
        each, under the claim (its epoch goes to the worker: ``EPOCH_ENV``). A task whose
        workspace this node cannot see is given back, saying why, and left to the other
        nodes for ``UNSEEN_PATIENCE`` seconds."""
        daemon = self.daemon
        self._unseen = {t: until for t, until in self._unseen.items() if until > now}
        try:
            # (not this node's own tasks: a lease that ran out while the database was away
            # is renewed by their running workers, not claimed a second time)
            # (nor, for a lease after the store was at fault, a task whose lease ran out
            # meanwhile: its holder could not renew it either, and renews it now)
            owners = self.shared.claim(
                free, exclude=[*self._unseen, *daemon.slots], expired=now >= self._claim_expired_at
            )
        except StorageError as exc:
            self._store_away(exc)
            return
        self._store_back()
        # every claim is told as it was made, before any worker starts: the tenth task of a
        # takeover was claimed with the first, not nine worker starts later
        claimed = [slot for owner in owners if (slot := self._claimed(owner)) is not None]
        for slot in claimed:
            unseen = self._unseen_workspace(slot)
            if unseen is not None:
                self._unseen[slot.task.id] = now + UNSEEN_PATIENCE
                daemon.emit(Event.WORKSPACE_UNSEEN, slot, level="warning", why=unseen)
                daemon.save(slot, TaskStatus.QUEUED, reason=unseen)
            elif daemon.requests.cancel_requested(slot):
                daemon.requests.cancel(slot)
            else:
                daemon.launcher.start(slot)

    def _claimed(self, owner: Owner) -> TaskSlot | None:
        """The slot of a task just claimed, its claim (and a takeover) told; None when the
        database went away after the claim (the lease ends)."""
        daemon = self.daemon
        task = daemon.spool.task(owner.task_id)
        try:
            record = TaskRecord.load(task)
        except StorageError:
            return None
        slot = daemon.slots[task.id] = TaskSlot(task, record, owner=owner)
        daemon.relay.track(task.id, from_end=True)
        taken: dict[str, Any] = {}
        if owner.previous is not None:  # (from a node that let its lease stand still)
            taken["taken_over"] = owner.previous.to_json()
        daemon.emit(Event.TASK_CLAIMED, slot, node=owner.holder, epoch=owner.epoch, **taken)
        if owner.previous is not None:  # its node died, froze or was cut off: ours now
            previous = owner.previous.node
            daemon.emit(Event.TASK_ADOPTED, slot, node=owner.holder, from_node=previous)
        return slot

    def _store_away(self, exc: StorageError) -> None:
        """A claim or a renewal met a shared store at fault (away, read-only, refusing the
        login...): logged once per outage (``storage_fault``, naming the cause), not at
        every tick; the tasks wait (invariant 8)."""
        daemon = self.daemon
        self.away_at = daemon.clock()
        if not self._away:
            self._away = True
            daemon.metrics.storage_faults += 1
            daemon.log.warning(
                Event.STORAGE_FAULT, error=str(exc), cause=exc.cause, store=repr(self.shared)
            )

    def _store_back(self) -> None:
        if self._away:
            self._away = False
            self._claim_expired_at = self.daemon.clock() + self.shared.lease
            self.daemon.log.info(Event.STORAGE_RECOVERED, store=repr(self.shared))

    def _unseen_workspace(self, slot: TaskSlot) -> str | None:
        """Why this node cannot run ``slot``'s task here (its workspace is not a folder
        it can see: a shared mount missing on this node), or None."""
        try:
            spec = self.daemon.store.load_spec(slot.task.id)
        except (AgentdError, OSError):
            return None  # the worker says what is wrong with the spec, as on one machine
        if spec.workspace is None or Path(spec.workspace).is_dir():
            return None
        return (
            f"waiting: its workspace {spec.workspace} is not a folder on node "
            f"{self.shared.node}; mount it there or let another node run the task"
        )

    def writer(self, slot: TaskSlot, write: Callable[[], None]) -> Callable[[], None] | None:
        """The write of ``slot``'s record on a shared store, fenced by this node's claim
        (None: the claim was lost, the record is not this node's to write): a task this
        node no longer runs is released with it (claimable again when its backoff ends)
        and leaves this node's view. A write the fence refuses (the lease was taken over)
        is the new owner's to make: ``lease_lost``, nothing written."""
        owner = slot.owner
        if owner is None:
            return None
        record = slot.record
        release = slot.worker is None and not slot.starting and record.state != TaskStatus.RUNNING
        due = slot.due - self.daemon.clock()
        delay = max(0.0, due) if record.state == TaskStatus.BACKOFF else 0.0
        data = record.stamped()
        if release:
            self._forget(slot)
        shared = self.shared

        def fenced_write() -> None:
            try:
                shared.put_record(owner, data, release=release, runnable_in=delay)
            except FencedError as exc:
                self.lease_lost(owner, str(exc))

        return fenced_write

    def _forget(self, slot: TaskSlot) -> None:
        """A task this node no longer runs leaves its view."""
        daemon = self.daemon
        if daemon.slots.get(slot.task.id) is slot:
            del daemon.slots[slot.task.id]
            daemon.relay.forget(slot.task.id)
            daemon.metrics.forget(slot.task.id)
        slot.owner = None

    def lease_lost(self, owner: Owner, why: str) -> None:
        """The claim ``owner`` was taken over: whatever of it runs here stops at once (its
        appends are refused anyway), and the task leaves this node's view. Only that
        claim's: a write kept from an earlier claim (refused once the database is back)
        must not stop a worker this node runs under a later claim of the same task."""
        daemon = self.daemon
        daemon.metrics.lease_lost += 1
        slot = daemon.slots.get(owner.task_id)
        if slot is None or slot.owner != owner:
            daemon.log.warning(Event.LEASE_LOST, task=owner.task_id, epoch=owner.epoch, why=why)
            return
        daemon.emit(Event.LEASE_LOST, slot, level="warning", why=why)
        if slot.worker is not None:
            slot.worker.kill_reason = KillReason.LEASE_LOST
            slot.worker.signal_group(signal.SIGKILL)
        self._forget(slot)

    def fenced(self, slot: TaskSlot) -> None:
        """A worker on a shared store stopped by itself: its lease moved, or it could not
        renew it in time (``worker.lease``). If another claim took the task, it is that
        node's; if the lease merely ran out (the database was away), the task is given
        back to the queue, the same as a stop: no crash, nothing run twice."""
        owner = slot.owner
        if owner is None:
            return
        try:
            self.shared.check_fence(owner)
        except FencedError as exc:
            self.lease_lost(owner, str(exc))
            return
        except StorageError:
            pass  # the database is away: the write below waits for it
        self.daemon.save(slot, TaskStatus.QUEUED, reason=None)

    def new_epoch(self, slot: TaskSlot) -> bool:
        """Before this node restarts a task at once: a new epoch for the new worker
        (``SharedStore.handover``), so nothing of the last one can append again; False
        when the claim was lost meanwhile. (The database away: the last epoch serves, its
        worker is dead and its group killed.)"""
        if slot.owner is None:
            return True
        try:
            slot.owner = self.shared.handover(slot.owner)
        except FencedError as exc:
            self.lease_lost(slot.owner, str(exc))
            return False
        except StorageError:
            pass
        return True

    def tick(self, now: float) -> None:
        self._tend_leases(now)
        # the workers' events (on the spool a worker rings for its own: Spool.ring)
        daemon = self.daemon
        for slot in daemon.slots.values():
            if slot.worker is not None:
                daemon.relay.pull(slot.task.id)

    def _tend_leases(self, now: float) -> None:
        """Every third of a lease, renew this node's leases in one step (a worker renews
        its own as well: ``worker.lease``) and say the node is alive; a lease that moved
        meanwhile is lost."""
        if now - self._renewed < self.shared.lease / 3:
            return
        sent = now
        owners = [s.owner for s in self.daemon.slots.values() if s.owner is not None]
        try:
            if self._superseded_by is not None:
                self._register_again()
                lost = []
            else:
                lost = self.shared.renew_all(owners)  # (and says the node is alive)
        except SupersededError as exc:
            self._superseded(exc)
            lost = []
        except StorageError as exc:
            self._store_away(exc)
        else:
            self._store_back()
            self._renewed = sent
            for owner in lost:
                self.lease_lost(owner, f"epoch {owner.epoch} was taken over")

    def _superseded(self, exc: SupersededError) -> None:
        """Another daemon registered this node's name while this one could not renew it
        (frozen, cut off past its lease): this one's workers stop at once (their claims
        are the name's, which is the other's now), and it registers the name again only
        once the other lets it go (``_register_again``). The live daemon that registered
        last keeps the name, so two daemons never take it from each other in turn."""
        daemon = self.daemon
        other = exc.now
        daemon.log.error(
            Event.NODE_SUPERSEDED,
            node=self.shared.node,
            epoch=exc.epoch,
            new_epoch=other[0] if other is not None else None,
            other_pid=other[1] if other is not None else None,
            other_host=other[2] if other is not None else None,
            tasks=sorted(s.task.id for s in daemon.slots.values() if s.owner is not None),
        )
        for slot in list(daemon.slots.values()):
            if slot.owner is not None:
                why = f"node {self.shared.node} was registered by another daemon"
                self.lease_lost(slot.owner, why)
        self._superseded_by = exc
        self._register_again()

    def _register_again(self) -> None:
        """A superseded daemon registers its name under a fresh epoch as soon as no other
        live daemon holds it (``ConfigError`` meanwhile: it waits, and says nothing more)."""
        daemon = self.daemon
        try:
            epoch = self.shared.join(daemon.config.max_workers)
        except ConfigError:
            return
        self._superseded_by = None
        daemon.log.warning(
            Event.NODE_REGISTERED, node=self.shared.node, epoch=epoch, pid=os.getpid()
        )
        daemon.wake()

    def relogin(self, secret: str) -> None:
        self.shared.relogin(secret)  # (a password that stopped working: a wait until then)

    def nodes_alive(self) -> int | None:
        with contextlib.suppress(StorageError):  # the database is away: not exposed
            return sum(1 for node in self.shared.nodes() if node.alive)
        return None
