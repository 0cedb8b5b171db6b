"""The daemon's liveness watch: one timer per instant a verdict could fall due
(docs/design.md section 7), and ``LivenessWatch``, the daemon's role that judges its
workers on it.

``liveness.judge`` says when a verdict on a worker could be due (``Alive.until``; a stop's
grace running out is another such instant); the watch sleeps until then on the loop's
monotonic clock. The instants are rounded up to a grid of ``GRID`` seconds, and the workers
due at one grid instant share its one timer: an idle daemon wakes a few times a second at
most, however many workers it watches, and reads no heartbeat before a verdict on it could
be due. (A module of its own: ``liveness`` is read by every ``agentd status``, which must
not import asyncio.)
"""

from __future__ import annotations

import asyncio
import math
import signal
import time
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Generic, TypeVar

from supervisor.exits import KillReason
from supervisor.liveness import Alive, Beat, Hung, Limits, judge, limits_of
from worker.errors import StorageError
from worker.events import Event

if TYPE_CHECKING:
    from supervisor.daemon import Supervisor
    from supervisor.slot import TaskSlot
    from supervisor.workers import WorkerProcess

K = TypeVar("K", bound=Hashable)

#: Seconds: a check falls due at most this much after its instant (a verdict is a
#: second-scale matter: ``heartbeat.timeout`` is 10 s by default, 1 s at the least). The
#: daemon's tick falls on the same instants (``sleep_to_grid``): an idle daemon wakes
#: twice a second however many workers it watches, a wake-up being most of what an idle
#: loop costs.
GRID = 0.5


async def sleep_to_grid(seconds: float, grid: float = GRID) -> None:
    """Sleep at least ``seconds``, until the next instant of ``grid`` (the watch's: a
    wake-up shared with the checks due then). A loop woken on an instant that sleeps half
    a step wakes on the next one: a tick every ``grid`` seconds, never two at once."""
    loop = asyncio.get_running_loop()
    woken: asyncio.Future[None] = loop.create_future()
    at = math.ceil((loop.time() + seconds) / grid) * grid
    timer = loop.call_at(at, woken.set_result, None)
    try:
        await woken
    finally:
        timer.cancel()


class Watch(Generic[K]):
    """The watched workers, each checked when its next verdict could be due.
    ``check(key, wall, mono)`` gives the verdict its due and says when the next could be
    (None: the worker is watched no more)."""

    def __init__(
        self, check: Callable[[K, float, float], float | None], grid: float = GRID
    ) -> None:
        self._check = check
        self._grid = grid
        self._due: dict[K, float] = {}  # each watched worker: when to check it
        self._slot_of: dict[K, int] = {}  # ... the grid instant it waits for (in steps)
        self._slots: dict[int, dict[K, None]] = {}  # each grid instant: its workers, in order
        self._timers: dict[int, asyncio.TimerHandle] = {}  # ... and its timer

    @property
    def timers(self) -> int:
        """The timers armed: one per grid instant some worker waits for."""
        return len(self._timers)

    def arm(self, key: K, at: float) -> None:
        """Check ``key`` at monotonic ``at`` (now, if that is past), and not before."""
        self.disarm(key)
        loop = asyncio.get_running_loop()
        slot = math.ceil(max(at, loop.time()) / self._grid)
        self._due[key] = at
        self._slot_of[key] = slot
        self._slots.setdefault(slot, {})[key] = None
        if slot not in self._timers:
            self._timers[slot] = loop.call_at(slot * self._grid, self._fire, slot)

    def disarm(self, key: K) -> None:
        self._due.pop(key, None)
        slot = self._slot_of.pop(key, None)
        if slot is None:
            return
        waiting = self._slots.get(slot)
        if waiting is None:
            return  # (its instant is being fired: ``_fire`` skips it)
        waiting.pop(key, None)
        if not waiting:
            del self._slots[slot]
            self._timers.pop(slot).cancel()

    def rearm_all(self, at: float) -> None:
        """Every worker checked again at ``at`` (a reload changed the limits)."""
        for key in list(self._due):
            self.arm(key, at)

    def check_due(self, wall: float, mono: float) -> None:
        """Check now every worker whose check is due by ``mono`` (what the timers do, for a
        caller that knows the loop woke late)."""
        for key, at in list(self._due.items()):
            if at <= mono:
                self._run(key, wall, mono)

    def _fire(self, slot: int) -> None:
        self._timers.pop(slot, None)
        waiting = self._slots.pop(slot, {})
        wall, mono = time.time(), asyncio.get_running_loop().time()
        for key in waiting:
            if self._slot_of.get(key) == slot:
                del self._slot_of[key]
                try:
                    self._run(key, wall, mono)
                except Exception as exc:  # (one check's fault is no other's)
                    loop = asyncio.get_running_loop()
                    loop.call_exception_handler({"message": "liveness check", "exception": exc})
                    self.arm(key, mono + self._grid)  # judged again at the next instant

    def _run(self, key: K, wall: float, mono: float) -> None:
        self.disarm(key)
        due = self._check(key, wall, mono)
        if due is not None and key not in self._due:  # (the check may have armed it)
            self.arm(key, due)


class LivenessWatch:
    """The daemon's role that judges its workers (docs/design.md section 7): a ``Watch``
    of every worker, whose check reads the worker's heartbeat through the daemon's store
    and carries out ``liveness.judge``'s verdict: hung, killed; stalled, stopped (TERM,
    then KILL after ``restart.stop_grace``); alive, looked at again when a verdict could
    next fall due. A worker that has ended is settled as an exit before any verdict."""

    def __init__(self, daemon: Supervisor) -> None:
        self.daemon = daemon
        self.timers: Watch[str] = Watch(self._check)
        self._limits = (daemon.config, limits_of(daemon.config))

    def watch(self, slot: TaskSlot) -> None:
        """Judge ``slot``'s worker, a first time now."""
        self.timers.arm(slot.task.id, self.daemon.clock())

    def forget(self, slot: TaskSlot) -> None:
        self.timers.disarm(slot.task.id)

    def rejudge_all(self) -> None:
        """Every worker judged again now (a reload changed the limits)."""
        self.timers.rearm_all(self.daemon.clock())

    def check_due(self, wall: float, mono: float) -> None:
        """The verdicts due by ``mono`` (the timers give them as they fall due; a daemon
        stopped with SIGSTOP wakes with them all due at once)."""
        self.timers.check_due(wall, mono)

    def limits(self) -> Limits:
        """The limits of the config in force (worked out again only when a reload changed
        it: every check asks)."""
        config = self.daemon.config
        if self._limits[0] is not config:
            self._limits = (config, limits_of(config))
        return self._limits[1]

    def stop_in_grace(self, slot: TaskSlot, worker: WorkerProcess, now: float) -> float:
        """A worker sent TERM is killed (its group) if it has not ended ``restart.stop_grace``
        from ``now``: it is looked at again then."""
        worker.term_deadline = now + self.daemon.config.restart.stop_grace
        self.timers.arm(slot.task.id, worker.term_deadline)
        return worker.term_deadline

    def _check(self, task_id: str, wall: float, mono: float) -> float | None:
        """The verdict on a task's worker, when one could be due (``liveness.judge``, on the
        monotonic clock; ``wall`` only carries a heartbeat of an earlier release over to
        it). Returns when to look again (None: no more verdicts on this worker)."""
        daemon = self.daemon
        slot = daemon.slots.get(task_id)
        worker = slot.worker if slot is not None else None
        if slot is None or worker is None:
            return None
        if worker.exited():
            daemon.settler.on_exit(slot)
            return None
        if worker.term_deadline is not None:
            if mono < worker.term_deadline:
                return worker.term_deadline
            daemon.emit(Event.WORKER_KILLED, slot, level="warning", pid=worker.pid)
            worker.signal_group(signal.SIGKILL)
            worker.term_deadline = None
            return None
        if worker.kill_reason:
            return None  # being stopped: its exit settles it
        limits = self.limits()
        try:
            data = daemon.store.read_heartbeat(task_id)
        except StorageError:  # a shared store away: no verdict on a beat unread
            daemon.placement.away_at = mono
            return mono + limits.interval
        verdict = judge(Beat.of_worker(data, worker.pid, wall, mono), worker.started, mono, limits)
        if isinstance(verdict, Alive):
            return verdict.until
        if isinstance(verdict, Hung) and mono - daemon.placement.away_at < limits.timeout:
            # the shared store was at fault within a timeout: its worker could not beat
            # (a read-only or lost database), which is no hang; its lease bounds it
            return mono + limits.interval
        if isinstance(verdict, Hung):
            worker.kill_reason = KillReason.HUNG
            daemon.emit(Event.WORKER_HUNG, slot, level="warning", pid=worker.pid, age=verdict.age)
            worker.signal_group(signal.SIGKILL)
            return None
        worker.kill_reason = KillReason.STALLED
        daemon.emit(
            Event.WORKER_STALLED, slot, level="warning", pid=worker.pid, phase=verdict.phase
        )
        worker.signal_group(signal.SIGTERM)
        return self.stop_in_grace(slot, worker, mono)
