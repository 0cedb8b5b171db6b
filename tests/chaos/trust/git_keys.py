"""Trust attack: git keys a tool plants in its workspace's repository (issue 20, item 3).

Each ``Plant`` is a task of a real daemon whose workspace (``--workspace``) is a real
repository. Its first turn plants git keys, each naming a command that would leave a
marker file in a folder outside the workspace:

* with ``write_file`` alone (no shell): a clean and smudge filter, a process filter,
  ``core.fsmonitor``, an ``include`` and an ``includeIf`` of a file of the tool's, and
  ``core.worktree`` (a work tree outside: any file git writes there is a marker);
* with ``run_command``: a ``post-checkout`` and a ``reference-transaction`` hook, a
  ``core.hooksPath`` of the tool's, and a ``gitdir:`` file naming a repository of the
  tool's.

The task runs to its end (each turn boundary takes a snapshot), then the operator
rewinds it with its files (``agentd rewind --restore-workspace``) and forks it
(``agentd fork``), through the CLI, and the fork runs to its end. ``escapes`` counts the
markers. Every setting runs with the sandbox off (git's own hardening alone must hold)
and, in full mode, with the sandbox on as well. The repositories and the folder outside
are the daemon's user's, in the daemon's folder; under the emulated unit the operator's
``rewind`` and ``fork`` run as that user in the unit's jail too (``run_cli``), so every
git run, the daemon's and the operator's, is the unit's.

The control runs git the old way in each planted repository: plain ``git`` on the
repository's own config (``add -A`` and ``write-tree`` with a fresh index,
``update-ref``, ``read-tree`` and ``checkout-index`` into a scratch index, ``worktree
add``), in a process of the host's (``Daemon.here``: under the unit, its user in its
jail). Each plant must leave its marker there: a defence never seen to matter proves
nothing.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.chaos.trust import FAULT, Host, outside_tmp
from tests.daemon import Daemon, config_text
from tests.faults.report import Figure
from tests.support import REPO, make_repo, reply, text, tool_use, worker_env

FINAL = ("done", "failed", "held", "cancelled")


@dataclass(frozen=True)
class Plant:
    """A task's planting: ``calls(marker, outside)`` are its first turn's tool calls."""

    name: str
    calls: Callable[[str, Path], list[dict[str, Any]]]


def _touch(marker: str) -> str:
    return f"sh -c 'touch {marker}; cat'"


def _write(path: str, content: str) -> dict[str, Any]:
    return tool_use("write_file", path=path, content=content)


def _shell(command: str) -> dict[str, Any]:
    return tool_use("run_command", command=command)


_ATTRIBUTES = _write(".gitattributes", "* filter=pwn\n")


def _filters(marker: str, _: Path) -> list[dict[str, Any]]:
    config = f'[filter "pwn"]\n\tclean = "{_touch(marker)}"\n\tsmudge = "{_touch(marker)}"\n'
    return [_ATTRIBUTES, _write(".git/config", config)]


def _process(marker: str, _: Path) -> list[dict[str, Any]]:
    return [_ATTRIBUTES, _write(".git/config", f'[filter "pwn"]\n\tprocess = "touch {marker}"\n')]


def _fsmonitor(marker: str, _: Path) -> list[dict[str, Any]]:
    return [_write(".git/config", f'[core]\n\tfsmonitor = "touch {marker}; :"\n')]


def _include(section: str) -> Callable[[str, Path], list[dict[str, Any]]]:
    def calls(marker: str, _: Path) -> list[dict[str, Any]]:
        included = f'[filter "pwn"]\n\tclean = "{_touch(marker)}"\n\tsmudge = "{_touch(marker)}"\n'
        return [
            _ATTRIBUTES,
            _write("evil.cfg", included),
            _write(".git/config", f"[{section}]\n\tpath = ../evil.cfg\n"),
        ]

    return calls


def _worktree(marker: str, _: Path) -> list[dict[str, Any]]:
    return [
        _write(
            ".git/config",
            f"[core]\n\trepositoryformatversion = 0\n\tbare = false\n\tworktree = {marker}.tree\n",
        )
    ]


def _hooks(marker: str, _: Path) -> list[dict[str, Any]]:
    make = "; ".join(
        f"printf '#!/bin/sh\\ntouch {marker}\\n' > .git/hooks/{hook}; chmod +x .git/hooks/{hook}"
        for hook in ("post-checkout", "reference-transaction")
    )
    return [_shell(f"mkdir -p .git/hooks; {make}")]


def _hooks_path(marker: str, _: Path) -> list[dict[str, Any]]:
    return [
        _shell(
            "mkdir -p hooks; for h in post-checkout reference-transaction post-index-change; "
            f"do printf '#!/bin/sh\\ntouch {marker}\\n' > hooks/$h; chmod +x hooks/$h; done; "
            f"printf '[core]\\n\\thooksPath = %s/hooks\\n' \"$PWD\" >> .git/config"
        )
    ]


def _gitdir(marker: str, _: Path) -> list[dict[str, Any]]:
    config = (
        f'[core]\n\tbare = false\n\tfsmonitor = "touch {marker}; :"\n'
        f'[filter "pwn"]\n\tclean = "{_touch(marker)}"\n\tsmudge = "{_touch(marker)}"\n'
    )
    return [
        _ATTRIBUTES,
        _write("evil.config", config),
        _shell(
            "mv .git .git-moved && git init -q --bare evil.git && mv evil.config evil.git/config"
            " && printf 'gitdir: %s/evil.git\\n' \"$PWD\" > .git"
        ),
    ]


PLANTS = (
    Plant("filter clean and smudge (write_file)", _filters),
    Plant("filter process (write_file)", _process),
    Plant("core.fsmonitor (write_file)", _fsmonitor),
    Plant("include (write_file)", _include("include")),
    Plant("includeIf (write_file)", _include('includeIf "gitdir:/"')),
    Plant("core.worktree (write_file)", _worktree),
    Plant("hooks (run_command)", _hooks),
    Plant("core.hooksPath (run_command)", _hooks_path),
    Plant("gitdir: file (run_command)", _gitdir),
)


def say(message: str) -> None:
    print(f"git_keys: {message}", file=sys.stderr, flush=True)


def script(plant: Plant, marker: str, outside: Path) -> list[dict[str, Any]]:
    return [
        reply(*plant.calls(marker, outside)),
        reply(_write("a.txt", "two\n"), _write("b.txt", "bee\n")),
        reply(text("Done.")),
    ]


def markers(outside: Path, marker: str) -> bool:
    """Whether a planted command left its marker (or git wrote into the planted work
    tree outside)."""
    tree = Path(f"{marker}.tree")
    return Path(marker).exists() or (tree.is_dir() and any(tree.iterdir()))


@dataclass
class Run:
    escapes: list[str]  # plants whose marker appeared
    failed: list[str]  # plants whose task, rewind or fork did not complete
    repos: dict[str, Path]
    daemon: Daemon


def attack(host: Host, root: Path, sandbox: str) -> Run:
    """The plants on a daemon of ``host``: the repositories and the folder outside are
    the daemon's user's, in the daemon's folder (all an emulated unit's daemon sees)."""
    daemon = host.daemon(
        root / "daemon",
        config_text(
            max_workers=16,
            timeout=5.0,
            model_call=None,
            tool_call=None,
            crash_loop_limit=None,
            sandbox=sandbox,
            tool_modules=(),
        ),
    )
    outside = daemon.root / "outside"
    with daemon.as_user():
        outside.mkdir()
    repos: dict[str, Path] = {}
    marks: dict[str, str] = {}
    failed: list[str] = []
    # (under the unit, the operator's commands run as the unit's user, as a process: its
    # git runs are that user's, not this process's)
    cli = daemon.cli if host.name == "bwrap" else _process_cli(daemon)
    try:
        daemon.start()
        for i, plant in enumerate(PLANTS):
            name = f"g{i}"
            repos[name] = daemon.give(make_repo(daemon.root / "repos" / name))
            marks[name] = str(outside / f"{name}.marker")
            with daemon.as_user():
                Path(f"{marks[name]}.tree").mkdir()  # a folder of the user's, outside
            daemon.submit(script(plant, marks[name], outside), name, workspace=repos[name])
        for name in repos:
            daemon.wait_state(name, *FINAL, timeout=60)
        for i, name in enumerate(repos):
            steps = [
                ("rewind", name, "--to", "1", "--yes", "--restore-workspace"),
                ("fork", name, "--at", "1", "--name", f"{name}-fork"),
            ]
            for args in steps:
                try:
                    code, _, err = cli(*args)
                except Exception as exc:  # (the old code let a git failure out)
                    code, err = 1, f"{type(exc).__name__}: {exc}"
                if code != 0:
                    failed.append(f"{PLANTS[i].name}: {args[0]}: {err.strip()[:120]}")
        for name in repos:
            for task in (name, f"{name}-fork"):
                if daemon.task(task).exists():
                    daemon.wait_state(task, *FINAL, timeout=60)
    finally:
        daemon.cleanup()
    escapes = [p.name for p, n in zip(PLANTS, repos, strict=True) if markers(outside, marks[n])]
    return Run(escapes, failed, {n: repos[n] for n in repos}, daemon)


def _process_cli(daemon: Daemon) -> Callable[..., tuple[int, str, str]]:
    def cli(*args: str) -> tuple[int, str, str]:
        done = daemon.run_cli(*args, timeout=120)
        return done.returncode, done.stdout, done.stderr

    return cli


def _old_way(repo: Path, scratch: Path) -> None:
    """Git as agentd ran it before: on the repository itself, its config and attributes
    honoured (errors ignored: a control only looks for markers). Run in a process of the
    daemon's host (``OLD_WAY``), as the daemon ran it."""
    env = {**os.environ, "GIT_INDEX_FILE": str(scratch / "index")}

    def run(*args: str, **kwargs: Any) -> str:
        done = subprocess.run(
            ["git", "-c", "user.name=c", "-c", "user.email=c@c", *args],
            cwd=repo,
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
            **kwargs,
        )
        return str(done.stdout).strip()

    run("add", "-A", ".", env=env)
    tree = run("write-tree", env=env)
    snapshot = run("commit-tree", tree, "-m", "control", env=env) if tree else ""
    if snapshot:
        run("update-ref", "refs/agentd/control/1", snapshot)
    files = run("rev-parse", "-q", "--verify", "HEAD") or snapshot  # (a snapshot of
    if files:  # a planted core.worktree is of that empty folder: restore HEAD's files)
        (scratch / "index").unlink(missing_ok=True)
        run("read-tree", files, env=env)
        run("checkout-index", "-a", "-f", env=env)
        run("worktree", "add", "--detach", str(scratch / "worktree"), files)


OLD_WAY = (
    "import json, sys; from pathlib import Path; from tests.chaos.trust.git_keys import _old_way; "
    "[_old_way(Path(repo), Path(scratch)) for repo, scratch in json.loads(sys.argv[1])]"
)


def control(run_: Run) -> list[str]:
    """The plants whose command ran when git ran the old way in their planted repository,
    in one process where the daemon ran (under the emulated unit: as its user, in the
    jail)."""
    daemon = run_.daemon
    outside = daemon.root / "outside"
    pairs = []
    for name, repo in run_.repos.items():
        marker = str(outside / f"{name}.marker")
        Path(marker).unlink(missing_ok=True)
        tree = Path(f"{marker}.tree")
        shutil.rmtree(tree)
        scratch = daemon.root / "control" / name
        with daemon.as_user():
            tree.mkdir()
            scratch.mkdir(parents=True)
        pairs.append((str(repo), str(scratch)))
    subprocess.run(
        daemon.here([sys.executable, "-c", OLD_WAY, json.dumps(pairs)]),
        cwd=REPO, env=worker_env(), capture_output=True, timeout=300, check=False,
    )  # fmt: skip
    names = list(run_.repos)
    return [
        PLANTS[i].name for i, n in enumerate(names) if markers(outside, f"{outside}/{n}.marker")
    ]


def run(quick: bool, host: Host) -> list[Figure]:
    figures: list[Figure] = []
    settings = ("off",) if quick else ("off", "auto")
    with outside_tmp("git") as folder:
        for sandbox in settings:
            root = folder / sandbox
            done = attack(host, root, sandbox)
            where = f"{host.name}, sandbox {sandbox}"
            say(f"{where}: escapes {done.escapes}, incomplete {done.failed}")
            figures.append(
                Figure(FAULT, f"git keys ({where}): escapes", len(done.escapes), bool(done.escapes))
            )
            figures.append(
                Figure(
                    FAULT,
                    f"git keys ({where}): plants whose rewind or fork failed",
                    len(done.failed),
                    bool(done.failed),
                )
            )
            if sandbox == "off":
                seen = control(done)
                missed = [p.name for p in PLANTS if p.name not in seen]
                figures.append(
                    Figure(
                        FAULT,
                        f"git keys ({host.name}): control, plain git: plants whose command ran",
                        f"{len(seen)} of {len(PLANTS)}",
                        bool(missed),
                    )
                )
                if missed:
                    figures.append(
                        Figure(
                            FAULT,
                            "git keys: control plants that ran nothing",
                            ", ".join(missed),
                            True,
                        )
                    )
    return figures
