"""File tools benchmark: what resolving beneath the workspace's fd costs a call.

``read_file`` of a 4 KiB file and ``write_file`` of 4 KiB (durable: fsync of the file and
the folder), three folders deep, as a worker runs them: the workspace opened once, each
path resolved beneath its fd, by ``openat2`` (where the kernel has it) and by the walk of
the kernels without it. The floor is the old way, the path checked by ``realpath`` and then
opened by name (the copy the trust attack ``tests.chaos.trust.swap_race`` keeps as its
control), which a folder swapped for a symlink meanwhile could send outside. The calls
alternate so that each way sees the same machine load; the figure is the median of a call.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path

from bench.report import Row
from bench.supervision import bench_run
from tests.chaos.trust.swap_race import old_read_file, old_write_file
from worker.tools.beneath import HAVE_OPENAT2, Root
from worker.tools.builtin import read_file, write_file
from worker.tools.tool import ToolContext

NAME = "filetools"
PATH = "a/b/c/f.txt"
CONTENT = "x" * 4096

Call = Callable[[], object]


def _medians(calls: dict[str, Call], runs: int) -> dict[str, float]:
    """The median µs of each call, run in alternation."""
    for call in calls.values():
        call()
    times: dict[str, list[float]] = {way: [] for way in calls}
    for _ in range(runs):
        for way, call in calls.items():
            started = time.perf_counter()
            call()
            times[way].append((time.perf_counter() - started) * 1e6)
    return {way: statistics.median(t) for way, t in times.items()}


def _measure(workdir: Path, runs: int) -> list[Row]:
    workspace = workdir / "workspace"
    (workspace / PATH).parent.mkdir(parents=True)
    (workspace / PATH).write_text(CONTENT)
    ways = {"openat2": Root(workspace, openat2=True), "walk": Root(workspace, openat2=False)}
    if not HAVE_OPENAT2:
        del ways["openat2"]
    contexts = {
        way: ToolContext(workspace, "t1", "toolu_1", "key", 60.0, root=root)
        for way, root in ways.items()
    }

    def reader(ctx: ToolContext) -> Call:
        return lambda: read_file.run(ctx, {"path": PATH})

    def writer(ctx: ToolContext) -> Call:
        return lambda: write_file.run(ctx, {"path": PATH, "content": CONTENT})

    tools: dict[str, tuple[Call, dict[str, Call]]] = {
        "read_file": (
            lambda: old_read_file(workspace, PATH),
            {way: reader(ctx) for way, ctx in contexts.items()},
        ),
        "write_file": (
            lambda: old_write_file(workspace, PATH, CONTENT),
            {way: writer(ctx) for way, ctx in contexts.items()},
        ),
    }
    rows = []
    for tool, (old, new) in tools.items():
        medians = _medians({"old": old, **new}, runs)
        for way in new:
            rows.append(
                Row(
                    NAME,
                    f"{tool} of 4 KiB, 3 folders deep, {way}, median of {runs}"
                    " (floor: check-then-use)",
                    "µs",
                    medians[way],
                    floor=medians["old"],
                    note=f"{tool} {way}: {medians[way] - medians['old']:+.1f} µs a call"
                    " against the old check-then-use",
                )
            )
    for root in ways.values():
        root.close()
    if not HAVE_OPENAT2:
        rows.append(Row(NAME, "openat2", "", None, note="not measured: this kernel lacks it"))
    return rows


def run(quick: bool) -> list[Row]:
    runs = 500 if quick else 5000
    return bench_run(NAME, quick, lambda workdir: _measure(workdir, runs))
