"""Approvals chaos: fault class 25 of the campaign, decisions on unsafe calls under kills,
stale and duplicate decisions, asked calls and expiry (decisions bound to an attempt and
used once, calls asked before they run, ``[approvals]``).

Every task runs on the scripted model one call of ``gated_charge``
(``tests.chaos.approval_tools``): an ``unsafe`` charge that writes one line a real run to a
ledger in its workspace, each line naming the attempt of the call's latest intent and of
its latest decision as the journal said when the run began, and that waits at two gates
(before its effect, before its result) so a kill lands where the campaign means it to.
Decisions are given as an operator gives them, each its own process or request: ``agentd
approve-dangling TASK CALL --attempt N --rerun|--skip`` and ``POST
/api/tasks/ID/decisions`` with its ``"attempt"``; what is held is read from ``status
--json``'s ``dangling`` rows (``attempt``, ``stage``).

* kills: a held call (its first run cut off after its effect) is decided, and the worker
  (or the daemon) is killed -9 at a point between the decision and the call's result:
  right after the decision is recorded (before a worker records it), after the worker's
  ``decision`` record, after the re-run's intent, mid-tool before the effect, after the
  effect before the result; each point aimed at in turn. A worker is held still right
  after its ``decision`` or ``intent`` record (``approval_tools``' pauses) and killed
  there; the daemon is stopped (``SIGSTOP``) before a decision and killed right after it,
  so no worker started; a kill of the worker aimed right after the decision races the
  worker's start and lands later as often as not. Where each kill landed is read back from
  the journal and the ledger, and counted. A decision the kill left unused is used by the
  next worker; one whose re-run began is consumed, and the call is held again as a new
  attempt; a worker the daemon's kill left running is killed at its gate.
* stale and duplicate decisions: after each re-run is cut off and held again, the decision
  just used is sent again (CLI or API, alone or two at once); the current decision is sent
  sometimes twice at once (a double click) or together with a stale one. A stale one must
  be refused (exit 3, 409), and of two for the current attempt exactly one accepted.
* asked calls (``submit --ask``): held before they run (``"stage": "before"``), then
  decided (run once), skipped (never run), or approved and cut off (held again, decided
  again).
* expiry, on a daemon of its own with ``[approvals] expire_after`` and ``ask_timeout``: a
  decision given while no daemon runs and left past ``expire_after`` is not used (the call
  is held again as a new attempt, and the old decision sent again is refused); an asked call
  nobody answers is skipped once ``ask_timeout`` passes.

Judged from the ledgers: each real run is tied to the decision its journal showed when it
began. Violations (all must be 0, the first at most 1): runs per decision (max), unsafe
runs without a current decision (a run with no decision that an operator's command
accepted for that attempt, one on an expired decision, or any run of an asked call before
it was decided), stale decisions accepted, decisions accepted twice for one attempt,
decisions for the current attempt refused, asked calls not listed with ``"stage":
"before"``, unanswered asked calls not skipped, tasks that did not end ``done``.

``python -m tests.chaos.approvals [--full] [--seed N]`` prints the table and exits 1 on any
violation; ``tests/test_campaigns.py`` runs the quick mode in ``make test``.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from tests.chaos.approval_tools import (
    EFFECT_GATE,
    LEDGER,
    PAUSES_ENV,
    RESULT_GATE,
    STARTS,
    pause_gate,
    paused,
)
from tests.chaos.effect_tools import read_log
from tests.console import Client, api_token, console_table, free_port
from tests.daemon import Daemon, alive, subreaper
from tests.daemon import config_text as daemon_config
from tests.faults.report import Figure, campaign_main
from tests.support import journal_records, poll_for, reply, text, tool_use
from worker.records import RecordKind

JSON = dict[str, Any]
FAULT = "25 approvals"
TOOL = "gated_charge"
#: ``[approvals]`` of the expiry daemon: a decision unused this long is void, an asked call
#: unanswered this long is skipped.
EXPIRE_SECONDS = 4.0
APPROVALS_TABLE = (
    f'[approvals]\nexpire_after = "{EXPIRE_SECONDS:g}s"\nask_timeout = "{EXPIRE_SECONDS:g}s"\n'
)
SETTLE = 60.0  # how long a task may take to reach its next hold or its end

#: Where a kill is aimed, in the order a decided call passes them.
POINTS = ("decision", "decision record", "intent", "mid-tool", "after the effect")
#: Where a kill landed, read back from the journal and the ledger.
LANDED = (
    "after the decision, before the worker's decision record",
    "after the decision record, before the re-run's intent",
    "after the re-run's intent, before the tool began",
    "mid-tool, before the effect",
    "after the effect, before the result record",
    "after the result record",
)


_BEGUN = [time.monotonic()]  # when the campaign began (``run``)


def say(message: str) -> None:
    took = time.monotonic() - _BEGUN[0]
    print(f"approvals: {took:5.1f} s: {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Plan:
    held: int  # tasks held on a call cut off after its effect, decided under worker kills
    kills: int  # decisions of each such task that are cut off by a kill
    asked: int  # tasks asked before they run (decided, skipped, approved and cut off)
    daemon_kills: int  # decisions of one held task cut off by a kill -9 of the daemon
    expired: int  # tasks whose decision expires before a worker uses it
    unanswered: int  # asked tasks left unanswered past ask_timeout
    parallel: int  # tasks carried at once

    @classmethod
    def of(cls, quick: bool) -> Plan:
        if quick:
            return cls(
                held=3, kills=3, asked=3, daemon_kills=2, expired=1, unanswered=1, parallel=4
            )
        return cls(
            held=48, kills=10, asked=30, daemon_kills=30, expired=20, unanswered=10, parallel=6
        )


# -- what one task tells --------------------------------------------------------------------


@dataclass
class Tally:
    trials: int = 0
    worker_kills: int = 0
    daemon_kills: int = 0
    decisions_cli: int = 0  # accepted
    decisions_api: int = 0
    stale_sent: int = 0
    stale_accepted: int = 0
    doubles_sent: int = 0  # two decisions for the current attempt at once
    doubles_accepted_twice: int = 0
    current_refused: int = 0  # a decision for the current attempt refused (noted)
    asked_decided: int = 0
    asked_skipped: int = 0
    asked_cut_off: int = 0
    asked_not_before: int = 0  # an asked call not listed with "stage": "before" (noted)
    expired: int = 0  # decisions left past expire_after that held the call again
    expired_used: int = 0
    unanswered_skipped: int = 0
    unanswered_not_skipped: int = 0
    tasks: int = 0
    completed: int = 0
    not_ended: int = 0
    runs: int = 0
    most_runs_per_decision: int = 0
    unsafe_runs: int = 0
    landed: Counter[str] = field(default_factory=Counter)
    ms: dict[str, list[float]] = field(default_factory=lambda: {"cli": [], "api": []})
    examples: list[str] = field(default_factory=list)

    def note(self, what: str) -> None:
        if len(self.examples) < 6:
            self.examples.append(what)

    def add(self, other: Tally) -> None:
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if f.name == "most_runs_per_decision":
                setattr(self, f.name, max(mine, theirs))
            elif f.name == "landed":
                mine.update(theirs)
            elif f.name == "ms":
                for via, took in theirs.items():
                    mine[via] += took
            elif f.name == "examples":
                for example in theirs:
                    self.note(example)
            else:
                setattr(self, f.name, mine + theirs)


@dataclass
class Book:
    """What the operator's commands did to one task: the attempts decided (accepted, and
    with what action), the decisions that expired unused."""

    asked: bool
    accepted: dict[int, str] = field(default_factory=dict)
    expired: set[int] = field(default_factory=set)


def judge_runs(ledger: list[JSON], book: Book) -> tuple[int, int, list[str]]:
    """(most runs on one decision, unsafe runs without a current decision, what was
    wrong) of one task's ledger. A run is on the decision its journal showed when it
    began; it is current when an operator's command was accepted for that attempt with
    ``rerun``, the decision did not expire, and the run is of that attempt or the next.
    The one run a call may have without a decision is the first run of a call not asked."""
    per_decision: Counter[int] = Counter()
    unsafe, wrong = 0, []
    first_seen = False
    for line in ledger:
        decided, ran = int(line.get("d") or 0), int(line.get("r") or 0)
        if decided == 0:
            if not book.asked and ran == 1 and not first_seen:
                first_seen = True
                continue
            unsafe += 1
            wrong.append(f"a run of attempt {ran} with no decision")
            continue
        per_decision[decided] += 1
        if book.accepted.get(decided) != "rerun" or line.get("action") != "rerun":
            unsafe += 1
            wrong.append(f"a run on decision {decided}, which no operator's rerun made")
        elif decided in book.expired:
            unsafe += 1
            wrong.append(f"a run on decision {decided}, which expired")
        elif ran - decided not in (0, 1):
            unsafe += 1
            wrong.append(f"a run of attempt {ran} on the decision of attempt {decided}")
    return max(per_decision.values(), default=0), unsafe, wrong


# -- one daemon and how an operator speaks to it ----------------------------------------------


@dataclass(frozen=True)
class Sent:
    via: str  # "cli" or "api"
    attempt: int
    accepted: bool
    refused: bool  # exit 3, HTTP 404 or 409
    said: str
    ms: float  # how long it took, from the command's start (or the request's) to its answer


class Operator:
    """A daemon with its console, and the two ways an operator decides: the CLI (a
    process each) and the JSON API (a request each, with a bearer token)."""

    def __init__(self, root: Path, *, extra: str = "") -> None:
        self.port = free_port()
        config = daemon_config(
            max_workers=16,
            timeout=5.0,
            backoff_max=0.3,
            crash_loop_limit=1_000_000,  # every trial crashes the same turn again
            stop_grace=2.0,
            sandbox=None,
            tool_modules=("tests.chaos.approval_tools",),
            extra=console_table(self.port) + extra,
        )
        self.daemon = Daemon(root, config)
        self.client = Client(self.port)
        self.pauses = root / "pauses"  # (approval_tools: a worker held still after a record)
        self.pauses.mkdir(exist_ok=True)
        self.up = self.frozen = False

    def start(self) -> None:
        self.daemon.start({PAUSES_ENV: str(self.pauses)})
        self.up = True
        if not self.client.bearer:
            self.client.bearer = api_token(self.daemon)
        poll_for(self._serving, 30, interval=0.05, what="the console to serve")

    def _serving(self) -> bool:
        with contextlib.suppress(OSError):
            return self.client.get("/api/held").status == 200
        return False

    def kill(self) -> None:
        self.up = self.frozen = False
        self.daemon.kill()

    def freeze(self) -> None:
        """``SIGSTOP`` of the daemon: it starts no worker until it is killed (or thawed)."""
        assert self.daemon.proc is not None
        os.kill(self.daemon.proc.pid, signal.SIGSTOP)
        self.frozen = True

    def thaw(self) -> None:
        assert self.daemon.proc is not None
        os.kill(self.daemon.proc.pid, signal.SIGCONT)
        self.frozen = False

    def stop(self) -> None:
        """``agentd stop`` (a process: the campaign's other daemon runs meanwhile)."""
        self.up = False
        done = self.daemon.run_cli("stop", timeout=60)
        assert done.returncode == 0, f"agentd stop: {done.stderr.strip()}"
        assert self.daemon.proc is not None
        self.daemon.proc.wait(timeout=30)

    def decide(self, via: str, task: str, call: str, attempt: int, action: str) -> Sent:
        begun = time.monotonic()
        if via == "cli":
            how = ("--rerun",) if action == "rerun" else ("--skip", "--reason", "chaos")
            args = ("approve-dangling", task, call, "--attempt", str(attempt), *how)
            done = self.daemon.run_cli(*args, timeout=60)
            said = (done.stderr or done.stdout).strip()
            ms = (time.monotonic() - begun) * 1000
            return Sent(via, attempt, done.returncode == 0, done.returncode == 3, said, ms)
        body: JSON = {"call_id": call, "action": action, "attempt": attempt}
        if action == "skip":
            body["reason"] = "chaos"
        answer = poll_for(
            lambda: self._post(f"/api/tasks/{task}/decisions", body), 30, what="the console"
        )
        said = answer.body.decode(errors="replace")[:200]
        ms = (time.monotonic() - begun) * 1000
        return Sent(via, attempt, answer.status == 200, answer.status in (404, 409), said, ms)

    def _post(self, path: str, body: JSON) -> Any:
        try:
            return self.client.post(path, body)
        except OSError:
            return None  # the console is starting again after a kill: ask again

    def at_once(self, sends: list[tuple[str, str, str, int, str]]) -> list[Sent]:
        """Several decisions given at the same moment (processes and requests at once)."""
        if len(sends) == 1:
            return [self.decide(*sends[0])]
        with ThreadPoolExecutor(max_workers=len(sends)) as pool:
            return list(pool.map(lambda s: self.decide(*s), sends))


# -- one task, decided and cut off ------------------------------------------------------------


def script() -> list[JSON]:
    return [
        reply(text("Charging."), tool_use(TOOL, amount=7)),
        reply(text("Charged.")),
    ]


class Case:
    """One task of the campaign: its call, the operator's book of it, its tally."""

    def __init__(self, op: Operator, name: str, rng: random.Random, *, asked: bool) -> None:
        self.op = op
        self.daemon = op.daemon
        self.name = name
        self.rng = rng
        self.book = Book(asked=asked)
        self.tally = Tally(tasks=1)
        self.call = ""
        self.attempt = 0  # the held attempt
        self.starts_seen = 0
        self.killed: set[int] = set()

    # -- what the task shows

    @property
    def workspace(self) -> Path:
        return self.daemon.task(self.name).path / "workspace"

    def starts(self) -> list[JSON]:
        return read_log(self.workspace / STARTS)

    def ledger(self) -> list[JSON]:
        return read_log(self.workspace / LEDGER)

    def records(self) -> list[JSON]:
        return [r for r in journal_records(self.daemon.task(self.name)) if r.get("call_id")]

    def held_row(self) -> JSON | None:
        row = self.daemon.row(self.name)
        if row["state"] != "held":
            return None
        for held in row.get("dangling") or []:
            if held.get("tool") == TOOL:
                return dict(held)
        return None

    def gates(self, *, effect: bool, result: bool) -> None:
        self.workspace.mkdir(mode=0o700, parents=True, exist_ok=True)  # (before its worker)
        for name, is_open in ((EFFECT_GATE, effect), (RESULT_GATE, result)):
            path = self.workspace / name
            if is_open:
                path.touch()
            else:
                path.unlink(missing_ok=True)

    # -- submitting

    def submit(self) -> None:
        if self.book.asked:
            path = self.daemon.root / f"script-{self.name}.json"
            path.write_text(json.dumps({"responses": script()}))
            done = self.daemon.run_cli(
                "submit", "--name", self.name, "--script", str(path), "--ask", TOOL,
                "--prompt", "Charge the card.",
            )  # fmt: skip
            assert done.returncode == 0, f"submit --ask: {done.stderr.strip()}"
        else:
            self.daemon.submit(script(), name=self.name)

    def first_hold(self) -> None:
        """A call held: asked before it runs, or run once (its effect made) and cut off."""
        self.submit()
        if not self.book.asked:
            self.gates(effect=True, result=False)
            effect = poll_for(self.ledger, SETTLE, what=f"{self.name}: its first run's effect")
            self.kill_worker(int(effect[-1]["pid"]))
            self.starts_seen = len(self.starts())
        ended = self.settle(0)
        if ended != "held":
            raise AssertionError(f"{self.name}: not held at first ({ended})")
        held = self.held_row()
        assert held is not None
        self.call = str(held["call_id"])
        if self.book.asked and held.get("stage") != "before":
            self.tally.asked_not_before += 1
            self.tally.note(f"{self.name}: asked call held with stage {held.get('stage')!r}")

    # -- waiting, and killing what runs

    def worker(self) -> int | None:
        """The newest worker of the task that is alive and not killed here."""
        for event in reversed(self.daemon.events(self.name, "worker_spawned")):
            pid = event.get("pid")
            if isinstance(pid, int) and pid not in self.killed and alive(pid):
                return pid
        return None

    def kill_worker(self, pid: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        self.killed.add(pid)
        self.tally.worker_kills += 1
        poll_for(lambda: not alive(pid), 30, what=f"worker {pid} to die")

    def settle(self, before: int) -> str:
        """Until the call is held at an attempt after ``before`` ("held"), or the task
        ended (its state); a run of the tool that waits at a closed gate meanwhile is
        killed (a kill mid-tool, or after the effect)."""
        deadline = time.monotonic() + SETTLE
        while time.monotonic() < deadline:
            row = self.daemon.row(self.name)
            if row["state"] in ("done", "failed", "cancelled"):
                return str(row["state"])
            held = self.held_row()
            if held is not None and int(held["attempt"]) > before:
                self.attempt = int(held["attempt"])
                return "held"
            runs = self.starts()
            if len(runs) > self.starts_seen and not (self.workspace / RESULT_GATE).exists():
                pid = int(runs[-1]["pid"])
                self.starts_seen = len(runs)
                if alive(pid) and pid not in self.killed:
                    if before:
                        kill = functools.partial(self.kill_worker, pid)
                        self.landed_kill(kill, before, look_first=False)
                    else:
                        self.kill_worker(pid)
            time.sleep(0.02)  # a poll's interval: the loop's deadline bounds it
        self.tally.note(f"{self.name}: neither held again nor ended in {SETTLE:g} s")
        return "stuck"

    def landed_kill(self, kill: Callable[[], None], attempt: int, *, look_first: bool) -> None:
        """Kill, and count where the kill landed after the decision of ``attempt``: the
        call's records after it, and the tool's lines; read once the worker is dead, or
        (``look_first``, a kill of the daemon, whose worker runs on) right before it."""
        if look_first:
            self.tally.landed[self.where(attempt)] += 1
            kill()
        else:
            kill()
            self.tally.landed[self.where(attempt)] += 1

    def where(self, attempt: int) -> str:
        """How far the decided call got after the decision of ``attempt`` (``LANDED``)."""
        records = self.records()
        decided = any(
            r["k"] == RecordKind.DECISION and r.get("attempt") == attempt for r in records
        )
        after = records
        for i, r in enumerate(records):
            if r["k"] == RecordKind.DECISION and r.get("attempt") == attempt:
                after = records[i + 1 :]
        intent = any(r["k"] == RecordKind.INTENT for r in after)
        result = any(r["k"] == RecordKind.RESULT for r in after)
        started = any(int(line.get("d") or 0) == attempt for line in self.starts())
        effect = any(int(line.get("d") or 0) == attempt for line in self.ledger())
        if not decided:
            return LANDED[0]
        if result:
            return LANDED[5]
        if effect:
            return LANDED[4]
        if started:
            return LANDED[3]
        return LANDED[2] if intent else LANDED[1]

    # -- deciding

    def send(self, how: str, action: str, *, via: str | None = None) -> bool:
        """The decision of the held attempt, ``how``: alone, twice at once (a double
        click), or at once with a stale one; through ``via`` (None: the CLI or the API at
        random). True when it was accepted."""
        via = via or self.rng.choice(("cli", "api"))
        current = (via, self.name, self.call, self.attempt, action)
        stale = [a for a in self.book.accepted if a < self.attempt] + list(self.book.expired)
        if how == "double":
            other = (self.rng.choice(("cli", "api")), self.name, self.call, self.attempt, action)
            results = self.op.at_once([current, other])
            self.tally.doubles_sent += 1
            self.tally.trials += 1
        elif how == "with stale" and stale:
            old = ("cli" if via == "api" else "api", self.name, self.call, max(stale), action)
            results = self.op.at_once([current, old])
            self.tally.stale_sent += 1
            self.tally.trials += 1
        else:
            results = [self.op.decide(*current)]
        mine = [r for r in results if r.attempt == self.attempt]
        for r in results:
            if r.attempt != self.attempt:
                self.stale(r)
        accepted = [r for r in mine if r.accepted]
        if len(accepted) > 1:
            self.tally.doubles_accepted_twice += 1
            self.tally.note(f"{self.name}: attempt {self.attempt} decided twice: {accepted}")
        if not accepted:
            self.tally.current_refused += 1
            self.tally.note(f"{self.name}: attempt {self.attempt} refused: {mine[0].said}")
            return False
        for r in accepted[:1]:
            if len(results) == 1:  # (alone: what one decision costs, not two at once)
                self.tally.ms[r.via].append(r.ms)
            if r.via == "cli":
                self.tally.decisions_cli += 1
            else:
                self.tally.decisions_api += 1
        self.book.accepted[self.attempt] = action
        return True

    def stale(self, sent: Sent) -> None:
        if sent.accepted:
            self.tally.stale_accepted += 1
            self.tally.note(f"{self.name}: stale attempt {sent.attempt} accepted via {sent.via}")
        elif not sent.refused:
            self.tally.note(f"{self.name}: stale attempt {sent.attempt}: {sent.said}")

    def resend_stale(self) -> None:
        """The decision just used sent again now that the call is held again: alone or
        two at once, through the CLI or the API."""
        old = [a for a in self.book.accepted if a < self.attempt] + list(self.book.expired)
        if not old:
            return
        attempt = max(old) if self.rng.random() < 0.8 else self.rng.choice(old)
        action = self.book.accepted.get(attempt, "rerun")
        count = self.rng.choice((1, 2))
        sends = [
            (self.rng.choice(("cli", "api")), self.name, self.call, attempt, action)
            for _ in range(count)
        ]
        for sent in self.op.at_once(sends):
            self.stale(sent)
        self.tally.stale_sent += 1
        self.tally.trials += 1

    def strike(self, point: str, victim: str) -> None:
        """Decide the held attempt and kill ``victim`` at ``point``; then until the call
        is held again (the kill cut the re-run off) or runs again (it did not: that run
        is killed at its gate). A kill right after the decision or intent record is aimed
        by holding the worker still there (``approval_tools``); one of the daemon right
        after the decision, by stopping the daemon before it (so no worker has started)."""
        self.gates(effect=point == "after the effect", result=False)
        spawned = len(self.daemon.events(self.name, "worker_spawned"))
        starts, ledger = len(self.starts()), len(self.ledger())
        attempt = self.attempt
        kind = {"decision record": "decision", "intent": "intent"}.get(point)
        if kind is not None:
            pause_gate(self.op.pauses, self.name, kind).touch()
        frozen = victim == "daemon" and point == "decision"
        if frozen:
            self.op.freeze()
        how = "single" if frozen else self.rng.choice(("single", "single", "double", "with stale"))
        try:
            if not self.send(how, "rerun", via="cli" if frozen else None):
                return
            self.tally.trials += 1

            def reached() -> int | None:
                if kind is not None:
                    return paused(self.op.pauses, self.name, kind)
                if point == "decision":
                    events = self.daemon.events(self.name, "worker_spawned")
                    return self.worker() if len(events) > spawned else None
                if point == "mid-tool":
                    runs = self.starts()
                    return int(runs[-1]["pid"]) if len(runs) > starts else None
                runs = self.ledger()
                return int(runs[-1]["pid"]) if len(runs) > ledger else None

            if frozen:
                self.landed_kill(self.kill_daemon, attempt, look_first=True)
            else:
                pid = poll_for(reached, SETTLE, interval=0.01, what=f"{self.name}: {point}")
                if victim == "daemon":
                    self.landed_kill(self.kill_daemon, attempt, look_first=True)
                else:
                    self.landed_kill(lambda: self.kill_worker(pid), attempt, look_first=False)
        finally:
            if self.op.frozen:  # (the decision was refused: nothing to kill it after)
                self.op.thaw()
            if frozen and not self.op.up:
                self.op.start()
            if kind is not None:
                pause_gate(self.op.pauses, self.name, kind).unlink(missing_ok=True)
                for mark in self.op.pauses.glob(f"{self.name}.{kind}.*"):
                    mark.unlink(missing_ok=True)  # (a killed worker's mark)
        self.starts_seen = starts  # (a run the kill left waiting at its gate is killed there)
        if self.settle(attempt) == "held":
            self.resend_stale()

    def kill_daemon(self) -> None:
        self.op.kill()
        self.tally.daemon_kills += 1
        self.op.start()

    def finish(self, action: str = "rerun") -> None:
        """The last decision: the gates open, the call run (or skipped) to the task's end."""
        self.gates(effect=True, result=True)
        for _ in range(5):  # a decision that expires before use holds the call again
            if not self.send(self.rng.choice(("single", "double", "with stale")), action):
                break
            self.tally.trials += 1
            if self.settle(self.attempt) != "held":
                break
            self.resend_stale()

    def verdict(self) -> Tally:
        row = self.daemon.row(self.name)
        if row["state"] == "done":
            self.tally.completed += 1
        else:
            self.tally.not_ended += 1
            self.tally.note(f"{self.name}: ended {row['state']} ({row.get('reason')})")
        ledger = self.ledger()
        most, unsafe, wrong = judge_runs(ledger, self.book)
        self.tally.runs += len(ledger)
        self.tally.most_runs_per_decision = max(self.tally.most_runs_per_decision, most)
        self.tally.unsafe_runs += unsafe
        self.tally.expired_used += sum(1 for w in wrong if "expired" in w)
        for what in wrong[:2]:
            self.tally.note(f"{self.name}: {what}")
        return self.tally


# -- the campaign's parts -------------------------------------------------------------------------


def held_case(op: Operator, name: str, rng: random.Random, points: list[str], victim: str) -> Tally:
    case = Case(op, name, rng, asked=False)
    try:
        case.first_hold()
        for point in points:
            case.strike(point, victim)
        case.finish()
    except Exception as exc:
        case.tally.note(f"{name}: {type(exc).__name__}: {exc}"[:300])
    return case.verdict()


def asked_case(
    op: Operator, name: str, rng: random.Random, outcome: str, points: list[str]
) -> Tally:
    case = Case(op, name, rng, asked=True)
    try:
        case.first_hold()
        case.tally.trials += 1
        if outcome == "decided":
            case.tally.asked_decided += 1
            case.finish()
        elif outcome == "skipped":
            case.tally.asked_skipped += 1
            case.finish("skip")
        else:
            case.tally.asked_cut_off += 1
            for point in points:
                case.strike(point, "worker")
            case.finish()
    except Exception as exc:
        case.tally.note(f"{name}: {type(exc).__name__}: {exc}"[:300])
    return case.verdict()


def killing(root: Path, plan: Plan, rng: random.Random) -> Tally:
    """Held and asked tasks decided under worker kills, several at once; then held tasks
    whose decisions are cut off by kills of the daemon, one at a time."""
    tally = Tally()
    op = Operator(root)
    try:
        op.start()
        jobs: list[Callable[[], Tally]] = []
        aims = itertools.cycle(POINTS)  # every point in turn, so each is aimed at
        for i in range(plan.held):
            points = [next(aims) for _ in range(plan.kills)]
            held = functools.partial(
                held_case, op, f"held-{i}", random.Random(rng.randrange(1 << 30)), points
            )
            jobs.append(functools.partial(held, "worker"))
        outcomes = ("decided", "skipped", "cut off")
        for i in range(plan.asked):
            asked = functools.partial(
                asked_case, op, f"asked-{i}", random.Random(rng.randrange(1 << 30))
            )
            points = [next(aims) for _ in range(max(1, plan.kills // 3))]
            jobs.append(functools.partial(asked, outcomes[i % 3], points))
        rng.shuffle(jobs)
        say(f"{len(jobs)} tasks decided under worker kills ...")
        with ThreadPoolExecutor(max_workers=plan.parallel) as pool:
            for found in pool.map(lambda job: job(), jobs):
                tally.add(found)
        say("decisions cut off by kills of the daemon ...")
        per_task = len(POINTS)
        aims = itertools.cycle(POINTS)
        for i in range(0, plan.daemon_kills, per_task):
            points = [next(aims) for _ in range(min(per_task, plan.daemon_kills - i))]
            case_rng = random.Random(rng.randrange(1 << 30))
            tally.add(held_case(op, f"daemon-{i}", case_rng, points, "daemon"))
        say("done")
    finally:
        op.daemon.cleanup()
    return tally


def expiring(root: Path, plan: Plan, rng: random.Random) -> Tally:
    """Decisions given while no daemon runs and left past ``expire_after``; asked calls left
    unanswered past ``ask_timeout``."""
    tally = Tally()
    op = Operator(root, extra=APPROVALS_TABLE)
    cases: list[Case] = []
    try:
        op.start()
        cases = [
            Case(op, f"expire-{i}", random.Random(rng.randrange(1 << 30)), asked=False)
            for i in range(plan.expired)
        ]
        unanswered = [f"unanswered-{i}" for i in range(plan.unanswered)]
        for name in unanswered:
            Case(op, name, rng, asked=True).submit()
        for case in cases:
            case.first_hold()
        say("decisions given while no daemon runs, left to expire ...")
        op.stop()
        for case in cases:
            case.gates(effect=True, result=True)
            sent = op.decide("cli", case.name, case.call, case.attempt, "rerun")
            if sent.accepted:
                case.book.accepted[case.attempt] = "rerun"
                case.book.expired.add(case.attempt)
                case.tally.decisions_cli += 1
                case.tally.trials += 1
            else:
                case.tally.note(f"{case.name}: decision refused with no daemon: {sent.said}")
        time.sleep(EXPIRE_SECONDS + 1.0)  # the fault itself: time passes past expire_after
        op.start()
        say("the daemon again, past expire_after ...")
        for case in cases:
            before = case.attempt
            if case.settle(before) == "held":
                case.tally.expired += 1
                case.resend_stale()
            case.finish()
            tally.add(case.verdict())
        for name in unanswered:
            tally.trials += 1
            tally.tasks += 1
            try:
                row = op.daemon.wait_state(name, "done", "failed", "cancelled", timeout=SETTLE)
            except AssertionError:
                row = op.daemon.row(name)
            ran = read_log(op.daemon.task(name).path / "workspace" / STARTS)
            if row["state"] == "done" and not ran:
                tally.unanswered_skipped += 1
                tally.completed += 1
            else:
                tally.unanswered_not_skipped += 1
                tally.note(f"{name}: unanswered, {row['state']}, {len(ran)} run(s)")
            if row["state"] != "done":
                tally.not_ended += 1
            tally.unsafe_runs += len(ran)
        say("expiry done")
    finally:
        op.daemon.cleanup()
    return tally


def median_of(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def figures_of(tally: Tally) -> list[Figure]:
    def v(name: str, value: int, bound: int = 0) -> Figure:
        return Figure(FAULT, name, value, value > bound)

    asked = f"{tally.asked_decided} / {tally.asked_skipped} / {tally.asked_cut_off}"
    return [
        Figure(FAULT, "trials", tally.trials),
        Figure(FAULT, "kills -9 of a worker", tally.worker_kills),
        Figure(FAULT, "kills -9 of the daemon", tally.daemon_kills),
        *(Figure(FAULT, f"kills landed {where}", tally.landed[where]) for where in LANDED),
        Figure(FAULT, "decisions accepted", tally.decisions_cli + tally.decisions_api),
        Figure(FAULT, "decisions accepted through the API", tally.decisions_api),
        Figure(FAULT, "a decision through the CLI, median ms", median_of(tally.ms["cli"])),
        Figure(FAULT, "a decision through the API, median ms", median_of(tally.ms["api"])),
        Figure(FAULT, "stale decisions sent (alone or two at once)", tally.stale_sent),
        Figure(FAULT, "double clicks (two decisions of one attempt at once)", tally.doubles_sent),
        Figure(FAULT, "asked calls (decided / skipped / approved and cut off)", asked),
        Figure(FAULT, "decisions expired unused (the call held again)", tally.expired),
        Figure(FAULT, "asked calls skipped on ask_timeout", tally.unanswered_skipped),
        Figure(FAULT, "real runs of the unsafe tool", tally.runs),
        Figure(FAULT, "tasks", tally.tasks),
        Figure(FAULT, "tasks completed", tally.completed),
        v("runs per decision (max)", tally.most_runs_per_decision, bound=1),
        v("unsafe runs without a current decision", tally.unsafe_runs),
        v("stale decisions accepted", tally.stale_accepted),
        v("decisions accepted twice for one attempt", tally.doubles_accepted_twice),
        v("decisions for the current attempt refused", tally.current_refused),
        v("asked calls not held with stage before", tally.asked_not_before),
        v("unanswered asked calls not skipped", tally.unanswered_not_skipped),
        v("tasks that did not end done", tally.not_ended),
    ]


def campaign(root: Path, plan: Plan, rng: random.Random) -> list[Figure]:
    tally = Tally()
    seeds = (rng.randrange(1 << 30), rng.randrange(1 << 30))
    found: list[Tally] = []
    failures: list[BaseException] = []

    def expiry() -> None:
        try:
            found.append(expiring(root / "expiry", plan, random.Random(seeds[1])))
        except BaseException as exc:
            traceback.print_exc()
            failures.append(exc)

    side = threading.Thread(target=expiry, name="approvals-expiry")
    side.start()
    try:
        tally.add(killing(root / "kills", plan, random.Random(seeds[0])))
    finally:
        side.join()
    for part in found:
        tally.add(part)
    figures = figures_of(tally)
    for exc in failures:
        figures.append(Figure(FAULT, "expiry could not run", f"{type(exc).__name__}: {exc}", True))
    for example in tally.examples:
        say(f"example: {example}")
    if tally.examples:
        figures.append(Figure(FAULT, "examples", " | ".join(tally.examples)))
    return figures


def run(quick: bool, *, seed: int | None = None) -> list[Figure]:
    seed = random.randrange(1 << 30) if seed is None else seed
    figures = [Figure(FAULT, "seed (--seed replays the choices)", str(seed))]
    started = _BEGUN[0] = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="agentd-approvals-") as folder, subreaper():
        try:
            figures += campaign(Path(folder), Plan.of(quick), random.Random(seed))
        except Exception as exc:
            traceback.print_exc()
            figures.append(Figure(FAULT, "could not run", f"{type(exc).__name__}: {exc}", True))
    figures.append(Figure(FAULT, "runtime s", time.monotonic() - started))
    return figures


def main(argv: list[str] | None = None) -> int:
    return campaign_main(run, "python -m tests.chaos.approvals", __doc__ or "", argv)


if __name__ == "__main__":
    sys.exit(main())
