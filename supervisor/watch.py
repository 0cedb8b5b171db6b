"""The daemon's liveness watch: one timer per worker, at the instant a verdict on it could
fall due (docs/design.md section 7).

``liveness.judge`` says when that is (``Alive.until``; a stop's grace running out is
another such instant); the watch sleeps until then on the loop's monotonic clock. An idle
daemon so reads no heartbeat and wakes for none before a verdict could be due, however
many workers it watches. (A module of its own: ``liveness`` is read by every ``agentd
status``, which must not import asyncio.)
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class Watch(Generic[K]):
    """One timer per watched worker. ``check(key, wall, mono)`` gives the verdict its due
    and says when the next could be (None: the worker is watched no more)."""

    def __init__(self, check: Callable[[K, float, float], float | None]) -> None:
        self._check = check
        self._timers: dict[K, asyncio.TimerHandle] = {}
        self._due: dict[K, float] = {}

    def arm(self, key: K, at: float) -> None:
        """Check ``key`` at monotonic ``at`` (now, if that is past), and not before."""
        self.disarm(key)
        self._due[key] = at
        loop = asyncio.get_running_loop()
        self._timers[key] = loop.call_at(max(at, loop.time()), self._fire, key)

    def disarm(self, key: K) -> None:
        timer = self._timers.pop(key, None)
        if timer is not None:
            timer.cancel()
        self._due.pop(key, None)

    def rearm_all(self, at: float) -> None:
        """Every worker checked again at ``at`` (a reload changed the limits)."""
        for key in list(self._timers):
            self.arm(key, at)

    def check_due(self, wall: float, mono: float) -> None:
        """Check now every worker whose check is due by ``mono`` (what the timers do, for a
        caller that knows the loop woke late)."""
        for key, at in list(self._due.items()):
            if at <= mono:
                self._run(key, wall, mono)

    def _fire(self, key: K) -> None:
        self._timers.pop(key, None)
        self._run(key, time.time(), asyncio.get_running_loop().time())

    def _run(self, key: K, wall: float, mono: float) -> None:
        self.disarm(key)
        due = self._check(key, wall, mono)
        if due is not None and key not in self._timers:  # (the check may have armed it)
            self.arm(key, due)
