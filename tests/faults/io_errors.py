"""I/O errors: ENOSPC and EIO on the worker's writes and syncs, once and for good.

Three kinds of injection, each on every matching call of a clean run (strace counts the
calls of the worker's main thread; ``when=N`` fails the N-th, ``when=N+`` it and every
later one):

* ``journal``: ``write`` and ``fdatasync`` of the journal only (``-P JOURNAL``, which
  strace honours for both counting and injection), so stderr and the other files keep
  working and the worker can say what happened;
* ``fsync``: every ``fsync`` of the worker (folders, workspace files, exit.json); the
  persistent form fails every later ``fsync`` and ``fdatasync`` too (a dead disk);
* ``write``: every other ``write`` into the task folder (workspace, outbox, exit and
  heartbeat files), once;
* ``background``: the journal's background fdatasync (its own thread, which makes a
  tool's result durable while the worker waits on the model). strace counts each thread
  apart, so ``tests.faults.sync_shim`` fails the k-th one inside the worker instead, and
  logs every sync for the same checks.

Each runs from two starting points: a fresh task (the journal is created under the fault)
and a task resumed after its first turn (recorded work exists before the fault). Then:
the worker exits 7 with one line naming the error, or goes on with the error in a tool
result (exit 0); it never prints a traceback; an fsync/fdatasync that failed is never
followed by another on the same open file, nor a failed journal append by any further
write to the journal (from the strace or shim log); every byte of the journal that was
recorded before the run is unchanged; in the persistent form a second run under the same
fault stops cleanly again (or has nothing left to write); and once the fault is gone the
task resumes to completion (holds decided by a careful operator) with every invariant of
``common.check_task``.
"""

from __future__ import annotations

import itertools
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from tests.faults.common import (
    PROBLEMS,
    UNREADABLE,
    Exit,
    Plan,
    appends_after_failure,
    background_syncs,
    check_task,
    clone_task,
    drive,
    final_state,
    fsync_retries,
    make_task,
    mixed_plan,
    parallel,
    parse_log,
    parse_shim_log,
    records,
    require_strace,
    run_shimmed,
    run_worker,
    shim_retries,
    stop_before_record,
    stopwatch,
    strace_prefix,
)
from tests.faults.report import Figure
from worker.protocol import ExitCode
from worker.spool import TaskDir

FAULT = "io errors"
ERRORS = ("ENOSPC", "EIO")
TRACE = ("write", "fdatasync", "fsync", "close", "openat", "rename", "ftruncate")
JOURNAL_TRACE = ("write", "fdatasync", "fsync", "close", "ftruncate")


@dataclass(frozen=True)
class Case:
    start: str  # "fresh" or "resumed"
    kind: str  # "journal", "fsync", "write"
    name: str  # the syscall
    index: int  # strace's when=N
    error: str
    persistent: bool
    syncs_before: int = 0  # fdatasync calls before this point (persistent fsync faults)
    where: str = ""

    @property
    def label(self) -> str:
        mode = "persistent" if self.persistent else "once"
        return f"{self.start} {self.kind} {self.name}#{self.index} {self.error} {mode} {self.where}"


@dataclass
class Result:
    case: Case
    code: int
    injected: bool
    issues: list[tuple[str, str]] = field(default_factory=list)
    problems: list[tuple[str, str]] = field(default_factory=list)


def _inject(case: Case) -> list[str]:
    plus = "+" if case.persistent else ""
    specs = [f"{case.name}:error={case.error}:when={case.index}{plus}"]
    if case.kind == "fsync" and case.persistent:
        specs.append(f"fdatasync:error={case.error}:when={case.syncs_before + 1}+")
    return specs


def _prefix(case: Case, task: TaskDir, log: Path, inject: list[str]) -> list[str]:
    if case.kind == "journal":
        return strace_prefix(log, JOURNAL_TRACE, inject=inject, paths=[task.journal])
    return strace_prefix(log, TRACE, inject=inject)


def _journal_bytes(task: TaskDir) -> bytes:
    try:
        return task.journal.read_bytes()
    except FileNotFoundError:
        return b""


def _clean_stop(done: Exit, case: Case) -> list[tuple[str, str]]:
    issues: list[tuple[str, str]] = []
    if "Traceback" in done.stderr:
        issues.append(("traceback printed", done.stderr.strip().splitlines()[-1][:200]))
    if done.code == ExitCode.STORAGE:
        if len(done.lines) != 1 or case.error not in done.lines[0]:
            issues.append(("stop without a one-line reason", repr(done.stderr[-300:])))
    elif done.code != ExitCode.DONE:
        issues.append(("unexpected exit code", f"{done.code}: {done.stderr.strip()[-200:]}"))
    if case.kind in ("journal", "background") and done.code != ExitCode.STORAGE:
        issues.append(("journal fault not stopping the worker", f"exit {done.code}"))
    return issues


def _case(starts: dict[str, TaskDir], plan: Plan, root: Path, case: Case, n: int) -> Result:
    case_root = root / f"c{n:04d}"
    task = clone_task(starts[case.start], case_root)
    old = _journal_bytes(task)
    done, injected, retries = _faulted_run(task, case, case_root / "fault.log")
    result = Result(case, done.code, injected, _clean_stop(done, case))
    for found in retries:
        result.issues.append(("fsync retried after it failed", found))
    after = _journal_bytes(task)
    if after[: len(old)] != old:
        result.issues.append(("recorded bytes changed", f"{len(old)} bytes before the run"))
    if case.persistent and done.code == ExitCode.STORAGE:
        again_case = Case(case.start, case.kind, case.name, 1, case.error, True)
        again, _, retries = _faulted_run(task, again_case, case_root / "fault2.log")
        # exit 0: the task had ended already, with nothing left to write
        ended = final_state(task).ended is not None
        if not (again.code == ExitCode.STORAGE or (again.code == ExitCode.DONE and ended)) or (
            len(again.lines) != 1
        ):
            result.issues.append(
                ("second run under the fault not stopped cleanly", f"exit {again.code}")
            )
        for found in retries:
            result.issues.append(("fsync retried after it failed", found))
        if _journal_bytes(task)[: len(after)] != after:
            result.issues.append(("recorded bytes changed", "by the second run under the fault"))
    try:
        before = records(task)
    except Exception as exc:
        result.problems.append((UNREADABLE, str(exc)))
        return result
    resumed = drive(task)
    result.problems += check_task(task, plan, before, exact=False)
    if resumed.code != ExitCode.DONE:
        result.problems.append(("task not completed", f"{resumed.exits[-1:]}"))
    return result


def _faulted_run(task: TaskDir, case: Case, log: Path) -> tuple[Exit, bool, list[str]]:
    """Run the worker under ``case``'s fault: its exit, whether the fault was injected,
    and any sync retried (or journal written) after a failed one."""
    if case.kind == "background":
        plus = "+" if case.persistent else ""
        done = run_shimmed(task, f"{case.index}{plus}:{case.error}", log)
        shim = parse_shim_log(log)
        return done, any(c.injected for c in shim), shim_retries(shim)
    done = run_worker(task, prefix=_prefix(case, task, log, _inject(case)))
    calls = parse_log(log)
    retries = fsync_retries(calls) + appends_after_failure(calls, task.journal)
    return done, any(c.injected for c in calls), retries


def _cases(
    start: str, task: TaskDir, root: Path, quick: bool, combos: itertools.cycle[tuple[str, bool]]
) -> list[Case]:
    """Every injection point of a clean run of (a copy of) ``task``."""
    clean = clone_task(task, root / f"clean-{start}")
    log = root / f"clean-{start}.strace"
    if run_worker(clean, prefix=strace_prefix(log, TRACE)).code != ExitCode.DONE:
        raise RuntimeError(f"the clean {start} run of the I/O-error task failed")
    calls = parse_log(log)
    base = str(clean.path)
    journal = str(clean.journal)

    def variants(kind: str, name: str, index: int, where: str, syncs: int = 0) -> list[Case]:
        options = [(e, p) for e in ERRORS for p in (False, True)]
        if kind == "write":
            options = [(e, False) for e in ERRORS]
        if quick:
            options = [next(combos)]
            while kind == "write" and options[0][1]:
                options = [next(combos)]
        return [Case(start, kind, name, index, e, p, syncs, where) for e, p in options]

    cases: list[Case] = []
    journal_counts: Counter[str] = Counter()
    syncs = 0
    for call in calls:
        where = call.paths[0][len(base) :] if call.paths and call.touches(base) else ""
        if call.name in ("write", "fdatasync") and journal in call.paths:
            journal_counts[call.name] += 1
            cases += variants("journal", call.name, journal_counts[call.name], where)
        elif call.name == "fsync" and call.touches(base):
            cases += variants("fsync", "fsync", call.index, where, syncs)
        elif call.name == "write" and call.touches(base):
            if quick and "heartbeat" in where:
                continue
            cases += variants("write", "write", call.index, where)
        if call.name == "fdatasync":
            syncs += 1
    for k in range(1, background_syncs(task, root / f"clean-{start}-shim") + 1):
        cases += variants("background", "fdatasync", k, "/journal")
    return cases


def run(quick: bool) -> list[Figure]:
    require_strace()
    plan = mixed_plan(3 if quick else 5)
    combos = itertools.cycle([(e, p) for p in (False, True) for e in ERRORS])
    with stopwatch() as elapsed, tempfile.TemporaryDirectory(prefix="agentd-io-") as tmp:
        root = Path(tmp)
        fresh = make_task(root / "fresh", plan)
        resumed = clone_task(fresh, root / "resumed")
        stop_before_record(resumed, 4)  # header, turn 1, a call's intent and result
        starts = {"fresh": fresh, "resumed": resumed}
        cases = _cases("resumed", resumed, root, quick, combos)
        fresh_cases = _cases("fresh", fresh, root, quick, combos)
        if quick:  # from a fresh task: the faults on creating the journal, every form
            fresh_cases = [
                Case("fresh", c.kind, c.name, c.index, e, p, c.syncs_before, c.where)
                for c in fresh_cases
                if c.kind == "journal" and c.index == 1
                for e in ERRORS
                for p in (False, True)
            ]
        cases += fresh_cases
        results = parallel(
            list(enumerate(cases)), lambda item: _case(starts, plan, root, item[1], item[0])
        )
        seconds = elapsed()
    return _figures(cases, results, seconds)


def _figures(cases: list[Case], results: list[Result], seconds: float) -> list[Figure]:
    figures = [Figure(FAULT, "cases", len(cases), violation=not cases)]
    kinds = Counter(f"{c.kind} {c.name}" for c in cases)
    for kind, n in sorted(kinds.items()):
        figures.append(Figure(FAULT, f"cases: {kind}", n))
    figures.append(Figure(FAULT, "cases: persistent", sum(c.persistent for c in cases)))
    figures.append(
        Figure(FAULT, "cases: from a fresh task", sum(c.start == "fresh" for c in cases))
    )
    missed = sum(not r.injected for r in results)
    figures.append(Figure(FAULT, "faults that missed their call", missed, violation=bool(missed)))
    figures.append(
        Figure(FAULT, "stopped cleanly (exit 7)", sum(r.code == ExitCode.STORAGE for r in results))
    )
    figures.append(
        Figure(
            FAULT, "went on, error in a tool result", sum(r.code == ExitCode.DONE for r in results)
        )
    )
    issue_kinds = (
        "traceback printed",
        "stop without a one-line reason",
        "unexpected exit code",
        "journal fault not stopping the worker",
        "fsync retried after it failed",
        "journal written after a failed append",
        "recorded bytes changed",
        "second run under the fault not stopped cleanly",
    )
    issues = Counter(kind for r in results for kind, _ in r.issues)
    problems = Counter(kind for r in results for kind, _ in r.problems)
    for kind in issue_kinds:
        figures.append(Figure(FAULT, kind, issues.get(kind, 0), violation=bool(issues.get(kind))))
    for kind in PROBLEMS:
        if kind == "effects missing or wrong":
            continue  # a tool whose write failed may legitimately leave no effect
        figures.append(
            Figure(
                FAULT, f"resume: {kind}", problems.get(kind, 0), violation=bool(problems.get(kind))
            )
        )
    bad = [r for r in results if r.issues or r.problems]
    if bad:
        r = bad[0]
        detail = f"{r.case.label}: " + "; ".join(
            f"{k}: {d}" for k, d in (r.issues + r.problems)[:2]
        )
        figures.append(Figure(FAULT, "first failing case", detail, violation=True))
    figures.append(Figure(FAULT, "runtime s", round(seconds, 1)))
    return figures
