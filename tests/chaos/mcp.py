"""Class 23, MCP tool servers: real workers on the real SDK, their MCP servers killed, hung,
refused a start, daemonizing, and attacking (docs/design.md section 11).

Each trial is one task on the ``anthropic`` backend against the local Messages API server
(``worker.testing.messages_api``, in process), which validates every transcript it is sent
the way the real API does, and which serves the trial's tool calls one a turn. The tools
are the fault server's (``tests/mcp/fault_server.py``), trusted, so each effect class is
there: ``slow`` read-only, ``settle`` idempotent, ``count`` unsafe (and, on a second server
whose ``effects`` says so, keyed). Every ``count`` appends a line with its idempotency key to
a ledger in the workspace: the outside world an operator checks.

* **kill -9 of the worker** inside a call of each class, once its intent is durable;
* **kill of the server** (its own process, inside the sandbox) in a read-only and in an
  unsafe call;
* **a server that hangs** past its ``timeout`` (the call is cancelled, the server killed,
  the outcome unknown: re-run, then an error result after three unknown outcomes);
* **a server that fails to start** at the task's first start (the task waits in
  ``backoff``, exit 9) and then starts (the config mended);
* **a daemonizing server**: each server leaves a daemon behind as it starts, and the
  ``daemon`` tool makes another; after every worker's end, by kill -9 or not, none of a
  trial's processes may be left;
* **the filesystem attack**: ``@modelcontextprotocol/server-filesystem`` allowed ``/`` and
  the fault server's unchecked ``read`` ask for the spool, the config, the API key's file,
  the systemd credentials and another task's workspace, each holding a canary.

A held call is decided as a careful operator would: a ledger line with its key means it
ran (``--result``), none means it did not (re-run). Figures (violations must be 0): unsafe
calls re-run (a key twice in the ledger), keyed calls re-run with a new key, read-only
calls held (a hold of a read-only or idempotent call), servers outliving their worker,
secrets read (a canary in any result or the journal), transcripts rejected by the API,
tasks not done. Counted beside them: kills, holds, re-runs, unknown outcomes.

``python -m tests.chaos.mcp [--full]`` prints the table; ``tests/test_campaigns.py`` runs
the quick mode in ``make test``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from supervisor.decisions import decide
from supervisor.status import held_calls
from supervisor.submit import submit
from tests.chaos.kill9 import Processes, _worker_env
from tests.faults.report import Figure, campaign_main
from tests.mcp.servers import NODE_BIN, fault_server, write_config
from tests.support import assert_paired, processes_with
from worker.config import load_config
from worker.protocol import ExitCode
from worker.spool import Spool, TaskDir
from worker.state import fold
from worker.store.journal import read_file
from worker.testing.messages_api import DEFAULT_API_KEY, MessagesAPIServer, Reply

FAULT = "23 mcp"
MODEL = "claude-chaos-mcp"
JSON = dict[str, Any]
WAIT = 120.0  # seconds any one worker may take, on two busy cores
SLOW = 2.0  # seconds a call the campaign kills in sleeps (its re-runs sleep as long)
#: Where the trials run: a folder a sandboxed server sees as the host has it (not /tmp).
OUTSIDE_TMP = "/var/tmp"


#: A kill aimed at a call: run while a worker works; False when the call was not reached.
Hook = Callable[[subprocess.Popen[bytes]], bool]


@dataclass
class Tally:
    tasks: int = 0
    done: int = 0
    worker_kills: int = 0
    server_kills: int = 0
    unknown: int = 0  # calls whose outcome was unknown (server died or timed out)
    holds: int = 0
    reruns: int = 0
    unsafe_rerun: int = 0
    keyed_new_key: int = 0
    read_only_held: int = 0
    outliving: int = 0
    secrets_read: int = 0
    rejected: int = 0
    backoffs: int = 0
    daemons_seen: int = 0  # control: daemons the servers left, seen while their worker ran
    control_reads: int = 0  # control: the attack's reads of its own workspace that worked
    failures: list[str] = field(default_factory=list)

    def figures(self) -> list[Figure]:
        counted = [
            ("tasks", self.tasks),
            ("kill -9 of a worker in a call", self.worker_kills),
            ("kills of a server in a call", self.server_kills),
            ("unknown outcomes (server death, timeout)", self.unknown),
            ("waits for a server at the first start", self.backoffs),
            ("holds decided", self.holds),
            ("dangling calls re-run", self.reruns),
            ("control: daemons seen while their worker ran", self.daemons_seen),
            ("control: the attack's reads of its own workspace", self.control_reads),
        ]
        violations = [
            ("unsafe calls re-run", self.unsafe_rerun),
            ("keyed calls re-run with a new key", self.keyed_new_key),
            ("read-only calls held", self.read_only_held),
            ("servers outliving their worker", self.outliving),
            ("secrets read", self.secrets_read),
            ("transcripts rejected", self.rejected),
            ("tasks not done", self.tasks - self.done),
        ]
        figures = [Figure(FAULT, name, value) for name, value in counted]
        figures += [Figure(FAULT, name, value, value > 0) for name, value in violations]
        if self.failures:
            figures.append(Figure(FAULT, "failures", "; ".join(self.failures[:3]), True))
        return figures


class Trial:
    """One task whose model calls ``calls`` (a tool and its input), one a turn."""

    def __init__(
        self,
        root: Path,
        tally: Tally,
        name: str,
        servers: dict[str, dict[str, Any]],
        calls: list[tuple[str, JSON]],
        *,
        env: dict[str, str] | None = None,
    ) -> None:
        self.root = root / name
        self.root.mkdir(parents=True)
        self.tally = tally
        self.tag = f"chaos-mcp-{os.getpid()}-{name}-{random.randrange(10**9)}"
        self.calls = calls
        self.extra_env = env or {}
        self.servers = {
            server: {**settings, "command": [*settings["command"], self.tag]}
            for server, settings in servers.items()
        }
        self.config = write_config(
            self.root / "agentd.toml", self.servers, restart={"stop_grace": 2.0}
        )
        self.spool = Spool(self.root / "spool").ensure()
        self.task = self.submit(self.spool)
        self.api = MessagesAPIServer(responder=self.respond)
        self.procs = Processes()
        tally.tasks += 1

    def submit(self, spool: Spool, workspace: Path | None = None) -> TaskDir:
        return submit(
            spool,
            load_config(self.config),
            prompt="Use the servers' tools as told.",
            model=MODEL,
            tools=["mcp__*"],
            max_turns=100,
            workspace=workspace,
        )

    @property
    def workspace(self) -> Path:
        return self.task.workspace_for(self.task.load_spec())

    def respond(self, body: JSON) -> Reply:
        k = sum(m["role"] == "assistant" for m in body["messages"])
        if k < len(self.calls):
            tool, tool_input = self.calls[k]
            return Reply.tool_use(tool, tool_input, id=f"call{k}")
        return Reply.text("All done.")

    def records(self) -> list[JSON]:
        try:
            return [record for record, _ in read_file(self.task.journal).records]
        except FileNotFoundError:
            return []

    def intent(self, call_id: str, attempt: int) -> bool:
        return any(
            r.get("k") == "intent" and r["call_id"] == call_id and r["attempt"] >= attempt
            for r in self.records()
        )

    def result(self, call_id: str) -> JSON | None:
        return next(
            (r for r in self.records() if r.get("k") == "result" and r["call_id"] == call_id), None
        )

    # -- driving ---------------------------------------------------------------------------

    def spawn(self) -> subprocess.Popen[bytes]:
        env = _worker_env(
            {"ANTHROPIC_BASE_URL": self.api.base_url, "ANTHROPIC_API_KEY": DEFAULT_API_KEY}
            | self.extra_env
        )
        argv = [sys.executable, "-m", "worker", str(self.task.path), "--config", str(self.config)]
        return self.procs.start(argv, env, self.root / "worker.log")

    def run(self, hooks: list[Hook]) -> None:
        """Start workers until the task is done, each running the next of ``hooks`` (a
        kill, which waits for its call: a start that ends first, held say, keeps it for
        the next); a hold is decided, a wait for a server mended."""
        with self.api:
            try:
                self._drive(list(hooks))
            finally:
                self.procs.kill_all()
        self.verify()

    def _drive(self, hooks: list[Hook]) -> None:
        for _ in range(12 + 3 * len(hooks)):
            proc = self.spawn()
            hook = hooks.pop(0) if hooks else None
            try:
                if hook is not None and not hook(proc):
                    hooks.insert(0, hook)  # its call was not reached by this start
                proc.wait(timeout=WAIT)
            except subprocess.TimeoutExpired:
                self.tally.failures.append(f"{self.task.id}: a worker ran past {WAIT:g} s")
                return
            except Exception as exc:
                self.tally.failures.append(f"{self.task.id}: {type(exc).__name__}: {exc}")
                return
            finally:
                self.procs.reap(proc)
                self.check_nothing_left()
            code = proc.returncode
            if code == ExitCode.DONE:
                return
            if code == ExitCode.HELD:
                self.decide()
            elif code == ExitCode.TOOLS:
                self.tally.backoffs += 1
                self.mend()
            elif code != -signal.SIGKILL:
                log = (self.root / "worker.log").read_text(errors="replace")[-800:]
                self.tally.failures.append(f"{self.task.id}: exit {code}: {log}")
                return
        self.tally.failures.append(f"{self.task.id}: not done after every start")

    def mend(self) -> None:
        """The operator fixes the server that could not start (its --fail-start goes)."""
        for settings in self.servers.values():
            settings["command"] = [a for a in settings["command"] if a != "--fail-start"]
        write_config(self.config, self.servers, restart={"stop_grace": 2.0})

    def decide(self) -> None:
        ledger = self.ledger()
        effects = {r["call_id"]: r.get("effect") for r in self.records() if r.get("k") == "intent"}
        for row in held_calls(self.task):
            self.tally.holds += 1
            if effects.get(row["call_id"]) in ("read_only", "idempotent"):
                self.tally.read_only_held += 1
            if ledger[row["idempotency_key"]]:
                decide(self.task, row["call_id"], action="result", result="counted (checked)")
            else:
                decide(self.task, row["call_id"], action="rerun")

    def ledger(self) -> Counter[str]:
        """How many times each idempotency key was counted (the unsafe tool's effects)."""
        path = self.workspace / "ledger"
        lines = path.read_text().splitlines() if path.exists() else []
        return Counter(json.loads(line)["agentd/idempotency_key"] for line in lines if line)

    def check_nothing_left(self) -> None:
        """No process of this trial's servers (their argv holds its tag, and so do the
        daemons they leave) outlives the worker that ended."""
        deadline = time.monotonic() + 10
        while processes_with(self.tag) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = processes_with(self.tag)
        if left:
            self.tally.outliving += len(left)
            for proc in left:
                with contextlib.suppress(psutil.Error):
                    proc.kill()

    # -- kills -------------------------------------------------------------------------------

    def kill_worker_in(self, call_id: str, rng: random.Random) -> Hook:
        def hook(proc: subprocess.Popen[bytes]) -> bool:
            if not self._await(proc, lambda: self.intent(call_id, 1)):
                return False
            time.sleep(rng.uniform(0.05, 0.8))  # somewhere in the call (it takes SLOW s)
            self.tally.daemons_seen += sum(
                "sleep" in " ".join(p.cmdline()) for p in processes_with(self.tag)
            )
            os.kill(proc.pid, signal.SIGKILL)
            self.tally.worker_kills += 1
            return True

        return hook

    def kill_servers_in(self, call_ids: list[str], rng: random.Random) -> Hook:
        """Kill the server's own process (inside the sandbox) in each call in turn, all in
        the one worker (a read-only call goes on to the next by itself)."""

        def hook(proc: subprocess.Popen[bytes]) -> bool:
            for call_id in call_ids:
                if not self._await(proc, functools.partial(self.intent, call_id, 1)):
                    return False
                time.sleep(rng.uniform(0.3, 0.8))
                for server in processes_with(self.tag):
                    with contextlib.suppress(psutil.Error):
                        if server.name() != "bwrap" and "fault_server" in " ".join(
                            server.cmdline()
                        ):
                            server.kill()
                            self.tally.server_kills += 1
            return True

        return hook

    def _await(self, proc: subprocess.Popen[bytes], ready: Callable[[], bool]) -> bool:
        """Whether ``ready`` came true while the worker ran."""
        deadline = time.monotonic() + WAIT
        while not ready():
            if proc.poll() is not None or time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True

    # -- checking ------------------------------------------------------------------------------

    def verify(self) -> None:
        records = self.records()
        state = fold(self.task.load_spec().prompt, records)
        if (
            state.ended == {"state": "done", "reason": "end_turn"}
            and state.turn == len(self.calls) + 1
        ):
            self.tally.done += 1
        else:
            self.tally.failures.append(f"{self.task.id}: ended {state.ended}")
        try:
            assert_paired(state.messages)
        except AssertionError as exc:
            self.tally.rejected += 1
            self.tally.failures.append(f"{self.task.id}: {exc}")
        self.tally.rejected += sum(r.request is not None for r in self.api.rejected)
        self.tally.reruns += sum(
            r.get("outcome") == "rerun" for r in records if r.get("k") == "result"
        )
        self.tally.unsafe_rerun += sum(n - 1 for n in self.ledger().values() if n > 1)
        keys: dict[str, set[str]] = {}
        for r in records:
            if r.get("k") == "intent" and r.get("effect") == "keyed":
                keys.setdefault(r["call_id"], set()).add(r["key"])
        self.tally.keyed_new_key += sum(len(k) - 1 for k in keys.values())
        for line in self.task.events.read_text().splitlines() if self.task.events.exists() else []:
            event = json.loads(line)
            self.tally.unknown += event.get("event") == "mcp_server_failed" and "call_id" in event


# -- the trials --------------------------------------------------------------------------------

KEYED = {"effects": {"count": "keyed"}}


def effect_classes(root: Path, tally: Tally, rng: random.Random) -> None:
    """kill -9 of the worker inside a call of each class; the servers daemonize."""
    servers = {
        "f": {"command": fault_server("--daemonize", "DAEMON"), "trust": True},
        "k": {"command": fault_server(), "trust": True, **KEYED},
    }
    calls: list[tuple[str, JSON]] = [
        ("mcp__f__slow", {"seconds": SLOW}),
        ("mcp__f__settle", {"file": "state", "seconds": SLOW}),
        ("mcp__f__count", {"file": "ledger", "seconds": SLOW}),
        ("mcp__k__count", {"file": "keyed-ledger", "seconds": SLOW}),
        ("mcp__f__daemon", {"marker": "DAEMON"}),
    ]
    trial = Trial(root, tally, "classes", servers, calls)
    # the daemons' argv holds the trial's tag: found like the servers
    for settings in trial.servers.values():
        settings["command"] = [trial.tag if a == "DAEMON" else a for a in settings["command"]]
    trial.calls[-1] = ("mcp__f__daemon", {"marker": trial.tag})
    write_config(trial.config, trial.servers, restart={"stop_grace": 2.0})
    hooks = [trial.kill_worker_in(f"call{i}", rng) for i in range(4)]
    trial.run(hooks)


def server_deaths(root: Path, tally: Tally, rng: random.Random) -> None:
    """The server's own process killed inside a read-only and an unsafe call."""
    servers = {"f": {"command": fault_server(), "trust": True}}
    calls: list[tuple[str, JSON]] = [
        ("mcp__f__slow", {"seconds": 3}),
        ("mcp__f__count", {"file": "ledger", "seconds": 3}),
    ]
    trial = Trial(root, tally, "deaths", servers, calls)
    trial.run([trial.kill_servers_in(["call0", "call1"], rng)])


def hangs_and_starts(root: Path, tally: Tally, rng: random.Random) -> None:
    """A server that hangs past its timeout; one that fails to start at the first start."""
    servers = {
        "f": {"command": fault_server(), "trust": True, "timeout": 1.0},
        "g": {"command": fault_server("--fail-start"), "trust": True},
    }
    calls: list[tuple[str, JSON]] = [("mcp__f__hang", {}), ("mcp__g__echo", {"text": "mended"})]
    trial = Trial(root, tally, "hangs", servers, calls)
    trial.run([])
    hang = trial.result("call0")  # re-run, then an error result: never held, never failed
    if hang is None or not hang.get("is_error") or hang.get("outcome") != "rerun":
        tally.failures.append(f"the hung call's result: {hang}")
    cancelled = trial.workspace / "cancelled.log"
    if not cancelled.exists():
        tally.failures.append("no notifications/cancelled reached the hung server")


def filesystem_attack(root: Path, tally: Tally, rng: random.Random) -> None:
    """The filesystem server allowed / and an unchecked reader, after every secret."""
    fs = NODE_BIN / "mcp-server-filesystem"
    if not fs.exists():
        tally.failures.append(f"{fs} is missing: run `make mcp-servers`")
        return
    canary = "canary-" + os.urandom(8).hex()
    keys = root / "keys"
    keys.mkdir()
    (keys / "anthropic").write_text(f"sk-ant-{canary}\n")
    creds = root / "credentials"  # systemd's: what a unit's store URL and tokens are in
    creds.mkdir()
    (creds / "tracker_token").write_text(f"{canary}-token\n")
    (creds / "pgpass").write_text(f"db:5432:agentd:agentd:{canary}\n")
    elsewhere = root / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "notes.txt").write_text(f"{canary} of another task\n")
    servers = {"fs": {"command": [str(fs), "/"]}, "f": {"command": fault_server()}}
    secrets = {
        "ANTHROPIC_API_KEY_FILE": str(keys / "anthropic"),
        "CREDENTIALS_DIRECTORY": str(creds),
    }
    trial = Trial(root, tally, "attack", servers, [], env=secrets)
    other = trial.submit(trial.spool, workspace=elsewhere)  # another task's workspace
    (other.path / "notes").write_text(canary)
    (other.path.parent.parent / "planted").write_text(canary)
    with trial.config.open("a") as config:
        config.write(f"# {canary}\n")
    targets = [
        other.path / "spec.json",
        other.path / "notes",
        trial.spool.root / "planted",
        trial.task.path / "journal",
        trial.config,
        keys / "anthropic",
        creds / "tracker_token",
        creds / "pgpass",
        elsewhere / "notes.txt",
    ]
    for path in targets:
        trial.calls += [
            ("mcp__fs__read_text_file", {"path": str(path)}),
            ("mcp__f__read", {"path": str(path)}),
        ]
    mine = trial.workspace / "mine.txt"
    mine.parent.mkdir(parents=True, exist_ok=True)
    mine.write_text("the task's own file")
    trial.calls += [
        ("mcp__fs__read_text_file", {"path": str(mine)}),
        ("mcp__f__read", {"path": str(mine)}),
    ]
    trial.run([])
    for record in trial.records():
        if record.get("k") == "result" and record.get("content") == "the task's own file":
            tally.control_reads += 1
        shown = json.dumps(record)
        if record.get("k") == "result" and (canary in shown or "[redacted]" in shown):
            tally.secrets_read += 1
            tally.failures.append(f"read: {str(record['content'])[:100]}")
    if canary in trial.task.journal.read_bytes().decode(errors="replace"):
        tally.secrets_read += 1


TRIALS: list[Callable[[Path, Tally, random.Random], None]] = [
    effect_classes,
    server_deaths,
    hangs_and_starts,
    filesystem_attack,
]


def run(quick: bool = True, *, seed: int | None = None) -> list[Figure]:
    """Every trial once (quick), or three rounds of them (full)."""
    seed = random.randrange(2**32) if seed is None else seed
    rng = random.Random(seed)
    tally = Tally()
    started = time.monotonic()
    # (outside /tmp: a sandboxed server has a /tmp of its own, which would hide any secret
    # there whatever the sandbox did: the attack must meet only the sandbox's hiding)
    with tempfile.TemporaryDirectory(prefix="chaos-mcp-", dir=OUTSIDE_TMP) as folder:
        for round_ in range(1 if quick else 3):
            for trial in TRIALS:
                where = Path(folder) / f"r{round_}-{trial.__name__}"
                where.mkdir()
                try:
                    trial(where, tally, rng)
                except Exception as exc:
                    tally.failures.append(f"{trial.__name__}: {type(exc).__name__}: {exc}")
    figures = tally.figures()
    figures.append(Figure(FAULT, "seed", str(seed)))
    figures.append(Figure(FAULT, "runtime s", round(time.monotonic() - started, 1)))
    return figures


def main(argv: list[str] | None = None) -> int:
    return campaign_main(run, "python -m tests.chaos.mcp", __doc__ or "", argv)


if __name__ == "__main__":
    sys.exit(main())
