"""Escape chaos, fault class 12: no process a tool starts outlives its worker.

A ``run_command`` starts a background loop that appends a line to a file of its workspace
every 0.2 s, and leaves its worker's reach in one of four ways (``ESCAPES``): ``setsid``
(a new session, out of the worker's process group), a double fork (its parent exits at
once: an orphan), ``nohup ... &``, and a loop that ignores SIGTERM. Then its worker ends
in one of four ways (``ENDS``): the task ends ``done``; the worker is killed with
SIGKILL while the command still runs (the restart holds the unsafe call); ``agentd
cancel``; ``agentd stop``. That is the matrix of docs/design.md section 5: every cell must
leave no process of the loop alive one second after the end.

Each loop names itself (``$0`` of its shell is a token of its cell) and writes its pid
to a file. One second after the end (``JUDGE_AFTER``), a cell's loop counts as alive
when a live process carries the token in its command line (whatever pid namespace it
sees itself in), when the pid in its file is a live process with that command line, or
when its file still grows over ``GROWTH_WINDOW`` more (the loop appends every 0.2 s).
The figures also say how long each loop took to die (polled every 10 ms from the end),
and how many loops had in fact left their worker's process group (``setsid``) before
the end: a loop that never escaped proves nothing.

The four cells of a column run at once, on one daemon (``tests.daemon.Daemon``, its
workers forked by its fork server): task end, then kill -9, then cancel, then stop.
Quick mode runs each cell once, the end coming as soon as every loop runs. Full mode
runs ``ROUNDS`` rounds with random timing: a random wait before the end, and for
cancel and stop a random choice between ending during the command (it sleeps after
starting the loop) and during the model call after it.

``setting`` says where ``run_command`` runs (``Setting``): the config lines of its
``[tools]`` table and a name for the figures; ``BARE`` runs it with the sandbox off.

``python -m tests.chaos.escape [--full] [--seed N]`` prints the table and exits 1 on a
violation; ``tests/test_campaigns.py`` runs the quick mode in ``make test``.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from tests.daemon import Daemon, config_text, subreaper
from tests.faults.report import Figure, campaign_main
from tests.support import reply, text, tool_use

FAULT = "12 escape"
JUDGE_AFTER = 1.0  # seconds after the end when no loop may be alive
GROWTH_WINDOW = 0.5  # seconds the loop's file must not grow after that (it appends every 0.2)
ROUNDS = 5  # full mode
PID_FILE, OUT_FILE = "escapee.pid", "escapee.out"
LONG = 30  # seconds: a command or model call that only an end cuts short
FINAL = ("done", "failed")


@dataclass(frozen=True)
class Setting:
    """Where ``run_command`` runs: ``tools`` is the body of the config's ``[tools]``
    table (what turns a sandbox on or off), ``name`` labels the figures."""

    name: str = "bare"
    tools: str = 'sandbox = "off"\n'


#: No sandbox: what the worker's and the daemon's sweeps must catch by themselves. (Under
#: the sandbox a call's PID namespace ends with it: tests/worker/test_sandbox.py and class
#: 14's "setsid child after the call" cover that.)
BARE = Setting()


def loop_command(token: str, *, ignore_term: bool = False) -> str:
    """A shell that writes its pid, then appends a line every 0.2 s for ever; ``$0`` (its
    command line) is ``token``."""
    trap = 'trap "" TERM; ' if ignore_term else ""
    body = f"{trap}echo $$ > {PID_FILE}; while :; do echo s >> {OUT_FILE}; sleep 0.2; done"
    return f"sh -c '{body}' {token}"


QUIET = ">/dev/null 2>&1 </dev/null"

#: How a tool's process gets out of its worker's reach: a shell line around the loop.
ESCAPES: dict[str, Callable[[str], str]] = {
    "setsid": lambda token: f"setsid {loop_command(token)} {QUIET} &",
    "double fork": lambda token: f"( {loop_command(token)} {QUIET} & )",
    "nohup": lambda token: f"nohup {loop_command(token)} {QUIET} &",
    "TERM ignored": lambda token: f"{loop_command(token, ignore_term=True)} {QUIET} &",
}
ENDS = ("task end", "worker kill -9", "cancel", "agentd stop")


@dataclass
class Cell:
    escape: str
    end: str
    task_id: str
    token: str
    in_command: bool  # the end comes while the command still runs (else in a model call)
    workspace: Path = Path()
    ended_at: float = 0.0  # monotonic
    died_after: float | None = None  # seconds from the end until no loop process was seen
    escaped_group: bool = False  # the loop was outside its worker's process group
    alive: int = 0  # loop processes alive at the judgement (1 for a file still growing)
    note: str = ""


@dataclass
class Tally:
    cells: list[Cell] = field(default_factory=list)
    not_run: int = 0  # cells whose loop never ran, or whose end could not be brought
    held_after_kill: int = 0


def say(message: str) -> None:
    print(f"escape: {message}", file=sys.stderr, flush=True)


def script(launch: str, pause: float, *, ends_itself: bool) -> list[dict[str, Any]]:
    """The cell's task: the command that starts the loop (and sleeps ``pause`` more),
    then, unless the task ``ends_itself``, a model call that only an end cuts short."""
    command = f"{launch}\nsleep {pause:g}" if pause else launch  # (not "&;": sh refuses it)
    first = reply(tool_use("run_command", command=command, timeout=LONG * 2))
    if ends_itself:
        return [first, reply(text("Done."))]
    return [first, reply(text("Thinking."), delay=LONG), reply(text("Done."))]


# -- looking at a loop ---------------------------------------------------------------------


def recorded_pid(cell: Cell) -> int | None:
    with contextlib.suppress(OSError, ValueError, IndexError):
        return int((cell.workspace / PID_FILE).read_text().split()[0])
    return None


def loop_pids(cells: list[Cell]) -> dict[str, set[int]]:
    """The live processes (no zombies) of each cell's loop, by token: those whose command
    line carries it, and the pid of its file if that process carries it (one scan)."""
    found: dict[str, set[int]] = {c.token: set() for c in cells}
    for proc in psutil.process_iter(["cmdline", "status"]):
        if proc.info["status"] in (None, psutil.STATUS_ZOMBIE):
            continue
        for arg in proc.info["cmdline"] or ():
            if arg in found:
                found[arg].add(proc.pid)
    for cell in cells:
        pid = recorded_pid(cell)
        if pid is None:  # (psutil.Process(None) would be this process)
            continue
        with contextlib.suppress(psutil.Error):
            proc = psutil.Process(pid)
            if proc.status() != psutil.STATUS_ZOMBIE and cell.token in proc.cmdline():
                found[cell.token].add(proc.pid)
    return found


def out_size(cell: Cell) -> int:
    try:
        return (cell.workspace / OUT_FILE).stat().st_size
    except FileNotFoundError:
        return 0


def running(cell: Cell) -> bool:
    """The loop has written its pid and appended twice at least."""
    return recorded_pid(cell) is not None and out_size(cell) >= 4


def left_group(daemon: Daemon, cell: Cell) -> bool:
    """Whether the loop runs outside its worker's process group (what ``setsid`` does)."""
    worker, pid = daemon.row(cell.task_id)["pid"], recorded_pid(cell)
    try:
        return bool(worker and pid and os.getpgid(pid) != worker)
    except OSError:
        return False


def each(
    cells: list[Cell],
    ready: Callable[[Cell], object],
    timeout: float,
    on_ready: Callable[[Cell], None],
) -> list[Cell]:
    """Poll every cell at once until ``ready``, calling ``on_ready`` the moment it is;
    the cells that were ready within ``timeout``."""
    pending, done = list(cells), []
    deadline = time.monotonic() + timeout
    while pending and time.monotonic() < deadline:
        for cell in list(pending):
            if ready(cell):
                on_ready(cell)
                pending.remove(cell)
                done.append(cell)
        time.sleep(0.01)
    return done


# -- one column ----------------------------------------------------------------------------


def submit(daemon: Daemon, end: str, rng: random.Random, quick: bool, serial: int) -> list[Cell]:
    cells = []
    for escape, launch in ESCAPES.items():
        in_command = end == "worker kill -9" or (
            end in ("cancel", "agentd stop") and not quick and rng.random() < 0.5
        )
        # A task that ends by itself runs its command long enough for the loop to be seen.
        pause = LONG if in_command else 1.0 if end == "task end" else 0.0
        if end == "task end" and not quick:
            pause = rng.uniform(0.6, 1.5)
        slug = f"{end}-{escape}".replace(" ", "-").lower()
        token = f"agentd-escapee-{serial}-{slug}"
        responses = script(launch(token), pause, ends_itself=end == "task end")
        task_id = daemon.submit(responses, name=f"{serial}-{slug}")
        cell = Cell(escape, end, task_id, token, in_command)
        cell.workspace = daemon.task(task_id).path / "workspace"
        cells.append(cell)
    return cells


def bring_to_end(daemon: Daemon, cells: list[Cell], rng: random.Random, quick: bool) -> list[Cell]:
    """Wait until each loop runs (and, but for a task end, until its worker waits where
    the end is to come), then end the column's workers; the cells that got that far."""

    def noted(cell: Cell) -> None:
        cell.escaped_group = left_group(daemon, cell)

    started = each(cells, running, 20, noted)
    end = cells[0].end
    if end == "task end":  # the tasks end one by one: each death is timed from its own end

        def ended(cell: Cell) -> None:
            cell.ended_at = time.monotonic()
            if not loop_pids([cell])[cell.token]:
                cell.died_after = 0.0  # dead by the time its task was seen done

        return each(started, lambda c: daemon.row(c.task_id)["state"] in FINAL, 20, ended)

    def waiting(cell: Cell) -> bool:
        phase = "tool:run_command" if cell.in_command else "model"
        return bool(daemon.row(cell.task_id)["phase"] == phase)

    started = each(started, waiting, 20, lambda c: None)
    if not quick:
        time.sleep(rng.uniform(0.0, 1.0))  # random timing: a random instant of the wait
    if end == "agentd stop":
        daemon.stop()
        for cell in started:
            cell.ended_at = time.monotonic()
        return started
    for cell in rng.sample(started, len(started)):
        if end == "worker kill -9":
            with contextlib.suppress(ProcessLookupError, TypeError):
                os.kill(daemon.row(cell.task_id)["pid"], signal.SIGKILL)
        else:
            code, _, err = daemon.cli("cancel", cell.task_id)
            if code != 0:
                cell.note = f" (cancel: {err.strip()})"
        cell.ended_at = time.monotonic()
    return started


def judge(cells: list[Cell]) -> None:
    """Time each loop's death from its end (a scan of every process every 10 ms or so),
    count the loop's processes alive at the first scan ``JUDGE_AFTER`` after its end
    (never before), then whether its file still grows."""
    unjudged = list(cells)
    while unjudged:
        now = time.monotonic()
        found = loop_pids(cells)
        for cell in cells:
            if cell.died_after is None and not found[cell.token]:
                cell.died_after = now - cell.ended_at
        for cell in list(unjudged):
            if now >= cell.ended_at + JUDGE_AFTER:
                cell.alive = len(found[cell.token])
                unjudged.remove(cell)
        time.sleep(0.01)
    sizes = {c.token: out_size(c) for c in cells}
    time.sleep(GROWTH_WINDOW)  # a loop appends every 0.2 s: a live one grows meanwhile
    for cell in cells:
        if not cell.alive and out_size(cell) != sizes[cell.token]:
            cell.alive = 1
            cell.note += " (its file still grows)"


def column(
    daemon: Daemon, end: str, tally: Tally, rng: random.Random, quick: bool, serial: int
) -> None:
    say(f"round {serial}: {end}")
    cells = submit(daemon, end, rng, quick, serial)
    started = bring_to_end(daemon, cells, rng, quick)
    tally.not_run += len(cells) - len(started)
    for cell in cells:
        if cell not in started:
            say(f"{cell.escape} / {end}: could not be run; row {daemon.row(cell.task_id)}")
    if not started:
        return
    judge(started)
    tally.cells += started
    if end == "worker kill -9":
        held = each(started, lambda c: daemon.row(c.task_id)["state"] == "held", 15, lambda c: None)
        tally.held_after_kill += len(held)


# -- the campaign --------------------------------------------------------------------------


def figures_of(tally: Tally, setting: Setting) -> list[Figure]:
    fault = f"{FAULT} ({setting.name})"
    cells = tally.cells
    figures = [
        Figure(fault, "cells run (escape x end)", len(cells)),
        Figure(fault, "cells that could not be run", tally.not_run, tally.not_run > 0),
        Figure(
            fault,
            "loops outside their worker's process group",
            sum(c.escaped_group for c in cells),
        ),
    ]
    for end in ENDS:
        mine = [c for c in cells if c.end == end]
        alive = sum(c.alive for c in mine)
        figures.append(
            Figure(fault, f"processes alive 1 s after {end}", alive, alive > 0 or not mine)
        )
        deaths = [c.died_after for c in mine if c.died_after is not None]
        if deaths:
            figures.append(Figure(fault, f"slowest death after {end}, s", round(max(deaths), 3)))
    kills = sum(1 for c in cells if c.end == "worker kill -9")
    figures.append(
        Figure(
            fault,
            "tasks held after the kill -9 (of their unsafe call)",
            f"{tally.held_after_kill}/{kills}",
        )
    )
    bad = [f"{c.escape} / {c.end}: {c.alive} alive{c.note}" for c in cells if c.alive or c.note]
    if bad:
        figures.append(Figure(fault, "cells with survivors", "; ".join(bad)))
    return figures


def campaign(root: Path, quick: bool, rng: random.Random, setting: Setting) -> Tally:
    tally = Tally()
    rounds = 1 if quick else ROUNDS
    daemon = Daemon(
        root,
        config_text(
            max_workers=16,
            timeout=5.0,
            model_call=LONG * 2,
            tool_call=LONG * 2,
            crash_loop_limit=None,
            sandbox=None,
            tool_modules=(),
            tools=f"{setting.tools}\n",
        ),
    )
    try:
        for serial in range(rounds):
            daemon.start()
            for end in ENDS:  # agentd stop last: it ends the daemon
                column(daemon, end, tally, rng, quick, serial)
    finally:
        daemon.cleanup()
    return tally


def run(quick: bool, *, seed: int | None = None, setting: Setting = BARE) -> list[Figure]:
    """The matrix (quick: each cell once; full: ``ROUNDS`` rounds, random timing)."""
    seed = random.randrange(1 << 30) if seed is None else seed
    rng = random.Random(seed)
    figures = [Figure(f"{FAULT} ({setting.name})", "seed (--seed replays the choices)", str(seed))]
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="agentd-escape-") as folder, subreaper():
        try:
            figures += figures_of(campaign(Path(folder), quick, rng, setting), setting)
        except Exception as exc:
            traceback.print_exc()
            figures.append(Figure(FAULT, "could not run", f"{type(exc).__name__}: {exc}", True))
    figures.append(Figure(f"{FAULT} ({setting.name})", "runtime s", time.monotonic() - started))
    return figures


def main(argv: list[str] | None = None) -> int:
    return campaign_main(run, "python -m tests.chaos.escape", __doc__ or "", argv)


if __name__ == "__main__":
    sys.exit(main())
