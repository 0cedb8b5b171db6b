"""Blank journals, a part of class 4 (torn journals): a journal that lost its records, on
every backend (the spool's files, the memory store, PostgreSQL).

The kinds: *empty* (no byte, no row), *zeroed* (every byte zero), *header-only* (all but
its header gone) and *header-cut* (half a header left). Each with the task's progress
recorded (its worker ran every turn: the effects are in the workspace, and the task's
record or row says how far its journal went) and without (a task that never ran a turn).

* progress recorded: damage. The worker refuses the task with one line that names the
  journal, changes nothing in it, runs no effect again, and the read that the daemon,
  ``status`` and ``history`` make says the same (on the files, ``agentd history`` itself);
* no progress, files: a journal of an earlier release, whose create could leave it blank
  before its header was synced. Nothing in it was durable: it is a fresh task, which runs
  to done with every effect once;
* no progress, memory and PostgreSQL: empty and header-only are a fresh task. A zeroed or
  cut row is damage whatever is recorded (a row is written whole in one step and counted
  by the task's ``seq``), so those two kinds come with progress only.
"""

from __future__ import annotations

import contextlib
import io
import os
import tempfile
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from supervisor import cli
from tests.faults.common import (
    KEYED_TWICE,
    UNSAFE_TWICE,
    Plan,
    check_task,
    clone_task,
    drive,
    effect_problems,
    make_task,
    one_line,
    parallel,
    run_worker,
    stop_before_record,
)
from tests.faults.report import Figure
from worker.config import Config
from worker.errors import JournalCorruptError
from worker.loop import AgentLoop
from worker.models.scripted import ScriptedModel
from worker.protocol import ExitCode
from worker.spool import TaskDir, TaskSpec
from worker.store import replay
from worker.store.base import PROGRESS, TaskStore
from worker.store.files import FileStore
from worker.store.journal import JOURNAL_VERSION, encode
from worker.store.memory import MemoryStore
from worker.tools.registry import ToolRegistry

FAULT = "torn journals"
KINDS = ("empty", "zeroed", "header-only", "header-cut")
#: What a store that counts its rows can hold without progress recorded.
ROW_FRESH = ("empty", "header-only")

REFUSED, FRESH = "refused", "fresh task"
RAN_AGAIN = "blank: an effect ran again"
NOT_REFUSED = "blank: damage not refused"
NO_LINE = "blank: refusal without a one-line reason"
CHANGED = "blank: journal changed by a refusal"
DISAGREES = "blank: history disagrees with the worker"
NOT_DONE = "blank: fresh task not completed"
RAISED = "blank: an error instead of a verdict"
ISSUES = (RAN_AGAIN, NOT_REFUSED, NO_LINE, CHANGED, DISAGREES, NOT_DONE, RAISED)


@dataclass(frozen=True)
class Case:
    backend: str  # files, memory, postgres
    kind: str
    progress: bool

    @property
    def expected(self) -> str:
        return REFUSED if self.progress else FRESH

    def __str__(self) -> str:
        return f"{self.backend} {self.kind} {'with' if self.progress else 'without'} progress"


@dataclass
class Result:
    case: Case
    verdict: str = ""
    issues: list[tuple[str, str]] = field(default_factory=list)


def cases(backends: list[str]) -> list[Case]:
    return [
        Case(backend, kind, progress)
        for backend in backends
        for kind in KINDS
        for progress in (True, False)
        if progress or backend == "files" or kind in ROW_FRESH
    ]


def _blank_bytes(kind: str, whole: bytes, header: bytes) -> bytes:
    """A journal file of ``kind``, from the journal ``whole`` that began with ``header``."""
    return {
        "empty": b"",
        "zeroed": bytes(len(whole)),
        "header-only": header,
        "header-cut": header[: len(header) // 2],
    }[kind]


# -- the spool's files: the real worker and `agentd history` -----------------------------


def _files_case(case: Case, pristine: TaskDir, finished: TaskDir, plan: Plan, root: Path) -> Result:
    result = Result(case)
    header = encode({"k": "header", "v": JOURNAL_VERSION, "task": pristine.id})
    if not case.progress:
        task = clone_task(pristine, root)
        task.journal.write_bytes(_blank_bytes(case.kind, header, header))
        done = drive(task)
        result.verdict = REFUSED if done.exits[-1].code == ExitCode.FAILED else FRESH
        result.issues += _named(check_task(task, plan, []))
        return result
    task = clone_task(finished, root)
    whole = task.journal.read_bytes()
    store = FileStore(task.root)
    record, version = store.get_record(task.id)
    store.cas_record(task.id, version, {**(record or {}), PROGRESS: len(whole)})
    blank = _blank_bytes(case.kind, whole, whole[: len(header)])
    task.journal.write_bytes(blank)
    exit_ = run_worker(task)
    result.verdict = REFUSED if exit_.code == ExitCode.FAILED else FRESH
    if result.verdict != REFUSED:
        result.issues.append((NOT_REFUSED, f"exit {exit_.code}: {exit_.stderr[-200:]}"))
    elif not one_line(exit_.stderr) or str(task.journal) not in exit_.stderr:
        result.issues.append((NO_LINE, exit_.stderr[-300:]))
    if task.journal.read_bytes() != blank:
        result.issues.append((CHANGED, f"{len(blank)} bytes became {task.journal.stat().st_size}"))
    code, err = _history(task)
    reason = exit_.stderr.strip().split(" failed: ", 1)[-1]
    if code == 0 or reason not in err:
        result.issues.append((DISAGREES, f"history exit {code}: {err[-200:]}"))
    workspace = task.workspace_for(task.load_spec())
    result.issues += _named(effect_problems(workspace, plan))
    return result


#: ``redirect_stderr`` swaps the process's one ``sys.stderr``: the cases run in threads,
#: so one history at a time, or a case reads another's words (or none).
_STDERR = threading.Lock()


def _history(task: TaskDir) -> tuple[int, str]:
    err = io.StringIO()
    with _STDERR, contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = cli.main(["--spool", str(task.root), "history", task.id])
    return code, err.getvalue()


# -- the memory and PostgreSQL stores: the loop in this process --------------------------


class Rows:
    """A store that counts its journal's rows, and how a case damages them."""

    def __init__(self, name: str, store: TaskStore, damage: Callable[[str, str], None]) -> None:
        self.name = name
        self.store = store
        self.damage = damage


def _memory() -> Iterator[Rows]:
    store = MemoryStore()

    def damage(task_id: str, kind: str) -> None:
        with store.guard:
            journal = store.get(task_id).journal
            kept = {
                "empty": [],
                "zeroed": [bytes(len(item)) for item in journal],
                "header-only": journal[:1],
                "header-cut": [journal[0][: len(journal[0]) // 2]],
            }[kind]
            journal[:] = kept

    yield Rows("memory", store, damage)


def _postgres() -> Iterator[Rows]:
    import psycopg

    from supervisor.pgcluster import ThrowawayCluster
    from tests.postgres import fresh_schema
    from worker.store.postgres import PostgresStore

    with contextlib.ExitStack() as stack:
        url = os.environ.get("AGENTD_TEST_POSTGRES")
        if not url:
            url = stack.enter_context(ThrowawayCluster.create()).url
        url = stack.enter_context(fresh_schema(url))
        store = PostgresStore(url, node="faults", migrate=True)
        stack.callback(store.close)
        statements = {
            "empty": ["DELETE FROM journal WHERE task = %(t)s"],
            "zeroed": [
                "UPDATE journal SET record = decode(repeat('00', length(record)), 'hex') "
                "WHERE task = %(t)s"
            ],
            "header-only": ["DELETE FROM journal WHERE task = %(t)s AND seq > 1"],
            "header-cut": [
                "DELETE FROM journal WHERE task = %(t)s AND seq > 1",
                "UPDATE journal SET record = substring(record FROM 1 FOR length(record) / 2) "
                "WHERE task = %(t)s",
            ],
        }

        def damage(task_id: str, kind: str) -> None:
            with psycopg.connect(url, autocommit=True) as conn:
                for sql in statements[kind]:
                    conn.execute(sql, {"t": task_id})

        yield Rows("postgres", store, damage)


def _loop(store: TaskStore, spec: TaskSpec, script: bytes, workspace: Path) -> AgentLoop:
    config = Config()
    tools = ToolRegistry.standard(config.tools.modules).narrowed(spec.tools)
    model = ScriptedModel.from_bytes(script, "script")
    return AgentLoop(store, spec, config, model, tools, workspace=workspace)


def _run(store: TaskStore, spec: TaskSpec, script: bytes, workspace: Path) -> tuple[str, str]:
    loop = _loop(store, spec, script, workspace)
    try:
        outcome = loop.run()
    finally:
        loop.close()
    return outcome.state, outcome.reason


def _journal_of(store: TaskStore, task_id: str) -> Any:
    """What the journal holds, to tell a refusal changed nothing (read-only)."""
    try:
        return store.replay(task_id)
    except JournalCorruptError as exc:
        return str(exc)


def _rows_case(case: Case, rows: Rows, pristine: TaskDir, plan: Plan, root: Path, n: int) -> Result:
    result = Result(case)
    base = pristine.load_spec()
    spec = TaskSpec.from_json({**base.to_json(), "id": f"b{n}"}, where="a blank case")
    script = pristine.script.read_bytes()
    store = rows.store
    store.create(spec, {"state": "queued"}, script=script)
    workspace = root / rows.name / f"ws-{n}"
    workspace.mkdir(parents=True)
    if case.progress:
        _run(store, spec, script, workspace)  # every turn, every effect
        rows.damage(spec.id, case.kind)
    elif case.kind == "header-only":
        owner = store.acquire(spec.id)
        writer, _ = store.open_journal(owner, header={"task": spec.id})
        writer.close()
        store.release(owner)
    before = _journal_of(store, spec.id)
    state, reason = _run(store, spec, script, workspace)
    refused = state == "failed" and "damaged" in reason
    result.verdict = REFUSED if refused else FRESH
    if case.progress:
        if not refused:
            result.issues.append((NOT_REFUSED, f"{state}: {reason[:200]}"))
        elif "\n" in reason or f"task {spec.id}" not in reason:
            result.issues.append((NO_LINE, reason[:300]))
        if _journal_of(store, spec.id) != before:
            result.issues.append((CHANGED, "the journal read differently after the refusal"))
        try:
            replay.load(store, spec.id)
            result.issues.append((DISAGREES, "the daemon's read found no damage"))
        except JournalCorruptError as exc:
            if str(exc) != reason:
                result.issues.append((DISAGREES, str(exc)[:200]))
    elif state != "done":
        result.issues.append((NOT_DONE, f"{state}: {reason[:200]}"))
    result.issues += _named(effect_problems(workspace, plan))
    return result


def _named(problems: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """``check_task``'s problems as this part's issues: an effect twice ran again, any
    other is a task not completed as it should be."""
    return [(RAN_AGAIN if k in (UNSAFE_TWICE, KEYED_TWICE) else NOT_DONE, d) for k, d in problems]


# -- the part of the class ----------------------------------------------------------------


def run(plan: Plan, root: Path) -> list[Figure]:
    """Every case on every backend: the figures, under class 4's name."""
    pristine = make_task(root / "pristine", plan)
    finished = clone_task(pristine, root / "finished")
    stop_before_record(finished, 10**6)  # never stops: runs to the end in-process
    results: list[Result] = []
    files = cases(["files"])
    results += parallel(
        list(enumerate(files)),
        lambda item: _files_case(item[1], pristine, finished, plan, root / f"f{item[0]}"),
    )
    failures: list[Figure] = []
    for backend in (_memory, _postgres):
        try:
            with contextlib.contextmanager(backend)() as rows:
                for n, case in enumerate(cases([rows.name])):
                    try:
                        results.append(_rows_case(case, rows, pristine, plan, root, n))
                    except Exception as exc:  # a read that raised instead of refusing
                        found = Result(case, "raised", [(RAISED, f"{type(exc).__name__}: {exc}")])
                        results.append(found)
        except Exception as exc:  # a backend that cannot run is a violation, not a skip
            name = backend.__name__.strip("_")
            failures.append(Figure(FAULT, f"blank: {name} could not run", str(exc)[:200], True))
    return failures + _figures(results)


def _figures(results: list[Result]) -> list[Figure]:
    figures = []
    for backend in ("files", "memory", "postgres"):
        mine = [r for r in results if r.case.backend == backend]
        if not mine:
            continue
        right = sum(r.verdict == r.case.expected for r in mine)
        name = f"blank journals ({backend}): verdicts as expected"
        figures.append(Figure(FAULT, name, f"{right}/{len(mine)}", violation=right != len(mine)))
        for kind in KINDS:
            seen = {r.case.progress: r.verdict for r in mine if r.case.kind == kind}
            value = ", ".join(
                f"{'with' if progress else 'without'} progress: {seen[progress]}"
                for progress in (True, False)
                if progress in seen
            )
            figures.append(Figure(FAULT, f"blank {kind} ({backend})", value))
    issues = Counter(kind for r in results for kind, _ in r.issues)
    figures += [
        Figure(FAULT, kind, issues.get(kind, 0), violation=bool(issues.get(kind)))
        for kind in ISSUES
    ]
    bad = [r for r in results if r.issues or r.verdict != r.case.expected]
    if bad:
        r = bad[0]
        detail = f"{r.case}: {r.verdict}; " + "; ".join(f"{k}: {d}" for k, d in r.issues[:2])
        figures.append(Figure(FAULT, "blank: first failing case", detail[:300], violation=True))
    return figures


if __name__ == "__main__":  # python -m tests.faults.blank: this part alone
    from tests.faults.common import mixed_plan
    from tests.faults.report import print_figures

    with tempfile.TemporaryDirectory(prefix="agentd-blank-") as tmp:
        print_figures(run(mixed_plan(3), Path(tmp)))
