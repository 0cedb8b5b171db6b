"""Power loss (fault class 15): only what was never synced is lost, and that is a torn tail.

A clean run of a task is traced with ``strace -f`` (every thread, so the journal's
background fdatasync is seen too): each write to the journal and each fdatasync of it, in
order. That gives, before each of those calls, the journal's size and the size its last
returned fdatasync had made durable. Every call before which some bytes are not yet
durable is a cut point: a copy of the task is run under ``tests.faults.sync_shim``, which
SIGKILLs the worker on entry to that call, so the workspace and the journal are as the
machine held them at that instant. The power then goes: every variant of the journal that
keeps the synced bytes and independently keeps, zeroes or drops each 4 KiB page written
after them (``common.after_power_loss``) is given to a real worker on the scripted model,
holds decided by a careful operator, until the task ends.

The task's tools read a file of a few KiB (``read_file``: a large result, written
without a sync) and then act (``append_file``, ``outbox_send``: an intent synced at once),
so an earlier unsynced page can be lost while a later one holding a whole frame survives,
which is the case a format without durable marks took for corruption. Only the journal
loses pages: the other files of the task are kept as the kill left them.

Figures: synced records lost and tasks failed for losing only unsynced bytes, both 0, and
the invariants of ``common.check_task`` after each resume; the variants in which a whole
frame follows the damage are counted apart (format 1 of the journal refused them all).
Quick mode: every variant of a 4-turn task reading 5,000 bytes; full mode: every variant
of four tasks (8, 6, 6 and 6 turns reading 5,000, 9,000, 2,500 and 13,000 bytes), so the page
boundaries fall at other places in the records.
"""

from __future__ import annotations

import itertools
import re
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from tests.faults.common import (
    LOST,
    NOT_DONE,
    PROBLEMS,
    SHIM,
    Fate,
    Plan,
    after_power_loss,
    check_task,
    clone_task,
    drive,
    make_task,
    parallel,
    require_strace,
    run_worker,
    stopwatch,
    unsynced_pages,
)
from tests.faults.report import Figure
from tests.support import reply, text, tool_use
from worker.errors import AgentdError
from worker.protocol import ExitCode
from worker.spool import TaskDir
from worker.store.journal import FRAMINGS, scan

FAULT = "power loss"
#: (turns, bytes of the file read back): quick mode's task, and full mode's.
QUICK = ((4, 5000),)
FULL = ((8, 5000), (6, 9000), (6, 2500), (6, 13000))


def big_file(size: int) -> str:
    """``size`` bytes of numbered lines: a read_file result of that size."""
    lines = "".join(
        f"line {i:05d} of the file the task reads back\n" for i in range(size // 40 + 1)
    )
    return lines[:size]


def powerloss_plan(turns: int, size: int) -> Plan:
    """A task whose turns (after the first, which writes the file) read a file of ``size``
    bytes back and then act: the large result is written unsynced, the action's intent is
    synced at once."""
    content = big_file(size)
    responses = [
        reply(text("Writing the file."), tool_use("write_file", path="big.txt", content=content))
    ]
    appends: dict[str, list[str]] = {"log.txt": []}
    outbox: list[str] = []
    for t in range(2, turns):
        act = tool_use("outbox_send", to="ops", body=f"message {t}")
        if t % 2 == 0:
            act = tool_use("append_file", path="log.txt", content=f"line {t}\n")
            appends["log.txt"].append(f"line {t}\n")
        else:
            outbox.append(f"message {t}")
        responses.append(reply(tool_use("read_file", path="big.txt"), act))
    responses.append(reply(text("All done.")))
    return Plan(responses, {"big.txt": content}, appends, outbox)


# -- the trace ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Cut:
    """The instant before the ``call``-th journal call (1-based, writes and fdatasyncs of
    every thread, in order): the journal's ``size`` then, and its ``synced`` prefix."""

    call: int
    size: int
    synced: int

    @property
    def pages(self) -> int:
        return len(unsynced_pages(self.size, self.synced))


_LINE = re.compile(
    r"^\d+\s+(?:(?P<name>write|fdatasync)\(\d+<(?P<path>[^>]*)>"
    r"|<\.\.\. (?:write|fdatasync) resumed>)"
)
_RET = re.compile(r"\)\s+=\s+(?P<ret>-?\d+)")


def journal_calls(log: Path, journal: Path) -> list[tuple[str, int]]:
    """The journal's writes (with the bytes they wrote) and fdatasyncs (0) that returned,
    in the order they returned, from an ``strace -f -y`` log."""
    calls: list[tuple[str, int]] = []
    pending: dict[str, str] = {}  # pid -> the call left unfinished on the journal
    for line in log.read_text(errors="replace").splitlines():
        m = _LINE.match(line)
        if not m:
            continue
        pid = line.split()[0]
        name = m.group("name")
        if name and m.group("path") != str(journal):
            continue
        if "<unfinished ...>" in line:
            pending[pid] = name
            continue
        name = name or pending.pop(pid, "")
        ret = _RET.search(line)
        if not name or ret is None or int(ret.group("ret")) < 0:
            continue
        calls.append((name, int(ret.group("ret")) if name == "write" else 0))
    return calls


def cuts(calls: list[tuple[str, int]], header: int) -> list[Cut]:
    """Every instant before a journal call at which some written bytes were not durable.
    The journal's first ``header`` bytes were durable before its first call: it is made
    whole, its header synced in a temp file renamed into place."""
    found, size, synced = [], header, header
    for n, (name, written) in enumerate(calls, start=1):
        if size > synced:
            found.append(Cut(n, size, synced))
        if name == "write":
            size += written
        else:
            synced = size
    return found


def trace(pristine: TaskDir, root: Path) -> tuple[list[tuple[str, int]], int]:
    """The journal calls of a clean run of (a copy of) ``pristine``, under ``strace -f``,
    and the size of its header (written before the journal had its name)."""
    task = clone_task(pristine, root / "clean")
    log = root / "clean.strace"
    prefix = [require_strace(), "-f", "-qq", "-y", "-e", "signal=none", "-o", str(log)]
    prefix += ["-e", "trace=write,fdatasync", "-P", str(task.journal)]
    done = run_worker(task, prefix=prefix)
    if done.code != ExitCode.DONE:
        raise RuntimeError(f"the clean run of the power-loss task failed: {done}")
    return journal_calls(log, task.journal), scan(task.journal.read_bytes()).records[0][1]


# -- the variants ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Variant:
    cut: Cut
    fates: tuple[Fate, ...]

    def __str__(self) -> str:
        fates = ",".join(f.value for f in self.fates)
        return f"call {self.cut.call} ({self.cut.synced}..{self.cut.size}: {fates})"


@dataclass
class Result:
    variant: Variant
    on_target: bool
    resumed: bool = False
    synced_lost: str = ""
    failed: str = ""
    frames_after_damage: bool = False
    problems: list[tuple[str, str]] = field(default_factory=list)


def stopped_at(pristine: TaskDir, cut: Cut, root: Path) -> tuple[TaskDir, bool]:
    """A copy of ``pristine`` killed on entry to the cut's journal call, and whether the
    kill landed there (its journal holds exactly the bytes written before it)."""
    task = clone_task(pristine, root)
    killed = run_worker(task, module=SHIM, env={"FAULTS_JOURNAL_KILL": str(cut.call)})
    size = task.journal.stat().st_size if task.journal.exists() else -1
    return task, killed.code == -9 and size == cut.size


def whole_frame_after_damage(data: bytes) -> bool:
    """Whether a whole frame follows the first damage in ``data`` (what the journal format
    without durable marks refused as corruption)."""
    try:
        end = scan(data).good_end
    except AgentdError:
        return True  # refused: a frame after the damage says it was synced
    return any(f.frame_at(data, p) for p in range(end + 1, len(data)) for f in FRAMINGS.values())


def _variant(stopped: TaskDir, plan: Plan, root: Path, variant: Variant) -> Result:
    task = clone_task(stopped, root)
    data = task.journal.read_bytes()
    synced = variant.cut.synced
    lost = after_power_loss(data, synced, variant.fates)
    task.journal.write_bytes(lost)
    result = Result(variant, True, frames_after_damage=whole_frame_after_damage(lost))
    before = [record for record, end in scan(data).records if end <= synced]
    resumed = drive(task)
    result.resumed = bool(resumed.exits)
    if resumed.code != ExitCode.DONE:
        last = resumed.exits[-1] if resumed.exits else None
        result.failed = f"exit {resumed.code}: {last.stderr.strip()[-200:] if last else ''}"
    after = task.journal.read_bytes()
    if after[:synced] != data[:synced]:
        result.synced_lost = f"{synced} synced bytes, the journal now holds {len(after)}"
    result.problems = [p for p in check_task(task, plan, before) if p[0] not in (LOST, NOT_DONE)]
    return result


def _case(
    pristine: TaskDir, plan: Plan, root: Path, cut: Cut, fates: list[tuple[Fate, ...]]
) -> list[Result]:
    """The task killed at ``cut``, then each of its power-loss variants resumed."""
    stopped, on_target = stopped_at(pristine, cut, root / "stopped")
    if not on_target:
        return [Result(Variant(cut, f), False) for f in fates]
    return [
        _variant(stopped, plan, root / f"v{n:03d}", Variant(cut, f)) for n, f in enumerate(fates)
    ]


@dataclass
class Shape:
    """One task traced and cut: its plan, journal calls, cut points and variants."""

    plan: Plan
    calls: list[tuple[str, int]]
    points: list[Cut]
    results: list[Result] = field(default_factory=list)

    @property
    def variants(self) -> int:
        return sum(3**cut.pages for cut in self.points)


def _shape(root: Path, turns: int, size: int) -> Shape:
    """The task of ``turns`` turns reading ``size`` bytes, killed at each cut point, every
    power-loss variant of each resumed."""
    plan = powerloss_plan(turns, size)
    pristine = make_task(root / "pristine", plan)
    calls, header = trace(pristine, root)
    shape = Shape(plan, calls, cuts(calls, header))
    every = [
        (n, cut, list(itertools.product(list(Fate), repeat=cut.pages)))
        for n, cut in enumerate(shape.points)
    ]
    done = parallel(every, lambda c: _case(pristine, plan, root / f"c{c[0]:03d}", c[1], c[2]))
    shape.results = [r for results in done for r in results]
    return shape


def run(quick: bool) -> list[Figure]:
    require_strace()
    with stopwatch() as elapsed, tempfile.TemporaryDirectory(prefix="agentd-power-") as tmp:
        shapes = [
            _shape(Path(tmp) / f"s{n}", turns, size)
            for n, (turns, size) in enumerate(QUICK if quick else FULL)
        ]
        seconds = elapsed()
    return _figures(shapes, seconds)


def _figures(shapes: list[Shape], seconds: float) -> list[Figure]:
    calls = [call for shape in shapes for call in shape.calls]
    points = [cut for shape in shapes for cut in shape.points]
    results = [r for shape in shapes for r in shape.results]
    kinds = Counter(name for name, _ in calls)
    done = [r for r in results if r.on_target]
    missed = [r for r in results if not r.on_target]
    lost = [r for r in done if r.synced_lost]
    failed = [r for r in done if r.failed]
    problems = Counter(kind for r in done for kind, _ in r.problems)
    figures = [
        Figure(FAULT, "tasks traced (turns)", ", ".join(str(s.plan.turns) for s in shapes)),
        Figure(FAULT, "journal writes traced", kinds["write"]),
        Figure(FAULT, "journal fdatasyncs traced", kinds["fdatasync"]),
        Figure(FAULT, "cut points with unsynced bytes", len(points), violation=not points),
        Figure(FAULT, "unsynced pages at the cut points", sum(c.pages for c in points)),
        Figure(FAULT, "variants built", sum(s.variants for s in shapes)),
        Figure(FAULT, "variants resumed", sum(r.resumed for r in done), violation=not done),
        Figure(
            FAULT,
            "variants with a whole frame after the damage (format 1 refused them)",
            sum(r.frames_after_damage for r in done),
        ),
        Figure(FAULT, "kills that missed their point", len(missed), violation=bool(missed)),
        Figure(FAULT, "synced records lost", len(lost), violation=bool(lost)),
        Figure(
            FAULT,
            "tasks failed for losing only unsynced bytes",
            len(failed),
            violation=bool(failed),
        ),
    ]
    for kind in PROBLEMS:
        if kind in (LOST, NOT_DONE):
            continue
        n = problems.get(kind, 0)
        figures.append(Figure(FAULT, f"resume: {kind}", n, violation=bool(n)))
    bad = [r for r in results if not r.on_target or r.synced_lost or r.failed or r.problems]
    if bad:
        r = bad[0]
        why = r.synced_lost or r.failed or "; ".join(d for _, d in r.problems[:2]) or "missed"
        figures.append(Figure(FAULT, "first failing variant", f"{r.variant}: {why}", True))
    figures.append(Figure(FAULT, "runtime s", round(seconds, 1)))
    return figures


if __name__ == "__main__":
    from tests.faults.report import print_figures

    print_figures(run(quick=True))
