"""Starting workers: the daemon's role that gives a task a worker (docs/design.md
section 7).

A start is asked of the fork server when it is ready (its answer, ``forked``, arrives on the
loop, which goes on meanwhile), else made from a fresh interpreter at once. A start waits
for a server still warming up when a fresh interpreter would take as long
(``worth_the_wait``). A machine that refuses the fork (EAGAIN, ENOMEM, ENFILE, EMFILE) is a
wait, never a failure (``exits.WaitKind.RESOURCES``). A worker started is attached: its
pidfd read by the loop (its exit, ``ExitSettler.on_exit``) and its liveness judged
(``LivenessWatch``).
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import signal
from typing import TYPE_CHECKING

from supervisor import exits
from supervisor.exits import KillReason
from supervisor.forkserver import Asked
from supervisor.workers import WorkerProcess, journal_end, process_started, spawn
from worker.errors import AgentdError, ConfigError
from worker.events import Event
from worker.protocol import EPOCH_ENV, RETRIES_ENV, TAKEN_OVER_ENV, TaskStatus
from worker.tools.sandbox import Sandbox, mode_for

if TYPE_CHECKING:
    from supervisor.daemon import Supervisor
    from supervisor.slot import TaskSlot

#: A worker refused by these (fork: EAGAIN, ENOMEM; no descriptor left: ENFILE, EMFILE)
#: waits for the resources to come back (``resource_wait``), it does not fail.
RESOURCE_ERRNOS = frozenset({errno.EAGAIN, errno.ENOMEM, errno.ENFILE, errno.EMFILE})


class Launcher:
    """How a task gets its worker (module docstring)."""

    def __init__(self, daemon: Supervisor, worker_env: dict[str, str]) -> None:
        self.daemon = daemon
        self.worker_env = worker_env  # every worker's: the node's, on a shared store

    def probe_sandbox(self) -> str:
        """How run_command will run (``Sandbox.verdict``), probed once at start: under
        ``required`` (and ``auto`` with a store) a sandbox that cannot run stops the start
        (ConfigError: exit 78); under ``auto`` it is said loudly (``sandbox_unavailable``,
        the gauge, ``supervisor.sandbox`` in status), never in silence."""
        tools = self.daemon.config.tools
        mode = mode_for(tools.sandbox, store=self.daemon.placement.clustered)
        verdict = Sandbox(mode, tools.network).verdict()
        if verdict.startswith("refused: "):
            why = "a store is configured, so" if mode is not tools.sandbox else "the config says"
            raise ConfigError(
                f"tools.sandbox: {why} run_command needs its sandbox, but {verdict[9:]}; "
                "install bubblewrap and let it create namespaces (under systemd: the "
                "unit `agentd unit` prints), then start again."
            )
        if verdict.startswith("bare: "):
            why = verdict[6:]
            self.daemon.emit(Event.SANDBOX_UNAVAILABLE, level="warning", why=why, sandbox=verdict)
        self.daemon.metrics.sandbox_available = verdict == "bwrap"
        return verdict

    def start(self, slot: TaskSlot) -> None:
        """Start a worker for ``slot`` (module docstring)."""
        daemon = self.daemon
        forks = daemon.forks
        if forks is not None and forks.ask(
            slot,
            journal_end(slot.task),
            slot.task.path,
            daemon.settings.worker_config,
            self._env_for(slot),
            slot.task.output,
            wait=not forks.server.ready and self._worth_the_wait(slot),
        ):
            slot.starting = True
            return
        self._start_fresh(slot)

    def _env_for(self, slot: TaskSlot) -> dict[str, str]:
        """The worker's environment: with the claim it runs under, on a shared store, the
        operator's retries, and the task's cgroup where cgroups are delegated (made now,
        with the limits)."""
        daemon = self.daemon
        env = self.worker_env
        if slot.record.retries:
            env = {**env, RETRIES_ENV: str(slot.record.retries)}
        if slot.owner is not None:
            env = {**env, EPOCH_ENV: str(slot.owner.epoch)}
            if slot.owner.previous is not None:
                env[TAKEN_OVER_ENV] = json.dumps(slot.owner.previous.to_json())
        tools = daemon.config.tools
        try:
            return {
                **env,
                **daemon.cgroups.prepare(slot.task.id, tools.max_processes, tools.max_memory),
            }
        except OSError as exc:  # the task runs on, bounded only as the daemon is
            daemon.emit(Event.CGROUP_FAILED, slot, level="warning", why=f"{exc}")
            return env

    def _worth_the_wait(self, slot: TaskSlot) -> bool:
        """Whether a start of ``slot`` is better off waiting for the fork server: a restart
        (a fresh interpreter would compete with the server's import for the CPU), or a
        task on the Messages API (a fresh interpreter imports the very SDK the server is
        importing). A scripted task's first start does not wait: it needs no SDK."""
        if slot.record.restarts > 0:
            return True
        try:
            return not self.daemon.store.load_spec(slot.task.id).scripted
        except (AgentdError, OSError):
            return False  # started fresh: the worker says what is wrong with the spec

    def _start_fresh(self, slot: TaskSlot) -> None:
        daemon = self.daemon
        try:
            worker = spawn(
                slot.task,
                daemon.settings.worker_config,
                self._env_for(slot),
                daemon.settings.credentials.for_workers(),
            )
        except OSError as exc:
            if exc.errno in RESOURCE_ERRNOS:
                self.resource_wait(slot, f"cannot start a worker: {exc}")
                return
            daemon.save(slot, TaskStatus.FAILED, reason=f"cannot start a worker: {exc}")
            return
        self._started(slot, worker)

    def resource_wait(self, slot: TaskSlot, why: str) -> None:
        """The machine refused a worker a process at its start (the fork): a wait."""
        daemon = self.daemon
        if daemon.stopping:
            daemon.save(slot, TaskStatus.QUEUED)
            return
        waits = slot.resource_waits + 1
        restart = daemon.config.restart
        wait = exits.waiting(exits.WaitKind.RESOURCES, waits, why, restart, daemon.rng)
        daemon.settler.wait(slot, wait)

    def _started(self, slot: TaskSlot, worker: WorkerProcess) -> None:
        daemon = self.daemon
        self.attach(slot, worker)
        if daemon.stopping:  # asked before the stop, answered after it
            worker.kill_reason = KillReason.STOP
            worker.signal_worker(signal.SIGTERM)
        elif daemon.requests.cancel_requested(slot):  # cancelled while being started
            daemon.requests.cancel(slot)
        # Not fsync'd: a `running` record is a claim that recovery checks against the task
        # lock (`LocalPlacement._recover`), never trusts; every task start would otherwise
        # wait on 2 fsyncs.
        started = process_started(worker.pid)
        daemon.save(slot, TaskStatus.RUNNING, durable=False, pid=worker.pid, pid_started=started)
        daemon.emit(Event.WORKER_SPAWNED, slot, pid=worker.pid)

    def forked(self, asked: Asked[TaskSlot], pid: int | None) -> None:
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

    def forks_settled(self, lost: list[Asked[TaskSlot]]) -> None:
        """The fork queue changed: start fresh what the fork server will not serve, and
        run the sweep of strays that waited for its answers."""
        for asked in lost:
            asked.item.starting = False
            self._start_fresh(asked.item)
        self.daemon.strays.sweep_if_due()
        self.daemon.wake()

    def attach(self, slot: TaskSlot, worker: WorkerProcess) -> None:
        """Watch ``worker`` as ``slot``'s: its exit and its liveness."""
        slot.worker = worker
        asyncio.get_running_loop().add_reader(worker.pidfd, self.daemon.settler.on_exit, slot)
        self.daemon.liveness.watch(slot)
