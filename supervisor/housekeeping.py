"""``Housekeeper``: the daemon's part that applies ``[retention]`` (docs/design.md section
20) at its start and then every ``PERIOD`` seconds, on a thread of its own so that a
prune of thousands of tasks never holds up supervision.

It is handed what it needs and nothing more: the spool, the config in use (a callable: a
reload moves it), ``log`` for the events it says, and what it lets go of for each task
removed (the daemon's slots, the relay's cursor), and ``told`` (the daemon's
announcer: the spool's size, each removal counted). It never sees the daemon.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from supervisor import retention
from supervisor.slot import TaskSlot
from worker.config import Config
from worker.errors import AgentdError
from worker.events import Event
from worker.spool import Spool

#: Seconds between two passes of ``[retention]``, and between two measures of the spool.
PERIOD = 3600.0
SIZE_PERIOD = 300.0


class Told(Protocol):
    """Who hears what the housekeeper finds (the daemon's ``Announcer``)."""

    def spool_measured(self, size: int) -> None: ...

    def task_removed(self) -> None: ...


class Housekeeper:
    def __init__(
        self,
        spool: Spool,
        config: Callable[[], Config],
        log: Callable[..., None],
        slots: dict[str, TaskSlot],
        unrelay: Callable[[str], None],
        told: Told,
    ) -> None:
        self.spool = spool
        self.config = config
        self.log = log
        self.slots = slots  # the daemon's: a removed task's slot is let go
        self.unrelay = unrelay  # the relay's cursor of a removed task, let go
        self.told = told  # the spool's size as measured, and each task removed
        self.next_measure = 0.0
        self._measuring: asyncio.Task[int] | None = None
        self.next_pass = 0.0  # on the daemon's clock: at once, then every PERIOD
        self._running: asyncio.Task[None] | None = None

    def forget(self, task_id: str) -> None:
        """Let go of a task at rest that is gone from the store (pruned)."""
        slot = self.slots.get(task_id)
        if slot is not None and (slot.worker is not None or slot.starting):
            return
        if self.slots.pop(task_id, None) is not None:
            self.told.task_removed()
        self.unrelay(task_id)

    def due(self, now: float) -> None:
        """Start a pass when one is due and none runs (the daemon's tick calls this); only
        on a spool's files (a shared store's tasks are not pruned yet)."""
        if self.spool.shared is not None:
            return
        self._measure(now)
        if now < self.next_pass:
            return
        if self._running is not None and not self._running.done():
            return
        self.next_pass = now + PERIOD
        finished = retention.finish_removals(self.spool)
        for task_id in finished:
            self.log(Event.TASK_REMOVED, task=task_id, why="a removal cut off before, finished")
            self.forget(task_id)
        if not self.config().retention.any:
            return
        loop = asyncio.get_running_loop()
        self._running = loop.create_task(asyncio.to_thread(self._pass, self.config(), loop))
        self._running.add_done_callback(self._done)

    def _measure(self, now: float) -> None:
        """Measure the spool's size on a thread, every ``SIZE_PERIOD`` seconds."""
        if now < self.next_measure or (self._measuring and not self._measuring.done()):
            return
        self.next_measure = now + SIZE_PERIOD
        self._measuring = asyncio.get_running_loop().create_task(
            asyncio.to_thread(retention.spool_bytes, self.spool)
        )
        self._measuring.add_done_callback(
            lambda done: (
                None
                if done.cancelled() or done.exception()
                else self.told.spool_measured(done.result())
            )
        )

    def _pass(self, config: Config, loop: asyncio.AbstractEventLoop) -> None:
        """On a thread: remove every task past its period, each removal told to the loop
        as it is made (the daemon's log and slots are the loop's)."""
        now = datetime.now(UTC)
        selection = retention.PruneRequest()
        for task, why in list(retention.candidates(self.spool, selection, config.retention, now)):
            try:
                archive = retention.remove(
                    self.spool, task.id, archive_to=config.retention.archive_to
                )
            except (AgentdError, OSError) as exc:  # (a retry came first, a full disk, ...)
                loop.call_soon_threadsafe(self._told, Removal(task.id, str(exc), None, True))
                continue
            loop.call_soon_threadsafe(self._told, Removal(task.id, why, archive))

    def _told(self, removal: Removal) -> None:
        if removal.failed:
            self.log(Event.TASK_REMOVE_FAILED, level="warning", task=removal.task, why=removal.why)
            return
        told: dict[str, Any] = {}
        if removal.archive is not None:
            told["archive"] = str(removal.archive)
        self.log(Event.TASK_REMOVED, task=removal.task, why=removal.why, **told)
        self.forget(removal.task)

    def _done(self, running: asyncio.Task[None]) -> None:
        if not running.cancelled() and (failure := running.exception()) is not None:
            self.log(Event.TASK_REMOVE_FAILED, level="error", why=str(failure))


@dataclass(frozen=True)
class Removal:
    """What one removal of a pass came to."""

    task: str
    why: str
    archive: Path | None
    failed: bool = False
