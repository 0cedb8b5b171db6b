"""Checkpoints as time travel: ``agentd history``, ``rewind`` and ``fork``.

A checkpoint restores the conversation and the ledger (messages, counters, which calls
ran with which idempotency keys). Files are version control's job: where the workspace
is under git, each turn boundary also recorded a snapshot commit (worker/vcs.py), which
``rewind --restore-workspace`` and ``fork`` use. Side effects on the outside world are
neither, which is why rewind lists the calls it cannot undo before it acts.

Both cut only at turn boundaries, so every tool_use keeps its one tool_result.

* rewind checks everything it can (the turn, ``--yes``, a cancelled task) before it
  pauses the task's worker, so a refused rewind never stops a running tool, and again
  once the worker has stopped at its safe point (it may have moved on meanwhile). Then
  it queues the task and appends one ``rewind`` record (one fdatasync): a kill at any
  instant leaves the old scene or the new one, and a new scene is never left recorded
  ``done``. Later turns stay in the journal, marked rewound, for audit.
* fork writes a new task whose journal starts with a ``base`` record holding the scene;
  its spec is written last, so a kill leaves either no fork or a whole one.
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from supervisor.control import REQUEUE_REQUEST, Fenced, change_record, paused
from supervisor.coordination import operator_lock, ring
from supervisor.decisions import drop_moot_cancel, refuse_if_cancelled
from supervisor.operator import Operator, fields_of
from supervisor.record import TaskRecord
from supervisor.status import load_state
from supervisor.stores import store_of
from supervisor.submit import create_task, existing_task
from worker import vcs
from worker.budget import BUILTIN_PRICES, Price, cost_usd, current_budget
from worker.config import Config
from worker.errors import IrreversibleError, SpoolError, StateConflictError, UsageError
from worker.events import Event, record_event, utc_now
from worker.models.base import Usage
from worker.records import CallOutcome, ForkBaseRecord, Origin, RecordKind, UserRecord
from worker.spool import Spool, TaskDir, validate_task_id
from worker.state import Call, TaskState
from worker.store.base import Snapshot
from worker.tools.sandbox import sandbox_for

IRREVERSIBLE = ("idempotent", "keyed", "unsafe")


# -- history ------------------------------------------------------------------------------


def history_rows(
    task: TaskDir, prices: Mapping[str, Price] = BUILTIN_PRICES
) -> list[dict[str, Any]]:
    """One row per turn ever recorded, live or rewound, in journal order; one per
    compaction (``"kind": "compaction"``, at the turn it followed, with the turns it
    replaced, the tokens before and after, and the summary's first line). A row a rewind
    cut is marked ``rewound`` and carries the ``rewind`` (``to``, ``at`` and who rewound:
    ``by``, ``via``); a call an operator decided carries the ``decision`` (``action``,
    ``by``, ``via``: docs/design.md section 15). Each row's ``cost_usd`` is its model
    call's, at ``prices`` (null without a price); a compaction row's is its summary
    call's."""
    rows: list[dict[str, Any]] = []
    calls: dict[str, dict[str, Any]] = {}
    branch = 0
    live = 0  # the live branch's latest turn
    for record in store_of(task).replay(task.id):  # none before it ran: no history
        kind = record.get("k")
        if kind == RecordKind.BASE:
            scene = record["scene"]
            live = int(scene.get("turn", 0))
            for info in scene.get("turns", []):
                if not info.get("rewound"):
                    row = _row(info, branch=0, inherited=True, prices=prices)
                    row["tool_calls"] = [
                        {
                            "call_id": c["call_id"],
                            "tool": c["tool"],
                            "effect": c.get("effect"),
                            "outcome": (c.get("result") or {}).get("outcome", CallOutcome.PENDING),
                            "is_error": bool((c.get("result") or {}).get("is_error")),
                            "key": c.get("key"),
                        }
                        for c in scene.get("calls", [])
                        if c.get("turn") == info["turn"]
                    ]
                    rows.append(row)
        elif kind == RecordKind.TURN:
            live = int(record["turn"])
            row = _row(record, branch=branch, inherited=False, prices=prices)
            for block in record["message"]["content"]:
                if block.get("type") == "tool_use":
                    call = {"call_id": block["id"], "tool": block["name"], "effect": None}
                    call.update(outcome=CallOutcome.PENDING, is_error=False, key=None)
                    row["tool_calls"].append(call)
                    calls[block["id"]] = call
            rows.append(row)
        elif kind == RecordKind.INTENT and record["call_id"] in calls:
            call = calls[record["call_id"]]
            call.update(
                effect=record.get("effect"), key=record.get("key"), outcome=CallOutcome.DANGLING
            )
        elif kind == RecordKind.RESULT and record["call_id"] in calls:
            call = calls[record["call_id"]]
            call.update(
                outcome=record.get("outcome", CallOutcome.RAN),
                is_error=bool(record.get("is_error")),
            )
        elif kind == RecordKind.DECISION and record.get("call_id") in calls:
            decision = {k: record[k] for k in ("action", "by", "via") if k in record}
            calls[record["call_id"]]["decision"] = decision
        elif kind == RecordKind.VCS:
            for row in reversed(rows):
                if row["turn"] == record["turn"] and not row["rewound"]:
                    row["vcs"] = {
                        "commit": record.get("commit"),
                        "snapshot": record.get("snapshot"),
                    }
                    break
        elif kind == RecordKind.COMPACTION:
            rows.append(_compaction_row(record, live, branch, prices))
        elif kind == RecordKind.REWIND:
            rewind = {k: record[k] for k in ("to", "at", "by", "via") if k in record}
            for row in rows:
                if row["turn"] > record["to"] and not row["inherited"] and not row["rewound"]:
                    row["rewound"] = True
                    row["rewind"] = rewind
            branch += 1
            live = min(live, int(record["to"]))
    return rows


def _compaction_row(
    record: dict[str, Any], turn: int, branch: int, prices: Mapping[str, Price]
) -> dict[str, Any]:
    """A compaction's row, at the turn it followed; its tokens are the summary call's."""
    summary = str(record.get("summary", "")).strip()
    return {
        **_row({**record, "turn": turn}, branch=branch, inherited=False, prices=prices),
        "kind": "compaction",
        "first": record.get("first"),
        "last": record.get("last"),
        "tokens_before": record.get("tokens_before"),
        "tokens_after": record.get("tokens_after"),
        "summary": summary.splitlines()[0] if summary else "",
        "trigger": record.get("trigger"),
    }


def _row(
    info: dict[str, Any], *, branch: int, inherited: bool, prices: Mapping[str, Price]
) -> dict[str, Any]:
    usage = info.get("usage") or {}
    return {
        "kind": "turn",
        "turn": info["turn"],
        "at": info.get("at"),
        "model": info.get("model"),
        "stop_reason": info.get("stop_reason"),
        "input_tokens": usage.get("input_tokens", 0),
        "output_tokens": usage.get("output_tokens", 0),
        "cost_usd": cost_usd({str(info.get("model") or ""): Usage.from_json(usage)}, prices),
        "tool_calls": [],
        "vcs": None,
        "branch": branch,
        "rewound": False,
        "inherited": inherited,
    }


# -- shared checks ------------------------------------------------------------------------


def _check_turn(task: TaskDir, state: TaskState, turn: int, verb: str) -> None:
    if turn < 0 or turn > state.turn:
        raise UsageError(
            f"task {task.id} has turns 0 to {state.turn}; cannot {verb} turn {turn}. "
            f"`agentd history {task.id}` lists them."
        )
    if turn == state.turn and state.pending_calls():
        raise StateConflictError(
            f"turn {turn} of task {task.id} is not complete (a tool call has no result); "
            f"{verb} turn {turn - 1} or earlier."
        )
    if state.boundaries is not None and turn < state.turn and turn not in state.boundaries:
        raise UsageError(
            f"turn {turn} of task {task.id} predates its fork point; "
            "fork or rewind the parent task instead."
        )


def _scene_after(state: TaskState, turn: int) -> TaskState:
    scene = state.clone()
    if turn < scene.turn or scene.pending_calls():
        scene.apply({"k": RecordKind.REWIND, "to": turn})
    return scene


def irreversible_calls(state: TaskState, turn: int) -> list[Call]:
    """Live calls after ``turn`` that started and whose effects a rewind cannot undo."""
    return [
        c
        for c in state.calls.values()
        if c.turn > turn and c.attempt > 0 and (c.effect or "unsafe") in IRREVERSIBLE
    ]


# -- rewind -------------------------------------------------------------------------------


@dataclass(frozen=True)
class RewindReport:
    task: str
    from_turn: int  # the live turn before the rewind
    to: int
    irreversible: list[dict[str, Any]]
    workspace: str
    cut_off: list[dict[str, Any]]  # calls killed mid-way by the pause: outcome unknown
    # on a shared store: taken from a node that stopped renewing its lease, whose cut-off
    # call may still complete until that lease ends
    fenced: Fenced | None = None


def _call_row(call: Call) -> dict[str, Any]:
    return {"turn": call.turn, "call_id": call.call_id, "tool": call.tool, "effect": call.effect}


def _check_rewind(
    task: TaskDir, state: TaskState, to: int, *, yes: bool, restore_workspace: bool
) -> list[dict[str, Any]]:
    """Every check of a rewind of ``state`` to ``to``; returns the calls it cannot undo."""
    _check_turn(task, state, to, "rewind to")
    undo = [_call_row(c) for c in irreversible_calls(state, to)]
    if undo and not yes:
        listing = "; ".join(f"turn {u['turn']} {u['tool']} ({u['effect']})" for u in undo)
        raise IrreversibleError(
            f"rewinding task {task.id} to turn {to} cannot undo {len(undo)} call(s) with "
            f"side effects: {listing}. Run again with --yes to rewind anyway.",
            undo,
        )
    if restore_workspace and not state.vcs.get(to, {}).get("snapshot"):
        raise StateConflictError(
            f"there is no workspace snapshot for turn {to} of task {task.id} (the "
            "workspace is not under git); rewind without --restore-workspace."
        )
    return undo


def rewind(
    spool: Spool,
    config: Config,
    task_id: str,
    to: int,
    *,
    restore_workspace: bool = False,
    yes: bool = False,
    operator: Operator | None = None,
) -> RewindReport:
    """Put the task back to the scene after turn ``to`` (``agentd rewind``); ``operator``:
    who did, kept in the journal's rewind record and the ``task_rewound`` event."""
    task = existing_task(spool, task_id)
    checks = {"yes": yes, "restore_workspace": restore_workspace}
    grace = config.restart.stop_grace
    with operator_lock(task, wait=grace + 10):
        refuse_if_cancelled(task, "rewind")
        _check_rewind(task, load_state(task), to, **checks)  # before anything is paused
        with paused(spool, task, wait=grace + 5) as pause:
            state = load_state(task)  # the worker may have moved on before it stopped
            undo = _check_rewind(task, state, to, **checks)
            cut_off = [_call_row(c) for c in state.dangling()] if pause.cut_off else []
            from_turn = state.turn
            # The task is queued before its scene changes: a kill between the two leaves a
            # queued task on its old scene (a worker ends it again at once), never a rewound
            # task recorded `done`, which no daemon would ever resume.
            drop_moot_cancel(task, TaskRecord.load(task))
            change_record(spool, task, REQUEUE_REQUEST, TaskRecord.requeue)
            store = store_of(task)
            journal, _ = store.open_journal(pause.owner, header={"task": task.id})
            try:
                journal.append(
                    [{"k": RecordKind.REWIND, "to": to, "at": utc_now(), **fields_of(operator)}]
                )
            finally:
                journal.close()
            state.apply({"k": RecordKind.REWIND, "to": to})
            store.put_snapshot(pause.owner, Snapshot(journal.cursor, state))
            workspace = _rewind_workspace(config, task, state, to, restore=restore_workspace)

    cut = [c["call_id"] for c in cut_off]
    record_event(
        store_of(task),
        task.id,
        Event.TASK_REWOUND,
        "warning" if cut else "info",
        task=task.id,
        to=to,
        from_turn=from_turn,
        cut_off=cut,
        **fields_of(operator),
    )
    ring(spool, task.id)
    return RewindReport(task.id, from_turn, to, undo, workspace, cut_off, pause.fenced)


def _rewind_workspace(
    config: Config, task: TaskDir, state: TaskState, to: int, *, restore: bool
) -> str:
    """Restore the workspace files of turn ``to`` when asked and possible; what was done."""
    git = _git_of(config, task, store_of(task).load_spec(task.id).git)
    snapshot = state.vcs.get(to, {}).get("snapshot")
    if restore and snapshot and git is not None:
        git.restore(snapshot)
        return f"files restored to their state after turn {to} (git {snapshot[:12]})"
    if git is not None:
        return "files were left as they are (add --restore-workspace to restore them)"
    return "files were not restored (the workspace is not under git)"


def _git_of(config: Config, task: TaskDir, spec_git: Any) -> vcs.Git | None:
    """The task's git (``worker.vcs``), run under the sandbox its tools get."""
    sandbox = sandbox_for(
        config.tools.sandbox, config.tools.network, spool=task.root, config=config.source
    )
    return vcs.git_of(spec_git, task.git, sandbox)


# -- fork ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ForkReport:
    task: str
    parent: str
    at: int
    workspace: str


def fork(
    spool: Spool,
    config: Config,
    parent_id: str,
    at: int,
    *,
    name: str | None = None,
    prompt: str | None = None,
    operator: Operator | None = None,
) -> ForkReport:
    """A new task from the scene after turn ``at`` of ``parent_id`` (``agentd fork``);
    ``operator``: who made it, kept in its base record's ``from`` and the parent's
    ``task_forked`` event (the spec's ``forked_from`` keeps its shape: task and turn)."""
    parent = existing_task(spool, parent_id)
    store = store_of(parent)
    spec = store.load_spec(parent_id)
    new_id = validate_task_id(name) if name else f"{parent_id[:50]}-fork-{secrets.token_hex(3)}"
    if store.exists(new_id):
        raise StateConflictError(f"a task named {new_id!r} already exists; pick another --name.")
    if prompt is not None and not prompt.strip():
        raise UsageError("--prompt is empty; leave it out or give the extra user message.")
    state = load_state(parent)
    _check_turn(parent, state, at, "fork at")
    scene = _scene_after(state, at)
    # the fork's life starts with its scene's: the parent's branch up to the fork point
    scene.usage_total, scene.spend_total = scene.usage, scene.spend
    scene.turns = [t for t in scene.turns if not t.rewound]
    origin = {"task": parent_id, "turn": at}
    base: Origin = {"task": parent_id, "turn": at, **fields_of(operator)}
    records: list[ForkBaseRecord | UserRecord] = [
        {"k": RecordKind.BASE, "scene": scene.to_snapshot(0), "from": base}
    ]
    if prompt:
        records.append({"k": RecordKind.USER, "content": [{"type": "text", "text": prompt}]})
    stamped = [{**r, "at": utc_now()} for r in records]

    parent_ws = parent.workspace_for(spec)
    snapshot = scene.vcs.get(at, {}).get("snapshot")
    # the fork's budget is its parent's now, and applies to a spend that starts with the
    # parent's up to the fork point (docs/design.md section 13)
    budget = current_budget(store, parent_id, spec.budget)[0]
    new_spec = replace(spec, id=new_id, forked_from=origin, created_at=utc_now(), budget=budget)
    note = "files were not restored (the workspace is not under git)"
    worktree = None
    git = _git_of(config, parent, spec.git) if snapshot else None
    # on a shared store a workspace given at submit is on a mount every node sees: the
    # fork's own goes beside it there (``_beside``), never in this node's spool
    beside = spool.shared is not None and spec.workspace is not None
    if snapshot and git is not None:
        worktree = spool.task(new_id).path / "worktree"
        if beside:
            worktree = _beside(git.repo.work_tree, new_id)
        inside = parent_ws.resolve().relative_to(git.repo.work_tree.resolve())
        child = vcs.Repository(worktree, None, git.repo.common_dir)
        new_spec = replace(new_spec, workspace=str(worktree / inside), git=child.to_json())
        note = f"own work tree at the files after turn {at} (git {snapshot[:12]})"
        note += f" at {worktree}" if beside else ""
    elif beside:
        worktree = _beside(parent_ws, new_id)
        new_spec = replace(new_spec, workspace=str(worktree))
        note += f"; the fork has its own copy of the parent's files, in {worktree}"
    elif spec.workspace is not None:
        note += f"; the fork shares the workspace {spec.workspace}"
    else:
        note += "; the fork starts with a copy of the parent's files as they are now"

    def prepare(folder: Path | None) -> None:
        made = folder or spool.task(new_id).path  # (the folder being made, or the task's)
        if git is not None and worktree is not None and snapshot:
            work_tree = worktree if beside else made / worktree.name
            git.fork(snapshot, work_tree, made / spool.task(new_id).git.name)
        elif beside and worktree is not None:
            _copy_beside(parent_ws, worktree)
        elif spec.workspace is None and parent_ws.is_dir():
            shutil.copytree(parent_ws, made / "workspace", symlinks=True)

    try:
        script: bytes | None = store.load_script(parent_id)
    except FileNotFoundError:
        script = None
    try:
        create_task(spool, new_spec, script, journal=stamped, prepare=prepare)
    except BaseException:
        if beside and worktree is not None:  # a refused fork leaves nothing beside
            shutil.rmtree(worktree, ignore_errors=True)
        raise
    record_event(
        store,
        parent_id,
        Event.TASK_FORKED,
        task=parent_id,
        fork=new_id,
        at=at,
        **fields_of(operator),
    )
    ring(spool, new_id)
    return ForkReport(new_id, parent_id, at, note)


def _beside(workspace: Path, fork_id: str) -> Path:
    """Where a fork's own workspace goes on a shared store: ``WORKSPACE.fork-ID``, beside
    its parent's on the same mount (so every node that sees the parent's sees it). Refused
    in one line, before anything is written, when that folder cannot be made there."""
    target = workspace.with_name(f"{workspace.name}.fork-{fork_id}")
    folder = target.parent
    if not workspace.is_dir():
        raise SpoolError(
            f"the workspace {workspace} is not a folder on this node, so the fork cannot copy "
            "it; fork the task on a node that mounts it."
        )
    if target.exists() or target.is_symlink():
        raise StateConflictError(
            f"{target} exists already; give the fork another --name, or remove that folder."
        )
    if not os.access(folder, os.W_OK | os.X_OK):
        raise SpoolError(
            f"the fork's workspace {target} cannot be made: {folder} is not writable here; "
            "make it writable for agentd's user (or read-write), or fork on a node where it is."
        )
    return target


def _copy_beside(workspace: Path, target: Path) -> None:
    """A copy of ``workspace`` at ``target``, built under a temporary name beside it and
    renamed into place: a copy cut short leaves no half folder under the fork's name."""
    build = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        shutil.copytree(workspace, build, symlinks=True, dirs_exist_ok=True)
        build.chmod(0o700)
        os.rename(build, target)
    except BaseException:
        shutil.rmtree(build, ignore_errors=True)
        raise
