"""Trust attack: a folder of a shared workspace swapped for a symlink while the file tools
use it (issue 20, finding 4).

Two tasks share a workspace. The attacker's tool (here a real process of the daemon's
user, the racer) swaps the folder ``d/`` of the workspace with a symlink to a folder
outside it, over and over, with ``renameat2(RENAME_EXCHANGE)``: the name ``d`` always
exists, a folder one instant and a link out the next. Meanwhile the victim's file tools
are called on ``d/...``, each try one call:

* ``read_file("d/secret.txt")``: a win is a result holding the secret of the file
  outside (the daemon user's ``~/.pgpass`` in the finding);
* ``write_file("d/journal", ...)``: a win is the file outside (a finished task's journal
  in the spool, in the finding) no longer holding its bytes.

The tools run as the worker runs them, through a ``ToolContext`` whose workspace root the
worker opened once, in a process where the ``Host``'s workers run (``race_in_host``), and
every resolution ``Root`` has there is raced: on the bwrap host, the kernel's
(``openat2`` with ``RESOLVE_BENEATH``) and the walk of the kernels without it; under the
emulated unit, as its user under its seccomp filters, where ``openat2`` is ENOSYS (as
``RestrictSUIDSGID=`` makes it), the walk alone, which is then what the daemon's workers
there use too: the figure of resolutions says which ran, and under the unit it must be
the walk. Every win is a violation.

The control races the same calls, in the same process, through a copy of the old tools
(``old_read_file``, ``old_write_file``: the path checked by ``realpath``, then opened by
name), which must be seen to lose at least once each; it tries until then, up to
``CONTROL_BUDGET`` seconds.

The same race is also run end to end, on a real daemon of the ``Host``
(``through_daemon``): the racer is a ``run_command`` of an attacker task, which plants the
symlink itself, in the sandbox of that host; the victim is another task on the same
``--workspace``, whose scripted model asks for the calls, run by its worker. Its reads aim
at a ``.pgpass`` of a home folder outside, its writes at the journal of a finished task
in the spool; that journal must keep its bytes. Everything lives in the daemon's folder
and belongs to its user (under the unit, nothing else is in its reach).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.chaos.trust import FAULT, Host
from tests.daemon import Daemon, subreaper
from tests.faults.report import Figure
from tests.support import (
    REPO,
    journal_records,
    of_kind,
    poll_for,
    reply,
    text,
    tool_use,
    worker_env,
)
from worker.store.durable import atomic_write
from worker.tools.beneath import HAVE_OPENAT2, Root, _openat2
from worker.tools.builtin import read_file, write_file
from worker.tools.tool import ToolContext, ToolError

SECRET = "*:5432:*:agentd:pgpass-canary-7f3a9c"  # noqa: S105  (a canary, not a password)
JOURNAL = b"a finished task's journal\n"
TRIES = {True: 1000, False: 20000}  # per tool and resolution: quick, full
DAEMON_TRIES = {True: 400, False: 2000}  # per tool, through a daemon
CONFIG = (
    "max_workers = 8\n"
    "[heartbeat]\ninterval = 0.2\ntimeout = 5.0\n"
    "[deadlines]\ntool_call = 600\n"
    '[tools]\nsandbox = "required"\n'
)
CONTROL_BUDGET = 30.0  # seconds the control may take to see each attack win

# The racer: swaps the names ``d`` and ``.swap`` (a folder, a symlink out) until killed.
RACER = textwrap.dedent(
    """
    import ctypes, os, sys
    libc = ctypes.CDLL(None, use_errno=True)
    a, b = os.fsencode(sys.argv[1]), os.fsencode(sys.argv[2])
    swap = lambda: libc.renameat2(-100, a, -100, b, 2)  # AT_FDCWD, RENAME_EXCHANGE
    if swap() != 0:
        sys.exit(f"renameat2: {os.strerror(ctypes.get_errno())}")
    print("ready", flush=True)
    while True:
        swap()
    """
)


@dataclass
class Scene:
    """The shared workspace, the files outside it, and the racer swapping the two."""

    workspace: Path
    outside: Path
    racer: subprocess.Popen[str]

    @property
    def journal(self) -> Path:
        return self.outside / "journal"

    def close(self) -> None:
        self.racer.kill()
        self.racer.wait()
        if self.racer.stdout is not None:
            self.racer.stdout.close()


def scene(root: Path) -> Scene:
    workspace, outside = root / "workspace", root / "outside"
    (workspace / "d").mkdir(parents=True)
    outside.mkdir()
    (workspace / "d" / "secret.txt").write_text("nothing to see")
    (workspace / "d" / "journal").write_bytes(b"the shared workspace's own file\n")
    (outside / "secret.txt").write_text(SECRET)
    (outside / "journal").write_bytes(JOURNAL)
    (workspace / ".swap").symlink_to(outside)
    racer = subprocess.Popen(
        [sys.executable, "-c", RACER, str(workspace / "d"), str(workspace / ".swap")],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert racer.stdout is not None
    started = Scene(workspace, outside, racer)
    if racer.stdout.readline().strip() != "ready":
        started.close()
        raise RuntimeError(f"the racer did not start (exit {racer.returncode})")
    return started


# -- the tools before the fix, kept as the control -----------------------------------


def _old_confine(workspace: Path, user_path: str) -> Path:
    root = os.path.realpath(workspace)
    target = os.path.realpath(os.path.join(root, user_path))
    if target != root and not target.startswith(root + os.sep):
        raise ToolError(f"path {user_path!r} escapes the workspace")
    return Path(target)


def old_read_file(workspace: Path, path: str) -> str:
    target = _old_confine(workspace, path)
    with open(target, "rb") as f:
        return f.read().decode()


def old_write_file(workspace: Path, path: str, content: str) -> None:
    target = _old_confine(workspace, path)
    target.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(_old_confine(workspace, path), content.encode())


# -- the race -------------------------------------------------------------------------

Attempt = Callable[[Scene, int], bool]  # one try: True when the attack won it


def reads(call: Callable[[Path, str], str]) -> Attempt:
    def attempt(scene: Scene, n: int) -> bool:
        try:
            return SECRET in call(scene.workspace, "d/secret.txt")
        except Exception:  # refused, or lost in the swap: not a win
            return False

    return attempt


def writes(call: Callable[[Path, str, str], object]) -> Attempt:
    def attempt(scene: Scene, n: int) -> bool:
        with contextlib.suppress(Exception):  # refused, or lost in the swap: not a win
            call(scene.workspace, "d/journal", f"written by try {n}\n")
        if scene.journal.read_bytes() == JOURNAL:
            return False
        scene.journal.write_bytes(JOURNAL)  # put it back for the next try
        return True

    return attempt


def tools(*, openat2: bool) -> tuple[Attempt, Attempt]:
    """read_file and write_file as the worker runs them: one ToolContext a try, the
    workspace root opened once (``openat2`` False forces the walk)."""
    roots: dict[Path, Root] = {}

    def ctx(workspace: Path) -> ToolContext:
        root = roots.setdefault(workspace, Root(workspace, openat2=openat2))
        return ToolContext(workspace, "victim", "toolu_1", "key", 30.0, root=root)

    def read(workspace: Path, path: str) -> str:
        return read_file.run(ctx(workspace), {"path": path})

    def write(workspace: Path, path: str, content: str) -> str:
        return write_file.run(ctx(workspace), {"path": path, "content": content})

    return reads(read), writes(write)


@dataclass(frozen=True)
class Tally:
    wins: int
    tries: int


def race(root: Path, attempt: Attempt, tries: int, *, until_win: float | None = None) -> Tally:
    """``attempt`` tried ``tries`` times against the racer; with ``until_win``, on past
    ``tries`` until a first win or that many seconds."""
    s = scene(root)
    wins, n, started = 0, 0, time.monotonic()
    try:
        while n < tries or (until_win is not None and not wins):
            if until_win is not None and n >= tries and time.monotonic() - started > until_win:
                break
            wins += attempt(s, n)
            n += 1
    finally:
        s.close()
    return Tally(wins, n)


# -- the race where the host's workers run --------------------------------------------


def resolutions() -> list[tuple[str, bool]]:
    """The resolutions ``Root`` has in this process: the kernel's and the walk, or the
    walk alone where ``openat2`` is refused (ENOSYS under the unit's filter)."""
    return [("openat2", True), ("walk", False)] if HAVE_OPENAT2 else [("walk", False)]


def openat2_refused() -> str:
    """Why ``openat2`` is not used in this process (its errno), or ``""``."""
    try:
        os.close(_openat2(-100, ".", os.O_PATH | os.O_CLOEXEC, 0))  # AT_FDCWD
    except OSError as exc:
        return errno.errorcode.get(exc.errno or 0, str(exc.errno))
    return "" if HAVE_OPENAT2 else "not known on this machine"


def race_tools(root: Path, tries: int) -> dict[str, Any]:
    """The race on the tools' own code, in this process: each of its resolutions, then
    the control (the old tools, until each is seen to lose). A dict for JSON."""
    secrets = foreign = 0
    ways = resolutions()
    for way, openat2 in ways:
        read, write = tools(openat2=openat2)
        secrets += race(root / f"read-{way}", read, tries).wins
        foreign += race(root / f"write-{way}", write, tries).wins
    old_read = race(root / "old-read", reads(old_read_file), tries, until_win=CONTROL_BUDGET)
    old_write = race(root / "old-write", writes(old_write_file), tries, until_win=CONTROL_BUDGET)
    return {
        "ways": [way for way, _ in ways],
        "refused": openat2_refused(),
        "tries": tries * len(ways),
        "secrets": secrets,
        "foreign": foreign,
        "old_read": [old_read.wins, old_read.tries],
        "old_write": [old_write.wins, old_write.tries],
    }


RACE_TOOLS = (
    "import json, sys; from pathlib import Path; "
    "from tests.chaos.trust.swap_race import race_tools; "
    "print(json.dumps(race_tools(Path(sys.argv[1]), int(sys.argv[2]))))"
)


def race_in_host(daemon: Daemon, tries: int) -> dict[str, Any]:
    """``race_tools`` in a process run where ``daemon`` runs its workers (``here``): as
    its user, and under the emulated unit, with the unit's seccomp filters, where
    ``openat2`` is ENOSYS and the walk is what the tools use."""
    folder = daemon.root / "race"
    with daemon.as_user():
        folder.mkdir()
    budget = 120 + 4 * CONTROL_BUDGET + tries / 10  # (seconds: a loaded machine)
    done = subprocess.run(
        daemon.here([sys.executable, "-c", RACE_TOOLS, str(folder), str(tries)]),
        cwd=REPO, env=worker_env(), capture_output=True, text=True, timeout=budget, check=False,
    )  # fmt: skip
    if done.returncode != 0 or not done.stdout.strip():
        raise RuntimeError(f"the race exited {done.returncode}: {done.stderr.strip()[-800:]}")
    found: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return found


# -- the race on a real daemon ------------------------------------------------------


@dataclass(frozen=True)
class Through:
    """What the victim's calls met on a daemon: ``wins``, and how many were refused (the
    link met) or served from the folder (the racer was seen, both ways)."""

    wins: int
    refused: int
    served: int


def through_daemon(daemon: Daemon, tries: int) -> tuple[Through, Through]:
    """The reads and the writes raced on ``daemon``, started here (see the module
    docstring). Everything it uses lives in its folder and belongs to its user."""
    daemon.start()
    finished = daemon.submit([reply(text("done"))], "finished")
    daemon.wait_state(finished, "done", timeout=60)
    journal = daemon.task(finished).journal
    before = journal.read_bytes()
    home = daemon.root / "home"
    with daemon.as_user():
        home.mkdir()
        (home / ".pgpass").write_text(SECRET + "\n")
    calls = [tool_use("read_file", path="d/.pgpass") for _ in range(tries)]
    results = _victim(daemon, daemon.root / "shared-read", home, calls, "reader")
    read = Through(
        sum(SECRET in r for r in results),
        sum("escapes the workspace" in r for r in results),
        sum("nothing to see" in r for r in results),
    )
    calls = [
        tool_use("write_file", path="d/journal", content=f"forged {n}\n") for n in range(tries)
    ]
    results = _victim(daemon, daemon.root / "shared-write", journal.parent, calls, "writer")
    write = Through(
        int(journal.read_bytes() != before),
        sum("escapes the workspace" in r for r in results),
        sum(r.startswith("wrote ") for r in results),
    )
    return read, write


def _victim(
    daemon: Daemon, shared: Path, target: Path, calls: list[dict[str, object]], name: str
) -> list[str]:
    """The results of ``calls`` made by a task on the workspace ``shared`` while a tool of
    another task there swaps its ``d/`` with a symlink to ``target``."""
    with daemon.as_user():
        (shared / "d").mkdir(parents=True)
        (shared / "d" / ".pgpass").write_text("nothing to see")
        (shared / "d" / "journal").write_text("the shared workspace's own file\n")
        (shared / "racer.py").write_text(RACER)
    command = f"ln -s '{target}' .swap && exec python3 racer.py d .swap >racer.out 2>&1"
    attacker = daemon.submit(
        [reply(tool_use("run_command", command=command, timeout=600)), reply(text("done"))],
        f"{name}-attacker",
        workspace=shared,
    )
    out = shared / "racer.out"
    poll_for(lambda: out.exists() and "ready" in out.read_text(), 60, what="the racer to race")
    victim = daemon.submit([reply(*calls), reply(text("done"))], name, workspace=shared)
    daemon.wait_state(victim, "done", "failed", timeout=300)
    daemon.cli("cancel", attacker)
    daemon.wait_state(attacker, "cancelled", "done", "failed", timeout=60)
    return [str(r["content"]) for r in of_kind(journal_records(daemon.task(victim)), "result")]


def run(quick: bool, host: Host) -> list[Figure]:
    tries, daemon_tries = TRIES[quick], DAEMON_TRIES[quick]
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="agentd-swap-race-") as folder, subreaper():
        daemon = host.daemon(Path(folder) / "agentd", CONFIG)
        try:
            raced = race_in_host(daemon, tries)
            daemon_read, daemon_write = through_daemon(daemon, daemon_tries)
        finally:
            daemon.cleanup()
    secrets = raced["secrets"] + daemon_read.wins
    foreign = raced["foreign"] + daemon_write.wins
    name = f"swap race ({host.name})"
    unseen = [
        what
        for what, through in (("reads", daemon_read), ("writes", daemon_write))
        if not (through.refused and through.served)
    ]
    ways = ", ".join(raced["ways"])
    if raced["refused"]:
        ways += f" (openat2: {raced['refused']})"
    return [
        Figure(
            FAULT,
            f"{name}: tries per tool",
            f"{raced['tries']} in the worker's code, {daemon_tries} through a daemon",
        ),
        # Under the unit, the walk is the only way: it must be what was raced there.
        Figure(FAULT, f"{name}: resolutions raced where its workers run", ways,
               host.name == "unit" and raced["ways"] != ["walk"]),
        Figure(FAULT, f"{name}: secrets read", secrets, secrets > 0),
        Figure(FAULT, f"{name}: foreign writes", foreign, foreign > 0),
        Figure(
            FAULT,
            f"{name}: through a daemon, calls refused / served (the racer seen both ways)",
            f"reads {daemon_read.refused} / {daemon_read.served}, "
            f"writes {daemon_write.refused} / {daemon_write.served}",
            bool(unseen),
        ),
        control(f"{name}: control, check-then-use: secrets read", Tally(*raced["old_read"])),
        control(f"{name}: control, check-then-use: foreign writes", Tally(*raced["old_write"])),
        Figure(FAULT, f"{name}: runtime s", time.monotonic() - started),
    ]  # fmt: skip


def control(name: str, tally: Tally) -> Figure:
    """A control's wins, which must not be 0."""
    return Figure(FAULT, name, f"{tally.wins} in {tally.tries} tries", not tally.wins)
