"""The kernel's kill (``worker.killtimer``) on real processes: a stopped process dies at
its deadline, re-arming moves the deadline, disarming takes it back; and the lease keeper
arms it before a tool, moves it at each renewal and takes it back while a result waits."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import pytest

from worker.errors import FencedError
from worker.killtimer import KillTimer, boottime
from worker.lease import KILL_MARGIN, MARGIN, LeaseKeeper
from worker.store.base import Owner, TaskStore

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _timers_here() -> None:
    made = KillTimer.create()
    if isinstance(made, str):
        pytest.skip(made)
    made.close()


@contextlib.contextmanager
def armed(steps: str) -> Iterator[tuple[subprocess.Popen[str], list[float]]]:
    """A Python child that makes a kill timer, runs ``steps`` (``t`` the timer, ``now`` the
    boot clock), printing each deadline it arms as ``deadline SECONDS``, then sleeps, and
    exits 0 after 30 s if nothing killed it."""
    code = (
        textwrap.dedent(
            """
        import sys, time
        from worker.killtimer import KillTimer, boottime as now
        t = KillTimer.create()
        def arm(at):
            t.arm_at(at)
            print("deadline", at, flush=True)
        """
        )
        + textwrap.dedent(steps)
        + "\nprint('ready', flush=True)\ntime.sleep(30)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    deadlines: list[float] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("deadline"):
                deadlines.append(float(line.split()[1]))
            if line.startswith("ready"):
                break
        yield proc, deadlines
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def test_a_stopped_process_dies_at_its_deadline() -> None:
    with armed("arm(now() + 0.5)") as (proc, deadlines):
        proc.send_signal(signal.SIGSTOP)
        assert proc.wait(timeout=20) == -signal.SIGKILL
        died = boottime()
        assert died >= deadlines[-1]
        print(f"killed while stopped {died - deadlines[-1]:.3f} s after its deadline")


def test_re_arming_moves_the_deadline() -> None:
    with armed("arm(now() + 0.3)\narm(now() + 1.5)") as (proc, deadlines):
        proc.send_signal(signal.SIGSTOP)
        assert proc.wait(timeout=20) == -signal.SIGKILL
        assert boottime() >= deadlines[-1] > deadlines[0]


def test_disarming_takes_the_kill_back() -> None:
    with armed("arm(now() + 0.3)\nt.disarm()\ntime.sleep(1.0)\nsys.exit(0)") as (proc, _):
        assert proc.wait(timeout=20) == 0


def test_a_deadline_already_past_kills_at_once() -> None:
    with armed("arm(now() - 5)") as (proc, _):
        assert proc.wait(timeout=20) == -signal.SIGKILL


def test_a_heartbeat_s_dead_man_spares_a_beating_worker_and_kills_a_stopped_one(
    tmp_path: Path,
) -> None:
    """Each beat arms the monotonic kill timer a timeout ahead (``worker.heartbeat``): a
    worker that beats outlives many timeouts; one stopped (SIGSTOP) dies of SIGKILL a
    timeout after its last beat, and that beat says the dead-man it armed."""
    beats = tmp_path / "beats"
    code = textwrap.dedent(
        f"""
        import json, time
        from worker.heartbeat import Heartbeat
        from worker.killtimer import CLOCK_MONOTONIC, KillTimer
        def publish(data):
            with open({str(beats)!r}, "a") as out:
                out.write(json.dumps(data) + "\\n")
        timer = KillTimer.create(CLOCK_MONOTONIC)
        Heartbeat(publish, 0.05, deadman=(timer, 0.4)).start()
        print("ready", flush=True)
        time.sleep(30)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=1.5)  # beating: the deadline moves on
        proc.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        assert proc.wait(timeout=20) == -signal.SIGKILL
        died = time.monotonic()
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    last = json.loads(beats.read_text().splitlines()[-1])
    assert last["deadman"] == 0.4
    assert died >= last["at_mono"] + 0.4
    assert died - stopped < 0.4 + 5.0  # the kernel's kill, not the test's
    print(f"killed {died - last['at_mono']:.3f} s after its last beat (dead-man 0.4 s)")


class Renews:
    """A store whose every renewal succeeds."""

    def renew(self, owner: Owner) -> None:
        pass


class FakeTimer:
    def __init__(self) -> None:
        self.deadline: float | None = None
        self.closed = False

    def arm_at(self, deadline: float) -> None:
        self.deadline = deadline

    def disarm(self) -> None:
        self.deadline = None

    def close(self) -> None:
        self.closed = True
        self.deadline = None


def test_the_keeper_arms_before_a_tool_moves_at_a_renewal_and_waits_unarmed() -> None:
    store = cast(TaskStore, Renews())
    now = [100.0]
    timer = FakeTimer()
    lost: list[FencedError] = []
    owner = Owner("t1", "a", 1)
    keeper = LeaseKeeper(store, owner, 10.0, lost.append, clock=lambda: now[0], timer=timer)
    assert timer.deadline is None  # nothing armed until a tool may run
    keeper.check()
    assert timer.deadline == pytest.approx(100.0 + 10.0 * (1 - KILL_MARGIN))
    now[0] = 104.0
    keeper.keep()  # a third of the lease passed: renewed, and the kill moves
    assert timer.deadline == pytest.approx(104.0 + 10.0 * (1 - KILL_MARGIN))
    assert keeper.kill_at > keeper.deadline  # the worker's own stop comes first
    assert keeper.deadline == pytest.approx(104.0 + 10.0 * (1 - MARGIN))
    with keeper.waiting():
        assert timer.deadline is None
        now[0] = 110.0
        keeper.keep()  # renewed within the wait: still no kill armed
        assert timer.deadline is None
    keeper.check()
    assert timer.deadline == pytest.approx(110.0 + 10.0 * (1 - KILL_MARGIN))
    keeper.close()
    assert timer.closed and timer.deadline is None
    assert lost == []
