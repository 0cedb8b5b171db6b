"""API faults (fault class 8): real workers on the real SDK while the Messages API fails.

A real daemon (``agentd start --detach``) runs tasks on the ``anthropic`` backend, whose
``ANTHROPIC_BASE_URL`` points at an in-process local Messages API
(``worker.testing.messages_api.MessagesAPIServer``) that validates every transcript it is sent the
way the API does. Each task is a 5-turn tool-using script (``tests.faults.common.mixed_plan``:
``write_file``, unsafe ``append_file``, keyed ``outbox_send``; 6 turns in full mode) that
the server answers by turn. At random turns of each task the server serves faults instead
of the reply: 429 (with ``retry-after``), 500, 529, a connection dropped before any
response, a stream cut mid-way, a stream that ends without ``message_stop``, a tool_use
whose input JSON is malformed, an ``error`` event mid-stream. A faulted turn gets one fault,
or a burst of two or three in a row (the same kind or mixed), and after some faults the
worker's process group is SIGKILLed right away (5 to 40 ms after the fault is written out:
in its backoff, before it retries). In a few tasks (one in quick mode, three in full) the
worker is frozen (SIGSTOP) as the server answers a turn with a complete reply: it stops
beating, and the hang verdict (``worker_hung``: its dead-man's kill, which the daemon names)
must kill it, so the reply it never read is one that kill caught. Held calls are decided
by the careful operator of ``tests.faults.common``.

Why the real daemon rather than a restart loop of our own: the daemon restarts a worker on
exit the way production does (its restart policy, and its fork server, which makes a
restart cost tens of milliseconds instead of the 2 s SDK import, so a quick campaign can
afford many kills), and the figures then include what the daemon does with exit codes.

Each served response carries a unique ``output_tokens`` count, so every turn record's usage
names the response it came from. Checked per task: no turn recorded twice; no response's
usage counted twice; no usage counted from a faulted response; every complete reply the
server served is counted, unless the worker it was served to was killed before it recorded
it (its tokens were spent: counted never, asked again by the next worker; asked again by
the same worker, or by a worker nobody killed, a complete reply was thrown away). Each
reply is served to the task lock's holder (``Served.pid``: a worker killed with its
request in flight stays the lock's last holder), and the kill is ours or the daemon's own:
on a loaded machine a worker whose heartbeat is older than ``[heartbeat] timeout`` is
killed by its dead-man (``worker_hung``) or stops one whose model call outlived ``[deadlines]
model_call`` (``worker_stalled``), and the task's events name it (``daemon_stops``); a
frozen worker is found hung and killed by the daemon; the task's usage counters
(``agentd status``) equal the sum over the replies counted, and so does its cost: the cost
from the journal (and status' ``cost_usd``) is the cost of the replies counted, exactly
("spend counted twice" 0); the server rejected no
transcript; the journal after each kill is a prefix of the final one; and the task ends
``done`` after all its turns with every tool_use paired and every side effect exactly once
(``common.check_task``).

``python -m tests.chaos.api_faults [--full] [--trials N] [--seed S]`` prints the figures;
exit 1 on a violation. ``tests/test_campaigns.py`` runs the quick mode.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import random
import re
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from supervisor.coordination import ring
from supervisor.record import TaskRecord
from supervisor.relay import DAEMON_MARK
from supervisor.status import status_row
from supervisor.submit import submit
from tests.daemon import Daemon, spool_processes
from tests.faults.common import (
    LOST,
    NOT_DONE,
    PROBLEMS,
    Plan,
    careful_decisions,
    check_task,
    mixed_plan,
    records,
    stopwatch,
)
from tests.faults.report import Figure, format_figures, violations
from worker.budget import Price, cost, price_table, usd
from worker.events import read_events
from worker.lock import holder_pid, is_locked
from worker.models.base import Usage
from worker.protocol import FINAL_STATES
from worker.spool import Spool, TaskDir
from worker.state import fold
from worker.testing.messages_api import (
    DEFAULT_API_KEY,
    Fault,
    MessagesAPIServer,
    Reply,
    stream_events,
)

FAULT = "api faults"
JSON = dict[str, Any]
MODEL = "claude-chaos-api-faults"
MODEL_DELAY = 0.01  # seconds before each good reply
KILL_SHARE = 0.3  # faults after which the worker is killed
KINDS = {  # fault kind -> what the figures call it
    "rate_limit": "429 rate limit",
    "server_error": "500 server error",
    "overloaded": "529 overloaded",
    "drop": "connection dropped",
    "cut": "stream cut mid-way",
    "no_message_stop": "no message_stop",
    "bad_tool_json": "malformed tool JSON",
    "stream_error": "error event mid-stream",
}
FREEZES = {True: 1, False: 3}  # quick mode -> tasks whose worker is frozen after a reply
SERIAL_START = 100_000  # output_tokens of served responses: unique, far from real counts
_TRIAL = re.compile(r"api-faults trial (\d+)")
CONFIG = """\
max_workers = 8
[heartbeat]
interval = 0.2
timeout = 10.0
[deadlines]
model_call = 60.0
tool_call = 30.0
[restart]
backoff_initial = 0.05
backoff_max = 0.5
crash_loop_limit = 10
stop_grace = 5.0
[model]
max_tokens = 1024
"""
#: What the campaign's model costs ([prices]): the Sonnet 4 family's rates.
PRICES_TABLE = f'''[prices."{MODEL}"]
input = 3
output = 15
'''
PRICES = price_table({MODEL: Price.of(3, 15, 3.75, 6, 0.3)})


@dataclass(frozen=True)
class Planned:
    kind: str
    kill: bool  # SIGKILL the worker right after this fault


@dataclass(frozen=True)
class Served:
    """One response the server served a task: a reply or a fault (with a reply inside)."""

    turn: int
    output_tokens: int  # the response's mark
    input_tokens: int
    kind: str | None  # None: a complete reply
    at: float  # monotonic, when the responder chose it (before it was written)
    pid: int | None  # the task lock's holder then: the worker the response is served to


@dataclass
class Trial:
    index: int
    task: TaskDir
    faults: dict[int, list[Planned]]  # turn index -> the faults served in a row there
    attempts: Counter[int] = field(default_factory=Counter)  # requests per turn index
    served: list[Served] = field(default_factory=list)
    kills: int = 0
    killed: list[int] = field(default_factory=list)  # the workers we killed
    after_kill: list[list[JSON]] = field(default_factory=list)  # the journal after each
    rejected: list[str] = field(default_factory=list)
    decisions: int = 0
    uncounted: int = 0  # complete replies a kill caught before they were recorded
    freeze: int | None = None  # the turn at whose first complete reply the worker is frozen
    frozen: int | None = None  # the worker frozen
    daemon_stops: int = 0  # workers the daemon killed or stopped itself (DAEMON_STOPS)


def plan_faults(rng: random.Random, turns: int) -> dict[int, list[Planned]]:
    """One to three faulted turns; each a burst of 1 (60%) or 2-3 faults in a row, of one
    kind or mixed; a kill after some of them."""
    faults: dict[int, list[Planned]] = {}
    for turn in rng.sample(range(turns), rng.randint(1, min(3, turns))):
        size = 1 if rng.random() < 0.6 else rng.randint(2, 3)
        first = rng.choice(list(KINDS))
        same = rng.random() < 0.5
        faults[turn] = [
            Planned(first if same or k == 0 else rng.choice(list(KINDS)), rng.random() < KILL_SHARE)
            for k in range(size)
        ]
    return faults


class FaultyAPI:
    """The responder of the local server: each task's replies by turn, with its faults."""

    def __init__(self, plan: Plan, rng: random.Random) -> None:
        self.plan = plan
        self.rng = rng
        self.trials: dict[int, Trial] = {}
        self.lock = threading.Lock()
        self.serials = itertools.count(SERIAL_START)
        self.timers: list[threading.Timer] = []
        self.kill_after: dict[int, Trial] = {}  # id of a fault to serve -> whose worker dies
        self.errors: list[str] = []

    def respond(self, request: JSON) -> Reply | Fault | None:
        messages = request.get("messages") or []
        found = _TRIAL.search(json.dumps(messages[:1]))
        trial = self.trials.get(int(found.group(1))) if found else None
        if trial is None:
            self.errors.append(f"a request of no trial: {str(messages)[:200]}")
            return None
        turn = sum(1 for m in messages if m.get("role") == "assistant")
        if turn >= self.plan.turns:
            return None  # past the script: a visible rejection
        content = self.plan.responses[turn]["content"]
        with self.lock:
            attempt = trial.attempts[turn]
            trial.attempts[turn] += 1
            planned = trial.faults.get(turn, [])
            fault = planned[attempt] if attempt < len(planned) else None
            usage = {
                "input_tokens": 1 + len(json.dumps(messages)) // 4,
                "output_tokens": next(self.serials),
            }
            trial.served.append(
                Served(
                    turn,
                    usage["output_tokens"],
                    usage["input_tokens"],
                    None if fault is None else fault.kind,
                    time.monotonic(),
                    holder_pid(trial.task.lock),
                )
            )
        if fault is None:
            if turn == trial.freeze and trial.frozen is None:
                self.freeze(trial)
            return Reply(content, usage=usage, delay=MODEL_DELAY)
        served = self._fault(fault.kind, Reply(content, usage=usage), request)
        if fault.kill:
            with self.lock:
                self.kill_after[id(served)] = trial
        return served

    def served(self, request: JSON, action: Reply | Fault) -> None:
        """Once a fault marked for it is written out: SIGKILL the worker a moment later."""
        with self.lock:
            trial = self.kill_after.pop(id(action), None)
        if trial is not None:
            timer = threading.Timer(self.rng.uniform(0.005, 0.04), self.kill, (trial,))
            self.timers.append(timer)
            timer.start()

    def _fault(self, kind: str, reply: Reply, request: JSON) -> Fault:
        if kind == "rate_limit":
            return Fault.rate_limit(retry_after=self.rng.choice([0.0, 0.1, 0.3]))
        if kind in ("server_error", "overloaded", "drop"):
            factory = {
                "server_error": Fault.server_error,
                "overloaded": Fault.overloaded,
                "drop": Fault.drop,
            }[kind]
            return factory()
        if kind == "bad_tool_json" and not any(b["type"] == "tool_use" for b in reply.content):
            # a reply with no tool_use has no tool JSON to break: give it one
            block = {
                "type": "tool_use",
                "name": "write_file",
                "input": {"path": "x", "content": ""},
            }
            reply = Reply([*reply.content, block], usage=reply.usage)
        if kind == "cut":
            events = len(stream_events(reply.message(request)))
            return Fault.cut(after_events=self.rng.randint(1, events - 1), reply=reply)
        if kind == "no_message_stop":
            return Fault.no_message_stop(reply=reply)
        if kind == "bad_tool_json":
            return Fault.bad_tool_json(reply=reply)
        return Fault(
            "stream_error", error_type="overloaded_error", message="Overloaded", reply=reply
        )

    def freeze(self, trial: Trial) -> None:
        """SIGSTOP the process group of the task's worker, waiting for this reply: a hang
        only the daemon's heartbeat verdict can end (its SIGKILL ends a stopped process)."""
        pid = holder_pid(trial.task.lock)
        if pid is None or not is_locked(trial.task.lock):
            self.errors.append(f"trial {trial.index}: no worker to freeze")
            return
        trial.frozen = pid
        os.killpg(pid, signal.SIGSTOP)

    def kill(self, trial: Trial) -> None:
        """SIGKILL the process group of the task's worker, then read what it left."""
        pid = holder_pid(trial.task.lock)
        if pid is None or not is_locked(trial.task.lock):
            self.errors.append(f"trial {trial.index}: no worker to kill after a fault")
            return
        with self.lock:
            trial.killed.append(pid)
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            self.errors.append(f"trial {trial.index}: worker {pid} gone before the kill")
            return
        deadline = time.monotonic() + 5
        while holder_pid(trial.task.lock) == pid and is_locked(trial.task.lock):
            if time.monotonic() > deadline:
                self.errors.append(f"trial {trial.index}: worker {pid} survived SIGKILL")
                return
            time.sleep(0.005)
        with self.lock:
            trial.kills += 1
            trial.after_kill.append(records(trial.task))


# -- the operator ---------------------------------------------------------------------------


def supervise(trials: Sequence[Trial], spool: Spool, timeout: float) -> list[str]:
    """Wait for every task to end, deciding held calls like a careful operator."""
    open_ = {t.index: t for t in trials}
    deadline = time.monotonic() + timeout
    while open_ and time.monotonic() < deadline:
        for index, trial in list(open_.items()):
            state = TaskRecord.load(trial.task).state
            if state == "held":
                made = careful_decisions(trial.task)
                trial.decisions += made
                if made:
                    ring(spool, trial.task.id)
            elif state in FINAL_STATES:
                del open_[index]
        time.sleep(0.05)
    return [
        f"trial {i}: still {TaskRecord.load(t.task).state} at the deadline"
        for i, t in open_.items()
    ]


# -- checks ---------------------------------------------------------------------------------

#: Violation figures, besides the task checks of ``common.check_task`` (PROBLEMS).
TURN_TWICE = "turns recorded twice"
USAGE_TWICE = "usage counted twice"
USAGE_FAULTED = "usage counted from faulted responses"
USAGE_UNKNOWN = "usage of no served response"
USAGE_LOST = "complete replies not counted, no kill after them"
USAGE_DIFFERS = "usage counters differ from the replies counted"
#: docs/design.md section 13: the cost reckoned from the journal (``cost_usd``), against the
#: cost of the complete replies the server answered that were recorded, exactly
SPEND_TWICE = "spend counted twice"
REJECTED = "transcripts rejected by the server"
NOT_HUNG = "frozen workers the daemon did not kill"
CHECKS = (
    TURN_TWICE,
    USAGE_TWICE,
    USAGE_FAULTED,
    USAGE_UNKNOWN,
    USAGE_LOST,
    USAGE_DIFFERS,
    SPEND_TWICE,
    REJECTED,
    NOT_HUNG,
)


#: The verdicts that end a worker, as the daemon logs them: SIGKILL for a heartbeat too old
#: (the worker's dead-man, ``liveness.hung_by_deadman``), SIGTERM (then SIGKILL after the
#: grace) for a call past its deadline (``supervisor.watch.LivenessWatch``).
DAEMON_STOPS = ("worker_hung", "worker_stalled")


def daemon_stops(task: TaskDir) -> list[int]:
    """The workers of ``task`` the daemon itself killed or stopped (``DAEMON_STOPS``)."""
    mark, value = DAEMON_MARK
    return [
        int(e["pid"])
        for e in read_events(task.events)
        if e.get("event") in DAEMON_STOPS and e.get(mark) == value
    ]


def worker_fate(task: TaskDir, pid: int | None) -> list[str]:
    """What the daemon saw of worker ``pid``: its stop verdicts and how it exited."""
    mark, value = DAEMON_MARK
    fate: list[str] = []
    for e in read_events(task.events):
        if e.get(mark) != value or e.get("pid") != pid:
            continue
        if e.get("event") in DAEMON_STOPS:
            fate.append(str(e["event"]))
        elif e.get("event") == "worker_exited":
            fate.append(str(e.get("signal") or f"exit {e.get('code')}"))
    return fate


def verify(trial: Trial, plan: Plan) -> list[tuple[str, str]]:
    found = records(trial.task)
    problems: list[tuple[str, str]] = []
    turns = Counter(r["turn"] for r in found if r.get("k") == "turn")
    problems += [(TURN_TWICE, f"turn {t} recorded {n} times") for t, n in turns.items() if n > 1]
    marks = Counter(
        int((r.get("usage") or {}).get("output_tokens", -1)) for r in found if r.get("k") == "turn"
    )
    served = {s.output_tokens: s for s in trial.served}
    for mark, n in marks.items():
        if n > 1:
            problems.append((USAGE_TWICE, f"response {mark} counted {n} times"))
        if mark not in served:
            problems.append((USAGE_UNKNOWN, f"usage {mark} was never served"))
        elif served[mark].kind is not None:
            problems.append((USAGE_FAULTED, f"{served[mark].kind} response {mark} counted"))
    # A complete reply that was not recorded is a reply a kill caught before the worker
    # recorded it (its tokens are spent, never counted): never twice, and only when a kill
    # came after it and before the turn was asked again (the worker it was served to died:
    # one that lived on and asked again treated a complete reply as failed). The kill may
    # be the daemon's own (a hang or stall verdict: a frozen worker, a loaded machine).
    stops = daemon_stops(trial.task)
    trial.daemon_stops = len(stops)
    if trial.frozen is not None and trial.frozen not in stops:
        problems.append((NOT_HUNG, f"the worker frozen at turn {trial.freeze} was never killed"))
    killed = {*trial.killed, *stops}
    complete = [s for s in trial.served if s.kind is None]
    for s in complete:
        again = any(r.turn == s.turn and r.at > s.at and r.pid == s.pid for r in trial.served)
        if s.output_tokens not in marks and (s.pid not in killed or again):
            fate = worker_fate(trial.task, s.pid) + (["asked again"] if again else [])
            problems.append(
                (
                    USAGE_LOST,
                    f"reply {s.output_tokens} (turn {s.turn}) not counted; its worker "
                    f"{s.pid}: {', '.join(fate) or 'no exit seen'}",
                )
            )
    counted = [s for s in complete if s.output_tokens in marks]
    trial.uncounted = len(complete) - len(counted)
    want = {
        "input_tokens": sum(s.input_tokens for s in counted),
        "output_tokens": sum(s.output_tokens for s in counted),
    }
    got = status_row(trial.task)["usage"]
    if got != want:
        problems.append((USAGE_DIFFERS, f"status says {got}, the served replies say {want}"))
    # the cost: the served replies' own, against the journal's fold and status' cost_usd
    served_cost = cost({MODEL: Usage(want["input_tokens"], want["output_tokens"])}, PRICES)
    journal_cost = cost(fold("", found).spend_total, PRICES)
    shown = status_row(trial.task, PRICES)["cost_usd"]
    if journal_cost != served_cost or shown != usd(served_cost):
        problems.append(
            (
                SPEND_TWICE,
                f"the journal's cost is {journal_cost} (status {shown}), the served replies' "
                f"{served_cost}",
            )
        )
    problems += [(REJECTED, r) for r in trial.rejected]
    for seen in trial.after_kill:
        if found[: len(seen)] != seen:
            problems.append((LOST, "a journal read after a kill is not a prefix of the final one"))
    problems += check_task(trial.task, plan, trial.after_kill[-1] if trial.after_kill else [])
    return problems


# -- the campaign -----------------------------------------------------------------------------


def run(quick: bool, trials: int | None = None, seed: int | None = None) -> list[Figure]:
    seed = random.randrange(2**32) if seed is None else seed
    count = trials or (16 if quick else 300)
    rng = random.Random(seed)
    plan = mixed_plan(5 if quick else 6)
    with stopwatch() as elapsed, tempfile.TemporaryDirectory(prefix="agentd-apifaults-") as tmp:
        daemon = Daemon(Path(tmp), CONFIG + f'name = "{MODEL}"\n' + PRICES_TABLE)
        spool = daemon.spool
        api = FaultyAPI(plan, random.Random(rng.randrange(2**32)))
        for i in range(1, count + 1):
            task = submit(
                spool,
                daemon.config,
                prompt=f"api-faults trial {i:04d}: write the files, log the lines, send mail.",
                name=f"af-{i:04d}",
                model=MODEL,
                max_turns=plan.turns + 3,
            )
            api.trials[i] = Trial(i, task, plan_faults(rng, plan.turns))
        for trial in rng.sample(list(api.trials.values()), min(count, FREEZES[quick])):
            trial.freeze = rng.choice([t for t in range(plan.turns) if t not in trial.faults])
        server = MessagesAPIServer(responder=api.respond)
        server.on_request = lambda body, rejection: _rejection(api, body, rejection)
        server.on_served = api.served
        env = {
            "ANTHROPIC_BASE_URL": server.base_url,
            "ANTHROPIC_API_KEY": DEFAULT_API_KEY,
            "NO_PROXY": "127.0.0.1,localhost",
            "no_proxy": "127.0.0.1,localhost",
        }
        errors: list[str] = []
        with server:
            try:
                daemon.start(env)
                errors += supervise(list(api.trials.values()), spool, 60 + 6 * count)
                alive = daemon.proc is not None and daemon.proc.poll() is None
                code, _, err = daemon.stop()
                if code != 0:
                    errors.append(f"agentd stop exited {code}: {err.strip()}")
                left = len(spool_processes(spool.root))
            finally:
                daemon.cleanup()
                for timer in api.timers:
                    timer.cancel()
        requests = len(server.requests)
        results = {t.index: verify(t, plan) for t in api.trials.values()}
        restarts = sum(TaskRecord.load(t.task).restarts for t in api.trials.values())
        seconds = elapsed()
    return _figures(seed, plan, api, results, requests, restarts, alive, left, errors, seconds)


def _rejection(api: FaultyAPI, body: JSON, rejection: Any) -> None:
    if rejection is None:
        return
    found = _TRIAL.search(json.dumps((body.get("messages") or [])[:1]))
    trial = api.trials.get(int(found.group(1))) if found else None
    if trial is None:
        api.errors.append(f"a rejected request of no trial: {rejection.message}")
    else:
        trial.rejected.append(rejection.message)


def _figures(
    seed: int,
    plan: Plan,
    api: FaultyAPI,
    results: dict[int, list[tuple[str, str]]],
    requests: int,
    restarts: int,
    alive: bool,
    left: int,
    errors: list[str],
    seconds: float,
) -> list[Figure]:
    trials = list(api.trials.values())
    faults = [s for t in trials for s in t.served if s.kind is not None]
    by_kind = Counter(s.kind for s in faults)
    bursts = sum(
        1
        for t in trials
        for turn, planned in t.faults.items()
        if len(planned) > 1 and t.attempts[turn] >= len(planned)
    )
    kinds = Counter(kind for problems in results.values() for kind, _ in problems)
    completed = sum(1 for p in results.values() if not any(k == NOT_DONE for k, _ in p))
    figures = [
        Figure(FAULT, "seed", seed),
        Figure(FAULT, "trials (tasks of turns)", f"{len(trials)} of {plan.turns}"),
        Figure(FAULT, "model requests served", requests),
        Figure(FAULT, "faults injected", len(faults), violation=not faults),
    ]
    figures += [Figure(FAULT, f"  {label}", by_kind.get(kind, 0)) for kind, label in KINDS.items()]
    figures += [
        Figure(FAULT, "turns faulted 2-3 times in a row", bursts),
        Figure(FAULT, "workers killed right after a fault", sum(t.kills for t in trials)),
        Figure(FAULT, "workers frozen after a reply", sum(t.frozen is not None for t in trials)),
        Figure(
            FAULT, "workers the daemon found hung or stalled", sum(t.daemon_stops for t in trials)
        ),
        Figure(FAULT, "worker restarts by the daemon", restarts),
        Figure(FAULT, "holds decided by the operator", sum(t.decisions for t in trials)),
        Figure(FAULT, "replies a kill caught before recording", sum(t.uncounted for t in trials)),
        Figure(FAULT, "tasks completed", completed, violation=completed != len(trials)),
    ]
    for kind in (*CHECKS, *(p for p in PROBLEMS if p != NOT_DONE)):
        figures.append(Figure(FAULT, kind, kinds.get(kind, 0), violation=bool(kinds.get(kind))))
    problems = [*errors, *api.errors]
    figures.append(Figure(FAULT, "daemon down at the end", int(not alive), violation=not alive))
    figures.append(Figure(FAULT, "processes left after stop", left, violation=bool(left)))
    figures.append(Figure(FAULT, "campaign errors", len(problems), violation=bool(problems)))
    bad = [(i, p) for i, p in sorted(results.items()) if p]
    if bad or problems:
        detail = problems[0] if problems else f"trial {bad[0][0]}: {bad[0][1][:3]}"
        figures.append(Figure(FAULT, "first failure", detail[:400], violation=True))
    figures.append(Figure(FAULT, "runtime s", round(seconds, 1)))
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.chaos.api_faults", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--full", action="store_true", help="300 trials of 6 turns")
    parser.add_argument("--trials", type=int, default=None)
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        figures = run(quick=not args.full, trials=args.trials, seed=args.seed)
        print(format_figures(figures), flush=True)
        return 1 if violations(figures) else 0
    return 130


if __name__ == "__main__":
    sys.exit(main())
