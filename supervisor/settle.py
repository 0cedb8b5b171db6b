"""Settling a worker's exit: the daemon's role that carries out ``exits.settle``'s verdict
(docs/design.md sections 7 and 8).

A worker's exit is seen through its pidfd the moment it happens (``on_exit``): what is left
of the worker is killed and swept, its last beat folded into the record and the metrics,
``worker_hung`` logged if its own dead-man killed it (``liveness.hung_by_deadman``), then
``worker_exited``; then ``exits.settle``, pure, says what the exit means from the
exit and the task's view (its crashes and waits, whether the daemon stops, whether the
store is shared), and this role carries that out through the daemon's one transition
(``Supervisor.save``, ``Supervisor.move``): an end, a hold, a wait, a restart (at once on
the very exit when the place is free, else after its backoff or behind the queue).

It also takes the daemon's own storage faults (``backlog.WriteBacklog``): the first write
refused is logged and counted, and once every kept write is written, the tasks that wait
on storage are retried at once, not at the end of their backoff.

The reads on the way to a verdict do not fail on the spool's files; a shared store may be
away (invariant 8), and the daemon serves on: each read gives what it would without the
item, and what the verdict writes waits in the daemon's backlog until the database is
back.
"""

from __future__ import annotations

import asyncio
import signal
import time
from typing import TYPE_CHECKING

from supervisor import exits
from supervisor.backlog import Recovery
from supervisor.decisions import pending_decisions
from supervisor.exits import KillReason
from supervisor.liveness import Beat, hung_by_deadman
from supervisor.logging import dropped_lines
from supervisor.record import TaskRecord
from supervisor.status import read_heartbeat
from supervisor.workers import worker_exit
from worker.errors import StorageError
from worker.events import Event
from worker.protocol import VERDICT_EXITS, HeartbeatData, TaskStatus

if TYPE_CHECKING:
    from supervisor.daemon import Supervisor
    from supervisor.slot import TaskSlot


class ExitSettler:
    """What happens to a task when its worker ends (module docstring)."""

    def __init__(self, daemon: Supervisor) -> None:
        self.daemon = daemon

    def on_exit(self, slot: TaskSlot) -> None:
        daemon = self.daemon
        worker = slot.worker
        if worker is None:
            return
        asyncio.get_running_loop().remove_reader(worker.pidfd)
        daemon.liveness.forget(slot)
        code, sig = worker.exit_status()
        worker.close()
        worker.signal_group(signal.SIGKILL)  # nothing of the worker keeps acting
        slot.worker = None
        daemon.strays.sweep()  # nor what its tools started outside its group
        daemon.cgroups.release(slot.task.id)
        beat = self.heartbeat(slot) or {}
        if beat.get("pid") == worker.pid:  # its last beat, written as it ended
            daemon.metrics.fold(slot.task.id, beat)
        slot.record.progressed(beat)  # written with the verdict, durably
        daemon.metrics.forget(slot.task.id)
        turn = int(beat.get("turn", 0))
        if worker.kill_reason is None:  # killed by its own dead-man: it was hung
            mono = daemon.clock()
            hung = hung_by_deadman(Beat.of_worker(beat, worker.pid, time.time(), mono), sig, mono)
            if hung is not None:
                worker.kill_reason = KillReason.HUNG
                daemon.emit(
                    Event.WORKER_HUNG, slot, level="warning", pid=worker.pid, **hung.fields()
                )
        level = "info" if sig is None and code in VERDICT_EXITS else "warning"
        daemon.emit(
            Event.WORKER_EXITED, slot, level=level, pid=worker.pid, turn=turn, code=code, signal=sig
        )
        if worker.kill_reason == KillReason.LEASE_LOST:  # the task is another node's now
            daemon.wake()
            return
        self.settle(slot, worker_exit(worker, code, sig, turn))
        daemon.wake()

    def heartbeat(self, slot: TaskSlot) -> HeartbeatData | None:
        try:
            return read_heartbeat(slot.task)
        except StorageError:
            return None

    def _decided(self, slot: TaskSlot) -> bool:
        try:
            return pending_decisions(slot.task)
        except StorageError:
            return False

    def settle(self, slot: TaskSlot, ended: exits.WorkerExit) -> None:
        """Carry out ``exits.settle``'s verdict on a worker's exit."""
        daemon = self.daemon
        record = slot.record
        record.last_exit, record.pid = ended.last_exit, None
        view = exits.TaskView(
            record.crashes,
            slot.storage_waits,
            slot.resource_waits,
            stopping=daemon.stopping,
            shared=daemon.placement.clustered,
        )
        verdict = exits.settle(ended, view, daemon.config.restart, daemon.rng)
        if not isinstance(verdict, exits.Wait):
            slot.storage_waits = slot.resource_waits = 0
        match verdict:
            case exits.Cancelled():
                daemon.move(slot, TaskRecord.cancel)  # (a worker ran: it had not ended)
            case exits.Ended(state=state, reason=reason):
                daemon.save(slot, state, reason=reason)
            case exits.Held(reason=reason):
                if self._decided(slot):  # decided already: nobody to call
                    daemon.save(slot, TaskStatus.QUEUED, reason=None)
                else:
                    daemon.save(slot, TaskStatus.HELD, reason=reason)
            case exits.Requeued():
                daemon.save(slot, TaskStatus.QUEUED, reason=None)
            case exits.Fenced():
                daemon.placement.fenced(slot)
            case exits.LockWait():
                slot.waiting_lock = True
                daemon.save(slot, TaskStatus.QUEUED)
            case exits.Wait():
                self.wait(slot, verdict)
            case exits.GaveUp(reason=reason, turn=turn, crashes=crashes):
                record.crashes = crashes
                daemon.metrics.crash_loops += 1
                daemon.emit(Event.CRASH_LOOP, slot, level="error", turn=turn, crashes=len(crashes))
                daemon.save(slot, TaskStatus.FAILED, reason=reason)
            case exits.Restart():
                self._restart(slot, verdict)

    def wait(self, slot: TaskSlot, wait: exits.Wait) -> None:
        """A wait, not a crash: a storage fault (exit 7: a full, failing or read-only disk),
        a machine that refused a worker a process or memory (at its start, or its exit 8:
        another task's tools may hold them all), or an MCP server that could not list its
        tools at the task's first start (exit 9: ``mcp_server_failed`` said why). Nothing
        goes into the crash history and no restart is counted; the task is retried on
        ``policy.wait_for_storage``'s schedule (or at once, for storage, when the daemon's
        own writes recover) until the fault clears."""
        daemon = self.daemon
        if wait.kind is exits.WaitKind.STORAGE:
            slot.storage_waits, slot.resource_waits = wait.waits, 0
        else:
            slot.storage_waits, slot.resource_waits = 0, wait.waits
        slot.due = daemon.clock() + wait.delay
        daemon.save(slot, TaskStatus.BACKOFF, reason=wait.reason)
        if wait.waits == 1 and wait.kind is exits.WaitKind.STORAGE:
            daemon.metrics.storage_faults += 1
            daemon.emit(Event.STORAGE_FAULT, slot, level="warning", error=wait.why)
        elif wait.waits == 1 and wait.kind is exits.WaitKind.RESOURCES:
            daemon.emit(Event.RESOURCE_WAIT, slot, level="warning", error=wait.why)
        daemon.emit(Event.RESTART_SCHEDULED, slot, delay=round(wait.delay, 3), why=str(wait.kind))
        asyncio.get_running_loop().call_later(wait.delay, daemon.wake)

    def _restart(self, slot: TaskSlot, restart: exits.Restart) -> None:
        """A crash ``policy.decide`` restarts: at once when it followed progress and the
        place is free, else after its backoff (or in the queue, behind the tasks that
        waited before it)."""
        daemon = self.daemon
        slot.record.crashes = restart.crashes
        slot.record.restarts += 1
        daemon.metrics.restarts += 1
        slot.due = daemon.clock() + restart.delay
        if restart.delay == 0 and self._restart_now(slot):
            if not daemon.placement.new_epoch(slot):
                return  # the task is another node's now
            # At once, on this very exit: the record is written once, as `running`
            # (restart count, crash and reason included), not first as `queued` too.
            slot.record.reason = None
            daemon.emit(Event.RESTART_SCHEDULED, slot, delay=0.0, queued=False, turn=restart.turn)
            daemon.launcher.start(slot)
            return
        # `queued`: no backoff, but it waits its turn for a place (max_workers), or for an
        # operator's pause, behind the tasks that were queued before it
        queued = restart.delay == 0
        daemon.save(slot, TaskStatus.QUEUED if queued else TaskStatus.BACKOFF, reason=None)
        daemon.emit(
            Event.RESTART_SCHEDULED,
            slot,
            delay=round(restart.delay, 3),
            queued=queued,
            turn=restart.turn,
        )
        if not queued:
            asyncio.get_running_loop().call_later(restart.delay, daemon.wake)

    def _restart_now(self, slot: TaskSlot) -> bool:
        """Whether ``slot`` may take its freed place at once: nothing holds it back and no
        other task waits for a place (it would have the place first: the daemon's
        schedule)."""
        daemon = self.daemon
        if slot.paused or slot.waiting_lock or daemon.running_count() >= daemon.config.max_workers:
            return False
        return not any(
            other is not slot
            and other.worker is None
            and not other.starting
            and not other.record.foreground
            and other.record.state == TaskStatus.QUEUED
            for other in daemon.slots.values()
        )

    # -- the daemon's own writes refused (``backlog.WriteBacklog``) ----------------------

    def storage_fault(self, fault: StorageError) -> None:
        """The first write of a fault episode was refused (``WriteBacklog.on_fault``)."""
        daemon = self.daemon
        daemon.metrics.storage_faults += 1
        daemon.log.warning(Event.STORAGE_FAULT, error=str(fault), spool=str(daemon.spool.root))

    def storage_recovered(self, recovery: Recovery) -> None:
        """Every kept write is written: the disk takes writes again. The tasks that wait on
        storage are retried now, not at the end of their backoff."""
        self.daemon.log.info(
            Event.STORAGE_RECOVERED,
            rewritten=recovery.rewritten,
            dropped=recovery.dropped,
            log_lines_dropped=dropped_lines(),
            seconds=round(recovery.seconds, 3),
        )
        now = self.daemon.clock()
        for slot in self.daemon.slots.values():
            if slot.storage_waits and slot.record.state == TaskStatus.BACKOFF:
                slot.due = min(slot.due, now)
        self.daemon.wake()
