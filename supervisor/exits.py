"""What a worker's exit means for its task: one pure verdict for the daemon and for
``agentd run`` alike (docs/design.md section 7).

``settle(exit, view, policy, rng)`` reads no clock, no process and no store: the caller
says how the worker ended (``WorkerExit``: its exit code or signal, why the supervisor
ended it, what it said in its exit record, whether its journal grew) and where the task
stood (``TaskView``: its crash history, the waits in a row, whether a stop is under
way), and gets a verdict to carry out:

=====================  ==========================================================
verdict                 when
=====================  ==========================================================
``Cancelled``           the supervisor ended the worker for an operator's cancel
``Ended``               the worker said the task is ``done`` or ``failed`` (exit 0, 3, 78)
``Held``                unsafe calls wait for a decision (exit 4)
``Requeued``            a stop at a safe point (exit 5 after a stop), or a stop of the
                        supervisor: the task waits in the queue, nothing counted
``Fenced``              a worker on a shared store stopped by itself (exit 5): its lease
                        moved or ran out, which only the store can tell (elsewhere a
                        stop nobody asked for is a crash)
``LockWait``            another process holds the task's lock (exit 6)
``Wait``                a storage fault (exit 7), no resources (exit 8), an MCP server
                        that could not list its tools at the task's first start (exit
                        9), or a verdict exit whose exit record the store could not give
                        (a shared store away: its worker, started again, says it again):
                        a wait on ``policy.wait_for_storage``'s schedule, never a crash
``Restart``             a crash (any other code, a signal, a hang): ``policy.decide``
``GaveUp``              a crash loop: ``policy.decide`` gave up
=====================  ==========================================================

How each side carries a verdict out differs (the daemon schedules a restart on its loop;
``agentd run`` waits in the foreground and tells the person), never what it is.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from supervisor.policy import Crash, GiveUp, decide, wait_for_storage
from worker.config import RestartConfig
from worker.protocol import ExitCode, TaskStatus

#: How many crashes a task record remembers: enough for any crash-loop limit.
CRASH_MEMORY = 50


class KillReason(StrEnum):
    """Why a supervisor ended a worker itself (``WorkerProcess.kill_reason``)."""

    CANCEL = "cancel"  # an operator's cancel: TERM to the group, KILL after the grace
    STOP = "stop"  # a stop at the next safe point (agentd stop, a rewind's pause, Ctrl-C)
    HUNG = "hung"  # its heartbeat went silent: KILL at once
    STALLED = "stalled"  # a model or tool call past its deadline: TERM, then KILL
    LEASE_LOST = "lease_lost"  # a shared store gave its task to another claim


@dataclass(frozen=True)
class WorkerExit:
    """How one worker ended."""

    code: int | None  # its exit code; None when a signal ended it
    signal: str | None  # the signal's name (``SIGKILL``), or None
    kill_reason: KillReason | None  # why the supervisor ended it, if it did
    said: str | None  # the reason in its own exit record (written by this very worker)
    progressed: bool  # its journal grew while it ran
    turn: int  # the turn it was on: its journal's last, else its last heartbeat's
    # why its exit record could not be read (the store at fault), when its code needs it
    unread: str | None = None

    @property
    def last_exit(self) -> dict[str, Any]:
        """The exit as the task record and ``status --json`` keep it."""
        return {"code": self.code, "signal": self.signal}


@dataclass(frozen=True)
class TaskView:
    """Where the task stood when its worker ended."""

    crashes: Sequence[Mapping[str, Any]] = ()  # the task record's, oldest first
    storage_waits: int = 0  # storage faults in a row, before this exit
    resource_waits: int = 0  # starts refused for want of resources, in a row
    stopping: bool = False  # the supervisor is stopping: nothing is restarted
    shared: bool = False  # on a shared store, where a worker stops itself at its lease


@dataclass(frozen=True)
class Cancelled:
    pass


@dataclass(frozen=True)
class Ended:
    state: TaskStatus  # DONE or FAILED
    reason: str | None


@dataclass(frozen=True)
class Held:
    reason: str | None


@dataclass(frozen=True)
class Requeued:
    pass


@dataclass(frozen=True)
class Fenced:
    pass


@dataclass(frozen=True)
class LockWait:
    pass


class WaitKind(StrEnum):
    STORAGE = "storage_fault"  # the reason's prefix and the restart's ``why``
    RESOURCES = "resources"
    MCP = "mcp"  # (its waits are counted with the resources')


@dataclass(frozen=True)
class Wait:
    kind: WaitKind
    waits: int  # in a row, this one included
    delay: float
    why: str

    @property
    def reason(self) -> str:
        """The task's reason while it waits: ``storage_fault: WHY``, ``resources: WHY``,
        ``mcp: SERVER: WHY``."""
        return f"{self.kind}: {self.why}"


@dataclass(frozen=True)
class Restart:
    delay: float  # 0: at once (the crash followed progress)
    turn: int
    crashes: list[dict[str, Any]]  # the record's new crash history


@dataclass(frozen=True)
class GaveUp:
    reason: str  # crash_loop
    turn: int
    crashes: list[dict[str, Any]]


Verdict = Cancelled | Ended | Held | Requeued | Fenced | LockWait | Wait | Restart | GaveUp

#: The exits whose verdict carries the reason in the worker's exit record.
SAYS_WHY = frozenset({ExitCode.DONE, ExitCode.FAILED, ExitCode.CONFIG, ExitCode.HELD})

#: What a wait says when the worker could not say why.
UNSAID = {
    WaitKind.STORAGE: "the worker could not write to its store",
    WaitKind.RESOURCES: "the worker got no process or memory",
    WaitKind.MCP: "a server could not list its tools",
}


def settle(
    ended: WorkerExit, view: TaskView, policy: RestartConfig, rng: random.Random | None = None
) -> Verdict:
    """The verdict on ``ended`` for a task that stood as ``view`` says."""
    code = ended.code
    if ended.kill_reason == KillReason.CANCEL:
        return Cancelled()
    if ended.unread is not None and code in SAYS_WHY:
        # a done, failed or held task without its reason: not settled on a guess. Its
        # journal holds the end (or the hold), so a worker started again ends the same
        # way and says why, once the store gives its records again.
        if view.stopping:
            return Requeued()
        unread = f"the exit record could not be read: {ended.unread}"
        return waiting(WaitKind.STORAGE, view.storage_waits + 1, unread, policy, rng)
    if code == ExitCode.DONE:
        return Ended(TaskStatus.DONE, ended.said)
    if code in (ExitCode.FAILED, ExitCode.CONFIG):
        return Ended(TaskStatus.FAILED, ended.said)
    if code == ExitCode.HELD:
        return Held(ended.said)
    if code == ExitCode.STOPPED and ended.kill_reason == KillReason.STOP:
        return Requeued()
    if code == ExitCode.STOPPED and view.shared:
        return Fenced()
    if code == ExitCode.LOCKED:
        return LockWait()
    if view.stopping:  # a fault or a crash while the supervisor stops: the next start's
        return Requeued()
    if code == ExitCode.STORAGE:
        # a worker that got somewhere before the fault starts a new run of waits
        waits = 1 if ended.progressed else view.storage_waits + 1
        return waiting(WaitKind.STORAGE, waits, ended.said, policy, rng)
    if code == ExitCode.RESOURCES:
        return waiting(WaitKind.RESOURCES, view.resource_waits + 1, ended.said, policy, rng)
    if code == ExitCode.TOOLS:  # the worker says "mcp: SERVER: WHY"
        why = ended.said.removeprefix("mcp: ") if ended.said else None
        waits = view.resource_waits + 1
        if waits >= policy.crash_loop_limit:  # never a task that waits for good
            return Ended(TaskStatus.FAILED, no_tool_list(why or UNSAID[WaitKind.MCP], waits))
        return waiting(WaitKind.MCP, waits, why, policy, rng)
    crashes = [*map(dict, view.crashes), {"turn": ended.turn, "progressed": ended.progressed}]
    crashes = crashes[-CRASH_MEMORY:]
    move = decide([Crash(int(c["turn"]), bool(c["progressed"])) for c in crashes], policy, rng)
    if isinstance(move, GiveUp):
        return GaveUp(move.reason, ended.turn, crashes)
    return Restart(move.delay, ended.turn, crashes)


def no_tool_list(why: str, starts: int) -> str:
    """The reason of a task failed because a server could not list its tools at its first
    ``starts`` starts in a row (``restart.crash_loop_limit``): a task never runs without its
    list, and never waits for one for good."""
    return (
        f"mcp: {why}; no tool list after {starts} starts in a row (restart.crash_loop_limit): "
        "fix the server or its config (`agentd config check` in the task's workspace), then "
        "`agentd retry` the task"
    )


def waiting(
    kind: WaitKind,
    waits: int,
    why: str | None,
    policy: RestartConfig,
    rng: random.Random | None = None,
) -> Wait:
    """The ``waits``-th wait in a row of ``kind`` (a worker refused at its start waits for
    resources this way too); ``why`` the worker's own words, if it had any."""
    delay = wait_for_storage(waits, policy, rng).delay  # (resources wait on the same schedule)
    return Wait(kind, waits, delay, why or UNSAID[kind])


def how_it_ended(ended: WorkerExit) -> str:
    """A crash in a few words, for a person: ``hung``, ``signal SIGKILL``, ``exit code 1``."""
    if ended.kill_reason is not None:
        return str(ended.kill_reason)
    return f"signal {ended.signal}" if ended.signal else f"exit code {ended.code}"
