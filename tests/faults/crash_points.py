"""Enumerated crash points: SIGKILL at the i-th durable syscall of a task, for every i.

A clean run of the task under strace lists the syscalls of the worker's main thread that
touch the task folder (journal, workspace, snapshot, exit and heartbeat files). Each one
is a crash point: a fresh copy of the task is run under
``strace -e inject=NAME:signal=KILL:when=N``, which kills the worker on entry to that
call (before it takes effect), so every state between two durable steps is visited. After
each kill the task is resumed without strace until it ends, holds decided by a careful
operator who checks the workspace for the held call's effect, and the invariants are
checked: the journal is readable, no record that was recorded is lost or changed, every
tool_use is paired, no unsafe or keyed effect happened twice, every effect happened once,
and the task is done after all its turns.

Quick mode: a 3-turn task, the write/fdatasync/fsync/rename/link points and the openat
calls that create or write a file, outside the heartbeat file (about 45). Full mode: a
6-turn task and every point of every class (pwrite64, ftruncate, mkdir and unlink too,
heartbeat included). Both add a kill on entry to each background fdatasync of the journal
(its own thread, which strace counts apart: ``tests.faults.sync_shim`` kills there), and
the points of a removal (``tests.faults.prune_points``: ``agentd prune`` killed at its
renames, unlinks and syncs; quick mode the first and last of each).
"""

from __future__ import annotations

import re
import tempfile
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tests.faults import prune_points
from tests.faults.common import (
    PROBLEMS,
    UNREADABLE,
    Exit,
    Plan,
    Syscall,
    background_syncs,
    check_task,
    clone_task,
    drive,
    make_task,
    mixed_plan,
    parallel,
    parse_log,
    parse_shim_log,
    records,
    require_strace,
    run_shimmed,
    run_worker,
    stopwatch,
    strace_prefix,
)
from tests.faults.report import Figure
from worker.errors import AgentdError
from worker.protocol import ExitCode
from worker.spool import TaskDir

FAULT = "crash points"
QUICK_CLASSES = ("write", "fdatasync", "fsync", "rename", "link", "openat")
ALL_CLASSES = (*QUICK_CLASSES, "pwrite64", "ftruncate", "mkdir", "unlink")
BACKGROUND = "fdatasync (background)"  # the journal's sync thread, through sync_shim
#: Names made fresh each run, folded so that a point is the same call in every run: temp
#: files, doorbells, and the folder a task is built in before it moves into place.
_TMP_NAME = re.compile(r"\.\d+\.[0-9a-f]{12}\.tmp|(?<=/inbox/)[^/]+$|(?<=/tmp/)\.submit-[^/]+")


@dataclass(frozen=True)
class Point:
    name: str
    index: int
    where: str  # the call's first path, relative to the task folder


@dataclass(frozen=True)
class Result:
    point: Point
    on_target: bool
    problems: list[tuple[str, str]]
    decisions: int
    resumes: int


def where(call: Syscall, base: Path) -> str:
    """The first path of ``call`` inside ``base``, relative to it (temp names folded)."""
    prefix = str(base)
    for path in call.paths:
        if path == prefix or path.startswith(prefix + "/"):
            return _TMP_NAME.sub(".TMP", path[len(prefix) :] or "/")
    return "?"


def is_point(call: Syscall, base: Path, quick: bool) -> bool:
    """Whether ``call`` is a crash point: a durable step on a file below ``base`` (in quick
    mode only the QUICK_CLASSES, and never the heartbeat file)."""
    if not call.touches(str(base)) or call.name not in ALL_CLASSES:
        return False
    if call.name == "openat" and not any(f in call.text for f in ("O_CREAT", "O_WRONLY", "O_RDWR")):
        return False
    heartbeat = "heartbeat.json" in where(call, base)
    return not (quick and (heartbeat or call.name not in QUICK_CLASSES))


def crash_points(pristine: TaskDir, root: Path, quick: bool) -> list[Point]:
    """Every crash point of a clean run of (a copy of) ``pristine``."""
    task = clone_task(pristine, root / "clean")
    log = root / "clean.strace"
    done = run_worker(task, prefix=strace_prefix(log, ALL_CLASSES))
    if done.code != ExitCode.DONE:
        raise RuntimeError(f"the clean run of the crash-point task failed: {done}")
    points = [
        Point(c.name, c.index, where(c, task.path))
        for c in parse_log(log)
        if is_point(c, task.path, quick)
    ]
    background = background_syncs(pristine, root / "clean-shim")
    return points + [Point(BACKGROUND, k, "/journal") for k in range(1, background + 1)]


def kill_at(
    point: Point, base: Path, log: Path, run: Callable[[list[str]], Exit]
) -> tuple[Exit, bool]:
    """``run(prefix)`` (a process behind the strace ``prefix``) killed with SIGKILL on entry
    to the syscall ``point`` (paths relative to ``base``): its exit, and whether the kill
    landed on that very call."""
    inject = f"{point.name}:signal=KILL:when={point.index}"
    killed = run(strace_prefix(log, ALL_CLASSES, inject=[inject]))
    calls = parse_log(log)
    last = calls[-1] if calls else None
    on_target = (
        killed.code == -9
        and last is not None
        and last.name == point.name
        and last.ret == "?"
        and where(last, base) == point.where
    )
    return killed, on_target


def _case(pristine: TaskDir, plan: Plan, root: Path, point: Point, n: int) -> Result:
    case_root = root / f"p{n:04d}"
    task = clone_task(pristine, case_root)
    log = case_root / "fault.log"
    if point.name == BACKGROUND:
        killed = run_shimmed(task, f"{point.index}:KILL", log)
        syncs = [c for c in parse_shim_log(log) if c.thread == "journal-sync"]
        on_target = killed.code == -9 and len(syncs) == point.index - 1
    else:
        killed, on_target = kill_at(
            point, task.path, log, lambda prefix: run_worker(task, prefix=prefix)
        )
    try:
        before = records(task)
    except (OSError, AgentdError) as exc:
        return Result(point, on_target, [(UNREADABLE, str(exc))], 0, 0)
    resumed = drive(task)
    problems = check_task(task, plan, before)
    if resumed.code != ExitCode.DONE:
        problems.append(("task not completed", f"last exit {resumed.exits[-1:]}"))
    return Result(point, on_target, problems, resumed.decisions, len(resumed.exits))


def run(quick: bool) -> list[Figure]:
    require_strace()
    plan = mixed_plan(3 if quick else 6)
    with stopwatch() as elapsed, tempfile.TemporaryDirectory(prefix="agentd-crash-") as tmp:
        root = Path(tmp)
        pristine = make_task(root / "pristine", plan)
        points = crash_points(pristine, root, quick)
        results = parallel(
            list(enumerate(points)), lambda item: _case(pristine, plan, root, item[1], item[0])
        )
        seconds = elapsed()
    figures = [Figure(FAULT, "task turns", plan.turns)]
    by_class = Counter(p.name for p in points)
    figures.append(Figure(FAULT, "points covered", len(points), violation=not points))
    for name in (*ALL_CLASSES, BACKGROUND):
        if by_class.get(name):
            figures.append(Figure(FAULT, f"points: {name}", by_class[name]))
    heartbeat = sum(1 for p in points if "heartbeat" in p.where)
    figures.append(Figure(FAULT, "points on the heartbeat file", heartbeat))
    off = [r.point for r in results if not r.on_target]
    figures.append(Figure(FAULT, "kills that missed their point", len(off), violation=bool(off)))
    figures.append(
        Figure(FAULT, "holds decided by the operator", sum(r.decisions for r in results))
    )
    figures.append(Figure(FAULT, "worker runs to resume", sum(r.resumes for r in results)))
    kinds = Counter(kind for r in results for kind, _ in r.problems)
    for kind in (*PROBLEMS, *(k for k in kinds if k not in PROBLEMS)):
        figures.append(Figure(FAULT, kind, kinds.get(kind, 0), violation=bool(kinds.get(kind))))
    bad = [r for r in results if r.problems] + [r for r in results if not r.on_target]
    if bad:
        r = bad[0]
        detail = f"{r.point.name}#{r.point.index} {r.point.where}: " + (
            "; ".join(d for _, d in r.problems[:3]) or "the kill missed its point"
        )
        figures.append(Figure(FAULT, "first failing point", detail, violation=True))
    # a removal killed at each of its steps (docs/design.md section 20)
    with stopwatch() as removals:
        figures += prune_points.figures(quick)
    figures.append(Figure(FAULT, "runtime s", round(seconds + removals(), 1)))
    return figures
