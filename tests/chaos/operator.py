"""Operator chaos: fault class 18 of the campaign, operator commands against a real daemon.

Every command runs as its own process (``python -m supervisor``, the installed CLI's code),
against a real daemon (``tests.daemon.Daemon``) and its real workers on the scripted model:

* refused: while a task's ``run_command`` (``echo start; sleep S; echo finished``, into a
  file of its workspace) runs, every command that must be refused is given, several at
  once: rewinds to a turn out of range, to a negative one, to the live turn (its call has
  no result), past the running unsafe call without ``--yes``, with
  ``--restore-workspace`` where there is no snapshot; forks at the live turn and out of
  range; decisions of calls that are not held, one with a ``--result-file`` over its cap;
  a retry of a task that did not fail. Each must exit non-zero, and the task must go on
  as if none had been given: its tool prints "finished", and there is no hold, rewind or
  decision record, no restart, no kill, no fork, no request file left.
* accepted: ``rewind --to 0 --yes`` while the tool runs. A call that ends within
  ``restart.stop_grace`` is waited for (its result is recorded, nothing is killed); one
  that outlasts it is cut off, and the rewind says so (a ``cut off:`` line, the call in
  ``task_rewound``'s ``cut_off``).
* races: tasks held on a dangling unsafe call (``CHARGE``, which counts its runs in a file
  of its workspace), each given ``cancel`` and ``approve-dangling --all`` at once (decision
  races) or ``cancel`` and ``rewind --to 0 --yes`` (rewind races), in a random order a few
  milliseconds apart, half with the daemon up and half with it down (then started again).
  A decision race has exactly one winner (exit 0) and one loser (exit 3, one line): when
  the cancel wins the task ends ``cancelled`` with the call run once, when the decision
  wins it ends ``done`` with the call run twice (the re-run decided). A cancel that
  reaches the lock only after the decided call's result is recorded finds no contended
  call and stops the running task like any cancel: both exit 0, one after the other
  (its record is stamped after the result), and that is counted apart. A rewind race ends
  with the task ``cancelled`` whenever the cancel exited 0, and a refused rewind left no
  rewind record. A cancelled task never records anything again: not while the daemon
  runs on, not after it is started again.
* orphans: tasks whose workers outlive a ``kill -9`` of the daemon (each in a session of
  its own) are cancelled while no daemon runs; the next daemon adopts each worker and
  stops it, so the rest of its tool (``sleep 3; echo after``) never runs.

Violations (all must be 0): refused commands that exited 0, tasks changed by a refused
command, calls cut off by a refused command, accepted rewinds that cut off a call that
ended within the grace, cut-offs not reported, races with two winners or none, cancels
exited 0 whose task did not end cancelled, cancelled tasks that ran again, unsafe calls run
again without a winning decision.

``python -m tests.chaos.operator [--full] [--seed N]`` prints the table and exits 1 on any
violation; ``tests/test_campaigns.py`` runs the quick mode in ``make test``.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from supervisor.status import load_state
from supervisor.submit import RESULT_FILE_LIMIT
from tests.daemon import Daemon, alive, subreaper
from tests.daemon import config_text as daemon_config
from tests.faults.report import Figure, campaign_main
from tests.support import (
    REPO,
    journal_records,
    of_kind,
    poll_for,
    reply,
    text,
    tool_use,
    worker_env,
)

JSON = dict[str, Any]
FAULT = "18 operator"
GRACE = 2.0  # restart.stop_grace of the campaign's daemon
CHARGE = (
    "echo run >> runs.txt; "
    "if [ -e charged ]; then echo second run; else touch charged; exec sleep 30; fi"
)
REQUEST_FILES = ("pause.request", "requeue.request", "retry.request")


def config_text(*, max_workers: int = 16, grace: float = GRACE) -> str:
    return daemon_config(
        max_workers=max_workers,
        timeout=5.0,
        backoff_max=0.5,
        crash_loop_limit=5,
        stop_grace=grace,
        sandbox=None,
        tool_modules=(),
    )


def say(message: str) -> None:
    print(f"operator: {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Plan:
    refused_tasks: int  # tasks given every refused command while their tool runs
    tool_seconds: float  # how long that tool runs
    decision_races: int  # of each: daemon up, daemon down
    rewind_races: int
    orphans: int  # workers left by a kill -9 of the daemon, then cancelled

    @classmethod
    def of(cls, quick: bool) -> Plan:
        if quick:
            return cls(  # (a tool of 10 s: eleven commands on a loaded machine take 6 s and more)
                refused_tasks=2, tool_seconds=10.0, decision_races=3, rewind_races=2, orphans=2
            )
        return cls(refused_tasks=6, tool_seconds=6.0, decision_races=15, rewind_races=8, orphans=6)


# -- scripts and commands -------------------------------------------------------------------


def running_command(seconds: float) -> str:
    return f"echo start >> out.txt; sleep {seconds:g}; echo finished >> out.txt"


#: A ``run_command`` that runs until the test lets it finish (``release``), for a test that
#: needs the call still running while it acts: how long its own steps take does not matter.
GATED_COMMAND = (
    "echo start >> out.txt; until [ -e release ]; do sleep 0.05; done; echo finished >> out.txt"
)


def release(daemon: Daemon, task_id: str) -> None:
    """Lets the task's ``GATED_COMMAND`` finish."""
    (daemon.task(task_id).path / "workspace" / "release").touch()


def running_script(seconds: float | None) -> list[JSON]:
    """One turn whose unsafe ``run_command`` runs ``seconds`` (``None``: until ``release``),
    then a final answer."""
    command = GATED_COMMAND if seconds is None else running_command(seconds)
    return [
        reply(text("Working."), tool_use("run_command", command=command, timeout=120)),
        reply(text("Done.")),
    ]


def charge_script() -> list[JSON]:
    return [
        reply(text("Charging."), tool_use("run_command", command=CHARGE, timeout=60)),
        reply(text("Charged.")),
    ]


@dataclass(frozen=True)
class Result:
    code: int
    out: str
    err: str
    ended: float  # monotonic

    @property
    def one_line_error(self) -> bool:
        return self.err.count("\n") == 1 and self.err.startswith("agentd: ")


def agentd(daemon: Daemon, *args: str) -> Result:
    """``agentd ARGS`` as its own process."""
    done = daemon.run_cli(*args)
    return Result(done.returncode, done.stdout, done.stderr, time.monotonic())


def race(daemon: Daemon, first: Sequence[str], second: Sequence[str], gap: float) -> list[Result]:
    """Two commands as processes, ``second`` started ``gap`` seconds after ``first``."""
    procs = []
    for args in (first, second):
        procs.append(
            subprocess.Popen(
                daemon.command(*args),
                cwd=REPO,
                env=worker_env(),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
        time.sleep(gap)  # the race's offset (0 to a few ms), not a wait for anything
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=60)
        results.append(Result(proc.returncode, out, err, time.monotonic()))
    return results


def refused_commands(task_id: str, call_id: str, big_file: Path) -> list[tuple[str, ...]]:
    """Commands that must be refused while ``call_id``, the unsafe call of turn 1 of
    ``task_id``, runs."""
    return [
        ("rewind", task_id, "--to", "99", "--yes"),
        ("rewind", task_id, "--to", "-1", "--yes"),
        ("rewind", task_id, "--to", "1", "--yes"),  # the live turn: its call has no result
        ("rewind", task_id, "--to", "0"),  # past the running unsafe call, without --yes
        ("rewind", task_id, "--to", "0", "--yes", "--restore-workspace"),  # no git
        ("fork", task_id, "--at", "1"),
        ("fork", task_id, "--at", "7"),
        ("approve-dangling", task_id, "--all", "--rerun"),
        ("approve-dangling", task_id, call_id, "--skip"),
        ("approve-dangling", task_id, call_id, "--result-file", str(big_file)),
        ("retry", task_id),
    ]


# -- what a task shows ------------------------------------------------------------------------


def workspace_file(daemon: Daemon, task_id: str, name: str) -> str:
    try:
        return (daemon.task(task_id).path / "workspace" / name).read_text()
    except FileNotFoundError:
        return ""


def runs(daemon: Daemon, task_id: str) -> int:
    return workspace_file(daemon, task_id, "runs.txt").count("run\n")


def kinds(daemon: Daemon, task_id: str) -> list[str]:
    return [str(r.get("k")) for r in journal_records(daemon.task(task_id))]


def call_result(daemon: Daemon, task_id: str, call_id: str) -> JSON | None:
    call = load_state(daemon.task(task_id)).calls.get(call_id)
    return None if call is None else call.result


def first_call(daemon: Daemon, task_id: str) -> str:
    (intent, *_) = of_kind(journal_records(daemon.task(task_id)), "intent")
    return str(intent["call_id"])


def wait_tool(daemon: Daemon, task_id: str) -> None:
    """Until the task's ``run_command`` has started (and written "start")."""

    def started() -> bool:
        running = daemon.row(task_id)["phase"] == "tool:run_command"
        return running and workspace_file(daemon, task_id, "out.txt") == "start\n"

    poll_for(started, 30, interval=0.02, what=f"{task_id}: its tool to run")


def changes_left(daemon: Daemon, task_id: str) -> list[str]:
    """What a refused command may have left on a task that then ran to its end."""
    task = daemon.task(task_id)
    found = [k for k in kinds(daemon, task_id) if k in ("rewind", "hold", "decision")]
    row = daemon.row(task_id)
    if row["restarts"]:
        found.append(f"restarts {row['restarts']}")
    events = [e.get("event") for e in daemon.events(task_id)]
    found += [str(e) for e in events if e in ("worker_killed", "task_rewound", "task_forked")]
    if events.count("worker_spawned") != 1:
        found.append(f"{events.count('worker_spawned')} workers")
    if task.decisions.exists() and any(task.decisions.iterdir()):
        found.append("decision files")
    found += [name for name in ("cancelled.json", *REQUEST_FILES) if (task.path / name).exists()]
    return found


# -- the campaign -------------------------------------------------------------------------------


@dataclass
class Tally:
    refused_given: int = 0  # each while the tool it would disturb ran
    void: int = 0  # trials whose tool ended before their commands: not judged
    refused_accepted: int = 0
    refused_not_one_line: int = 0
    changed_by_refused: int = 0
    cut_by_refused: int = 0
    accepted_waited: int = 0
    accepted_cut_early: int = 0
    cut_unreported: int = 0
    cut_reported: int = 0
    decision_races: int = 0
    rewind_races: int = 0
    rewinds_first: int = 0  # rewind races the rewind won (the cancel came after it)
    two_winners: int = 0
    decided_then_cancelled: int = 0  # both exit 0, one after the other (``sequence``)
    same_millisecond: int = 0  # both exit 0, the result and the cancel stamped alike
    orphans: int = 0  # workers that outlived the daemon, their task cancelled meanwhile
    no_winner: int = 0
    cancel_won: int = 0
    decision_won: int = 0
    cancel_not_in_force: int = 0
    cancelled_ran_again: int = 0
    unsafe_rerun: int = 0
    examples: list[str] = field(default_factory=list)

    def note(self, what: str) -> None:
        if len(self.examples) < 4:
            self.examples.append(what)


def refused(daemon: Daemon, plan: Plan, tally: Tally, root: Path) -> None:
    """Every refused command, four at a time, while a task's tool runs; task by task, so
    the tool outlasts the commands (a trial where it did not is void, and not judged)."""
    big = root / "big-result.txt"
    big.write_bytes(b"x" * (RESULT_FILE_LIMIT + 1))
    known = set(daemon.spool.task_ids())
    judged = []
    for i in range(plan.refused_tasks):
        name = f"refused-{i}"
        known.add(name)
        daemon.submit(running_script(plan.tool_seconds), name=name)
        wait_tool(daemon, name)
        call_id = first_call(daemon, name)
        commands = refused_commands(name, call_id, big)

        def give(command: tuple[str, ...], name: str = name, call_id: str = call_id) -> Result:
            result = agentd(daemon, *command)
            if call_result(daemon, name, call_id) is not None:  # the tool ended first
                return Result(-1, result.out, result.err, result.ended)
            return result

        with ThreadPoolExecutor(max_workers=4) as pool:
            results = list(pool.map(give, commands))
        if any(r.code == -1 for r in results):
            tally.void += 1
            continue
        judged.append(name)
        for command, result in zip(commands, results, strict=True):
            tally.refused_given += 1
            if result.code == 0:
                tally.refused_accepted += 1
                tally.note(f"accepted: {' '.join(command)}")
            elif not result.one_line_error or result.out:
                tally.refused_not_one_line += 1
                tally.note(f"{' '.join(command)}: {result.err!r}")
    for name in judged:
        row = daemon.wait_state(name, "done", "failed", "held", "cancelled", timeout=60)
        recorded = call_result(daemon, name, first_call(daemon, name)) or {}
        finished = workspace_file(daemon, name, "out.txt") == "start\nfinished\n"
        if not finished or "exit code 0" not in str(recorded.get("content")):
            tally.cut_by_refused += 1
            tally.note(f"{name}: cut off ({row['state']}, {recorded.get('content')!r})")
        left = changes_left(daemon, name)
        if row["state"] != "done" or left:
            tally.changed_by_refused += 1
            tally.note(f"{name}: {row['state']}, {left}")
    if set(daemon.spool.task_ids()) != known:
        tally.changed_by_refused += 1
        tally.note(f"refused forks made {set(daemon.spool.task_ids()) - known}")


def accepted(daemon: Daemon, tally: Tally) -> None:
    """A rewind past a call that ends within the grace waits for it; one past a call that
    outlasts the grace cuts it off and says so."""
    # the long call runs until cancelled: past the grace however long the steps before took
    cases: dict[str, float | None] = {"wait-short": GRACE * 0.75, "cut-long": None}
    for name, seconds in cases.items():
        daemon.submit(running_script(seconds), name=name)
    for name, seconds in cases.items():
        wait_tool(daemon, name)
        call_id = first_call(daemon, name)
        result = agentd(daemon, "rewind", name, "--to", "0", "--yes")
        said = [line for line in result.out.splitlines() if line.startswith("cut off:")]
        (event, *_) = daemon.events(name, "task_rewound") or [{}]
        killed = bool(daemon.events(name, "worker_killed"))
        results = of_kind(journal_records(daemon.task(name)), "result")
        recorded = any(r.get("call_id") == call_id for r in results)
        if result.code != 0:
            tally.note(f"{name}: rewind refused: {result.err!r}")
            tally.cut_unreported += 1
            continue
        if seconds is not None:
            if killed or said or not recorded:
                tally.accepted_cut_early += 1
                tally.note(f"{name}: cut off within the grace ({said}, killed {killed})")
            else:
                tally.accepted_waited += 1
        elif not (killed and said and call_id in event.get("cut_off", [])):
            tally.cut_unreported += 1
            tally.note(f"{name}: cut-off unreported ({result.out!r}, {event})")
        else:
            tally.cut_reported += 1
        done = agentd(daemon, "cancel", name)  # the new branch would run the command again
        if done.code != 0:
            daemon.wait_state(name, "done", "failed", "held", "cancelled", timeout=30)


def hold(daemon: Daemon, names: list[str]) -> dict[str, str]:
    """Hold each task on a dangling ``CHARGE`` (its worker killed mid-call); their calls."""
    for name in names:
        daemon.submit(charge_script(), name=name)
    calls = {}
    for name in names:

        def charging(row: JSON, name: str = name) -> bool:
            under_way = workspace_file(daemon, name, "runs.txt") == "run\n"
            return row["phase"] == "tool:run_command" and under_way

        row = daemon.wait_row(name, charging, timeout=30, what="the charge under way")
        os.kill(row["pid"], signal.SIGKILL)
    for name in names:
        row = daemon.wait_state(name, "held", "done", "failed", timeout=30)
        assert row["state"] == "held", row
        calls[name] = row["dangling"][0]["call_id"]
    return calls


def settled(daemon: Daemon, name: str) -> JSON:
    return daemon.wait_state(name, "done", "failed", "held", "cancelled", timeout=30)


def races(
    daemon: Daemon, plan: Plan, tally: Tally, rng: random.Random, *, up: bool
) -> list[tuple[str, str, Result, Result]]:
    """Hold the race tasks, then race ``cancel`` with a decision or a rewind on each, with
    the daemon up (``up``) or stopped; the daemon runs again when this returns."""
    where = "up" if up else "down"
    kinds_of = ["decision"] * plan.decision_races + ["rewind"] * plan.rewind_races
    names = [f"{where}-{kind}-{i}" for i, kind in enumerate(kinds_of)]
    hold(daemon, names)
    if not up:
        daemon.stop()
    outcomes = []
    for name, kind in zip(names, kinds_of, strict=True):
        other = (
            ("approve-dangling", name, "--all", "--rerun")
            if kind == "decision"
            else ("rewind", name, "--to", "0", "--yes")
        )
        pair = [("cancel", name), other]
        rng.shuffle(pair)
        first, second = race(daemon, pair[0], pair[1], gap=rng.uniform(0, 0.03))
        cancel, decision = (first, second) if pair[0][0] == "cancel" else (second, first)
        outcomes.append((name, kind, cancel, decision))
    if not up:
        daemon.start()
    return outcomes


def judge(daemon: Daemon, tally: Tally, outcomes: list[tuple[str, str, Result, Result]]) -> None:
    for name, kind, cancel, other in outcomes:
        row = settled(daemon, name)
        for result in (cancel, other):
            if result.code not in (0, 3) or (result.code == 3 and not result.one_line_error):
                tally.note(f"{name}: {result.code} {result.err!r}")
        if kind == "decision":
            tally.decision_races += 1
            winners = (cancel.code == 0) + (other.code == 0)
            order = sequence(daemon, name) if winners == 2 else None
            if order == "after":
                tally.decided_then_cancelled += 1
            elif order == "tie":
                tally.same_millisecond += 1
                tally.note(f"{name}: both won in the same millisecond ({row['state']})")
            elif winners == 2:
                tally.two_winners += 1
                tally.note(f"{name}: both won ({row['state']})")
            elif winners == 0:
                tally.no_winner += 1
                tally.note(f"{name}: none won: {cancel.err!r} {other.err!r}")
            elif cancel.code == 0:
                tally.cancel_won += 1
            else:
                tally.decision_won += 1
            decided = other.code == 0
            if runs(daemon, name) > (2 if decided else 1):
                tally.unsafe_rerun += 1
                tally.note(f"{name}: {runs(daemon, name)} runs")
        else:
            tally.rewind_races += 1
            tally.rewinds_first += other.code == 0
            rewound = "rewind" in kinds(daemon, name)
            if other.code != 0 and rewound:
                tally.changed_by_refused += 1
                tally.note(f"{name}: a refused rewind left its record")
        if cancel.code == 0 and row["state"] != "cancelled":
            tally.cancel_not_in_force += 1
            tally.note(f"{name}: cancel exited 0, task {row['state']}")


def sequence(daemon: Daemon, name: str) -> str | None:
    """When the decided call's result was recorded, against the cancel: ``"after"`` when
    the cancel came later (the decision was carried out in full, and the cancel then
    stopped a running task: no contention, ``record_cancel`` loses only while a decided
    call is not carried out), ``"tie"`` in the same millisecond (both stamps are ISO 8601
    UTC to the millisecond: the order is not told), else None (no result, or the cancel
    first: two winners)."""
    task = daemon.task(name)
    call_id = first_call(daemon, name)
    results = [r for r in of_kind(journal_records(task), "result") if r["call_id"] == call_id]
    try:
        cancelled_at = str(json.loads(task.cancellation.read_text())["cancelled_at"])
    except (OSError, ValueError, KeyError):
        return None
    if not results:
        return None
    result_at = str(results[0]["at"])
    return "after" if result_at < cancelled_at else "tie" if result_at == cancelled_at else None


def ran_again(daemon: Daemon, names: list[str], restart: bool) -> int:
    """Cancelled tasks whose journal grows after they were recorded cancelled: while the
    daemon runs on (a second and a doorbell), or after it is started again."""
    cancelled = [n for n in names if daemon.row(n)["state"] == "cancelled"]
    journals = {n: daemon.task(n).journal.read_bytes() for n in cancelled}
    counts = {n: runs(daemon, n) for n in cancelled}
    if restart:
        daemon.stop()
        daemon.start()
    for name in cancelled:
        daemon.cli("status", name)  # a look, as an operator would take
    time.sleep(1.0)  # a cancelled task that would run again has done so by now
    return sum(
        1
        for n in cancelled
        if daemon.task(n).journal.read_bytes() != journals[n]
        or runs(daemon, n) != counts[n]
        or daemon.row(n)["state"] != "cancelled"
    )


def orphans(daemon: Daemon, tally: Tally, count: int) -> None:
    """Tasks whose workers outlive a ``kill -9`` of the daemon, cancelled while no daemon
    runs: the next daemon must stop them before their tools go on (``late.txt``)."""
    names = [f"orphan-{i}" for i in range(count)]
    command = "sleep 3; echo after >> late.txt"
    for name in names:
        daemon.submit([reply(tool_use("run_command", command=command, timeout=60))], name=name)
    pids = {n: daemon.wait_row(n, lambda r: r["phase"] == "tool:run_command")["pid"] for n in names}
    daemon.kill()
    try:
        results = {n: agentd(daemon, "cancel", n) for n in names}
    finally:
        daemon.start()
    for name in names:
        tally.orphans += 1

        def ended(pid: int = pids[name]) -> bool:
            return not alive(pid)

        try:
            poll_for(ended, 10, what=f"{name}'s worker to end")
        except AssertionError:
            tally.cancelled_ran_again += 1
            tally.note(f"{name}: its worker runs on after the cancel")
    time.sleep(3.5)  # past the tools' sleep: a tool that survived the cancel has written
    for name in names:
        row = daemon.row(name)
        if results[name].code != 0 or row["state"] != "cancelled":
            tally.cancel_not_in_force += 1
            tally.note(f"{name}: cancel {results[name].code}, task {row['state']}")
        if workspace_file(daemon, name, "late.txt"):
            tally.cancelled_ran_again += 1
            tally.note(f"{name}: its tool went on after the cancel")


def figures_of(tally: Tally) -> list[Figure]:
    def v(name: str, value: int) -> Figure:
        return Figure(FAULT, name, value, value != 0)

    return [
        Figure(FAULT, "refused commands given while a tool ran", tally.refused_given),
        Figure(FAULT, "trials void (the tool ended before the commands)", tally.void),
        v("refused commands that exited 0", tally.refused_accepted),
        v("refused commands without a one-line error", tally.refused_not_one_line),
        v("tasks changed by a refused command", tally.changed_by_refused),
        v("calls cut off by a refused command", tally.cut_by_refused),
        Figure(FAULT, "accepted rewinds that waited for the call's result", tally.accepted_waited),
        v("accepted rewinds that cut off a call within the grace", tally.accepted_cut_early),
        Figure(FAULT, "cut-offs past the grace, reported", tally.cut_reported),
        v("cut-offs not reported", tally.cut_unreported),
        Figure(
            FAULT,
            "decision races (cancel won / decision won)",
            f"{tally.decision_races} ({tally.cancel_won} / {tally.decision_won})",
        ),
        Figure(
            FAULT,
            "rewind races (cancel first / rewind first)",
            f"{tally.rewind_races} ({tally.rewind_races - tally.rewinds_first} / "
            f"{tally.rewinds_first})",
        ),
        Figure(FAULT, "orphaned workers whose task was cancelled", tally.orphans),
        v("races with two winners", tally.two_winners),
        Figure(
            FAULT,
            "decision carried out, then the task cancelled (not a race)",
            tally.decided_then_cancelled,
        ),
        Figure(
            FAULT,
            "both exited 0, the result and the cancel in the same millisecond (order untold)",
            tally.same_millisecond,
        ),
        v("races with no winner", tally.no_winner),
        v("cancels exited 0 whose task did not end cancelled", tally.cancel_not_in_force),
        v("cancelled tasks that ran again", tally.cancelled_ran_again),
        v("unsafe calls run again without a winning decision", tally.unsafe_rerun),
    ]


def campaign(root: Path, plan: Plan, rng: random.Random) -> list[Figure]:
    tally = Tally()
    daemon = Daemon(root, config_text())
    try:
        daemon.start()
        say("refused commands while a tool runs ...")
        refused(daemon, plan, tally, root)
        say("accepted rewinds ...")
        accepted(daemon, tally)
        for up in (True, False):
            say(f"cancel races, daemon {'up' if up else 'down'} ...")
            outcomes = races(daemon, plan, tally, rng, up=up)
            judge(daemon, tally, outcomes)
            names = [name for name, *_ in outcomes]
            tally.cancelled_ran_again += ran_again(daemon, names, restart=not up)
        say("cancels of workers that outlived the daemon ...")
        orphans(daemon, tally, plan.orphans)
    finally:
        daemon.cleanup()
    figures = figures_of(tally)
    if tally.examples:
        figures.append(Figure(FAULT, "examples", " | ".join(tally.examples)))
    return figures


def run(quick: bool, *, seed: int | None = None) -> list[Figure]:
    seed = random.randrange(1 << 30) if seed is None else seed
    figures = [Figure(FAULT, "seed (--seed replays the choices)", str(seed))]
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="agentd-operator-") as folder, subreaper():
        try:
            figures += campaign(Path(folder), Plan.of(quick), random.Random(seed))
        except Exception as exc:
            traceback.print_exc()
            figures.append(Figure(FAULT, "could not run", f"{type(exc).__name__}: {exc}", True))
    figures.append(Figure(FAULT, "runtime s", time.monotonic() - started))
    return figures


def main(argv: list[str] | None = None) -> int:
    return campaign_main(run, "python -m tests.chaos.operator", __doc__ or "", argv)


if __name__ == "__main__":
    sys.exit(main())
