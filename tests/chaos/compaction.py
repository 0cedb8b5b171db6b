"""Compaction chaos: fault class 20 of the campaign, ``kill -9`` aimed at compaction.

Each trial is one long task on the ``anthropic`` backend (the real SDK, in a real
``python -m worker`` process) against the local Messages API server
(``worker.testing.messages_api``, in process) with a ``context_limit`` as small as the worker's
``[context] window``, so the task compacts every few turns; the server validates every
request the way the API does, so a transcript with an unpaired tool_use is a rejection.
Step k of the task calls one tool of the five chaos tools (``tests.chaos.effect_tools``:
every effect class, 2 in 5 keyed, 1 in 5 unsafe) tagged ``s<k>``, with a few hundred
characters of text, tool input and tool output; the server derives the next step from the
latest tool_use of the transcript it is sent, so it answers a compacted transcript, and a
resumed worker, as the model would.

The worker is started again until the task is done, each start armed with one kill:

* ``summary call``: SIGKILL of the worker's group while the server holds its summary call;
* ``summary arrived``: right after the summary reply is written out, before (or, as the
  race goes, after) the worker records it; the journal says which;
* ``after record``: at the first model request after a summary, so after the record;
* ``random``: a short random delay after a random model reply of the start, so the kill
  lands in a tool call, between records or in the next call;

then, once every kill is spent, one start runs the task to its end. A held unsafe call is
decided like a careful operator (``tests.chaos.kill9.decide_held``).

Figures (violations, all 0): recorded turns lost (a journal read after a kill that is not
a prefix of the final one, or a turn record missing from it), compactions recorded twice
(two at the same turn boundary, or a range summarised twice), usage counted twice (the
folded total against the sum of the turn and compaction records), unpaired transcripts
(rejections of a request other than "prompt is too long", or a final transcript that does
not pair; a body cut short by its sender's kill, which does not parse, is counted apart),
unsafe or keyed effects repeated, effects missing, tasks not completed.

The proof run follows: one undisturbed task of ``PROOF_TURNS`` steps (300 in both modes)
through a window that holds about 30 of them, with its compactions, its requests rejected
as too long and for pairing, and its effects missing or repeated.

``python -m tests.chaos.compaction [--full] [--seed N]`` prints the table; quick mode runs
2 trials of 40 steps with 5 kills each, full mode 12 of 120 steps with 11 kills each.
``tests/test_campaigns.py`` runs the quick mode.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from supervisor.submit import submit
from tests.chaos.effect_tools import CHAOS_TOOLS, EFFECTS_ENV, JITTER_ENV, read_log
from tests.chaos.kill9 import Processes, _recorded, _worker_env, decide_held, journal_records
from tests.faults.report import Figure, campaign_main
from tests.support import assert_paired
from worker.compaction import SUMMARY_INSTRUCTION
from worker.config import load_config
from worker.spool import Spool, TaskDir
from worker.state import TaskState, fold
from worker.testing.messages_api import DEFAULT_API_KEY, Fault, MessagesAPIServer, Reply

FAULT = "20 compaction"
JSON = dict[str, Any]
MODEL = "claude-chaos-compaction"
EXIT_DONE, EXIT_HELD = 0, 4
FILLER = "the quick brown fox jumps over the lazy dog " * 6  # ~260 characters a block
TURN_TOKENS = 200  # about what one step adds to a request (prompt_tokens), measured
WINDOW = 12 * TURN_TOKENS  # the trials' window: a compaction every few steps
PROOF_TURNS = 300
PROOF_WINDOW = 30 * TURN_TOKENS  # holds about 30 steps
POINTS = ("summary call", "summary arrived", "after record")
EFFECT_OF = {
    "chaos_lookup": "read_only",
    "chaos_set": "idempotent",
    "chaos_send": "keyed",
    "chaos_enqueue": "keyed",
    "chaos_charge": "unsafe",
}


@dataclass(frozen=True)
class Plan:
    trials: int
    steps: int
    targeted: int  # rounds of the three aimed kills per trial
    random_kills: int

    @classmethod
    def of(cls, quick: bool) -> Plan:
        if quick:
            return cls(trials=2, steps=40, targeted=1, random_kills=2)
        return cls(trials=12, steps=120, targeted=2, random_kills=5)


# -- the model's side -------------------------------------------------------------------


def step_tool(k: int) -> str:
    return CHAOS_TOOLS[k % len(CHAOS_TOOLS)]


def step_input(k: int) -> JSON:
    """Step k's tool input: sizeable, and (for lookups) a sizeable tool output too."""
    tool, tag = step_tool(k), f"s{k}"
    if tool == "chaos_lookup":
        return {"tag": tag, "name": f"note{k % 3}"}
    if tool == "chaos_set":
        return {"tag": tag, "name": f"note{k % 3}", "value": f"step {k}: {FILLER}"}
    if tool == "chaos_send":
        return {"tag": tag, "to": "ops", "body": f"report of step {k}: {FILLER}"}
    if tool == "chaos_enqueue":
        return {"tag": tag, "item": f"job-{k}"}
    return {"tag": tag, "amount": k}


def is_summary_call(body: JSON) -> bool:
    last = body["messages"][-1]["content"]
    return isinstance(last, list) and any(
        b.get("type") == "text" and str(b.get("text", "")).startswith(SUMMARY_INSTRUCTION[:40])
        for b in last
    )


def last_step(body: JSON) -> int:
    """The step of the latest tool_use in the request (0 before the first)."""
    for message in reversed(body["messages"]):
        for block in reversed(message["content"]) if message["role"] == "assistant" else ():
            if block.get("type") == "tool_use":
                return int(str(block["input"]["tag"]).removeprefix("s"))
    return 0


def answer(body: JSON, steps: int) -> Reply:
    """What the model says to ``body``: a summary, the next step's call, or the end."""
    done = last_step(body)
    if is_summary_call(body):
        return Reply.text(f"Steps s1 to s{done} are done.\nNext: step s{done + 1}.")
    k = done + 1
    if k > steps:
        return Reply.text(f"All {steps} steps are done.")
    return Reply.tool_use(step_tool(k), step_input(k), text=f"Step {k}. {FILLER}")


def worker_config(root: Path, window: int, compact_at: float) -> Path:
    path = root / "agentd.toml"
    path.write_text(
        '[model]\nname = "claude-chaos"\nmax_tokens = 100\n\n'
        f"[context]\nwindow = {window}\ncompact_at = {compact_at}\nkeep_turns = 2\n\n"
        '[tools]\nmodules = ["tests.chaos.effect_tools"]\n'
    )
    return path


# -- one trial ----------------------------------------------------------------------------


@dataclass
class Tally:
    """What one trial (or, added up, the campaign) counted: the kills by where they
    landed, what the task did, and the violations (``MUST_BE_0``)."""

    kills: Counter[str] = field(default_factory=Counter)
    spawns: int = 0
    holds: int = 0
    compactions: int = 0
    summary_calls: int = 0
    too_long: int = 0
    cut_off: int = 0
    requests: int = 0
    turns_lost: int = 0
    compactions_twice: int = 0
    usage_twice: int = 0
    unpaired: int = 0
    unsafe_repeated: int = 0
    keyed_repeated: int = 0
    effects_missing: int = 0
    completed: int = 0
    failures: list[str] = field(default_factory=list)

    def add(self, other: Tally) -> None:
        for name, value in vars(other).items():
            mine = getattr(self, name)
            if isinstance(value, int):
                setattr(self, name, mine + value)
            elif isinstance(value, Counter):
                mine.update(value)
            else:
                mine.extend(value)


class Trial:
    """One long task, its own local server, and the kills aimed at its compactions."""

    def __init__(
        self,
        root: Path,
        rng: random.Random,
        steps: int,
        kills: list[str],
        window: int,
        compact_at: float = 0.6,
    ) -> None:
        self.root = root
        self.rng = rng
        self.steps = steps
        self.kills = kills
        # replies before a random kill: at most a share of the task, so every kill lands
        self.spacing = max(1, steps // (len(kills) + 1))
        self.max_spawns = 3 * len(kills) + 10  # a runaway loop fails instead of running on
        self.tally = Tally()
        self.effects = root / "effects.jsonl"
        self.config = worker_config(root, window, compact_at)
        self.task = self._submit()
        self.server = MessagesAPIServer(responder=self.respond, context_limit=window)
        self.server.on_served = self.served
        self.procs = Processes()
        self.lock = threading.Lock()
        self.proc: subprocess.Popen[bytes] | None = None
        self.armed: str | None = None
        self.killed: str | None = None
        self.summarised = False  # this start was served a summary
        self.replies_left = 0  # random: the replies of this start before the kill
        self.after_kill: list[list[JSON]] = []

    def _submit(self) -> TaskDir:
        spool = Spool(self.root / "spool").ensure()
        return submit(
            spool,
            load_config(self.config),
            prompt=f"Run the {self.steps} steps with the chaos tools.",
            name="long",
            model=MODEL,
            tools=list(CHAOS_TOOLS),
            max_turns=self.steps + 5,
        )

    # -- the server's hooks (its threads) ---------------------------------------------------

    def kill(self, point: str) -> None:
        with self.lock:
            if self.proc is None or self.armed != point:
                return
            self.armed, self.killed = None, point
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                self.killed = None

    def respond(self, body: JSON) -> Reply | Fault:
        summary = is_summary_call(body)
        if summary and self.armed == "summary call":
            self.kill("summary call")
            return Fault.drop()
        if not summary and self.summarised and self.armed == "after record":
            self.kill("after record")
            return Fault.drop()
        return answer(body, self.steps)

    def served(self, body: JSON, action: Reply | Fault) -> None:
        if is_summary_call(body) and isinstance(action, Reply):
            self.summarised = True
            self.kill("summary arrived")
        if self.armed == "random":
            self.replies_left -= 1
            if self.replies_left <= 0:
                timer = threading.Timer(self.rng.uniform(0, 0.08), self.kill, ("random",))
                timer.daemon = True
                timer.start()

    # -- driving ---------------------------------------------------------------------------

    def run(self) -> Tally:
        with self.server:
            try:
                self._drive()
            finally:
                self.procs.kill_all()
        self.verify()
        return self.tally

    def _drive(self) -> None:
        deadline = time.monotonic() + 60 + self.steps * 2.0
        while self.tally.spawns < self.max_spawns:
            code = self._spawn(self.kills.pop(0) if self.kills else None, deadline)
            if code == EXIT_DONE:
                return
            if code == EXIT_HELD:
                decided = decide_held(self.task, self.effects)
                if decided is None:
                    self.tally.failures.append("held, but no call waits for a decision")
                    return
                self.tally.holds += sum(decided)
            elif code != -signal.SIGKILL:
                log = (self.root / "worker.log").read_text(errors="replace")[-1500:]
                self.tally.failures.append(f"worker exited with {code}:\n{log}")
                return
        self.tally.failures.append(f"not done after {self.tally.spawns} worker starts")

    def _spawn(self, armed: str | None, deadline: float) -> int | None:
        env = _worker_env(
            {
                "ANTHROPIC_BASE_URL": self.server.base_url,
                "ANTHROPIC_API_KEY": DEFAULT_API_KEY,
                EFFECTS_ENV: str(self.effects),
                JITTER_ENV: "0.01",
            }
        )
        argv = [sys.executable, "-m", "worker", str(self.task.path), "--config", str(self.config)]
        compactions = len(self._compactions())
        with self.lock:
            self.armed, self.killed, self.summarised = armed, None, False
            self.replies_left = self.rng.randint(1, self.spacing)
            self.proc = self.procs.start(argv, env, self.root / "worker.log")
        self.tally.spawns += 1
        proc = self.proc
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.tally.failures.append("ran past the trial's deadline")
            return None
        finally:
            self.procs.reap(proc)
            with self.lock:
                self.proc, self.armed = None, None
        if proc.returncode == -signal.SIGKILL:
            records = journal_records(self.task)
            self.after_kill.append(records)
            point = self.killed or "unsent"
            if point == "summary arrived":
                made = len(self._compactions(records)) > compactions
                point += ", recorded" if made else ", not recorded"
            self.tally.kills[point] += 1
            if self.killed is None:
                self.tally.failures.append(f"worker {proc.pid} died of a SIGKILL nobody sent")
        return proc.returncode

    def _compactions(self, records: list[JSON] | None = None) -> list[JSON]:
        records = journal_records(self.task) if records is None else records
        return [r for r in records if r.get("k") == "compaction"]

    # -- checking ---------------------------------------------------------------------------

    def verify(self) -> None:
        t, final = self.tally, journal_records(self.task)
        for seen in self.after_kill:
            lost = len(_recorded(seen, "turn") - _recorded(final, "turn"))
            if lost or final[: len(seen)] != seen:
                t.turns_lost += max(1, lost)
                t.failures.append("a journal read after a kill is not a prefix of the final one")
        state = fold(self.task.load_spec().prompt, final)
        self._check_compactions(final)
        self._check_usage(final, state)
        self._check_requests(state)
        self._check_effects()
        ended = state.ended or {}
        if ended == {"state": "done", "reason": "end_turn"} and state.turn == self.steps + 1:
            t.completed += 1
        else:
            t.failures.append(f"ended {ended} after {state.turn} turns")

    def _check_compactions(self, final: list[JSON]) -> None:
        turns, boundaries, ranges = 0, Counter[int](), Counter[tuple[int, int]]()
        for record in final:
            turns += record.get("k") == "turn"
            if record.get("k") == "compaction":
                boundaries[turns] += 1
                ranges[(int(record["first"]), int(record["last"]))] += 1
        self.tally.compactions += sum(boundaries.values())
        twice = sum(n - 1 for n in boundaries.values()) + sum(n - 1 for n in ranges.values())
        if twice:
            self.tally.compactions_twice += twice
            self.tally.failures.append(f"compactions at turns {dict(boundaries)}")

    def _check_usage(self, final: list[JSON], state: TaskState) -> None:
        """The folded usage is the sum of what was recorded, each call once."""
        recorded = [r for r in final if r.get("k") in ("turn", "compaction")]
        for name in ("input_tokens", "output_tokens"):
            counted = sum(int(r["usage"].get(name, 0)) for r in recorded)
            if getattr(state.usage_total, name) != counted:
                self.tally.usage_twice += 1
                self.tally.failures.append(f"{name}: {getattr(state.usage_total, name)} folded")

    def _check_requests(self, state: TaskState) -> None:
        t, srv = self.tally, self.server
        t.requests += len(srv.requests)
        t.summary_calls += sum(is_summary_call(b) for b in srv.requests)
        t.too_long += sum("prompt is too long" in r.message for r in srv.rejected)
        # a body cut short by its sender's kill does not parse: the API never saw a request
        t.cut_off += sum(r.request is None for r in srv.rejected)
        other = [
            r.message
            for r in srv.rejected
            if r.request is not None and "prompt is too long" not in r.message
        ]
        t.failures += [f"server: {e}" for e in srv.errors]
        try:
            assert_paired(state.messages)
        except AssertionError as exc:
            other.append(f"final transcript: {exc}")
        t.unpaired += len(other)
        t.failures += other[:3]

    def _check_effects(self) -> None:
        effects = Counter(
            line["tag"] for line in read_log(self.effects) if line.get("kind") == "effect"
        )
        for k in range(1, self.steps + 1):
            kind, tag = EFFECT_OF[step_tool(k)], f"s{k}"
            if kind not in ("unsafe", "keyed"):
                continue
            if effects[tag] > 1:
                setattr(self.tally, f"{kind}_repeated", getattr(self.tally, f"{kind}_repeated") + 1)
                self.tally.failures.append(f"{kind} {tag} took effect {effects[tag]} times")
            elif effects[tag] == 0:
                self.tally.effects_missing += 1
                self.tally.failures.append(f"{kind} {tag} never took effect")


# -- the campaign -------------------------------------------------------------------------


def kill_plan(plan: Plan, rng: random.Random) -> list[str]:
    """The kills of one trial, in the order of its worker starts."""
    kills = [point for _ in range(plan.targeted) for point in POINTS]
    kills += ["random"] * plan.random_kills
    rng.shuffle(kills)
    return kills


#: The violation counts of a Tally, and their names in the table.
MUST_BE_0 = (
    ("turns_lost", "turns lost"),
    ("compactions_twice", "compactions recorded twice"),
    ("usage_twice", "usage counted twice"),
    ("unpaired", "unpaired transcripts"),
    ("unsafe_repeated", "unsafe effects repeated"),
    ("keyed_repeated", "keyed effects repeated"),
    ("effects_missing", "effects missing"),
)


def figures_of(t: Tally, trials: int) -> list[Figure]:
    where = ", ".join(f"{k} {v}" for k, v in sorted(t.kills.items()))
    return [
        Figure(FAULT, "trials (long tasks)", trials),
        Figure(FAULT, "kills", sum(t.kills.values())),
        Figure(FAULT, "  where they landed", where or "-"),
        Figure(FAULT, "worker starts", t.spawns),
        Figure(FAULT, "compactions recorded", t.compactions),
        Figure(FAULT, "summary calls made (lost ones included)", t.summary_calls),
        Figure(FAULT, "holds decided", t.holds),
        Figure(FAULT, "model requests validated", t.requests),
        Figure(FAULT, "requests rejected as too long", t.too_long),
        Figure(FAULT, "request bodies cut off by a kill (not JSON)", t.cut_off),
        *[Figure(FAULT, name, getattr(t, attr), getattr(t, attr) > 0) for attr, name in MUST_BE_0],
        Figure(FAULT, "tasks completed", t.completed, t.completed != trials),
        Figure(FAULT, "failures", len(t.failures), bool(t.failures)),
        *[Figure(FAULT, "failure", f, True) for f in t.failures[:5]],
    ]


def proof(root: Path, steps: int = PROOF_TURNS) -> list[Figure]:
    """One undisturbed task of ``steps`` steps through a window of about 30 of them."""
    root.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    trial = Trial(root, random.Random(0), steps, [], PROOF_WINDOW, compact_at=0.8)
    t = trial.run()
    widest = max(
        (sum(m["role"] == "assistant" for m in b["messages"]) for b in trial.server.requests),
        default=0,
    )
    name = f"proof: {steps} steps"
    return [
        Figure(name, "steps per request at most (the window)", widest),
        Figure(name, "compactions made", t.compactions),
        Figure(name, "requests rejected as too long", t.too_long, t.too_long > 1),
        Figure(name, "requests rejected for pairing", t.unpaired, t.unpaired > 0),
        Figure(
            name,
            "effects missing or repeated",
            t.effects_missing + t.unsafe_repeated + t.keyed_repeated,
            bool(t.effects_missing + t.unsafe_repeated + t.keyed_repeated),
        ),
        Figure(name, "finished done", t.completed, t.completed != 1),
        *[Figure(name, "failure", f, True) for f in t.failures[:5]],
        Figure(name, "runtime s", time.monotonic() - started),
    ]


def run(quick: bool, *, seed: int | None = None) -> list[Figure]:
    seed = random.randrange(1 << 30) if seed is None else seed
    plan, master = Plan.of(quick), random.Random(seed)
    figures = [Figure(FAULT, "seed (--seed replays the choices)", str(seed))]
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="agentd-compaction-") as folder:
        trials = []
        for i in range(plan.trials):
            rng = random.Random(master.randrange(1 << 30))
            root = Path(folder) / f"trial-{i:03d}"
            root.mkdir()
            trials.append(Trial(root, rng, plan.steps, kill_plan(plan, rng), WINDOW))
        total = Tally()
        with ThreadPoolExecutor(max_workers=2) as pool:
            for i, tally in enumerate(pool.map(Trial.run, trials)):
                total.add(tally)
                for failure in tally.failures:  # the table shows the first few only
                    print(f"compaction: trial {i}: {failure}", file=sys.stderr, flush=True)
        figures += figures_of(total, plan.trials)
        figures.append(Figure(FAULT, "runtime s", time.monotonic() - started))
        figures += proof(Path(folder) / "proof")
    return figures


def main(argv: list[str] | None = None) -> int:
    return campaign_main(run, "python -m tests.chaos.compaction", __doc__ or "", argv)


if __name__ == "__main__":
    sys.exit(main())
