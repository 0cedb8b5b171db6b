"""Conversation chaos: fault class 26 of the campaign, ``agentd say`` and ``agentd continue``
among kill -9s (docs/design.md section 19).

A real daemon runs tasks on the scripted model whose turns each run an idempotent tool
that takes a moment (``stall``), so the tasks are live for seconds at a time. Each trial
picks a task and one of:

* ``say``: a message, numbered and unique, given to a live task (``agentd say``, its own
  process), then at once, or a random moment later, a ``kill -9`` of the task's worker
  (right after the message was accepted, during the model call that carries it, or in a
  tool call);
* ``continue``: a task that ended ``done`` is given a new instruction (``agentd
  continue``), and its worker killed a moment after it starts again.

Every task is then run to its end, and each message and instruction given (exit 0) is
looked for in the task's journal and in its final transcript (``agentd show --json``):
exactly once each. Figures, all must be 0: messages lost (accepted, never in the
transcript), messages sent twice (recorded or shown more than once), instructions lost,
tasks that did not end ``done``. Counted: trials, kills, messages, instructions. The
kills land on the same turn again and again, so the class's daemon has a crash-loop limit
no trial reaches (with the default of 3, its tasks end ``failed``, ``crash_loop``, and
the messages said to them are never taken: a run of the full mode so showed 6 of each).

``python -m tests.chaos.conversations [--full] [--seed N]``; quick mode in ``make test``.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import tempfile
import time
import traceback
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.daemon import Daemon, config_text, subreaper
from tests.faults.report import Figure, campaign_main
from tests.support import journal_records, poll_for, reply, text, tool_use

FAULT = "26 conversations"
JSON = dict[str, Any]


@dataclass(frozen=True)
class Plan:
    tasks: int
    turns: int  # per task, each a stall of the tool
    trials: int

    @classmethod
    def of(cls, quick: bool) -> Plan:
        return cls(tasks=3, turns=6, trials=8) if quick else cls(tasks=6, turns=40, trials=150)


def script(turns: int, extra: int) -> list[JSON]:
    """``turns`` turns of a short stall, an end, and ``extra`` more answers for the
    instructions a continue gives."""
    steps = [reply(text(f"step {n}"), tool_use("stall", seconds=0.4)) for n in range(turns)]
    again = [reply(text(f"Again {n}."), delay=0.6) for n in range(extra)]  # (a kill lands in it)
    return [*steps, reply(text("Done.")), *again]


def worker_pid(daemon: Daemon, name: str) -> int | None:
    pid = daemon.row(name).get("pid")
    return pid if isinstance(pid, int) else None


def kill_worker(daemon: Daemon, name: str) -> bool:
    pid = worker_pid(daemon, name)
    if pid is None:
        return False
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return False
    return True


def said_in(daemon: Daemon, name: str) -> tuple[Counter[str], Counter[str]]:
    """Each text of a user record in the journal, and of a user line the transcript shows."""
    recorded: Counter[str] = Counter()
    for record in journal_records(daemon.task(name)):
        if record["k"] == "user":
            for block in record["content"]:
                recorded[block.get("text", "")] += 1
    done = daemon.run_cli("show", name, "--json")
    shown: Counter[str] = Counter()
    for line in done.stdout.splitlines():
        item = json.loads(line)
        if item.get("kind") == "text" and item.get("role") == "user":
            shown[item["text"]] += 1
    return recorded, shown


def campaign(root: Path, plan: Plan, rng: random.Random) -> list[Figure]:
    # (kills land on the same turn again and again: no crash loop may end a task here)
    daemon = Daemon(root, config_text(max_workers=plan.tasks, crash_loop_limit=1000))
    daemon.start()
    names = [f"conv-{n}" for n in range(plan.tasks)]
    extra = plan.trials  # enough answers for every continue
    for name in names:
        daemon.submit(script(plan.turns, extra), name=name)
    messages: dict[str, list[str]] = {name: [] for name in names}
    instructions: dict[str, list[str]] = {name: [] for name in names}
    kills = refused = 0
    ended: dict[str, str] = {}
    try:
        for trial in range(plan.trials):
            live = [n for n in names if daemon.row(n)["state"] != "done"]
            # a message to a live task mostly, an instruction to a done one otherwise
            name = rng.choice(live if live and rng.random() < 0.75 else names)
            row = daemon.row(name)
            if row["state"] == "done":
                words = f"instruction {trial} for {name}"
                if daemon.run_cli("continue", name, "--prompt", words).returncode == 0:
                    instructions[name].append(words)
                    poll_for(lambda: worker_pid(daemon, name), 30, what="its worker")  # noqa: B023
                    time.sleep(rng.uniform(0, 0.3))
                    kills += kill_worker(daemon, name)
                else:
                    refused += 1
                continue
            words = f"message {trial} for {name}"
            if daemon.run_cli("say", name, words).returncode != 0:
                refused += 1  # (it ended meanwhile: continue takes it next time)
                continue
            messages[name].append(words)
            time.sleep(rng.choice([0.0, 0.0, rng.uniform(0.05, 1.2)]))
            kills += kill_worker(daemon, name)
        for name in names:
            row = daemon.wait_state(name, "done", "failed", "held", timeout=180)
            ended[name] = f"{row['state']} ({row['reason']})"
        lost = twice = lost_instructions = not_done = 0
        for name in names:
            recorded, shown = said_in(daemon, name)
            for words in messages[name]:
                lost += shown[words] == 0
                twice += recorded[words] > 1 or shown[words] > 1
            for words in instructions[name]:
                lost_instructions += shown[words] == 0
                twice += recorded[words] > 1 or shown[words] > 1
            not_done += daemon.row(name)["state"] != "done"
    finally:
        daemon.stop()
    return [
        Figure(FAULT, "trials", plan.trials),
        Figure(FAULT, "kill -9 of a worker", kills, violation=kills == 0),
        Figure(FAULT, "messages said", sum(map(len, messages.values()))),
        Figure(FAULT, "instructions given to done tasks", sum(map(len, instructions.values()))),
        Figure(FAULT, "refused (the task had ended or was not done)", refused),
        Figure(FAULT, "messages lost", lost, violation=bool(lost)),
        Figure(FAULT, "messages sent twice", twice, violation=bool(twice)),
        Figure(FAULT, "instructions lost", lost_instructions, violation=bool(lost_instructions)),
        Figure(FAULT, "tasks that did not end done", not_done, violation=bool(not_done)),
        *(
            [Figure(FAULT, "how they ended", "; ".join(f"{k}: {v}" for k, v in ended.items()))]
            if not_done
            else []
        ),
    ]


def run(quick: bool, *, seed: int | None = None) -> list[Figure]:
    seed = random.randrange(1 << 30) if seed is None else seed
    figures = [Figure(FAULT, "seed (--seed replays the choices)", str(seed))]
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="agentd-conversations-") as folder, subreaper():
        try:
            figures += campaign(Path(folder), Plan.of(quick), random.Random(seed))
        except Exception as exc:
            traceback.print_exc()
            figures.append(Figure(FAULT, "could not run", f"{type(exc).__name__}: {exc}", True))
    figures.append(Figure(FAULT, "runtime s", round(time.monotonic() - started, 1)))
    return figures


def main(argv: list[str] | None = None) -> int:
    return campaign_main(run, "python -m tests.chaos.conversations", __doc__ or "", argv)


if __name__ == "__main__":
    sys.exit(main())
