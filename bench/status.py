"""Status under a backlog: what ``agentd status --json`` costs when many tasks wait.

A real daemon with ``max_workers`` 8 is given a burst of scripted tasks at once (each one's
first model call sleeps for an hour), so 8 run and the rest wait ``queued``. Once the 8
are in their model call, ``status --json`` is timed as a fresh CLI process, start to exit,
several times: the median and the worst. The sizes are 500 and 5,000 tasks (full mode).
The running daemon answers (``supervisor.ask``, ``supervisor.status_socket``): the call
should cost what the interpreter costs to start. Each size is then timed once more with
the daemon killed (its workers live on), where the command line reads every task's files
itself.

Each size is timed twice in the same run: on the machine as it is ("quiet"), and with
three busy loops (``while True: pass``, one process each, killed after) beside it on the
machine's cores ("loaded"), as an operator's status call meets a busy host. The targets,
at 500 tasks: a median of at most ``TARGET_MS`` quiet and ``LOADED_TARGET_MS`` loaded.
Floors, timed the same two ways: a bare ``python -c pass`` (the interpreter and its
``site``: the least any CLI command costs) and ``python -S -c pass`` (the interpreter
alone).

Unlike ``bench/scale.py`` (idle workers, each of them running), this measures a spool
whose tasks mostly do not run: what status reads per task, not per worker.
"""

from __future__ import annotations

import contextlib
import statistics
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.report import Row
from bench.supervision import (
    Daemon,
    Timing,
    bench_run,
    child_env,
    config_text,
    end,
    idle_script,
    idle_workers,
    say,
    submit_scripted,
    timed_call,
    wait_until,
)

NAME = "status"
TARGET_MS = 100.0  # median at 500 tasks, quiet (issue 23, "Status under load")
LOADED_TARGET_MS = 200.0  # the same, with BUSY_LOOPS beside it
RUNNING = 8  # max_workers: the tasks that run while the rest wait
BUSY_LOOPS = 3
BUSY_LOOP = "while True: pass"
FLOOR_CALLS = 7


@dataclass(frozen=True)
class Plan:
    sizes: tuple[int, ...]  # tasks submitted at once, one daemon each
    calls: int  # status calls per size


FULL = Plan(sizes=(500, 5000), calls=15)
QUICK = Plan(sizes=(40,), calls=3)


@dataclass(frozen=True)
class Calls:
    """One command timed several times."""

    timings: list[Timing]

    @property
    def median_ms(self) -> float:
        return 1000 * statistics.median(c.wall for c in self.timings)

    @property
    def worst_ms(self) -> float:
        return 1000 * max(c.wall for c in self.timings)

    @property
    def cpu_ms(self) -> float:
        return 1000 * statistics.median(c.cpu for c in self.timings)

    def told(self) -> str:
        each = ", ".join(f"{1000 * c.wall:.0f}" for c in self.timings)
        return (
            f"p50 {self.median_ms:.0f} ms, worst {self.worst_ms:.0f} ms (calls {each}; "
            f"CPU p50 {self.cpu_ms:.0f} ms)"
        )


@dataclass(frozen=True)
class Size:
    tasks: int
    quiet: Calls
    loaded: Calls
    files: Calls  # quiet, with the daemon killed: the CLI reads every task's files


@dataclass(frozen=True)
class Floor:
    """``python -c pass`` (``site``) and ``python -S -c pass``, quiet and loaded."""

    site: Calls
    bare: Calls
    site_loaded: Calls
    bare_loaded: Calls


@contextlib.contextmanager
def busy_loops(workdir: Path, n: int = BUSY_LOOPS) -> Iterator[None]:
    """``n`` processes spinning on a core each for the block, killed after."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for _ in range(n):
            procs.append(subprocess.Popen([sys.executable, "-S", "-c", BUSY_LOOP], cwd=workdir))
        yield
    finally:
        for proc in procs:
            end(proc)


def timed(cmd: Sequence[str], env: dict[str, str], workdir: Path, calls: int) -> Calls:
    return Calls([timed_call(cmd, env, workdir) for _ in range(calls)])


def floor(workdir: Path) -> Floor:
    env = child_env()
    site, bare = [sys.executable, "-c", "pass"], [sys.executable, "-S", "-c", "pass"]
    quiet = timed(site, env, workdir, FLOOR_CALLS), timed(bare, env, workdir, FLOOR_CALLS)
    with busy_loops(workdir):
        loaded = timed(site, env, workdir, FLOOR_CALLS), timed(bare, env, workdir, FLOOR_CALLS)
    found = Floor(*quiet, *loaded)
    say(NAME, f"floor, quiet: python -c pass {found.site.told()}")
    say(NAME, f"floor, quiet: python -S -c pass {found.bare.told()}")
    say(NAME, f"floor, {BUSY_LOOPS} busy loops: python -c pass {found.site_loaded.told()}")
    say(NAME, f"floor, {BUSY_LOOPS} busy loops: python -S -c pass {found.bare_loaded.told()}")
    return found


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
        # the operator's command line reads the daemon's config, as `agentd status` does
        # where both find the same file
        cmd = [sys.executable, "-m", "supervisor", "--spool", str(daemon.spool.root)]
        cmd += ["--config", str(daemon.config_path), "status", "--json"]
        quiet = timed(cmd, daemon.env, workdir, calls)
        say(NAME, f"{tasks} tasks, {RUNNING} running, quiet: status {quiet.told()}")
        with busy_loops(workdir):
            loaded = timed(cmd, daemon.env, workdir, calls)
        say(NAME, f"{tasks} tasks, {BUSY_LOOPS} busy loops: status {loaded.told()}")
        end(daemon.proc)  # its workers live on; the CLI finds no daemon to ask
        files = timed(cmd, daemon.env, workdir, calls)
        say(NAME, f"{tasks} tasks, the daemon killed, quiet: status {files.told()}")
        return Size(tasks, quiet, loaded, files)


def run(quick: bool) -> list[Row]:
    return bench_run(NAME, quick, lambda workdir: measure(QUICK if quick else FULL, workdir, quick))


def measure(plan: Plan, workdir: Path, quick: bool) -> list[Row]:
    floors = floor(workdir)
    sizes = [backlog(workdir / f"n{n}", n, plan.calls) for n in plan.sizes]
    rows: list[Row] = []
    for i, size in enumerate(sizes):
        judged = not quick and size.tasks == min(FULL.sizes)  # the targets are stated at 500
        for how, calls, floor_calls, target in (
            ("quiet", size.quiet, floors.site, TARGET_MS),
            (f"{BUSY_LOOPS} busy loops", size.loaded, floors.site_loaded, LOADED_TARGET_MS),
        ):
            at = f"@ {size.tasks:,} tasks, {RUNNING} running, {how}"
            first = i == 0 and how == "quiet"
            rows.append(
                Row(
                    NAME,
                    f"status --json latency {at}, median",
                    "ms",
                    calls.median_ms,
                    floor=floor_calls.median_ms,
                    target=f"<= {target:g} ms" if judged else "",
                    met=calls.median_ms <= target if judged else None,
                    note=(
                        f"`agentd status --json` as a fresh CLI process, start to exit, "
                        f"{plan.calls} calls, while {RUNNING} tasks are in their model call "
                        "and the rest are queued (max_workers 8); quiet, then with "
                        f"{BUSY_LOOPS} `{BUSY_LOOP}` processes beside it. Floor: "
                        "`python -c pass`, timed the same way."
                    )
                    if first
                    else "",
                )
            )
            rows.append(
                Row(
                    NAME,
                    f"status --json latency {at}, worst",
                    "ms",
                    calls.worst_ms,
                    floor=floor_calls.worst_ms,
                )
            )
            rows.append(
                Row(
                    NAME,
                    f"status --json CPU time {at}, median",
                    "ms",
                    calls.cpu_ms,
                    floor=floor_calls.cpu_ms,
                    note="User + system time of the status process: what the call costs on "
                    "an idle core."
                    if first
                    else "",
                )
            )
    for size in sizes:
        rows.append(
            Row(
                NAME,
                f"status --json latency @ {size.tasks:,} tasks, the daemon killed, quiet, median",
                "ms",
                size.files.median_ms,
                floor=floors.site.median_ms,
                note="With no daemon to ask, the command line reads every task's files "
                "itself (as it does on a shared store): the answer above without the "
                "daemon's kept rows."
                if size is sizes[0]
                else "",
            )
        )
    for how, bare, site in (
        ("quiet", floors.bare, floors.site),
        (f"{BUSY_LOOPS} busy loops", floors.bare_loaded, floors.site_loaded),
    ):
        rows.append(
            Row(
                NAME,
                f"python -c pass (site) against python -S -c pass, {how}, median",
                "ms",
                site.median_ms,
                floor=bare.median_ms,
                note="What `site` (and the packages it finds) adds to every command: the "
                "floor above, against the interpreter alone."
                if how == "quiet"
                else "",
            )
        )
    return rows
