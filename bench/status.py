"""Status under a backlog: what ``agentd status --json`` costs when many tasks wait.

A real daemon with ``max_workers`` 8 is given a burst of scripted tasks at once (each one's
first model call sleeps for an hour), so 8 run and the rest wait ``queued``. Once the 8
are in their model call, ``status --json`` is timed as a fresh CLI process, start to exit,
several times: the median and the worst. The sizes are 500 and 5,000 tasks (full mode),
the target a median of at most ``TARGET_MS`` at 500 (the store-seam issue): status should
cost what reading the task rows costs, not a replay of every journal. Floor: a bare
``python -c pass`` (the least any CLI command costs).

Unlike ``bench/scale.py`` (idle workers, each of them running), this measures a spool
whose tasks mostly do not run: what status reads per task, not per worker.
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from bench.report import Row
from bench.supervision import (
    Daemon,
    Timing,
    bench_run,
    child_env,
    config_text,
    idle_script,
    idle_workers,
    say,
    submit_scripted,
    timed_call,
    timed_run,
    wait_until,
)

NAME = "status"
TARGET_MS = 200.0
RUNNING = 8  # max_workers: the tasks that run while the rest wait


@dataclass(frozen=True)
class Plan:
    sizes: tuple[int, ...]  # tasks submitted at once, one daemon each
    calls: int  # status calls per size


FULL = Plan(sizes=(500, 5000), calls=15)
QUICK = Plan(sizes=(40,), calls=3)


@dataclass(frozen=True)
class Size:
    tasks: int
    calls: list[Timing]

    @property
    def median_ms(self) -> float:
        return 1000 * statistics.median(c.wall for c in self.calls)

    @property
    def worst_ms(self) -> float:
        return 1000 * max(c.wall for c in self.calls)

    @property
    def cpu_ms(self) -> float:
        return 1000 * statistics.median(c.cpu for c in self.calls)


def backlog(workdir: Path, tasks: int, calls: int) -> Size:
    """``tasks`` submitted at once to a daemon running ``RUNNING`` of them; ``calls``
    status calls once those are in their model call."""
    with Daemon(workdir, config_text(max_workers=RUNNING)) as daemon:
        daemon.start()
        script = idle_script()
        found = [
            submit_scripted(daemon.spool, daemon.config, script, f"b{k:05d}", workdir)
            for k in range(tasks)
        ]
        daemon.launch(found)
        ids = [task.id for task in found]
        wait_until(
            lambda: len(idle_workers(daemon.spool, ids)) >= min(RUNNING, tasks),
            120 + tasks / 50,
            0.5,
            f"{RUNNING} of {tasks} tasks in their model call",
        )
        cmd = [sys.executable, "-m", "supervisor", "--spool", str(daemon.spool.root)]
        cmd += ["status", "--json"]
        timings = [timed_call(cmd, daemon.env, workdir) for _ in range(calls)]
        size = Size(tasks, timings)
        say(
            NAME,
            f"{tasks} tasks, {RUNNING} running: status p50 {size.median_ms:.0f} ms, worst "
            f"{size.worst_ms:.0f} ms (calls {', '.join(f'{1000 * c.wall:.0f}' for c in timings)};"
            f" CPU p50 {size.cpu_ms:.0f} ms)",
        )
        return size


def run(quick: bool) -> list[Row]:
    return bench_run(NAME, quick, lambda workdir: measure(QUICK if quick else FULL, workdir, quick))


def measure(plan: Plan, workdir: Path, quick: bool) -> list[Row]:
    floor = 1000 * statistics.median(
        timed_run([sys.executable, "-c", "pass"], child_env(), workdir) for _ in range(5)
    )
    say(NAME, f"floor: python -c pass {floor:.0f} ms")
    sizes = [backlog(workdir / f"n{n}", n, plan.calls) for n in plan.sizes]
    rows: list[Row] = []
    for i, size in enumerate(sizes):
        at = f"@ {size.tasks:,} tasks, {RUNNING} running"
        judged = not quick and size.tasks == min(FULL.sizes)  # the target is stated at 500
        rows.append(
            Row(
                NAME,
                f"status --json latency {at}, median",
                "ms",
                size.median_ms,
                floor=floor,
                target=f"<= {TARGET_MS:g} ms" if judged else "",
                met=size.median_ms <= TARGET_MS if judged else None,
                note=(
                    f"`agentd status --json` as a fresh CLI process, start to exit, "
                    f"{plan.calls} calls, while {RUNNING} tasks are in their model call and "
                    "the rest are queued (max_workers 8). Floor: `python -c pass`."
                )
                if i == 0
                else "",
            )
        )
        rows.append(Row(NAME, f"status --json latency {at}, worst", "ms", size.worst_ms))
        rows.append(
            Row(
                NAME,
                f"status --json CPU time {at}, median",
                "ms",
                size.cpu_ms,
                note="User + system time of the status process: what the call costs on "
                "an idle core."
                if i == 0
                else "",
            )
        )
    return rows
