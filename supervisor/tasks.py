"""Tasks as the supervisor and the CLI see them.

* ``submit`` creates a task folder; the spec is written last, so a folder without
  ``spec.json`` is not a task yet and is never picked up half-made.
* ``TaskRecord`` is the supervisor's own record of a task (``state.json``): its state,
  restarts, last exit and reason. Only the holder of the supervisor lock writes it: the
  running daemon, or a CLI command while no daemon runs.
* Operator requests to a running daemon (retry, requeue) are small files in the task
  folder that the daemon applies and removes; decisions on held calls and a cancel are
  files written exclusively, so of two operators deciding one call exactly one wins.
* The commands that settle what becomes of a task (a decision, cancel, rewind, retry)
  check and write under the task's operator lock, one at a time: each sees what the one
  before it did. So a cancel and a decision that race have exactly one winner, and a
  cancel is final: no decision, rewind or retry is taken after it.
* Files an operator names (a prompt, a script, a supplied result) are read up to a cap.
* ``status_row`` builds the JSON of DESIGN.md section 3 from the files alone, so status
  works whether or not the daemon runs.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
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
    AgentdError,
    LockBusyError,
    NotFoundError,
    SpoolError,
    StateConflictError,
    TaskSpecError,
    UsageError,
)
from worker.events import append_event, utc_now
from worker.journal import read_file
from worker.lock import TaskLock
from worker.protocol import parse_heartbeat, usable_decision
from worker.spool import Spool, TaskDir, TaskSpec, new_task_id, normalize_tools, validate_task_id
from worker.state import Call, NeedsFullReplay, TaskState, parse_snapshot

STATES = ("queued", "running", "backoff", "held", "done", "failed", "cancelled")
FINAL_STATES = ("done", "failed", "cancelled")
ENDED = ("done", "failed")  # final states a task reaches on its own
CANCEL_REASON = "cancelled by operator"

#: Caps on the files an operator names on the command line. Each is read up to its cap and
#: one byte more, never further, so a wrong path (``/dev/zero``, a log) is refused in one
#: line instead of being read into memory. A prompt and a supplied result become part of
#: every later model request; a script is a test fixture of model replies.
PROMPT_FILE_LIMIT = 1024 * 1024
SCRIPT_FILE_LIMIT = 16 * 1024 * 1024
RESULT_FILE_LIMIT = 1024 * 1024

OPERATOR_LOCK = "operator.lock"  # in the task folder: see ``operator_lock``
OPERATOR_WAIT = 30.0  # seconds a command waits for another one on the same task


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

    def cancel(self) -> None:
        self.state, self.reason = "cancelled", CANCEL_REASON

    def save(self, task: TaskDir, *, durable: bool = True) -> None:
        """Replace the record atomically; ``durable=False`` skips the fsyncs, for a state
        that recovery never trusts anyway (``running``: the task lock decides)."""
        self.updated_at = utc_now()
        atomic_write_json(task.state, asdict(self), durable=durable)


# -- submission ---------------------------------------------------------------------------


def read_input(path: Path, limit: int, option: str) -> bytes:
    """The bytes of a file named by ``option``, at most ``limit`` of them; a UsageError in
    one line when it is missing, unreadable or larger."""
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except FileNotFoundError:
        raise UsageError(f"{option} {path}: no such file; check the path.") from None
    except OSError as exc:
        raise UsageError(
            f"{option} {path}: cannot read it ({exc.strerror or exc}); check the path and its "
            "permissions."
        ) from None
    if len(data) > limit:
        raise UsageError(
            f"{option} {path} is larger than the {_size(limit)} a {option} may have; "
            "name the file you meant, or shorten it."
        )
    return data


def read_text_input(path: Path, limit: int, option: str) -> str:
    """``read_input`` as UTF-8 text."""
    try:
        return read_input(path, limit, option).decode()
    except UnicodeDecodeError:
        raise UsageError(f"{option} {path} is not UTF-8 text; save it as UTF-8.") from None


def _size(limit: int) -> str:
    return f"{limit // (1024 * 1024)} MiB" if limit % (1024 * 1024) == 0 else f"{limit} bytes"


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
        script_bytes = read_input(script, SCRIPT_FILE_LIMIT, "--script")
        try:
            parse_script(script_bytes, str(script))
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
    shape a worker writes (``worker.protocol.parse_heartbeat``)."""
    try:
        return parse_heartbeat(read_bytes(task.heartbeat))
    except OSError:
        return None


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
    compactions = 0
    if not running or beat is None:
        with contextlib.suppress(Exception):  # status must show a broken task, not die on it
            state = load_state(task, full=False)
            turn = state.turn
            tokens_used = state.tokens_used if state.turn else None
            compactions = len(state.live_compactions())
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
        made = beat.get("compactions")
        compactions = made if type(made) is int else compactions
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
        "compactions": compactions,  # on the live branch (worker.compaction)
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


@contextlib.contextmanager
def operator_lock(task: TaskDir, wait: float = OPERATOR_WAIT) -> Iterator[None]:
    """Hold ``task``'s operator lock for the block (an flock: a killed command drops it).

    Every command that settles what becomes of a task checks and writes under it, so it
    sees what the command before it did: of a cancel and a decision that race, the first
    to take the lock wins, and the other finds the cancel (or the decision) and exits 3."""
    lock = TaskLock(task.path / OPERATOR_LOCK)
    try:
        lock.acquire(wait=wait)
    except LockBusyError as exc:
        raise StateConflictError(
            f"another command on task {task.id} (pid {exc.holder_pid}) did not end within "
            f"{wait:g} s; try again once it has."
        ) from None
    try:
        yield
    finally:
        lock.release()


def cancelled(task: TaskDir, record: TaskRecord | None = None) -> bool:
    """Whether an operator cancelled ``task`` (the daemon may not have applied it yet). A
    cancel record of a task that ended ``done`` or ``failed`` before the daemon could
    apply it is moot (``drop_moot_cancel``)."""
    state = (record or TaskRecord.load(task)).state
    return state == "cancelled" or (state not in ENDED and task.cancellation.exists())


def refuse_if_cancelled(task: TaskDir, verb: str) -> None:
    """A cancel is final: StateConflictError for any command that would revive the task."""
    if cancelled(task):
        raise StateConflictError(
            f"task {task.id} was cancelled; a cancelled task takes no {verb}. "
            f"`agentd fork {task.id} --at TURN` starts a new task from it."
        )


def record_cancel(task: TaskDir) -> None:
    """Durably record the operator's cancel of ``task`` (``TaskDir.cancellation``, created
    exclusively), for the daemon to apply; the caller holds the operator lock. Refused
    when the task has ended, and when a call of it was decided and the decision is not
    carried out yet: that decision won the race, and the cancel would cut it off."""
    record = TaskRecord.load(task)
    if cancelled(task, record):
        raise StateConflictError(f"task {task.id} is already cancelled; nothing to cancel.")
    if record.state in FINAL_STATES:
        raise StateConflictError(f"task {task.id} is already {record.state}; nothing to cancel.")
    decided = _decided_calls(task)
    if decided:
        raise StateConflictError(
            f"call {decided[0]} of task {task.id} was already decided and is not carried out "
            "yet; cancel the task once its result is recorded (`agentd logs`)."
        )
    stamp = {"cancelled_at": utc_now(), "pid": os.getpid()}
    if not write_exclusive(task.cancellation, json.dumps(stamp).encode()):
        raise StateConflictError(f"task {task.id} is already cancelled; nothing to cancel.")


def drop_moot_cancel(task: TaskDir, record: TaskRecord) -> None:
    """Remove the cancel record of a task that ended ``done`` or ``failed`` before it was
    applied, so that a rewind or retry of it is not cancelled afterwards. Only under the
    operator lock: no other command can be reading it then."""
    if record.state in ENDED:
        with contextlib.suppress(FileNotFoundError):
            task.cancellation.unlink()


def _decided_calls(task: TaskDir) -> list[str]:
    """Calls of ``task`` whose operator decision is not carried out yet: held with a
    decision for the held attempt, or being re-run on one (a dangling attempt right after
    a decided one, not held again)."""
    if not task.decisions.is_dir() or task.decisions.is_symlink():
        return []
    try:
        state = load_state(task)
        held = {h["call_id"]: h.get("attempt") for h in state.held}
        found = []
        for call in state.calls.values():
            if not call.dangling or call.key is None:
                continue
            decided = call.attempt if held.get(call.call_id) == call.attempt else call.attempt - 1
            if decided > 0 and _usable_decision(task.decision_file(call.key, decided)):
                found.append(call.call_id)
        return found
    except (AgentdError, OSError, ValueError, KeyError, TypeError):
        return []  # a journal no worker can replay: nothing of it will be carried out


def decide(
    task: TaskDir,
    call_id: str,
    *,
    action: str,
    reason: str | None = None,
    result: str | None = None,
) -> dict[str, Any]:
    """Durably record an operator's decision on one held call of ``task``; refused once
    the task was cancelled (under the operator lock, so a racing cancel has one winner)."""
    with operator_lock(task):
        refuse_if_cancelled(task, "decision")
        return _decide(task, call_id, action=action, reason=reason, result=result)


def _decide(
    task: TaskDir, call_id: str, *, action: str, reason: str | None, result: str | None
) -> dict[str, Any]:
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
    """Whether the worker can apply this decision file (``worker.protocol.usable_decision``)."""
    try:
        return usable_decision(read_bytes(path))
    except OSError:
        return False
