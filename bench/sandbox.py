"""Sandbox benchmark: what bubblewrap adds to a ``run_command`` call.

The tool itself (``worker.tools.builtin.run_command``) runs ``true`` in a workspace inside
a spool, as a worker runs it: with the sandbox ``required`` (bwrap, with the spool and a
config folder hidden), and ``off`` (bare ``/bin/sh -c``, the floor), in alternation so
that both see the same machine load. The figure is the median wall time of a call, and
the overhead is the difference of the medians; the target is an overhead under 10 ms.
A second row does the same with ``network = false`` (a network namespace of its own).
A third gives the cost of hiding the other tasks' workspaces (``worker.tool_calls.OtherWorkspaces``)
when ``NEIGHBOURS`` tasks of the spool each have a ``--workspace`` of their own: one
mount each, so it grows with them; shown, not judged.
Where bwrap does not work the rows say why and the target is not judged.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path

from bench.report import Row
from bench.supervision import bench_run
from supervisor.submit import create_task
from worker.spool import Spool, TaskSpec
from worker.store.files import FileStore
from worker.tool_calls import OtherWorkspaces
from worker.tools.builtin import run_command
from worker.tools.registry import ToolContext
from worker.tools.sandbox import Sandbox, SandboxMode, probe, sandbox_for

NAME = "sandbox"
TARGET_MS = 10.0
NEIGHBOURS = 100


def _call_ms(ctx: ToolContext) -> float:
    started = time.perf_counter()
    out = run_command.run(ctx, {"command": "true"})
    elapsed = (time.perf_counter() - started) * 1000
    if not out.startswith("exit code 0"):
        raise RuntimeError(f"run_command of true failed: {out[:200]}")
    return elapsed


def _medians(bare: ToolContext, boxed: ToolContext, runs: int) -> tuple[float, float]:
    for ctx in (bare, boxed):  # warm: the probe, the page cache
        _call_ms(ctx)
    bare_ms, boxed_ms = [], []
    for _ in range(runs):
        bare_ms.append(_call_ms(bare))
        boxed_ms.append(_call_ms(boxed))
    return statistics.median(bare_ms), statistics.median(boxed_ms)


def _measure(workdir: Path, runs: int) -> list[Row]:
    spool = workdir / "spool"
    workspace = spool / "tasks" / "t1" / "workspace"
    workspace.mkdir(parents=True)
    config = workdir / "etc" / "agentd" / "agentd.toml"
    config.parent.mkdir(parents=True)
    config.write_text("")
    env = {"PATH": "/usr/bin:/bin", "AGENTD_TASK": "t1"}

    def ctx(sandbox: Sandbox) -> ToolContext:
        return ToolContext(workspace, "t1", "toolu_1", "key", 60.0, env, sandbox)

    bare = ctx(Sandbox(SandboxMode.OFF))
    rows = []
    for network in (True, False):
        what = "" if network else ", network = false"
        figure = f"run_command of `true`, median of {runs}{what}"
        problem = probe("bwrap", network).problem
        if problem is not None:
            rows.append(Row(NAME, figure, "ms", None, note=f"not measured: {problem}"))
            continue
        boxed = ctx(sandbox_for(SandboxMode.REQUIRED, network, spool=spool, config=config))
        floor, agentd = _medians(bare, boxed, runs)
        rows.append(
            Row(
                NAME,
                figure + " (floor: bare)",
                "ms",
                agentd,
                floor=floor,
                target=f"overhead < {TARGET_MS:g} ms",
                met=agentd - floor < TARGET_MS,
                note=f"sandbox overhead{what}: {agentd - floor:.2f} ms a call",
            )
        )
    if probe("bwrap", True).problem is None:
        rows.append(_neighbours(workdir, ctx, runs))
    return rows


def _neighbours(workdir: Path, ctx: Callable[[Sandbox], ToolContext], runs: int) -> Row:
    spool = Spool(workdir / "spool")
    for i in range(NEIGHBOURS):
        folder = workdir / "neighbours" / f"w{i}"
        folder.mkdir(parents=True)
        create_task(spool, TaskSpec(id=f"n{i}", prompt="x", workspace=str(folder)), None)
    others = OtherWorkspaces(FileStore(spool.root), "t1")
    plain = ctx(sandbox_for(SandboxMode.REQUIRED, True, spool=spool.root, config=None))
    hiding = ctx(
        sandbox_for(SandboxMode.REQUIRED, True, spool=spool.root, config=None, others=others)
    )
    floor, agentd = _medians(plain, hiding, runs)
    return Row(
        NAME,
        f"run_command of `true` hiding {NEIGHBOURS} other workspaces, median of {runs}",
        "ms",
        agentd,
        floor=floor,
        note=f"hiding {NEIGHBOURS} other tasks' workspaces: {agentd - floor:.2f} ms a call",
    )


def run(quick: bool) -> list[Row]:
    runs = 50 if quick else 200
    return bench_run(NAME, quick, lambda workdir: _measure(workdir, runs))
