"""Workspace snapshot benchmark: what a turn boundary's ``vcs`` capture costs now that
git runs through a private GIT_DIR (``worker.vcs``), against the way it ran before.

A real repository of many small committed files; before each capture one file changes
and one is added, as a turn of a tool would. *Before* is the old capture, inlined here:
plain ``git`` on the repository itself (its own config read), a fresh temporary index
each time (``rev-parse --show-toplevel``, ``rev-parse HEAD``, ``add -A``, ``write-tree``,
``commit-tree``, ``update-ref``). *Now* is ``Git.capture``: the private GIT_DIR's own
index kept between turns, HEAD read from the repository's files; bare (sandbox off), and
under bwrap (sandbox on, one bwrap per git run). Runs alternate so that both see the
same load; each figure is a median. No target: the row says what the safety costs.
"""

from __future__ import annotations

import functools
import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench.report import Row
from bench.supervision import bench_run
from worker import vcs
from worker.tools.sandbox import SandboxMode, probe, sandbox_for

NAME = "vcs"
_USER = ["-c", "user.name=b", "-c", "user.email=b@b"]


def _git(cwd: Path, *args: str, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(
        ["git", *_USER, *args],
        cwd=cwd,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout


def _before(repo: Path, turn: int) -> None:
    """The capture as it was: git on the repository itself, a temporary index."""
    root = Path(_git(repo, "rev-parse", "--show-toplevel").strip())
    head = _git(root, "rev-parse", "--verify", "-q", "HEAD").strip()
    with tempfile.TemporaryDirectory(prefix="agentd-index-") as tmp:
        env = {"GIT_INDEX_FILE": str(Path(tmp) / "index")}
        _git(root, "add", "-A", ".", env=env)
        tree = _git(root, "write-tree", env=env).strip()
    snapshot = _git(root, "commit-tree", tree, "-p", head, "-m", f"turn {turn}").strip()
    _git(root, "update-ref", f"refs/agentd/old/{turn}", snapshot)


def _repository(folder: Path, files: int) -> Path:
    folder.mkdir()
    subprocess.run(["git", "init", "-q", str(folder)], check=True)
    for i in range(files):
        sub = folder / f"d{i % 20:02d}"
        sub.mkdir(exist_ok=True)
        (sub / f"f{i:05d}.txt").write_text(f"file {i}\n" * 20)
    _git(folder, "add", "-A")
    _git(folder, "commit", "-qm", "init")
    return folder


def _timed(action: Callable[[], object]) -> float:
    started = time.perf_counter()
    action()
    return (time.perf_counter() - started) * 1000


def _measure(workdir: Path, files: int, runs: int) -> list[Row]:
    repo = _repository(workdir / "repo", files)
    found = vcs.discover(repo)
    if found is None:
        raise RuntimeError(f"{repo} is not found as a repository")
    spool = workdir / "spool"
    bare = vcs.Git(found, spool / "tasks" / "t1" / "git")
    boxed_sandbox = sandbox_for(SandboxMode.REQUIRED, True, spool=spool, config=None)
    problem = probe("bwrap", True).problem
    boxed = vcs.Git(found, spool / "tasks" / "t2" / "git", boxed_sandbox) if not problem else None
    timings: dict[str, list[float]] = {"before": [], "bare": [], "bwrap": []}
    for turn in range(runs + 1):  # the first round warms the page cache and the indexes
        (repo / "d00" / "f00000.txt").write_text(f"changed at turn {turn}\n")
        (repo / f"new{turn}.txt").write_text("new\n")
        rounds: list[tuple[str, Callable[[], object]]] = [
            ("before", functools.partial(_before, repo, turn)),
            ("bare", functools.partial(bare.capture, "t1", turn)),
        ]
        if boxed is not None:
            rounds.append(("bwrap", functools.partial(boxed.capture, "t2", turn)))
        for name, action in rounds:
            elapsed = _timed(action)
            if turn:
                timings[name].append(elapsed)
    before = statistics.median(timings["before"])
    figure = f"snapshot of a {files:,}-file repository, median of {runs}"
    rows = [
        Row(
            NAME,
            f"{figure}, sandbox off (floor: before)",
            "ms",
            statistics.median(timings["bare"]),
            floor=before,
            note="before: plain git on the repository's own config, a fresh index each turn",
        )
    ]
    if boxed is None:
        rows.append(Row(NAME, f"{figure}, bwrap", "ms", None, note=f"not measured: {problem}"))
    else:
        rows.append(
            Row(
                NAME,
                f"{figure}, bwrap (floor: before)",
                "ms",
                statistics.median(timings["bwrap"]),
                floor=before,
            )
        )
    return rows


def run(quick: bool) -> list[Row]:
    files, runs = (500, 15) if quick else (5000, 40)
    return bench_run(NAME, quick, lambda workdir: _measure(workdir, files, runs))
