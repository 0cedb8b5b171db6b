"""Supervision chaos: fault classes 6, 7 and 9 of the campaign, against a real daemon.

Each class runs a real daemon (``python -m supervisor start``, ``tests.daemon.Daemon``) on
its own spool, with real workers (forked by the daemon's fork server) on the scripted
model, or on the real SDK against the local Messages API server (``worker.testing.messages_api``).

6. ``kill -9`` of the daemon under load. Tasks of 15 to 60 turns call tools of every
   effect class (``list_dir``/``read_file`` read-only, ``write_file`` idempotent,
   ``outbox_send`` keyed, ``append_file``/``run_command`` unsafe). Each round waits until
   every unfinished task has a running worker past its first turn, waits a random instant
   more, kills the daemon with SIGKILL, reads every journal as it stands, submits new
   tasks while no daemon runs (so the load stays at its level), and starts a new daemon,
   which must adopt the running workers and start the rest; every other round kills that
   daemon too, within half a second of its serving (while it starts workers). A census
   samples, all the while, which processes hold a task's journal open for writing
   (``WorkerCensus``).
7. Hangs and stalls, each timed from the fault to the daemon's verdict (its event's
   timestamp) against the limit the daemon enforces: a worker stopped with SIGSTOP, from
   the signal (heartbeat ``timeout``: ``worker_hung``); a tool that sleeps past
   ``deadlines.tool_call``, from its intent record (the daemon allows
   ``TOOL_DEADLINE_SLACK`` more, so a tool that keeps its own deadline can record its
   timed-out result: ``worker_stalled``); a model call that never answers, on the
   anthropic backend against the API server's ``hang`` fault (silent, or stalled
   mid-stream), from the request's arrival (``deadlines.model_call``: ``worker_stalled``).
   The limits differ, so each fault meets the verdict it is for, and the faults start
   once the fork server is ready (a cold worker imports the SDK inside its first model
   call, which a deadline of seconds would count). Every task must then complete.
9. Load: ``load_tasks`` tasks at once (``max_workers`` leaves room for all), new ones
   submitted as others end, and for ``load_window`` seconds a random running worker is
   killed with SIGKILL every ``kill_every`` seconds or so (only once it has recorded a turn
   past its last kill, so no kill makes a crash loop). Held tasks (a killed unsafe call)
   are decided as a careful operator would: an ``append_file`` whose line is in the file
   gets that outcome recorded, anything else is re-run. The daemon's RSS is sampled all
   along; the figure is the growth from the first seconds after warm-up to the last
   seconds of the window, at the same load.

For every task of classes 6 and 9 the audit checks: it ended ``done`` (``end_turn``)
with every turn of its script recorded exactly once; every journal read along the way
(after each kill) is a prefix of the final journal (no recorded turn or tool result lost
or changed); its transcript pairs every tool_use with one tool_result; no worker of it
found the task lock taken (a daemon that started a second worker). The census runs
through both classes.

Bounds (violations): every count of lost, doubled or unpaired things must be 0;
detection must fall within ``limit + 1 s + DETECTION_TOLERANCE`` (0.5 s: the daemon's
tick and the scheduling of ~10 busy processes on 2 loaded cores), and not before
``limit - heartbeat.interval - 0.1 s`` (a false alarm); daemon RSS may grow at most
the larger of ``RSS_GROWTH_MB`` (10 MB) and ``RSS_GROWTH_SHARE`` (20 %) between warm-up and
the end of the load window (medians of ``RSS_SPAN`` seconds of samples each).

``python -m tests.chaos.supervision [--full] [--only kills|hangs|load] [--seed N]`` prints
the table and exits 1 on any violation; ``tests/test_campaigns.py`` runs the quick
mode in ``make test``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import re
import signal
import statistics
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from supervisor.coordination import ring
from supervisor.decisions import decide
from supervisor.liveness import TOOL_DEADLINE_SLACK
from supervisor.record import TaskRecord
from supervisor.status import held_calls, load_state, read_heartbeat
from supervisor.submit import submit
from tests.daemon import Daemon, WorkerCensus, alive, parse_time, subreaper
from tests.daemon import config_text as daemon_config
from tests.faults.report import Figure, print_figures, violations
from tests.support import assert_paired, journal_records, of_kind, poll_for, reply, text, tool_use
from worker.errors import AgentdError
from worker.protocol import FINAL_STATES, ExitCode
from worker.testing.messages_api import Fault, MessagesAPIServer, Reply

JSON = dict[str, Any]
KILLS, HANGS, LOAD = "6 daemon kill -9", "7 hangs and stalls", "9 load + worker kill -9"
CLASSES = ("kills", "hangs", "load")
MODEL = "claude-chaos-supervision"
DETECTION_TOLERANCE = 0.5  # seconds past limit + 1 s
RSS_GROWTH_MB, RSS_GROWTH_SHARE = 10.0, 0.20
RSS_PERIOD = 0.5  # seconds between samples of the daemon's RSS
RSS_SPAN = 5.0  # seconds of samples whose median is "after warm-up" / "at the end"
FINAL = frozenset(FINAL_STATES)
UNSAFE_PHASES = frozenset({"tool:append_file", "tool:run_command"})


@dataclass(frozen=True)
class Plan:
    """How much of each class to run."""

    kill_tasks: int  # unfinished tasks at each daemon kill
    kill_rounds: int
    kill_turns: tuple[int, int]  # script length range
    hang_samples: int  # of each kind
    load_tasks: int  # at once
    load_window: float  # seconds of worker kills
    load_turns: tuple[int, int]
    kill_every: float  # seconds between worker kills, on average
    warmup: float  # seconds of the load window before RSS counts as warmed up

    @classmethod
    def of(cls, quick: bool) -> Plan:
        if quick:
            return cls(
                kill_tasks=20,
                kill_rounds=2,
                kill_turns=(15, 30),
                hang_samples=2,
                load_tasks=20,
                load_window=15.0,
                load_turns=(8, 16),
                kill_every=0.3,
                warmup=4.0,
            )
        return cls(
            kill_tasks=50,
            kill_rounds=12,
            kill_turns=(30, 60),
            hang_samples=6,
            load_tasks=100,
            load_window=90.0,
            load_turns=(20, 40),
            kill_every=0.25,
            warmup=20.0,
        )


def config_text(
    *,
    max_workers: int,
    interval: float = 0.5,
    timeout: float = 10.0,
    model_call: float = 60.0,
    tool_call: float = 30.0,
    grace: float = 1.0,
    crash_loop_limit: int = 5,
    crash_tools: bool = False,
) -> str:
    return daemon_config(
        max_workers=max_workers,
        interval=interval,
        timeout=timeout,
        model_call=model_call,
        tool_call=tool_call,
        backoff_max=1.0,
        crash_loop_limit=crash_loop_limit,
        stop_grace=grace,
        model=MODEL,
        sandbox=None,
        tool_modules=("tests.crash_tools",) if crash_tools else (),
    )


def say(message: str) -> None:
    print(f"supervision: {message}", file=sys.stderr, flush=True)


def within(predicate: Callable[[], object], timeout: float, interval: float = 0.05) -> bool:
    """``poll_for`` that answers False instead of failing: a campaign counts, not asserts."""
    try:
        poll_for(predicate, timeout, interval=interval)
    except AssertionError:
        return False
    return True


def gone(pid: int, timeout: float) -> bool:
    """Wait until process ``pid`` has ended (a zombie has)."""
    return within(lambda: not alive(pid), timeout, interval=0.01)


def file_text(path: Path) -> str:
    """What a file holds; nothing when it does not exist."""
    try:
        return path.read_text()
    except FileNotFoundError:
        return ""


# -- scripts -------------------------------------------------------------------------------


def mixed_script(tag: str, turns: int, delay: float, offset: int) -> list[JSON]:
    """``turns`` turns: tool calls of every effect class in turn, then a final answer."""
    responses = []
    for i in range(1, turns):
        blocks = [text(f"Step {i}.")]
        kind = (i + offset) % 6
        if kind == 0:
            blocks.append(tool_use("list_dir", path="."))
        elif kind == 1:
            blocks.append(tool_use("write_file", path=f"notes/{i}.txt", content=f"step {i}"))
        elif kind == 2:
            blocks.append(tool_use("outbox_send", to="ops", body=f"{tag} step {i}"))
        elif kind == 3:
            blocks.append(tool_use("append_file", path="log.txt", content=f"{tag} {i}\n"))
            blocks.append(tool_use("read_file", path="log.txt"))
        elif kind == 4:
            command = f"sleep 0.2; echo {tag} {i}"  # long enough to be killed in, at times
            blocks.append(tool_use("run_command", command=command, timeout=20))
        else:
            blocks.append(tool_use("write_file", path="status.txt", content=f"at step {i}"))
        responses.append(reply(*blocks, delay=delay))
    responses.append(reply(text("All done."), delay=delay))
    return responses


# -- the tasks of a campaign ------------------------------------------------------------------


@dataclass
class Audit:
    tasks: int = 0
    not_completed: int = 0
    turns_lost: int = 0  # recorded turn or result records gone or changed later
    rewritten: int = 0  # journals that do not extend what was read of them earlier
    doubled: int = 0  # turns recorded twice
    unpaired: int = 0
    restarts: int = 0
    adopted: int = 0
    lock_refused: int = 0  # workers that found the task lock taken (exit 6)
    examples: list[str] = field(default_factory=list)

    def note(self, what: str) -> None:
        if len(self.examples) < 3:
            self.examples.append(what)


@dataclass(frozen=True)
class Running:
    """A task's live worker, as its heartbeat tells."""

    pid: int
    turn: int
    phase: str  # idle, model, tool:NAME


class Book:
    """The tasks a campaign submitted, what was seen of their journals, and the operator
    who decides their held calls."""

    def __init__(self, daemon: Daemon, rng: random.Random) -> None:
        self.daemon = daemon
        self.rng = rng
        self.turns: dict[str, int] = {}
        self.seen: dict[str, list[list[JSON]]] = {}
        self.final: set[str] = set()
        self.holds_decided = 0

    def submit(self, turns: tuple[int, int], delay: tuple[float, float]) -> str:
        n = self.rng.randint(*turns)
        name = f"t{len(self.turns):04d}"
        script = mixed_script(name, n, round(self.rng.uniform(*delay), 3), self.rng.randrange(6))
        task_id = self.daemon.submit(script, name=name)
        self.turns[task_id] = n
        self.seen[task_id] = []
        return task_id

    def unfinished(self) -> list[str]:
        for task_id in self.turns.keys() - self.final:
            if TaskRecord.load(self.daemon.task(task_id)).state in FINAL:
                self.final.add(task_id)
        return sorted(self.turns.keys() - self.final)

    def top_up(self, level: int, turns: tuple[int, int], delay: tuple[float, float]) -> None:
        for _ in range(level - len(self.unfinished())):
            self.submit(turns, delay)

    def running(self) -> dict[str, Running]:
        """Unfinished tasks whose worker runs and beats, by task id."""
        found = {}
        for task_id in sorted(self.turns.keys() - self.final):
            task = self.daemon.task(task_id)
            record = TaskRecord.load(task)
            if record.state in FINAL:
                self.final.add(task_id)
            if record.state != "running" or not record.pid:
                continue
            beat = read_heartbeat(task) or {}
            if beat.get("pid") == record.pid:
                found[task_id] = Running(record.pid, int(beat["turn"]), str(beat["phase"]))
        return found

    def load_up(
        self, level: int, turns: tuple[int, int], delay: tuple[float, float], timeout: float
    ) -> None:
        """Top the unfinished tasks up to ``level`` and wait until each has a running worker
        past its first turn; again while more than a tenth of them ended meanwhile, for up
        to ``timeout`` s."""
        deadline = time.monotonic() + timeout

        def mid_flight() -> bool:
            past_first = sum(1 for w in self.running().values() if w.turn >= 1)
            return past_first >= len(self.unfinished())

        while True:
            self.top_up(level, turns, delay)
            within(mid_flight, deadline - time.monotonic())
            if len(self.unfinished()) >= level - level // 10 or time.monotonic() >= deadline:
                return

    def observe(self, task_id: str) -> None:
        self.seen[task_id].append(journal_records(self.daemon.task(task_id)))

    def decide_holds(self) -> None:
        """Decide every held call like a careful operator: an ``append_file`` whose line is
        in its file took effect (record that), anything else is re-run."""
        for task_id in self.unfinished():
            task = self.daemon.task(task_id)
            if TaskRecord.load(task).state != "held":
                continue
            with contextlib.suppress(AgentdError):  # (decided meanwhile: seen next time)
                for row in held_calls(task):
                    tool_input = row["input"]
                    if row["tool"] == "append_file" and tool_input["content"] in file_text(
                        task.path / "workspace" / tool_input["path"]
                    ):
                        decide(task, row["call_id"], action="result", result="appended")
                    else:
                        decide(task, row["call_id"], action="rerun")
                    self.holds_decided += 1
                ring(self.daemon.spool, task_id)

    def finish(self, timeout: float) -> bool:
        """Wait for every task to end, deciding held calls meanwhile."""

        def ended() -> bool:
            self.decide_holds()
            return not self.unfinished()

        return within(ended, timeout, interval=0.2)

    def audit(self) -> Audit:
        audit = Audit(tasks=len(self.turns))
        for task_id, n in sorted(self.turns.items()):
            task = self.daemon.task(task_id)
            record = TaskRecord.load(task)
            records = journal_records(task)
            turns = [r["turn"] for r in of_kind(records, "turn")]
            audit.doubled += len(turns) - len(set(turns))
            if (record.state, record.reason) != ("done", "end_turn") or sorted(turns) != list(
                range(1, n + 1)
            ):
                audit.not_completed += 1
                audit.note(f"{task_id}: {record.state} ({record.reason}), turns {turns}")
            for earlier in self.seen[task_id]:
                if records[: len(earlier)] != earlier:
                    audit.rewritten += 1
                    audit.note(f"{task_id}: the journal does not extend what was read before")
                audit.turns_lost += sum(
                    1 for r in earlier if r.get("k") in ("turn", "result") and r not in records
                )
            try:
                assert_paired(load_state(task).messages)
            except (AssertionError, AgentdError) as exc:
                audit.unpaired += 1
                audit.note(f"{task_id}: {exc}")
            audit.restarts += record.restarts
            events = self.daemon.events(task_id)
            audit.adopted += sum(1 for e in events if e.get("event") == "worker_adopted")
            audit.lock_refused += sum(
                1
                for e in events
                if e.get("event") == "worker_exited" and e["code"] == ExitCode.LOCKED
            )
        return audit


def must_be_zero(fault: str, name: str, value: int) -> Figure:
    return Figure(fault, name, value, violation=value != 0)


def audit_figures(fault: str, audit: Audit, census: WorkerCensus) -> list[Figure]:
    figures = [
        Figure(fault, "tasks run", audit.tasks),
        Figure(fault, "worker restarts", audit.restarts),
        Figure(fault, "workers seen by the census", len(census.seen)),
        Figure(fault, "most workers alive at once", census.max_live),
        Figure(fault, "census samples", census.samples),
        must_be_zero(fault, "tasks lost (not done, or turns missing)", audit.not_completed),
        must_be_zero(fault, "recorded turns or results lost", audit.turns_lost),
        must_be_zero(fault, "journals not extending what was read", audit.rewritten),
        must_be_zero(fault, "turns recorded twice", audit.doubled),
        must_be_zero(fault, "transcripts unpaired", audit.unpaired),
        must_be_zero(fault, "tasks run by two workers at once", len(census.overlapping_tasks())),
        must_be_zero(fault, "second workers refused by a task lock", audit.lock_refused),
    ]
    if audit.examples:
        figures.append(Figure(fault, "examples", "; ".join(audit.examples)))
    return figures


# -- 6: kill -9 of the daemon under load ------------------------------------------------------


def daemon_kills(root: Path, plan: Plan, rng: random.Random) -> list[Figure]:
    daemon = Daemon(root, config_text(max_workers=plan.kill_tasks + 10))
    book = Book(daemon, rng)
    delay = (0.2, 0.4)  # seconds a model reply takes: tasks span several rounds
    at_kill: list[int] = []
    restart_times: list[float] = []
    early_kills = 0
    try:
        with WorkerCensus(daemon.spool, period=0.02) as census:
            daemon.start(timeout=30)
            for round_no in range(plan.kill_rounds):
                book.load_up(plan.kill_tasks, plan.kill_turns, delay, timeout=30)
                time.sleep(rng.uniform(0.0, 1.0))  # the random instant of the kill
                at_kill.append(sum(1 for w in book.running().values() if w.turn >= 1))
                killed = time.monotonic()
                daemon.kill()
                for task_id in book.unfinished():
                    book.observe(task_id)
                book.top_up(plan.kill_tasks, plan.kill_turns, delay)  # while no daemon runs
                time.sleep(rng.uniform(0.0, 0.5))  # down for a random while
                daemon.start(timeout=30)
                restart_times.append(time.monotonic() - killed)
                if round_no % 2:  # again, while it adopts workers and starts the new tasks
                    time.sleep(rng.uniform(0.0, 0.5))
                    daemon.kill()
                    early_kills += 1
                    for task_id in book.unfinished():
                        book.observe(task_id)
                    daemon.start(timeout=30)
                say(f"daemon kill {round_no + 1}: {at_kill[-1]} tasks running past turn 1")
            finished = book.finish(60 + 2 * plan.kill_tasks)
            daemon.run_cli("stop")
        audit = book.audit()
    finally:
        daemon.cleanup()
    return [
        Figure(KILLS, "daemon kills", len(at_kill) + early_kills),
        Figure(KILLS, "tasks running at a kill, fewest", min(at_kill, default=0)),
        Figure(KILLS, "kills within 0.5 s of serving (not counted above)", early_kills),
        Figure(KILLS, "kill to serving again, worst s", max(restart_times, default=0.0)),
        Figure(KILLS, "workers adopted", audit.adopted),
        Figure(KILLS, "holds decided", book.holds_decided),
        *audit_figures(KILLS, audit, census),
        Figure(KILLS, "all tasks ended in time", str(finished), not finished),
    ]


# -- 7: hangs and stalls ----------------------------------------------------------------------


def steps(n: int, delay: float = 0.15) -> list[JSON]:
    """n - 1 turns that each write a file, then a final answer."""
    writes = [
        reply(
            text(f"Step {i}."), tool_use("write_file", path=f"s{i}.txt", content="x"), delay=delay
        )
        for i in range(1, n)
    ]
    return [*writes, reply(text("All done."), delay=delay)]


class HangingModel:
    """The Messages API's answers for the model-hang tasks: turn 0 a tool call; the first
    request of turn 1 never answered (silent, or stalled mid-stream), the next answered."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.hung_at: dict[str, float] = {}  # task -> wall time its hanging request arrived
        self._lock = threading.Lock()

    def __call__(self, request: JSON) -> Reply | Fault | None:
        messages = request.get("messages") or [{}]
        first = messages[0].get("content")
        prompt = first if isinstance(first, str) else " ".join(b.get("text", "") for b in first)
        match = re.search(r"Task (\S+):", prompt)
        turn = sum(1 for m in messages if m.get("role") == "assistant")
        if match is None or turn > 1:
            return None
        if turn == 0:
            return Reply.tool_use("write_file", {"path": "a.txt", "content": "a"}, text="Hi.")
        task = match.group(1)
        with self._lock:
            if task in self.hung_at:
                return Reply.text("Done.")
            self.hung_at[task] = time.time()
            stall_mid_stream = len(self.hung_at) % 2 == 0
        return Fault.hang(self.seconds, after_events=2 if stall_mid_stream else None)


#: (when the daemon gave its verdict, when the fault began), as Unix times; None: not seen
Timing = tuple[float | None, float | None]


def detection_figures(
    fault: str, what: str, timings: Sequence[Timing], limit: float, interval: float
) -> list[Figure]:
    """Worst and median detection of one kind of fault against ``limit``. A violation: a
    fault not detected, detected past ``limit + 1 s + DETECTION_TOLERANCE``, or before
    ``limit - interval - 0.1 s`` (a false alarm: the heartbeat may be one interval old)."""
    times = [
        round((seen - at) * 1000) for seen, at in timings if seen is not None and at is not None
    ]
    missed = len(timings) - len(times)
    ms = round(limit * 1000)
    late = not times or max(times) > ms + 1000 + DETECTION_TOLERANCE * 1000
    early = bool(times) and min(times) < ms - (interval + 0.1) * 1000
    return [
        Figure(fault, f"{what}: limit ms", ms),
        Figure(fault, f"{what}: samples", len(timings)),
        Figure(fault, f"{what}: detected, median ms", round(statistics.median(times or [0]))),
        Figure(fault, f"{what}: detected, worst ms", max(times, default=0), late),
        Figure(fault, f"{what}: detected, earliest ms", min(times, default=0), early),
        must_be_zero(fault, f"{what}: never detected", missed),
    ]


def verdict_after(daemon: Daemon, task_id: str, event: str, since: float | None) -> float | None:
    """When the daemon first gave its verdict ``event`` on a task at or after ``since``."""
    if since is None:
        return None
    stamps = [parse_time(e["timestamp"]) for e in daemon.events(task_id, event)]
    return min((t for t in stamps if t >= since), default=None)


def hangs(root: Path, plan: Plan, rng: random.Random) -> list[Figure]:
    # Each limit is set apart from the others, so every fault meets the verdict it is for
    # (a worker stopped while its tool deadline runs out first would be "stalled").
    interval, timeout, tool_call, model_call, grace = 0.2, 2.0, 1.5, 3.0, 1.0
    config = config_text(
        max_workers=32,
        interval=interval,
        timeout=timeout,
        model_call=model_call,
        tool_call=tool_call,
        grace=grace,
        crash_loop_limit=3,
        crash_tools=True,
    )
    model = HangingModel(seconds=60.0)
    stall_script = [
        reply(tool_use("write_file", path="a.txt", content="a")),
        reply(tool_use("stall", seconds=60, once="stalled")),
        reply(text("Done.")),
    ]
    with MessagesAPIServer(responder=model) as server:
        env = {
            "ANTHROPIC_BASE_URL": server.base_url,
            "ANTHROPIC_API_KEY": str(server.api_key),
            "NO_PROXY": "127.0.0.1,localhost",
            "no_proxy": "127.0.0.1,localhost",
        }
        daemon = Daemon(root, config)
        try:
            daemon.start(env, timeout=30)
            # Workers start warm from here on: a cold worker imports the SDK inside its
            # first model call, which a deadline of seconds would count (see the report).
            events = daemon.log_events
            within(lambda: any(e["event"] == "forkserver_ready" for e in events()), 60, 0.1)
            n = plan.hang_samples
            stops = [daemon.submit(steps(8), name=f"sigstop-{i}") for i in range(n)]
            stalls = [daemon.submit(stall_script, name=f"stall-{i}") for i in range(n)]
            model_hangs = [f"model-hang-{i}" for i in range(n)]
            for name in model_hangs:
                submit(daemon.spool, daemon.config, prompt=f"Task {name}: go.", name=name)
                ring(daemon.spool, name)
            stopped_at = {task_id: sigstop_mid_flight(daemon, task_id, rng) for task_id in stops}
            everyone = [*stops, *stalls, *model_hangs]

            def all_ended() -> bool:
                return all(TaskRecord.load(daemon.task(t)).state in FINAL for t in everyone)

            within(all_ended, 60, interval=0.2)
            not_done = [t for t in everyone if daemon.row(t)["state"] != "done"]
            hung = [
                (verdict_after(daemon, t, "worker_hung", at), at) for t, at in stopped_at.items()
            ]
            stalled: list[Timing] = []
            kills_after_term = [0.0]
            for task_id in stalls:
                intents = of_kind(journal_records(daemon.task(task_id)), "intent")
                began = min(
                    (parse_time(r["at"]) for r in intents if r["tool"] == "stall"), default=None
                )
                seen = verdict_after(daemon, task_id, "worker_stalled", began)
                killed = verdict_after(daemon, task_id, "worker_killed", seen)
                stalled.append((seen, began))
                if seen is not None and killed is not None:
                    kills_after_term.append(killed - seen)
            model_hung = [
                (
                    verdict_after(daemon, t, "worker_stalled", model.hung_at.get(t)),
                    model.hung_at.get(t),
                )
                for t in model_hangs
            ]
        finally:
            daemon.cleanup()
    term_to_kill = round(max(kills_after_term) * 1000)
    slack = f"tool_call {tool_call:g} + {TOOL_DEADLINE_SLACK:g} s slack"
    return [
        *detection_figures(HANGS, "SIGSTOP (heartbeat.timeout)", hung, timeout, interval),
        *detection_figures(
            HANGS, f"tool sleeping ({slack})", stalled, tool_call + TOOL_DEADLINE_SLACK, interval
        ),
        Figure(HANGS, f"tool sleeping: TERM to KILL, worst ms (grace {grace:g} s)", term_to_kill),
        *detection_figures(
            HANGS, "model call unanswered (model_call)", model_hung, model_call, interval
        ),
        must_be_zero(HANGS, "tasks not completed afterwards", len(not_done)),
        must_be_zero(HANGS, "requests the API server rejected", len(server.rejected)),
    ]  # fmt: skip


def sigstop_mid_flight(daemon: Daemon, task_id: str, rng: random.Random) -> float:
    """SIGSTOP the task's worker at a random instant past its second turn; when."""

    def past_turn_2(row: JSON) -> bool:
        return row["state"] == "running" and row["turn"] >= 2 and bool(row["pid"])

    row = daemon.wait_row(task_id, past_turn_2, timeout=30)
    time.sleep(rng.uniform(0.0, 0.2))  # a random instant of its turn
    os.kill(row["pid"], signal.SIGSTOP)
    return time.time()


# -- 9: load, with worker kills ---------------------------------------------------------------


class MemorySampler:
    """The RSS of one process, sampled in a thread: (monotonic time, bytes)."""

    def __init__(self, pid: int) -> None:
        self.process = psutil.Process(pid)
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(psutil.Error):
                self.samples.append((time.monotonic(), self.process.memory_info().rss))
            self._stop.wait(RSS_PERIOD)

    def median_mb(self, start: float, end: float) -> float:
        values = [rss for at, rss in self.samples if start <= at <= end]
        return statistics.median(values) / 2**20 if values else float("nan")


def kill_a_worker(book: Book, rng: random.Random, last_kill_turn: dict[str, int]) -> int:
    """SIGKILL a random running worker that recorded a turn since its task's last kill
    (half the time, one in an unsafe tool call, when there is one: a hold); read its
    journal once it is gone. The number of workers killed: 1, or 0 when none could be."""
    victims = {t: w for t, w in book.running().items() if w.turn > last_kill_turn.get(t, 0)}
    unsafe = [t for t, w in victims.items() if w.phase in UNSAFE_PHASES]
    if not victims:
        return 0
    task_id = rng.choice(unsafe if unsafe and rng.random() < 0.5 else sorted(victims))
    worker = victims[task_id]
    try:
        os.kill(worker.pid, signal.SIGKILL)
    except ProcessLookupError:
        return 0
    last_kill_turn[task_id] = worker.turn
    gone(worker.pid, 5.0)
    book.observe(task_id)
    return 1


def load(root: Path, plan: Plan, rng: random.Random) -> list[Figure]:
    daemon = Daemon(root, config_text(max_workers=plan.load_tasks + 20))
    book = Book(daemon, rng)
    delay = (0.3, 0.6)
    kills = 0
    last_kill_turn: dict[str, int] = {}
    try:
        with WorkerCensus(daemon.spool, period=0.05) as census:
            proc = daemon.start(timeout=30)
            with MemorySampler(proc.pid) as memory:
                book.top_up(plan.load_tasks, plan.load_turns, delay)
                began = time.monotonic()
                end = began + plan.load_window
                next_kill = next_chores = began
                while (now := time.monotonic()) < end:
                    if now >= next_chores:  # new tasks for those that ended, decisions
                        book.top_up(plan.load_tasks, plan.load_turns, delay)
                        book.decide_holds()
                        next_chores = now + 1.0
                    kills += kill_a_worker(book, rng, last_kill_turn)
                    next_kill = max(next_kill + rng.uniform(0.5, 1.5) * plan.kill_every, now)
                    time.sleep(max(0.0, next_kill - time.monotonic()))
                ended = time.monotonic()
                warm = began + plan.warmup
                rss_warm = memory.median_mb(warm, warm + RSS_SPAN)
                rss_end = memory.median_mb(ended - RSS_SPAN, ended)
                rss_peak = max((rss for _, rss in memory.samples), default=0) / 2**20
                say(f"load window over: {kills} worker kills, {len(book.turns)} tasks")
                finished = book.finish(60 + 2 * plan.load_tasks)
                rss_idle = memory.median_mb(time.monotonic() - 2.0, time.monotonic())
            daemon.run_cli("stop")
        audit = book.audit()
    finally:
        daemon.cleanup()
    bound = max(RSS_GROWTH_MB, RSS_GROWTH_SHARE * rss_warm)
    growth = rss_end - rss_warm
    bad = not growth <= bound  # (NaN, no samples, is a violation too)
    return [
        Figure(LOAD, "kill window s", plan.load_window),
        Figure(LOAD, "worker kills", kills),
        Figure(LOAD, "holds decided", book.holds_decided),
        *audit_figures(LOAD, audit, census),
        Figure(LOAD, "all tasks ended in time", str(finished), not finished),
        Figure(LOAD, f"daemon RSS {plan.warmup:g} s into the window, MB", rss_warm),
        Figure(LOAD, "daemon RSS at the end of the window, MB", rss_end),
        Figure(LOAD, "daemon RSS peak, MB", rss_peak),
        Figure(LOAD, "daemon RSS once all ended, MB", rss_idle),
        Figure(LOAD, f"daemon RSS growth after warm-up, MB (bound {bound:.1f})", growth, bad),
    ]


# -- the campaign ---------------------------------------------------------------------------


def run(quick: bool, *, only: tuple[str, ...] = CLASSES, seed: int | None = None) -> list[Figure]:
    """Run the classes ``only`` (quick or full); their figures, one table's worth."""
    seed = random.randrange(1 << 30) if seed is None else seed
    plan = Plan.of(quick)
    runners = {"kills": daemon_kills, "hangs": hangs, "load": load}
    faults = {"kills": KILLS, "hangs": HANGS, "load": LOAD}
    figures = [Figure("6, 7, 9 supervision", "seed (--seed replays the choices)", str(seed))]
    with tempfile.TemporaryDirectory(prefix="agentd-supervision-") as folder, subreaper():
        for name in only:
            rng = random.Random(f"{seed}-{name}")
            started = time.monotonic()
            say(f"running {name} ({'quick' if quick else 'full'}, seed {seed}) ...")
            try:
                figures += runners[name](Path(folder) / name, plan, rng)
            except Exception as exc:
                traceback.print_exc()
                figures.append(
                    Figure(faults[name], "could not run", f"{type(exc).__name__}: {exc}", True)
                )
            figures.append(Figure(faults[name], "runtime s", time.monotonic() - started))
    return figures  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.chaos.supervision", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--full", action="store_true", help="the full campaign (make chaos)")
    parser.add_argument("--only", action="append", choices=CLASSES, metavar="NAME")
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args(argv)
    figures = run(not args.full, only=tuple(args.only or CLASSES), seed=args.seed)
    print_figures(figures)
    return 1 if violations(figures) else 0


if __name__ == "__main__":
    sys.exit(main())
