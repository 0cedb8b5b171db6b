"""Workspace version control: what a checkpoint records of the files, and how it puts
them back, without ever running code of the repository.

Checkpoints restore the conversation and the ledger; files are version control's job.
Whether a task's workspace is under git is decided once, at submit (``discover``), and
recorded in the spec as a ``Repository``: the work tree, the repository's own git dir
(where its HEAD is) and its common dir (where its objects are). A ``.git`` that appears
later, a ``gitdir:`` file or ``core.worktree`` planted afterwards, change nothing.

The workspace's ``.git`` is writable by the task's tools, even by ``write_file`` alone,
so git never reads it as a repository: its config could name a filter, an fsmonitor, a
hook folder, a pager, a signing program, an include. Each task has a private GIT_DIR
instead (``TaskDir.git``, in the spool, which the sandbox hides):

* its own ``config`` (no filters, no hooks) and ``info/attributes`` of
  ``* -filter -text -ident -diff -merge -working-tree-encoding``, which overrides any
  ``.gitattributes`` in the tree (git 2.39 has no flag that turns attributes off);
* its own objects, index and refs, and the repository's objects borrowed read-only
  through ``objects/info/alternates``, which names a folder of this GIT_DIR whose
  entries are symlinks to the repository's object folders: an ``info/alternates`` or
  ``commit-graph`` planted in the repository is never read;
* every run with ``GIT_CONFIG_NOSYSTEM=1``, ``GIT_CONFIG_GLOBAL=/dev/null``,
  ``GIT_ATTR_NOSYSTEM=1``, an explicit ``GIT_DIR`` and ``GIT_WORK_TREE``,
  ``-c core.hooksPath=/dev/null -c core.fsmonitor=false``, and an environment of only
  ``PATH``, ``HOME=/nonexistent``, ``LC_ALL=C`` and the ``GIT_*`` it needs; under the
  sandbox when it is on (``Sandbox.wrap``: the private GIT_DIR is mounted into that
  sandbox of git's own, never into a tool's).

Each turn boundary records the repository's HEAD commit (read from its files, not by
git) and a *snapshot commit* of the whole working tree (tracked changes and untracked
files, ``.gitignore`` respected), kept under ``refs/agentd/TASK/TURN`` of the private
GIT_DIR; the user's branch, index and stash are never touched, and nothing is written
into the repository. ``restore`` writes a snapshot's files back and removes files the
snapshot did not have; ``fork`` gives a fork a work tree of its own at a snapshot, with a
private GIT_DIR of its own that has the parent's snapshot objects.

A snapshot's blobs that the repository already had are borrowed, not copied: a
repository that drops them (a history rewrite, then ``git gc --prune``) leaves older
snapshots without them, and a restore of such a turn fails in one line.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from worker.errors import AgentdError
from worker.tools.sandbox import Sandbox, SandboxRefused

GIT_TIMEOUT = 30.0
#: What a private GIT_DIR's ``info/attributes`` says of every path: nothing git would
#: run or convert. It has the highest precedence of all attribute files.
NEUTRAL_ATTRIBUTES = "* -filter -text -ident -diff -merge -working-tree-encoding\n"
#: Options of every git run: no hook, no fsmonitor, whatever a config says.
GIT_OPTIONS = ("-c", "core.hooksPath=/dev/null", "-c", "core.fsmonitor=false")
_AUTHOR = {
    "GIT_AUTHOR_NAME": "agentd",
    "GIT_AUTHOR_EMAIL": "agentd@localhost",
    "GIT_COMMITTER_NAME": "agentd",
    "GIT_COMMITTER_EMAIL": "agentd@localhost",
}
_DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin"
_OBJECT_ID = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")
_SMALL_FILE = 4096  # HEAD, a ref, a gitdir: file
_PACKED_REFS_LIMIT = 64 * 1024 * 1024
_CONFIG = """\
[core]
\trepositoryformatversion = 0
\tbare = false
\tlogAllRefUpdates = false
\tuntrackedCache = false
\tsymlinks = true
[gc]
\tauto = 0
"""


class VcsError(AgentdError):
    """A git command failed; the message says which and why, in one line."""


@dataclass(frozen=True)
class Checkpoint:
    commit: str | None  # HEAD, None on a repository without commits
    snapshot: str  # a commit of the whole working tree


@dataclass(frozen=True)
class Repository:
    """A workspace's repository, as decided at submit: ``work_tree`` (the top of the
    checkout), ``git_dir`` (its HEAD; None for a fork's work tree, whose HEAD is its
    private GIT_DIR's) and ``common_dir`` (whose ``objects`` are borrowed)."""

    work_tree: Path
    git_dir: Path | None
    common_dir: Path

    def to_json(self) -> dict[str, Any]:
        return {
            "work_tree": str(self.work_tree),
            "git_dir": str(self.git_dir) if self.git_dir is not None else None,
            "common_dir": str(self.common_dir),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Repository:
        git_dir = data.get("git_dir")
        return cls(
            Path(str(data["work_tree"])),
            Path(str(git_dir)) if git_dir is not None else None,
            Path(str(data["common_dir"])),
        )


def discover(workspace: Path) -> Repository | None:
    """The repository whose work tree holds ``workspace`` (which need not exist yet), or
    None; found by reading files, as git's own discovery would, with no git run. Only a
    ``.git`` folder or ``gitdir:`` file counts: ``GIT_DIR`` and ``core.worktree`` do not."""
    start = Path(os.path.realpath(workspace))
    for folder in (start, *start.parents):
        dot = folder / ".git"
        if dot.is_dir():
            git_dir: Path | None = dot
        elif dot.is_file():
            git_dir = _gitdir_file(dot)
        else:
            continue
        if git_dir is None or not (git_dir / "HEAD").is_file():
            continue
        common = git_dir
        if (git_dir / "commondir").is_file():  # a linked worktree: objects are there
            common = git_dir / _read_small(git_dir / "commondir").strip()
        common = Path(os.path.realpath(common))
        if not (common / "objects").is_dir():
            continue
        return Repository(folder, Path(os.path.realpath(git_dir)), common)
    return None


def _gitdir_file(dot: Path) -> Path | None:
    text = _read_small(dot)
    if not text.startswith("gitdir: "):
        return None
    target = Path(text[len("gitdir: ") :].strip())
    target = target if target.is_absolute() else dot.parent / target
    return target if target.is_dir() else None


def _read_small(path: Path, limit: int = _SMALL_FILE) -> str:
    """A regular file's first bytes as text, '' for anything else (a FIFO is not waited
    on, a symlink to /dev/zero is not read past ``limit``)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return ""
    with open(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            return ""
        return f.read(limit).decode(errors="replace")


class Git:
    """Git of one task's work tree, through its private GIT_DIR ``private``; each run
    under the sandbox ``runner`` when one is given (``Sandbox.wrap``: bare where the
    sandbox would run a command bare), else bare."""

    def __init__(self, repo: Repository, private: Path, runner: Sandbox | None = None) -> None:
        self.repo = repo
        self.private = private
        self.runner = runner

    # -- the private GIT_DIR ------------------------------------------------------------

    def ensure(self, *, head: str | None = None) -> None:
        """Make the private GIT_DIR unless it is there: built beside, then renamed."""
        if (self.private / "config").is_file():
            return
        self.private.parent.mkdir(parents=True, exist_ok=True)
        build = Path(tempfile.mkdtemp(prefix=".git-", dir=self.private.parent))
        try:
            for folder in ("refs/heads", "refs/tags", "info", "objects/info", "borrowed"):
                (build / folder).mkdir(parents=True, exist_ok=True)
            (build / "HEAD").write_text(f"{head}\n" if head else "ref: refs/heads/agentd\n")
            (build / "config").write_text(_CONFIG + self._excludes())
            (build / "info" / "attributes").write_text(NEUTRAL_ATTRIBUTES)
            objects = self.repo.common_dir / "objects"
            for name in [f"{i:02x}" for i in range(256)] + ["pack"]:
                (build / "borrowed" / name).symlink_to(objects / name)
            alternates = build / "objects" / "info" / "alternates"
            # relative to the objects folder: the GIT_DIR may be made in a folder that is
            # then moved into place (a fork's task folder, built whole before it appears)
            alternates.write_text("../borrowed\n")
            os.rename(build, self.private)
        except FileExistsError:
            shutil.rmtree(build, ignore_errors=True)  # another process made it first
        except BaseException:
            shutil.rmtree(build, ignore_errors=True)
            raise

    def _excludes(self) -> str:
        """The repository's ``info/exclude`` still applies (patterns, nothing that runs)."""
        if self.repo.git_dir is None:
            return ""
        exclude = str(self.repo.common_dir / "info" / "exclude").replace("\\", "\\\\")
        return f'\texcludesFile = "{exclude.replace(chr(34), chr(92) + chr(34))}"\n'

    def env(self, **extra: str) -> dict[str, str]:
        """The whole environment of a git run."""
        return {
            "PATH": os.environ.get("PATH") or _DEFAULT_PATH,
            "HOME": "/nonexistent",
            "LC_ALL": "C",
            "GIT_CONFIG_NOSYSTEM": "1",
            "GIT_CONFIG_GLOBAL": "/dev/null",
            "GIT_ATTR_NOSYSTEM": "1",
            "GIT_TERMINAL_PROMPT": "0",
            "GIT_DIR": str(self.private),
            "GIT_WORK_TREE": str(self.repo.work_tree),
            **_AUTHOR,
            **extra,
        }

    def run(self, *args: str, index: Path | None = None) -> str:
        """``git ARGS`` on the work tree; its output, or a VcsError in one line."""
        env = self.env(**({"GIT_INDEX_FILE": str(index)} if index is not None else {}))
        argv = ["git", *GIT_OPTIONS, *args]
        try:
            if self.runner is not None:
                argv = self.runner.wrap(
                    argv,
                    self.repo.work_tree,
                    env,
                    binds=[self.private],
                    shown=[p for p in [self.repo.common_dir / "objects"] if p.is_dir()],
                )
        except SandboxRefused as exc:
            raise VcsError(f"git {args[0]} refused: {exc}") from None
        try:
            done = subprocess.run(
                argv,
                cwd=self.repo.work_tree,
                env=env,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=GIT_TIMEOUT,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise VcsError(f"git {args[0]} failed: {exc}") from None
        if done.returncode != 0:
            why = " ".join(done.stderr.split())[:300] or f"exit status {done.returncode}"
            raise VcsError(f"git {args[0]} failed: {why}")
        return done.stdout

    @contextlib.contextmanager
    def _scratch_index(self) -> Iterator[Path]:
        with tempfile.TemporaryDirectory(prefix="index-", dir=self.private) as tmp:
            yield Path(tmp) / "index"

    # -- what a checkpoint does ---------------------------------------------------------

    def head(self) -> str | None:
        """The commit HEAD names, or None (no commits yet, or a HEAD that is not one)."""
        if self.repo.git_dir is None:
            with contextlib.suppress(VcsError):
                return self.run("rev-parse", "-q", "--verify", "HEAD^{commit}").strip() or None
            return None
        return _ref_target(self.repo.git_dir, self.repo.common_dir)

    def tree(self) -> str:
        """A tree of the working tree as it is, through the private GIT_DIR's own index
        (kept between turns: unchanged files are not read again). When a blob that index
        borrowed is gone from the repository, the index is dropped and every file read
        again, so that the snapshot has it in the private objects."""
        try:
            self.run("add", "-A")
            return self.run("write-tree").strip()
        except VcsError:
            (self.private / "index").unlink(missing_ok=True)
            self.run("add", "-A")
            return self.run("write-tree").strip()

    def capture(self, task_id: str, turn: int) -> Checkpoint:
        """Record the work tree's files after ``turn``."""
        self.ensure()
        tree = self.tree()
        head = self.head()
        message = ("-m", f"agentd checkpoint {task_id} turn {turn}")
        try:
            snapshot = self.run("commit-tree", tree, *(["-p", head] if head else []), *message)
        except VcsError:
            if head is None:
                raise
            snapshot = self.run("commit-tree", tree, *message)  # HEAD's commit is gone
        snapshot = snapshot.strip()
        self.run("update-ref", f"refs/agentd/{task_id}/{turn}", snapshot)
        return Checkpoint(head, snapshot)

    def restore(self, snapshot: str) -> None:
        """Make the work tree's files exactly those of ``snapshot``."""
        self.ensure()
        current = set(self.ls_tree(self.tree()))
        self.checkout(snapshot)
        wanted = set(self.ls_tree(snapshot))
        root = self.repo.work_tree
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

    def checkout(self, snapshot: str) -> None:
        """Write ``snapshot``'s files into the work tree (through a scratch index)."""
        with self._scratch_index() as index:
            self.run("read-tree", snapshot, index=index)
            self.run("checkout-index", "-a", "-f", index=index)

    def ls_tree(self, treeish: str) -> list[str]:
        out = self.run("ls-tree", "-r", "-z", "--name-only", treeish)
        return [name for name in out.split("\0") if name]

    def fork(self, snapshot: str, work_tree: Path, private: Path) -> Git:
        """A new work tree at ``work_tree`` whose files are those of ``snapshot``, with a
        private GIT_DIR ``private`` of its own (HEAD at the snapshot, the parent's own
        objects copied, the repository's borrowed)."""
        child = Git(Repository(work_tree, None, self.repo.common_dir), private, self.runner)
        child.ensure(head=snapshot)
        shutil.copytree(
            self.private / "objects",
            private / "objects",
            ignore=shutil.ignore_patterns("info"),
            copy_function=_link_or_copy,
            dirs_exist_ok=True,
        )
        work_tree.mkdir(mode=0o700, parents=True, exist_ok=True)
        child.checkout(snapshot)
        return child


def _link_or_copy(source: str, target: str) -> None:
    """Objects never change once written: a hard link where the file system allows."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def _ref_target(git_dir: Path, common: Path) -> str | None:
    """What the repository's HEAD names, read from its files (loose ref, then
    packed-refs) with caps: a tool may have written any of them."""
    value = _read_small(git_dir / "HEAD").strip()
    for _ in range(5):  # a symbolic ref may name another
        if _OBJECT_ID.fullmatch(value):
            return value
        if not value.startswith("ref: refs/"):
            return None
        name = value[len("ref: ") :]
        if ".." in name.split("/") or "\0" in name:
            return None
        value = (
            _read_small(git_dir / name).strip()
            or _read_small(common / name).strip()
            or _packed(common, name)
        )
    return None


def _packed(common: Path, name: str) -> str:
    for line in _read_small(common / "packed-refs", _PACKED_REFS_LIMIT).splitlines():
        sha, _, ref = line.partition(" ")
        if ref == name and _OBJECT_ID.fullmatch(sha):
            return sha
    return ""


def git_of(spec_git: Mapping[str, Any] | None, private: Path, runner: Sandbox | None) -> Git | None:
    """The ``Git`` of a task whose spec recorded ``spec_git`` at submit, or None."""
    if not spec_git:
        return None
    return Git(Repository.from_json(spec_git), private, runner)
