"""A handed-over lease, kept alive by the worker and checked before every tool call.

On a shared store (docs/design.md section 10) the daemon claims a task and hands its worker
the claim's ``Owner``; the database fences every append by its epoch. What the database
cannot fence is a tool: a worker that was stopped (SIGSTOP, a swapped-out VM, a cut
network) for longer than its lease could wake up after another node took the task and
run a tool before its next append is refused. So the worker keeps its own deadline:
the time it *sent* its last successful renewal, plus the lease, less ``MARGIN``. Past
it the worker acts no more (``check`` raises ``FencedError``, and ``keep`` ends the
process), whatever the database would say: it stops itself before the database has to.

``keep`` runs on the heartbeat's thread after each beat and renews every third of the
lease, so a renewal can fail twice before the deadline; a renewal the database refuses
(the epoch moved) ends the worker at once.

A worker that is frozen cannot stop itself, and its tool, frozen with it, would go on
after the thaw. So the kernel holds a kill too (``worker.killtimer``): ``check``, which
comes before every tool call, arms a timer that sends this process SIGKILL at
``kill_at``, and each renewal moves it. It comes ``KILL_MARGIN`` of the lease before the
server's expiry, after the worker's own deadline, so that a worker still scheduled
stops itself first (exit 5, ``lease_lost``); only one that could not is killed, stopped or
not, and its sandbox dies with it (``--die-with-parent``). While a call's result waits for
the database (``waiting``) the timer is disarmed: no tool runs then, and the result must
not be lost to the kill; only the fence ends that wait. Deadlines are read on
``CLOCK_BOOTTIME``, the kernel timer's clock: monotonic, and counting a system suspend.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

from worker.errors import FencedError, StorageError
from worker.killtimer import Timer, boottime
from worker.store.base import Owner, TaskStore

#: The part of the lease the worker never uses: its deadline comes this much early.
MARGIN = 0.2
#: The kernel's kill comes this part of the lease before the lease ends (after ``MARGIN``).
KILL_MARGIN = 0.1


class LeaseKeeper:
    def __init__(
        self,
        store: TaskStore,
        owner: Owner,
        lease: float,
        on_lost: Callable[[FencedError], None],
        *,
        clock: Callable[[], float] = boottime,
        timer: Timer | None = None,
    ) -> None:
        self.store = store
        self.owner = owner
        self.lease = lease
        self.on_lost = on_lost
        self.clock = clock
        self._renewed = clock()  # the claim (or handover) renewed it a moment ago
        self._lock = threading.Lock()
        self._waiting = 0  # blocks of ``waiting`` open
        self.timer = timer

    @property
    def kill_at(self) -> float:
        """When the kernel kills this worker unless a renewal comes first (``timer``)."""
        with self._lock:
            return self._renewed + self.lease * (1 - KILL_MARGIN)

    def _arm(self) -> None:
        """(Re-)arm the kernel's kill at ``kill_at``, outside a ``waiting`` block."""
        with self._lock:
            if self.timer is None or self._waiting:
                return
            self.timer.arm_at(self._renewed + self.lease * (1 - KILL_MARGIN))

    @property
    def deadline(self) -> float:
        """The monotonic time after which this worker no longer acts."""
        with self._lock:
            return self._renewed + self.lease * (1 - MARGIN)

    def check(self) -> None:
        """``FencedError`` once the lease may have ended (see the module docstring)."""
        late = self.clock() - self.deadline
        if late >= 0:
            raise FencedError(
                f"lease_lost: task {self.owner.task_id}'s lease (epoch {self.owner.epoch}) "
                f"could not be renewed in time ({late + self.lease * (1 - MARGIN):.1f} s since "
                "the last renewal); this worker stops before another node runs the task"
            )
        self._arm()  # a tool may run now: the kernel ends it with the lease

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """Within the block the worker runs no tool (a call's result waits for the database
        to take it), so a deadline passed does not end it: only the fence does, a renewal
        the database refuses because the epoch moved. ``check`` still refuses a tool."""
        with self._lock:
            self._waiting += 1
            if self.timer is not None:
                self.timer.disarm()
        try:
            yield
        finally:
            with self._lock:
                self._waiting -= 1

    def close(self) -> None:
        """No kill any more: the worker runs no tool from here on (its loop has ended)."""
        with self._lock:
            timer, self.timer = self.timer, None
        if timer is not None:
            timer.close()

    def keep(self) -> None:
        """Renew when a third of the lease has passed; on a refusal, or past the deadline
        with no renewal, call ``on_lost`` (which ends the worker)."""
        sent = self.clock()
        with self._lock:
            due = sent - self._renewed >= self.lease / 3
        try:
            if due:
                self.store.renew(self.owner)
                with self._lock:
                    self._renewed = max(self._renewed, sent)
                self._arm()
            if not self._waiting:
                self.check()
        except FencedError as exc:
            self.on_lost(exc)
        except StorageError:
            return  # the database is away: the deadline decides (check, next beat)
