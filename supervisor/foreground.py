"""``agentd run``: one task in the foreground, no daemon (docs/design.md section 16).

``ForegroundRun`` does for one task what the daemon does for many, in the process of the
person who typed the command:

* the worker is started fresh (``python -m worker TASKDIR``, ``supervisor.workers.spawn``)
  as a child of this process, which is a child subreaper: what the worker's tools leave
  comes here and is killed when the worker ends, and the worker is killed the moment
  this process ends, even of a kill -9 (``worker.descendants.dies_with``). The task is
  left as a crash leaves it: resumable, by ``agentd run --resume`` or a daemon;
* a crash or a hang is restarted with resume under ``[restart]`` (``policy.decide``, the
  daemon's own rules: ``crash_loop`` fails the task); a storage fault, or a machine out of
  processes, is a wait, said on the terminal;
* the transcript is streamed as the journal grows, as ``agentd show`` renders it
  (``supervisor.run_terminal``);
* Ctrl-C, SIGHUP (a closed terminal) and SIGTERM ask the worker to stop at its next safe
  point (SIGTERM to the worker alone, as ``agentd stop`` has the daemon do: a model call
  is abandoned at once, a running tool call is waited for until its result is recorded,
  up to ``restart.stop_grace``); a second one kills the worker's group at once, and the
  call in flight follows the dangling rules when the task is resumed;
* a hold is put to the person through ``ask`` (re-run, skip, record a result), and the
  answer recorded as ``agentd approve-dangling`` records it (``supervisor.hold_prompt``);
  without ``ask`` (no terminal) the run ends with the task held, for a daemon or a later
  ``run --resume``.

The task record is this process's to write while it runs the task (it is marked
``foreground``: a daemon on the same spool leaves it alone, ``supervisor.daemon``); each
write reads the record again and compares-and-sets it (``control.move_record``), so an
operator's cancel or decision made meanwhile is never written over.

Only the spool's own files are served: on a shared store a task belongs to the nodes,
and ``prepare`` refuses it in one line (``agentd submit`` it instead).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import time
from enum import IntEnum
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

from supervisor import exits
from supervisor.control import move_record
from supervisor.coordination import operator_lock, running_pid
from supervisor.decisions import cancelled_by, pending_decisions
from supervisor.exits import KillReason
from supervisor.hold_prompt import Ask, AskBudget, HoldPrompt, Interrupted
from supervisor.liveness import Alive, Beat, Hung, Limits, hung_by_deadman, judge, limits_of
from supervisor.operator import fields_of
from supervisor.record import Move, TaskRecord, arrival
from supervisor.run_terminal import RunTerminal
from supervisor.status import held_calls, read_heartbeat
from supervisor.stores import store_of
from supervisor.strays import sweep_until_none
from supervisor.traces import TraceTail, exporter_for
from supervisor.workers import WorkerProcess, process_started, spawn, worker_exit
from worker import credentials
from worker.budget import budget_hold
from worker.config import Config
from worker.descendants import become_subreaper
from worker.errors import LockBusyError, StateConflictError, StorageError, UsageError
from worker.events import Event, record_event
from worker.lock import TaskLock
from worker.protocol import (
    RETRIES_ENV,
    VERDICT_EXITS,
    TaskStatus,
)
from worker.spool import Spool, TaskDir

#: Seconds between two looks at the journal, the heartbeat and a cancel while a worker
#: runs (its exit is seen at once: its pidfd).
POLL = 0.1
#: In the task folder: the flock of the ``agentd run`` that runs the task (``claim``).
FOREGROUND_LOCK = "foreground.lock"


class RunExit(IntEnum):
    """How ``agentd run`` ends (docs/design.md section 16)."""

    DONE = 0
    FAILED = 1
    HELD = 3  # held for a decision, or cancelled
    INTERRUPTED = 130


def claim(task: TaskDir) -> TaskLock:
    """This process's claim to run ``task`` in the foreground, held until it lets it go or
    ends (an flock on ``FOREGROUND_LOCK``: the kernel drops it with the process, a kill -9
    too, and its descriptor is not inherited by the worker). Taken before ``prepare`` reads
    anything: of two ``agentd run`` of one task, the second is refused (exit 3) before it
    writes, so the record stays the first one's while its worker starts and runs."""
    try:
        return TaskLock(task.path / FOREGROUND_LOCK).acquire()
    except LockBusyError as exc:
        raise StateConflictError(
            f"task {task.id} is being run by another `agentd run` (pid {exc.holder_pid}); "
            f"`agentd logs {task.id} --follow` watches it."
        ) from None


def prepare(task: TaskDir, spool: Spool) -> TaskRecord | None:
    """Take ``task`` into the foreground for ``agentd run --resume``: its record, marked,
    or None when the task is done already (nothing to run). Refused (exit 3) when it was
    cancelled, when a worker runs it (a daemon's, or another ``agentd run``'s), and when it
    is a daemon's task while that daemon runs. A failed task is retried. The caller holds
    the task's ``claim``."""
    refuse_shared(shared=spool.shared is not None)
    store = store_of(task)
    with operator_lock(task):
        record = TaskRecord.load(task)
        record.check_resume(task.id)
        if store.cancel_requested(task.id) and record.state != TaskStatus.DONE:
            raise StateConflictError(f"task {task.id} was cancelled; it takes no resume.")
        if record.state == TaskStatus.DONE:
            return None
        if store.owned(task.id):
            pid = store.owner_pid(task.id)
            who = "agentd run" if record.foreground else "the daemon"
            raise StateConflictError(
                f"task {task.id} is running (worker pid {pid}, started by {who}); "
                f"`agentd logs {task.id} --follow` watches it."
            )
        daemon = running_pid(spool)
        if daemon is not None and not record.foreground:
            raise StateConflictError(
                f"task {task.id} is {record.state} under the daemon (pid {daemon}); "
                f"`agentd logs {task.id} --follow` watches it."
            )
        move_record(task, TaskRecord.take_foreground)
        return TaskRecord.load(task)


def refuse_shared(*, shared: bool) -> None:
    """``agentd run`` serves the spool's own files only: on a shared store (``shared``)
    every task is the nodes' to run (docs/guides/run.md)."""
    if shared:
        raise UsageError(
            "agentd run works on a spool's own files, not on a shared store; "
            "`agentd submit` the task and let a node run it."
        )


def resume_command(task_id: str, prefix: str = "agentd") -> str:
    """The line that carries the task on: ``agentd run --resume TASK``."""
    return f"{prefix} run --resume {task_id}"


class ForegroundRun:
    """One task's worker run in this process until the task ends, holds, or the person
    interrupts (``run``, which returns a ``RunExit``).

    ``out`` takes the transcript (``json_lines``: one object a line, whole; else
    ``transcript.Renderer``'s text), ``err`` the run's own lines (restarts, waits, the
    end): ``terminal``, a ``RunTerminal``. ``ask`` puts a held call to the person (None:
    no terminal), ``ask_budget`` a budget: ``holds``, a ``HoldPrompt``."""

    def __init__(
        self,
        task: TaskDir,
        config: Config,
        config_path: Path | None,
        *,
        out: TextIO,
        err: TextIO,
        json_lines: bool = False,
        ask: Ask | None = None,
        ask_budget: AskBudget | None = None,
        resume_line: str | None = None,
        show_from_start: bool = True,
    ) -> None:
        self.task = task
        self.store = store_of(task)
        self.config = config
        self.config_path = config_path
        self.resume_line = resume_line or resume_command(task.id)
        self.terminal = RunTerminal(
            self.store,
            task.id,
            config.price_table,
            out=out,
            err=err,
            json_lines=json_lines,
            show_from_start=show_from_start,
        )
        self.resumed = not show_from_start  # (`--resume`: say where it picks up)
        self.say = self.terminal.say  # one line of the run's own on ``err``
        self.holds = HoldPrompt(
            task, config, self.say, ask=ask, ask_budget=ask_budget, resume_line=self.resume_line
        )
        self.interrupts = 0  # Ctrl-C, SIGHUP, SIGTERM received
        self.acted = 0  # of them, carried out (``_interrupt``)
        self.worker: WorkerProcess | None = None
        self.storage_waits = 0
        self.resource_waits = 0
        self.last_exit: dict[str, Any] | None = None  # of the last worker, as the daemon keeps it
        #: traces on and no daemon on the spool (it would export them): this run's own
        self.traces: TraceTail | None = None

    # -- what the person sees ----------------------------------------------------------

    def pump(self) -> None:
        """Print the transcript lines recorded since the last call (and hand the trace its
        new spans and events)."""
        if self.traces is not None:
            self.traces.pull()
        self.terminal.pump()

    def event(self, name: Event, level: str = "info", **fields: Any) -> None:
        """A lifecycle event of the task (docs/design.md section 8), into its events, as
        the daemon records its own; a daemon on the spool relays it to its log."""
        record_event(self.store, self.task.id, name, level, task=self.task.id, **fields)

    # -- signals -----------------------------------------------------------------------

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        """Count the interruption; the loop that watches the worker carries it out
        (``_interrupt``), so that nothing is printed or sent from inside a handler. At the
        prompt the run ends at once."""
        self.interrupts += 1
        if signum == signal.SIGHUP:
            self.terminal.speechless = True
        if self.holds.asking:
            raise Interrupted

    def _interrupt(self, worker: WorkerProcess) -> None:
        """The first interruption asks the worker alone (SIGTERM) to stop at its next safe
        point, within ``restart.stop_grace``; the second kills its group at once."""
        if self.acted == 0:
            self.acted = 1
            worker.kill_reason = KillReason.STOP
            worker.term_deadline = time.monotonic() + self.config.restart.stop_grace
            worker.signal_worker(signal.SIGTERM)
            self.say(
                f"stopping task {self.task.id} at its next safe point "
                "(Ctrl-C again stops it at once)"
            )
        if self.interrupts > 1 and self.acted == 1:
            self.acted = 2
            worker.term_deadline = None
            worker.signal_group(signal.SIGKILL)

    @contextlib.contextmanager
    def _signals(self) -> Any:
        handled = (signal.SIGINT, signal.SIGHUP, signal.SIGTERM)
        before = {sig: signal.signal(sig, self._on_signal) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in before.items():
                signal.signal(sig, handler)

    # -- the run -----------------------------------------------------------------------

    def run(self) -> RunExit:
        """Run workers for the task until it ends, holds with no one to ask, or the person
        interrupts; the exit code."""
        become_subreaper()
        self._export_traces()
        if self.resumed:
            self.terminal.recap()
        try:
            with self._signals():
                try:
                    return self._run()
                except Interrupted:
                    return self._interrupted()
        finally:
            if self.traces is not None:
                self.traces.close()

    def _export_traces(self) -> None:
        """Traces on (docs/design.md section 14): this run exports its task's, unless a
        daemon runs on the spool, whose relay exports every task's (once)."""
        if running_pid(self.task.spool) is not None:
            return
        exporter = exporter_for(self.config.telemetry)
        if exporter is not None:
            self.traces = TraceTail(self.store, self.task.id, exporter)

    def _run(self) -> RunExit:
        while True:
            self.pump()
            if self.interrupts:
                return self._interrupted()
            if self.store.cancel_requested(self.task.id):
                return self._cancelled()
            worker = self._start()
            code, sig = self._watch(worker)
            self.pump()
            ended = self._settle(worker, code, sig)
            if ended is not None:
                return ended

    def _start(self) -> WorkerProcess:
        record = TaskRecord.load(self.task)
        env = {
            **credentials.without_credentials(dict(os.environ)),
            "PYTHONUNBUFFERED": "1",
        }
        if record.retries:
            env[RETRIES_ENV] = str(record.retries)
        held = credentials.held().for_workers()  # (the exporter's headers stay here)
        worker = spawn(self.task, self.config_path, env, held, dies_with_parent=True)
        self.worker = worker
        started = process_started(worker.pid)
        self._record(TaskStatus.RUNNING, pid=worker.pid, pid_started=started)
        self.event(Event.WORKER_SPAWNED, pid=worker.pid)
        return worker

    def _watch(self, worker: WorkerProcess) -> tuple[int | None, str | None]:
        """Stream the transcript while ``worker`` runs; stop it on a cancel, kill it hung or
        stalled (the daemon's verdicts); its exit status once it has ended."""
        poller = select.poll()
        poller.register(worker.pidfd, select.POLLIN)
        limits = limits_of(self.config)
        while not poller.poll(int(POLL * 1000)):
            self.pump()
            if self.interrupts:
                self._interrupt(worker)
            now = time.monotonic()
            if worker.term_deadline is not None:
                if now >= worker.term_deadline:
                    worker.signal_group(signal.SIGKILL)
                    worker.term_deadline = None
                continue
            if worker.kill_reason is not None:
                continue
            if self._cancel_requested():
                worker.kill_reason = KillReason.CANCEL
                worker.term_deadline = now + self.config.restart.stop_grace
                worker.signal_group(signal.SIGTERM)
                continue
            if now >= worker.beat_due:
                self._judge(worker, limits, now)
        code, sig = worker.exit_status()
        if worker.kill_reason is None:
            self._found_hung(worker, sig)
        worker.close()
        worker.signal_group(signal.SIGKILL)  # nothing of the worker keeps acting
        self.worker = None
        sweep_until_none()  # what its tools left came to this process, a subreaper
        return code, sig

    def _cancel_requested(self) -> bool:
        try:
            return self.store.cancel_requested(self.task.id)
        except StorageError:
            return False

    def _judge(self, worker: WorkerProcess, limits: Limits, now: float) -> None:
        """``liveness.judge`` on the worker's heartbeat: hung, killed at once; stalled,
        TERM (its group), the grace, then KILL."""
        try:
            data = read_heartbeat(self.task)
        except StorageError:
            worker.beat_due = now + limits.interval
            return
        beat = Beat.of_worker(data, worker.pid, time.time(), now)
        verdict = judge(beat, worker.started, now, limits)
        if isinstance(verdict, Alive):
            worker.beat_due = verdict.until
        elif isinstance(verdict, Hung):
            worker.kill_reason = KillReason.HUNG
            self.event(Event.WORKER_HUNG, "warning", pid=worker.pid, age=round(verdict.age, 3))
            self.say(f"the worker (pid {worker.pid}) stopped beating; killing it")
            worker.signal_group(signal.SIGKILL)
        else:
            worker.kill_reason = KillReason.STALLED
            worker.term_deadline = now + self.config.restart.stop_grace
            self.event(Event.WORKER_STALLED, "warning", pid=worker.pid, phase=verdict.phase)
            self.say(f"the worker's {verdict.phase} ran past its deadline; stopping it")
            worker.signal_group(signal.SIGTERM)

    def _found_hung(self, worker: WorkerProcess, sig: str | None) -> None:
        """A worker its own dead-man killed was hung (``liveness.hung_by_deadman``): said
        as the verdict here would have said it."""
        try:
            data = read_heartbeat(self.task)
        except StorageError:
            return
        now = time.monotonic()
        hung = hung_by_deadman(Beat.of_worker(data, worker.pid, time.time(), now), sig, now)
        if hung is not None:
            worker.kill_reason = KillReason.HUNG
            self.event(Event.WORKER_HUNG, "warning", pid=worker.pid, **hung.fields())
            self.say(f"the worker (pid {worker.pid}) stopped beating; the kernel killed it")

    # -- verdicts ----------------------------------------------------------------------

    def _settle(self, worker: WorkerProcess, code: int | None, sig: str | None) -> RunExit | None:
        """Carry out ``exits.settle``'s verdict on the worker's exit, as the daemon does: a
        ``RunExit`` to end with, or None to start the next worker."""
        level = "info" if sig is None and code in VERDICT_EXITS else "warning"
        self.event(Event.WORKER_EXITED, level, pid=worker.pid, code=code, signal=sig)
        try:
            beat_turn = int((read_heartbeat(self.task) or {}).get("turn", 0))
        except StorageError:
            beat_turn = 0
        ended = worker_exit(worker, code, sig, beat_turn)
        self.last_exit = ended.last_exit  # kept in every record from here on
        record = TaskRecord.load(self.task)
        view = exits.TaskView(record.crashes, self.storage_waits, self.resource_waits)
        verdict = exits.settle(ended, view, self.config.restart)
        if not isinstance(verdict, exits.Wait):
            self.storage_waits = self.resource_waits = 0
        match verdict:
            case exits.Cancelled():
                return self._cancelled()
            case exits.Ended(state=TaskStatus.DONE, reason=reason):
                self._record(TaskStatus.DONE, reason=reason)
                self.say(f"task {self.task.id} done" + (f": {reason}" if reason else ""))
                return RunExit.DONE
            case exits.Ended(state=state, reason=reason):
                self._record(state, reason=reason)
                self.say(f"task {self.task.id} failed: {reason}")
                return RunExit.FAILED
            case exits.Held(reason=reason):
                return self._held(reason)
        if self.interrupts:
            return self._interrupted()
        match verdict:
            case exits.LockWait():
                self._record(TaskStatus.QUEUED, pid=None)
                raise StateConflictError(
                    f"another process holds task {self.task.id}'s lock (a worker runs it); "
                    f"`agentd status {self.task.id}` says which."
                )
            case exits.Wait(kind=kind, waits=waits, delay=delay):
                if kind is exits.WaitKind.STORAGE:
                    self.storage_waits = waits
                else:
                    self.resource_waits = waits
                self._record(TaskStatus.BACKOFF, pid=None, reason=verdict.reason)
                self.say(f"{verdict.reason}; the task waits, trying again in {delay:.1f} s")
                self._pause(delay)
                return None
            case exits.GaveUp(reason=reason, turn=turn, crashes=crashes):
                self.event(Event.CRASH_LOOP, "error", turn=turn, crashes=len(crashes))
                self._record(TaskStatus.FAILED, pid=None, reason=reason, crashes=crashes)
                how = exits.how_it_ended(ended)
                self.say(f"task {self.task.id} failed: {reason} (turn {turn} crashed {how})")
                return RunExit.FAILED
            case exits.Restart(delay=delay, turn=turn, crashes=crashes):
                self._record(
                    TaskStatus.BACKOFF if delay else TaskStatus.QUEUED,
                    pid=None,
                    crashes=crashes,
                    restarts=record.restarts + 1,
                )
                self.event(Event.RESTART_SCHEDULED, delay=round(delay, 3), turn=turn)
                self.say(
                    f"the worker crashed ({exits.how_it_ended(ended)}); resuming in {delay:.1f} s"
                )
                self._pause(delay)
                return None
        self._record(TaskStatus.QUEUED, pid=None, reason=None)  # a stop at a safe point
        return None

    def _held(self, reason: str | None) -> RunExit | None:
        """Held calls: decided already, go on; else ask; else end with the hint."""
        if pending_decisions(self.task):
            self._record(TaskStatus.QUEUED, pid=None, reason=None)
            return None
        self._record(TaskStatus.HELD, pid=None, reason=reason)
        if self.interrupts:
            return self._interrupted()
        rows = held_calls(self.task)
        if not rows and budget_hold(reason):
            decided = self.holds.budget(str(reason))
        else:
            decided = self.holds.calls(reason, rows)
        if not decided:
            return RunExit.HELD
        self._record(TaskStatus.QUEUED, pid=None, reason=None)
        return None

    def _cancelled(self) -> RunExit:
        with contextlib.suppress(StateConflictError):  # (cancelled already, by a command)
            self._move(TaskRecord.cancel)
        self.say(f"task {self.task.id} was cancelled")
        return RunExit.HELD

    def _interrupted(self) -> RunExit:
        """Stopped by the person: the task waits, resumable, and the line says how."""
        record = TaskRecord.load(self.task)
        if record.state in (TaskStatus.RUNNING, TaskStatus.BACKOFF):
            self._record(TaskStatus.QUEUED, pid=None, reason=None)
        self.pump()
        self.terminal.write(self.terminal.err, self.resume_line)
        return RunExit.INTERRUPTED

    def _pause(self, delay: float) -> None:
        """Wait ``delay`` seconds, or until the person interrupts."""
        deadline = time.monotonic() + delay
        while not self.interrupts and time.monotonic() < deadline:
            time.sleep(min(POLL, max(0.0, deadline - time.monotonic())))

    def _record(self, state: TaskStatus, **changes: Any) -> None:
        """Move the task record to ``state`` (with ``changes``), as read now: a cancel an
        operator made meanwhile is left as it is."""

        def to_state(record: TaskRecord, task_id: str) -> None:
            if record.state == TaskStatus.CANCELLED:
                return
            record.move_to(state, task_id)
            for key, value in changes.items():
                setattr(record, key, value)

        self._move(to_state)

    def _move(self, move: Move) -> None:
        """Make ``move`` on the task's record as read now (``control.move_record``: compared
        and set), and log the arrival it made (``record.arrival``), as the daemon does."""
        moved: list[TaskRecord] = []
        before: list[TaskStatus] = []

        def make(record: TaskRecord, task_id: str) -> None:
            before[:] = [record.state]
            move(record, task_id)
            record.foreground = True
            if self.last_exit is not None:
                record.last_exit = self.last_exit
            moved[:] = [record]

        with contextlib.suppress(StorageError):  # a wait the next write may end
            move_record(self.task, make)
        if moved and (said := arrival(before[0], moved[0].state)) is not None:
            event, level = said
            if moved[0].state == TaskStatus.CANCELLED:  # (by whom: docs/design.md section 15)
                self.event(event, level, **fields_of(cancelled_by(self.task)))
            else:
                self.event(event, level, reason=moved[0].reason)
