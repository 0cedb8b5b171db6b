"""The supervisor daemon: one asyncio loop that keeps every task of a spool alive.

What drives it:

* a doorbell: CLI commands that change a task (submit, decide, cancel, retry) and workers
  that append an event drop a file named for the task in ``SPOOL/inbox``, which inotify
  reports at once (``supervisor.inbox``), and the daemon looks at that task; a rescan
  every ``placement.RESCAN_INTERVAL`` seconds makes sure a missed one can never strand a
  task (on a shared store, claims every ``placement.CLAIM_POLL``: ``supervisor.placement``);
* worker exits, seen through each worker's pidfd the moment they happen, and settled by
  ``exits.settle``; each is followed by a sweep that kills whatever the worker's tools left
  that outlived it (``supervisor.strays``);
* the liveness watch (``supervisor.watch``): a worker's heartbeat is read at the instant a
  verdict on it could fall due, and only then, the checks due at one instant on one
  timer; a worker's hang is its own dead-man's to end (``worker.heartbeat``), so an idle
  daemon reads a beat once a deadline could pass, however many workers it watches;
* a tick every ``min(heartbeat.interval, TICK)`` seconds, on the liveness checks'
  instants (one wake-up for both), that feeds the systemd watchdog,
  retries what a storage fault refused, skips the calls that waited for approval past
  ``[approvals] ask_timeout`` (``supervisor.approvals``), tends the fork server and, on a
  shared store, the leases.

Signals (docs/design.md section 7): TERM and INT stop gracefully; HUP reopens the log file
and reloads the config (``reload``); USR1 logs a one-line summary of the daemon
(``supervisor_status``); USR2 is logged and otherwise ignored; PIPE stays ignored, as
Python leaves it (a write to a closed pipe raises instead). None of them ends the daemon.
The fork server and the workers each run in a session of their own, so a signal sent to
the daemon's process group (``kill -HUP -PGID``) never reaches them.

A foreground task (``agentd run``, docs/design.md section 16) is never started here: its
record is ``agentd run``'s to write, read again at each scan, until ``agentd retry`` hands
it over (``TaskRecord.retry`` clears the mark). Other task records (``state.json``) are
written only here while the daemon runs. The restart
decision is ``supervisor.policy.decide``; this module only carries it out.

Storage faults (docs/design.md invariant 8) are waits on both sides. A worker's exit 7 puts
its task in ``backoff`` with reason ``storage_fault: ...`` on the schedule of
``policy.wait_for_storage``, outside the crash history. What the daemon itself cannot
write (records, event lines, ``supervisor.json``) waits in a ``WriteBacklog`` that each
tick retries; ``storage_fault`` is logged when the first write is refused and
``storage_recovered`` when the last kept one is written, and then every task that waits
on storage is retried at once. A worker the machine refuses to start (EAGAIN, ENOMEM:
another task's tools may hold every process) is a wait too: ``backoff`` with reason
``resources: ...``, on ``policy.wait_for_resources``' schedule, never ``failed``.

Metrics (``[metrics] listen``, ``supervisor.metrics``): the daemon counts its restart,
crash-loop and storage-fault decisions where it makes them, folds the histograms its
workers publish in their heartbeats when it reads one (a liveness read, an exit, a
scrape), and answers each scrape with a sample taken on this loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

from supervisor import cgroups, inbox
from supervisor.announce import Announcer
from supervisor.approvals import AskTimeouts
from supervisor.backlog import WriteBacklog
from supervisor.cgroups import Cgroups
from supervisor.coordination import SupervisorLock, coordination
from supervisor.decisions import cancelled_by
from supervisor.exits import KillReason
from supervisor.forkserver import ForkQueue, ForkServer
from supervisor.hooks import HOOK_STATES, HOOK_TIMEOUT, HookRunner
from supervisor.launch import Launcher
from supervisor.metrics import Metrics
from supervisor.notify import NOTIFY_ENVIRONMENT, Notifier
from supervisor.operator import fields_of
from supervisor.placement import ClusterPlacement, LocalPlacement, Placement
from supervisor.record import Move, TaskRecord, arrival
from supervisor.relay import CursorFiles, EventRelay
from supervisor.reload import Reloader, Settings
from supervisor.requests import Requests
from supervisor.settle import ExitSettler
from supervisor.slot import TaskSlot
from supervisor.stores import store_for
from supervisor.strays import StraySweeper
from supervisor.surfaces import Surfaces
from supervisor.watch import LivenessWatch, sleep_to_grid
from worker import __version__, credentials
from worker.config import Config
from worker.descendants import become_subreaper
from worker.errors import (
    SpoolError,
    StateConflictError,
)
from worker.events import Event, utc_now
from worker.protocol import (
    TaskStatus,
)
from worker.spool import Spool
from worker.store.durable import private_dir

#: Seconds: the tick's longest period (a multiple of ``watch.GRID``, on whose instants it
#: falls). An idle daemon then wakes about once a second, as supervisord does; a shorter
#: ``heartbeat.interval`` or systemd's watchdog makes it tick more often.
TICK = 1.0


class Supervisor:
    """The daemon's loop and its wiring. The parts, each a role of one concept:

    * ``placement`` (``supervisor.placement``): where tasks come from (the spool's
      folders, or a shared store's queue under leases) and whose record is whose to
      write;
    * ``launcher`` (``supervisor.launch``): how a task gets its worker, forked warm or
      fresh, a refused fork a wait;
    * ``settler`` (``supervisor.settle``): a worker's exit, ``exits.settle``'s verdict
      (pure) carried out through the one transition (``save``, ``move``:
      ``TaskRecord.move_to``, its event and hook derived from the old and new state);
    * ``liveness`` (``supervisor.watch``): each worker judged when a verdict on it could
      fall due (``liveness.judge``, pure), the checks due at one instant on one timer;
    * ``requests`` (``supervisor.requests``): what commands asked of a task (cancel,
      retry, requeue, release, pause), carried out;
    * ``announcer`` (``supervisor.announce``): what the daemon says: its events, a task's
      hooks, SIGUSR1's summary, systemd's status line, ``supervisor.json``, a scrape;
    * ``strays`` (``supervisor.strays``): the sweep of what dead workers' tools left;
    * ``settings`` and ``reloader`` (``supervisor.reload``): the config in use, and what
      SIGHUP does;
    * ``forks`` (``supervisor.forkserver``): workers forked warm; ``backlog``
      (``supervisor.backlog``): writes a storage fault refused; ``relay``
      (``supervisor.relay``): other processes' events into this log; ``hooks``;
      ``metrics``, the counters; ``surfaces`` (``supervisor.surfaces``): ``/metrics``,
      the console and traces.

    Everything runs on one asyncio loop: a worker's exit (its pidfd), a doorbell
    (``_doorbell``), a timer of the watch, the tick, a signal."""

    def __init__(
        self,
        spool: Spool,
        config: Config,
        config_path: Path | None = None,
        *,
        notifier: Notifier | None = None,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
        preload: bool = True,
    ) -> None:
        self.spool = spool
        self.store = store_for(spool)  # every byte of a task goes through it
        self.announcer = Announcer(self)  # its events and hooks
        # where the tasks come from, and whose record is whose to write: this spool's
        # folders, or a shared store's queue (``supervisor.placement``)
        store = spool.shared
        self.placement: Placement = (
            LocalPlacement(self) if store is None else ClusterPlacement(self, store)
        )
        # how commands reach it: the inbox and request files, or the database's rows
        self.coordination = coordination(spool)
        # the config in use and the secrets held, and what SIGHUP does to them
        self.settings = Settings(spool.root, config, config_path, self.emit)
        self.notifier = notifier or Notifier()
        self.rng = rng or random.Random()  # noqa: S311  (restart jitter)
        self.clock = clock
        self.log = structlog.get_logger("agentd")
        self.slots: dict[str, TaskSlot] = {}
        self.stopping = False
        self._wake = asyncio.Event()
        self._stopped = asyncio.Event()
        self._lock = SupervisorLock(spool)
        # Workers get no secret in their environment, only through a pipe (worker.credentials)
        worker_env = {
            **credentials.without_credentials(
                {k: v for k, v in os.environ.items() if k not in NOTIFY_ENVIRONMENT}
            ),
            "PYTHONUNBUFFERED": "1",
            **self.placement.worker_env(),
        }
        self.launcher = Launcher(self, worker_env)  # how a task gets its worker
        self.settler = ExitSettler(self)  # what a worker's exit means for its task
        self.reloader = Reloader(self)  # what SIGHUP does
        self.requests = Requests(self)  # what commands asked of a task
        self.forkserver = (
            ForkServer(
                spool.root / "forkserver.log",
                worker_env,
                self.settings.credentials.for_workers(),
                preload_mcp=bool(config.mcp.servers),
            )
            if preload
            else None
        )
        self.forks: ForkQueue[TaskSlot] | None = (
            ForkQueue(
                self.forkserver,
                answered=self.launcher.forked,
                settle=self.launcher.forks_settled,
                emit=self.emit,
                clock=clock,
                standby_config=lambda: self.settings.worker_config,
            )
            if self.forkserver is not None
            else None
        )
        # each worker looked at when a liveness verdict on it could fall due
        self.liveness = LivenessWatch(self)
        self.backlog = WriteBacklog(
            self.settler.storage_fault, self.settler.storage_recovered, clock=clock
        )
        # what a dead worker's tools left: every child of the daemon it did not start
        self.strays = StraySweeper(
            self.own_children,
            held_back=lambda: self.forks is not None and self.forks.answering,
            killed=lambda pids: self.emit(Event.STRAYS_KILLED, pids=pids),
        )
        self.metrics = Metrics(lambda: self.config.price_table)
        # the other processes' task events, into this log (and the counters they feed)
        self.relay = EventRelay(
            self.log, self.store, self.announcer.relayed, kept=CursorFiles(spool.relay_dir)
        )
        hook_env = {k: v for k, v in worker_env.items() if k != "PYTHONUNBUFFERED"}
        self.hooks = HookRunner(hook_env, self.announcer.hook_failed)
        # /metrics, the console and traces (``supervisor.surfaces``)
        self.surfaces = Surfaces(
            spool,
            self.settings,
            self.emit,
            node=self.placement.node if self.placement.clustered else None,
            environ=worker_env,
        )
        self.cgroups = Cgroups(None, "not arranged yet")  # (``_serve`` arranges them)
        # calls asked before they run and left unanswered past [approvals] ask_timeout
        self.ask_timeouts = AskTimeouts(
            self.slots,
            lambda: self.config.approvals.ask_timeout,
            lambda slot: self.move(slot, TaskRecord.release_hold),
        )

    # -- events and the transition -------------------------------------------------------

    def emit(
        self, event: Event, slot: TaskSlot | None = None, level: str = "info", **kw: Any
    ) -> None:
        """Log ``event``; a task's also goes to its events file (``Announcer.emit``)."""
        self.announcer.emit(event, slot, level, **kw)

    def save(
        self,
        slot: TaskSlot,
        state: TaskStatus | None = None,
        *,
        durable: bool = True,
        **changes: Any,
    ) -> None:
        """Write ``slot``'s record, moved to ``state`` (``TaskRecord.move_to``) with
        ``changes``; an arrival in a new state is logged as its event (``record.arrival``)
        and runs its hook. A move the record refuses is logged and changes nothing."""
        before = slot.record.state
        if state is not None:
            try:
                slot.record.move_to(state, slot.task.id)
            except StateConflictError as exc:
                self.emit(Event.TRANSITION_REFUSED, slot, level="error", why=str(exc))
                return
        for key, value in changes.items():
            setattr(slot.record, key, value)
        self._write_record(slot, durable=durable)
        self._arrived(slot, before)

    def _write_record(self, slot: TaskSlot, *, durable: bool = True) -> None:
        record, task = slot.record, slot.task
        write = self.placement.writer(slot, lambda: record.save(task, durable=durable))
        if write is None:  # not this daemon's to write (a cluster's claim was lost)
            return
        try:  # refused by a storage fault: kept, and rewritten as it is then (``backlog``)
            self.backlog.replace(("record", task.id), write)
        except SpoolError as exc:
            self.emit(Event.RECORD_WRITE_FAILED, slot, level="error", error=str(exc))

    def _arrived(self, slot: TaskSlot, before: TaskStatus) -> None:
        """What a task's move from ``before`` to its state now says: its event, its hook."""
        record = slot.record
        said = arrival(before, record.state)
        if said is not None:
            event, level = said
            fields: dict[str, Any] = {"reason": record.reason}
            if record.state == TaskStatus.CANCELLED:  # (by whom: docs/design.md section 15)
                fields = dict(fields_of(cancelled_by(slot.task)))
            self.emit(event, slot, level=level, **fields)
        if record.state != before and record.state in HOOK_STATES:
            self.announcer.hook(slot)

    def move(self, slot: TaskSlot, move: Move) -> bool:
        """Make an operator's move (``TaskRecord.cancel``, say) on ``slot``'s record and
        save it; False, with nothing changed, when the record refuses it (a request that
        the task's state made moot: a retry of a task that no longer failed)."""
        before = slot.record.state
        try:
            move(slot.record, slot.task.id)
        except StateConflictError:
            return False
        self._write_record(slot)
        self._arrived(slot, before)
        return True

    # -- lifecycle ----------------------------------------------------------------------

    async def run(self) -> int:
        """Serve until stopped; returns the process exit code."""
        self._lock.acquire()
        try:
            return await self._serve()
        finally:
            self._lock.release()

    async def _serve(self) -> int:
        loop = asyncio.get_running_loop()
        started = utc_now()
        private_dir(self.spool.root / "inbox")
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)
        loop.add_signal_handler(signal.SIGHUP, self.reloader.reload)
        loop.add_signal_handler(signal.SIGUSR1, self.announcer.summary)
        loop.add_signal_handler(signal.SIGUSR2, self.announcer.ignored, signal.SIGUSR2)
        self.settings.accept_file(at_start=True)
        # before anything starts (a node joins, a worker runs): a listener that cannot
        # bind stops the start, in one line (and before READY: a ready daemon answers)
        self.surfaces.start(self.announcer.sample, self.relay)
        sandbox = self.launcher.probe_sandbox()

        def wake() -> None:  # (on any thread: a shared store's listener)
            loop.call_soon_threadsafe(self._doorbell)

        where = {"spool": str(self.spool.root), **self.placement.join(wake)}
        self.emit(Event.SUPERVISOR_STARTED, pid=os.getpid(), **where)
        # The inbox watch is in place before the first scan: a change made before it is
        # seen by the scan, one made after it by the watch. (One loop turn lets the
        # watcher task set up its inotify watch.)
        watcher = asyncio.create_task(inbox.watch(self.spool.root / "inbox", self._doorbell))
        await asyncio.sleep(0)
        # A subreaper: forked workers, and whatever a killed worker's tools leave, are the
        # daemon's children (the fork server needs the first; ``strays`` the other).
        self.cgroups = cgroups.delegate()  # before the fork server: it starts in the leaf
        self.emit(Event.CGROUPS, verdict=self.cgroups.verdict)
        if become_subreaper() and self.forkserver is not None:
            self.forkserver.start()  # ready in a second or two (``_start``: who waits for it)
        self.placement.adopt()
        self.rescan()
        self.announcer.info = {
            "pid": os.getpid(),
            "started_at": started,
            "version": __version__,
            "spool": str(self.spool.root),
            "node": self.placement.node,
            "sandbox": sandbox,
            "ready": True,
            "cgroups": self.cgroups.verdict,
            "console": self.surfaces.console_url,
        }
        self.announcer.publish_info()
        self.notifier.ready()
        self.emit(Event.SUPERVISOR_READY, pid=os.getpid(), tasks=len(self.slots))
        ticker = asyncio.create_task(self._tick_forever())
        try:
            rescanned = self.clock()
            while not self.stopping:
                self._schedule()
                self.announcer.publish_status()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self.placement.poll)
                due = self.placement.rescan_due(self.clock() - rescanned)
                if not self._wake.is_set() and due:
                    rescanned = self.clock()
                    self.rescan()
                self._wake.clear()
            await self._shutdown()
        finally:
            self.surfaces.stop()
            self.placement.leave()
            watcher.cancel()
            ticker.cancel()
            with contextlib.suppress(BaseException):
                await asyncio.gather(watcher, ticker, return_exceptions=True)
            self.relay.keep()  # the cursors of the lines logged since the last tick
        self.emit(Event.SUPERVISOR_STOPPED, pid=os.getpid())
        return 0

    def request_stop(self) -> None:
        if not self.stopping:
            self.stopping = True
            self.notifier.stopping()
            self.emit(Event.SUPERVISOR_STOPPING, pid=os.getpid(), workers=self.running_count())
        self._wake.set()

    async def _shutdown(self) -> None:
        grace = self.config.restart.stop_grace
        for asked in self.forks.abandon_warming() if self.forks is not None else []:
            asked.item.starting = False  # never started: it stays queued
        for slot in self.slots.values():
            if slot.worker is not None:
                slot.worker.kill_reason = slot.worker.kill_reason or KillReason.STOP
                slot.worker.signal_worker(signal.SIGTERM)
        deadline = self.clock() + grace
        while self.running_count() and self.clock() < deadline:
            await asyncio.sleep(0.05)
        for slot in self.slots.values():
            if slot.worker is not None:
                self.emit(
                    Event.WORKER_KILLED, slot, level="warning", pid=slot.worker.pid, why="stop"
                )
                slot.worker.signal_group(signal.SIGKILL)
        deadline = self.clock() + 5.0
        while self.running_count() and self.clock() < deadline:
            await asyncio.sleep(0.05)
        if self.forks is not None:
            self.forks.close()
        await self.hooks.wait(HOOK_TIMEOUT)  # a failure's hook, say, still gets its call
        await self.strays.until_none(self.clock)

    # -- signals ------------------------------------------------------------------------

    @property
    def config(self) -> Config:
        return self.settings.config

    def running_count(self) -> int:
        return sum(1 for s in self.slots.values() if s.worker is not None or s.starting)

    # -- discovering tasks --------------------------------------------------------------

    def _doorbell(self, tasks: set[str] | None = None) -> None:
        """Something changed: the tasks a command or a worker named (``Spool.ring``), or
        every task (None: a name it could not read, or a wake-up from the shared store)."""
        self.placement.ring(tasks)
        self._wake.set()

    def rescan(self) -> None:
        """Bring every task into the daemon's view, relay the events other processes
        wrote (``supervisor.relay``) and apply pending requests (``Placement.rescan``)."""
        self.placement.rescan()

    def wake(self) -> None:
        """Have the loop come round now (to schedule what changed)."""
        self._wake.set()

    # -- scheduling ---------------------------------------------------------------------

    def _schedule(self) -> None:
        """Start what may run in the places free now (``Placement.schedule``)."""
        if self.stopping:
            return
        now = self.clock()
        free = self.config.max_workers - self.running_count()
        if free <= 0:
            return
        self.placement.schedule(free, now)

    # -- the tick -----------------------------------------------------------------------

    async def _tick_forever(self) -> None:
        watchdog = self.notifier.watchdog_interval()
        next_dog = 0.0
        next_reap = 0.0
        while True:
            # every period, on its instants (the watch's: TICK is a multiple of GRID), and
            # often enough for systemd's watchdog (a reload moves it)
            period = min(self.config.heartbeat.interval, TICK, watchdog or TICK)
            await sleep_to_grid(period / 2, grid=period)
            now = self.clock()
            self.placement.tick(now)
            if watchdog and now >= next_dog:
                self.notifier.watchdog()
                # less half a period: a tick a hair early on its instant still pings
                next_dog = now + watchdog - period / 2
            if now >= next_reap:
                next_reap = now + 5.0
                self._reap()
            self.backlog.retry()  # nothing to do unless a storage fault refused a write
            self.ask_timeouts.check()  # nothing to read unless a task waits for approval
            self.relay.keep()  # the relay's cursors that moved (fsyncs, off the events' path)
            if self.forks is not None and not self.stopping:
                self.forks.tend()
            if any(s.waiting_lock for s in self.slots.values()):
                self._wake.set()

    def _reap(self) -> None:
        with contextlib.suppress(ChildProcessError):
            if os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
                return  # no child has ended: spare the sweep
        self.strays.sweep()

    # -- strays -------------------------------------------------------------------------

    def own_children(self) -> set[int]:
        """The children this daemon started on purpose and watches: its live workers, the
        fork server and the hooks that run. Any other child is a stray, killed by the
        sweep (``supervisor.strays``); a process the daemon starts for itself must be named
        here."""
        own = {s.worker.pid for s in self.slots.values() if s.worker is not None}
        own |= self.hooks.pids()
        own |= self.surfaces.pids()
        if self.forkserver is not None and self.forkserver.pid is not None:
            own.add(self.forkserver.pid)
        return own
