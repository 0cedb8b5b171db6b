"""No repository code runs: git keys a tool can plant in its workspace have no effect on
the snapshot of a turn, on ``rewind --restore-workspace`` or on a fork (worker/vcs.py).

Each test plants one key in a real repository after the task was submitted (as a tool
could, between two git runs of the worker), with a command that would write a marker
file outside the workspace, then runs the task, rewinds it with its files and forks it.
The sandbox is off here: what is proved is that git itself runs none of it.
"""

from __future__ import annotations

import os
import stat
import subprocess
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from supervisor.history import fork, rewind
from supervisor.status import load_state
from tests.support import (
    git,
    make_loop,
    make_repo,
    make_spool,
    reply,
    scripted_task,
    text,
    tool_use,
)
from worker import vcs
from worker.config import Config, ToolsConfig
from worker.spool import Spool
from worker.tools.sandbox import Sandbox, SandboxMode

BARE = Config(tools=ToolsConfig(sandbox=SandboxMode.OFF))


def three_turns() -> list[dict[str, object]]:
    return [
        reply(tool_use("write_file", path="a.txt", content="one")),
        reply(
            tool_use("write_file", path="a.txt", content="two"),
            tool_use("write_file", path="b.txt", content="bee"),
        ),
        reply(text("Done.")),
    ]


@dataclass
class Scene:
    repo: Path
    outside: Path  # where a planted command would leave its marker
    cleanups: list[Callable[[], None]] = field(default_factory=list)

    def marker(self, name: str = "ran") -> Path:
        return self.outside / name

    def touch(self, name: str = "ran") -> str:
        """A shell command that leaves a marker, then passes its input through."""
        return f"sh -c 'touch {self.marker(name)}; cat'"

    def config(self, text_: str) -> None:
        with open(self.repo / ".git" / "config", "a") as f:
            f.write(text_)

    def hook(self, folder: Path, name: str) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        hook = folder / name
        hook.write_text(f"#!/bin/sh\ntouch {self.marker(name)}\n")
        hook.chmod(hook.stat().st_mode | stat.S_IXUSR)

    def markers(self) -> list[str]:
        """What planted commands left: files outside, and any in the folder that a
        planted ``core.worktree`` names."""
        tree = self.outside / "other" / "tree"
        found = [p.name for p in self.outside.iterdir() if p.name != "other"]
        return sorted(found + ([f"tree/{p.name}" for p in tree.iterdir()] if tree.is_dir() else []))


def plant_clean(scene: Scene) -> None:
    (scene.repo / ".gitattributes").write_text("* filter=pwn\n")
    scene.config(f'[filter "pwn"]\n\tclean = "{scene.touch()}"\n')


def plant_smudge(scene: Scene) -> None:
    (scene.repo / ".gitattributes").write_text("* filter=pwn\n")
    scene.config(f'[filter "pwn"]\n\tsmudge = "{scene.touch()}"\n')


def plant_process(scene: Scene) -> None:
    (scene.repo / ".gitattributes").write_text("* filter=pwn\n")
    scene.config(f'[filter "pwn"]\n\tprocess = "touch {scene.marker()}"\n')


def plant_post_checkout(scene: Scene) -> None:
    scene.hook(scene.repo / ".git" / "hooks", "post-checkout")


def plant_fsmonitor(scene: Scene) -> None:
    scene.config(f'[core]\n\tfsmonitor = "touch {scene.marker()}; :"\n')


def plant_hooks_path(scene: Scene) -> None:
    hooks = scene.outside / "other" / "hooks"
    for name in ("reference-transaction", "post-checkout", "post-index-change"):
        scene.hook(hooks, name)
    scene.config(f"[core]\n\thooksPath = {hooks}\n")


def _included(scene: Scene) -> Path:
    (scene.repo / ".gitattributes").write_text("* filter=pwn\n")
    included = scene.outside / "other" / "included.cfg"
    included.parent.mkdir(exist_ok=True)
    included.write_text(
        f'[filter "pwn"]\n\tclean = "{scene.touch()}"\n\tsmudge = "{scene.touch()}"\n'
        f'[core]\n\tfsmonitor = "touch {scene.marker("fsmonitor")}; :"\n'
    )
    return included


def plant_include(scene: Scene) -> None:
    scene.config(f"[include]\n\tpath = {_included(scene)}\n")


def plant_include_if(scene: Scene) -> None:
    scene.config(f'[includeIf "gitdir:/"]\n\tpath = {_included(scene)}\n')


def plant_core_worktree(scene: Scene) -> None:
    """The repository's work tree moved elsewhere: git would snapshot, and restore into,
    that folder; a file written there is the marker."""
    other = scene.outside / "other" / "tree"
    other.mkdir()
    scene.config(f"[core]\n\tworktree = {other}\n")


def plant_gitdir_file(scene: Scene) -> None:
    """``.git`` becomes a ``gitdir:`` file naming a repository of the tool's, with a
    filter and an fsmonitor in its config."""
    evil = scene.outside / "other" / "evil.git"
    subprocess.run(["git", "init", "-q", "--bare", str(evil)], check=True)
    (evil / "config").write_text(
        f'[core]\n\tbare = false\n\tfsmonitor = "touch {scene.marker("fsmonitor")}; :"\n'
        f'[filter "pwn"]\n\tclean = "{scene.touch()}"\n\tsmudge = "{scene.touch()}"\n'
    )
    (scene.repo / ".gitattributes").write_text("* filter=pwn\n")
    (scene.repo / ".git").rename(scene.repo / ".git-moved")
    (scene.repo / ".git").write_text(f"gitdir: {evil}\n")


def plant_alternates(scene: Scene) -> None:
    """``objects/info/alternates`` becomes a FIFO: a git that reads the repository's
    alternates opens it, and the writer waiting on it leaves the marker."""
    fifo = scene.repo / ".git" / "objects" / "info" / "alternates"
    fifo.parent.mkdir(exist_ok=True)
    os.mkfifo(fifo)
    done = threading.Event()

    def writer() -> None:
        while not done.is_set():
            with open(fifo, "w"):  # blocks until a reader opens it
                if not done.is_set():
                    scene.marker().touch()

    threading.Thread(target=writer, daemon=True).start()
    scene.cleanups.append(lambda: _release(fifo, done))


def _release(fifo: Path, done: threading.Event) -> None:
    done.set()
    fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # lets the waiting writer go
    os.close(fd)


PLANTS: dict[str, Callable[[Scene], None]] = {
    "filter clean": plant_clean,
    "filter smudge": plant_smudge,
    "filter process": plant_process,
    "post-checkout hook": plant_post_checkout,
    "core.fsmonitor": plant_fsmonitor,
    "core.hooksPath": plant_hooks_path,
    "include": plant_include,
    "includeIf": plant_include_if,
    "core.worktree": plant_core_worktree,
    "gitdir: file": plant_gitdir_file,
    "alternates": plant_alternates,
}


@pytest.fixture
def scene(tmp_path: Path) -> Iterator[Scene]:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "other").mkdir()
    planted = Scene(make_repo(tmp_path / "repo"), outside)
    yield planted
    for cleanup in planted.cleanups:
        cleanup()


def run_to_end(spool: Spool, task_id: str, config: Config = BARE) -> str:
    loop = make_loop(spool.task(task_id), config=config)
    try:
        return loop.run().state
    finally:
        loop.close()


@pytest.mark.parametrize("plant", list(PLANTS))
def test_a_planted_git_key_runs_nothing_at_snapshot_rewind_or_fork(
    tmp_path: Path, scene: Scene, plant: str
) -> None:
    spool = make_spool(tmp_path)
    task = scripted_task(spool, three_turns(), name="p1", workspace=scene.repo)
    PLANTS[plant](scene)  # after submit: what a tool can write between two git runs
    assert run_to_end(spool, task.id) == "done"
    assert scene.markers() == [], "the snapshot ran a planted command"
    assert load_state(task).vcs, "no turn was snapshotted"

    rewind(spool, BARE, task.id, 1, yes=True, restore_workspace=True)
    assert scene.markers() == [], "the restore ran a planted command"
    assert (scene.repo / "a.txt").read_text() == "one"
    assert not (scene.repo / "b.txt").exists()

    report = fork(spool, BARE, task.id, 1, name="p1-fork")
    assert "own work tree" in report.workspace
    assert scene.markers() == [], "the fork ran a planted command"
    forked = Path(spool.task("p1-fork").load_spec().workspace or "")
    assert (forked / "a.txt").read_text() == "one" and not (forked / "b.txt").exists()
    assert run_to_end(spool, "p1-fork") == "done"  # the fork snapshots its own turns
    assert scene.markers() == []


def test_a_git_repository_made_after_submit_is_never_snapshotted(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    workspace = tmp_path / "plain"
    workspace.mkdir()
    spool = make_spool(tmp_path)
    task = scripted_task(spool, three_turns(), name="n1", workspace=workspace)
    assert task.load_spec().git is None
    make_repo(workspace / "x").rename(workspace / "y")  # (a repository, then its .git)
    (workspace / "y" / ".git").rename(workspace / ".git")
    (workspace / ".gitattributes").write_text("* filter=pwn\n")
    with open(workspace / ".git" / "config", "a") as f:
        f.write(f'[filter "pwn"]\n\tclean = "sh -c \'touch {outside}/ran; cat\'"\n')
        f.write(f'[core]\n\tfsmonitor = "touch {outside}/fsmonitor; :"\n')
    assert run_to_end(spool, task.id) == "done"
    assert list(outside.iterdir()) == []
    assert load_state(task).vcs == {}


def test_submit_records_the_repository_of_a_subfolder(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo")
    (repo / "sub").mkdir()
    spool = make_spool(tmp_path)
    task = scripted_task(spool, three_turns(), name="s1", workspace=repo / "sub")
    assert task.load_spec().git == {
        "work_tree": str(repo.resolve()),
        "git_dir": str((repo / ".git").resolve()),
        "common_dir": str((repo / ".git").resolve()),
    }


def test_a_snapshot_keeps_the_head_commit_and_ignored_files_out(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo")
    (repo / ".gitignore").write_text("*.log\n")
    (repo / "noise.log").write_text("x")
    found = vcs.discover(repo)
    assert found is not None
    git_ = vcs.Git(found, tmp_path / "private")
    point = git_.capture("t1", 1)
    assert point.commit == git(repo, "rev-parse", "HEAD").strip()
    assert sorted(git_.ls_tree(point.snapshot)) == [".gitignore", "a.txt"]
    assert git(repo, "for-each-ref").count("refs/agentd") == 0  # nothing written in the repo


def test_git_runs_under_the_sandbox_when_it_is_on(tmp_path: Path) -> None:
    sandbox = Sandbox(SandboxMode.REQUIRED, hidden=(tmp_path / "spool",))
    if sandbox.problem():
        pytest.fail(f"bwrap cannot run here: {sandbox.problem()}")
    repo = make_repo(tmp_path / "repo")
    found = vcs.discover(repo)
    assert found is not None
    private = tmp_path / "spool" / "tasks" / "t1" / "git"
    git_ = vcs.Git(found, private, sandbox)
    argv = sandbox.wrap(["git"], repo, {}, binds=[private])
    assert argv[0].endswith("bwrap") and str(private) in argv
    point = git_.capture("t1", 1)
    (repo / "a.txt").write_text("changed")
    (repo / "new.txt").write_text("new")
    git_.restore(point.snapshot)
    assert (repo / "a.txt").read_text() == "committed" and not (repo / "new.txt").exists()
    child = git_.fork(
        point.snapshot,
        tmp_path / "spool" / "tasks" / "t2" / "tree",
        private.parent.parent / "t2" / "git",
    )
    assert (child.repo.work_tree / "a.txt").read_text() == "committed"


def test_a_snapshot_after_the_repository_lost_its_objects_has_every_file(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo")
    found = vcs.discover(repo)
    assert found is not None
    git_ = vcs.Git(found, tmp_path / "private")
    os.utime(repo / "a.txt", (1e9, 1e9))  # (not racily clean: its index entry is trusted)
    git_.capture("t1", 1)  # its index now borrows a.txt's blob from the repository
    (repo / ".git").rename(tmp_path / "moved.git")  # as a tool may do
    (repo / ".git").write_text(f"gitdir: {tmp_path / 'moved.git'}\n")
    point = git_.capture("t1", 2)
    (repo / "a.txt").write_text("changed")
    git_.restore(point.snapshot)
    assert (repo / "a.txt").read_text() == "committed"
