"""``python -m worker TASK_DIR``: run one task until it ends, holds or is stopped.

Exit codes are listed in docs/ARCHITECTURE.md (0 done, 3 failed, 4 held, 5 stopped,
6 locked, 7 storage fault, 78 configuration error; anything else is a crash).

Started as a process of its own, the worker first takes over its secrets
(``worker.credentials.take_over``: handed over by the daemon through a pipe, never in its
environment); forked from the fork server, it holds them already.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from worker import credentials
from worker.config import load_config
from worker.descendants import contained
from worker.errors import (
    AgentdError,
    ConfigError,
    InvalidIdError,
    JournalCorruptError,
    LockBusyError,
    StorageError,
    TaskSpecError,
)
from worker.heartbeat import Heartbeat
from worker.lock import TaskLock
from worker.loop import (
    EXIT_CONFIG,
    EXIT_FAILED,
    EXIT_LOCKED,
    EXIT_STORAGE,
    AgentLoop,
    Outcome,
    write_exit,
)
from worker.models.base import Model
from worker.spool import TaskDir, TaskSpec
from worker.tools.registry import ToolRegistry


def make_model(task: TaskDir, spec: TaskSpec) -> Model:
    if spec.scripted:
        from worker.models.scripted import ScriptedModel  # noqa: PLC0415

        return ScriptedModel.from_file(task.script)
    # The SDK's import (seconds, cold) is part of start-up, never of the first model
    # call, whose deadline would otherwise pay for it (free after the fork server's).
    import anthropic  # noqa: F401, PLC0415

    from worker.models.messages_api import MessagesAPIModel  # noqa: PLC0415

    held = credentials.held()
    return MessagesAPIModel(
        api_key=held.get(credentials.API_KEY), auth_token=held.get(credentials.AUTH_TOKEN)
    )


def run(task_path: Path, config_path: Path | None) -> int:
    task = TaskDir(task_path.parent.parent, task_path.name)
    try:
        lock = TaskLock(task.lock).acquire(wait=1.0)
    except LockBusyError as exc:
        print(f"agentd worker: {exc}", file=sys.stderr)
        return EXIT_LOCKED
    except OSError as exc:  # no such task folder, or its lock is not a file of ours
        outcome = Outcome(
            "failed", f"cannot take the lock {task.lock}: {exc.strerror}", EXIT_FAILED
        )
        write_exit(task, outcome)
        print(f"agentd worker: {outcome.reason}", file=sys.stderr)
        return EXIT_FAILED
    with lock, contained(task.events, task=task.id):  # no tool process outlives it
        try:
            config = load_config(config_path)
        except ConfigError as exc:
            write_exit(task, Outcome("failed", str(exc), EXIT_CONFIG))
            print(f"agentd worker: {exc}", file=sys.stderr)
            return EXIT_CONFIG
        try:
            spec = task.load_spec()
            tools = ToolRegistry.standard(config.tools.modules, source=config.source).narrowed(
                spec.tools
            )
            workspace = task.workspace_for(spec)
            workspace.mkdir(mode=0o700, parents=True, exist_ok=True)
            if spec.workspace is None and workspace.is_symlink():
                raise TaskSpecError(
                    f"{workspace} is a symlink; a task's own workspace must be a folder "
                    "inside the spool (give --workspace to use a folder elsewhere)."
                )
            model = make_model(task, spec)
        except AgentdError as exc:
            outcome = Outcome("failed", str(exc), EXIT_FAILED)
            write_exit(task, outcome)
            print(f"agentd worker: {exc}", file=sys.stderr)
            return outcome.exit_code
        heartbeat = Heartbeat(task.heartbeat, config.heartbeat.interval)
        loop = AgentLoop(task, spec, config, model, tools, heartbeat)
        loop.install_signal_handlers()
        try:
            state = loop.open()
        except JournalCorruptError as exc:  # the task cannot go on: failed, with the reason
            outcome = Outcome("failed", str(exc), EXIT_FAILED)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            # whole frames whose records do not have the shape of ours: the same verdict
            # (restarting would only replay them again, into a crash loop)
            reason = (
                f"{task.journal}: a record cannot be replayed ({type(exc).__name__}: {exc}); "
                "restore the task folder from a backup or fork the task from an earlier turn."
            )
            outcome = Outcome("failed", reason, EXIT_FAILED)
        except StorageError as exc:  # nothing was changed: resume later
            outcome = Outcome("stopped", str(exc), EXIT_STORAGE)
        else:
            heartbeat.update(turn=state.turn, usage=state.usage_total.to_json())
            heartbeat.start()
            outcome = loop.run()
        finally:
            heartbeat.stop()
            loop.close()
        write_exit(task, outcome)
        print(f"agentd worker: task {task.id} {outcome.state}: {outcome.reason}", file=sys.stderr)
        return outcome.exit_code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m worker", description=__doc__)
    parser.add_argument("task_dir", type=Path, help="the task's folder: SPOOL/tasks/ID")
    parser.add_argument("--config", type=Path, default=None)
    args = parser.parse_args(argv)
    os.umask(0o077)
    task_dir = args.task_dir.absolute()
    if ".." in task_dir.parts or task_dir.parent.name != "tasks":
        print(f"agentd worker: {task_dir} is not a task folder (SPOOL/tasks/ID)", file=sys.stderr)
        return 2
    try:
        return run(task_dir, args.config)
    except InvalidIdError as exc:
        print(f"agentd worker: {exc}", file=sys.stderr)
        return 2


def process_main() -> int:
    """``python -m worker``: ``main`` in a process of its own, once its secrets are held."""
    try:
        credentials.take_over()
    except ConfigError as exc:
        print(f"agentd worker: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    return main()


if __name__ == "__main__":
    sys.exit(process_main())
