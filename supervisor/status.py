"""What a task is now, read from its files alone: ``status_row`` builds the JSON of
docs/design.md section 3, so `agentd status` works whether or not the daemon runs.

A running task is shown from its worker's heartbeat (cheap, and as fresh as the worker);
any other from its journal, folded from the snapshot on (``load_state(full=False)``). The
heartbeat's age is read on the monotonic clock, as the daemon's verdicts are.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping
from typing import Any

from supervisor.liveness import Beat
from supervisor.record import TaskRecord
from supervisor.stores import store_of
from worker.budget import BUILTIN_PRICES, Price, cost_usd, current_budget, spend_from_json
from worker.errors import JournalCorruptError, NotFoundError, SpoolError, TaskSpecError
from worker.protocol import HeartbeatData, TaskStatus, heartbeat_shaped
from worker.spool import TaskDir, TaskSpec
from worker.state import Call, TaskState
from worker.store import replay

#: A held call's ``stage`` (docs/guides/tools.md): it waits for an approval before it
#: runs at all, or it started and its outcome is unknown (section 5).
STAGE_BEFORE, STAGE_UNKNOWN = "before", "unknown"
#: How much of a failed model call's error REASON shows (the log has it whole).
RETRY_ERROR_LIMIT = 160


def load_state(task: TaskDir, *, full: bool = True, spec: TaskSpec | None = None) -> TaskState:
    """Fold the task's journal (read-only) into its state: ``worker.store.replay.load``.
    ``full=False`` starts from the snapshot when there is a usable one: fast, but without
    the per-turn boundaries that rewind and fork need. ``spec``: the task's, when the
    caller has it (status reads it once per task, not twice)."""
    prompt = spec.prompt if spec is not None else None
    return replay.load(store_of(task), task.id, full=full, prompt=prompt)


def read_heartbeat(task: TaskDir) -> HeartbeatData | None:
    """The worker's last heartbeat, or None when there is none or it does not have the
    shape a worker writes (``worker.protocol.heartbeat_shaped``)."""
    beat = store_of(task).read_heartbeat(task.id)
    return beat if heartbeat_shaped(beat) else None


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def beat_age(beat: HeartbeatData) -> float:
    """Seconds since the worker wrote ``beat`` (a ``read_heartbeat`` result), now."""
    mono = time.monotonic()
    return Beat.of(beat, time.time(), mono).age(mono)


def held_calls(task: TaskDir, state: TaskState | None = None) -> list[dict[str, Any]]:
    """The task's dangling calls that wait for an operator, as `agentd dangling` shows them.
    Read from the snapshot on: a held call is one of the latest turn's, which a snapshot
    carries, so a long task's holds cost the records after its snapshot, not its history."""
    state = state or load_state(task, full=False)
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
                "input_sha256": _input_sha256(call.input),
                "started_at": call.started_at,
                "stage": STAGE_BEFORE if call.asked else STAGE_UNKNOWN,
                "why": hold.get("why"),
            }
        )
    return rows


def _input_sha256(value: Any) -> str | None:
    """The held call's ``input_sha256`` (docs/guides/tools.md); None for an input
    no JSON can carry (never one a model sent)."""
    from worker.canonical import NotCanonical, input_sha256  # noqa: PLC0415  (a held call's alone: status starts fast)

    try:
        return input_sha256(value)
    except NotCanonical:
        return None


def retrying(beat: HeartbeatData | None) -> str | None:
    """What a running task's REASON says while its worker retries a model call (the
    ``retry`` of its heartbeat): what failed, the attempt, when the next try is."""
    retry = (beat or {}).get("retry")
    if not isinstance(retry, dict):
        return None
    error = " ".join(str(retry.get("error", "")).split())
    if len(error) > RETRY_ERROR_LIMIT:
        error = error[: RETRY_ERROR_LIMIT - 3] + "..."
    next_try = retry.get("next_try")
    wait = next_try - time.time() if isinstance(next_try, int | float) else None
    when = f"in {wait:.0f} s" if wait is not None and wait >= 0.5 else "now"
    return (
        f"retrying the model call: attempt {retry.get('attempt')} failed ({error}); next try {when}"
    )


def budget_of(task: TaskDir, spec: TaskSpec | None) -> dict[str, Any]:
    """The task's budget now (docs/design.md section 13): the latest ``agentd budget``
    change, else its spec's; one whose changes cannot be read shows its spec's."""
    if spec is None:
        return {"usd": None, "tokens": None}
    try:
        return current_budget(store_of(task), task.id, spec.budget)[0].to_json()
    except ValueError:
        return spec.budget.to_json()


def status_row(task: TaskDir, prices: Mapping[str, Price] = BUILTIN_PRICES) -> dict[str, Any]:
    """One task as `agentd status --json` shows it (docs/design.md section 3). The heartbeat's
    age is read on the monotonic clock, as the daemon's verdicts are: a stepped wall clock
    never shows an age below 0 or an hour off. ``prices``: what ``cost_usd`` is reckoned
    at (``Config.price_table``)."""
    return status_row_of(task, prices)[0]


def status_row_of(
    task: TaskDir, prices: Mapping[str, Price] = BUILTIN_PRICES
) -> tuple[dict[str, Any], bool]:
    """``status_row``, and whether the row follows from the task's files alone: False
    while a worker runs the task (its heartbeat's age moves on by itself) and for a task
    of `agentd run` (whether its run is alive is a lock, not a file's contents)."""
    record = TaskRecord.load(task)
    by_files = record.state != TaskStatus.RUNNING and not record.foreground
    if (
        record.state == TaskStatus.RUNNING
        and record.foreground
        and not store_of(task).owned(task.id)
    ):
        # its `agentd run` was killed (a kill -9, a closed terminal), and its worker with it
        record.state = TaskStatus.QUEUED
        record.reason = f"its agentd run ended; `agentd run --resume {task.id}` carries it on"
    beat = read_heartbeat(task)
    spec_error = None
    try:
        spec = store_of(task).load_spec(task.id)
    except (SpoolError, TaskSpecError, NotFoundError) as exc:
        spec, spec_error = None, str(exc)
    running = record.state == TaskStatus.RUNNING
    turn, usage, dangling = 0, {"input_tokens": 0, "output_tokens": 0}, []
    tokens_used: int | None = None
    compactions = 0
    damage = None
    # what it spent, by model (the whole life): the heartbeat's while its worker runs
    spend = spend_from_json(beat.get("spend")) if running and beat and "spend" in beat else None
    if not running or beat is None or spend is None:
        with contextlib.suppress(Exception):  # status must show a broken task, not die on it
            try:
                state = load_state(task, full=False, spec=spec)
            except JournalCorruptError as exc:  # its worker refuses it in the same words
                damage = str(exc)
                raise
            turn = state.turn
            tokens_used = state.tokens_used if state.turn else None
            compactions = state.compaction_count
            usage = {
                "input_tokens": state.usage_total.input_tokens,
                "output_tokens": state.usage_total.output_tokens,
            }
            spend = spend if spend is not None else state.spend_total
            if record.state == TaskStatus.HELD:
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
    row: dict[str, Any] = {
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
        "reason": record.reason or spec_error or damage or (retrying(beat) if running else None),
        "workspace": str(task.workspace_for(spec)) if spec else None,
        "updated_at": record.updated_at or None,
        "forked_from": spec.forked_from if spec else None,
        "created_at": spec.created_at or None if spec else None,
        # the context the model saw at its last call plus what it wrote; null before the
        # first call, and for a running worker whose heartbeat does not carry it
        "tokens_used": tokens_used,
        "compactions": compactions,  # on the live branch (worker.compaction)
        # USD to 6 decimals at ``prices``, null while a model it used has no price
        "cost_usd": cost_usd(spend, prices) if spend is not None else None,
        "budget": budget_of(task, spec),
    }
    return row, by_files
