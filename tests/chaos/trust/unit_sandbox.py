"""Trust attack: a tool goes for the journals and the worker of other tasks.

A neighbour task runs a long ``run_command`` (it waits for a file of its workspace).
Meanwhile an attacker task's ``run_command`` tries, knowing the spool's path, the
neighbour's ids and its worker's pid:

* to append to its own task's journal (``$PWD/../journal``) and to the neighbour's;
* to kill -9 the neighbour's worker;
* to write a file outside its workspace, in the spool and in the daemon's folder.

Then the neighbour is let go. Figures (each must be 0): foreign writes (journals that
got the attacker's bytes), escapes (the kill, a file made outside the workspace), tasks
failed by a neighbour (the neighbour not ``done``, or restarted); and the attacker's
status row must say ``bwrap``. The defended run uses ``sandbox = "required"`` (what
``agentd init --system`` writes) on the host; under the emulated unit that is the unit
``agentd unit`` prints now.

The control removes the defence and must see the attack work (a journal written and
the neighbour's worker killed): on the bwrap host ``sandbox = "off"``; under the unit
host, the unit as it shipped before (``RestrictNamespaces=yes`` and the rest, see
``tests.unitjail.old_unit``) with the default ``sandbox = "auto"``, where bwrap cannot
start and every command ran bare without a word.
"""

from __future__ import annotations

import contextlib
import shlex
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from tests.chaos.trust import FAULT, Host
from tests.daemon import Daemon, subreaper
from tests.faults.report import Figure
from tests.support import reply, text, tool_use
from tests.unitdaemon import UnitDaemon, unit_text
from tests.unitjail import old_unit

NAME = "unit sandbox"
FINAL = ("done", "failed", "held", "cancelled")
REQUIRED = '[heartbeat]\ninterval = 0.2\n[tools]\nsandbox = "required"\n'
WAIT = 60.0  # seconds: any one step, on a loaded machine


@dataclass
class Outcome:
    """What one attack did."""

    foreign_writes: int = 0  # journals that hold the attacker's mark
    escapes: int = 0  # the neighbour's worker killed, files made outside the workspace
    neighbours_failed: int = 0  # the neighbour not done, or restarted
    sandbox: str = ""  # the attacker's status row
    killed: bool = False
    ran: bool = False  # the attacker's command ran (its result is recorded)


def attack(daemon: Daemon, token: str) -> Outcome:
    """One attacker against one neighbour on ``daemon`` (started here, stopped after)."""
    neighbour, attacker = f"n-{token}", f"a-{token}"
    wait_stop = "i=0; while [ ! -e stop ] && [ $i -lt 1200 ]; do sleep 0.1; i=$((i+1)); done"
    daemon.start(timeout=WAIT)
    daemon.submit(
        [reply(tool_use("run_command", command=wait_stop, timeout=WAIT * 2)), reply(text("ok"))],
        name=neighbour,
    )
    row = daemon.wait_row(
        neighbour, lambda r: r["phase"] == "tool:run_command" and r["pid"], WAIT, "its command"
    )
    victim = psutil.Process(row["pid"])
    spool, mark = daemon.spool.root, f"PWNED-{token}"
    outside = [spool / f"escaped-{token}", daemon.root / f"escaped-{token}"]
    written = f"printf %s%s PWNED- {token}"  # (the mark, not in the command's own text)
    steps = {
        "own": f'{written} >> "$PWD/../journal"',
        "neighbour": f"{written} >> {shlex.quote(str(spool / 'tasks' / neighbour / 'journal'))}",
        "kill": f"kill -9 {victim.pid}",
        **{f"file{i}": f"{written} > {shlex.quote(str(p))}" for i, p in enumerate(outside)},
    }
    # (each success says did-WHAT: words its command's own text does not hold)
    command = "; ".join(f"{step} && printf '%s-%s\\n' did {what}" for what, step in steps.items())
    command += "; printf '%s-%s\\n' did end"
    daemon.submit([reply(tool_use("run_command", command=command)), reply(text("ok"))], attacker)
    attacked = daemon.wait_state(attacker, *FINAL, timeout=WAIT)
    out = Outcome(sandbox=str(attacked.get("sandbox")))
    out.killed = not _alive(victim)
    # What the tool said it did (its result, in the journal's bytes: the attack may have
    # damaged it), and below what it left: a killed neighbour's next worker cuts the torn
    # tail of its journal.
    said = daemon.task(attacker).journal.read_bytes().decode(errors="replace")
    out.ran = "did-end" in said
    with daemon.as_user():
        (daemon.task(neighbour).path / "workspace" / "stop").touch()
    with contextlib.suppress(AssertionError):  # (the control's neighbour may stay held)
        daemon.wait_state(neighbour, *FINAL, timeout=WAIT)
    ended = daemon.row(neighbour)
    daemon.stop()
    out.foreign_writes = sum(
        f"did-{who}" in said or mark.encode() in daemon.task(task).journal.read_bytes()
        for who, task in (("own", attacker), ("neighbour", neighbour))
    )
    out.escapes = int(out.killed) + sum(path.exists() for path in outside)
    out.neighbours_failed = int(ended["state"] != "done" or int(ended["restarts"]) > 0)
    return out


def _alive(process: psutil.Process) -> bool:
    with contextlib.suppress(psutil.Error):
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    return False


def control_daemon(host: Host, root: Path) -> Daemon:
    """The host with the defence removed: the old unit under ``auto``, or bwrap off."""
    if host.name == "unit":
        return UnitDaemon(root, "[heartbeat]\ninterval = 0.2\n", unit=old_unit(unit_text()))
    return host.daemon(root, '[heartbeat]\ninterval = 0.2\n[tools]\nsandbox = "off"\n')


def run(quick: bool, host: Host) -> list[Figure]:
    rounds = 1 if quick else 3
    started = time.monotonic()
    defended: list[Outcome] = []
    with tempfile.TemporaryDirectory(prefix="agentd-unit-sandbox-") as folder, subreaper():
        made: list[Daemon] = []
        try:
            for i in range(rounds):
                made.append(host.daemon(Path(folder) / f"defended-{i}", REQUIRED))
                defended.append(attack(made[-1], f"d{i}"))
            made.append(control_daemon(host, Path(folder) / "control"))
            control = attack(made[-1], "c")
        finally:
            for daemon in made:
                daemon.cleanup()
    where = f"{NAME} ({host.name})"
    rows = [o.sandbox for o in defended]
    figures = [
        zero(f"{where}: foreign writes", sum(o.foreign_writes for o in defended)),
        zero(f"{where}: escapes", sum(o.escapes for o in defended)),
        zero(f"{where}: tasks failed by a neighbour", sum(o.neighbours_failed for o in defended)),
        Figure(FAULT, f"{where}: attacker's status row", ", ".join(sorted(set(rows))),
               any(r != "bwrap" for r in rows)),
        Figure(FAULT, f"{where}: attacks whose command ran", f"{sum(o.ran for o in defended)} "
               f"of {rounds}", not all(o.ran for o in defended)),
    ]  # fmt: skip
    seen = control.foreign_writes > 0 and control.killed
    said = (
        f"foreign writes {control.foreign_writes}, worker killed {control.killed}, "
        f"neighbours failed {control.neighbours_failed}, row "
    )
    figures += [
        Figure(FAULT, f"{where}: control, defence removed: attack seen working",
               said + control.sandbox.split(" (")[0], not seen),
        Figure(FAULT, f"{where}: runtime s", time.monotonic() - started),
    ]  # fmt: skip
    return figures


def zero(name: str, value: int) -> Figure:
    """A count that must be 0."""
    return Figure(FAULT, name, value, value > 0)
