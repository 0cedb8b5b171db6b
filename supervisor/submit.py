"""Submitting a task: checking what an operator gives, then making its folder.

* ``submit`` checks every input (the prompt, the tools, a script, the workspace) and
  raises before anything is written when one is bad.
* ``create_task`` makes the folder; the spec is written last, so a folder without
  ``spec.json`` is not a task yet and is never picked up half-made.
* Files an operator names (a prompt, a script, a supplied result) are read up to a cap.
* ``existing_task`` is how every other command finds a task by its id.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from supervisor.record import TaskRecord
from supervisor.stores import store_for
from worker.budget import Budget, price_of
from worker.config import Config
from worker.errors import ConfigError, NotFoundError, TaskSpecError, UsageError
from worker.events import Event, record_event, utc_now
from worker.mcp.naming import TOOL_PATTERN
from worker.spool import Spool, TaskDir, TaskSpec, new_task_id, normalize_tools, validate_task_id
from worker.store.durable import NotRegularFileError, private_dir, read_regular
from worker.store.files import refuse_symlinks

#: Caps on the files an operator names on the command line. Each is read up to its cap and
#: one byte more, never further, so a wrong path (``/dev/zero``, a log) is refused in one
#: line instead of being read into memory. A prompt and a supplied result become part of
#: every later model request; a script is a test fixture of model replies.
PROMPT_FILE_LIMIT = 1024 * 1024
SCRIPT_FILE_LIMIT = 16 * 1024 * 1024
RESULT_FILE_LIMIT = 1024 * 1024


def read_input(path: Path, limit: int, option: str) -> bytes:
    """The bytes of a file named by ``option``, at most ``limit`` of them; a UsageError in
    one line when it is missing, unreadable or larger."""
    try:
        data = read_regular(path, limit, follow_symlinks=True)
    except FileNotFoundError:
        raise UsageError(f"{option} {path}: no such file; check the path.") from None
    except NotRegularFileError as exc:
        raise UsageError(f"{option} {path} is {exc.strerror}; name a file.") from None
    except OSError as exc:
        raise UsageError(
            f"{option} {path}: cannot read it ({exc.strerror or exc}); check the path and its "
            "permissions."
        ) from None
    if len(data) > limit:
        raise UsageError(
            f"{option} {path} is larger than the {_size(limit)} a {option} may have; "
            "name the file you meant, or shorten it."
        )
    return data


def read_text_input(path: Path, limit: int, option: str) -> str:
    """``read_input`` as UTF-8 text."""
    try:
        return read_input(path, limit, option).decode()
    except UnicodeDecodeError:
        raise UsageError(f"{option} {path} is not UTF-8 text; save it as UTF-8.") from None


def checked_text(value: str | None, option: str) -> str | None:
    """``value`` when UTF-8 can hold it; a UsageError in one line when it cannot: an
    argument whose bytes were not UTF-8, which Python keeps as surrogate escapes, and no
    spec, journal or model request can carry."""
    if value is not None:
        try:
            value.encode()
        except UnicodeEncodeError:
            raise UsageError(
                f"{option} is not UTF-8 text (the shell passed bytes of another encoding); "
                "give it in UTF-8."
            ) from None
    return value


def _size(limit: int) -> str:
    return f"{limit // (1024 * 1024)} MiB" if limit % (1024 * 1024) == 0 else f"{limit} bytes"


def submit(
    spool: Spool,
    config: Config,
    *,
    prompt: str,
    name: str | None = None,
    model: str | None = None,
    script: Path | None = None,
    tools: Sequence[str] | None = None,
    system: str | None = None,
    max_turns: int = 100,
    workspace: Path | None = None,
    foreground: bool = False,
    budget: Budget | None = None,
    ask: Sequence[str] = (),
) -> TaskDir:
    """Create a queued task; raises before anything is written when an input is bad.
    ``foreground``: made by ``agentd run``, which runs its worker itself (the spec and the
    record say so: a daemon never starts it by itself). ``budget``: what it may spend
    (None: ``[budget]``); a USD budget for a model without a price is a ConfigError."""
    # Imported here: `agentd status` and the daemon import this module and need neither.
    from worker.mcp.catalog import check_patterns  # noqa: PLC0415
    from worker.models.scripted import parse_script  # noqa: PLC0415
    from worker.tools.registry import ToolRegistry  # noqa: PLC0415

    task_id = validate_task_id(name) if name is not None else new_task_id()
    checked_text(prompt, "--prompt")
    checked_text(system, "--system")
    checked_text(model, "--model")
    if not prompt.strip():
        raise UsageError("the prompt is empty; give --prompt TEXT or --prompt-file FILE.")
    if max_turns < 1:
        raise UsageError("--max-turns must be at least 1.")
    budget = config.budget if budget is None else budget
    task_model = config.model.name if model in (None, "scripted") else model
    if budget.usd is not None and price_of(task_model, config.price_table) is None:
        where = config.source or "the config"
        raise ConfigError(
            f"a USD budget needs the price of the model, and {task_model!r} has none; add "
            f'[prices."{task_model}"] (input, output, ... in USD per million tokens) to '
            f"{where}, or give --budget-tokens instead."
        )
    tool_names = normalize_tools(tools)
    try:
        local = ToolRegistry.standard(config.tools.modules, source=config.source).names()
        check_patterns(tool_names or (), local, list(config.mcp.servers))
    except TaskSpecError as exc:
        raise UsageError(str(exc)) from None
    asked = normalize_tools(ask) or ()
    for pattern in asked:
        if not TOOL_PATTERN.fullmatch(pattern):
            raise UsageError(
                f"--ask {pattern[:80]!r} is no tool name or glob (letters, digits, _, -, *, ?, "
                '[...]), such as "run_command" or "mcp__git__git_commit".'
            )
    script_bytes: bytes | None = None
    if script is not None:
        script_bytes = read_input(script, SCRIPT_FILE_LIMIT, "--script")
        try:
            parse_script(script_bytes, str(script))
        except TaskSpecError as exc:
            raise UsageError(str(exc)) from None
    if workspace is not None:
        workspace = workspace.expanduser().absolute()
        if workspace.exists() and not workspace.is_dir():
            raise UsageError(f"--workspace {workspace} exists and is not a folder.")
        refuse_spool_exposure(spool, task_id, workspace)
    spec = TaskSpec(
        id=task_id,
        prompt=prompt,
        model=None if model == "scripted" else model,
        system=system,
        tools=tool_names,
        max_turns=max_turns,
        workspace=str(workspace) if workspace else None,
        git=_repository(workspace),
        scripted=script is not None or model == "scripted",
        created_at=utc_now(),
        foreground=foreground,
        budget=budget,
        ask=asked,
    )
    if spec.scripted and script_bytes is None:
        raise UsageError("the scripted model needs --script FILE with its responses.")
    if spool.shared is None:
        return create_task(spool, spec, script_bytes)
    # On a shared store a task's default workspace is a path every node of this machine
    # reaches: the one in the submitting node's spool, named in the spec (a task folder
    # of another spool is not the same folder); nodes elsewhere need --workspace on a
    # shared mount (docs/guides/cluster.md). It is made now, so that a node that
    # cannot see it can tell (``ClusterPlacement._unseen_workspace``).
    folder = Path(spec.workspace) if spec.workspace else spool.task(task_id).path / "workspace"
    spec = dataclasses.replace(spec, workspace=str(folder))

    def prepare(_: Path | None) -> None:
        if folder.parent == spool.task(task_id).path:  # the default: in the spool, private
            spool.ensure()
            private_dir(folder.parent)
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)

    return create_task(spool, spec, script_bytes, prepare=prepare)


def refuse_spool_exposure(spool: Spool, task_id: str, workspace: Path) -> None:
    """A UsageError when ``workspace`` is the spool, in it (but for the task's own default
    workspace) or holds it: the tools would reach every task's journal and decisions
    there, through the file tools and where the sandbox is off. Symlinks are resolved."""
    root = Path(os.path.realpath(spool.root))
    real = Path(os.path.realpath(workspace))
    if real == Path(os.path.realpath(spool.task(task_id).path / "workspace")):
        return
    if real.is_relative_to(root):
        where, instead = "is" if real == root else "is in", root.parent / "work"
    elif root.is_relative_to(real):
        where, instead = "holds", real / "work"
    else:
        return
    raise UsageError(
        f"--workspace {workspace} {where} the spool {spool.root}, which a task's tools must "
        f"never reach; give a project folder of its own, such as {instead}."
    )


def _repository(workspace: Path | None) -> dict[str, Any] | None:
    """The repository of a workspace given with --workspace (``worker.vcs.discover``);
    a task's own workspace is never one (it is made empty, and what a tool puts in it
    later is the tool's)."""
    from worker import vcs  # noqa: PLC0415  (git: only a submit with --workspace needs it)

    repo = vcs.discover(workspace) if workspace is not None else None
    return repo.to_json() if repo is not None else None


def create_task(
    spool: Spool,
    spec: TaskSpec,
    script: bytes | None,
    *,
    journal: Sequence[dict[str, Any]] = (),
    prepare: Callable[[Path | None], None] | None = None,
) -> TaskDir:
    """Create the task in the spool's store (``TaskStore.create``): a queued record, a
    fork's first ``journal`` records, and what ``prepare`` adds beside them (a fork's
    workspace) before the spec, which is written last: until then it is not a task."""
    store = store_for(spool)
    record = TaskRecord(foreground=spec.foreground)
    store.create(spec, record.stamped(), script=script, journal=journal, prepare=prepare)
    record_event(store, spec.id, Event.TASK_SUBMITTED, task=spec.id)
    return spool.task(spec.id)


def listed_tasks(spool: Spool) -> list[TaskDir]:
    """Every task the spool's store lists (``TaskStore.task_ids``), in id order."""
    store = store_for(spool)
    return [spool.task(task_id) for task_id in store.task_ids()]


def existing_task(spool: Spool, task_id: str) -> TaskDir:
    task = spool.task(task_id)
    refuse_symlinks(task)
    if not store_for(spool).exists(task_id):
        raise NotFoundError(f"no task {task_id!r} in {spool.root}; `agentd status` lists them.")
    return task
