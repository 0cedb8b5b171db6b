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
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

from worker.errors import FencedError, StorageError
from worker.store.base import Owner, TaskStore

#: The part of the lease the worker never uses: its deadline comes this much early.
MARGIN = 0.2


class LeaseKeeper:
    def __init__(
        self,
        store: TaskStore,
        owner: Owner,
        lease: float,
        on_lost: Callable[[FencedError], None],
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.owner = owner
        self.lease = lease
        self.on_lost = on_lost
        self.clock = clock
        self._renewed = clock()  # the claim (or handover) renewed it a moment ago
        self._lock = threading.Lock()
        self._waiting = 0  # blocks of ``waiting`` open

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

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """Within the block the worker runs no tool (a call's result waits for the database
        to take it), so a deadline passed does not end it: only the fence does, a renewal
        the database refuses because the epoch moved. ``check`` still refuses a tool."""
        with self._lock:
            self._waiting += 1
        try:
            yield
        finally:
            with self._lock:
                self._waiting -= 1

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
            if not self._waiting:
                self.check()
        except FencedError as exc:
            self.on_lost(exc)
        except StorageError:
            return  # the database is away: the deadline decides (check, next beat)
