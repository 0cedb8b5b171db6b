"""``agentd demo``: the whole promise, shown in under 30 seconds, offline.

On a temporary spool, with the scripted model: start the daemon, submit a long task that
uses tools of every effect class, ``kill -9`` its worker twice (once at a random moment,
once between an unsafe tool's side effect and its result record), and show the restart
with resume, the hold, the operator's decision, and the task finishing. The summary
checks the journal against the outside record of side effects.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from supervisor.record import FINAL_STATES, TaskRecord
from supervisor.status import load_state
from supervisor.stores import store_of
from worker.protocol import TaskStatus
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


def demo_script(turns: int = TURNS) -> dict[str, Any]:
    """A long scripted task: every effect class, one slow unsafe call at turn 20."""
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
                "delay": 0.12,
            }
        )
    responses.append({"content": [{"type": "text", "text": "All steps done."}]})
    return {"responses": responses}


class Demo:
    def __init__(self, root: Path, say: Callable[[str], None] = print) -> None:
        self.root = root
        self.spool = Spool(root / "spool")
        self.config = root / "agentd.toml"
        self.say = say
        self.daemon: subprocess.Popen[bytes] | None = None

    def cli(self, *args: str) -> str:
        cmd = [sys.executable, "-m", "supervisor", "--spool", str(self.spool.root)]
        cmd += ["--config", str(self.config), *args]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=30)
        if done.returncode != 0:
            raise RuntimeError(f"agentd {' '.join(args)} failed: {done.stderr.strip()}")
        return done.stdout

    def status(self, task_id: str) -> dict[str, Any]:
        doc = json.loads(self.cli("status", task_id, "--json"))
        row: dict[str, Any] = doc["tasks"][0]
        return row

    def wait_for(self, what: str, check: Callable[[], bool], timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        while not check():
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out waiting for {what}")
            time.sleep(0.02)

    def start_daemon(self) -> None:
        self.config.write_text(DEMO_CONFIG)
        self.spool.ensure()  # `status` refuses a named spool that does not exist yet
        log = open(self.root / "daemon.log", "wb")  # noqa: SIM115  (lives as long as the daemon)
        cmd = [sys.executable, "-m", "supervisor", "--spool", str(self.spool.root)]
        cmd += ["--config", str(self.config), "--log-format", "json", "start"]
        self.daemon = subprocess.Popen(cmd, stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        log.close()
        self.wait_for("the daemon", lambda: '"running": true' in self.cli("status", "--json"))

    def stop_daemon(self) -> None:
        if self.daemon is not None and self.daemon.poll() is None:
            self.daemon.send_signal(signal.SIGTERM)
            try:
                self.daemon.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.daemon.kill()
                self.daemon.wait()

    def run(self) -> bool:
        self.say(f"agentd demo: spool {self.spool.root}")
        self.start_daemon()
        self.say("1. daemon started; submitting a 30-turn task that uses every kind of tool")
        script = self.root / "script.json"
        script.write_text(json.dumps(demo_script()))
        task_id = self.cli("submit", "--name", "demo", "--prompt", "Work through the steps.",
                           "--script", str(script)).strip()  # fmt: skip
        task = self.spool.task(task_id)
        ledger = task.path / "workspace" / LEDGER

        self.wait_for("turn 8", lambda: self.status(task_id)["turn"] >= 8)
        row = self.status(task_id)
        self.say(f"2. kill -9 of worker {row['pid']} at turn {row['turn']} ({row['phase']})")
        os.kill(row["pid"], signal.SIGKILL)
        self.wait_for(
            "the restart",
            lambda: (r := self.status(task_id))["restarts"] >= 1 and r["state"] == "running",
        )
        row = self.status(task_id)
        self.say(f"   restarted as worker {row['pid']}: resumed, now at turn {row['turn']}")

        self.wait_for("the charge", lambda: ledger.exists() and ledger.read_text() != "")
        row = self.status(task_id)
        self.say(
            f"3. an unsafe run_command has charged (ledger.txt written) but not returned: "
            f"kill -9 of worker {row['pid']} before its result is recorded"
        )
        os.kill(row["pid"], signal.SIGKILL)
        self.wait_for("the hold", lambda: self.status(task_id)["state"] == "held")
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
        self.wait_for("the end", lambda: self.status(task_id)["state"] in FINAL_STATES, 40)
        row = self.status(task_id)
        self.say(f"5. task {row['state']} ({row['reason']}) after {row['turn']} turns")
        self.stop_daemon()
        return self.summary(task, ledger)

    def summary(self, task: Any, ledger: Path) -> bool:
        records = store_of(task).replay(task.id)
        turns = [r["turn"] for r in records if r["k"] == "turn"]
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
        demo.stop_daemon()
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
            (f"{on} fork demo --at 12 --name demo-b", "a new task from the scene after turn 12"),
        ]
    return [
        (f"{agentd} demo --keep", "the same demo, keeping its spool to look into"),
        (f"{agentd} start --detach", "a daemon of your own (spool: ~/.local/state/agentd)"),
        (f'{agentd} submit --prompt "Summarise the files in this folder" --workspace .',
         "a task on the Anthropic API (ANTHROPIC_API_KEY from the environment)"),
    ]  # fmt: skip


def _agentd_as_typed() -> str:
    """``agentd`` when that is the one on PATH, else this environment's script as a path
    from the current folder (``.venv/bin/agentd`` after ``make demo``)."""
    script = Path(sys.executable).with_name("agentd")
    if shutil.which("agentd") == str(script):
        return "agentd"
    if script.is_relative_to(Path.cwd()):
        return str(script.relative_to(Path.cwd()))
    return str(script)
