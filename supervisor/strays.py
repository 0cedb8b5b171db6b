"""The subreaper's sweep: what a worker's tools left behind dies with it (docs/design.md
section 5: no process a tool starts outlives its call's worker).

A worker runs in a session of its own, and its group is killed when it ends; a process
that left the group (``setsid``, a double fork) is still the worker's descendant, and the
worker, a subreaper itself, kills it as it ends. A worker killed outright cannot: such
processes pass to the supervisor, the next subreaper up, whose every child it did not
start on purpose is a stray. ``sweep_strays`` kills those (``agentd run`` sweeps with it
after each worker); ``StraySweeper`` is the daemon's, which sweeps on every worker exit
and again, a moment later, while it finds strays (their own children come to it in
turn), and until none is left when it stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Callable, Collection

from worker.descendants import children, reap

RESWEEP = 0.02  # seconds: the children of killed strays come to the daemon in turn
PATIENCE = 5.0  # seconds a stop keeps sweeping strays before it exits


def sweep_strays(keep: Collection[int]) -> list[int]:
    """Kill every child of this process that is not in ``keep`` (the children it started
    on purpose), and reap those that have ended.

    Such a child is a stray: a process a tool started that outlived its worker (the
    worker, a subreaper, kills what it leaves when it ends: ``worker.descendants``; one
    killed outright leaves them to its supervisor), or a worker whose fork server died
    before naming it. Returns the pids killed: their own children come to this process in
    turn, so sweep again until it returns none.

    The supervisor's own list of children is exact (``descendants.children``: only it
    reaps them), and reading it costs a file per thread, not a scan of /proc."""
    killed: list[int] = []
    for pid in children(os.getpid()):
        if pid in keep:
            continue
        if reap(pid) is not None:
            continue
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
    return killed


def sweep_until_none(keep: Collection[int] = (), patience: float = PATIENCE) -> None:
    """Sweep until no stray is left, for ``patience`` seconds at most (``agentd run``,
    after its worker is reaped)."""
    deadline = time.monotonic() + patience
    while sweep_strays(keep) and time.monotonic() < deadline:
        time.sleep(RESWEEP)


class StraySweeper:
    """The daemon's sweep. ``own`` names the children it started on purpose (its live
    workers, the fork server, the hooks that run); ``held_back`` says while a sweep must
    wait (a worker the fork server forked and has not named yet cannot be told from a
    stray); ``killed`` is told of the strays each sweep killed, each once."""

    def __init__(
        self,
        own: Callable[[], set[int]],
        held_back: Callable[[], bool],
        killed: Callable[[list[int]], None],
    ) -> None:
        self._own = own
        self._held_back = held_back
        self._killed = killed
        self.due = False  # a sweep waits for the fork server's answers
        self._resweep: asyncio.TimerHandle | None = None
        self._last: set[int] = set()  # killed by the last sweep (they may be dying still)

    def sweep(self) -> None:
        """Kill (and reap) every child that is not the daemon's own: on each worker exit,
        and again every ``RESWEEP`` while it finds strays. Held back while the fork server
        has answers to give (``due``: swept once they are in, ``sweep_if_due``)."""
        if self._held_back():
            self.due = True
            return
        self.due = False
        if self._note(sweep_strays(self._own())) and self._resweep is None:
            self._resweep = asyncio.get_running_loop().call_later(RESWEEP, self._again)

    def sweep_if_due(self) -> None:
        if self.due and not self._held_back():
            self.sweep()

    def _again(self) -> None:
        self._resweep = None
        self.sweep()

    def _note(self, killed: list[int]) -> bool:
        """Tell of the strays a sweep killed (each once: one still dying is killed again by
        the next sweep); whether there were any."""
        new = [pid for pid in killed if pid not in self._last]
        if new:
            self._killed(new)
        self._last = set(killed)
        return bool(killed)

    async def until_none(self, clock: Callable[[], float] = time.monotonic) -> None:
        """At a stop, once the workers are gone: sweep until no stray is left, so none
        outlives the daemon (a worker the fork server never named is one too now: nothing
        would watch it), for ``PATIENCE`` at most."""
        deadline = clock() + PATIENCE
        while self._note(sweep_strays(self._own())):
            if clock() >= deadline:
                return
            await asyncio.sleep(RESWEEP)
