"""Liveness verdicts on the monotonic clock (``supervisor.liveness``), with injected time.

The verdict is a pure function of the beat, the worker's start, now and the limits; the
wall clock reaches it only through ``Beat.of``, and only for a heartbeat of an earlier
release (no monotonic stamps). The daemon's side, that an ended worker is an exit and not
a hang, runs the daemon's ``LivenessWatch.check_due`` on a real process that has exited.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from supervisor.daemon import Supervisor
from supervisor.liveness import (
    Alive,
    Beat,
    Hung,
    KilledHung,
    Limits,
    Stalled,
    hung_by_deadman,
    judge,
    phase_limit,
)
from supervisor.record import TaskRecord
from supervisor.status import status_row
from supervisor.watch import Watch, sleep_to_grid
from supervisor.workers import WorkerProcess
from tests.support import make_spool, poll_for, scripted_task, text
from worker.config import Config, HeartbeatConfig
from worker.events import read_events
from worker.protocol import TaskStatus

LIMITS = Limits(interval=0.5, timeout=2.0, model_call=10.0, tool_call=6.0)
HOUR = 3600.0


def beat(at: float, phase: str = "idle", started: float | None = None, **more: float) -> Beat:
    return Beat(at=at, phase=phase, phase_started=at if started is None else started, **more)


def written(wall: float, mono: float, **fields: object) -> dict[str, object]:
    """A heartbeat as a worker of this release writes it at (wall, mono)."""
    return {
        "pid": 1,
        "at": wall,
        "at_mono": mono,
        "turn": 0,
        "phase": "model",
        "phase_started": wall,
        "phase_started_mono": mono,
        **fields,
    }


def test_a_fresh_beat_is_alive_until_the_timeout_or_the_shortest_limit() -> None:
    assert judge(beat(100.0), spawned=90.0, now=100.5, limits=LIMITS) == Alive(102.0)
    assert judge(None, spawned=100.0, now=100.1, limits=LIMITS) == Alive(102.0)


def test_a_silent_heartbeat_is_hung_once_past_the_timeout() -> None:
    assert judge(beat(100.0), spawned=90.0, now=102.0, limits=LIMITS) == Alive(102.0)
    assert judge(beat(100.0), spawned=90.0, now=102.01, limits=LIMITS) == Hung(age=102.01 - 100.0)
    assert isinstance(judge(None, spawned=100.0, now=102.5, limits=LIMITS), Hung)


def test_a_phase_past_its_deadline_is_stalled_and_its_deadline_bounds_alive() -> None:
    live = beat(200.0, phase="model", started=195.0)
    assert judge(live, spawned=0.0, now=200.5, limits=LIMITS) == Alive(202.0)
    near = beat(200.0, phase="tool:run_command", started=195.0)
    assert judge(near, spawned=0.0, now=200.5, limits=LIMITS) == Alive(201.0)
    assert judge(near, spawned=0.0, now=201.5, limits=LIMITS) == Stalled("tool:run_command", 6.5)
    assert judge(beat(200.0, started=0.0), spawned=0.0, now=201.5, limits=LIMITS) == Alive(202.0)


def test_a_summary_call_has_the_model_calls_deadline() -> None:
    summary = beat(200.0, phase="compaction", started=192.5)  # past tool_call, not model_call
    assert judge(summary, spawned=0.0, now=200.5, limits=LIMITS) == Alive(202.0)
    later = beat(202.9, phase="compaction", started=192.5)
    assert judge(later, spawned=0.0, now=203.0, limits=LIMITS) == Stalled("compaction", 10.5)
    assert phase_limit("compaction", LIMITS) == LIMITS.model_call


def test_a_worker_beating_slower_than_the_config_gets_the_difference() -> None:
    """A reload that shortens heartbeat.interval and timeout never kills a worker started
    under the old, slower interval as hung."""
    slow = beat(100.0, interval=1.5)
    assert judge(slow, spawned=0.0, now=103.0, limits=LIMITS) == Alive(103.0)
    assert isinstance(judge(slow, spawned=0.0, now=103.1, limits=LIMITS), Hung)
    fast = beat(100.0, interval=0.1)  # faster than the config: no discount
    assert isinstance(judge(fast, spawned=0.0, now=102.1, limits=LIMITS), Hung)


def test_a_worker_with_its_own_dead_man_is_read_again_only_when_a_deadline_could_pass() -> None:
    """Its hang is its kernel timer's to end: no instant at the timeout to wake for, only
    its phase's deadline or, for a phase begun after the read, the shortest deadline."""
    own = beat(100.0, deadman=2.0)
    assert judge(own, spawned=0.0, now=100.5, limits=LIMITS) == Alive(106.5)
    calling = beat(100.0, phase="model", started=99.0, deadman=2.0)
    assert judge(calling, spawned=0.0, now=100.5, limits=LIMITS) == Alive(106.5)
    tool = beat(100.0, phase="tool:run_command", started=96.0, deadman=2.0)
    assert judge(tool, spawned=0.0, now=100.5, limits=LIMITS) == Alive(102.0)
    # a beat found older than the timeout all the same is hung, dead-man or not
    assert isinstance(judge(own, spawned=0.0, now=102.1, limits=LIMITS), Hung)


def test_a_dead_man_longer_than_the_timeout_leaves_the_verdict_to_the_daemon() -> None:
    """After a reload shortened heartbeat.timeout below what the worker arms, the daemon
    judges its beat's age itself (with the slower worker's difference, as ever)."""
    longer = beat(100.0, deadman=5.0)
    assert judge(longer, spawned=0.0, now=100.5, limits=LIMITS) == Alive(102.0)
    slower = beat(100.0, interval=1.5, deadman=3.0)  # within timeout + the difference
    assert judge(slower, spawned=0.0, now=100.5, limits=LIMITS) == Alive(106.5)


def test_a_sigkill_past_the_dead_man_s_deadline_is_a_hang_and_nothing_else_is() -> None:
    own = beat(100.0, deadman=2.0)
    assert hung_by_deadman(own, "SIGKILL", now=102.25) == KilledHung(age=2.25, deadman=2.0)
    assert hung_by_deadman(own, "SIGKILL", now=101.9) is None  # a kill -9 before its time
    assert hung_by_deadman(own, "SIGTERM", now=105.0) is None
    assert hung_by_deadman(own, None, now=105.0) is None
    assert hung_by_deadman(beat(100.0), "SIGKILL", now=105.0) is None  # no dead-man armed
    assert hung_by_deadman(None, "SIGKILL", now=105.0) is None


def test_a_beat_is_the_worker_s_own_only_with_its_pid_and_shape() -> None:
    data = written(5e8, 50.0, pid=7, deadman=2.0)
    assert Beat.of_worker(data, 7, wall=5e8, mono=50.0) == Beat(
        at=50.0, phase="model", phase_started=50.0, interval=None, deadman=2.0
    )
    assert Beat.of_worker(data, 8, wall=5e8, mono=50.0) is None  # a previous worker's
    assert Beat.of_worker({**data, "deadman": "2"}, 7, wall=5e8, mono=50.0) is None
    assert Beat.of_worker(None, 7, wall=5e8, mono=50.0) is None


@given(step=st.floats(-2 * HOUR, 2 * HOUR), age=st.floats(0.0, 20.0))
def test_a_stepped_wall_clock_changes_no_verdict(step: float, age: float) -> None:
    """The beat was written at mono 1000 (wall 5e8); it is read `age` seconds later, with
    the wall clock stepped by `step` in between: the verdict is that of no step."""
    data = written(5e8, 1000.0)
    mono = 1000.0 + age
    stepped = judge(Beat.of(data, 5e8 + age + step, mono), 900.0, mono, LIMITS)
    assert stepped == judge(Beat.of(data, 5e8 + age, mono), 900.0, mono, LIMITS)
    assert math.isclose(Beat.of(data, 5e8 + age + step, mono).age(mono), age, abs_tol=1e-9)


def test_a_beat_of_an_earlier_release_is_judged_by_the_wall_clock() -> None:
    """No monotonic stamps (a worker adopted from the previous release): its wall times
    are carried over to the monotonic clock as they read now."""
    old = {"pid": 1, "at": 5e8, "turn": 0, "phase": "model", "phase_started": 5e8 - 4}
    got = Beat.of(old, wall=5e8 + 1.0, mono=50.0)
    assert got == Beat(at=49.0, phase="model", phase_started=45.0, interval=None)
    assert judge(got, spawned=0.0, now=50.0, limits=LIMITS) == Alive(51.0)
    assert Beat.of(old, wall=5e8 - HOUR, mono=50.0).age(50.0) == 0.0  # never below 0


def test_status_heartbeat_age_follows_the_monotonic_clock(tmp_path: Path) -> None:
    spool = make_spool(tmp_path)
    task = scripted_task(spool, [{"content": [text("hi")]}], config=Config())
    record = TaskRecord.load(task)
    record.state = TaskStatus.RUNNING
    record.save(task)
    for step in (HOUR, -HOUR):  # the wall stamp an hour off either way
        beat_file = written(time.time() + step, time.monotonic() - 1.0)
        task.heartbeat.write_text(json.dumps(beat_file))
        age = status_row(task)["heartbeat_age"]
        assert 1.0 <= age < 5.0, f"wall stepped {step:+.0f} s: heartbeat_age {age}"
    legacy = {"pid": 1, "at": time.time() + HOUR, "turn": 0, "phase": "idle"}
    task.heartbeat.write_text(json.dumps(legacy))
    assert status_row(task)["heartbeat_age"] == 0.0  # clamped, never negative


def test_a_worker_that_ended_is_settled_as_an_exit_not_judged_hung(tmp_path: Path) -> None:
    """A daemon stopped (SIGSTOP) past the heartbeat timeout wakes with a verdict due on a
    worker that exited meanwhile: its exit is handled, and no `worker_hung` logged."""
    spool = make_spool(tmp_path)
    task = scripted_task(spool, [{"content": [text("hi")]}], config=Config())
    config = Config(heartbeat=HeartbeatConfig(interval=0.1, timeout=0.5))

    async def scenario() -> list[str]:
        supervisor = Supervisor(spool, config, preload=False)
        supervisor.rescan()
        slot = supervisor.slots[task.id]
        proc = subprocess.Popen([sys.executable, "-c", "pass"])
        worker = WorkerProcess(task, proc.pid, os.pidfd_open(proc.pid), proc)
        supervisor.launcher.attach(slot, worker)
        poll_for(worker.exited, 10, what="the stand-in worker to exit")
        (task.exit).write_text(json.dumps({"pid": proc.pid, "code": 0, "reason": "end_turn"}))
        supervisor.liveness.check_due(time.time(), time.monotonic() + 60.0)  # long past due
        assert slot.worker is None
        return [e["event"] for e in read_events(slot.task.events)]

    events = asyncio.run(scenario())
    assert "worker_hung" not in events
    assert events[-2:] == ["worker_exited", "task_done"]


# -- the watch: one timer per instant a verdict could be due ------------------------------


def test_the_watch_checks_each_worker_when_its_verdict_could_be_due_and_not_before() -> None:
    async def scenario() -> list[tuple[str, float]]:
        loop = asyncio.get_running_loop()
        seen: list[tuple[str, float]] = []
        again: dict[str, list[float | None]] = {"a": [0.05, None], "b": [None]}  # a twice, b once

        def check(key: str, wall: float, mono: float) -> float | None:
            seen.append((key, mono))
            step = again[key].pop(0)
            return None if step is None else mono + step

        watch: Watch[str] = Watch(check, grid=0.01)
        start = loop.time()
        watch.arm("a", start + 0.05)
        watch.arm("b", start + 0.1)
        watch.arm("c", start + 0.02)
        watch.disarm("c")  # (its worker ended: never looked at)
        await asyncio.sleep(0.3)
        return [(key, at - start) for key, at in seen]

    seen = asyncio.run(scenario())
    assert [key for key, _ in seen] == ["a", "b", "a"]
    assert seen[0][1] >= 0.05 and seen[1][1] >= 0.1 and seen[2][1] >= 0.1


def test_the_watch_gives_every_verdict_due_at_once_to_a_loop_that_woke_late() -> None:
    async def scenario() -> tuple[list[str], list[str]]:
        seen: list[str] = []

        def check(key: str, wall: float, mono: float) -> float | None:
            seen.append(key)
            return None

        watch: Watch[str] = Watch(check, grid=0.01)
        now = asyncio.get_running_loop().time()
        watch.arm("soon", now + 10.0)
        watch.arm("late", now + 100.0)
        watch.check_due(time.time(), now + 50.0)  # a daemon stopped for 50 s
        due_after_wake = list(seen)
        watch.rearm_all(now)  # a reload: every worker judged again at once
        await asyncio.sleep(0.05)
        return due_after_wake, seen

    due, seen = asyncio.run(scenario())
    assert due == ["soon"]
    assert sorted(seen[1:]) == ["late"]  # "soon" asked for no next look: watched no more


def test_workers_due_within_one_grid_step_share_its_one_timer_and_none_is_early() -> None:
    async def scenario() -> tuple[int, int, list[tuple[str, float, float]]]:
        loop = asyncio.get_running_loop()
        seen: list[tuple[str, float, float]] = []
        due: dict[str, float] = {}

        def check(key: str, wall: float, mono: float) -> float | None:
            seen.append((key, due[key], mono))
            return None

        watch: Watch[str] = Watch(check, grid=0.1)
        start = loop.time()
        for k in range(50):  # fifty workers due over 0.1 s: at most two grid instants
            due[f"w{k}"] = start + 0.1 + k * 0.002
            watch.arm(f"w{k}", due[f"w{k}"])
        shared = watch.timers
        watch.disarm("w0")
        watch.disarm("w49")
        await asyncio.sleep(0.5)
        return shared, watch.timers, seen

    shared, left, seen = asyncio.run(scenario())
    assert shared <= 2 and left == 0
    assert sorted(key for key, _, _ in seen) == sorted(f"w{k}" for k in range(1, 49))
    assert all(mono >= at for _, at, mono in seen)  # rounded up, never early
    assert len({mono for _, _, mono in seen}) <= 2  # one wake-up per timer, all due at it


def test_the_tick_sleeps_to_the_watch_s_grid_and_wakes_with_the_checks_due_there() -> None:
    async def scenario() -> tuple[float, float, list[float]]:
        loop = asyncio.get_running_loop()
        seen: list[float] = []
        watch: Watch[str] = Watch(lambda key, wall, mono: seen.append(mono), grid=0.05)
        start = loop.time()
        watch.arm("w", start + 0.06)  # due at the grid instant after it
        await sleep_to_grid(0.06, grid=0.05)
        return start, loop.time(), seen

    start, woke, seen = asyncio.run(scenario())
    instant = math.ceil((start + 0.06) / 0.05) * 0.05
    assert woke >= instant and woke >= start + 0.06
    assert len(seen) == 1 and instant <= seen[0] <= woke  # the check due there ran by then


def test_a_check_that_fails_loses_no_other_worker_due_at_its_instant_and_is_judged_again() -> None:
    async def scenario() -> list[str]:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(lambda loop, context: None)  # (the fault is logged)
        seen: list[str] = []

        def check(key: str, wall: float, mono: float) -> float | None:
            seen.append(key)
            if key == "bad" and seen.count("bad") == 1:
                raise OSError("a check's own fault")
            return None

        watch: Watch[str] = Watch(check, grid=0.05)
        start = loop.time()
        for key in ("a", "bad", "b"):  # all due at one instant, "bad" before "b"
            watch.arm(key, start + 0.01)
        await asyncio.sleep(0.3)
        return seen

    seen = asyncio.run(scenario())
    assert sorted(seen) == ["a", "b", "bad", "bad"]  # "b" judged, "bad" judged again
