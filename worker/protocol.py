"""What the worker and the daemon share: the words of the file protocol between them.

The worker writes, the daemon (and the CLI) read: exit codes, task states, the heartbeat,
the exit record and operator decisions. Each is defined once here, so the two sides
cannot drift apart, and each works on parsed data (a dict, the bytes of a file): where
the bytes are kept is the store's business (``worker.store``), not the protocol's.

* ``ExitCode``: a worker's exit status, the daemon's input to its verdict (docs/design.md
  section 8). The numbers are public: scripts and unit files test them.
* ``TaskStatus``: the states of a task record (``state.json``, ``status --json``).
* ``heartbeat_shaped``/``parse_heartbeat``: what a heartbeat must look like to be used.
* ``exit_record``/``exit_reason``: the worker's last words (``exit.json``).
* ``parse_decision``/``usable_decision``: an operator's decision on a held call, as the
  worker applies it; the daemon requeues a held task only on one the worker will apply.
"""

from __future__ import annotations

import math
from enum import IntEnum, StrEnum
from typing import Any, NotRequired, TypedDict, TypeGuard

from worker.store.durable import load_json


class ExitCode(IntEnum):
    """A worker's exit status. Any other code, or a signal, is a crash."""

    DONE = 0
    ERROR = 1  # an error a restart may fix: the daemon counts it as a crash
    FAILED = 3
    HELD = 4
    STOPPED = 5
    LOCKED = 6
    STORAGE = 7  # a storage fault: a wait, never counted as a crash
    RESOURCES = 8  # no process, thread or memory to be had: a wait, never counted as a crash
    TOOLS = 9  # an MCP server could not list its tools at the task's first start: a wait
    CONFIG = 78


#: Exit codes that are a worker's own verdict on its task; any other code, or a signal, is
#: a crash, whose ``worker_exited`` is a warning (docs/design.md section 8).
VERDICT_EXITS = frozenset(code for code in ExitCode if code is not ExitCode.ERROR)


#: How a daemon on a shared store hands its worker the claim it runs under (the worker's
#: environment; the store's URL, a secret, comes through the credentials pipe): the
#: node's name, the lease in seconds, and the claim's epoch (``worker.store.base.Owner``).
NODE_ENV = "AGENTD_NODE"
LEASE_ENV = "AGENTD_LEASE"
EPOCH_ENV = "AGENTD_EPOCH"
#: The lease the claim took over, when it took one from a holder that let it stand still
#: (JSON: ``worker.store.base.Previous``): the hold of the call that holder was running
#: names it.
TAKEN_OVER_ENV = "AGENTD_TAKEN_OVER"
#: How many times an operator retried the task (``agentd retry``): a worker whose journal
#: ended ``failed`` reopens it (a ``retry`` record) when fewer retries are recorded there.
RETRIES_ENV = "AGENTD_RETRIES"
#: Where cgroups are delegated: the task's cgroup, which its worker joins first thing
#: (``supervisor.cgroups``); tools never see it (their environment is an allowlist).
CGROUP_ENV = "AGENTD_CGROUP"


class TaskStatus(StrEnum):
    """The state of a task record; its value is what ``state.json`` and ``status --json``
    carry. A StrEnum compares equal to its text, so a record of an earlier release reads
    back unchanged."""

    QUEUED = "queued"
    RUNNING = "running"
    BACKOFF = "backoff"
    HELD = "held"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


#: States a task does not leave on its own; only an operator (retry, rewind) moves it on.
FINAL_STATES = frozenset({TaskStatus.DONE, TaskStatus.FAILED, TaskStatus.CANCELLED})
#: The final states a task reaches on its own (a cancel is the operator's).
ENDED = frozenset({TaskStatus.DONE, TaskStatus.FAILED})
#: The states a shared store's claim takes a task in (a running one only once its lease
#: stood still), in the order the SQL lists them (``worker.store.pgschema.sql_states``).
CLAIMABLE = (TaskStatus.QUEUED, TaskStatus.BACKOFF, TaskStatus.RUNNING)


# -- the heartbeat ----------------------------------------------------------------------

#: Numbers a heartbeat may carry besides ``at`` (a worker of an earlier release wrote no
#: monotonic stamps, no interval and no dead-man: ``supervisor.liveness.Beat.of`` falls
#: back for it).
OPTIONAL_BEAT_TIMES = ("phase_started", "at_mono", "phase_started_mono", "interval", "deadman")


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class HeartbeatData(TypedDict, total=False):
    """A heartbeat as a worker writes it (``worker.heartbeat``) and the daemon, `agentd
    status` and `agentd run` read it, once ``heartbeat_shaped`` said it is one. Every field
    but ``at`` may be missing: a worker of an earlier release wrote fewer."""

    pid: int
    at: float  # wall time, for people
    at_mono: float  # CLOCK_MONOTONIC, for verdicts
    turn: int
    phase: str  # idle, model, compaction, tool:NAME
    phase_started: float
    phase_started_mono: float
    interval: float  # the worker's own beat interval
    deadman: float  # the seconds its dead-man is armed ahead (none on a shared store)
    usage: dict[str, int]
    spend: dict[str, Any]  # by model (``worker.budget.spend_json``)
    tokens_used: int | None
    compactions: int
    sandbox: str  # how its run_command runs (``worker.tools.sandbox``)
    retry: dict[str, Any] | None  # a model call being retried: error, attempt, next_try
    metrics: dict[str, Any]  # its step metrics (``worker.metrics``)
    journal: int  # the journal's durable size
    epoch: int  # on a shared store: its claim's epoch, its process and its clock
    process: dict[str, Any] | None
    clock: str | None


def heartbeat_shaped(beat: Any) -> TypeGuard[HeartbeatData]:
    """Whether ``beat`` (parsed JSON) has the shape a worker writes. A heartbeat is
    advisory: garbage in one must not break `agentd status` or the daemon."""
    if not isinstance(beat, dict):
        return False
    usage = beat.get("usage", {})
    return (
        _number(beat.get("at"))
        and all(_number(beat.get(key, 0)) for key in OPTIONAL_BEAT_TIMES)
        and _whole(beat.get("turn", 0))
        and _whole(beat.get("pid", 0))
        and isinstance(beat.get("phase", ""), str)
        and isinstance(usage, dict)
        and all(_whole(v) for v in usage.values())
    )


def parse_heartbeat(data: bytes) -> HeartbeatData | None:
    """The heartbeat in ``data`` (a heartbeat file's bytes), or None when it is not one."""
    try:
        beat = load_json(data)
    except ValueError:
        return None
    return beat if heartbeat_shaped(beat) else None


# -- the exit record --------------------------------------------------------------------


class ExitRecord(TypedDict):
    """A worker's last words for the daemon (``exit.json``, or its row): how it ended
    (its exit code and the state it reached), why, which worker, and when."""

    code: int
    state: str
    reason: str
    pid: int
    at: str


def exit_record(code: ExitCode, state: str, reason: str, *, pid: int, at: str) -> ExitRecord:
    """The worker's last words for the daemon: how it ended and why."""
    return {"code": int(code), "state": state, "reason": reason, "pid": pid, "at": at}


def exit_reason(data: bytes, pid: int | None = None) -> str | None:
    """The reason in an exit record's bytes; with ``pid``, only if that worker wrote it (one
    that could not write leaves an earlier worker's)."""
    try:
        record = load_json(data)
    except ValueError:
        return None
    return exit_record_reason(record, pid)


def exit_record_reason(record: Any, pid: int | None = None) -> str | None:
    """``exit_reason`` of an exit record already parsed (as a store returns it)."""
    if isinstance(record, dict) and (pid is None or record.get("pid") == pid):
        return str(record.get("reason"))
    return None


# -- operator decisions -----------------------------------------------------------------


class DecisionAction(StrEnum):
    """What an operator decides about a held call (``agentd approve-dangling``)."""

    RERUN = "rerun"  # run it again
    SKIP = "skip"  # do not run it; the model is told it was skipped, and why
    RESULT = "result"  # do not run it; record the result the operator supplies


DECISION_ACTIONS = frozenset(DecisionAction)


class Decision(TypedDict):
    """An operator's decision on a held call, as ``agentd approve-dangling`` (or the
    console) writes it for the worker: the call and its attempt, the action and its text,
    when, and who (docs/design.md section 15)."""

    call_id: str
    attempt: int
    action: str  # a DecisionAction
    reason: str | None
    result: str | None
    decided_at: str
    by: NotRequired[str]
    via: NotRequired[str]


class DecisionFields(TypedDict):
    """What the worker records of a decision (its ``decision`` record, ``worker.records``):
    the action, and the text fields it carries when they are strings: a skip's reason, a
    supplied result, who decided and through what (docs/design.md section 15)."""

    action: str  # a DecisionAction
    reason: NotRequired[str]
    result: NotRequired[str]
    by: NotRequired[str]
    via: NotRequired[str]


def parse_decision(data: bytes) -> DecisionFields:
    """The decision in ``data`` (a decision file's bytes) as the worker records it: its
    ``action`` and the text fields it carries. ValueError, whose text is the one the
    worker logs as ``decision_invalid``, when the worker cannot apply it."""
    return decision_fields(load_json(data))


def decision_fields(decision: Any) -> DecisionFields:
    """``parse_decision`` of a decision already parsed as JSON (as a store returns it)."""
    if not isinstance(decision, dict):
        decision = {}
    action = decision.get("action")
    if action not in DECISION_ACTIONS:
        raise ValueError("bad action")
    fields: DecisionFields = {"action": str(action)}
    if isinstance(reason := decision.get("reason"), str):
        fields["reason"] = reason
    if isinstance(result := decision.get("result"), str):
        fields["result"] = result
    if isinstance(by := decision.get("by"), str):
        fields["by"] = by
    if isinstance(via := decision.get("via"), str):
        fields["via"] = via
    return fields


def usable_decision(data: bytes) -> bool:
    """Whether the worker can apply the decision in ``data``. One it cannot must not
    requeue a held task: the worker would only hold again, and the daemon would restart it
    for ever."""
    try:
        parse_decision(data)
    except ValueError:
        return False
    return True
