"""Held tasks at rest: what the daemon's rescan costs when many long tasks wait for an
operator.

A spool of held tasks (each a journal of many turns whose last call, unsafe, is held:
``worker.testing.journals``) is scanned by the daemon's own code
(``Supervisor.rescan``, in this process): the first scan reads each task's holds and
decisions (``pending_decisions``, from its snapshot and the records after it: these
journals have none, a worker's latest is at most ``SNAPSHOT_EVERY`` turns back), the
later ones only look at each task's decisions folder and journal (``held_mark``) and
read nothing while those stand still. The daemon rescans every ``RESCAN_INTERVAL``
seconds, so a rescan's cost over that interval is its share of a core at rest; the
target (the house issue): at most 2% with 30 held tasks of 1,000 turns. Floor: the first
scan, what every rescan cost before the marks.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench.report import Row
from bench.supervision import bench_run, say
from supervisor.daemon import Supervisor
from supervisor.decisions import pending_decisions
from supervisor.placement import RACY_NS, RESCAN_INTERVAL
from supervisor.record import TaskRecord
from supervisor.stores import store_of
from supervisor.submit import submit
from worker.config import Config
from worker.protocol import TaskStatus
from worker.spool import Spool
from worker.testing.journals import held_call, long_journal

NAME = "held"
TARGET_SHARE = 2.0  # % of a core


@dataclass(frozen=True)
class Plan:
    tasks: int
    turns: int
    rescans: int


FULL = Plan(tasks=30, turns=1000, rescans=20)
QUICK = Plan(tasks=5, turns=200, rescans=5)


def held_spool(root: Path, plan: Plan) -> Spool:
    spool = Spool(root / "spool")
    config = Config()
    for n in range(plan.tasks):
        task = submit(spool, config, prompt="Hold.", name=f"held-{n:03d}")
        long_journal(store_of(task), task.id, plan.turns)
        held_call(store_of(task), task.id, plan.turns + 1)
        record = TaskRecord.load(task)
        record.state = TaskStatus.HELD
        record.save(task)
    return spool


def timed(action: Callable[[], object]) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def run(quick: bool) -> list[Row]:
    return bench_run(NAME, quick, lambda workdir: measure(QUICK if quick else FULL, workdir))


def measure(plan: Plan, workdir: Path) -> list[Row]:
    say(NAME, f"{plan.tasks} held tasks of {plan.turns:,} turns")
    spool = held_spool(workdir, plan)
    time.sleep(RACY_NS / 1e9 + 0.1)  # the files' change times settle (``held_mark``)
    daemon = Supervisor(spool, Config(), preload=False)
    first = timed(daemon.rescan)
    assert all(s.record.state == TaskStatus.HELD for s in daemon.slots.values())
    later = statistics.median(timed(daemon.rescan) for _ in range(plan.rescans))
    tasks = [slot.task for slot in daemon.slots.values()]
    before = later + statistics.median(  # (each rescan reading every hold, as before)
        timed(lambda: [pending_decisions(task) for task in tasks])
        for _ in range(max(3, plan.rescans // 4))
    )
    share = 100 * later / RESCAN_INTERVAL
    shape = f"{plan.tasks} held tasks of {plan.turns:,} turns"
    return [
        Row(NAME, f"first scan, {shape} (reads every hold)", "ms", 1000 * first, compare=False),
        Row(
            NAME,
            f"rescan, {shape}, median",
            "ms",
            1000 * later,
            floor=1000 * before,
            target="(floor: each rescan reading every hold, as before)",
        ),
        Row(
            NAME,
            f"rescan's share of a core at rest (one every {RESCAN_INTERVAL:.0f} s)",
            "%",
            share,
            floor=100 * before / RESCAN_INTERVAL,
            target=f"<= {TARGET_SHARE:.0f}%",
            met=share <= TARGET_SHARE,
        ),
    ]
