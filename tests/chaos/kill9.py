"""The ``kill -9`` campaign: real workers on the real SDK, killed at random instants.

Each trial submits a task (``supervisor.submit.submit``) on the ``anthropic`` backend, whose
``ANTHROPIC_BASE_URL`` points at a standalone local Messages API server
(``python -m worker.testing.messages_api --by-turn``) that validates every transcript it is sent the
way the real API does. The task runs a 10-turn script of 14 tool calls of every effect
class (``tests.chaos.effect_tools``; 5 unsafe), four turns with two tool_uses, and every
side effect lands in an external effects log outside the spool. Then, until it is done:

* spawn ``python -m worker TASK_DIR --config C`` (its own process group);
* while the trial's kill budget (1..``max_kills``) lasts, arm the spawn, by a coin flip,
  either with a SIGKILL of its group at a random instant of its expected runtime
  (``Campaign.kill_instant``), or with a target call, drawn from those not finished yet,
  whose tool SIGKILLs its own worker right after its side effect is durable and before the
  worker records the result (or, in ``before_share`` of the cases, right before the
  effect, once the intent is durable);
* on exit 4 (held), decide each held call like a careful operator who checks the outside
  world: its effect is in the log, so supply the logged outcome (``action="result"``), or
  it is not, so re-run it (``action="rerun"``);
* after every kill, read the journal as the dead worker left it.

Then verify the trial: (a) every journal read after a kill is a prefix of the final journal
(no recorded turn or tool result lost or changed); (b) no unsafe operation took effect twice;
(c) no keyed operation took effect twice (its key stayed the same across attempts); (d) the
server rejected no transcript; (e) the task ended ``done`` with ``end_turn`` after all 10
turns, its transcript pairs every tool_use with exactly one tool_result, every unsafe and
keyed operation took effect exactly once, no tool ran without a durable intent, and the
idempotent state is right; (f) spend is never counted twice: each reply the server
answers is logged with its id and usage (``--record-file``), each turn record carries the
id of the reply it recorded, and the cost of the replies answered whose ids the journal
holds must be the journal's cost exactly (every rate of the price table paid: cache reads
and writes, a share of them to the 1-hour cache), with no id recorded twice. Re-runs of
read-only and idempotent calls are allowed and counted.

``python -m tests.chaos.kill9 --trials N`` prints the figures and exits 1 on any violation;
``tests/test_chaos_kill9.py`` runs it in CI, ``bench/chaos_kill9.py`` in ``make bench``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

from supervisor.decisions import decide
from supervisor.record import TaskRecord
from supervisor.status import held_calls
from supervisor.submit import submit
from tests.chaos.effect_tools import (
    CHAOS_TOOLS,
    EFFECTS_ENV,
    JITTER_ENV,
    SELF_KILL_BEFORE_ENV,
    SELF_KILL_ENV,
    SELF_KILL_ONCE_ENV,
    SELF_KILL_TAGS_ENV,
    read_log,
)
from tests.faults.report import Figure
from tests.support import REPO, assert_paired
from worker.budget import Price, cost, price_table
from worker.config import load_config
from worker.errors import AgentdError
from worker.models.base import Usage
from worker.protocol import ExitCode, TaskStatus
from worker.spool import Spool, TaskDir
from worker.state import TaskState
from worker.store.files import FileStore
from worker.store.journal import read_file
from worker.testing.messages_api import DEFAULT_API_KEY

JSON = dict[str, Any]
MODEL = "claude-chaos-kill9"
MODEL_DELAY = 0.02  # seconds the server waits before each reply
#: What each reply reports beyond its size: cache reads and writes, a third of the writes
#: to the 1-hour cache, so every rate of the price table is paid (docs/design.md section 13)
CACHE_USAGE = {
    "cache_read_input_tokens": 1200,
    "cache_creation_input_tokens": 300,
    "cache_creation": {"ephemeral_1h_input_tokens": 100, "ephemeral_5m_input_tokens": 200},
}
#: The campaign model's price ([prices]), every rate its own.
PRICES = price_table({MODEL: Price.of(3, 15, 3.75, 6, 0.3)})
CONFIG = (
    '[tools]\nmodules = ["tests.chaos.effect_tools"]\n'
    f'[prices."{MODEL}"]\ninput = 3\noutput = 15\ncache_write = 3.75\ncache_write_1h = 6\n'
    "cache_read = 0.3\n"
)
MAX_SPAWNS = 40  # per trial: a runaway loop fails the trial instead of running forever


def _use(tool: str, tag: str, **inputs: Any) -> JSON:
    return {"type": "tool_use", "name": tool, "input": {"tag": tag, **inputs}}


def _text(text: str) -> JSON:
    return {"type": "text", "text": text}


#: The model's script, one reply per turn (the server answers by turn index). Tags name
#: the logical operations, so a repeat is seen even under a new tool_use id.
TURNS: list[list[JSON]] = [
    [_text("First, the current plan."), _use("chaos_lookup", "r1", name="plan")],
    [
        _text("Recording the plan and charging the first amount."),
        _use("chaos_set", "i1", name="plan", value="v1"),
        _use("chaos_charge", "u1", amount=30),
    ],
    [_use("chaos_send", "k1", to="ops", body="charged 30")],
    [
        _text("Queueing the invoice and checking the plan."),
        _use("chaos_enqueue", "k2", item="invoice-1"),
        _use("chaos_lookup", "r2", name="plan"),
    ],
    [_use("chaos_charge", "u2", amount=12)],
    [
        _use("chaos_set", "i2", name="status", value="charged"),
        _use("chaos_send", "k3", to="customer", body="your receipt"),
    ],
    [_use("chaos_charge", "u3", amount=7), _use("chaos_enqueue", "k4", item="report")],
    [
        _text("Charging the fee and checking the status."),
        _use("chaos_charge", "u4", amount=2),
        _use("chaos_lookup", "r3", name="status"),
    ],
    [_use("chaos_charge", "u5", amount=-2)],
    [_text("All done: five charges, three messages and two jobs.")],
]
EFFECT_OF = {
    "chaos_lookup": "read_only",
    "chaos_set": "idempotent",
    "chaos_send": "keyed",
    "chaos_enqueue": "keyed",
    "chaos_charge": "unsafe",
}
TAGS = {b["input"]["tag"]: b["name"] for turn in TURNS for b in turn if b["type"] == "tool_use"}
FINAL_KV = {"plan": "v1", "status": "charged"}


@dataclass
class Options:
    trials: int = 100
    parallel: int = 2
    max_kills: int = 2  # per trial, drawn from 1..max_kills
    before_share: float = 0.25  # self-kills placed right before the effect, not right after
    jitter: float = 0.02  # seconds of sleep before and after each tool's effect
    seed: int | None = None
    trial_timeout: float = 120.0
    root: Path | None = None  # where to work; a temporary folder when None
    keep: bool = False  # keep the work folder (it is kept anyway when a check fails)
    progress: bool = False
    #: Drive the task with ``agentd run --resume`` instead of bare workers (class 24): the
    #: random-instant kills are a kill -9 of ``agentd run`` (its worker dies with it), and a
    #: self-killed worker is restarted by ``agentd run`` itself.
    via_run: bool = False


@dataclass
class TrialResult:
    index: int
    completed: bool = False
    kills_external: int = 0
    kills_after_effect: int = 0
    kills_before_effect: int = 0
    kill_points: Counter[str] = field(default_factory=Counter)
    spawns: int = 0
    holds: int = 0
    decided_result: int = 0
    decided_rerun: int = 0
    turns_lost: int = 0
    results_lost: int = 0
    journal_rewritten: int = 0
    unsafe_repeated: int = 0
    unsafe_rerun_undecided: int = 0
    keyed_repeated: int = 0
    effects_missing: int = 0
    ran_without_intent: int = 0
    keys_changed: int = 0
    unpaired: int = 0
    reruns_allowed: int = 0
    duplicates_suppressed: int = 0
    reconciled: int = 0
    rejected: int = 0
    model_requests: int = 0
    #: replies counted more than once, or counted and never answered, or a cost from the
    #: journal that is not the cost of the replies the server answered that were recorded
    spend_twice: int = 0
    recorded_ids: list[str] = field(default_factory=list)  # the journal's replies, by id
    journal_cost: Decimal = Decimal(0)  # what the journal says they cost
    seconds: float = 0.0
    failures: list[str] = field(default_factory=list)

    def fail(self, message: str) -> None:
        self.failures.append(f"trial {self.index}: {message}")

    @property
    def kills(self) -> int:
        return self.kills_external + self.kills_after_effect + self.kills_before_effect


@dataclass
class Report:
    options: Options
    trials: list[TrialResult]
    wall: float
    calibration: dict[str, float]
    root: Path
    server_errors: list[str] = field(default_factory=list)

    def total(self, name: str) -> int:
        return sum(int(getattr(t, name)) for t in self.trials)

    @property
    def completed(self) -> int:
        return sum(t.completed for t in self.trials)

    @property
    def completion(self) -> float:
        return 100.0 * self.completed / len(self.trials) if self.trials else 0.0

    @property
    def killed(self) -> int:
        """Trials whose worker was killed at least once."""
        return sum(t.kills > 0 for t in self.trials)

    @property
    def kill_points(self) -> Counter[str]:
        points: Counter[str] = Counter()
        for t in self.trials:
            points.update(t.kill_points)
        return points

    @property
    def failures(self) -> list[str]:
        return [*self.server_errors, *(f for t in self.trials for f in t.failures)]

    VIOLATIONS = (
        "turns_lost",
        "results_lost",
        "journal_rewritten",
        "unsafe_repeated",
        "unsafe_rerun_undecided",
        "keyed_repeated",
        "rejected",
        "spend_twice",
        "effects_missing",
        "ran_without_intent",
        "keys_changed",
        "unpaired",
    )

    @property
    def ok(self) -> bool:
        return (
            bool(self.trials)
            and not self.failures
            and self.completed == len(self.trials)
            and all(self.total(name) == 0 for name in self.VIOLATIONS)
        )

    def figures(self) -> dict[str, Any]:
        """The headline figures, for the bench report and ``--json``."""
        return {
            "trials": len(self.trials),
            "trials_killed": self.killed,
            "kills_random_instant": self.total("kills_external"),
            "kills_after_effect": self.total("kills_after_effect"),
            "kills_before_effect": self.total("kills_before_effect"),
            "recorded_turns_lost": self.total("turns_lost"),
            "recorded_results_lost": self.total("results_lost"),
            "unsafe_effects_repeated": self.total("unsafe_repeated"),
            "keyed_effects_repeated": self.total("keyed_repeated"),
            "transcripts_rejected": self.total("rejected"),
            "tasks_completed_pct": round(self.completion, 1),
            "holds_decided": self.total("holds"),
            "wall_seconds": round(self.wall, 1),
        }

    def as_figures(self) -> list[Figure]:
        """The figures for the chaos table (``python -m tests.chaos``)."""
        n = len(self.trials)
        fault = (
            "kill -9 of agentd run and its workers"
            if self.options.via_run
            else "kill -9 of workers"
        )
        figures = [
            Figure(fault, "trials", n),
            Figure(fault, "kills", self.total("kills")),
            Figure(fault, "kills right after a side effect", self.total("kills_after_effect")),
            Figure(fault, "worker starts", self.total("spawns")),
            Figure(fault, "holds decided", self.total("holds")),
            Figure(fault, "model requests validated", self.total("model_requests")),
        ]
        names = {"spend_twice": "spend counted twice"}
        figures += [
            Figure(
                fault,
                names.get(name, name.replace("_", " ")),
                self.total(name),
                self.total(name) > 0,
            )
            for name in self.VIOLATIONS
        ]
        figures += [
            Figure(fault, "tasks completed", self.completed, self.completed != n),
            Figure(fault, "failures", len(self.failures), bool(self.failures)),
            Figure(fault, "runtime s", round(self.wall, 1)),
        ]
        return figures

    def table(self) -> str:
        o, n = self.options, len(self.trials)
        boot, turn = self.calibration.get("boot", 0.0), self.calibration.get("turn", 0.0)
        points = self.kill_points
        kills = self.total("kills")
        where = ", ".join(f"{k} {v}" for k, v in sorted(points.items(), key=lambda kv: -kv[1]))
        rows = [
            (
                "trials",
                f"{n} ({self.killed} killed at least once; {o.parallel} at a time, "
                f"a budget of 1-{o.max_kills} kills each)",
            ),
            (
                "kill -9 of the worker",
                f"{kills} (random-instant {self.total('kills_external')}"
                f"{' of agentd run, whose worker dies with it' if o.via_run else ''}; "
                f"self-kills right "
                f"after a side effect {self.total('kills_after_effect')}, right before one "
                f"{self.total('kills_before_effect')})",
            ),
            ("  where the kills landed", where or "-"),
            ("worker starts", str(self.total("spawns"))),
            ("recorded turns lost", str(self.total("turns_lost"))),
            ("recorded tool results lost", str(self.total("results_lost"))),
            ("journal prefixes changed", str(self.total("journal_rewritten"))),
            ("unsafe effects repeated", str(self.total("unsafe_repeated"))),
            ("unsafe re-runs without a decision", str(self.total("unsafe_rerun_undecided"))),
            ("keyed effects repeated", str(self.total("keyed_repeated"))),
            ("transcripts rejected by the API server", str(self.total("rejected"))),
            ("spend counted twice", str(self.total("spend_twice"))),
            (
                "tasks completed (after decisions)",
                f"{self.completed}/{n} ({self.completion:.1f}%)",
            ),
            (
                "holds decided",
                f"{self.total('holds')} (outcome in the log: result {self.total('decided_result')}"
                f"; not in the log: rerun {self.total('decided_rerun')})",
            ),
            ("unsafe/keyed effects missing", str(self.total("effects_missing"))),
            ("tool runs without a durable intent", str(self.total("ran_without_intent"))),
            ("idempotency keys changed on resume", str(self.total("keys_changed"))),
            ("transcripts not paired", str(self.total("unpaired"))),
            (
                "read-only/idempotent re-runs (allowed)",
                f"{self.total('reruns_allowed')}; keyed duplicates suppressed "
                f"{self.total('duplicates_suppressed')}, reconciled {self.total('reconciled')}",
            ),
            ("model requests validated", str(self.total("model_requests"))),
            (
                "wall time",
                f"{self.wall:.1f} s ({self.wall / max(n, 1):.2f} s a trial; worker boot "
                f"{boot:.2f} s, turn {turn:.3f} s)",
            ),
        ]
        width = max(len(name) for name, _ in rows)
        through = " through agentd run --resume" if o.via_run else ""
        lines = [f"kill -9 chaos campaign{through} (seed {o.seed})"]
        lines += [f"  {name:<{width}}  {value}" for name, value in rows]
        failures = self.failures
        lines.append(f"  {'result':<{width}}  {'PASS' if self.ok else 'FAIL'}")
        if failures:
            lines.append(f"  {len(failures)} failure(s), work folder kept at {self.root}:")
            lines += [f"    {f}" for f in failures[:30]]
        return "\n".join(lines)


# -- processes --------------------------------------------------------------------------


class Processes:
    """Every process the campaign starts, so that ``kill_all`` can end each group."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: set[subprocess.Popen[bytes]] = set()

    def start(self, argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
        with open(log, "ab") as out, self._lock:
            proc = subprocess.Popen(
                argv,
                cwd=REPO,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            self._live.add(proc)
        return proc

    def reap(self, proc: subprocess.Popen[bytes]) -> None:
        """Kill what is left of the process group and collect the process."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
        with self._lock:
            self._live.discard(proc)

    def kill_all(self) -> None:
        with self._lock:
            live = list(self._live)
        for proc in live:
            self.reap(proc)


def _worker_env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AGENTD_", "ANTHROPIC_"))}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost"
    env.update(extra)
    return env


@contextlib.contextmanager
def api_server(
    root: Path, procs: Processes, responses: list[JSON]
) -> Iterator[tuple[str, Path, subprocess.Popen[bytes]]]:
    """The standalone local Messages API (by turn index): its base URL and record file."""
    script, port_file, record = root / "api-script.json", root / "api.port", root / "api.jsonl"
    script.write_text(json.dumps({"responses": responses, "api_key": DEFAULT_API_KEY}))
    argv = [sys.executable, "-m", "worker.testing.messages_api", "--by-turn", "--exit-with-parent"]
    argv += ["--port-file", str(port_file), "--script-file", str(script)]
    argv += ["--record-file", str(record)]
    proc = procs.start(argv, _worker_env({}), root / "api.log")
    try:
        deadline = time.monotonic() + 20
        while not port_file.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                log = (root / "api.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"the local Messages API did not start:\n{log}")
            time.sleep(0.02)
        yield f"http://127.0.0.1:{port_file.read_text().strip()}", record, proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
        procs.reap(proc)


# -- one trial ----------------------------------------------------------------------------


def journal_records(task: TaskDir) -> list[JSON]:
    """The whole records of a journal, read-only (a torn tail is not a record)."""
    if not task.journal.exists():
        return []
    return [record for record, _ in read_file(task.journal).records]


def _self_kills(effects: Path) -> list[JSON]:
    return [line for line in read_log(effects) if line.get("kind") == "self_kill"]


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]


def _recorded(records: list[JSON], kind: str) -> set[str]:
    """Digests of the whole turn (or result) records, timestamps included: a record that
    was lost and recorded again (a turn asked for again, a tool run again) is still lost."""
    return {_digest(r) for r in records if r.get("k") == kind}


def _turns(records: list[JSON]) -> int:
    return sum(1 for r in records if r.get("k") == "turn")


def _finished_tags(records: list[JSON]) -> set[str]:
    """The tags of the calls that have a result record."""
    tags = {
        block["id"]: block["input"].get("tag")
        for r in records
        if r.get("k") == "turn"
        for block in r["message"]["content"]
        if block.get("type") == "tool_use"
    }
    return {tags[r["call_id"]] for r in records if r.get("k") == "result" and r["call_id"] in tags}


def decide_held(task: TaskDir, effects: Path) -> tuple[int, int] | None:
    """Decide every held call of ``task`` like a careful operator who checks the outside
    world (the effects log): a call whose effect is logged gets the logged outcome as its
    result, any other is re-run. (results supplied, re-runs), or None when none is held."""
    rows = held_calls(task)
    if not rows:
        return None
    lines = read_log(effects)
    supplied = 0
    for row in rows:
        done = [
            line
            for line in lines
            if line.get("call_id") == row["call_id"] and line.get("kind") == "effect"
        ]
        if done:
            supplied += 1
            outcome = f"{done[-1]['result']} (verified in the ledger by the operator)"
            reason = "the ledger shows the charge"
            decide(task, row["call_id"], action="result", result=outcome, reason=reason)
        else:
            decide(task, row["call_id"], action="rerun", reason="the ledger has no charge")
    return supplied, len(rows) - supplied


class Campaign:
    def __init__(self, options: Options, root: Path, base_url: str, procs: Processes) -> None:
        self.options = options
        self.root = root
        self.base_url = base_url
        self.procs = procs
        self.config_path = root / "agentd.toml"
        self.config_path.write_text(CONFIG)
        self.config = load_config(self.config_path)
        self.spool = Spool(root / "spool").ensure()
        self.stop = threading.Event()  # set when the campaign is interrupted
        self.boot = 2.0  # seconds from spawn to the first turn; calibrated
        self.turn = 0.1  # seconds a turn takes after that; calibrated

    def kill_instant(self, rng: random.Random, turns_done: int) -> tuple[str, float]:
        """A random instant of a worker start's expected runtime: ``("boot", seconds after
        the spawn)`` or ``("active", seconds after the worker recorded its first turn)``.

        The runtime is the boot (interpreter, journal replay, re-runs of dangling calls,
        the SDK import and the first model call: a second or two here, longer while the
        CPU is shared, and a negligible share of a real run), then one turn time per
        remaining turn. A quarter of the instants are drawn uniformly from the boot, the
        rest uniformly from the active part, measured from the first turn this worker
        records, so that most kills land where a real worker spends its life: in model
        calls, tool calls and between records."""
        if rng.random() < 0.25:
            return "boot", rng.uniform(0, self.boot)
        return "active", rng.uniform(0, max(1, len(TURNS) - turns_done) * self.turn)

    # -- calibration: one undisturbed run, timing its turns --------------------------------

    def calibrate(self) -> TrialResult:
        trial = Trial(self, 0, random.Random(0), kills=0)
        times = trial.run(watch=True)
        result = trial.verify()
        if len(times) == len(TURNS):
            self.boot = times[0]
            self.turn = max(0.01, (times[-1] - times[0]) / (len(TURNS) - 1))
        return result


class Trial:
    def __init__(self, camp: Campaign, index: int, rng: random.Random, kills: int) -> None:
        self.camp = camp
        self.index = index
        self.rng = rng
        self.kills_left = kills
        self.dir = camp.root / f"trial-{index:04d}"
        self.dir.mkdir()
        self.effects = self.dir / "effects.jsonl"
        self.log = self.dir / "worker.log"
        self.result = TrialResult(index)
        self.after_kill: list[list[JSON]] = []  # the journal as each killed worker left it
        self.final_code: int | None = None
        self.task = submit(
            camp.spool,
            camp.config,
            prompt=f"chaos trial {index:04d}: run the billing errand with the chaos tools.",
            name=f"kill9-{index:04d}",
            model=MODEL,
            tools=list(CHAOS_TOOLS),
            max_turns=len(TURNS) + 5,
        )

    # -- running --------------------------------------------------------------------------

    def run(self, *, watch: bool = False) -> list[float]:
        """Drive the task to its end; with ``watch``, the times its turn records appeared."""
        started = time.monotonic()
        deadline = started + self.camp.options.trial_timeout
        times: list[float] = []
        try:
            while True:
                if self.result.spawns >= MAX_SPAWNS:
                    self.result.fail(f"still not done after {MAX_SPAWNS} worker starts")
                    return times
                code = self._spawn(deadline, times if watch else None)
                if code is None:
                    return times
                if code == ExitCode.DONE:
                    self.final_code = code
                    return times
                if code == ExitCode.HELD:
                    if not self._decide():
                        return times
                elif code != -signal.SIGKILL:
                    tail = self.log.read_text(errors="replace")[-1500:]
                    self.result.fail(f"worker exited with code {code}:\n{tail}")
                    self.final_code = code
                    return times
        except (AgentdError, OSError, ValueError, KeyError) as exc:
            self.result.fail(f"campaign error: {type(exc).__name__}: {exc}")
            return times
        finally:
            self.result.seconds = time.monotonic() - started

    def _spawn(self, deadline: float, times: list[float] | None) -> int | None:
        """One worker start; its exit code, None when the trial ran out of time."""
        opts, rng = self.camp.options, self.rng
        before = journal_records(self.task)
        turns_done = _turns(before)
        remaining = sorted(set(TAGS) - _finished_tags(before))
        mode = "none"
        if self.kills_left > 0:
            mode = "self" if remaining and rng.random() < 0.5 else "external"
        stratum, kill_after = self.camp.kill_instant(rng, turns_done)
        target = rng.choice(remaining) if mode == "self" else ""
        env = _worker_env(
            {
                "ANTHROPIC_BASE_URL": self.camp.base_url,
                "ANTHROPIC_API_KEY": DEFAULT_API_KEY,
                EFFECTS_ENV: str(self.effects),
                # self mode: the target call kills its worker, before or after its effect
                SELF_KILL_TAGS_ENV: target,
                SELF_KILL_BEFORE_ENV: str(opts.before_share if target else 0.0),
                SELF_KILL_ENV: "1.0" if target else "0.0",
                JITTER_ENV: str(opts.jitter),
            }
        )
        argv = [sys.executable, "-m", "worker", str(self.task.path)]
        argv += ["--config", str(self.camp.config_path)]
        if opts.via_run:
            argv = [sys.executable, "-m", "supervisor", "--spool", str(self.camp.spool.root)]
            argv += ["--config", str(self.camp.config_path), "run", "--resume", self.task.id]
            env[SELF_KILL_ONCE_ENV] = f"{self.index}.{self.result.spawns}"
            self_kills = len(_self_kills(self.effects))
        self.result.spawns += 1
        size = self._journal_size()
        spawned = time.monotonic()
        kill_at = spawned + kill_after if stratum == "boot" else None
        proc = self.camp.procs.start(argv, env, self.log)
        sent = False
        try:
            while proc.poll() is None:
                now = time.monotonic()
                if now > deadline:
                    self.result.fail(f"ran past the {opts.trial_timeout:g} s trial deadline")
                    return None
                if self.camp.stop.is_set():
                    self.result.fail("the campaign was interrupted")
                    return None
                if kill_at is None and (grown := self._journal_size()) > size:
                    size = grown  # this worker records: is it past its first model call?
                    if _turns(journal_records(self.task)) > turns_done:
                        kill_at = now + kill_after
                if mode == "external" and kill_at is not None and now >= kill_at:
                    os.killpg(proc.pid, signal.SIGKILL)
                    sent = True
                    proc.wait(timeout=10)
                    break
                if times is not None:
                    times += [now - spawned] * (_turns(journal_records(self.task)) - len(times))
                time.sleep(0.002)
        finally:
            self.camp.procs.reap(proc)
        code = proc.returncode
        if opts.via_run:
            return self._run_exit(code, sent, turns_done, self_kills)
        if code == -signal.SIGKILL:
            self.kills_left -= 1
            records = journal_records(self.task)
            self.after_kill.append(records)
            selfkill = [
                line
                for line in read_log(self.effects)
                if line.get("kind") == "self_kill" and line.get("pid") == proc.pid
            ]
            if selfkill and selfkill[-1].get("when") == "before":
                self.result.kills_before_effect += 1
            elif selfkill:
                self.result.kills_after_effect += 1
            elif sent:
                self.result.kills_external += 1
            else:
                self.result.fail(f"worker {proc.pid} died of SIGKILL that nobody sent")
            point = self._kill_point(records, proc.pid, turns_done)
            self.result.kill_points[point] += 1
        return code

    def _run_exit(self, code: int, sent: bool, turns_done: int, self_kills: int) -> int | None:
        """What an ``agentd run --resume`` that ended with ``code`` means, as a worker's
        exit code: the self-kills of its workers (which it restarted) are counted, and after
        a kill -9 of it, its worker must die with it before anything else starts."""
        for line in _self_kills(self.effects)[self_kills:]:
            self.kills_left -= 1
            if line.get("when") == "before":
                self.result.kills_before_effect += 1
                self.result.kill_points["in tool, before effect"] += 1
            else:
                self.result.kills_after_effect += 1
                self.result.kill_points["after effect, before result"] += 1
        if code == -signal.SIGKILL:
            self.kills_left -= 1
            if not sent:
                self.result.fail("agentd run died of SIGKILL that nobody sent")
            worker = TaskRecord.load(self.task).pid
            store = FileStore(self.camp.spool.root)
            deadline = time.monotonic() + 10
            while store.owned(self.task.id):
                if time.monotonic() > deadline:
                    self.result.fail(f"worker {worker} outlived its agentd run's kill -9")
                    return None
                time.sleep(0.01)
            records = journal_records(self.task)
            self.after_kill.append(records)
            self.result.kills_external += 1
            point = self._kill_point(records, worker or -1, turns_done)
            self.result.kill_points[point] += 1
            return code
        if code == 3 and TaskRecord.load(self.task).state == TaskStatus.HELD:
            return ExitCode.HELD
        return ExitCode.DONE if code == 0 else 1000 + code  # (never a worker's code)

    def _journal_size(self) -> int:
        try:
            return self.task.journal.stat().st_size
        except FileNotFoundError:
            return 0

    def _kill_point(self, records: list[JSON], pid: int, turns_before: int) -> str:
        """Where the worker was when it died, from what it left behind."""
        try:
            beat = json.loads(self.task.heartbeat.read_text())
        except (OSError, ValueError):
            beat = {}
        if beat.get("pid") != pid:
            return "startup"
        state = TaskState(self.task.load_spec().prompt)
        for record in records:
            state.apply(record)
        dangling = state.dangling()
        if dangling:
            call_id = dangling[0].call_id
            done = any(
                line.get("call_id") == call_id
                and line.get("pid") == pid
                and line.get("kind") in ("exec", "effect", "dup")
                for line in read_log(self.effects)
            )
            return "after effect, before result" if done else "in tool, before effect"
        if state.pending_calls():
            return "between turn and tool"
        if beat.get("phase") == "model":
            first = state.turn == turns_before  # the first call of a start loads the SDK
            return "model call (first of a start)" if first else "model call"
        return "between records"

    def _decide(self) -> bool:
        """Decide every held call the way a careful operator would; False if there is none."""
        decided = decide_held(self.task, self.effects)
        if decided is None:
            self.result.fail("the worker exited held, but no call waits for a decision")
            return False
        self.result.holds += sum(decided)
        self.result.decided_result += decided[0]
        self.result.decided_rerun += decided[1]
        return True

    # -- checking -------------------------------------------------------------------------

    def verify(self) -> TrialResult:
        res = self.result
        final = journal_records(self.task)
        state = TaskState(self.task.load_spec().prompt)
        for record in final:
            state.apply(record)

        # the spend, for the check against the server's own log (``_count_requests``)
        res.recorded_ids = [str(r.get("id")) for r in final if r.get("k") == "turn"]
        res.journal_cost = cost(state.spend_total, PRICES) or Decimal(0)

        # (a) nothing a killed worker left recorded is lost or changed
        for seen in self.after_kill:
            res.turns_lost += len(_recorded(seen, "turn") - _recorded(final, "turn"))
            res.results_lost += len(_recorded(seen, "result") - _recorded(final, "result"))
            if final[: len(seen)] != seen:
                res.journal_rewritten += 1
                res.fail("a journal read after a kill is not a prefix of the final journal")

        # (e) the task ended well
        ended = state.ended or {}
        if self.final_code == ExitCode.DONE and ended == {"state": "done", "reason": "end_turn"}:
            res.completed = state.turn == len(TURNS)
            if not res.completed:
                res.fail(f"done after {state.turn} turns, the script has {len(TURNS)}")
        elif not res.failures:
            res.fail(f"ended {ended} with exit code {self.final_code}")
        try:
            assert_paired(state.messages)
        except AssertionError as exc:
            res.unpaired += 1
            res.fail(f"final transcript not paired: {exc}")
        uses = [
            b
            for m in state.messages
            if m["role"] == "assistant"
            for b in m["content"]
            if b.get("type") == "tool_use"
        ]
        if res.completed and sorted(b["input"]["tag"] for b in uses) != sorted(TAGS):
            res.unpaired += 1
            res.fail(f"final transcript calls {[b['input']['tag'] for b in uses]}")
        errors = [
            b
            for m in state.messages
            for b in m["content"]
            if b.get("type") == "tool_result" and b.get("is_error")
        ]
        if errors:
            res.fail(f"tool errors in the final transcript: {errors}")

        # (b), (c): effects per logical operation, from the outside record
        lines = read_log(self.effects)
        effects: Counter[str] = Counter()
        runs: Counter[str] = Counter()
        for line in lines:
            if line.get("kind") == "effect":
                effects[line["tag"]] += 1
            if line.get("kind") in ("exec", "effect", "dup"):
                runs[line["tag"]] += 1
            res.duplicates_suppressed += line.get("kind") == "dup"
            res.reconciled += line.get("kind") == "reconciled"
        for tag, tool in TAGS.items():
            kind = EFFECT_OF[tool]
            if kind in ("unsafe", "keyed"):
                if effects[tag] > 1:
                    setattr(res, f"{kind}_repeated", getattr(res, f"{kind}_repeated") + 1)
                    res.fail(f"{kind} operation {tag} took effect {effects[tag]} times")
                elif effects[tag] == 0 and res.completed:
                    res.effects_missing += 1
                    res.fail(f"{kind} operation {tag} never took effect")
            else:
                res.reruns_allowed += max(0, runs[tag] - 1)

        # invariant 2 in the journal itself: an unsafe call's attempt n > 1 follows an
        # operator's "rerun" decision on attempt n - 1
        reruns_allowed: set[tuple[str, int]] = set()
        for record in final:
            if record.get("k") == "decision" and record.get("action") == "rerun":
                reruns_allowed.add((record["call_id"], int(record["attempt"]) + 1))
            unsafe = record.get("k") == "intent" and record.get("effect") == "unsafe"
            attempt = int(record.get("attempt", 1)) if unsafe else 1
            if attempt > 1 and (record["call_id"], attempt) not in reruns_allowed:
                res.unsafe_rerun_undecided += 1
                res.fail(f"unsafe call {record['call_id']} attempt {attempt} without a decision")

        # no tool ran without a durable intent; keys stay the same across attempts
        intents: Counter[str] = Counter()
        keys: dict[str, set[str | None]] = {}  # None: a call recorded with no key
        for record in final:
            if record.get("k") == "intent":
                intents[record["call_id"]] += 1
                keys.setdefault(record["call_id"], set()).add(record.get("key"))
        ran: Counter[str] = Counter(
            line["call_id"] for line in lines if line.get("kind") in ("exec", "effect", "dup")
        )
        for call_id, count in ran.items():
            if count > intents[call_id]:
                res.ran_without_intent += count - intents[call_id]
                res.fail(f"call {call_id} ran {count} times, {intents[call_id]} intents")
        used: dict[str, set[str | None]] = {}
        for line in lines:
            if line.get("effect") == "keyed" and line.get("kind") in ("effect", "dup"):
                used.setdefault(line["call_id"], set()).add(line.get("key"))
        for call_id, seen_keys in used.items():
            if len(keys.get(call_id, set()) | seen_keys) != 1:
                res.keys_changed += 1
                every = sorted(keys.get(call_id, set()) | seen_keys, key=str)
                res.fail(f"keyed call {call_id} used keys {every}")

        world = self.effects.with_name(self.effects.name + ".world")
        for name, value in FINAL_KV.items():
            path = world / f"kv-{name}"
            got = path.read_text() if path.exists() else None
            if res.completed and got != value:
                res.fail(f"idempotent state {name} = {got!r}, expected {value!r}")
        return res


# -- the campaign -------------------------------------------------------------------------


def _count_requests(record: Path, results: dict[int, TrialResult]) -> list[str]:
    """Attribute every request the server saw (and every rejection) to its trial, and check
    each trial's spend against the replies the server answered (its ``served`` lines):
    the cost of those whose id the journal recorded must be the journal's cost, exactly,
    and no recorded id may be twice in the journal or unknown to the server."""
    problems = []
    pattern = re.compile(r"chaos trial (\d+)")
    served: dict[int, dict[str, JSON]] = {index: {} for index in results}
    text = record.read_text() if record.exists() else ""
    for raw in text.splitlines():
        try:
            line = json.loads(raw)
        except ValueError:
            problems.append("a request record that is not JSON")
            continue
        request = line.get("request") or {}
        found = pattern.search(json.dumps(request.get("messages", [])[:1]))
        trial = results.get(int(found.group(1))) if found else None
        if trial is None:
            problems.append(f"a request of no trial: {str(request)[:200]}")
            continue
        if "served" in line:
            served[trial.index][line["served"]["id"]] = line["served"]
            continue
        trial.model_requests += 1
        if line.get("rejected"):
            trial.rejected += 1
            trial.fail(f"the API server rejected a transcript: {line['rejected']}")
    for index, trial in results.items():
        answered = served[index]
        twice = sum(n - 1 for n in Counter(trial.recorded_ids).values())
        unknown = [i for i in set(trial.recorded_ids) if i not in answered]
        billed = sum(
            (_cost_of(answered[i]) for i in set(trial.recorded_ids) if i in answered), Decimal(0)
        )
        trial.spend_twice += twice + len(unknown) + int(billed != trial.journal_cost)
        if trial.spend_twice:
            trial.fail(
                f"spend: the journal's cost is {trial.journal_cost}, the server's for the "
                f"replies recorded {billed} ({twice} recorded twice, unknown ids {unknown})"
            )
    return problems


def _cost_of(message: JSON) -> Decimal:
    """What a reply the server answered costs, from its own usage (the 1-hour share of the
    cache writes apart, as the API bills it)."""
    usage = message["usage"]
    split = usage.get("cache_creation") or {}
    tokens = Usage(
        int(usage.get("input_tokens") or 0),
        int(usage.get("output_tokens") or 0),
        int(usage.get("cache_creation_input_tokens") or 0),
        int(usage.get("cache_read_input_tokens") or 0),
        int(split.get("ephemeral_1h_input_tokens") or 0),
    )
    return cost({str(message["model"]): tokens}, PRICES) or Decimal(0)


def run_campaign(options: Options) -> Report:
    seed = options.seed if options.seed is not None else random.SystemRandom().randrange(2**32)
    options.seed = seed
    root = options.root or Path(tempfile.mkdtemp(prefix="agentd-kill9-"))
    root.mkdir(parents=True, exist_ok=True)
    responses = [{"content": turn, "delay": MODEL_DELAY, "usage": CACHE_USAGE} for turn in TURNS]
    started = time.monotonic()
    procs = Processes()
    results: dict[int, TrialResult] = {}
    calibration: dict[str, float] = {}
    server_errors: list[str] = []
    try:
        with api_server(root, procs, responses) as (base_url, record, server):
            camp = Campaign(options, root, base_url, procs)
            calib = camp.calibrate()
            calibration = {"boot": camp.boot, "turn": camp.turn}
            if calib.failures:
                server_errors += [f"calibration: {f}" for f in calib.failures]
            master = random.Random(seed)
            plans = [
                (i, random.Random(master.randrange(2**32)), master.randint(1, options.max_kills))
                for i in range(1, options.trials + 1)
            ]

            def one(plan: tuple[int, random.Random, int]) -> TrialResult:
                index, rng, kills = plan
                try:
                    trial = Trial(camp, index, rng, kills)
                    trial.run()
                    result = trial.verify()
                except Exception:
                    result = TrialResult(index)
                    result.fail(f"the trial itself broke:\n{traceback.format_exc()}")
                if options.progress:
                    status = "ok" if not result.failures else "FAIL"
                    print(
                        f"trial {index:4d}: {status}, kills {result.kills_external} random + "
                        f"{result.kills_after_effect} after + {result.kills_before_effect} "
                        f"before effect, holds {result.holds}, {result.seconds:.1f} s",
                        file=sys.stderr,
                        flush=True,
                    )
                return result

            pool = ThreadPoolExecutor(max_workers=options.parallel)
            try:
                for result in pool.map(one, plans):
                    results[result.index] = result
            except BaseException:  # Ctrl-C, a test timeout: stop now, not after every trial
                camp.stop.set()
                raise
            finally:
                pool.shutdown(wait=True, cancel_futures=True)
            if server.poll() is not None:
                server_errors.append(f"the API server exited early ({server.returncode})")
        server_errors += _count_requests(record, {0: calib, **results})
        if calib.rejected:
            server_errors.append(f"calibration run: {calib.rejected} rejected transcripts")
    finally:
        procs.kill_all()
    report = Report(
        options,
        [results[i] for i in sorted(results)],
        time.monotonic() - started,
        calibration,
        root,
        server_errors,
    )
    if report.ok and not options.keep and options.root is None:
        shutil.rmtree(root, ignore_errors=True)
    return report


def run(quick: bool) -> list[Figure]:
    """The campaign as chaos figures: 100 trials quick, 500 full."""
    report = run_campaign(Options(trials=100 if quick else 500))
    print(report.table(), file=sys.stderr, flush=True)
    return report.as_figures()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.chaos.kill9", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--trials", type=int, default=100)
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--max-kills", type=int, default=Options.max_kills)
    parser.add_argument(
        "--before-share",
        type=float,
        default=Options.before_share,
        help="share of self-kills placed right before a side effect instead of right after",
    )
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--root", type=Path, default=None, help="work folder (kept)")
    parser.add_argument("--keep", action="store_true", help="keep the work folder")
    parser.add_argument("--json", action="store_true", help="also print the figures as JSON")
    parser.add_argument("--progress", action="store_true", help="one line per trial")
    args = parser.parse_args(argv)
    if args.trials < 1 or args.parallel < 1 or args.max_kills < 1:
        parser.error("--trials, --parallel and --max-kills must be at least 1")

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # unwind: every worker group and the server are killed

    signal.signal(signal.SIGTERM, on_term)
    options = Options(
        trials=args.trials,
        parallel=args.parallel,
        max_kills=args.max_kills,
        before_share=args.before_share,
        seed=args.seed,
        root=args.root,
        keep=args.keep,
        progress=args.progress,
    )
    try:
        report = run_campaign(options)
    except KeyboardInterrupt:
        print("kill9: interrupted; every worker and the API server were stopped", file=sys.stderr)
        return 130
    print(report.table())
    if args.json:
        print(json.dumps(report.figures()))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
