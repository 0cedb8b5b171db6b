"""Trust attack: a task's tools reach another task's workspace, or the spool through a
workspace that exposes it.

Two tasks run on one daemon, each with a ``--workspace`` of its own. The victim's holds
a secret; the attacker's ``run_command`` reads it and plants a file there (docs/design.md
section 5: every other task is invisible to a tool under the sandbox). Then the
attacker submits tasks whose workspace would expose the spool: the spool itself, the
victim's task folder in it, and the folder that holds the spool (``--workspace .`` in
a home folder that holds the default spool): ``agentd submit`` must refuse each (exit 2).

Figures, under the sandbox (``[tools] sandbox = "required"``): foreign reads and foreign
writes of the victim's workspace, and spool workspaces accepted. The controls remove each
defence: with ``sandbox = "off"`` the same command must read the secret and plant the
file; and a task made with the spool as its workspace (the submit check bypassed,
``create_task``) must replace the victim's journal with ``write_file``, which needs no
sandbox to be turned off.
"""

from __future__ import annotations

from dataclasses import dataclass

from supervisor.coordination import ring
from tests.chaos.trust import FAULT, Host, outside_tmp
from tests.daemon import Daemon, subreaper
from tests.faults.report import Figure
from tests.support import reply, spec_task, text, tool_use

SECRET = "workspace-canary-7d41"  # noqa: S105  (a canary, not a password)
CONFIG = (
    "[heartbeat]\ninterval = 0.25\ntimeout = 5.0\n"
    "[restart]\nbackoff_initial = 0.1\nbackoff_max = 0.4\n"
    '[tools]\nsandbox = "{sandbox}"\n'
)
WAIT = 60.0  # seconds: a task of two turns, on two busy cores
FORGED = "forged by a neighbour\n"


@dataclass
class Outcome:
    reads: int = 0
    writes: int = 0
    accepted: int = 0
    exposures: int = 0
    journal_replaced: int = 0


def run(quick: bool, host: Host) -> list[Figure]:
    del quick  # one round says it: a neighbour's workspace is either reachable or not
    with subreaper(), outside_tmp("ws") as root:
        guarded = attack(host.daemon(root / "bwrap", CONFIG.format(sandbox="required")))
        control = attack(host.daemon(root / "bare", CONFIG.format(sandbox="off")), bypass=True)
    name = host.name
    return [
        Figure(FAULT, f"foreign reads ({name})", guarded.reads, guarded.reads > 0),
        Figure(FAULT, f"foreign writes ({name})", guarded.writes, guarded.writes > 0),
        Figure(
            FAULT,
            f"spool workspaces accepted ({name})",
            f"{guarded.accepted} of {guarded.exposures}",
            guarded.accepted > 0,
        ),
        Figure(
            FAULT,
            f"control, sandbox off: foreign read, write ({name})",
            f"{control.reads}, {control.writes}",
            not (control.reads and control.writes),
        ),
        Figure(
            FAULT,
            f"control, submit check bypassed: journal replaced ({name})",
            control.journal_replaced,
            control.journal_replaced == 0,
        ),
    ]


def attack(daemon: Daemon, *, bypass: bool = False) -> Outcome:
    mine, theirs = daemon.root / "mine", daemon.root / "theirs"
    with daemon.as_user():  # (the workspaces of the daemon's user, in its folder)
        for folder in (mine, theirs):
            folder.mkdir()
        (theirs / "secret").write_text(SECRET)
    try:
        daemon.start()
        daemon.submit([reply(text("Done."))], "victim", workspace=theirs)
        daemon.wait_state("victim", "done", timeout=WAIT)
        command = f"cat {theirs}/secret > loot; echo planted > {theirs}/planted; true"
        steal = [reply(tool_use("run_command", command=command)), reply(text("Done."))]
        daemon.submit(steal, "attacker", workspace=mine)
        daemon.wait_state("attacker", "done", "failed", timeout=WAIT)
        outcome = Outcome(
            reads=int((mine / "loot").exists() and SECRET in (mine / "loot").read_text()),
            writes=int((theirs / "planted").exists()),
        )
        spool = daemon.spool.root
        for exposing in (spool, daemon.task("victim").path, daemon.root):
            done = daemon.run_cli("submit", "--prompt", "x", "--workspace", str(exposing))
            outcome.exposures += 1
            outcome.accepted += int(done.returncode != 2)
        if bypass:
            journal = daemon.task("victim").journal
            path = str(journal.relative_to(spool))
            forge = [reply(tool_use("write_file", path=path, content=FORGED)), reply(text("x"))]
            with daemon.as_user():
                spec_task(daemon.spool, forge, id="exposed", workspace=str(spool))
                ring(daemon.spool, "exposed")
            daemon.wait_state("exposed", "done", "failed", timeout=WAIT)
            outcome.journal_replaced = int(journal.read_bytes() == FORGED.encode())
        return outcome
    finally:
        daemon.cleanup()
