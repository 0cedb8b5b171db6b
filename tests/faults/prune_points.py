"""Crash points of a removal (docs/design.md section 20): SIGKILL of ``agentd prune`` at
every system call that moves or deletes a task's files, for every one of them.

A clean ``agentd prune TASK`` under strace lists its renames, unlinks and syncs; each is a
point. A fresh copy of a spool with one ended task is pruned under ``strace -e
inject=NAME:signal=KILL:when=N`` (killed on entry to that call, before it takes effect),
and then: the task must be whole in ``tasks/`` (every file as it was) or gone from it, and
the next ``agentd prune`` must finish what the kill left (``SPOOL/removed/`` empty, the
task gone). Part of class 2 (``tests.faults.crash_points``)."""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tests.faults.common import parallel, parse_log, require_strace, run_cli
from tests.faults.report import Figure

FAULT = "crash points"
TASK = "ended"
CALLS = ("rename", "renameat", "renameat2", "unlink", "unlinkat", "rmdir", "fsync")
SCRIPT = {"responses": [{"content": [{"type": "text", "text": "Done."}]}]}


@dataclass(frozen=True)
class Case:
    call: str
    when: int
    half: bool  # the task was left neither whole nor gone
    unfinished: bool  # the next prune did not finish the removal


def _files(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and not p.name.endswith(".lock") and p.name != "lock"
    }


def _made(root: Path) -> Path:
    """A spool with one task run to its end (``agentd run``)."""
    spool = root / "spool"
    script = root / "script.json"
    script.write_text(json.dumps(SCRIPT))
    done = run_cli(spool, "run", "--name", TASK, "--prompt", "hi", "--script", str(script))
    if done.code != 0:
        raise RuntimeError(f"agentd run ended {done.code}: {done.stderr[-300:]}")
    return spool


def _points(pristine: Path, root: Path) -> list[tuple[str, int]]:
    spool = root / "count"
    shutil.copytree(pristine, spool, symlinks=True)
    log = root / "count.log"
    strace = require_strace()
    prefix = [strace, "-qq", "-o", str(log), "-e", "trace=" + ",".join(CALLS)]
    if run_cli(spool, "prune", TASK, prefix=prefix).code != 0:
        raise RuntimeError("a clean prune failed")
    calls = [c for c in parse_log(log) if c.name in CALLS]
    return [(c.name, c.index) for c in calls]


def _case(
    pristine: Path, root: Path, whole: dict[str, str], n: int, point: tuple[str, int]
) -> Case:
    call, when = point
    spool = root / f"case-{n}"
    shutil.copytree(pristine, spool, symlinks=True)
    prefix = [require_strace(), "-qq", "-o", "/dev/null", "-e", f"trace={call}"]
    prefix += ["-e", f"inject={call}:signal=KILL:when={when}"]
    run_cli(spool, "prune", TASK, prefix=prefix)
    folder = spool / "tasks" / TASK
    half = folder.exists() and _files(folder) != whole
    run_cli(spool, "prune", "--state", "done")
    removed = spool / "removed"
    unfinished = folder.exists() or (removed.exists() and any(removed.iterdir()))
    shutil.rmtree(spool, ignore_errors=True)
    return Case(call, when, half, unfinished)


def figures(quick: bool) -> list[Figure]:
    with tempfile.TemporaryDirectory(prefix="agentd-prune-") as tmp:
        root = Path(tmp)
        pristine = _made(root)
        whole = _files(pristine / "tasks" / TASK)
        points = _points(pristine, root)
        if quick:  # the first and last of each call, and every rename
            firsts: dict[str, tuple[str, int]] = {}
            lasts: dict[str, tuple[str, int]] = {}
            for p in points:
                firsts.setdefault(p[0], p)
                lasts[p[0]] = p
            points = sorted({*firsts.values(), *lasts.values()})
        cases = parallel(list(enumerate(points)), lambda item: _case(pristine, root, whole, *item))
    half = [c for c in cases if c.half]
    unfinished = [c for c in cases if c.unfinished]
    return [
        Figure(FAULT, "prune: kill points", len(cases), violation=not cases),
        Figure(FAULT, "prune: tasks left half removed", len(half), violation=bool(half)),
        Figure(
            FAULT,
            "prune: removals the next prune did not finish",
            len(unfinished),
            violation=bool(unfinished),
        ),
    ]
