"""``agentd demo``: the whole promise, shown in under 30 seconds, offline.

On a temporary spool, with the scripted model: start the daemon, submit a long task that
uses tools of every effect class, ``kill -9`` its worker twice (once at a random moment,
once between an unsafe tool's side effect and its result record), and show the restart
with resume, the hold, the operator's decision, and the task finishing. The summary
checks the journal against the outside record of side effects.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from supervisor.pgcluster import ThrowawayCluster, find_binaries
from supervisor.record import TaskRecord
from supervisor.status import load_state
from supervisor.stores import store_of
from worker.descendants import descendants
from worker.errors import ClusterError
from worker.events import Event
from worker.protocol import FINAL_STATES, TaskStatus
from worker.records import CallOutcome, RecordKind
from worker.spool import Spool

TURNS = 30
DEMO_CONFIG = """\
max_workers = 2
[heartbeat]
interval = 0.2
timeout = 3.0
[restart]
backoff_initial = 0.2
backoff_max = 2.0
stop_grace = 3.0
"""


#: The file the demo's unsafe "charge" appends to, in the task's workspace (the only place a
#: sandboxed run_command may write).
LEDGER = "ledger.txt"


#: The turn whose model call is slow: the first kill -9 lands in it, where the task has no
#: call under way (a kill timed by the clock on a loaded machine could land in turn 20's
#: unsafe call instead, and hold the task where the demo waits for a restart).
SLOW_TURN = 9


def demo_script(turns: int = TURNS) -> dict[str, Any]:
    """A long scripted task: every effect class, one slow unsafe call at turn 20, and a
    slow model call (``SLOW_TURN``) for the first kill to land in."""
    responses: list[dict[str, Any]] = []
    for i in range(1, turns):
        kind = i % 5
        if i == 20:
            charge = f"echo charged >> {LEDGER}; sleep 3; echo ok"
            block = {"name": "run_command", "input": {"command": charge, "timeout": 30}}
        elif kind == 0:
            block = {"name": "write_file", "input": {"path": f"notes/{i}.md", "content": f"#{i}"}}
        elif kind == 1:
            block = {"name": "read_file", "input": {"path": f"notes/{i - 1}.md"}}
        elif kind == 2:
            block = {"name": "outbox_send", "input": {"to": "ops", "body": f"step {i}"}}
        elif kind == 3:
            block = {"name": "append_file", "input": {"path": "journal.txt", "content": f"{i}\n"}}
        else:
            block = {"name": "list_dir", "input": {"path": "."}}
        responses.append(
            {
                "content": [
                    {"type": "text", "text": f"Step {i}."},
                    {"type": "tool_use", **block},
                ],
                "delay": 2.0 if i == SLOW_TURN else 0.12,
            }
        )
    responses.append({"content": [{"type": "text", "text": "All steps done."}]})
    return {"responses": responses}


class Node:
    """One agentd daemon the demo runs, with a spool and a config of its own under
    ``root``; given ``store`` and ``name``, one node of a cluster on that database (the
    URL goes through ``AGENTD_STORE``, so its password is on no command line)."""

    def __init__(
        self, root: Path, config: str, *, name: str | None = None, store: str | None = None
    ) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.root = root
        self.name = name
        self.spool = Spool(root / "spool").ensure()  # commands refuse a spool not there
        self.config = root / "agentd.toml"
        self.config.write_text(config)
        self.env = {**os.environ, "AGENTD_STORE": store} if store else None
        self.daemon: subprocess.Popen[bytes] | None = None

    def argv(self, *args: str) -> list[str]:
        cmd = [sys.executable, "-m", "supervisor", "--spool", str(self.spool.root)]
        cmd += ["--config", str(self.config)]
        return [*cmd, "--node", self.name, *args] if self.name else [*cmd, *args]

    def cli(self, *args: str) -> str:
        """``agentd ARGS`` on this node; its standard output. RuntimeError with the
        command's error line when it fails (the demo then stops and says so)."""
        done = subprocess.run(
            self.argv(*args), capture_output=True, text=True, check=False, timeout=30,
            env=self.env,
        )  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"agentd {' '.join(args)} failed: {done.stderr.strip()}")
        return done.stdout

    def status(self, task_id: str) -> dict[str, Any]:
        doc = json.loads(self.cli("status", task_id, "--json"))
        row: dict[str, Any] = doc["tasks"][0]
        return row

    def start(self) -> None:
        """Start the daemon in the background; returns once it serves (its own
        ``status`` says so)."""
        log = open(self.root / "daemon.log", "wb")  # noqa: SIM115  (lives as long as the daemon)
        self.daemon = subprocess.Popen(
            self.argv("--log-format", "json", "start"),
            stdout=log, stderr=log, stdin=subprocess.DEVNULL, env=self.env,
        )  # fmt: skip
        log.close()
        daemon = self.daemon

        def serving() -> bool:
            if daemon.poll() is not None:
                raise RuntimeError(f"{self.title} exited with {daemon.returncode}: {self.tail()}")
            doc = json.loads(self.cli("status", "--json"))
            return bool(doc["supervisor"].get("running"))

        wait_for(f"{self.title} to start", serving)

    def stop(self) -> None:
        if self.daemon is not None and self.daemon.poll() is None:
            self.daemon.send_signal(signal.SIGTERM)
            try:
                self.daemon.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill()

    def kill(self) -> list[int]:
        """kill -9 of the daemon's whole tree (a node's death): frozen first so it starts
        nothing meanwhile, then every descendant (the fork server, workers in sessions of
        their own, their tools) and the daemon itself. Returns the descendants' pids."""
        if self.daemon is None or self.daemon.poll() is not None:
            return []
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.daemon.pid, signal.SIGSTOP)
        below = descendants(self.daemon.pid)
        for pid in [self.daemon.pid, *below]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.daemon.wait()
        return below

    @property
    def title(self) -> str:
        return f"node {self.name}" if self.name else "the daemon"

    def tail(self) -> str:
        """The last line the daemon logged: why it stopped, when it did."""
        with contextlib.suppress(OSError, IndexError):
            return (self.root / "daemon.log").read_text().strip().splitlines()[-1]
        return "(no log)"


#: Seconds a demo step waits while what it waits for does not move on.
PATIENCE = 60.0
#: Seconds after which a step still waiting says so, and why it may take long.
SLOW = 10.0


def wait_for(
    what: str,
    check: Callable[[], object],
    timeout: float = PATIENCE,
    say: Callable[[str], None] | None = None,
) -> None:
    """Poll ``check`` until it returns True. Anything else it returns is what it saw (a
    task's state, phase and turn: ``progress``), and ``timeout`` counts from the last
    change of it: a step that moves on, however slowly a loaded machine runs it, is waited
    for, and one that stops moving is given up, RuntimeError naming ``what``, what was
    seen last and the machine's load. A step still waiting after ``SLOW`` seconds says
    so through ``say``, once."""
    started = last_change = time.monotonic()
    seen: object = None
    while (now_seen := check()) is not True:
        now = time.monotonic()
        if now_seen != seen:
            seen, last_change = now_seen, now
        if now - last_change > timeout:
            last = f" (last seen: {seen})" if seen else ""
            raise RuntimeError(
                f"timed out waiting for {what}: nothing moved on for {timeout:g} s{last}; {_load()}"
            )
        if say is not None and now - started > SLOW:
            say(f"   (still waiting for {what} after {SLOW:g} s; {_load()})")
            say = None
        time.sleep(0.02)


def progress(row: dict[str, Any]) -> str:
    """What ``wait_for`` sees of a task's status row: it changes as the task moves on."""
    return f"{row['state']}, turn {row['turn']}, {row['phase'] or 'no phase'}"


def _load() -> str:
    """The machine's load, which slows each step of the demo."""
    try:
        load = os.getloadavg()[0]
    except OSError:
        return "the machine's load is unknown"
    return f"load average {load:.1f} on {os.cpu_count() or 1} cores"


class Demo:
    def __init__(self, root: Path, say: Callable[[str], None] = print) -> None:
        self.root = root
        self.node = Node(root, DEMO_CONFIG)
        self.spool = self.node.spool
        self.cli = self.node.cli
        self.status = self.node.status
        self.say = say

    def wait(self, task_id: str, what: str, done: Callable[[dict[str, Any]], bool]) -> None:
        """``wait_for`` the task's status row to be ``done``, for as long as it moves on."""

        def check() -> object:
            row = self.status(task_id)
            return True if done(row) else progress(row)

        wait_for(what, check, say=self.say)

    def run(self) -> bool:
        self.say(f"agentd demo: spool {self.spool.root}")
        self.node.start()
        self.say("1. daemon started; submitting a 30-turn task that uses every kind of tool")
        script = self.root / "script.json"
        script.write_text(json.dumps(demo_script()))
        task_id = self.cli("submit", "--name", "demo", "--prompt", "Work through the steps.",
                           "--script", str(script)).strip()  # fmt: skip
        task = self.spool.task(task_id)
        ledger = task.path / "workspace" / LEDGER

        self.wait(  # the worker waiting on the model's slow reply: no call under way
            task_id,
            f"turn {SLOW_TURN}'s model call",
            lambda r: r["turn"] == SLOW_TURN - 1 and r["phase"] == "model",
        )
        row = self.status(task_id)
        self.say(f"2. kill -9 of worker {row['pid']} at turn {row['turn']} ({row['phase']})")
        os.kill(row["pid"], signal.SIGKILL)
        self.wait(task_id, "the restart", lambda r: r["restarts"] >= 1 and r["state"] == "running")
        row = self.status(task_id)
        self.say(f"   restarted as worker {row['pid']}: resumed, now at turn {row['turn']}")

        self.wait(task_id, "the charge", lambda _: ledger.exists() and ledger.read_text() != "")
        row = self.status(task_id)
        self.say(
            f"3. an unsafe run_command has charged (ledger.txt written) but not returned: "
            f"kill -9 of worker {row['pid']} before its result is recorded"
        )
        os.kill(row["pid"], signal.SIGKILL)
        self.wait(task_id, "the hold", lambda r: r["state"] == "held")
        held = json.loads(self.cli("dangling", task_id, "--json"))
        call = held[0]
        self.say(
            f"4. task held: dangling {call['tool']} call {call['call_id']} ({call['effect']}); "
            "re-running it could charge twice"
        )
        charges = ledger.read_text().count("charged")
        self.say(f"   the operator checks ledger.txt: {charges} charge, so records that outcome")
        self.cli("approve-dangling", task_id, call["call_id"], "--result",
                 "exit code 0 (verified by operator: charged once)")  # fmt: skip
        self.wait(task_id, "the end", lambda r: r["state"] in FINAL_STATES)
        row = self.status(task_id)
        self.say(f"5. task {row['state']} ({row['reason']}) after {row['turn']} turns")
        self.node.stop()
        return self.summary(task, ledger)

    def summary(self, task: Any, ledger: Path) -> bool:
        records = store_of(task).replay(task.id)
        turns = [r["turn"] for r in records if r["k"] == RecordKind.TURN]
        state = load_state(task)
        outcomes: dict[str, int] = {}
        for call in state.calls.values():
            outcomes[call.outcome] = outcomes.get(call.outcome, 0) + 1
        outbox = list((task.path / "workspace" / "outbox").glob("*.json"))
        sends = sum(1 for c in state.calls.values() if c.tool == "outbox_send")
        appended = (task.path / "workspace" / "journal.txt").read_text().split()
        appends = sum(1 for c in state.calls.values() if c.tool == "append_file")
        record = TaskRecord.load(task)
        checks = {
            "turns recorded 1..N with none lost or repeated": turns == list(range(1, TURNS + 1)),
            "unsafe charge done exactly once": ledger.read_text().count("charged") == 1,
            "unsafe appends done exactly once each": len(appended) == len(set(appended)) == appends,
            "keyed sends delivered exactly once each": len(outbox) == sends,
            "every tool_use answered by one tool_result": _paired(state.messages),
            "task done": record.state == TaskStatus.DONE,
        }
        self.say("")
        calls = ", ".join(f"{n} {k}" for k, n in sorted(outcomes.items()))
        self.say(f"summary: {len(turns)} turns, {record.restarts} restarts, {len(state.calls)} "
                 f"tool calls ({calls})")  # fmt: skip
        for what, ok in checks.items():
            self.say(f"  [{'ok' if ok else 'FAIL'}] {what}")
        return all(checks.values())


def _paired(messages: list[dict[str, Any]]) -> bool:
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        uses = [b["id"] for b in message["content"] if b.get("type") == "tool_use"]
        if not uses:
            continue
        if i + 1 >= len(messages):
            return False
        answers = [
            b["tool_use_id"] for b in messages[i + 1]["content"] if b.get("type") == "tool_result"
        ]
        if sorted(answers) != sorted(uses):
            return False
    return True


def run_demo(*, keep: bool = False) -> int:
    root = Path(tempfile.mkdtemp(prefix="agentd-demo-"))
    demo = Demo(root)
    started = time.monotonic()
    try:
        ok = demo.run()
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        print(f"agentd demo: {exc}", file=sys.stderr)
        ok = False
    finally:
        demo.node.stop()
        if not keep:
            shutil.rmtree(root, ignore_errors=True)
    print(f"demo {'passed' if ok else 'FAILED'} in {time.monotonic() - started:.1f} s"
          + (f"; spool kept in {demo.spool.root}" if keep else ""))  # fmt: skip
    print("\ntry next:")
    for command, why in next_commands(demo.spool.root if keep else None):
        print(f"  {command}\n      {why}")
    return 0 if ok else 1


def next_commands(kept: Path | None) -> list[tuple[str, str]]:
    """Three commands to run after the demo: on its spool when it was kept, else the
    way to keep it and the first steps with a daemon of one's own."""
    agentd = _agentd_as_typed()
    if kept is not None:
        on = f"{agentd} --spool {kept}"
        return [
            (f"{on} history demo", "every turn: its time, tokens and tool calls with outcomes"),
            (f"{on} logs demo", "the lifecycle: the two kill -9s, the restarts, the hold"),
            (
                f"{on} fork demo --at 12 --name demo-b",
                "a new task from the scene after turn 12; it waits queued until "
                f"`{on} start` (the demo's daemon has stopped)",
            ),
        ]
    return [
        (f"{agentd} demo --keep", "the same demo, keeping its spool to look into"),
        (f"{agentd} start --detach", "a daemon of your own (spool: ~/.local/state/agentd)"),
        (f'{agentd} submit --prompt "Summarise the files in this folder" --workspace .',
         "a task on the Anthropic API (ANTHROPIC_API_KEY from the environment)"),
    ]  # fmt: skip


def _agentd_as_typed() -> str:
    """``agentd`` when that is the one on PATH, else this environment's script by its
    absolute path (``.../.venv/bin/agentd`` after ``make demo``): a line that works from
    any folder."""
    script = Path(sys.executable).with_name("agentd")
    if shutil.which("agentd") == str(script):
        return "agentd"
    return shlex.quote(str(script))


# -- agentd demo --cluster ------------------------------------------------------------------

CLUSTER_TURNS = 30
KILL_AT = 5  # node a dies once the task is past this turn, in its model call
LEASE = 3.0
CLUSTER_CONFIG = f"""\
max_workers = 2
[heartbeat]
interval = 0.5
timeout = 3.0
[restart]
backoff_initial = 0.2
backoff_max = 2.0
stop_grace = 3.0
[cluster]
lease = {LEASE}
"""


def cluster_script(turns: int = CLUSTER_TURNS) -> dict[str, Any]:
    """A task of slow-ish turns (a 0.3 s model call each) with unsafe appends and keyed
    sends among its tools, so that a step run twice would show in the workspace. No
    run_command: the demo's story is the failover, not the sandbox."""
    responses: list[dict[str, Any]] = []
    for i in range(1, turns):
        block = {"type": "tool_use", **_cluster_tool(i)}
        responses.append({"content": [{"type": "text", "text": f"Step {i}."}, block], "delay": 0.3})
    responses.append({"content": [{"type": "text", "text": "All steps done."}]})
    return {"responses": responses}


def _cluster_tool(i: int) -> dict[str, Any]:
    """Turn ``i``'s tool call: a write, an unsafe append, a keyed send or a listing."""
    kind = i % 4
    if kind == 0:
        return {"name": "write_file", "input": {"path": f"notes/{i}.md", "content": f"#{i}"}}
    if kind == 1:
        return {"name": "append_file", "input": {"path": "journal.txt", "content": f"{i}\n"}}
    if kind == 2:
        return {"name": "outbox_send", "input": {"to": "ops", "body": f"step {i}"}}
    return {"name": "list_dir", "input": {"path": "."}}


class ClusterDemo:
    """Two nodes on one PostgreSQL: node a takes the task and dies (kill -9 of its whole
    tree) mid-task; node b takes it over once a's lease ends and finishes it. Everything
    it shows comes through the CLI, as an operator on either node would see it."""

    def __init__(self, root: Path, store: str, say: Callable[[str], None] = print) -> None:
        self.root = root
        self.say = say
        self.a = Node(root / "a", CLUSTER_CONFIG, name="a", store=store)
        self.b = Node(root / "b", CLUSTER_CONFIG, name="b", store=store)
        self.workspace = root / "shared" / "workspace"  # the mount every node reaches

    def claims(self, node: Node, task_id: str) -> list[dict[str, Any]]:
        """The task's ``task_claimed`` events, as any node reads them."""
        lines = node.cli("logs", task_id, "--json").splitlines()
        events = [json.loads(line) for line in lines if line.strip()]
        return [e for e in events if e.get("event") == Event.TASK_CLAIMED]

    def run(self) -> bool:
        a, b = self.a, self.b
        a.cli("store", "init")
        a.start()
        self.say(f"1. schema created (agentd store init); node a started (lease {LEASE:g} s); "
                 f"submitting a {CLUSTER_TURNS}-turn task")  # fmt: skip
        script = self.root / "script.json"
        script.write_text(json.dumps(cluster_script()))
        self.workspace.mkdir(parents=True)
        task_id = a.cli("submit", "--name", "demo", "--prompt", "Work through the steps.",
                        "--script", str(script),
                        "--workspace", str(self.workspace)).strip()  # fmt: skip
        wait_for("node a to claim the task", lambda: a.status(task_id)["node"] == "a")
        first = self.claims(a, task_id)[-1]
        b.start()
        self.say(f"2. node a claimed it (epoch {first.get('epoch')}); node b started")

        wait_for(
            f"turn {KILL_AT}",
            lambda: (r := a.status(task_id))["turn"] >= KILL_AT and r["phase"] == "model",
        )
        turn = a.status(task_id)["turn"]
        killed_at = time.time()
        below = a.kill()
        self.say(f"3. at turn {turn}, in its model call: kill -9 of node a's whole tree "
                 f"(the daemon and the {len(below)} processes below it)")  # fmt: skip

        wait_for("node b to take the task", lambda: b.status(task_id)["node"] == "b")
        second = self.claims(b, task_id)[-1]
        after = _seconds_since(killed_at, second.get("timestamp"))
        row = b.status(task_id)
        self.say(f"4. node b claimed it {after} after the kill (epoch {second.get('epoch')}): "
                 f"a's lease of {LEASE:g} s ran out; it resumed after turn {turn}, and "
                 f"status --json now shows node {row['node']} at turn {row['turn']}")  # fmt: skip
        wait_for("the end", lambda: b.status(task_id)["state"] in FINAL_STATES, 120)
        row = b.status(task_id)
        self.say(f"5. task {row['state']} ({row['reason']}) after {row['turn']} turns")
        return self.summary(task_id)

    def summary(self, task_id: str) -> bool:
        b = self.b
        rows = [r for r in json.loads(b.cli("history", task_id, "--json")) if r["kind"] == "turn"]
        turns = [r["turn"] for r in rows if not r["rewound"]]
        calls = [c for r in rows for c in r["tool_calls"]]
        outcomes: dict[str, int] = {}
        for call in calls:
            outcomes[call["outcome"]] = outcomes.get(call["outcome"], 0) + 1
        appended = (self.workspace / "journal.txt").read_text().split()
        appends = sum(1 for c in calls if c["tool"] == "append_file")
        outbox = list((self.workspace / "outbox").glob("*.json"))
        sends = sum(1 for c in calls if c["tool"] == "outbox_send")
        claims = [(e.get("node"), e.get("epoch")) for e in self.claims(b, task_id)]
        state = b.status(task_id)["state"]
        checks = {
            "node b took the task over from node a": [n for n, _ in claims] == ["a", "b"],
            "turns recorded 1..N with none lost or repeated": (
                [r["turn"] for r in rows] == turns == list(range(1, CLUSTER_TURNS + 1))
            ),
            "unsafe appends done exactly once each": len(appended) == len(set(appended)) == appends,
            "keyed sends delivered exactly once each": len(outbox) == sends,
            "every tool call has one outcome, none left dangling": (
                not {CallOutcome.PENDING, CallOutcome.DANGLING} & outcomes.keys()
            ),
            "task done": state == TaskStatus.DONE,
        }
        self.say("")
        held = ", ".join(f"{node} epoch {epoch}" for node, epoch in claims)
        made = ", ".join(f"{n} {k}" for k, n in sorted(outcomes.items()))
        self.say(
            f"summary: {len(turns)} turns, claimed by {held}; {len(calls)} tool calls ({made})"
        )
        for what, ok in checks.items():
            self.say(f"  [{'ok' if ok else 'FAIL'}] {what}")
        return all(checks.values())

    def stop(self) -> None:
        self.a.stop()
        self.b.stop()


def _seconds_since(start: float, timestamp: object) -> str:
    """``timestamp`` (an event's ISO 8601 time) as seconds after ``start`` (epoch)."""
    try:
        then = datetime.fromisoformat(str(timestamp)).timestamp()
    except ValueError:
        return "(at an unknown time)"
    return f"{then - start:.1f} s"


def run_cluster_demo(*, binaries: Callable[[], Path] = find_binaries) -> int:
    """``agentd demo --cluster``: the failover story on a throwaway PostgreSQL (started
    from the server binaries ``binaries`` finds, removed afterwards); exit 1 with one
    line saying how to get them when they are not on this machine."""
    try:
        binaries()
    except ClusterError as exc:
        print(f"agentd demo --cluster: {exc}", file=sys.stderr)
        return 1
    root = Path(tempfile.mkdtemp(prefix="agentd-demo-cluster-"))
    started = time.monotonic()
    ok = False
    demo: ClusterDemo | None = None
    try:
        with ThrowawayCluster.create() as server:
            print(f"agentd demo --cluster: a throwaway PostgreSQL on 127.0.0.1:{server.port}, "
                  f"nodes a and b with spools of their own in {root}")  # fmt: skip
            demo = ClusterDemo(root, server.url)
            try:
                ok = demo.run()
            finally:
                demo.stop()
    except (RuntimeError, OSError, subprocess.SubprocessError, ClusterError) as exc:
        print(f"agentd demo --cluster: {exc}", file=sys.stderr)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"demo {'passed' if ok else 'FAILED'} in {time.monotonic() - started:.1f} s")
    print("\ntry next:")
    for command, why in cluster_next_commands():
        print(f"  {command}\n      {why}")
    return 0 if ok else 1


def cluster_next_commands() -> list[tuple[str, str]]:
    """How to run the same by hand, with a throwaway server of one's own."""
    agentd = _agentd_as_typed()
    return [
        (f"{shlex.quote(sys.executable)} -m supervisor.pgcluster up",
         "a throwaway PostgreSQL: prints its folder and URL"),
        (f"AGENTD_STORE=URL {agentd} --spool /tmp/a --node a start --detach",
         "a node (and another with --spool /tmp/b --node b)"),
        (f"AGENTD_STORE=URL {agentd} status", "the whole cluster, from any node: `node` per task"),
    ]  # fmt: skip
