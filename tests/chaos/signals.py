"""Signals chaos: fault class 17 of the campaign, against a real daemon.

A real daemon (``python -m supervisor start``, ``tests.daemon.Daemon``) runs scripted
tasks that call a tool every turn, with new ones submitted as others end. At random
moments it gets HUP, USR1, USR2 or PIPE, the signals a user sends by habit; half of the
HUPs go to its whole process group (``kill -HUP -PGID``), as a terminal's hangup would.
Before each HUP the config file is edited, good and bad edits in turn:

* a good edit sets ``max_workers`` (2 to 5) and ``heartbeat.timeout`` at random;
* a bad edit sets ``max_workers = 9`` (a value no good edit uses) and breaks the file
  elsewhere: TOML that does not parse, an unknown key, a timeout not above the interval,
  a negative grace.

After each HUP the campaign waits for the daemon's answer (``config_reloaded`` or
``config_reload_failed``), then sends USR1 and reads the ``max_workers`` the daemon says it
uses (``supervisor_status``): a good reload is applied when it says the edit's value, a
bad one refused when it says the last good one.

Figures (violations): daemon deaths 0 (it is started again to go on), good reloads not
applied 0, bad reloads applied 0, worker restarts 0 (no signal to the daemon reaches a
worker), tasks completed 100 % (each ``done`` with every turn recorded once).

``python -m tests.chaos.signals [--full] [--seed N]`` prints the table; quick mode sends
about 20 signals, full mode 400. ``tests/test_campaigns.py`` runs the quick mode.
"""

from __future__ import annotations

import os
import random
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.daemon import Daemon, EventTail, Workload, subreaper
from tests.faults.report import Figure, campaign_main
from tests.support import poll_for

FAULT = "17 signals"
SIGNALS = (signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGPIPE)  # HUP twice as often
BAD_MAX_WORKERS = 9  # what every bad edit says: seen in use, it was applied
ANSWER = 10.0  # seconds the daemon may take to answer a signal (loaded machine)
BAD_EDITS = (
    "[heartbeat\ninterval = 0.2\n",  # not TOML
    "max_wokers = 3\n",  # an unknown key
    "[heartbeat]\ninterval = 0.5\ntimeout = 0.5\n",  # timeout not above the interval
    "[restart]\nstop_grace = -1\n",
)


@dataclass(frozen=True)
class Plan:
    signals: int
    tasks: int  # unfinished tasks kept going
    turns: tuple[int, int]
    gap: tuple[float, float]  # seconds between signals

    @classmethod
    def of(cls, quick: bool) -> Plan:
        if quick:
            return cls(signals=20, tasks=6, turns=(8, 16), gap=(0.05, 0.4))
        return cls(signals=400, tasks=10, turns=(10, 30), gap=(0.02, 0.5))


def config_text(max_workers: int, timeout: float, extra: str = "") -> str:
    return (
        f"max_workers = {max_workers}\n{extra}"
        + ("" if "[heartbeat" in extra else f"[heartbeat]\ninterval = 0.2\ntimeout = {timeout}\n")
        + ("" if "[restart" in extra else "[restart]\nbackoff_initial = 0.1\nstop_grace = 2.0\n")
    )


@dataclass
class Tally:
    sent: dict[str, int] = field(default_factory=lambda: {s.name: 0 for s in SIGNALS})
    deaths: int = 0
    applied: int = 0
    not_applied: list[str] = field(default_factory=list)
    refused: int = 0
    bad_applied: list[str] = field(default_factory=list)


class Campaign:
    def __init__(self, root: Path, plan: Plan, rng: random.Random) -> None:
        self.plan = plan
        self.rng = rng
        self.good = 3  # the max_workers of the last good config
        self.daemon = Daemon(root, config_text(self.good, 3.0))
        self.tail = EventTail(self.daemon)
        self.tally = Tally()
        self.work = Workload(self.daemon, rng, plan.turns)
        self.edits = 0

    # -- signals ---------------------------------------------------------------------------

    def alive(self) -> bool:
        """Whether the daemon lives; a dead one is counted and started again."""
        assert self.daemon.proc is not None
        if self.daemon.proc.poll() is None:
            return True
        self.tally.deaths += 1
        self.daemon.start()
        return False

    def send(self, sig: signal.Signals) -> None:
        assert self.daemon.proc is not None
        self.tally.sent[sig.name] += 1
        if sig == signal.SIGHUP and self.rng.random() < 0.5:
            os.killpg(self.daemon.proc.pid, sig)  # its own session: its group is its pid
        else:
            os.kill(self.daemon.proc.pid, sig)

    def hup(self) -> None:
        self.edits += 1
        good = self.edits % 2 == 1
        if good:
            wanted, timeout = self.rng.randint(2, 5), self.rng.choice((3.0, 4.0, 5.0))
            edit = config_text(wanted, timeout)
        else:
            wanted, bad = self.good, self.rng.choice(BAD_EDITS)
            edit = config_text(BAD_MAX_WORKERS, 3.0, bad)
        answers = (
            len(self.tail.named("config_reloaded")),
            len(self.tail.named("config_reload_failed")),
        )
        self.daemon.config_path.write_text(edit)
        self.send(signal.SIGHUP)
        name = "config_reloaded" if good else "config_reload_failed"
        answered = self.tail.wait(name, answers[0 if good else 1] + 1, ANSWER)
        in_use = self.status() if answered and self.alive() else None
        kind = "good" if good else "bad"
        what = f"edit {self.edits} ({kind}): answered {bool(answered)}, max_workers {in_use}"
        if good and in_use == wanted:
            self.good = wanted
            self.tally.applied += 1
        elif good:
            self.tally.not_applied.append(what)
        elif in_use == wanted and len(self.tail.named("config_reloaded")) == answers[0]:
            self.tally.refused += 1
        else:
            self.tally.bad_applied.append(what)

    def status(self) -> int | None:
        """The max_workers the daemon says it uses (USR1's ``supervisor_status``)."""
        count = len(self.tail.named("supervisor_status"))
        self.send(signal.SIGUSR1)
        found = self.tail.wait("supervisor_status", count + 1, ANSWER)
        return int(found[-1]["max_workers"]) if found else None

    def run(self) -> list[Figure]:
        self.daemon.start()
        self.work.top_up(self.plan.tasks)
        for _ in range(self.plan.signals):
            time.sleep(self.rng.uniform(*self.plan.gap))  # a random moment (the fault's time)
            sig = self.rng.choices(SIGNALS, weights=(2, 1, 1, 1))[0]
            if sig == signal.SIGHUP:
                self.hup()
            else:
                self.send(sig)
            self.alive()
            self.work.top_up(self.plan.tasks)
        return self.audit()

    def audit(self) -> list[Figure]:
        def ended() -> bool:
            self.alive()
            return self.work.ended()

        tasks = len(self.work.turns)
        poll_for(ended, 60 + 2 * tasks, interval=0.1, what="every task to end")
        complete, restarts = len(self.work.completed()), self.work.restarts()
        t = self.tally
        sent = ", ".join(f"{name} {n}" for name, n in t.sent.items())
        return [
            Figure(
                FAULT, "signals sent (USR1 probes included)", f"{sum(t.sent.values())} ({sent})"
            ),
            Figure(FAULT, "daemon deaths", t.deaths, t.deaths > 0),
            Figure(FAULT, "reloads applied", t.applied),
            Figure(FAULT, "good reloads not applied", len(t.not_applied), bool(t.not_applied)),
            Figure(FAULT, "bad reloads refused", t.refused),
            Figure(FAULT, "bad reloads applied", len(t.bad_applied), bool(t.bad_applied)),
            Figure(FAULT, "worker restarts", restarts, restarts > 0),
            Figure(
                FAULT,
                "tasks completed %",
                round(100.0 * complete / tasks, 1),
                complete < tasks,
            ),
            *[Figure(FAULT, "not applied", w, True) for w in t.not_applied[:3]],
            *[Figure(FAULT, "bad one applied", w, True) for w in t.bad_applied[:3]],
        ]


def run(quick: bool, *, seed: int | None = None) -> list[Figure]:
    seed = random.randrange(1 << 30) if seed is None else seed
    figures = [Figure(FAULT, "seed (--seed replays the choices)", str(seed))]
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="agentd-signals-") as folder, subreaper():
        campaign = Campaign(Path(folder), Plan.of(quick), random.Random(seed))
        try:
            figures += campaign.run()
        finally:
            campaign.daemon.cleanup()
    figures.append(Figure(FAULT, "runtime s", time.monotonic() - started))
    return figures


def main(argv: list[str] | None = None) -> int:
    return campaign_main(run, "python -m tests.chaos.signals", __doc__ or "", argv)


if __name__ == "__main__":
    sys.exit(main())
