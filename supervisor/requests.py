"""What commands ask of a task (docs/design.md sections 3 and 7): the daemon's role that
carries out the requests an operator's command left in the task's folder (``supervisor.
control``: cancel, retry, requeue, a hold released, a pause) when the task's doorbell rings
or a scan looks at it. A cancel stops the worker (TERM to its group, KILL after the
grace) or cancels a task without one at once; a pause stops it at a safe point, and the
task resumes once the pause's holder lets go.
"""

from __future__ import annotations

import signal
from typing import TYPE_CHECKING

from supervisor.control import RELEASE_REQUEST, REQUEUE_REQUEST, RETRY_REQUEST
from supervisor.coordination import take_request, taken_request
from supervisor.exits import KillReason
from supervisor.operator import Operator, fields_of
from supervisor.record import TaskRecord
from worker.errors import StorageError
from worker.events import Event
from worker.protocol import FINAL_STATES

if TYPE_CHECKING:
    from supervisor.daemon import Supervisor
    from supervisor.slot import TaskSlot


class Requests:
    """The requests on a task, carried out (module docstring)."""

    def __init__(self, daemon: Supervisor) -> None:
        self.daemon = daemon

    def apply(self, slot: TaskSlot) -> None:
        """Carry out what commands asked of ``slot``'s task: a cancel, a retry, a requeue,
        a hold released (a budget raised), a pause (a safe-point stop)."""
        daemon = self.daemon
        if (
            (slot.record.state not in FINAL_STATES or slot.worker is not None)
            and daemon.store.cancel_requested(slot.task.id)
            and not (slot.record.foreground and daemon.store.owned(slot.task.id))
        ):  # (a foreground task's running `agentd run` applies its cancel itself)
            self.cancel(slot)
        asked = taken_request(slot.task, RETRY_REQUEST)
        if asked is not None and daemon.move(slot, TaskRecord.retry):
            daemon.emit(Event.TASK_RETRIED, slot, **fields_of(Operator.of(asked)))
        if take_request(slot.task, REQUEUE_REQUEST) and slot.worker is None:
            daemon.move(slot, TaskRecord.requeue)
        if take_request(slot.task, RELEASE_REQUEST) and not slot.record.foreground:
            daemon.move(slot, TaskRecord.release_hold)  # a budget raised (``supervisor.budgets``)
        slot.paused = daemon.coordination.pause_requested(slot.task)
        if slot.paused and slot.worker is not None and slot.worker.kill_reason is None:
            slot.worker.kill_reason = KillReason.STOP  # a safe-point stop; the task resumes after
            slot.worker.signal_worker(signal.SIGTERM)
            daemon.liveness.stop_in_grace(slot, slot.worker, daemon.clock())

    def cancel(self, slot: TaskSlot) -> None:
        """Apply an operator's cancel: a worker gets TERM (its group: the running tool
        too), then KILL after the grace; a task without one is cancelled at once."""
        daemon = self.daemon
        worker = slot.worker
        if worker is not None:
            if worker.kill_reason != KillReason.CANCEL:
                worker.kill_reason = KillReason.CANCEL
                worker.signal_group(signal.SIGTERM)
                daemon.liveness.stop_in_grace(slot, worker, daemon.clock())
        elif not slot.starting:  # (one being started is cancelled as it arrives: ``_started``)
            daemon.move(slot, TaskRecord.cancel)

    def cancel_requested(self, slot: TaskSlot) -> bool:
        try:
            return self.daemon.store.cancel_requested(slot.task.id)
        except StorageError:  # a shared store away: seen at its next look
            return False
