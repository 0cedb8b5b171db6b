"""The unsafe tool of the approvals campaign (``tests.chaos.approvals``): a charge that
counts its real runs in a ledger of its task's workspace, and waits at two gates the
campaign opens, so a kill lands where the campaign wants it.

Loaded by the campaign's workers through ``[tools] modules = ["tests.chaos.approval_tools"]``.
``gated_charge`` (effect ``unsafe``), in the task's workspace:

1. appends a line to ``starts.txt`` (the run has begun: its intent is durable);
2. waits until ``effect.go`` exists (a kill here lands mid-tool, before the effect);
3. appends one line to ``ledger.txt``: the effect itself, one ``O_APPEND`` write, fsync'd;
4. waits until ``result.go`` exists (a kill here lands after the effect, before the
   result record);
5. returns, and its worker records the result.

And it can hold its worker still right after a record: where ``APPROVALS_CHAOS_PAUSES``
names a folder (the campaign's daemon passes it on to its workers), a worker that has just
made a ``decision`` or an ``intent`` record durable for a task whose gate
``FOLDER/TASK.KIND`` exists writes ``FOLDER/TASK.KIND.PID`` and waits until the gate is
gone, so a kill lands between that record and the next step however fast the worker is.

Each line says what the run was told by its task's journal when it began: the attempt of
the call's latest ``intent`` record (``r``), and the attempt of the call's latest
``decision`` record (``d``, 0 when there is none) with its action. The campaign reads them to
tie each real run to the one decision it was made on.
"""

from __future__ import annotations

import functools
import json
import os
import time
from pathlib import Path
from typing import Any

from worker.recorder import Recorder
from worker.records import RecordKind
from worker.store.journal import iter_records
from worker.tools.registry import Effect, ToolContext, ToolError, tool

PAUSES_ENV = "APPROVALS_CHAOS_PAUSES"
LEDGER = "ledger.txt"
STARTS = "starts.txt"
EFFECT_GATE = "effect.go"
RESULT_GATE = "result.go"
POLL = 0.02


def told(ctx: ToolContext) -> dict[str, Any]:
    """What the journal says of this call as it begins: its latest intent's attempt, and
    its latest decision's attempt and action."""
    seen: dict[str, Any] = {"r": 0, "d": 0, "action": None, "asked": False}
    for record in iter_records(ctx.workspace.parent / "journal"):
        if record.get("call_id") != ctx.call_id:
            continue
        if record.get("k") == RecordKind.INTENT:
            seen["r"] = record.get("attempt", 0)
            seen["asked"] = bool(record.get("asked", False))
        elif record.get("k") == RecordKind.DECISION:
            seen["d"] = record.get("attempt", 0)
            seen["action"] = record.get("action")
    return seen


def _line(path: Path, fields: dict[str, Any]) -> None:
    data = (json.dumps(fields, separators=(",", ":")) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, data)  # one small O_APPEND write: whole or absent
        os.fsync(fd)
    finally:
        os.close(fd)


def _gate(ctx: ToolContext, name: str) -> None:
    deadline = time.monotonic() + max(1.0, ctx.timeout - 1.0)
    while not (ctx.workspace / name).exists():
        if time.monotonic() > deadline:
            raise ToolError(f"gate {name} was not opened within {ctx.timeout:g} s")
        time.sleep(POLL)


@tool(effect=Effect.UNSAFE)
def gated_charge(ctx: ToolContext, amount: int) -> str:
    """Charge an amount on the task's ledger. Not idempotent: a second run charges again."""
    fields = {**told(ctx), "pid": os.getpid(), "amount": amount}
    _line(ctx.workspace / STARTS, fields)
    _gate(ctx, EFFECT_GATE)
    _line(ctx.workspace / LEDGER, {**fields, "at": time.time()})
    _gate(ctx, RESULT_GATE)
    return f"charged {amount}"


def pause_gate(folder: Path, task_id: str, kind: str) -> Path:
    """The gate that holds a worker of ``task_id`` still after its next ``kind`` record."""
    return folder / f"{task_id}.{kind}"


def paused(folder: Path, task_id: str, kind: str) -> int | None:
    """The pid of a worker held still at that gate, if one is."""
    for path in folder.glob(f"{task_id}.{kind}.*"):
        return int(path.suffix[1:])
    return None


def _pause(folder: Path, task_id: str, kind: str) -> None:
    gate = pause_gate(folder, task_id, kind)
    if not gate.exists():
        return
    mark = gate.with_name(f"{gate.name}.{os.getpid()}")
    mark.touch()
    try:
        while gate.exists():
            time.sleep(POLL)
    finally:
        mark.unlink(missing_ok=True)


def _hold_after_records() -> None:
    """In a worker, hold still after a decision or intent record whose gate is set."""
    named = os.environ.get(PAUSES_ENV, "")
    if not named:
        return
    folder = Path(named)
    record = Recorder.record

    @functools.wraps(record)
    def held(self: Recorder, *records: Any, **kwargs: Any) -> None:
        record(self, *records, **kwargs)
        for kind in (RecordKind.DECISION, RecordKind.INTENT):
            if any(r.get("k") == kind for r in records):
                _pause(folder, self.task_id, str(kind))

    Recorder.record = held  # type: ignore[method-assign]


_hold_after_records()
