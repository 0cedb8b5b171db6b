"""The daemon's part in approvals (docs/guides/tools.md): a call asked before it runs
and not answered within ``[approvals] ask_timeout`` is skipped, the model told "no
approval within 1h".

No worker runs while such a call waits (its task is ``held``), so the daemon acts: at
each tick ``AskTimeouts.check`` looks at the held tasks whose reason is
``approval: TOOL``. A task's held calls are read once per hold (its record's
``updated_at`` marks one), not at every tick; when the first of them is due, each due
call is decided ``skip`` through the operator's own path (``decisions.decide``, bound to
the attempt that was read, so an operator's decision made meanwhile wins), with no
``by``: an automatic action. The task goes back to the queue once every held call has a
decision, as after an operator's.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any

from supervisor.decisions import decide, pending_decisions
from supervisor.record import TaskRecord
from supervisor.slot import TaskSlot
from supervisor.status import STAGE_BEFORE, held_calls
from worker.approvals import APPROVAL_REASON
from worker.config import period_text
from worker.errors import AgentdError
from worker.protocol import DecisionAction, TaskStatus


class AskTimeouts:
    """Skips the calls that waited for approval longer than ``timeout()`` seconds (None:
    they wait for ever), among ``slots``; ``release`` queues a held task again."""

    def __init__(
        self,
        slots: Mapping[str, TaskSlot],
        timeout: Callable[[], float | None],
        release: Callable[[TaskSlot], object],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.slots = slots
        self.timeout = timeout
        self.release = release
        self.clock = clock
        self._due: dict[str, tuple[str, float]] = {}  # task -> (the hold's mark, when due)

    def check(self) -> None:
        timeout = self.timeout()
        if timeout is None:
            self._due.clear()
            return
        now = self.clock()
        for task_id, slot in self.slots.items():
            record = slot.record
            if not _asking(record) or slot.worker is not None:
                self._due.pop(task_id, None)
                continue
            mark = f"{record.updated_at}"
            known = self._due.get(task_id)
            if known is None or known[0] != mark:
                rows = _asked_rows(slot)
                due = min((_started(r) + timeout for r in rows), default=float("inf"))
                known = self._due[task_id] = (mark, due)
            if now >= known[1]:
                self._skip_due(slot, timeout, now)
                self._due.pop(task_id, None)

    def _skip_due(self, slot: TaskSlot, timeout: float, now: float) -> None:
        reason = f"no approval within {period_text(timeout)}"
        for row in _asked_rows(slot):
            if _started(row) + timeout > now:
                continue
            with contextlib.suppress(AgentdError):  # (decided meanwhile: that decision wins)
                decide(
                    slot.task,
                    row["call_id"],
                    action=DecisionAction.SKIP,
                    reason=reason,
                    attempt=row["attempt"],
                )
        if pending_decisions(slot.task):
            self.release(slot)


def _asking(record: TaskRecord) -> bool:
    return (
        record.state == TaskStatus.HELD
        and not record.foreground
        and (record.reason or "").startswith(APPROVAL_REASON)
    )


def _asked_rows(slot: TaskSlot) -> list[dict[str, Any]]:
    """The held calls of ``slot`` that wait for approval before they run."""
    try:
        return [r for r in held_calls(slot.task) if r["stage"] == STAGE_BEFORE]
    except (AgentdError, OSError, ValueError):
        return []  # (a journal that cannot be read now: looked at again at the next hold)


def _started(row: Mapping[str, Any]) -> float:
    """When the call was asked (its intent's time), in seconds since the epoch."""
    try:
        return datetime.fromisoformat(str(row["started_at"])).timestamp()
    except ValueError:
        return float("inf")
