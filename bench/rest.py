"""A spool at rest: what the daemon's rescan costs when many tasks wait for an operator or
have ended.

Two spools, each scanned by the daemon's own code (``Supervisor.rescan``, in this
process): held tasks, each a journal of many turns whose last call, unsafe, is held
(``worker.testing.journals``; these journals have no snapshot, the worst case: a
worker's latest is at most ``SNAPSHOT_EVERY`` turns back), and finished tasks, as a spool
that keeps every task it ran. A rescan skips a task at rest whose folder, events,
decisions and journal stand still since its last scan (``TaskStore.rest_mark``: a few
``stat`` calls); before, it read each one's requests, and each held task's holds and
decisions, at every rescan: that is the floor here, timed as a doorbell for every task
(which reads each whatever its mark). The daemon rescans every ``RESCAN_INTERVAL``
seconds, so a rescan over that interval is its share of a core at rest; the target (the
house issue): at most 2% with 30 held tasks of 1,000 turns.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench.report import Row
from bench.supervision import bench_run, say
from supervisor.daemon import Supervisor
from supervisor.placement import RESCAN_INTERVAL
from supervisor.record import TaskRecord
from supervisor.stores import store_of
from supervisor.submit import submit
from worker.config import Config
from worker.protocol import TaskStatus
from worker.spool import Spool, TaskDir
from worker.store.files import RACY_NS
from worker.testing.journals import held_call, long_journal

NAME = "rest"
TARGET_SHARE = 2.0  # % of a core


@dataclass(frozen=True)
class Plan:
    held: int  # held tasks
    turns: int  # turns of each
    finished: int  # finished tasks
    rescans: int


FULL = Plan(held=30, turns=1000, finished=1000, rescans=20)
QUICK = Plan(held=5, turns=200, finished=100, rescans=5)


def made(spool: Spool, name: str, state: TaskStatus) -> TaskDir:
    task = submit(spool, Config(), prompt="Rest.", name=name)
    record = TaskRecord.load(task)
    record.state = state
    record.save(task)
    return task


def held_spool(root: Path, plan: Plan) -> Spool:
    spool = Spool(root / "held")
    for n in range(plan.held):
        task = made(spool, f"held-{n:03d}", TaskStatus.HELD)
        long_journal(store_of(task), task.id, plan.turns)
        held_call(store_of(task), task.id, plan.turns + 1)
    return spool


def finished_spool(root: Path, plan: Plan) -> Spool:
    spool = Spool(root / "finished")
    for n in range(plan.finished):
        made(spool, f"done-{n:04d}", TaskStatus.DONE)
    return spool


def timed(action: Callable[[], object]) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def run(quick: bool) -> list[Row]:
    return bench_run(NAME, quick, lambda workdir: measure(QUICK if quick else FULL, workdir))


def measure(plan: Plan, workdir: Path) -> list[Row]:
    say(NAME, f"{plan.held} held tasks of {plan.turns:,} turns; {plan.finished:,} finished")
    spools = {
        f"{plan.held} held tasks of {plan.turns:,} turns": held_spool(workdir, plan),
        f"{plan.finished:,} finished tasks": finished_spool(workdir, plan),
    }
    time.sleep(RACY_NS / 1e9 + 0.1)  # the files' change times settle (``rest_mark``)
    rows: list[Row] = []
    for shape, spool in spools.items():
        daemon = Supervisor(spool, Config(), preload=False)
        first = timed(daemon.rescan)
        assert all(s.record.state != TaskStatus.QUEUED for s in daemon.slots.values())
        ids = set(daemon.slots)
        rest = statistics.median(timed(daemon.rescan) for _ in range(plan.rescans))
        ring_all = functools.partial(daemon.placement.ring, ids)
        every = statistics.median(  # (a doorbell reads each task whatever its mark: before)
            timed(ring_all) for _ in range(max(3, plan.rescans // 4))
        )
        share = 100 * rest / RESCAN_INTERVAL
        rows += [
            Row(NAME, f"first scan, {shape}", "ms", 1000 * first, compare=False),
            Row(
                NAME,
                f"rescan at rest, {shape}, median",
                "ms",
                1000 * rest,
                floor=1000 * every,
                target="(floor: every task read, as each rescan did before)",
            ),
            Row(
                NAME,
                f"its share of a core (one every {RESCAN_INTERVAL:.0f} s), {shape}",
                "%",
                share,
                floor=100 * every / RESCAN_INTERVAL,
                target=f"<= {TARGET_SHARE:.0f}%",
                met=share <= TARGET_SHARE,
            ),
        ]
    return rows
