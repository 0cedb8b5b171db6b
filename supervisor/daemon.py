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
* one timer per worker (``liveness.Watch``) at the instant a verdict on it could fall due:
  its heartbeat is read then, and only then, so an idle daemon costs next to nothing
  however many workers it watches;
* a tick every ``min(heartbeat.interval, 0.5)`` seconds that feeds the systemd watchdog,
  retries what a storage fault refused, tends the fork server and, on a shared store, the
  leases.

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
import errno
import json
import os
import random
import signal
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import structlog

from supervisor import cgroups, exits, inbox
from supervisor import logging as agentd_logging
from supervisor.backlog import Recovery, WriteBacklog
from supervisor.cgroups import Cgroups
from supervisor.control import (
    RELEASE_REQUEST,
    REQUEUE_REQUEST,
    RETRY_REQUEST,
    SupervisorLock,
    pause_holder_alive,
    take_request,
    taken_request,
)
from supervisor.decisions import cancelled_by, pending_decisions
from supervisor.exits import KillReason
from supervisor.forkserver import Asked, ForkQueue, ForkServer
from supervisor.hooks import HOOK_STATES, HOOK_TIMEOUT, HookRunner
from supervisor.liveness import Alive, Beat, Hung, Limits, judge, limits_of
from supervisor.logging import dropped_lines
from supervisor.metrics import Metrics, Sample
from supervisor.notify import NOTIFY_ENVIRONMENT, Notifier
from supervisor.operator import Operator, fields_of
from supervisor.placement import ClusterPlacement, LocalPlacement, Placement
from supervisor.record import Move, TaskRecord, arrival
from supervisor.relay import DAEMON_MARK, CursorFiles, EventRelay
from supervisor.reload import Settings
from supervisor.slot import TaskSlot
from supervisor.status import held_calls, read_heartbeat
from supervisor.stores import shared, store_for
from supervisor.strays import StraySweeper
from supervisor.surfaces import Surfaces
from supervisor.watch import Watch
from supervisor.workers import (
    WorkerProcess,
    journal_end,
    process_started,
    spawn,
    worker_exit,
)
from worker import __version__, credentials
from worker.config import Config
from worker.descendants import become_subreaper
from worker.errors import (
    AgentdError,
    ConfigError,
    SpoolError,
    StateConflictError,
    StorageError,
)
from worker.events import event_line, utc_now
from worker.protocol import (
    EPOCH_ENV,
    FINAL_STATES,
    RETRIES_ENV,
    TAKEN_OVER_ENV,
    VERDICT_EXITS,
    TaskStatus,
)
from worker.spool import Spool, TaskDir
from worker.store.durable import atomic_write_json, private_dir
from worker.tools.sandbox import Sandbox, mode_for

#: A worker refused by these (fork: EAGAIN, ENOMEM; no descriptor left: ENFILE, EMFILE)
#: waits for the resources to come back (``_resource_wait``), it does not fail.
RESOURCE_ERRNOS = frozenset({errno.EAGAIN, errno.ENOMEM, errno.ENFILE, errno.EMFILE})


class Supervisor:
    """The daemon's loop and its wiring. The parts, each a role of one concept:

    * ``placement`` (``supervisor.placement``): where tasks come from (the spool's
      folders, or a shared store's queue under leases) and whose record is whose to
      write;
    * ``exits.settle``, pure: what a worker's exit means; ``_settle_exit`` carries it
      out, through the one transition (``save``, ``move``: ``TaskRecord.move_to``, its
      event and hook derived from the old and new state);
    * ``watch`` (``supervisor.watch``): one liveness timer per worker, ``_check`` its
      verdict (``liveness.judge``, pure);
    * ``strays`` (``supervisor.strays``): the sweep of what dead workers' tools left;
    * ``settings`` (``supervisor.reload``): the config in use and SIGHUP's reload;
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
        self.store = store_for(spool.root)  # every byte of a task goes through it
        # where the tasks come from, and whose record is whose to write: this spool's
        # folders, or a shared store's queue (``supervisor.placement``)
        store = shared()
        self.placement: Placement = (
            LocalPlacement(self) if store is None else ClusterPlacement(self, store)
        )
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
        self._last_status = ""
        # Workers get no secret in their environment, only through a pipe (worker.credentials)
        self._worker_env = {
            **credentials.without_credentials(
                {k: v for k, v in os.environ.items() if k not in NOTIFY_ENVIRONMENT}
            ),
            "PYTHONUNBUFFERED": "1",
            **self.placement.worker_env(),
        }
        self._info: dict[str, Any] = {}  # supervisor.json (``_publish_info``), once ready
        self.forkserver = (
            ForkServer(
                spool.root / "forkserver.log",
                self._worker_env,
                self.settings.credentials.for_workers(),
                preload_mcp=bool(config.mcp.servers),
            )
            if preload
            else None
        )
        self.forks: ForkQueue[TaskSlot] | None = (
            ForkQueue(
                self.forkserver,
                answered=self._forked,
                settle=self._forks_settled,
                emit=self.emit,
                clock=clock,
                standby_config=lambda: self.settings.worker_config,
            )
            if self.forkserver is not None
            else None
        )
        # one timer per worker, at the instant a liveness verdict on it could fall due
        self.watch: Watch[str] = Watch(self._check)
        self.backlog = WriteBacklog(self._storage_fault, self._storage_recovered, clock=clock)
        # what a dead worker's tools left: every child of the daemon it did not start
        self.strays = StraySweeper(
            self.own_children,
            held_back=lambda: self.forks is not None and self.forks.answering,
            killed=lambda pids: self.emit("strays_killed", pids=pids),
        )
        self.metrics = Metrics(lambda: self.config.price_table)
        # the other processes' task events, into this log (and the counters they feed)
        self.relay = EventRelay(
            self.log, self.store, self._relayed, kept=CursorFiles(spool.relay_dir)
        )
        hook_env = {k: v for k, v in self._worker_env.items() if k != "PYTHONUNBUFFERED"}
        self.hooks = HookRunner(hook_env, self._hook_failed)
        # the last operator's action on each task since its last hook: what the next
        # hook's payload says led to it (``by``, ``via``; docs/design.md section 15)
        self._acted: dict[str, dict[str, str]] = {}
        # /metrics, the console and traces (``supervisor.surfaces``)
        self.surfaces = Surfaces(
            spool,
            self.settings,
            self.emit,
            node=self.placement.node if self.placement.clustered else None,
            environ=self._worker_env,
        )
        self.cgroups = Cgroups(None, "not arranged yet")  # (``_serve`` arranges them)

    def _probe_sandbox(self) -> str:
        """How run_command will run (``Sandbox.verdict``), probed once at start: under
        ``required`` (and ``auto`` with a store) a sandbox that cannot run stops the start
        (ConfigError: exit 78); under ``auto`` it is said loudly (``sandbox_unavailable``,
        the gauge, ``supervisor.sandbox`` in status), never in silence."""
        tools = self.config.tools
        mode = mode_for(tools.sandbox, store=self.placement.clustered)
        verdict = Sandbox(mode, tools.network).verdict()
        if verdict.startswith("refused: "):
            why = "a store is configured, so" if mode is not tools.sandbox else "the config says"
            raise ConfigError(
                f"tools.sandbox: {why} run_command needs its sandbox, but {verdict[9:]}; "
                "install bubblewrap and let it create namespaces (under systemd: the "
                "unit `agentd unit` prints), then start again."
            )
        if verdict.startswith("bare: "):
            self.emit("sandbox_unavailable", level="warning", why=verdict[6:], sandbox=verdict)
        self.metrics.sandbox_available = verdict == "bwrap"
        return verdict

    # -- events -------------------------------------------------------------------------

    def emit(
        self, event: str, slot: TaskSlot | None = None, level: str = "info", **kw: Any
    ) -> None:
        """Log ``event``; a task's also goes to its events file, marked as the daemon's
        (``relay.DAEMON_MARK``), after what other processes wrote there before it."""
        if slot is None:
            getattr(self.log, level)(event, **kw)
            return
        task_id = slot.task.id
        self.relay.pull(task_id)
        kw = {"task": task_id, **kw}
        mark, value = DAEMON_MARK
        line = event_line(event, level, **kw, **{mark: value})
        written = False
        with contextlib.suppress(OSError):  # not a file of ours (a folder): dropped
            written = self.backlog.append(lambda: self.store.append_event(task_id, line))
        self._acted_on(task_id, event, kw)

        def log() -> None:
            getattr(self.log, level)(event, **kw)

        if written:  # logged where the file has it, after what another process wrote first
            self.relay.pull(task_id, own=(line, log))
        else:
            log()

    def _acted_on(self, task_id: str, event: str, fields: Mapping[str, Any]) -> None:
        """Keep the operator an event names (``by``, ``via``) for the task's next hook."""
        if (who := Operator.of(fields)) is not None:
            self._acted[task_id] = {**who.fields(), "acted": event}

    def _hook(self, slot: TaskSlot) -> None:
        """Run the hook of the state ``slot`` has just reached, if one is set
        (``supervisor.hooks``): started now, never waited for."""
        key, event = HOOK_STATES[slot.record.state]
        command = getattr(self.config.hooks, key)
        if not command:
            return
        payload: dict[str, Any] = {
            "event": event,
            "task": slot.task.id,
            "reason": slot.record.reason,
            "node": self.placement.node,
            "timestamp": utc_now(),
            **self._acted.pop(slot.task.id, {}),  # the operator's action that led here
        }
        if slot.record.state == TaskStatus.HELD:
            try:
                payload["dangling"] = held_calls(slot.task)
            except (AgentdError, OSError, ValueError) as exc:  # a journal it cannot read
                payload["dangling"] = []
                self.emit("hook_failed", slot, level="warning", hook=key, why=f"{exc}")
        self.hooks.run(key, command, payload)

    def _relayed(self, task_id: str, event: Mapping[str, Any]) -> None:
        """Another process's event reached the daemon's log: count what a metric counts,
        and keep the operator it names for the task's next hook."""
        name = str(event.get("event"))
        if name == "compaction":
            self.metrics.compactions += 1
        self._acted_on(task_id, name, event)

    def _hook_failed(self, task_id: str, hook: str, why: str) -> None:
        slot = self.slots.get(task_id)
        self.emit("hook_failed", slot, level="warning", hook=hook, why=why, task=task_id)

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
                self.emit("transition_refused", slot, level="error", why=str(exc))
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
            self.emit("record_write_failed", slot, level="error", error=str(exc))

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
            self._hook(slot)

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

    def _storage_fault(self, fault: StorageError) -> None:
        """The first write of a fault episode was refused (``WriteBacklog.on_fault``)."""
        self.metrics.storage_faults += 1
        self.log.warning("storage_fault", error=str(fault), spool=str(self.spool.root))

    def _storage_recovered(self, recovery: Recovery) -> None:
        """Every kept write is written: the disk takes writes again. The tasks that wait on
        storage are retried now, not at the end of their backoff."""
        self.log.info(
            "storage_recovered",
            rewritten=recovery.rewritten,
            dropped=recovery.dropped,
            log_lines_dropped=dropped_lines(),
            seconds=round(recovery.seconds, 3),
        )
        now = self.clock()
        for slot in self.slots.values():
            if slot.storage_waits and slot.record.state == TaskStatus.BACKOFF:
                slot.due = min(slot.due, now)
        self._wake.set()

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
        loop.add_signal_handler(signal.SIGHUP, self.reload)
        loop.add_signal_handler(signal.SIGUSR1, self.log_status)
        loop.add_signal_handler(signal.SIGUSR2, self._ignored, signal.SIGUSR2)
        self.settings.accept_file(at_start=True)
        # before anything starts (a node joins, a worker runs): a listener that cannot
        # bind stops the start, in one line (and before READY: a ready daemon answers)
        self.surfaces.start(self._metrics_sample, self.relay)
        sandbox = self._probe_sandbox()

        def wake() -> None:  # (on any thread: a shared store's listener)
            loop.call_soon_threadsafe(self._doorbell)

        where = {"spool": str(self.spool.root), **self.placement.join(wake)}
        self.emit("supervisor_started", pid=os.getpid(), **where)
        # The inbox watch is in place before the first scan: a change made before it is
        # seen by the scan, one made after it by the watch. (One loop turn lets the
        # watcher task set up its inotify watch.)
        watcher = asyncio.create_task(inbox.watch(self.spool.root / "inbox", self._doorbell))
        await asyncio.sleep(0)
        # A subreaper: forked workers, and whatever a killed worker's tools leave, are the
        # daemon's children (the fork server needs the first; ``strays`` the other).
        self.cgroups = cgroups.delegate()  # before the fork server: it starts in the leaf
        self.emit("cgroups", verdict=self.cgroups.verdict)
        if become_subreaper() and self.forkserver is not None:
            self.forkserver.start()  # ready in a second or two (``_start``: who waits for it)
        self.placement.adopt()
        self.rescan()
        self._info = {
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
        self._publish_info()
        self.notifier.ready()
        self.emit("supervisor_ready", pid=os.getpid(), tasks=len(self.slots))
        ticker = asyncio.create_task(self._tick_forever())
        try:
            rescanned = self.clock()
            while not self.stopping:
                self._schedule()
                self._publish_status()
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
        self.emit("supervisor_stopped", pid=os.getpid())
        return 0

    def request_stop(self) -> None:
        if not self.stopping:
            self.stopping = True
            self.notifier.stopping()
            self.emit("supervisor_stopping", pid=os.getpid(), workers=self.running_count())
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
                self.emit("worker_killed", slot, level="warning", pid=slot.worker.pid, why="stop")
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

    def _publish_info(self) -> None:
        """``supervisor.json``: who the daemon is, and whether it holds an API key (what
        ``submit`` warns about: never the key itself)."""
        if not self._info:  # not ready yet: ``run`` publishes it
            return
        held = self.settings.credentials
        has_key = held.get(credentials.API_KEY) or held.get(credentials.AUTH_TOKEN)
        info = {**self._info, "api_key": bool(has_key)}
        if not has_key:
            info["api_key_hint"] = credentials.how_to_change(credentials.API_KEY, os.environ)
        self.backlog.replace(
            "supervisor.json", lambda: atomic_write_json(self.spool.root / "supervisor.json", info)
        )

    def reload(self) -> None:
        """SIGHUP: reopen the log file (for logrotate), read the secrets kept in files and
        the config file again (``supervisor.reload``). A good config is applied: at once
        (max_workers, heartbeat.timeout, deadlines, restart, hooks, console: judged at the
        next verdict), by workers started from now on (heartbeat.interval, model, tools,
        mcp), or at the next start (anything else, the spool first). A lower max_workers
        stops no running worker; it starts no more until the count is under it. Secrets
        that changed go to the workers started from now on (the fork server is started
        again with them) and, the store's, to its next login."""
        try:
            reopened = agentd_logging.reopen_log_file()
        except OSError as exc:
            self.emit("log_reopen_failed", level="warning", error=str(exc))
        else:
            if reopened is not None:
                self.emit("log_reopened", path=str(reopened))
        renewed = self.settings.reread_credentials()
        if renewed:
            held = self.settings.credentials
            if credentials.STORE in renewed:
                try:  # a password that stopped working is a wait, until this new one
                    self.placement.relogin(held.values[credentials.STORE])
                except ConfigError as exc:
                    self.emit("config_reload_failed", level="warning", reason=str(exc))
            if self.forks is not None:
                self.forks.renew(held.for_workers())
            self._publish_info()
        before = self.config
        if self.settings.reload(renewed) is None:
            return
        self.watch.rearm_all(self.clock())  # every worker judged by the new limits now
        if self.forks is not None:  # the standby read the old config ahead: a new one
            self.forks.renew_standby()
        if self.surfaces.reload(before) and self._info:  # the console moved
            self._info["console"] = self.surfaces.console_url
            self._publish_info()
        self._wake.set()

    def log_status(self) -> None:
        """SIGUSR1: one line that says what the daemon is doing, in its own log."""
        counts: dict[str, int] = {}
        for slot in self.slots.values():
            counts[slot.record.state] = counts.get(slot.record.state, 0) + 1
        server = self.forkserver
        self.emit(
            "supervisor_status",
            pid=os.getpid(),
            tasks={state: counts[state] for state in TaskStatus if counts.get(state)},
            workers=self.running_count(),
            max_workers=self.config.max_workers,
            forkserver="off" if server is None else "ready" if server.ready else "starting",
            config=str(self.settings.file) if self.settings.file else None,
            stopping=self.stopping,
        )

    def _ignored(self, sig: int) -> None:
        self.emit("signal_ignored", signal=signal.Signals(sig).name, pid=os.getpid())

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

    def apply_requests(self, slot: TaskSlot) -> None:
        if (
            (slot.record.state not in FINAL_STATES or slot.worker is not None)
            and self.store.cancel_requested(slot.task.id)
            and not (slot.record.foreground and self.store.owned(slot.task.id))
        ):  # (a foreground task's running `agentd run` applies its cancel itself)
            self.cancel(slot)
        asked = taken_request(slot.task, RETRY_REQUEST)
        if asked is not None and self.move(slot, TaskRecord.retry):
            self.emit("task_retried", slot, **fields_of(Operator.of(asked)))
        if take_request(slot.task, REQUEUE_REQUEST) and slot.worker is None:
            self.move(slot, TaskRecord.requeue)
        if take_request(slot.task, RELEASE_REQUEST) and not slot.record.foreground:
            self.move(slot, TaskRecord.release_hold)  # a budget raised (``supervisor.budgets``)
        slot.paused = pause_holder_alive(slot.task)
        if slot.paused and slot.worker is not None and slot.worker.kill_reason is None:
            slot.worker.kill_reason = KillReason.STOP  # a safe-point stop; the task resumes after
            slot.worker.signal_worker(signal.SIGTERM)
            self._stop_in_grace(slot, slot.worker, self.clock())

    def cancel(self, slot: TaskSlot) -> None:
        """Apply an operator's cancel: a worker gets TERM (its group: the running tool
        too), then KILL after the grace; a task without one is cancelled at once."""
        worker = slot.worker
        if worker is not None:
            if worker.kill_reason != KillReason.CANCEL:
                worker.kill_reason = KillReason.CANCEL
                worker.signal_group(signal.SIGTERM)
                self._stop_in_grace(slot, worker, self.clock())
        elif not slot.starting:  # (one being started is cancelled as it arrives: ``_started``)
            self.move(slot, TaskRecord.cancel)

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

    def _env_for(self, slot: TaskSlot) -> dict[str, str]:
        """The worker's environment: with the claim it runs under, on a shared store, the
        operator's retries, and the task's cgroup where cgroups are delegated (made now,
        with the limits)."""
        env = self._worker_env
        if slot.record.retries:
            env = {**env, RETRIES_ENV: str(slot.record.retries)}
        if slot.owner is not None:
            env = {**env, EPOCH_ENV: str(slot.owner.epoch)}
            if slot.owner.previous is not None:
                env[TAKEN_OVER_ENV] = json.dumps(slot.owner.previous.to_json())
        tools = self.config.tools
        try:
            return {
                **env,
                **self.cgroups.prepare(slot.task.id, tools.max_processes, tools.max_memory),
            }
        except OSError as exc:  # the task runs on, bounded only as the daemon is
            self.emit("cgroup_failed", slot, level="warning", why=f"{exc}")
            return env

    def start(self, slot: TaskSlot) -> None:
        """Start a worker for ``slot``: asked of the fork server when it is ready (the
        answer is handled when it arrives, ``_forked``: the loop goes on meanwhile), else a
        fresh interpreter at once. A start waits for a server still warming up
        (``forkserver.WARMUP_WAIT`` at most) when a fresh one would take as long
        (``_worth_the_wait``), so a worker that dies in the first seconds after the daemon
        started is replaced warm."""
        forks = self.forks
        if forks is not None and forks.ask(
            slot,
            journal_end(slot.task),
            slot.task.path,
            self.settings.worker_config,
            self._env_for(slot),
            slot.task.output,
            wait=not forks.server.ready and self._worth_the_wait(slot),
        ):
            slot.starting = True
            return
        self._start_fresh(slot)

    def _worth_the_wait(self, slot: TaskSlot) -> bool:
        """Whether a start of ``slot`` is better off waiting for the fork server: a restart
        (a fresh interpreter would compete with the server's import for the CPU), or a
        task on the Messages API (a fresh interpreter imports the very SDK the server is
        importing). A scripted task's first start does not wait: it needs no SDK."""
        if slot.record.restarts > 0:
            return True
        try:
            return not self.store.load_spec(slot.task.id).scripted
        except (AgentdError, OSError):
            return False  # started fresh: the worker says what is wrong with the spec

    def _start_fresh(self, slot: TaskSlot) -> None:
        try:
            worker = spawn(
                slot.task,
                self.settings.worker_config,
                self._env_for(slot),
                self.settings.credentials.for_workers(),
            )
        except OSError as exc:
            if exc.errno in RESOURCE_ERRNOS:
                self._resource_wait(slot, f"cannot start a worker: {exc}")
                return
            self.save(slot, TaskStatus.FAILED, reason=f"cannot start a worker: {exc}")
            return
        self._started(slot, worker)

    def _resource_wait(self, slot: TaskSlot, why: str) -> None:
        """The machine refused a worker a process at its start (the fork): a wait."""
        if self.stopping:
            self.save(slot, TaskStatus.QUEUED)
            return
        waits = slot.resource_waits + 1
        self._wait(
            slot, exits.waiting(exits.WaitKind.RESOURCES, waits, why, self.config.restart, self.rng)
        )

    def _started(self, slot: TaskSlot, worker: WorkerProcess) -> None:
        self.attach(slot, worker)
        if self.stopping:  # asked before the stop, answered after it
            worker.kill_reason = KillReason.STOP
            worker.signal_worker(signal.SIGTERM)
        elif self.cancel_requested(slot):  # cancelled while being started
            self.cancel(slot)
        # Not fsync'd: a `running` record is a claim that recovery checks against the task
        # lock (`LocalPlacement._recover`), never trusts; every task start would otherwise
        # wait on 2 fsyncs.
        pid_started = process_started(worker.pid)
        self.save(slot, TaskStatus.RUNNING, durable=False, pid=worker.pid, pid_started=pid_started)
        self.emit("worker_spawned", slot, pid=worker.pid)

    def _forked(self, asked: Asked[TaskSlot], pid: int | None) -> None:
        """The fork server's answer to a start of ``asked.item``: a worker to watch, or
        (None: it could not fork one; or the pid is gone already) a fresh start."""
        slot = asked.item
        slot.starting = False
        if pid is None:
            self._start_fresh(slot)
            return
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:  # gone and reaped already: it cannot be watched
            self._start_fresh(slot)
            return
        worker = WorkerProcess(
            slot.task, pid, pidfd, None, journal_at=asked.journal_at, forked=True
        )
        self._started(slot, worker)

    def _forks_settled(self, lost: list[Asked[TaskSlot]]) -> None:
        """The fork queue changed: start fresh what the fork server will not serve, and
        run the sweep of strays that waited for its answers."""
        for asked in lost:
            asked.item.starting = False
            self._start_fresh(asked.item)
        self.strays.sweep_if_due()
        self._wake.set()

    def attach(self, slot: TaskSlot, worker: WorkerProcess) -> None:
        slot.worker = worker
        asyncio.get_running_loop().add_reader(worker.pidfd, self._on_exit, slot)
        self.watch.arm(slot.task.id, self.clock())

    # -- exits --------------------------------------------------------------------------

    def _on_exit(self, slot: TaskSlot) -> None:
        worker = slot.worker
        if worker is None:
            return
        asyncio.get_running_loop().remove_reader(worker.pidfd)
        self.watch.disarm(slot.task.id)
        code, sig = worker.exit_status()
        worker.close()
        worker.signal_group(signal.SIGKILL)  # nothing of the worker keeps acting
        slot.worker = None
        self.strays.sweep()  # nor what its tools started outside its group
        self.cgroups.release(slot.task.id)
        beat = self._heartbeat(slot) or {}
        if beat.get("pid") == worker.pid:  # its last beat, written as it ended
            self.metrics.fold(slot.task.id, beat)
        slot.record.progressed(beat)  # written with the verdict, durably
        self.metrics.forget(slot.task.id)
        turn = int(beat.get("turn", 0))
        level = "info" if sig is None and code in VERDICT_EXITS else "warning"
        self.emit(
            "worker_exited", slot, level=level, pid=worker.pid, turn=turn, code=code, signal=sig
        )
        if worker.kill_reason == KillReason.LEASE_LOST:  # the task is another node's now
            self._wake.set()
            return
        self._settle_exit(slot, worker_exit(worker, code, sig, turn))
        self._wake.set()

    # The daemon's reads of a task on the way to a verdict. On the spool's files they do
    # not fail; a shared store may be away (invariant 8), and the daemon serves on: each
    # read gives what it would without the item, and what the verdict writes waits in the
    # backlog until the database is back.

    def _heartbeat(self, slot: TaskSlot) -> dict[str, Any] | None:
        try:
            return read_heartbeat(slot.task)
        except StorageError:
            return None

    def _decided(self, slot: TaskSlot) -> bool:
        try:
            return pending_decisions(slot.task)
        except StorageError:
            return False

    def cancel_requested(self, slot: TaskSlot) -> bool:
        try:
            return self.store.cancel_requested(slot.task.id)
        except StorageError:
            return False

    def _settle_exit(self, slot: TaskSlot, ended: exits.WorkerExit) -> None:
        """Carry out ``exits.settle``'s verdict on a worker's exit."""
        record = slot.record
        record.last_exit, record.pid = ended.last_exit, None
        view = exits.TaskView(
            record.crashes,
            slot.storage_waits,
            slot.resource_waits,
            stopping=self.stopping,
            shared=self.placement.clustered,
        )
        verdict = exits.settle(ended, view, self.config.restart, self.rng)
        if not isinstance(verdict, exits.Wait):
            slot.storage_waits = slot.resource_waits = 0
        match verdict:
            case exits.Cancelled():
                self.move(slot, TaskRecord.cancel)  # (a worker ran: it had not ended)
            case exits.Ended(state=state, reason=reason):
                self.save(slot, state, reason=reason)
            case exits.Held(reason=reason):
                if self._decided(slot):  # decided already: nobody to call
                    self.save(slot, TaskStatus.QUEUED, reason=None)
                else:
                    self.save(slot, TaskStatus.HELD, reason=reason)
            case exits.Requeued():
                self.save(slot, TaskStatus.QUEUED, reason=None)
            case exits.Fenced():
                self.placement.fenced(slot)
            case exits.LockWait():
                slot.waiting_lock = True
                self.save(slot, TaskStatus.QUEUED)
            case exits.Wait():
                self._wait(slot, verdict)
            case exits.GaveUp(reason=reason, turn=turn, crashes=crashes):
                record.crashes = crashes
                self.metrics.crash_loops += 1
                self.emit("crash_loop", slot, level="error", turn=turn, crashes=len(crashes))
                self.save(slot, TaskStatus.FAILED, reason=reason)
            case exits.Restart():
                self._restart(slot, verdict)

    def _wait(self, slot: TaskSlot, wait: exits.Wait) -> None:
        """A wait, not a crash: a storage fault (exit 7: a full, failing or read-only disk),
        a machine that refused a worker a process or memory (at its start, or its exit 8:
        another task's tools may hold them all), or an MCP server that could not list its
        tools at the task's first start (exit 9: ``mcp_server_failed`` said why). Nothing
        goes into the crash history and no restart is counted; the task is retried on
        ``policy.wait_for_storage``'s schedule (or at once, for storage, when the daemon's
        own writes recover) until the fault clears."""
        if wait.kind is exits.WaitKind.STORAGE:
            slot.storage_waits, slot.resource_waits = wait.waits, 0
        else:
            slot.storage_waits, slot.resource_waits = 0, wait.waits
        slot.due = self.clock() + wait.delay
        self.save(slot, TaskStatus.BACKOFF, reason=wait.reason)
        if wait.waits == 1 and wait.kind is exits.WaitKind.STORAGE:
            self.metrics.storage_faults += 1
            self.emit("storage_fault", slot, level="warning", error=wait.why)
        elif wait.waits == 1 and wait.kind is exits.WaitKind.RESOURCES:
            self.emit("resource_wait", slot, level="warning", error=wait.why)
        self.emit("restart_scheduled", slot, delay=round(wait.delay, 3), why=str(wait.kind))
        asyncio.get_running_loop().call_later(wait.delay, self._wake.set)

    def _restart(self, slot: TaskSlot, restart: exits.Restart) -> None:
        """A crash ``policy.decide`` restarts: at once when it followed progress and the
        place is free, else after its backoff (or in the queue, behind the tasks that
        waited before it)."""
        slot.record.crashes = restart.crashes
        slot.record.restarts += 1
        self.metrics.restarts += 1
        slot.due = self.clock() + restart.delay
        if restart.delay == 0 and self._restart_now(slot):
            if not self.placement.new_epoch(slot):
                return  # the task is another node's now
            # At once, on this very exit: the record is written once, as `running`
            # (restart count, crash and reason included), not first as `queued` too.
            slot.record.reason = None
            self.emit("restart_scheduled", slot, delay=0.0, queued=False, turn=restart.turn)
            self.start(slot)
            return
        # `queued`: no backoff, but it waits its turn for a place (max_workers), or for an
        # operator's pause, behind the tasks that were queued before it
        queued = restart.delay == 0
        self.save(slot, TaskStatus.QUEUED if queued else TaskStatus.BACKOFF, reason=None)
        self.emit(
            "restart_scheduled",
            slot,
            delay=round(restart.delay, 3),
            queued=queued,
            turn=restart.turn,
        )
        if not queued:
            asyncio.get_running_loop().call_later(restart.delay, self._wake.set)

    def _restart_now(self, slot: TaskSlot) -> bool:
        """Whether ``slot`` may take its freed place at once: nothing holds it back and no
        other task waits for a place (it would have the place first: ``_schedule``)."""
        if slot.paused or slot.waiting_lock or self.running_count() >= self.config.max_workers:
            return False
        return not any(
            other is not slot
            and other.worker is None
            and not other.starting
            and not other.record.foreground
            and other.record.state == TaskStatus.QUEUED
            for other in self.slots.values()
        )

    # -- liveness -----------------------------------------------------------------------

    async def _tick_forever(self) -> None:
        watchdog = self.notifier.watchdog_interval()
        next_dog = 0.0
        next_reap = 0.0
        while True:
            await asyncio.sleep(min(self.config.heartbeat.interval, 0.5))  # (a reload moves it)
            now = self.clock()
            self.placement.tick(now)
            if watchdog and now >= next_dog:
                self.notifier.watchdog()
                next_dog = now + watchdog
            if now >= next_reap:
                next_reap = now + 5.0
                self._reap()
            self.backlog.retry()  # nothing to do unless a storage fault refused a write
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

    def check_liveness(self, wall: float, mono: float) -> None:
        """The verdicts due by ``mono`` (the watch's timers give them as they fall due; a
        daemon stopped with SIGSTOP wakes with them all due at once)."""
        self.watch.check_due(wall, mono)

    def _check(self, task_id: str, wall: float, mono: float) -> float | None:
        """The liveness verdict on a task's worker, when its watch says one could be due:
        hung, killed; stalled, stopped (TERM, then KILL after the grace); alive, looked at
        again when a verdict could next fall due (``liveness.judge``, on the monotonic
        clock; ``wall`` only carries a heartbeat of an earlier release over to it). A
        worker that has ended is settled as an exit before any verdict. Returns when to
        look again (None: no more verdicts on this worker)."""
        slot = self.slots.get(task_id)
        worker = slot.worker if slot is not None else None
        if slot is None or worker is None:
            return None
        if worker.exited():
            self._on_exit(slot)
            return None
        if worker.term_deadline is not None:
            if mono < worker.term_deadline:
                return worker.term_deadline
            self.emit("worker_killed", slot, level="warning", pid=worker.pid)
            worker.signal_group(signal.SIGKILL)
            worker.term_deadline = None
            return None
        if worker.kill_reason:
            return None  # being stopped: its exit settles it
        limits = self.liveness_limits()
        try:
            data = read_heartbeat(slot.task)
        except StorageError:  # a shared store away: no verdict on a beat unread
            self.placement.away_at = mono
            return mono + limits.interval
        fresh = data is not None and data.get("pid") == worker.pid
        beat = Beat.of(data, wall, mono) if fresh and data is not None else None
        verdict = judge(beat, worker.started, mono, limits)
        if isinstance(verdict, Alive):
            return verdict.until
        if isinstance(verdict, Hung) and mono - self.placement.away_at < limits.timeout:
            # the shared store was at fault within a timeout: its worker could not beat
            # (a read-only or lost database), which is no hang; its lease bounds it
            return mono + limits.interval
        if isinstance(verdict, Hung):
            worker.kill_reason = KillReason.HUNG
            self.emit("worker_hung", slot, level="warning", pid=worker.pid, age=verdict.age)
            worker.signal_group(signal.SIGKILL)
            return None
        worker.kill_reason = KillReason.STALLED
        self.emit("worker_stalled", slot, level="warning", pid=worker.pid, phase=verdict.phase)
        worker.signal_group(signal.SIGTERM)
        return self._stop_in_grace(slot, worker, mono)

    def _stop_in_grace(self, slot: TaskSlot, worker: WorkerProcess, now: float) -> float:
        """A worker sent TERM is killed (its group) if it has not ended ``restart.stop_grace``
        from ``now``: its watch looks again then."""
        worker.term_deadline = now + self.config.restart.stop_grace
        self.watch.arm(slot.task.id, worker.term_deadline)
        return worker.term_deadline

    def liveness_limits(self) -> Limits:
        return limits_of(self.config)

    # -- metrics ------------------------------------------------------------------------

    def _metrics_sample(self) -> Sample:
        """A scrape's values (on the loop): the running workers' beats folded first, so the
        histograms are as fresh as their last beat."""
        states: dict[str, int] = {}
        held: list[tuple[TaskDir, str]] = []
        for slot in self.slots.values():
            state = slot.record.state
            states[state] = states.get(state, 0) + 1
            if state == TaskStatus.HELD:
                held.append((slot.task, slot.record.updated_at))
            if slot.worker is not None:
                beat = self._heartbeat(slot)
                if beat is not None and beat.get("pid") == slot.worker.pid:
                    self.metrics.fold(slot.task.id, beat)
        return self.metrics.sample(states, held, nodes=self.placement.nodes_alive())

    # -- status -------------------------------------------------------------------------

    def _publish_status(self) -> None:
        if not self.notifier.enabled:  # no systemd to tell: spare counting every task
            return
        counts: dict[str, int] = {}
        for slot in self.slots.values():
            counts[slot.record.state] = counts.get(slot.record.state, 0) + 1
        text = ", ".join(f"{counts[s]} {s}" for s in TaskStatus if counts.get(s)) or "no tasks"
        if text != self._last_status:
            self._last_status = text
            self.notifier.status(text)
