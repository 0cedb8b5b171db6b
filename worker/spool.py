"""The spool: where tasks live on disk, and the task spec.

``Spool`` is the root folder; ``TaskDir`` names every file of one task (the layout is
documented in docs/ARCHITECTURE.md and docs/reference/spool.md). Ids are validated before they touch
the filesystem, so no id can name a path outside ``SPOOL/tasks``.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import stat
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from worker.budget import Budget
from worker.errors import InvalidIdError, NotFoundError, TaskSpecError, quoted
from worker.store.durable import open_private, private_dir, read_json

if TYPE_CHECKING:
    from worker.store.base import SharedStore

SPEC_VERSION = 1
TASK_ID = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")
CALL_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")


def validate_task_id(task_id: str) -> str:
    if not TASK_ID.fullmatch(task_id) or task_id in (".", ".."):
        raise InvalidIdError(
            f"invalid task id {quoted(task_id)}: use 1 to 64 characters of a-z, 0-9, '.', '_' "
            "and '-', starting with a letter or digit."
        )
    return task_id


def validate_call_id(call_id: str) -> str:
    if not CALL_ID.fullmatch(call_id):
        raise InvalidIdError(
            f"invalid call id {quoted(call_id)}: call ids are 1 to 128 characters of "
            "A-Z, a-z, 0-9, '_' and '-'; copy it from `agentd dangling`."
        )
    return call_id


def new_task_id() -> str:
    return f"t-{os.urandom(4).hex()}"


@dataclass(frozen=True)
class TaskSpec:
    """What a task is asked to do: written once by ``agentd submit``."""

    id: str
    prompt: str
    model: str | None = None
    system: str | None = None
    tools: tuple[str, ...] | None = None
    max_turns: int = 100
    max_tokens: int | None = None
    #: What it may spend (worker.budget): ``submit --budget-usd/--budget-tokens``, else
    #: ``[budget]``, as of the submit; ``agentd budget`` changes it later, in the store.
    budget: Budget = field(default_factory=Budget)
    workspace: str | None = None
    scripted: bool = False
    forked_from: Mapping[str, Any] | None = None
    #: The workspace's repository, decided at submit (``worker.vcs.Repository``), or None:
    #: the workspace's files are then never checkpointed, whatever appears in it later.
    git: Mapping[str, Any] | None = None
    created_at: str = ""
    #: Made by ``agentd run``, whose process runs its worker: a daemon never starts it by
    #: itself (docs/design.md section 16). How the task was made; who runs it now is the
    #: task record's ``foreground``.
    foreground: bool = False
    extra: Mapping[str, Any] = field(default_factory=dict)
    #: ``submit --ask``: tools (names and globs) whose calls wait for an operator's
    #: approval before they run, besides ``[tools] ask`` (docs/guides/tools.md)
    ask: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["v"] = SPEC_VERSION
        data["tools"] = list(self.tools) if self.tools is not None else None
        data["ask"] = list(self.ask)
        return data

    @classmethod
    def from_json(cls, data: Any, *, where: str) -> TaskSpec:
        def bad(what: str) -> TaskSpecError:
            return TaskSpecError(f"{where}: {what}; resubmit the task with `agentd submit`.")

        if not isinstance(data, dict):
            raise bad("the spec is not a JSON object")
        if data.get("v") != SPEC_VERSION:
            raise bad(f"spec version {data.get('v')!r} is not {SPEC_VERSION}")
        try:
            validate_task_id(str(data.get("id")))
        except InvalidIdError as exc:
            raise bad(str(exc).rstrip(".")) from None
        _expect(data, "prompt", str, bad)
        for key in ("model", "system", "workspace"):
            _expect(data, key, (str, type(None)), bad)
        for key in ("max_tokens", "token_budget"):
            _expect(data, key, (int, type(None)), bad)
        try:  # (a spec of 0.1 has a token_budget: the same limit, by tokens)
            budget = Budget.from_json(data.get("budget") or {"tokens": data.get("token_budget")})
        except ValueError as exc:
            raise bad(str(exc)) from None
        _expect(data, "max_turns", int, bad)
        if data["max_turns"] < 1:
            raise bad("max_turns must be at least 1")
        tools = data.get("tools")
        if tools is not None and (
            not isinstance(tools, list) or not all(isinstance(t, str) for t in tools)
        ):
            raise bad("tools must be a list of tool names or null")
        ask = data.get("ask") or []
        if not isinstance(ask, list) or not all(isinstance(t, str) for t in ask):
            raise bad("ask must be a list of tool names")
        forked = data.get("forked_from")
        if forked is not None and not isinstance(forked, dict):
            raise bad("forked_from must be an object or null")
        git = data.get("git")
        if git is not None and not (
            isinstance(git, dict)
            and all(isinstance(git.get(k), str) for k in ("work_tree", "common_dir"))
            and isinstance(git.get("git_dir"), (str, type(None)))
        ):
            raise bad("git must be an object with work_tree, git_dir and common_dir, or null")
        return cls(
            id=data["id"],
            prompt=data["prompt"],
            model=data.get("model"),
            system=data.get("system"),
            tools=tuple(tools) if tools is not None else None,
            max_turns=data["max_turns"],
            max_tokens=data.get("max_tokens"),
            budget=budget,
            workspace=data.get("workspace"),
            scripted=bool(data.get("scripted", False)),
            forked_from=forked,
            git=git,
            created_at=str(data.get("created_at", "")),
            foreground=data.get("foreground") is True,
            extra=data.get("extra") or {},
            ask=tuple(ask),
        )


def _expect(data: Mapping[str, Any], key: str, kind: Any, bad: Any) -> None:
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, kind):
        raise bad(f"field {key!r} has the wrong type ({type(value).__name__})")


@dataclass(frozen=True)
class TaskDir:
    """The files of one task. Constructing one validates the id. ``shared``: the shared
    store its spool is on (``Spool.on``), None for the spool's own files."""

    root: Path
    id: str
    shared: SharedStore | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        validate_task_id(self.id)

    # The paths are cached: the daemon asks for them for every task, every tick, and
    # status for every task of the spool.
    @functools.cached_property
    def path(self) -> Path:
        return self.root / "tasks" / self.id

    @functools.cached_property
    def spec(self) -> Path:
        return self.path / "spec.json"

    @functools.cached_property
    def script(self) -> Path:
        return self.path / "script.json"

    @functools.cached_property
    def journal(self) -> Path:
        return self.path / "journal"

    @functools.cached_property
    def snapshot(self) -> Path:
        return self.path / "snapshot"

    @functools.cached_property
    def lock(self) -> Path:
        return self.path / "lock"

    @functools.cached_property
    def heartbeat(self) -> Path:
        return self.path / "heartbeat.json"

    @functools.cached_property
    def exit(self) -> Path:
        return self.path / "exit.json"

    @functools.cached_property
    def state(self) -> Path:
        return self.path / "state.json"

    @functools.cached_property
    def events(self) -> Path:
        return self.path / "events.jsonl"

    @functools.cached_property
    def output(self) -> Path:
        return self.path / "worker.log"

    @functools.cached_property
    def git(self) -> Path:
        """The task's private GIT_DIR (``worker.vcs``), when its workspace is under git."""
        return self.path / "git"

    @functools.cached_property
    def decisions(self) -> Path:
        return self.path / "decisions"

    @functools.cached_property
    def cancellation(self) -> Path:
        """The operator's cancel, once made: created exclusively, never removed (a cancel
        is final, and no decision of the task is carried out after it)."""
        return self.path / "cancelled.json"

    def decision_file(self, key: str, attempt: int) -> Path:
        """Where the decision on one attempt of a held call lives. Named by the call's
        idempotency key, which is unique per call, per branch and per task, so a decision
        can never apply to a namesake call after a rewind."""
        return self.decisions / f"{validate_call_id(key)}.{attempt}.json"

    def exists(self) -> bool:
        """Whether the folder holds a task: its spec is a file, or the folder cannot be
        looked into (owned by another user, say). A task that cannot be read is still a
        task: it is shown ``failed`` with its reason, never taken for an empty folder."""
        try:
            return stat.S_ISREG(os.stat(self.spec, follow_symlinks=False).st_mode)
        except (FileNotFoundError, NotADirectoryError):
            return False
        except OSError:
            return True

    def load_spec(self) -> TaskSpec:
        try:
            data = read_json(self.spec)
        except FileNotFoundError:
            raise NotFoundError(
                f"no task {self.id!r} in {self.root}; `agentd status` lists the tasks."
            ) from None
        except (OSError, ValueError) as exc:
            raise TaskSpecError(
                f"{self.spec}: cannot read the task spec ({exc}); resubmit the task."
            ) from None
        spec = TaskSpec.from_json(data, where=str(self.spec))
        if spec.id != self.id:
            raise TaskSpecError(f"{self.spec}: spec names task {spec.id!r}, not {self.id!r}.")
        return spec

    def workspace_for(self, spec: TaskSpec) -> Path:
        return Path(spec.workspace) if spec.workspace else self.path / "workspace"

    @property
    def spool(self) -> Spool:
        """The spool this task is in, on the same store."""
        return Spool(self.root, self.shared)


@dataclass(frozen=True)
class Spool:
    """The spool at ``root``, and the store its tasks are in: ``shared``, the shared store
    that several nodes serve (``on``), or None for the spool's own files. The store is
    handed in with the spool, so nothing of the supervisor looks it up
    (``supervisor.stores.store_for``)."""

    root: Path
    shared: SharedStore | None = field(default=None, compare=False, repr=False)

    def on(self, shared: SharedStore | None) -> Spool:
        """This spool, its tasks on ``shared`` (None: its own files)."""
        return replace(self, shared=shared)

    @property
    def tasks_dir(self) -> Path:
        return self.root / "tasks"

    @property
    def relay_dir(self) -> Path:
        """Where the daemon keeps how far it relayed each task's events
        (``supervisor.relay.CursorFiles``)."""
        return self.root / "relay"

    @property
    def inbox(self) -> Path:
        """The daemon's doorbell (``supervisor.inbox``): a file made here wakes it about the
        task the file is named for."""
        return self.root / "inbox"

    def ring(self, task_id: str, *, once: bool = False) -> None:
        """Tell a daemon on this spool that ``task_id`` changed (harmless when none runs):
        a file in the inbox named for the task, which the daemon takes. ``once``: the one
        file of the task, made again while it waits (a worker's events: however many, at
        most one file waits for a daemon); else a file of this ring's own."""
        name = f"{task_id}.events.0" if once else f"{task_id}.{os.getpid()}.{time.monotonic_ns()}"
        with contextlib.suppress(OSError):
            os.close(open_private(private_dir(self.inbox) / name, os.O_CREAT | os.O_WRONLY))

    @property
    def tmp_dir(self) -> Path:
        """Where a task folder is made before it is moved into ``tasks`` whole."""
        return self.root / "tmp"

    def ensure(self) -> Spool:
        private_dir(self.root)
        private_dir(self.tasks_dir)
        private_dir(self.relay_dir)
        return self

    def task(self, task_id: str) -> TaskDir:
        """The folder of ``task_id``; ``SpoolError`` for an id that is not valid."""
        return _task_dir(self.root, task_id, self.shared)

    def task_ids(self) -> list[str]:
        """Ids of the task folders; a symlink planted in ``tasks/`` is never followed."""
        try:
            entries = list(os.scandir(self.tasks_dir))
        except FileNotFoundError:
            return []
        return sorted(
            e.name
            for e in entries
            if TASK_ID.fullmatch(e.name)
            and e.name not in (".", "..")
            and e.is_dir(follow_symlinks=False)
        )

    def tasks(self) -> Iterator[TaskDir]:
        for task_id in self.task_ids():
            yield self.task(task_id)


@functools.lru_cache(maxsize=4096)
def _task_dir(root: Path, task_id: str, shared: SharedStore | None) -> TaskDir:
    """The ``TaskDir`` of a task, kept: it caches its paths, and the daemon (every tick),
    the stores and status (every task) ask for the same tasks again and again. The 4,096
    most recent at most, some 12 MB."""
    return TaskDir(root, task_id, shared)


def normalize_tools(names: Sequence[str] | None) -> tuple[str, ...] | None:
    if names is None:
        return None
    return tuple(dict.fromkeys(n.strip() for n in names if n.strip()))
