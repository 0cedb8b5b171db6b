"""The daemon's liveness watch: one timer per instant a verdict could fall due
(docs/design.md section 7).

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
import time
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)

#: Seconds: a check falls due at most this much after its instant (a verdict is a
#: second-scale matter: ``heartbeat.timeout`` is 30 s by default, 1 s at the least).
GRID = 0.25


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
        del waiting[key]
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
                self._run(key, wall, mono)

    def _run(self, key: K, wall: float, mono: float) -> None:
        self.disarm(key)
        due = self._check(key, wall, mono)
        if due is not None and key not in self._due:  # (the check may have armed it)
            self.arm(key, due)
