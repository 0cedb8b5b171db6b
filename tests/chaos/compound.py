"""Compound failures (fault class 5): ``kill -9`` while agentd recovers from a first one.

Every case starts from a *start*: a copy of a task folder as a first fault left it (a kill
between two journal appends, a held call, a finished task about to be rewound...). Two
futures of the start are compared:

* **single recovery**: the operation that follows the fault runs cleanly (a worker
  resumes the task, or ``agentd approve-dangling``/``rewind``/``fork`` runs), then the
  task is driven to its end by clean workers, held calls decided by the careful operator
  of ``tests.faults.common`` (who looks at the workspace for the held call's effect);
* **double recovery**: the same operation is killed with SIGKILL on entry to one of its
  durable syscalls (``strace -e inject``, as in ``tests.faults.crash_points``), the operator
  does what an operator does after a killed command (repeats it unless it took effect),
  and the task is driven to its end the same way.

The two ends must be the same state: the same transcript, counters (turn, usage, total
usage), ledger (every call's tool, input, effect class, idempotency key and result) and
workspace files, byte for byte. Differences allowed by docs/design.md, and only these: a
read_only/idempotent/keyed call run again (its attempt count, and a keyed result's wording
"duplicate suppressed"/"already recorded"), and a second hold when the kill fell inside an
unsafe call an operator had let re-run (the operator decides it again; a supplied outcome
reads "(checked by the operator)"). Besides, in the double recovery: nothing recorded before
the kill is lost or changed; no record is written twice (a turn, an intent or a decision
for the same attempt, a result); no unsafe call runs again without an operator's decision;
every call the single recovery held is held; every decision file is applied exactly once;
the task ends done after all its turns, every tool_use paired.

Starts and what is killed (the worker's kill points are those of its recovery: every
durable syscall on the task folder before it records its first new model turn, but the
heartbeat file's, which ``tests.faults.crash_points`` visits):

* ``recovery``: the task stopped before each of its journal appends (4 turns; 5 in full),
  plus the dangling ``append_file``/``outbox_send`` calls with their effect undone (killed
  after the intent, before the effect) and torn tails (half of the next record, every
  third record); the resuming worker is killed.
* ``decision``: a held ``append_file`` call decided (re-run when its effect is absent, the
  outcome supplied when present, skip); the worker applying the decision is killed.
* ``approve``: the same held call; ``agentd approve-dangling`` itself is killed, then the
  operator repeats it (a decision that was written makes it say "already decided").
* ``rewind``: ``agentd rewind t1 --to 2 --yes`` of the finished task is killed: the scene
  must be the old one or the new one, and a rewound task must not be left ``done`` (the
  daemon would never resume it); the operator repeats the rewind when it did not take.
* ``fork``: ``agentd fork t1 --at 2 --name f1`` is killed: no fork or a whole one, and the
  parent untouched; the operator repeats the fork when there is none.

``tests/supervisor/test_history.py`` kills rewind and fork at random instants; here every
durable syscall is visited and the task is followed to its end. Quick mode takes one
recovery start of each kind (what the first crash interrupted, and the variant) and
samples the points (2 a recovery start, 3 a decision or approve, 6 a rewind or fork:
about 60 cases); full mode takes every point of every start (about 900).

``python -m tests.chaos.compound [--full] [--seed N]`` prints the figures; exit 1 on a
violation.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import tempfile
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from supervisor.decisions import decide, pending_decisions
from supervisor.record import TaskRecord
from supervisor.status import load_state
from tests.faults.common import (
    Exit,
    Plan,
    check_task,
    clone_task,
    drive,
    final_state,
    mixed_plan,
    parallel,
    parse_log,
    records,
    require_strace,
    run_cli,
    run_worker,
    stopwatch,
    strace_prefix,
)
from tests.faults.crash_points import ALL_CLASSES, Point, is_point, kill_at, where
from tests.faults.report import Figure, format_figures, violations
from tests.faults.torn import Setup, prepare
from tests.support import assert_paired
from worker.errors import AgentdError
from worker.protocol import FINAL_STATES, ExitCode, TaskStatus
from worker.spool import TaskDir

FAULT = "compound"
JSON = dict[str, Any]
SUBCLASSES = ("recovery", "decision", "approve", "rewind", "fork")
REWIND_TO = FORK_AT = 2
FORK_NAME = "f1"
TURN_WRITE = '{\\"k\\":\\"turn\\"'  # a turn record, as strace shows the journal write
_WORDING = re.compile(r", (?:duplicate suppressed|already recorded)\)| \(checked by the operator\)")

#: Violation figures, in the order they are printed.
DIFFERS = "states differing after double vs single recovery"
LOST = "recorded records lost or changed"
DUPLICATED = "records written twice"
UNSAFE_RERUN = "unsafe calls re-run without a decision"
UNSAFE_TWICE = "unsafe effects repeated"
KEYED_TWICE = "keyed effects repeated"
HOLDS_LOST = "holds of the single recovery not held"
DECIDED_TWICE = "decisions applied twice"
DECISIONS_LOST = "decisions lost"
MIXED = "rewind/fork mixed scenes"
LEFT_DONE = "rewound tasks left done (never resumed)"
PARENT_CHANGED = "fork parents changed"
UNPAIRED = "tool_use not paired"
NOT_DONE = "tasks not completed"
MISSED = "kills that missed their point"
PROBLEMS = (
    DIFFERS,
    LOST,
    DUPLICATED,
    UNSAFE_RERUN,
    UNSAFE_TWICE,
    KEYED_TWICE,
    HOLDS_LOST,
    DECIDED_TWICE,
    DECISIONS_LOST,
    MIXED,
    LEFT_DONE,
    PARENT_CHANGED,
    UNPAIRED,
    NOT_DONE,
    MISSED,
)


# -- starts -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Start:
    """A task folder as a first fault left it, and the operation that comes next: a worker
    resuming it (``args`` empty) or an ``agentd`` command."""

    sub: str
    name: str
    task: TaskDir  # never run itself: every case works on a copy
    args: tuple[str, ...] = ()
    kind: str = ""  # what the first crash interrupted, and how (quick mode takes one a kind)

    @property
    def target(self) -> str:
        """The task whose end is compared: the fork's child for a fork."""
        return FORK_NAME if self.sub == "fork" else self.task.id


@dataclass
class Baseline:
    """The single recovery of a start: its end, and the kill points of its operation."""

    start: Start
    end: JSON  # fingerprint of the target task at its end
    held: set[str]  # calls the single recovery held
    scene_after_op: JSON | None  # rewind/fork: the target's scene right after the command
    points: list[Point]
    problems: list[tuple[str, str]] = field(default_factory=list)


@dataclass
class Result:
    start: Start
    point: Point
    problems: list[tuple[str, str]] = field(default_factory=list)
    allowed: Counter[str] = field(default_factory=Counter)


def _call_of(task: TaskDir, result: JSON) -> tuple[JSON, JSON]:
    """The intent record and the tool_use block of the call a result record answers."""
    found = records(task)
    intent = next(r for r in found if r.get("k") == "intent" and r["call_id"] == result["call_id"])
    block = next(
        b
        for r in found
        if r.get("k") == "turn"
        for b in r["message"]["content"]
        if b.get("type") == "tool_use" and b["id"] == result["call_id"]
    )
    return intent, block


def undo_effect(task: TaskDir, result: JSON) -> bool:
    """Take back the effect of the dangling call that ``result`` (the record a kill kept
    from being written) answers, as if the kill had come before the effect. False for a
    call whose effect is not undone here (a read, or write_file: re-run either way)."""
    intent, block = _call_of(task, result)
    workspace = task.workspace_for(task.load_spec())
    if block["name"] == "append_file":
        path = workspace / block["input"]["path"]
        body = path.read_text()
        line = block["input"]["content"]
        cut = body.rindex(line)
        path.write_text(body[:cut] + body[cut + len(line) :])
        return True
    if block["name"] == "outbox_send":
        (workspace / "outbox" / f"{intent['key']}.json").unlink()
        return True
    return False


def recovery_starts(setup: Setup, root: Path) -> list[Start]:
    """The task stopped before each journal append, effect-undone and torn variants."""
    starts: list[Start] = []
    for i, state in sorted(setup.states.items()):
        record = setup.records[i]
        kind = str(record.get("k"))
        if kind == "intent":
            kind += f" of {record['tool']}"
        elif kind == "result":
            kind += f" of {_call_of(state, record)[1]['name']}"
        starts.append(Start("recovery", f"before record {i} ({kind})", state, kind=kind))
        if record.get("k") == "result":
            undone = clone_task(state, root / f"undone-{i}")
            if undo_effect(undone, record):
                name = f"before record {i} ({kind}), effect undone"
                starts.append(Start("recovery", name, undone, kind=f"{kind}, undone"))
        if i % 3 == 0 or i == len(setup.frames) - 2:
            torn = clone_task(state, root / f"torn-{i}")
            with open(torn.journal, "ab") as f:
                f.write(setup.frames[i][: len(setup.frames[i]) // 2])
            name = f"before record {i} ({kind}), half of it torn"
            starts.append(Start("recovery", name, torn, kind=f"{kind}, torn"))
    return starts


def held_starts(setup: Setup, root: Path, quick: bool) -> tuple[list[Start], list[tuple[str, str]]]:
    """Held append_file calls, decided (``decision``) and to be decided (``approve``); and
    the problems of making them (a dangling unsafe call that did not hold)."""
    starts: list[Start] = []
    problems: list[tuple[str, str]] = []
    for i, state in sorted(setup.states.items()):
        record = setup.records[i]
        if record.get("k") != "result":
            continue
        _, block = _call_of(state, record)
        if block["name"] != "append_file":
            continue
        line = block["input"]["content"]
        supplied = f"appended {len(line.encode())} bytes to {block['input']['path']}"
        supplied += " (checked by the operator)"
        for effect in ("done", "undone"):
            held = clone_task(state, root / f"held-{i}-{effect}")
            if effect == "undone":
                undo_effect(held, record)
            first = run_worker(held)
            if first.code != ExitCode.HELD:
                problems.append((HOLDS_LOST, f"record {i} {effect}: exit {first.code}"))
                continue
            TaskRecord(state=TaskStatus.HELD, reason="dangling append_file").save(
                held
            )  # as the daemon
            forms = {"done": ["result", "skip"], "undone": ["rerun"]}[effect]
            for form in forms:
                decided = clone_task(held, root / f"decided-{i}-{form}")
                _decide(decided, record["call_id"], form, supplied)
                starts.append(Start("decision", f"record {i} held, {form}", decided))
                flags = {
                    "rerun": ("--rerun",),
                    "skip": ("--skip", "--reason", "checked: cannot tell"),
                    "result": ("--result", supplied),
                }[form]
                args = ("approve-dangling", held.id, record["call_id"], *flags)
                starts.append(Start("approve", f"record {i} held, {form}", held, args))
        if quick:
            break
    return starts, problems


def _decide(task: TaskDir, call_id: str, form: str, supplied: str) -> None:
    if form == "result":
        decide(task, call_id, action="result", result=supplied)
    elif form == "skip":
        decide(task, call_id, action="skip", reason="checked: cannot tell")
    else:
        decide(task, call_id, action="rerun")


def history_starts(setup: Setup, root: Path) -> list[Start]:
    """The finished task, recorded ``done`` as the daemon leaves it, rewound and forked."""
    task = clone_task(setup.finished, root / "done")
    TaskRecord(state=TaskStatus.DONE, reason="end_turn").save(task)
    rewind = ("rewind", task.id, "--to", str(REWIND_TO), "--yes")
    fork = ("fork", task.id, "--at", str(FORK_AT), "--name", FORK_NAME)
    return [
        Start("rewind", f"rewind to {REWIND_TO}", task, rewind),
        Start("fork", f"fork at {FORK_AT}", task, fork),
    ]


# -- state fingerprints ---------------------------------------------------------------------


def _norm(content: Any) -> Any:
    """A tool result as it may legitimately differ between two recoveries, made equal."""
    if isinstance(content, str):
        return _WORDING.sub(lambda m: ")" if m.group(0).startswith(",") else "", content)
    return content


def workspace_files(task: TaskDir) -> dict[str, str]:
    """Every file of the task's workspace (temp files of a killed write left out)."""
    workspace = task.workspace_for(task.load_spec())
    return {
        str(p.relative_to(workspace)): p.read_text(errors="replace")
        for p in sorted(workspace.rglob("*"))
        if p.is_file() and not p.name.endswith(".tmp")
    }


def scene(task: TaskDir) -> JSON:
    """The live scene of a task (turn and transcript), read-only."""
    state = load_state(task)
    return {"turn": state.turn, "messages": state.messages, "ended": state.ended}


def fingerprint(task: TaskDir) -> JSON:
    """Everything that must be equal after single and double recovery."""
    state = final_state(task)
    messages = json.loads(json.dumps(state.messages))
    for message in messages:
        for block in message["content"]:
            if block.get("type") == "tool_result":
                block["content"] = _norm(block["content"])
    calls = {
        cid: {
            "tool": c.tool,
            "input": c.input,
            "turn": c.turn,
            "effect": c.effect,
            "key": c.key,
            "result": None
            if c.result is None
            else {
                "content": _norm(c.result.get("content")),
                "error": bool(c.result.get("is_error")),
            },
        }
        for cid, c in state.calls.items()
    }
    return {
        "messages": messages,
        "turn": state.turn,
        "usage": state.usage.to_json(),
        "usage_total": state.usage_total.to_json(),
        "stop_reason": state.stop_reason,
        "ended": state.ended,
        "epoch": state.epoch,
        "calls": calls,
        "turns": [[t.turn, t.stop_reason, t.usage.to_json(), t.rewound] for t in state.turns],
        "workspace": workspace_files(task),
    }


def _difference(a: JSON, b: JSON) -> str:
    keys = [k for k in a if a[k] != b.get(k)]
    if not keys:
        return ""
    k = keys[0]
    if isinstance(a[k], dict):
        sub = [s for s in set(a[k]) | set(b[k]) if a[k].get(s) != b[k].get(s)]
        return f"{', '.join(keys)}; {k}[{sub[0]!r}]: {a[k].get(sub[0])!r} vs {b[k].get(sub[0])!r}"
    return f"{', '.join(keys)}: {str(a[k])[:120]} vs {str(b[k])[:120]}"


# -- checks of one journal ----------------------------------------------------------------


def journal_problems(found: Sequence[JSON]) -> list[tuple[str, str]]:
    """Records written twice, unsafe attempts without a decision, decisions applied twice."""
    problems: list[tuple[str, str]] = []
    seen: Counter[tuple[Any, ...]] = Counter()
    branch = 0
    reruns: set[tuple[str, int]] = set()
    for record in found:
        kind = record.get("k")
        if kind == "rewind":
            branch += 1
        elif kind == "turn":
            seen[("turn", branch, record["turn"])] += 1
        elif kind in ("intent", "decision"):  # a rewound call id may come again: per branch
            seen[(kind, branch, record["call_id"], record.get("attempt"))] += 1
        elif kind == "result":
            seen[("result", branch, record["call_id"])] += 1
        if kind == "decision" and record.get("action") == "rerun":
            reruns.add((record["call_id"], int(record["attempt"]) + 1))
        if kind == "intent" and record.get("effect") == "unsafe":
            attempt = int(record.get("attempt", 1))
            if attempt > 1 and (record["call_id"], attempt) not in reruns:
                problems.append((UNSAFE_RERUN, f"{record['call_id']} attempt {attempt}"))
    for key, n in seen.items():
        if n > 1:
            kind = DECIDED_TWICE if key[0] == "decision" else DUPLICATED
            problems.append((kind, f"{key} recorded {n} times"))
    return problems


def decision_problems(task: TaskDir, found: Sequence[JSON]) -> list[tuple[str, str]]:
    """Every decision file must have been applied: one decision record that matches it."""
    problems = []
    applied = {
        (r["call_id"], r.get("attempt"), r.get("action")) for r in found if r.get("k") == "decision"
    }
    folder = task.decisions
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            problems.append((DECISIONS_LOST, f"{path.name} unreadable: {exc}"))
            continue
        if (data.get("call_id"), data.get("attempt"), data.get("action")) not in applied:
            problems.append((DECISIONS_LOST, f"{path.name} ({data.get('action')}) never applied"))
    return problems


def _held(found: Sequence[JSON]) -> set[str]:
    return {c["call_id"] for r in found if r.get("k") == "hold" for c in r["calls"]}


def end_problems(
    start: Start, task: TaskDir, plan: Plan, before: Sequence[JSON]
) -> list[tuple[str, str]]:
    """The checks of ``common.check_task`` on a task at its end, and of its journal. A
    rewound task and a fork (which starts from a copy of the parent's files) do some
    effects again on purpose: there only the comparison with the single recovery counts."""
    mapping = {
        "records lost or changed": LOST,
        "journal unreadable after the fault": LOST,
        "tool_use not paired": UNPAIRED,
        "task not completed": NOT_DONE,
    }
    if start.sub not in ("rewind", "fork"):
        mapping["unsafe effect repeated"] = UNSAFE_TWICE
        mapping["keyed effect repeated"] = KEYED_TWICE
    found = [
        (mapping[kind], detail)
        for kind, detail in check_task(task, plan, before, exact=False)
        if kind in mapping
    ]
    return found + journal_problems(records(task))


# -- running a start ------------------------------------------------------------------------


def _operate(start: Start, task: TaskDir, prefix: Sequence[str] = ()) -> Exit:
    """Run the start's operation on the copy ``task`` (behind ``prefix``)."""
    if not start.args:
        return run_worker(task, prefix=prefix)
    return run_cli(task.root, *start.args, prefix=prefix)


def _recovery_points(log: Path, base: Path) -> list[Point]:
    """The kill points of a traced run up to its first new model turn: every durable
    syscall below ``base`` but the heartbeat's (crash_points visits those)."""
    points = []
    for call in parse_log(log):
        if call.name == "write" and TURN_WRITE in call.text:
            break
        if is_point(call, base, False) and "heartbeat.json" not in where(call, base):
            points.append(Point(call.name, call.index, where(call, base)))
    return points


def baseline(start: Start, plan: Plan, root: Path) -> Baseline:
    """The single recovery, traced: its end and the kill points of its operation."""
    task = clone_task(start.task, root)
    log = root / "clean.strace"
    first = _operate(start, task, strace_prefix(log, ALL_CLASSES))
    base = task.path if not start.args else task.root
    points = _recovery_points(log, base)
    problems: list[tuple[str, str]] = []
    after_op: JSON | None = None
    target = TaskDir(task.root, start.target)
    if start.args:
        if first.code != 0:
            raise RuntimeError(f"{start.sub}: the clean `agentd {start.args[0]}` failed: {first}")
        after_op = scene(target)
        resumed = drive(target)
    else:
        resumed = drive(target, first=first)
    if resumed.code != ExitCode.DONE:
        problems.append((NOT_DONE, f"single recovery of {start.name}: {resumed.exits[-1:]}"))
    problems += end_problems(start, target, plan, [])
    held = _held(records(target))
    return Baseline(start, fingerprint(target), held, after_op, points, problems)


def _case(plan: Plan, base: Baseline, root: Path, point: Point) -> Result:
    start = base.start
    result = Result(start, point)
    task = clone_task(start.task, root)
    parent = _parent_bytes(task)
    old = scene(task) if start.sub == "rewind" else None
    log = root / "fault.strace"
    target = TaskDir(task.root, start.target)
    killed, on_target = kill_at(
        point,
        task.path if not start.args else task.root,
        log,
        lambda prefix: _operate(start, task, prefix),
    )
    if not on_target:
        result.problems.append((MISSED, f"exit {killed.code}: {killed.stderr.strip()[-160:]}"))
        return result
    try:  # a fork without its spec is no task yet: its records were never recorded
        before = records(target) if target.exists() else []
    except (OSError, AgentdError) as exc:
        result.problems.append((LOST, f"journal unreadable after the kill: {exc}"))
        return result
    if start.args and not _after_command(start, base, task, target, old, parent, result):
        return result
    resumed = drive(target)
    result.allowed["worker runs to the end"] += len(resumed.exits)
    result.allowed["holds decided by the operator"] += resumed.decisions
    found = records(target)
    result.problems += end_problems(start, target, plan, before)
    result.problems += decision_problems(target, found)
    lost_holds = base.held - _held(found)
    if lost_holds:
        result.problems.append((HOLDS_LOST, f"{sorted(lost_holds)} never held"))
    end = fingerprint(target)
    if end != base.end:
        result.problems.append((DIFFERS, _difference(base.end, end)))
        lines = [
            line
            for line in end["workspace"].get("log.txt", "").splitlines()
            if end["workspace"]["log.txt"].count(line)
            > base.end["workspace"].get("log.txt", "").count(line)
        ]
        if lines:
            result.problems.append((UNSAFE_TWICE, f"{lines[0]!r} appended more often"))
    attempts = Counter(r["call_id"] for r in found if r.get("k") == "intent")
    result.allowed["re-runs"] += sum(n - 1 for n in attempts.values() if n > 1)
    return result


def _after_command(
    start: Start,
    base: Baseline,
    task: TaskDir,
    target: TaskDir,
    old: JSON | None,
    parent: tuple[bytes, bytes],
    result: Result,
) -> bool:
    """What an operator sees after a killed command, and what they do about it: True when
    the task can be driven on."""
    if start.sub == "rewind":
        now = scene(task)
        if now == old:
            result.allowed["commands repeated"] += 1
            again = run_cli(task.root, *start.args)
            if again.code != 0:
                result.problems.append((MIXED, f"the repeated rewind failed: {again.stderr}"))
                return False
        elif now != base.scene_after_op:
            result.problems.append((MIXED, f"scene at turn {now['turn']} is neither"))
            return False
        elif TaskRecord.load(task).state in FINAL_STATES:
            result.problems.append((LEFT_DONE, f"record {TaskRecord.load(task).state}"))
        return True
    if start.sub == "fork":
        if _parent_bytes(task) != parent:
            result.problems.append((PARENT_CHANGED, "the parent's journal or record changed"))
        if not target.exists():
            result.allowed["commands repeated"] += 1
            again = run_cli(task.root, *start.args)
            if again.code != 0:
                result.problems.append((MIXED, f"the repeated fork failed: {again.stderr}"))
                return False
        else:
            try:
                now = scene(target)
            except (OSError, AgentdError, ValueError, KeyError) as exc:
                result.problems.append((MIXED, f"a fork that is not whole: {exc}"))
                return False
            if now != base.scene_after_op:
                result.problems.append((MIXED, f"fork scene at turn {now['turn']}"))
                return False
            try:
                assert_paired(load_state(target).messages)
            except AssertionError as exc:
                result.problems.append((UNPAIRED, str(exc)[:160]))
        return True
    # approve: the operator repeats the command; "already decided" (exit 3) means it took
    again = run_cli(task.root, *start.args)
    result.allowed["commands repeated"] += 1
    if again.code not in (0, 3) or (again.code == 3 and "already decided" not in again.stderr):
        result.problems.append((DECISIONS_LOST, f"the repeated approve: {again}"))
        return False
    if not pending_decisions(task):  # what the worker (and the daemon) go by
        result.problems.append((DECISIONS_LOST, "no usable decision after the approve"))
    return True


def _parent_bytes(task: TaskDir) -> tuple[bytes, bytes]:
    """A fork's parent as the fork must leave it: its journal and its task record."""
    return task.journal.read_bytes(), task.state.read_bytes()


# -- the campaign ---------------------------------------------------------------------------


def _sample(points: list[Point], rng: random.Random, quick: bool, limit: int) -> list[Point]:
    if not quick or len(points) <= limit:
        return points
    return sorted(rng.sample(points, limit), key=points.index)


#: Quick mode: kill points sampled per start, by sub-class.
QUICK_POINTS = {"recovery": 2, "decision": 3, "approve": 3, "rewind": 6, "fork": 6}


def run(quick: bool, seed: int | None = None) -> list[Figure]:
    require_strace()
    seed = random.randrange(2**32) if seed is None else seed
    rng = random.Random(seed)
    plan = mixed_plan(4 if quick else 5)
    with stopwatch() as elapsed, tempfile.TemporaryDirectory(prefix="agentd-compound-") as tmp:
        root = Path(tmp)
        probe = prepare(root / "probe", plan, set())
        setup = prepare(root / "setup", plan, set(range(1, len(probe.frames))))
        starts = recovery_starts(setup, root / "starts")
        if quick:  # every kind of state, not every state: the recovery work differs by kind
            starts = _one_per_kind(starts, rng)
        held, problems = held_starts(setup, root / "starts", quick)
        starts += held
        starts += history_starts(setup, root / "starts")
        bases = parallel(
            list(enumerate(starts)),
            lambda item: baseline(item[1], plan, root / f"base-{item[0]:03d}"),
        )
        cases = [
            (base, point)
            for base in bases
            for point in _sample(base.points, rng, quick, QUICK_POINTS[base.start.sub])
        ]
        results = parallel(
            list(enumerate(cases)),
            lambda item: _case(plan, item[1][0], root / f"case-{item[0]:04d}", item[1][1]),
        )
        seconds = elapsed()
    return _figures(seed, plan, bases, results, problems, seconds)


def _one_per_kind(starts: list[Start], rng: random.Random) -> list[Start]:
    """Quick mode: one start of each kind (the next record, its tool, the variant)."""
    kinds: dict[str, list[Start]] = {}
    for start in starts:
        kinds.setdefault(start.kind, []).append(start)
    return [rng.choice(group) for _, group in sorted(kinds.items())]


def _figures(
    seed: int,
    plan: Plan,
    bases: list[Baseline],
    results: list[Result],
    setup_problems: list[tuple[str, str]],
    seconds: float,
) -> list[Figure]:
    figures = [Figure(FAULT, "seed", seed), Figure(FAULT, "task turns", plan.turns)]
    for sub in SUBCLASSES:
        starts = [b for b in bases if b.start.sub == sub]
        trials = [r for r in results if r.start.sub == sub]
        figures.append(Figure(FAULT, f"{sub}: starts", len(starts)))
        figures.append(Figure(FAULT, f"{sub}: trials (kills)", len(trials), not trials))
    kinds: Counter[str] = Counter()  # cases (and starts) with each kind of problem
    for problems in [*(r.problems for r in results), *(b.problems for b in bases)]:
        kinds.update({kind for kind, _ in problems})
    kinds.update(kind for kind, _ in setup_problems)
    allowed: Counter[str] = Counter()
    for r in results:
        allowed.update(r.allowed)
    for name in ("re-runs", "holds decided by the operator", "commands repeated"):
        figures.append(Figure(FAULT, f"allowed: {name}", allowed[name]))
    figures.append(Figure(FAULT, "worker runs to the end", allowed["worker runs to the end"]))
    for kind in PROBLEMS:
        figures.append(Figure(FAULT, kind, kinds.get(kind, 0), violation=bool(kinds.get(kind))))
    bad: list[tuple[Start, Point | None, list[tuple[str, str]]]] = [
        (r.start, r.point, r.problems) for r in results if r.problems
    ]
    bad += [(b.start, None, b.problems) for b in bases if b.problems]
    if setup_problems:
        detail = "; ".join(f"{k}: {d}" for k, d in setup_problems[:3])
        figures.append(Figure(FAULT, "first failing start", detail[:400], violation=True))
    if bad:
        start, point, problems = bad[0]
        at = f" at {point.name}#{point.index} {point.where}" if point else ""
        detail = f"{start.sub} {start.name}{at}: " + "; ".join(f"{k}: {d}" for k, d in problems[:3])
        figures.append(Figure(FAULT, "first failing case", detail[:400], violation=True))
    figures.append(Figure(FAULT, "runtime s", round(seconds, 1)))
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.chaos.compound", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--full", action="store_true", help="every point of every start")
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args(argv)
    figures = run(quick=not args.full, seed=args.seed)
    print(format_figures(figures), flush=True)
    return 1 if violations(figures) else 0


if __name__ == "__main__":
    sys.exit(main())
