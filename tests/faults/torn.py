"""Torn and corrupted journals, given to the real worker.

The states: a task stopped (in-process, as a kill leaves it) right before its i-th journal
append, its workspace holding exactly the effects of the records before. Then:

* truncation: the i-th record of a clean run appended up to every byte offset inside it
  (a torn append). The worker must cut exactly the torn bytes, keep every earlier record
  byte for byte, accept no part of the torn one, and finish the task (holds decided by a
  careful operator) with every invariant of ``common.check_task``;
* tail flips: the i-th record appended whole with one bit flipped: the same verdict
  (the checksum makes it a torn tail);
* middle flips: a bit flipped in any record but the last of a finished journal: the
  worker must refuse (exit 3) with one line that says so, and change no byte of the
  journal; it never skips the damage;
* blank journals (``tests.faults.blank``), on every backend: empty, zeroed, header-only
  and header-cut, with the task's progress recorded (refused: damage) and without (a
  fresh task).

Quick mode: the ``end`` record at every offset, the result of an ``append_file`` call at
its header bytes and every 16th byte after, and 32 flips. Full mode: every record
at every offset, and hundreds of flips.
"""

from __future__ import annotations

import os
import random
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from tests.faults import blank
from tests.faults.common import (
    JSON,
    PROBLEMS,
    Plan,
    check_task,
    clone_task,
    drive,
    make_task,
    mixed_plan,
    parallel,
    records,
    run_worker,
    stop_before_record,
    stopwatch,
)
from tests.faults.report import Figure
from worker.errors import AgentdError
from worker.protocol import ExitCode
from worker.spool import TaskDir
from worker.store.durable import open_private
from worker.store.journal import FRAMINGS, JOURNAL_VERSION, read_file, scan

FAULT = "torn journals"
HEAD = FRAMINGS[JOURNAL_VERSION].head.size  # a frame header: length, checksum, durable mark


@dataclass(frozen=True)
class Case:
    kind: str  # "cut", "tail flip", "middle flip"
    record: int  # the damaged record's index
    offset: int  # cut: bytes of the record kept; flip: the byte flipped
    bit: int = 0


@dataclass
class Result:
    case: Case
    code: int
    issues: list[tuple[str, str]] = field(default_factory=list)
    problems: list[tuple[str, str]] = field(default_factory=list)


@dataclass
class Setup:
    plan: Plan
    frames: list[bytes]  # the clean run's frames
    records: list[JSON]  # and the record each one holds
    states: dict[int, TaskDir]  # record index -> the task stopped before that record
    finished: TaskDir  # the clean run, done


def prepare(root: Path, plan: Plan, tails: set[int]) -> Setup:
    """``plan`` run cleanly (in-process) and cut into its frames, and a copy of the task
    stopped right before each record of ``tails``, as a kill there leaves it."""
    pristine = make_task(root / "pristine", plan)
    finished = clone_task(pristine, root / "finished")
    stop_before_record(finished, 10**6)  # never stops: runs to the end in-process
    data = finished.journal.read_bytes()
    frames, found, pos = [], [], 0
    for record, end in scan(data).records:
        frames.append(data[pos:end])
        found.append(record)
        pos = end
    states = {}
    for i in sorted(tails):
        state = clone_task(pristine, root / f"state-{i}")
        stop_before_record(state, i)
        if len(records(state)) != i:
            raise RuntimeError(f"stopping before record {i} left {len(records(state))} records")
        states[i] = state
    return Setup(plan, frames, found, states, finished)


def _tail_case(setup: Setup, root: Path, case: Case, n: int) -> Result:
    task = clone_task(setup.states[case.record], root / f"c{n:05d}")
    # (stopped before record 0, the header, a task has no journal yet: the torn header is
    # the first bytes of a journal its worker made, private as it makes it)
    good = task.journal.read_bytes() if task.journal.exists() else b""
    before = records(task)
    frame = setup.frames[case.record]
    if case.kind == "cut":
        damage = frame[: case.offset]
    else:
        flipped = bytearray(frame)
        flipped[case.offset] ^= 1 << case.bit
        damage = bytes(flipped)
    with open(open_private(task.journal, os.O_WRONLY | os.O_APPEND | os.O_CREAT), "ab") as f:
        f.write(damage)
    first = run_worker(task)
    result = Result(case, first.code)
    if "Traceback" in first.stderr:
        result.issues.append(("traceback printed", first.stderr.strip()[-200:]))
    if first.code not in (ExitCode.DONE, ExitCode.HELD):
        result.issues.append(("worker refused a torn tail", f"exit {first.code}: {first.stderr}"))
    after = task.journal.read_bytes()
    if after[: len(good)] != good:
        result.issues.append(("earlier records lost", f"{len(good)} good bytes changed"))
    try:
        found = read_file(task.journal)
    except (OSError, AgentdError) as exc:
        result.issues.append(("partial records accepted", f"the journal is now damaged: {exc}"))
        return result
    if found.torn:
        result.issues.append(("partial records accepted", "the torn bytes were left in place"))
    resumed = drive(task, first=first)
    result.problems = check_task(task, setup.plan, before)
    if resumed.code != ExitCode.DONE:
        result.problems.append(("task not completed", f"{resumed.exits[-1:]}"))
    return result


def _middle_case(setup: Setup, root: Path, case: Case, n: int) -> Result:
    task = clone_task(setup.finished, root / f"c{n:05d}")
    data = bytearray(task.journal.read_bytes())
    start = sum(len(f) for f in setup.frames[: case.record])
    data[start + case.offset] ^= 1 << case.bit
    task.journal.write_bytes(bytes(data))
    done = run_worker(task)
    result = Result(case, done.code)
    if task.journal.read_bytes() != bytes(data):
        result.issues.append(("journal changed by a refusal", f"record {case.record}"))
    if done.code == ExitCode.FAILED:
        if len(done.lines) != 1 or "damaged" not in done.stderr or "Traceback" in done.stderr:
            result.issues.append(("refusal without a one-line reason", done.stderr[-300:]))
    else:
        result.issues.append(("middle damage skipped", f"exit {done.code}: {done.stderr[-200:]}"))
    return result


def _cases(setup: Setup, quick: bool, rng: random.Random) -> list[Case]:
    last = len(setup.frames) - 1
    cases: list[Case] = []
    for i in sorted(setup.states):
        size = len(setup.frames[i])
        if quick and i != last:
            offsets = [*range(1, HEAD + 1), *range(HEAD + 16, size, 16)]
        else:
            offsets = list(range(1, size))
        cases += [Case("cut", i, k) for k in offsets]
    tails = sorted(setup.states)
    for _ in range(16 if quick else 400):
        i = rng.choice(tails)
        cases.append(Case("tail flip", i, rng.randrange(len(setup.frames[i])), rng.randrange(8)))
    for _ in range(16 if quick else 400):
        j = rng.randrange(last)
        cases.append(Case("middle flip", j, rng.randrange(len(setup.frames[j])), rng.randrange(8)))
    return cases


def run(quick: bool, seed: int | None = None) -> list[Figure]:
    seed = random.randrange(2**32) if seed is None else seed
    rng = random.Random(seed)
    plan = mixed_plan(3 if quick else 4)
    with stopwatch() as elapsed, tempfile.TemporaryDirectory(prefix="agentd-torn-") as tmp:
        root = Path(tmp)
        probe = prepare(root / "probe", plan, set())
        kinds = [r.get("k") for r in records(probe.finished)]
        last = len(kinds) - 1
        unsafe_result = _unsafe_result_index(probe.finished)
        tails = {last, unsafe_result} if quick else set(range(len(kinds)))
        setup = prepare(root / "setup", plan, tails)
        cases = _cases(setup, quick, rng)
        results = parallel(
            list(enumerate(cases)),
            lambda item: (_middle_case if item[1].kind == "middle flip" else _tail_case)(
                setup, root, item[1], item[0]
            ),
        )
        lost = blank.run(plan, root / "blank")  # every backend's blank journals
        seconds = elapsed()
    return _figures(cases, results, seconds, seed, len(kinds), lost)


def _unsafe_result_index(task: TaskDir) -> int:
    """The index of the result record of the first append_file call."""
    found = records(task)
    calls = {
        b["id"]
        for r in found
        if r.get("k") == "turn"
        for b in r["message"]["content"]
        if b.get("type") == "tool_use" and b.get("name") == "append_file"
    }
    return next(i for i, r in enumerate(found) if r.get("k") == "result" and r["call_id"] in calls)


def _figures(
    cases: list[Case],
    results: list[Result],
    seconds: float,
    seed: int,
    n_records: int,
    blanks: list[Figure],
) -> list[Figure]:
    count = Counter(c.kind for c in cases)
    issues = Counter(kind for r in results for kind, _ in r.issues)
    problems = Counter(kind for r in results for kind, _ in r.problems)
    middle = [r for r in results if r.case.kind == "middle flip"]
    figures = [
        Figure(FAULT, "seed", seed),
        Figure(FAULT, "journal records", n_records),
        Figure(FAULT, "tail records cut", len({c.record for c in cases if c.kind == "cut"})),
        Figure(FAULT, "offsets tried", count["cut"], violation=not count["cut"]),
        Figure(FAULT, "tail bit flips", count["tail flip"]),
        Figure(FAULT, "middle bit flips", count["middle flip"]),
        Figure(FAULT, "middle flips refused", sum(r.code == ExitCode.FAILED for r in middle)),
    ]
    for kind in (
        "partial records accepted",
        "earlier records lost",
        "worker refused a torn tail",
        "traceback printed",
        "middle damage skipped",
        "journal changed by a refusal",
        "refusal without a one-line reason",
    ):
        figures.append(Figure(FAULT, kind, issues.get(kind, 0), violation=bool(issues.get(kind))))
    for kind in PROBLEMS:
        figures.append(
            Figure(
                FAULT, f"resume: {kind}", problems.get(kind, 0), violation=bool(problems.get(kind))
            )
        )
    bad = [r for r in results if r.issues or r.problems]
    if bad:
        r = bad[0]
        detail = f"{r.case}: " + "; ".join(f"{k}: {d}" for k, d in (r.issues + r.problems)[:2])
        figures.append(Figure(FAULT, "first failing case", detail[:300], violation=True))
    figures += blanks
    figures.append(Figure(FAULT, "runtime s", round(seconds, 1)))
    return figures
