"""Tasks as the supervisor and the CLI see them.

* ``submit`` creates a task folder; the spec is written last, so a folder without
  ``spec.json`` is not a task yet and is never picked up half-made.
* ``TaskRecord`` is the supervisor's own record of a task (``state.json``): its state,
  restarts, last exit and reason. Only the holder of the supervisor lock writes it: the
  running daemon, or a CLI command while no daemon runs.
* Operator requests to a running daemon (cancel, retry) are small files in the task
  folder that the daemon applies and removes; decisions on held calls are files written
  exclusively, so of two operators deciding one call exactly one wins.
* ``status_row`` builds the JSON of DESIGN.md section 3 from the files alone, so status
  works whether or not the daemon runs.
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from supervisor.liveness import Beat
from worker.config import Config
from worker.durable import (
    atomic_write,
    atomic_write_json,
    private_dir,
    read_bytes,
    read_json,
    write_exclusive,
)
from worker.errors import (
    NotFoundError,
    SpoolError,
    StateConflictError,
    TaskSpecError,
    UsageError,
)
from worker.events import append_event, utc_now
from worker.journal import read_file
from worker.spool import Spool, TaskDir, TaskSpec, new_task_id, normalize_tools, validate_task_id
from worker.state import Call, NeedsFullReplay, TaskState, parse_snapshot

STATES = ("queued", "running", "backoff", "held", "done", "failed", "cancelled")
FINAL_STATES = ("done", "failed", "cancelled")


@dataclass
class TaskRecord:
    state: str = "queued"
    reason: str | None = None
    restarts: int = 0
    last_exit: dict[str, Any] | None = None
    pid: int | None = None
    pid_started: float | None = None  # the worker's process start time, for adoption
    crashes: list[dict[str, Any]] = field(default_factory=list)  # recent: {turn, at}
    updated_at: str = ""

    @classmethod
    def load(cls, task: TaskDir) -> TaskRecord:
        try:
            data = read_json(task.state)
        except FileNotFoundError:
            return cls()
        except (OSError, ValueError):
            return cls(state="failed", reason=f"{task.state} is unreadable")
        if not isinstance(data, dict) or data.get("state") not in STATES:
            return cls(state="failed", reason=f"{task.state} is not a task record")
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        try:
            return cls(**known)
        except TypeError:
            return cls(state="failed", reason=f"{task.state} is not a task record")

    def save(self, task: TaskDir, *, durable: bool = True) -> None:
        """Replace the record atomically; ``durable=False`` skips the fsyncs, for a state
        that recovery never trusts anyway (``running``: the task lock decides)."""
        self.updated_at = utc_now()
        atomic_write_json(task.state, asdict(self), durable=durable)


# -- submission ---------------------------------------------------------------------------


def submit(
    spool: Spool,
    config: Config,
    *,
    prompt: str,
    name: str | None = None,
    model: str | None = None,
    script: Path | None = None,
    tools: Sequence[str] | None = None,
    system: str | None = None,
    max_turns: int = 100,
    workspace: Path | None = None,
) -> TaskDir:
    """Create a queued task; raises before anything is written when an input is bad."""
    # Imported here: `agentd status` and the daemon import this module and need neither.
    from worker.models.scripted import parse_script  # noqa: PLC0415
    from worker.tools.registry import ToolRegistry  # noqa: PLC0415

    task_id = validate_task_id(name) if name is not None else new_task_id()
    if not prompt.strip():
        raise UsageError("the prompt is empty; give --prompt TEXT or --prompt-file FILE.")
    if max_turns < 1:
        raise UsageError("--max-turns must be at least 1.")
    tool_names = normalize_tools(tools)
    try:
        ToolRegistry.standard(config.tools.modules, source=config.source).narrowed(tool_names)
    except TaskSpecError as exc:
        raise UsageError(str(exc)) from None
    script_bytes: bytes | None = None
    if script is not None:
        try:
            script_bytes = script.read_bytes()
            parse_script(script_bytes, str(script))
        except OSError as exc:
            raise UsageError(
                f"cannot read --script {script}: {exc.strerror or exc}; check the path."
            ) from None
        except TaskSpecError as exc:
            raise UsageError(str(exc)) from None
    if workspace is not None:
        workspace = workspace.expanduser().absolute()
        if workspace.exists() and not workspace.is_dir():
            raise UsageError(f"--workspace {workspace} exists and is not a folder.")
    spec = TaskSpec(
        id=task_id,
        prompt=prompt,
        model=None if model == "scripted" else model,
        system=system,
        tools=tool_names,
        max_turns=max_turns,
        workspace=str(workspace) if workspace else None,
        scripted=script is not None or model == "scripted",
        created_at=utc_now(),
    )
    if spec.scripted and script_bytes is None:
        raise UsageError("the scripted model needs --script FILE with its responses.")
    return create_task(spool, spec, script_bytes)


def create_task(
    spool: Spool,
    spec: TaskSpec,
    script: bytes | None,
    *,
    setup: Callable[[TaskDir], None] | None = None,
) -> TaskDir:
    """Make the task folder; ``setup`` adds files (a fork's journal) before the spec, which
    is written last: until then the folder is not a task."""
    spool.ensure()
    task = spool.task(spec.id)
    _not_a_symlink(task)
    try:
        task.path.mkdir(mode=0o700)
    except FileExistsError:
        if task.exists():
            raise StateConflictError(
                f"a task named {spec.id!r} already exists; pick another --name."
            ) from None
        shutil.rmtree(task.path, ignore_errors=True)  # a submit that died half-way
        task.path.mkdir(mode=0o700)
    if script is not None:
        atomic_write(task.script, script)
    TaskRecord().save(task)
    if setup is not None:
        setup(task)
    atomic_write_json(task.spec, spec.to_json())  # last: now it is a task
    append_event(task.events, "task_submitted", task=spec.id)
    return task


# -- reading state ------------------------------------------------------------------------


def load_state(task: TaskDir, *, full: bool = True) -> TaskState:
    """Fold the task's journal (read-only) into its state. ``full=False`` starts from the
    snapshot when there is a usable one: fast, but without the per-turn boundaries that
    rewind and fork need."""
    spec = task.load_spec()
    if not task.journal.exists():
        return TaskState(spec.prompt)
    if not full:
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError, NeedsFullReplay):
            state, offset = parse_snapshot(read_bytes(task.snapshot))
            for record, _ in read_file(task.journal, offset).records:
                state.apply(record)
            return state
    state = TaskState(spec.prompt)
    for record, _ in read_file(task.journal).records:
        state.apply(record)
    return state


def read_heartbeat(task: TaskDir) -> dict[str, Any] | None:
    """The worker's last heartbeat, or None when there is none or it does not have the
    shape a worker writes: it is advisory, and garbage in it must not break `agentd
    status` or the daemon (which would leave the task stuck)."""
    with contextlib.suppress(OSError, ValueError):
        data = read_json(task.heartbeat)
        if isinstance(data, dict) and _heartbeat_shaped(data):
            return data
    return None


#: Numbers a heartbeat may carry besides ``at`` (a worker of an earlier release wrote no
#: monotonic stamps and no interval: ``supervisor.liveness.Beat.of`` falls back for it).
OPTIONAL_BEAT_TIMES = ("phase_started", "at_mono", "phase_started_mono", "interval")


def _heartbeat_shaped(beat: dict[str, Any]) -> bool:
    def number(value: Any) -> bool:
        return (
            isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        )

    def whole(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    usage = beat.get("usage", {})
    return (
        number(beat.get("at"))
        and all(number(beat.get(key, 0)) for key in OPTIONAL_BEAT_TIMES)
        and whole(beat.get("turn", 0))
        and whole(beat.get("pid", 0))
        and isinstance(beat.get("phase", ""), str)
        and isinstance(usage, dict)
        and all(whole(v) for v in usage.values())
    )


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def beat_age(beat: dict[str, Any]) -> float:
    """Seconds since the worker wrote ``beat`` (a ``read_heartbeat`` result), now."""
    mono = time.monotonic()
    return Beat.of(beat, time.time(), mono).age(mono)


def held_calls(task: TaskDir, state: TaskState | None = None) -> list[dict[str, Any]]:
    """The task's dangling calls that wait for an operator, as `agentd dangling` shows them."""
    state = state or load_state(task)
    rows = []
    for hold in state.held:
        call: Call | None = state.calls.get(hold["call_id"])
        if call is None or call.result is not None or call.attempt != hold.get("attempt"):
            continue
        rows.append(
            {
                "task": task.id,
                "call_id": call.call_id,
                "tool": call.tool,
                "input": call.input,
                "effect": call.effect,
                "idempotency_key": call.key,
                "attempt": call.attempt,
                "started_at": call.started_at,
                "why": hold.get("why"),
            }
        )
    return rows


def status_row(task: TaskDir) -> dict[str, Any]:
    """One task as `agentd status --json` shows it (DESIGN.md section 3). The heartbeat's
    age is read on the monotonic clock, as the daemon's verdicts are: a stepped wall clock
    never shows an age below 0 or an hour off."""
    record = TaskRecord.load(task)
    beat = read_heartbeat(task)
    spec_error = None
    try:
        spec = task.load_spec()
    except (SpoolError, TaskSpecError, NotFoundError) as exc:
        spec, spec_error = None, str(exc)
    running = record.state == "running"
    turn, usage, dangling = 0, {"input_tokens": 0, "output_tokens": 0}, []
    tokens_used: int | None = None
    if not running or beat is None:
        with contextlib.suppress(Exception):  # status must show a broken task, not die on it
            state = load_state(task, full=False)
            turn = state.turn
            tokens_used = state.tokens_used if state.turn else None
            usage = {
                "input_tokens": state.usage_total.input_tokens,
                "output_tokens": state.usage_total.output_tokens,
            }
            if record.state == "held":
                dangling = held_calls(task, state)
    if running and beat is not None:
        turn = int(beat.get("turn", turn))
        beat_usage = beat.get("usage") or {}
        usage = {
            "input_tokens": int(beat_usage.get("input_tokens", 0)),
            "output_tokens": int(beat_usage.get("output_tokens", 0)),
        }
        used = beat.get("tokens_used")
        tokens_used = used if type(used) is int and turn else None
    return {
        "id": task.id,
        "state": record.state,
        "pid": record.pid if running else None,
        "turn": turn,
        "restarts": record.restarts,
        "last_exit": record.last_exit,
        "heartbeat_age": round(beat_age(beat), 3) if running and beat else None,
        "phase": beat.get("phase") if running and beat else None,
        # how its last worker ran run_command (worker.tools.sandbox): a fact about that
        # worker, so it stays shown after the worker ends, unlike the phase
        "sandbox": _text(beat.get("sandbox")) if beat else None,
        "usage": usage,
        "dangling": dangling,
        "reason": record.reason or spec_error,
        "workspace": str(task.workspace_for(spec)) if spec else None,
        "updated_at": record.updated_at or None,
        "forked_from": spec.forked_from if spec else None,
        "created_at": spec.created_at or None if spec else None,
        # the context the model saw at its last call plus what it wrote; null before the
        # first call, and for a running worker whose heartbeat does not carry it
        "tokens_used": tokens_used,
    }


# -- operator actions ---------------------------------------------------------------------


def _not_a_symlink(task: TaskDir) -> None:
    """A task folder (or its decisions folder) that is a symlink leads out of the spool:
    agentd never follows one (the daemon skips such a folder too)."""
    for path in (task.path, task.decisions):
        if path.is_symlink():
            raise SpoolError(
                f"{path} is a symlink; agentd does not follow links out of the spool. "
                "Remove the link (or move the real folder into the spool)."
            )


def existing_task(spool: Spool, task_id: str) -> TaskDir:
    task = spool.task(task_id)
    _not_a_symlink(task)
    if not task.exists():
        raise NotFoundError(f"no task {task_id!r} in {spool.root}; `agentd status` lists them.")
    return task


def decide(
    task: TaskDir,
    call_id: str,
    *,
    action: str,
    reason: str | None = None,
    result: str | None = None,
) -> dict[str, Any]:
    """Durably record an operator's decision on one held call of ``task``."""
    record = TaskRecord.load(task)
    rows = {row["call_id"]: row for row in held_calls(task)}
    if call_id not in rows:
        raise NotFoundError(
            f"task {task.id} has no held call {call_id!r} (state {record.state}); "
            f"`agentd dangling {task.id}` lists the calls that wait for a decision."
        )
    row = rows[call_id]
    decision = {
        "call_id": call_id,
        "attempt": row["attempt"],
        "action": action,
        "reason": reason,
        "result": result,
        "decided_at": utc_now(),
    }
    _not_a_symlink(task)
    private_dir(task.decisions)
    path = task.decision_file(row["idempotency_key"], row["attempt"])
    if not write_exclusive(path, json.dumps(decision).encode()):
        raise StateConflictError(
            f"call {call_id} of task {task.id} was already decided by someone else "
            f"({path.name}); `agentd dangling {task.id}` shows what still waits."
        )
    append_event(task.events, "dangling_decided", task=task.id, call_id=call_id, action=action)
    return decision


def pending_decisions(task: TaskDir) -> bool:
    """True when every held call of a held task has a decision file."""
    rows = held_calls(task)
    if task.decisions.is_symlink():  # never read through it (the worker does not either)
        return False
    return bool(rows) and all(
        _usable_decision(task.decision_file(r["idempotency_key"], r["attempt"])) for r in rows
    )


def _usable_decision(path: Path) -> bool:
    """Whether the worker can apply this decision file (what ``AgentLoop._load_decision``
    accepts). One it cannot must not requeue the task: the worker would only hold again,
    and the daemon would restart it for ever."""
    try:
        data = read_json(path)
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and data.get("action") in ("rerun", "skip", "result")
