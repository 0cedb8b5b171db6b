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
worker opened once; both of its resolutions are raced, the kernel's (``openat2`` with
``RESOLVE_BENEATH``) and the walk of the kernels without it. Every win is a violation.

The control races the same calls through a copy of the old tools (``old_read_file``,
``old_write_file``: the path checked by ``realpath``, then opened by name), which must be
seen to lose at least once each; it tries until then, up to ``CONTROL_BUDGET`` seconds.

The file tools run in the worker, outside any sandbox, so a host changes nothing of the
race: the figures carry its name, the attack is the same under each.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tests.chaos.trust import FAULT, Host
from tests.faults.report import Figure
from worker.store.durable import atomic_write
from worker.tools.beneath import Root
from worker.tools.builtin import read_file, write_file
from worker.tools.tool import ToolContext, ToolError

SECRET = "*:5432:*:agentd:pgpass-canary-7f3a9c"  # noqa: S105  (a canary, not a password)
JOURNAL = b"a finished task's journal\n"
TRIES = {True: 1000, False: 20000}  # per tool and resolution: quick, full
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


def run(quick: bool, host: Host) -> list[Figure]:
    tries = TRIES[quick]
    started = time.monotonic()
    secrets = foreign = 0
    with tempfile.TemporaryDirectory(prefix="agentd-swap-race-") as folder:
        root = Path(folder)
        for way, openat2 in (("openat2", True), ("walk", False)):
            read, write = tools(openat2=openat2)
            secrets += race(root / f"read-{way}", read, tries).wins
            foreign += race(root / f"write-{way}", write, tries).wins
        old_read = race(root / "old-read", reads(old_read_file), tries, until_win=CONTROL_BUDGET)
        old_write = race(
            root / "old-write", writes(old_write_file), tries, until_win=CONTROL_BUDGET
        )
    name = f"swap race ({host.name})"
    return [
        Figure(FAULT, f"{name}: tries per tool", tries * 2),
        Figure(FAULT, f"{name}: secrets read", secrets, secrets > 0),
        Figure(FAULT, f"{name}: foreign writes", foreign, foreign > 0),
        control(f"{name}: control, check-then-use: secrets read", old_read),
        control(f"{name}: control, check-then-use: foreign writes", old_write),
        Figure(FAULT, f"{name}: runtime s", time.monotonic() - started),
    ]


def control(name: str, tally: Tally) -> Figure:
    """A control's wins, which must not be 0."""
    return Figure(FAULT, name, f"{tally.wins} in {tally.tries} tries", not tally.wins)
