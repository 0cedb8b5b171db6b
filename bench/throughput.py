"""Throughput benchmark: many short scripted tasks through ``max_workers = 8``, against the
cost of starting as many bare processes.

``TASKS`` one-turn scripted tasks (the model answers with text at once, the task is done)
are made with ``supervisor.submit.submit`` in a staging spool beforehand, then moved into
the spool of a running daemon (one ``rename`` and one doorbell each): the clock runs
from the first move to the daemon's last ``task_done``, so it holds the daemon's work
(scheduling, records, events, forks) and the workers' (lock, journal, exit record), not
the submission's.

The three runs below are interleaved, ``ROUNDS`` times in full mode, and each figure is
its best round: this machine is shared, and the least disturbed round is the closest to
what the work costs (every round is printed).

* **floor**: ``TASKS`` bare ``python -c pass`` processes, 8 at a time (fork + exec of a
  fresh interpreter, what any supervisor without a fork server pays per task).
* **worker alone**: the same tasks run by the same worker code, forked 8 at a time from a
  warm process that preloaded what the fork server preloads, with no daemon at all. What
  agentd takes beyond this is the daemon's own overhead.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bench.report import Row
from bench.supervision import (
    Daemon,
    bench_run,
    child_env,
    config_text,
    machine_load,
    one_turn_script,
    say,
    submit_scripted,
    wait_until,
)
from worker.config import Config
from worker.spool import Spool

NAME = "throughput"
WIDTH = 8  # max_workers
TARGET_MS = 5.0  # daemon overhead per task

#: Runs ``sys.argv[2]`` tasks of the spool ``sys.argv[1]`` with the worker forked WIDTH at
#: a time from this warm process; prints the seconds from the first fork to the last exit.
WORKER_ALONE = f"""
import os, sys, time
from worker.forkserver import preload
preload()
from worker.__main__ import main
root, n = sys.argv[1], int(sys.argv[2])
ids = sorted(os.listdir(os.path.join(root, "tasks")))[:n]
t0, running, failed = time.monotonic(), 0, 0
for task_id in ids + [None] * {WIDTH}:
    if running == {WIDTH} or (task_id is None and running):
        _, status = os.wait()
        running -= 1
        failed += os.waitstatus_to_exitcode(status) != 0
    if task_id is None:
        continue
    pid = os.fork()
    if pid == 0:
        fd = os.open(os.devnull, os.O_WRONLY)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os._exit(main([os.path.join(root, "tasks", task_id)]))
    running += 1
print(time.monotonic() - t0, failed)
"""


@dataclass(frozen=True)
class Plan:
    tasks: int
    rounds: int


FULL = Plan(tasks=1000, rounds=3)
QUICK = Plan(tasks=50, rounds=1)


def stage(spool: Spool, n: int, scratch: Path) -> list[str]:
    config, script = Config(), one_turn_script()
    return [submit_scripted(spool, config, script, f"t{k:05d}", scratch).id for k in range(n)]


def copy_of(template: Spool, root: Path) -> Spool:
    """A spool at ``root`` holding a copy of ``template``'s tasks (made once, copied for
    each run: much faster than submitting them again)."""
    spool = Spool(root).ensure()
    spool.tasks_dir.rmdir()
    shutil.copytree(template.tasks_dir, spool.tasks_dir, symlinks=True)
    return spool


def run_agentd(workdir: Path, n: int, template: Spool | None = None) -> tuple[float, int]:
    """(seconds from the first task moved in to the last task_done, tasks not done)."""
    if template is None:
        template = Spool(workdir / "template").ensure()
        stage(template, n, workdir)
    staging = copy_of(template, workdir / "staging")
    ids = staging.task_ids()
    with Daemon(workdir / "agentd", config_text(max_workers=WIDTH)) as daemon:
        daemon.start()
        target = daemon.spool.tasks_dir
        t0 = time.monotonic()
        for task_id in ids:
            os.rename(staging.tasks_dir / task_id, target / task_id)
        daemon.launch([daemon.spool.task(task_id) for task_id in ids])

        def finished() -> int:
            return len(daemon.events("task_done")) + len(daemon.events("task_failed"))

        wait_until(lambda: finished() >= n, 60 + n, 0.01, f"{n} tasks to finish")
        took = time.monotonic() - t0
        return took, len(daemon.events("task_failed"))


def run_bare(workdir: Path, n: int) -> float:
    """Seconds to run ``n`` bare ``python -c pass`` processes, WIDTH at a time."""
    env = child_env()
    cmd = [sys.executable, "-c", "pass"]
    t0 = time.monotonic()
    running: list[subprocess.Popen[bytes]] = []
    try:
        for _ in range(n):
            if len(running) == WIDTH:
                running.pop(0).wait()
            running.append(subprocess.Popen(cmd, env=env, cwd=workdir))
        for proc in running:
            proc.wait()
    finally:
        for proc in running:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return time.monotonic() - t0


def run_worker_alone(workdir: Path, n: int, template: Spool) -> tuple[float, int]:
    spool = copy_of(template, workdir / "alone")
    done = subprocess.run(
        [sys.executable, "-c", WORKER_ALONE, str(spool.root), str(n)],
        env=child_env(),
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=600 + n,
        check=True,
        start_new_session=True,
    )
    took, failed = done.stdout.split()
    return float(took), int(failed)


def run(quick: bool) -> list[Row]:
    plan = QUICK if quick else FULL
    return bench_run(NAME, quick, lambda workdir: measure(plan, workdir), f", {plan.tasks:,} tasks")


def measure(plan: Plan, workdir: Path) -> list[Row]:
    n = plan.tasks
    template = Spool(workdir / "template").ensure()
    stage(template, n, workdir)
    runs: dict[str, list[float]] = {"agentd": [], "bare": [], "alone": []}
    for r in range(plan.rounds):
        here = workdir / f"round{r}"
        bare = run_bare(workdir, n)
        agentd, failed = run_agentd(here / "a", n, template)
        alone, alone_failed = run_worker_alone(here / "w", n, template)
        shutil.rmtree(here, ignore_errors=True)
        runs["agentd"].append(agentd)
        runs["bare"].append(bare)
        runs["alone"].append(alone)
        say(
            NAME,
            f"round {r + 1}: agentd {agentd:.2f} s ({n / agentd:.0f}/s, {failed} failed); "
            f"floor ({n:,} x `python -c pass`, {WIDTH} at a time) {bare:.2f} s; worker "
            f"alone {alone:.2f} s ({alone_failed} failed); {machine_load()}",
        )
    agentd, bare, alone = min(runs["agentd"]), min(runs["bare"]), min(runs["alone"])

    overhead = 1000 * (agentd - bare) / n
    daemon_only = 1000 * (agentd - alone) / n
    return [
        Row(
            NAME,
            f"{n:,} one-turn scripted tasks, max_workers {WIDTH}: wall",
            "s",
            agentd,
            floor=bare,
            note=f"From the first task moved into the spool to the last task_done. Floor: "
            f"{n:,} bare `python -c pass` processes (fork + exec), {WIDTH} at a time. Best "
            f"of {plan.rounds} interleaved round(s) each.",
        ),
        Row(
            NAME,
            "tasks per second",
            "/s",
            n / agentd,
            floor=n / bare,
        ),
        Row(
            NAME,
            "overhead per task over bare process starts",
            "ms",
            overhead,
            target=f"< {TARGET_MS:g} ms",
            met=overhead < TARGET_MS,
            compare=False,
            note="(agentd wall - floor wall) / tasks. Holds everything agentd does for a "
            "task beyond starting a process: the daemon's scheduling, records and events, "
            "and the worker's own durable writes (lock, journal, exit record).",
        ),
        Row(
            NAME,
            "daemon overhead per task over the worker alone",
            "ms",
            daemon_only,
            floor=1000 * alone / n,
            compare=False,
            note=f"(agentd wall - worker-alone wall) / tasks. Worker alone: the same tasks "
            f"run by the same worker code forked {WIDTH} at a time from a warm process "
            "without any daemon (its wall per task is the floor column).",
        ),
    ]
