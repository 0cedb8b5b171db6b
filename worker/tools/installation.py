"""What a sandboxed command needs to run: its installation, found from its argv.

The sandbox (``worker.tools.sandbox``) shows a command the system's folders, its
workspace and nothing else; a program installed elsewhere (a venv, a ``node_modules``, a
pyenv or nvm interpreter, under /tmp or a home folder) would not be found. ``installed``
follows the command to what it runs, and gives the folders to show read-only:

* ``argv[0]``, looked up on the command's ``PATH``, then followed through symlinks and
  ``#!`` lines (``#!/usr/bin/env node`` looks ``node`` up on that ``PATH``) to the
  interpreter that runs it, each step up to ``STEPS``;
* for an interpreter (python, node...), its first argument that is a file: the script;
* each executable or script met is shown as its installation: the venv it lives in (the
  folder with ``pyvenv.cfg``), else the outermost ``node_modules`` folder it lives in,
  else its prefix (``PREFIX/bin/NAME`` where ``PREFIX/lib`` is a folder: pyenv, nvm,
  /opt/node), else the file alone.

A folder is never shown whole when it is ``/``, a top-level folder, a home folder or the
host's temporary folder itself: the file alone is, with a note saying why (``notes``),
which a server that then cannot start gets in its error. What lies in the system's
folders (``SYSTEM``) needs nothing more.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

#: The system's read-only folders, shown to every sandboxed command (docs/guides/tools.md).
SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/opt")
#: Links and ``#!`` lines followed from ``argv[0]`` at most.
STEPS = 8
#: Interpreters whose first file argument is the program they run.
INTERPRETERS = ("python", "node", "nodejs", "bun", "deno", "ruby", "perl", "php")
#: Folders a program's installation may never be (it would show them whole).
NOT_AN_INSTALLATION = ("/", "/tmp", "/var/tmp", "/home", "/root", "/run/user")  # noqa: S108  (names, not files made)


@dataclass(frozen=True)
class Installation:
    """The folders and files to show read-only (``paths``), and what could not be."""

    paths: tuple[Path, ...] = ()
    notes: tuple[str, ...] = field(default=())


def in_system(path: Path) -> bool:
    """Whether ``path`` lies in one of the system's folders every command sees."""
    return any(path.is_relative_to(folder) for folder in SYSTEM)


def installed(
    argv: Sequence[str], search_path: str | None, *, workspace: Path | None = None
) -> Installation:
    """What ``argv`` needs to run, outside the system's folders (see the module's doc).
    A file in ``workspace`` is shown with it, and its ``#!`` line is not followed: the
    task may have written it, and must not choose what else the sandbox shows."""
    if not argv:
        return Installation()
    found: dict[Path, None] = {}
    notes: list[str] = []
    program = shutil.which(argv[0], path=search_path) if "/" not in argv[0] else argv[0]
    if program is None or not os.path.exists(program):
        return Installation((), (f"{argv[0]} is not found on the command's PATH",))
    mine = Path(os.path.realpath(workspace)) if workspace is not None else None
    for step in range(STEPS):
        path = Path(os.path.abspath(program))
        if mine is not None and Path(os.path.realpath(path)).is_relative_to(mine):
            break
        for each in dict.fromkeys((path, Path(os.path.realpath(path)))):
            _show(each, found, notes)
        if step == 0 and _is_interpreter(path):
            script = _script(argv[1:])
            real = Path(os.path.realpath(script)) if script is not None else None
            if real is not None and not (mine is not None and real.is_relative_to(mine)):
                _show(real, found, notes)
        program = _interpreter(Path(os.path.realpath(path)), search_path)
        if program is None:
            break
    return Installation(tuple(found), tuple(notes))


def _show(path: Path, found: dict[Path, None], notes: list[str]) -> None:
    """Add what shows ``path`` (an executable or a script) to ``found``."""
    if in_system(path):
        return
    root = _root(path)
    if root is not None and _acceptable(root):
        found[root] = None
        return
    if root is not None:
        notes.append(
            f"{path} lies in {root}, which the sandbox never shows whole (a home or "
            "temporary folder itself): only the file is shown; install it in a folder "
            "of its own (a venv, a node_modules)"
        )
    found[path] = None


def _root(path: Path) -> Path | None:
    """The installation ``path`` belongs to, or None (a file on its own)."""
    for parent in path.parents:
        if (parent / "pyvenv.cfg").is_file():
            return parent
    modules = [p for p in path.parents if p.name == "node_modules"]
    if modules:
        return modules[-1]
    if path.parent.name == "bin" and (path.parent.parent / "lib").is_dir():
        return path.parent.parent
    return None


def _acceptable(root: Path) -> bool:
    """A folder that may be shown whole: no home, temporary or top-level folder."""
    if len(root.parts) <= 2 or str(root) in NOT_AN_INSTALLATION:
        return False
    return root not in _homes()


def _homes() -> set[Path]:
    homes = {Path(os.path.expanduser("~"))}
    with contextlib.suppress(OSError):
        homes |= {Path(entry.pw_dir) for entry in pwd.getpwall()}
    return homes


def _is_interpreter(path: Path) -> bool:
    """``python3.11``, ``node``...: a name of ``INTERPRETERS``, maybe with a version."""
    name = path.name
    return any(
        name == i or (name.startswith(i) and name[len(i) :][:1] in "0123456789.")
        for i in INTERPRETERS
    )


def _script(args: Sequence[str]) -> str | None:
    """An interpreter's program: its first argument that is not an option, if a file."""
    for arg in args:
        if arg.startswith("-"):
            if arg in ("-c", "-e", "-m", "--eval", "-p", "--print"):
                return None  # (code or a module, not a file)
            continue
        return arg if os.path.isfile(arg) else None
    return None


def _interpreter(path: Path, search_path: str | None) -> str | None:
    """The program a script's ``#!`` line runs (``env NAME`` looked up), or None."""
    try:
        with path.open("rb") as f:
            head = f.read(256)
    except OSError:
        return None
    if not head.startswith(b"#!"):
        return None
    words = head[2:].split(b"\n", 1)[0].decode(errors="replace").split()
    if not words:
        return None
    if Path(words[0]).name == "env":
        names = [w for w in words[1:] if not w.startswith("-") and "=" not in w]
        return shutil.which(names[0], path=search_path) if names else None
    return words[0]


def hidden_why(argv: Sequence[str], search_path: str | None, *, sandboxed: bool) -> str:
    """Why ``argv`` may not find what it needs, in one clause, or '': a program or script
    named under /tmp or /var/tmp that is not there (a daemon under ``agentd unit`` has a
    fresh copy of them: ``PrivateTmp=``), and, ``sandboxed``, what of its installation
    the sandbox could not show (``Installation.notes``). Said with the error of a server
    that did not start (``worker.mcp.servers``)."""
    if not argv:
        return ""
    named = [argv[0]]
    if _is_interpreter(Path(argv[0])):  # (and its script)
        named += [a for a in argv[1:] if not a.startswith("-")][:1]
    for program in named:
        if program.startswith("/") and not os.path.exists(program) and _in_tmp(Path(program)):
            return (
                f"{program} does not exist here: it is under the host's temporary folder, "
                "which a daemon run by `agentd unit` (PrivateTmp=) has a fresh copy of; "
                "install the server elsewhere (e.g. /opt)"
            )
    notes = installed(argv, search_path).notes if sandboxed else ()
    if not notes:
        return ""
    return "the sandbox shows a server the system's folders, its workspace and its " + (
        "installation; " + "; ".join(notes)
    )


def _in_tmp(path: Path) -> bool:
    return any(path.is_relative_to(folder) for folder in ("/tmp", "/var/tmp"))  # noqa: S108
