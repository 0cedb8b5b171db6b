"""Spool tampering: fault class 14 of the campaign, against a real daemon.

A real daemon (``tests.daemon.Daemon``) with ``[tools] sandbox = "required"`` runs tasks
on the scripted model whose one ``run_command`` is an attack on the spool it lives in
(the default workspace is ``SPOOL/tasks/ID/workspace``, so ``..`` is the task's folder):
writes to its journal (appended, truncated, by absolute path, through a symlink, from a
``setsid`` child after the call), its ``state.json``, ``snapshot``, ``heartbeat.json``,
``events.jsonl`` and a forged decision file, another task's journal and the daemon's inbox;
reads of ``supervisor.json`` and of the config file; and signals: ``kill -9`` of the
daemon, of its process group and of another task's worker, ``kill -9 -1``, and a kill of
every pid in ``/proc``. Another task (the *neighbour*) runs a command all along.

An attack is *accepted* when any of these holds afterwards: its command reports that a
write succeeded; a marker it writes (assembled at run time, so the recorded command does
not hold it) is found in any spool file outside the workspaces; its task's journal is
damaged, torn, or holds other records than a harmless task's; ``agentd history`` of it
fails; its task did not end ``done``; the secret it read (the daemon's ``started_at``, a
canary in the config) is in its result; the daemon is not the same live process; the
neighbour's worker is not the same live process. Each attack's call must also have run
inside bwrap (the task's status row says ``sandbox: bwrap``).

The same attacks are also run with the sandbox off, as a control: each must be seen as
accepted there, or the checks above could not see a tampering that did happen. Two are
left out of it: the signals to every visible process (``kill -9 -1`` as root outside a
PID namespace would end every process on the machine, so those commands refuse to run
outside one), and the late write of a ``setsid`` child (whether that child outlives its
call without the sandbox is the escape class's question, not this one's).

Where bwrap is missing or cannot create namespaces the class reports "could not run" as
a violation: it never pretends to have attacked anything.
``python -m tests.chaos.tampering [--full]``; ``tests/test_campaigns.py`` runs quick.
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from supervisor.coordination import supervisor_info
from tests.chaos.supervision import within
from tests.daemon import Daemon, alive, config_text, subreaper
from tests.faults.report import Figure, campaign_main
from tests.support import processes_with, reply, text, tool_use
from worker.errors import AgentdError
from worker.store.journal import read_file
from worker.tools.sandbox import probe

FAULT = "14 spool tampering"
MARK = "TAMPERED"  # what the attacks write, assembled by the shell from the next line
WRITE = "\"$(printf 'TAMP%sRED' E)\""
TOKEN = "ACCEPTED"  # noqa: S105  (printed by an attack whose write succeeded)
SAY_TOKEN = "echo ACC$(printf EPTED)"  # noqa: S105  (prints TOKEN, which it does not hold)
CONFIG_CANARY = "config-canary-7d2a"
#: Signals are only ever sent from inside a sandbox's own PID namespace.
IN_SANDBOX = 'test "$(cat /proc/1/comm)" = bwrap || { echo not in a sandbox; exit 99; }; '
FINAL = ("done", "failed", "held", "cancelled")
LATE_MARK = "0.5147"  # the sleep of the setsid child, found by it
KILL_EVERY_PID = (  # but the shell itself
    'for p in /proc/[0-9]*; do [ "${{p#/proc/}}" = $$ ] || kill -9 "${{p#/proc/}}"; done'
)


@dataclass(frozen=True)
class Attack:
    """One tampering: a shell command (format fields: ``task``, ``neighbour``, ``config``,
    ``daemon``, ``victim``) and how it is judged: ``write`` (its command says whether the
    write succeeded, and the marker must not land), ``late`` (a write after the call ends),
    ``read`` (the secret must not be in its result) or ``signal``."""

    name: str
    command: str
    judge: str
    wide: bool = False  # a signal to every process it can see: never run outside a sandbox

    @property
    def bare_control(self) -> bool:
        return self.judge != "late" and not self.wide


def _write(name: str, command: str) -> Attack:
    return Attack(name, f"{command} && {SAY_TOKEN}", "write")


def _signal(name: str, command: str, *, wide: bool = False) -> Attack:
    return Attack(name, command, "signal", wide)


ATTACKS = (
    _write("journal append", f"printf '%s' {WRITE} >> ../journal"),
    _write("journal truncate", ": > ../journal"),
    _write("journal by absolute path", f"printf '%s' {WRITE} >> {{task}}/journal"),
    _write("journal through a symlink", f"ln -sf ../journal j && printf '%s' {WRITE} >> j"),
    _write("state.json", f'printf \'{{{{"state": "%s"}}}}\' {WRITE} > ../state.json'),
    _write("snapshot", f"printf '%s' {WRITE} > ../snapshot"),
    _write(
        "heartbeat.json",
        f'printf \'{{{{"pid": 1, "phase": "%s"}}}}\' {WRITE} > ../heartbeat.json',
    ),
    _write("events.jsonl", f'printf \'{{{{"event": "%s"}}}}\\n\' {WRITE} >> ../events.jsonl'),
    _write(
        "forged decision",
        f'mkdir -p ../decisions && printf \'{{{{"action": "rerun", "by": "%s"}}}}\' {WRITE}'
        " > ../decisions/forged.1.json",
    ),
    _write("another task's journal", f"printf '%s' {WRITE} >> ../../{{neighbour}}/journal"),
    _write("the daemon's inbox", f"printf '%s' {WRITE} > ../../../inbox/{{neighbour}}.1.1"),
    Attack(
        "journal from a setsid child after the call",
        f"setsid sh -c 'sleep {LATE_MARK}; printf TAMP%sRED E >> ../journal' "
        ">/dev/null 2>&1 </dev/null &",
        "late",
    ),
    Attack("read supervisor.json", "cat ../../../supervisor.json", "read"),
    Attack("read the config", "cat {config}", "read"),
    _signal("kill -9 the daemon", "kill -9 {daemon}"),
    _signal("kill -9 the daemon's group", "kill -9 -{daemon}"),
    _signal("kill -9 another task's worker", "kill -9 {victim}"),
    _signal("kill -9 -1", "kill -9 -1", wide=True),
    _signal("kill -9 every pid in /proc", KILL_EVERY_PID, wide=True),
)


def attack_script(command: str) -> list[dict[str, Any]]:
    """The attack, then an answer after a while (the heartbeat shows the call's sandbox)."""
    return [
        reply(text("Trying."), tool_use("run_command", command=command, timeout=20)),
        reply(text("Done."), delay=0.3),
    ]


def neighbour_script() -> list[dict[str, Any]]:
    """A command that runs until its workspace has a ``stop`` file."""
    wait = "while [ ! -e stop ]; do sleep 0.05; done; echo stopped"
    return [
        reply(tool_use("run_command", command=wait, timeout=300)),
        reply(text("Done.")),
    ]


@dataclass
class Tally:
    """What one campaign saw, by attack name."""

    tried: Counter[str] = field(default_factory=Counter)
    accepted: Counter[str] = field(default_factory=Counter)
    unsandboxed: Counter[str] = field(default_factory=Counter)
    why: list[str] = field(default_factory=list)
    daemon_lost: int = 0
    neighbour_lost: int = 0
    neighbour_done: bool = False


class Campaign:
    """One daemon, its neighbour task, and attacks run one at a time against it."""

    def __init__(self, root: Path, sandbox: str) -> None:
        self.daemon = Daemon(
            root,
            config_text(
                timeout=10.0,
                model_call=None,
                tool_call=None,
                backoff_max=1.0,
                crash_loop_limit=None,
                stop_grace=1.0,
                interval=0.1,
                sandbox=sandbox,
                tool_modules=(),
                extra=f"# {CONFIG_CANARY}\n",
            ),
        )
        self.sandboxed = sandbox != "off"
        self.tally = Tally()
        self.baseline: list[str] | None = None
        self.count = 0
        self.lost_daemon = False

    def __enter__(self) -> Campaign:
        self.daemon_pid = self.daemon.start(timeout=30).pid
        self.neighbour = self.daemon.submit(neighbour_script(), name="neighbour")
        row = self.daemon.wait_row(
            self.neighbour, lambda r: r["phase"] == "tool:run_command", 30, "its command"
        )
        self.victim, self.victim_alive = int(row["pid"]), True
        self.baseline = self.run_task("true")[1]
        return self

    def __exit__(self, *exc: object) -> None:
        self.daemon.cleanup()

    def run_task(self, command: str) -> tuple[str, list[str], dict[str, Any]]:
        """Run one attack task to its end: its id, record kinds, status row. A daemon that
        died meanwhile is counted and started again (it adopts the task's worker)."""
        self.count += 1
        task_id = self.daemon.submit(attack_script(command), name=f"a{self.count}")

        def ended(row: dict[str, Any]) -> bool:
            return row["state"] in FINAL

        row = self.daemon.wait_row(task_id, lambda r: ended(r) or not self._daemon_alive(), 30)
        if not self._daemon_alive():
            self.tally.daemon_lost += 1
            self.lost_daemon = True
            self.daemon_pid = self.daemon.start(timeout=30).pid
            row = self.daemon.wait_row(task_id, ended, 30, "its end")
        try:
            kinds = [str(r.get("k")) for r, _ in self._scan(task_id)]
        except (AgentdError, OSError) as exc:
            kinds = [f"unreadable: {exc}"]
        return task_id, kinds, row

    def _scan(self, task_id: str) -> list[tuple[dict[str, Any], int]]:
        found = read_file(self.daemon.task(task_id).journal)
        if found.torn:
            raise AgentdError(f"journal torn at byte {found.good_end}")
        return found.records

    def attack(self, attack: Attack) -> None:
        tally = self.tally
        tally.tried[attack.name] += 1
        secrets = {
            "read supervisor.json": str(self.daemon_info().get("started_at")),
            "read the config": CONFIG_CANARY,
        }
        command = attack.command.format(
            task=self.daemon.task(f"a{self.count + 1}").path,
            neighbour=self.neighbour,
            config=self.daemon.config_path,
            daemon=self.daemon_pid,
            victim=self.victim,
        )
        if attack.wide:
            command = IN_SANDBOX + command
        self.lost_daemon = False
        try:
            task_id, kinds, row = self.run_task(command)
        except AssertionError as exc:  # it never ended
            self._accept(attack, [f"its task did not end ({exc})"])
            return
        result = self._result(task_id)
        if attack.judge == "late":  # the child sleeps, then writes: wait until it is gone
            within(lambda: not processes_with(LATE_MARK), 5.0)
        reasons = []
        if attack.judge == "write" and TOKEN in result:
            reasons.append("the write succeeded")
        if attack.judge == "read" and secrets[attack.name] in result:
            reasons.append("the secret was read")
        if kinds != self.baseline:
            reasons.append(f"its records are {kinds}, not {self.baseline}")
        if row["state"] != "done":
            reasons.append(f"its task ended {row['state']} ({row['reason']})")
        code, _, err = self.daemon.cli("history", task_id)
        if code != 0:
            reasons.append(f"agentd history fails: {err.strip()[:120]}")
        if marked := self._marked_files():
            reasons.append(f"{MARK} is in {marked[:3]}")
        if self.lost_daemon:
            reasons.append("the daemon died")
        if self.victim_alive and not alive(self.victim):
            reasons.append("the other task's worker died")
            self.tally.neighbour_lost += 1
            self.victim_alive = False  # (the neighbour is held now: its command was cut off)
        if self.sandboxed and (row.get("sandbox") != "bwrap" or "not in a sandbox" in result):
            self.tally.unsandboxed[attack.name] += 1
            self.tally.why.append(f"{attack.name}: sandbox {row.get('sandbox')!r}")
        self._accept(attack, reasons)

    def _accept(self, attack: Attack, reasons: list[str]) -> None:
        self.tally.why += [f"{attack.name}: {reason}" for reason in reasons]
        if reasons:
            self.tally.accepted[attack.name] += 1

    def _result(self, task_id: str) -> str:
        with contextlib.suppress(AgentdError, OSError):
            for record, _ in self._scan(task_id):
                if record.get("k") == "result":
                    return str(record.get("content"))
        return ""

    def _marked_files(self) -> list[str]:
        """Spool files outside the workspaces that hold the marker."""
        found = []
        for path in self.daemon.spool.root.rglob("*"):
            if "workspace" in path.relative_to(self.daemon.spool.root).parts:
                continue
            with contextlib.suppress(OSError):
                if path.is_file() and not path.is_symlink() and MARK.encode() in path.read_bytes():
                    found.append(str(path.relative_to(self.daemon.spool.root)))
        return found

    def daemon_info(self) -> dict[str, Any]:
        return supervisor_info(self.daemon.spool) or {}

    def _daemon_alive(self) -> bool:
        proc = self.daemon.proc
        return proc is not None and proc.poll() is None and proc.pid == self.daemon_pid

    def finish(self) -> None:
        """Let the neighbour end, and see that it ended well."""
        (self.daemon.task(self.neighbour).path / "workspace" / "stop").touch()
        with contextlib.suppress(AssertionError):
            row = self.daemon.wait_state(self.neighbour, *FINAL, timeout=30)
            self.tally.neighbour_done = row["state"] == "done" and row["restarts"] == 0


def campaign(root: Path, sandbox: str, attacks: tuple[Attack, ...], rounds: int) -> Tally:
    with Campaign(root, sandbox) as run:
        for _ in range(rounds):
            for attack in attacks:
                run.attack(attack)
        run.finish()
    return run.tally


def zero(name: str, value: int) -> Figure:
    """A count that must be 0."""
    return Figure(FAULT, name, value, value > 0)


def run(quick: bool) -> list[Figure]:
    problem = probe("bwrap", True).problem
    if problem is not None:
        return [Figure(FAULT, "could not run", f"no working bwrap: {problem}", True)]
    rounds = 1 if quick else 5
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="agentd-tampering-") as folder, subreaper():
        boxed = campaign(Path(folder) / "boxed", "required", ATTACKS, rounds)
        controls = tuple(a for a in ATTACKS if a.bare_control)
        bare = campaign(Path(folder) / "bare", "off", controls, 1)
    for line in boxed.why:
        print(f"tampering: under the sandbox: {line}", file=sys.stderr, flush=True)
    figures = [zero(f"accepted: {a.name}", boxed.accepted[a.name]) for a in ATTACKS]
    missed = [a.name for a in controls if not bare.accepted[a.name]]
    figures += [
        Figure(FAULT, "tamperings tried under the sandbox", sum(boxed.tried.values())),
        zero("tamperings accepted", sum(boxed.accepted.values())),
        zero("calls not run in bwrap", sum(boxed.unsandboxed.values())),
        zero("daemon deaths", boxed.daemon_lost),
        zero("other task's worker deaths", boxed.neighbour_lost),
        Figure(
            FAULT,
            "other task ended done, never restarted",
            str(boxed.neighbour_done),
            not boxed.neighbour_done,
        ),
        Figure(
            FAULT,
            "control, sandbox off: attacks seen accepted",
            f"{len(controls) - len(missed)} of {len(controls)}",
            bool(missed),
        ),
        Figure(FAULT, "runtime s", time.monotonic() - started),
    ]
    if missed:
        figures.append(Figure(FAULT, "control attacks the checks missed", ", ".join(missed), True))
    return figures


def main(argv: list[str] | None = None) -> int:
    return campaign_main(run, "python -m tests.chaos.tampering", __doc__ or "", argv, seeded=False)


if __name__ == "__main__":
    sys.exit(main())
