"""Clock chaos: fault class 19 of the campaign, the wall clock stepped under a real daemon.

The daemon, its fork server and every worker run with their wall clock at an offset read
from a file at every call, which the campaign rewrites while they run (atomically: a
half-written file must not be read); their monotonic clock is left alone, as an NTP step or
``date -s`` leaves it. Two shims move the wall clock:

* ``agentd status --json``, run after each step, runs under libfaketime (``LD_PRELOAD``,
  Debian's ``libfaketime``; ``FAKETIME_TIMESTAMP_FILE`` with ``FAKETIME_NO_CACHE=1`` and
  ``DONT_FAKE_MONOTONIC=1``), which moves every ``clock_gettime(CLOCK_REALTIME)``;
* the daemon, the fork server and the workers run under an injected clock instead: a
  ``sitecustomize`` module on their ``PYTHONPATH`` (``WALL_SHIM``) that moves
  ``time.time`` and ``time.time_ns``, the wall clock every stamp and verdict of theirs
  reads. libfaketime cannot reach them: under it (0.9.10) Python's ``time.sleep`` fails
  with EINVAL when the monotonic clock is left alone, and ``threading`` waits never end
  when it is not.

Tasks calling a tool every turn are kept running while the wall clock jumps an hour
forward, back to true, an hour back, and so on. Right after some of the steps a random
running worker is stopped with SIGSTOP (a real hang), and the time from the signal to the
daemon's ``worker_hung`` for it is measured on this process's own monotonic clock.

Figures (violations): false hang or stall verdicts 0 (a ``worker_hung`` or
``worker_stalled`` for a worker that was not stopped), real hangs detected later than
``heartbeat.timeout + 1 s`` (or not at all) 0, with the largest detection time printed,
status heartbeat ages below 0 or above ``STALE_AGE`` 0, tasks completed 100 %.

``python -m tests.chaos.clock [--full] [--seed N]``; quick mode makes 6 steps, full mode 40.
``tests/test_campaigns.py`` runs the quick mode.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from supervisor.status import beat_age, read_heartbeat
from tests.daemon import Daemon, EventTail, Workload, alive, subreaper
from tests.faults.report import Figure, campaign_main
from tests.support import REPO, poll_for, worker_env

FAULT = "19 clock"
HOUR = 3600
INTERVAL, TIMEOUT = 0.2, 2.0
LIMIT = TIMEOUT + 1.0  # a real hang is detected within this, from its SIGSTOP
STALE_AGE = 30.0  # a running task's heartbeat age above this in status is an hour-off reading
FAKETIME_DIRS = ("/usr/lib/{arch}/faketime", "/usr/lib/faketime", "/usr/local/lib/faketime")


@dataclass(frozen=True)
class Plan:
    steps: int
    hangs: int  # of the steps, how many are followed by a SIGSTOP
    dwell: tuple[float, float]  # seconds at each offset
    tasks: int

    @classmethod
    def of(cls, quick: bool) -> Plan:
        if quick:
            return cls(steps=6, hangs=2, dwell=(1.5, 2.5), tasks=6)
        return cls(steps=40, hangs=12, dwell=(1.0, 4.0), tasks=10)


def faketime_library() -> Path | None:
    arch = sysconfig.get_config_var("MULTIARCH") or ""
    for folder in FAKETIME_DIRS:
        path = Path(folder.format(arch=arch)) / "libfaketime.so.1"
        if path.exists():
            return path
    return None


def faketime_env(library: Path, offset_file: Path) -> dict[str, str]:
    """The environment that puts a process under libfaketime: its wall clock at the
    offset in ``offset_file``, read at every call, its monotonic clock left alone."""
    return {
        "LD_PRELOAD": str(library),
        "FAKETIME_TIMESTAMP_FILE": str(offset_file),
        "FAKETIME_NO_CACHE": "1",
        "DONT_FAKE_MONOTONIC": "1",  # libfaketime 0.9.7 to 0.9.10
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",  # and later
    }


WALL_SHIM = """\
\"\"\"Clock chaos: this process's wall clock runs at the offset in $CHAOS_WALL_OFFSET_FILE.\"\"\"
import os
import time

_file = os.environ.get("CHAOS_WALL_OFFSET_FILE")
_time, _time_ns = time.time, time.time_ns


def _offset():
    try:
        with open(_file) as f:
            return float(f.read())
    except (OSError, TypeError, ValueError):
        return 0.0


if _file:
    time.time = lambda: _time() + _offset()
    time.time_ns = lambda: _time_ns() + int(_offset() * 1e9)
"""


class FakeClock:
    """The wall-clock offset of every process started with ``env`` (the injected clock)
    or ``faketime_env`` (libfaketime): one file, which both read."""

    def __init__(self, root: Path, library: Path) -> None:
        self.file = root / "wall-offset"
        shim = root / "shim"
        shim.mkdir()
        (shim / "sitecustomize.py").write_text(WALL_SHIM)
        self.env = {
            "PYTHONPATH": os.pathsep.join((str(shim), str(REPO))),
            "CHAOS_WALL_OFFSET_FILE": str(self.file),
        }
        self.faketime_env = faketime_env(library, self.file)
        self.set(0)

    def set(self, offset: int) -> None:
        tmp = self.file.with_name(self.file.name + ".tmp")
        tmp.write_text(f"{offset:+d}\n")
        os.replace(tmp, self.file)


class Campaign:
    def __init__(self, root: Path, plan: Plan, rng: random.Random, library: Path) -> None:
        self.plan = plan
        self.rng = rng
        self.clock = FakeClock(root, library)
        config = (
            f"max_workers = {plan.tasks + 2}\n"
            f"[heartbeat]\ninterval = {INTERVAL}\ntimeout = {TIMEOUT}\n"
            "[deadlines]\nmodel_call = 20.0\ntool_call = 20.0\n"
            "[restart]\nbackoff_initial = 0.1\nbackoff_max = 0.5\nstop_grace = 2.0\n"
        )
        self.daemon = Daemon(root / "d", config)
        self.tail = EventTail(self.daemon)
        self.work = Workload(self.daemon, rng, (20, 40))
        self.stopped: dict[int, float] = {}  # pid -> monotonic time of its SIGSTOP
        self.detected: dict[int, float] = {}  # pid -> seconds to its worker_hung
        self.bad_ages: list[str] = []
        self.status_rows = 0
        self.reached = 0  # ±1 h steps that the workers' heartbeats showed

    def hang_one(self) -> None:
        """SIGSTOP one running worker and wait for the daemon's verdict on it."""
        running = [
            row["pid"]
            for t in self.work.turns
            if (row := self.daemon.row(t))["state"] == "running"
            and row["pid"]
            and row["pid"] not in self.stopped
            and alive(row["pid"])
        ]
        if not running:
            return
        pid = self.rng.choice(running)
        os.kill(pid, signal.SIGSTOP)
        self.stopped[pid] = time.monotonic()

        def verdict() -> float | None:
            self.tail.read()
            for event, seen in zip(self.tail.events, self.tail.seen, strict=True):
                if event.get("event") == "worker_hung" and event.get("pid") == pid:
                    return seen - self.stopped[pid]
            return None

        try:
            self.detected[pid] = poll_for(verdict, LIMIT + 10, interval=0.01)
        except AssertionError:
            os.kill(pid, signal.SIGKILL)  # never detected: the campaign ends its hang

    def check_reach(self, offset: int) -> None:
        """Whether the workers' wall clock is at ``offset``: a heartbeat's wall stamp says."""
        for task_id in self.work.turns:
            beat = read_heartbeat(self.daemon.task(task_id))
            if self.daemon.row(task_id)["state"] == "running" and beat is not None:
                written = time.time() - beat_age(beat)
                self.reached += abs(float(beat["at"]) - written - offset) < 5.0
                return

    def check_status(self) -> None:
        """``agentd status --json`` under libfaketime: every running task's age."""
        env = worker_env(self.clock.faketime_env)
        done = subprocess.run(
            self.daemon.command("status", "--json"),
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        if done.returncode != 0:
            self.bad_ages.append(f"status exited {done.returncode}: {done.stderr.strip()[:120]}")
            return
        for row in json.loads(done.stdout)["tasks"]:
            age = row.get("heartbeat_age")
            if row["state"] != "running" or age is None:
                continue
            self.status_rows += 1
            if not 0 <= age <= STALE_AGE:
                self.bad_ages.append(f"{row['id']}: heartbeat_age {age}")

    def run(self) -> list[Figure]:
        self.daemon.start(self.clock.env)
        self.work.top_up(self.plan.tasks)
        offsets = [HOUR, 0, -HOUR, 0]
        hang_at = set(self.rng.sample(range(self.plan.steps), self.plan.hangs))
        for step in range(self.plan.steps):
            self.clock.set(offsets[step % len(offsets)])
            if step in hang_at:
                self.hang_one()
            time.sleep(self.rng.uniform(*self.plan.dwell))  # the daemon lives at this offset
            if offsets[step % len(offsets)]:
                self.check_reach(offsets[step % len(offsets)])
            self.check_status()
            self.work.top_up(self.plan.tasks)
        self.clock.set(0)
        poll_for(self.work.ended, 120, interval=0.1, what="every task to end")
        return self.audit()

    def audit(self) -> list[Figure]:
        verdicts = [
            e for e in self.tail.events if e.get("event") in ("worker_hung", "worker_stalled")
        ]
        false = [e for e in verdicts if e.get("pid") not in self.stopped]
        late = [pid for pid in self.stopped if self.detected.get(pid, LIMIT + 1) > LIMIT]
        worst = max(self.detected.values(), default=0.0)
        tasks, complete = len(self.work.turns), len(self.work.completed())
        return [
            Figure(FAULT, "wall-clock steps of 1 h (+1 h, back, -1 h, back...)", self.plan.steps),
            Figure(
                FAULT,
                "±1 h steps seen in the workers' wall stamps",
                self.reached,
                self.reached == 0,
            ),
            Figure(FAULT, "false hang or stall verdicts", len(false), bool(false)),
            Figure(
                FAULT,
                "real hangs (SIGSTOP) detected",
                f"{len(self.detected)} of {len(self.stopped)}",
            ),
            Figure(FAULT, f"real hangs detected later than {LIMIT:g} s", len(late), bool(late)),
            Figure(FAULT, "max detection s", round(worst, 2)),
            Figure(FAULT, "status rows read under libfaketime", self.status_rows),
            Figure(
                FAULT,
                "status heartbeat ages < 0 or an hour off",
                len(self.bad_ages),
                bool(self.bad_ages),
            ),
            Figure(
                FAULT, "tasks completed %", round(100.0 * complete / tasks, 1), complete < tasks
            ),
            *[Figure(FAULT, "false verdict", json.dumps(e)[:150], True) for e in false[:3]],
            *[Figure(FAULT, "bad age", a, True) for a in self.bad_ages[:3]],
        ]


def run(quick: bool, *, seed: int | None = None) -> list[Figure]:
    seed = random.randrange(1 << 30) if seed is None else seed
    figures = [Figure(FAULT, "seed (--seed replays the choices)", str(seed))]
    library = faketime_library()
    if library is None:
        why = "libfaketime is not installed (Debian: apt install libfaketime)"
        return [*figures, Figure(FAULT, "could not run", why, True)]
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="agentd-clock-") as folder, subreaper():
        campaign = Campaign(Path(folder), Plan.of(quick), random.Random(seed), library)
        try:
            figures += campaign.run()
        finally:
            campaign.clock.set(0)
            campaign.daemon.cleanup()
    figures.append(Figure(FAULT, "runtime s", time.monotonic() - started))
    return figures


def main(argv: list[str] | None = None) -> int:
    return campaign_main(run, "python -m tests.chaos.clock", __doc__ or "", argv)


if __name__ == "__main__":
    sys.exit(main())
