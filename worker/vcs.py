"""Workspace version control: what a checkpoint records of the files, and how it puts
them back.

Checkpoints restore the conversation and the ledger; files are version control's job.
Where a task's workspace is inside a git repository, each turn boundary records the
HEAD commit and a *snapshot commit* of the whole working tree (tracked changes and
untracked files, ``.gitignore`` respected), built with a private index file so the
user's branch, index and stash are never touched. The snapshot is kept reachable under
``refs/agentd/TASK/TURN`` so ``git gc`` does not drop it.

``restore`` writes a snapshot's files back into a working tree (again through a private
index) and removes files the snapshot did not have; ``add_worktree`` gives a fork its own
git worktree at a snapshot.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

GIT_TIMEOUT = 30.0
_AUTHOR = {
    "GIT_AUTHOR_NAME": "agentd",
    "GIT_AUTHOR_EMAIL": "agentd@localhost",
    "GIT_COMMITTER_NAME": "agentd",
    "GIT_COMMITTER_EMAIL": "agentd@localhost",
}


class VcsError(Exception):
    """A git command failed; the message says which and why."""


@dataclass(frozen=True)
class Checkpoint:
    commit: str | None  # HEAD, None on a repository without commits
    snapshot: str  # a commit of the whole working tree


def _git(
    cwd: Path, *args: str, env: Mapping[str, str] | None = None, check: bool = True
) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, **_AUTHOR, **(env or {})}
    try:
        done = subprocess.run(
            ["git", *args],
            cwd=cwd,
            env=full_env,
            capture_output=True,
            text=True,
            timeout=GIT_TIMEOUT,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise VcsError(f"git {args[0]} failed: {exc}") from None
    if check and done.returncode != 0:
        raise VcsError(f"git {args[0]} failed: {done.stderr.strip()[:300]}")
    return done


def repo_root(workspace: Path) -> Path | None:
    """The top of the git work tree holding ``workspace``, or None."""
    if not workspace.is_dir():
        return None
    if "GIT_DIR" not in os.environ and not any(
        (folder / ".git").exists() for folder in (workspace.resolve(), *workspace.resolve().parents)
    ):
        return None  # no repository can hold it: spare a git process on every start
    try:
        done = _git(workspace, "rev-parse", "--show-toplevel", check=False)
    except VcsError:
        return None
    return Path(done.stdout.strip()) if done.returncode == 0 else None


def uses_vcs(workspace: Path, *, explicit: bool) -> bool:
    """Checkpoint files with git when the workspace is the user's (given with
    --workspace) and inside a repository, or is a repository of its own."""
    root = repo_root(workspace)
    if root is None:
        return False
    return explicit or root.resolve() == workspace.resolve()


@contextlib.contextmanager
def _private_index(root: Path) -> Iterator[dict[str, str]]:
    with tempfile.TemporaryDirectory(prefix="agentd-index-") as tmp:
        yield {"GIT_INDEX_FILE": str(Path(tmp) / "index")}


def _tree_of_worktree(root: Path, env: Mapping[str, str]) -> str:
    _git(root, "add", "-A", ".", env=env)
    return _git(root, "write-tree", env=env).stdout.strip()


def capture(workspace: Path, task_id: str, turn: int) -> Checkpoint | None:
    """Record the workspace's files after ``turn``; None when it is not under git."""
    root = repo_root(workspace)
    if root is None:
        return None
    head_done = _git(root, "rev-parse", "--verify", "-q", "HEAD", check=False)
    head = head_done.stdout.strip() or None
    with _private_index(root) as env:
        tree = _tree_of_worktree(root, env)
    parents = ["-p", head] if head else []
    snapshot = _git(
        root, "commit-tree", tree, *parents, "-m", f"agentd checkpoint {task_id} turn {turn}"
    ).stdout.strip()
    _git(root, "update-ref", f"refs/agentd/{task_id}/{turn}", snapshot)
    return Checkpoint(head, snapshot)


def restore(workspace: Path, snapshot: str) -> None:
    """Make the working tree's files exactly those of ``snapshot`` (index, HEAD untouched)."""
    root = repo_root(workspace)
    if root is None:
        raise VcsError(f"{workspace} is not inside a git repository")
    with _private_index(root) as env:
        current = set(_ls_tree(root, _tree_of_worktree(root, env)))
    with _private_index(root) as env:
        _git(root, "read-tree", snapshot, env=env)
        _git(root, "checkout-index", "-a", "-f", env=env)
    wanted = set(_ls_tree(root, snapshot))
    for name in sorted(current - wanted, reverse=True):
        with contextlib.suppress(FileNotFoundError):
            (root / name).unlink()
        for parent in (root / name).parents:  # folders the snapshot did not have either
            if parent == root or not parent.is_relative_to(root):
                break
            try:
                parent.rmdir()
            except OSError:
                break


def _ls_tree(root: Path, treeish: str) -> list[str]:
    out = _git(root, "ls-tree", "-r", "-z", "--name-only", treeish).stdout
    return [name for name in out.split("\0") if name]


def add_worktree(workspace: Path, snapshot: str, target: Path) -> Path:
    """A new git worktree at ``target`` whose files are those of ``snapshot``; returns the
    fork's workspace (the same sub-folder of the new worktree as ``workspace`` is of its
    repository)."""
    root = repo_root(workspace)
    if root is None:
        raise VcsError(f"{workspace} is not inside a git repository")
    _git(root, "worktree", "add", "--detach", str(target), snapshot)
    return target / workspace.resolve().relative_to(root.resolve())


def moved_worktree(workspace: Path, target: Path) -> None:
    """Tell the repository of ``workspace`` that one of its worktrees now lives at
    ``target`` (``git worktree repair``): it was made in a folder since moved."""
    root = repo_root(workspace)
    if root is not None:
        _git(root, "worktree", "repair", str(target))
