"""Trust attack: a long-lived MCP server reads the workspace of a task made after it started.

An attacker task's MCP server (the fault server, whose ``read`` returns any file it can
open) is started by its first call, which reads a file of the attacker's own workspace.
Then the attacker's ``run_command`` waits, so the worker, and the server with it, run on.
Meanwhile a victim task is submitted with a ``--workspace`` of its own that holds a
secret. Then the attacker's server is asked for the victim's secret by path, and for its
own file again (docs/design.md section 5: the sandbox shows a process the system's
folders, its installation and its own workspace; nothing of any other task, also one
made after it started).

Figures, under the sandbox (``[tools] sandbox = "required"``): later tasks' secrets read
through a running server (must be 0), and the attacker's reads of its own workspace
through the same server (must both work: a server that reads nothing proves nothing).
The control removes the defence (``sandbox = "off"``): the same server must read the
victim's secret.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from tests.chaos.trust import FAULT, Host, outside_tmp
from tests.daemon import Daemon, subreaper
from tests.faults.report import Figure
from tests.mcp.servers import fault_server
from tests.support import poll_for, reply, text, tool_use

SECRET = "later-task-canary-41c7"  # noqa: S105  (a canary, not a password)
OWN = "the attacker's own file"
CONFIG = (
    "[heartbeat]\ninterval = 0.25\ntimeout = 5.0\n"
    "[restart]\nbackoff_initial = 0.1\nbackoff_max = 0.4\n"
    '[tools]\nsandbox = "{sandbox}"\n'
    "[mcp.servers.f]\ncommand = {command}\n"
)
WAIT = 60.0  # seconds: any one step, on two busy cores
FINAL = ("done", "failed", "held", "cancelled")


@dataclass
class Outcome:
    secrets_read: int = 0  # the victim's secret in a result of the attacker's server
    own_reads: int = 0  # reads of the attacker's own file that worked (of 2)


def config(sandbox: str) -> str:
    command = "[" + ", ".join(f'"{arg}"' for arg in fault_server()) + "]"
    return CONFIG.format(sandbox=sandbox, command=command)


def attack(daemon: Daemon, later: Path) -> Outcome:
    """The attacker's server started, then the victim made, then the reads."""
    mine = daemon.root / "mine"
    with daemon.as_user():
        mine.mkdir()
        (mine / "own.txt").write_text(OWN)
    wait = "i=0; while [ ! -e go ] && [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done"
    read = "mcp__f__read"
    responses = [
        reply(tool_use(read, "own-before", path=str(mine / "own.txt"))),
        reply(tool_use("run_command", "wait", command=wait, timeout=WAIT * 2)),
        reply(
            tool_use(read, "later", path=str(later / "secret.txt")),
            tool_use(read, "own-after", path=str(mine / "own.txt")),
        ),
        reply(text("Done.")),
    ]
    try:
        daemon.start(timeout=WAIT)
        daemon.submit(responses, "attacker", workspace=mine, tools=[read, "run_command"])
        daemon.wait_row(
            "attacker", lambda r: r["phase"] == "tool:run_command", WAIT, "its server running"
        )
        daemon.submit([reply(text("Done."))], "victim", workspace=later)  # while it runs
        daemon.wait_state("victim", *FINAL, timeout=WAIT)
        with daemon.as_user():
            (mine / "go").touch()
        daemon.wait_state("attacker", *FINAL, timeout=WAIT)
        results = poll_for(lambda: _results(daemon), WAIT, what="the attacker's results")
        return Outcome(
            secrets_read=int(SECRET in results.get("later", "")),
            own_reads=sum(results.get(c, "") == OWN for c in ("own-before", "own-after")),
        )
    finally:
        daemon.cleanup()


def _results(daemon: Daemon) -> dict[str, str] | None:
    """The attacker's results by call, once its last read has one."""
    from tests.support import journal_records, of_kind

    records = of_kind(journal_records(daemon.task("attacker")), "result")
    found = {r["call_id"]: str(r["content"]) for r in records}
    return found if "own-after" in found else None


def run(quick: bool, host: Host) -> list[Figure]:
    del quick  # one round says it: a later task's workspace is either reachable or not
    with subreaper(), outside_tmp("later") as root, outside_tmp("victim") as later:
        # (the victim's workspace outside the daemon's folder: that one holds the config,
        # whose folder the sandbox hides anyway)
        (later / "secret.txt").write_text(SECRET)
        os.chmod(later / "secret.txt", 0o644)
        guarded = attack(host.daemon(root / "guarded", config("required")), later)
        control = attack(host.daemon(root / "bare", config("off")), later)
    name = host.name
    return [
        Figure(
            FAULT,
            f"later tasks' secrets read through a running server ({name})",
            guarded.secrets_read,
            guarded.secrets_read > 0,
        ),
        Figure(
            FAULT,
            f"control: own workspace read through the same server ({name})",
            f"{guarded.own_reads} of 2",
            guarded.own_reads != 2,
        ),
        Figure(
            FAULT,
            f"control, sandbox off: later task's secret read ({name})",
            control.secrets_read,
            control.secrets_read == 0,
        ),
    ]
