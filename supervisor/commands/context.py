"""What a command works on, as the operator named it: the spool (``--spool``,
``$AGENTD_SPOOL``, the config), the shared store (``--store`` and its other sources), this
node's name; the text given inline or in a file; and how an answer is printed as JSON."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from supervisor.coordination import running_pid
from supervisor.stores import recorded_store
from supervisor.submit import checked_text, read_text_input
from worker import credentials
from worker.config import NODE_NAME, Config
from worker.errors import SpoolError, UsageError, quoted
from worker.paths import default_spool
from worker.protocol import NODE_ENV
from worker.spool import Spool


def named_spool(args: argparse.Namespace) -> tuple[Path, str] | None:
    """The spool the operator named (``--spool``, else ``$AGENTD_SPOOL``) and how."""
    if args.spool:
        return Path(args.spool).expanduser().absolute(), "--spool"
    if env := os.environ.get("AGENTD_SPOOL"):
        return Path(env).expanduser().absolute(), "$AGENTD_SPOOL"
    return None


def resolve_spool(args: argparse.Namespace, config: Config) -> Spool:
    if named := named_spool(args):
        return Spool(named[0])
    if os.environ.get("STATE_DIRECTORY"):
        return Spool(default_spool())
    if config.spool is not None:
        return Spool(config.spool.expanduser().absolute())
    return Spool(default_spool())


def store_url(args: argparse.Namespace, config: Config, spool: Spool) -> str | None:
    """The shared store's URL, first of: ``--store``, ``$AGENTD_STORE`` (or what a daemon
    holds of it: ``credentials``; only that secret is read, so a command never fails on
    another's source), the config's ``store``, the store a node on ``spool`` recorded
    (without its password: libpq's own sources give it); None: the spool's files."""
    held = credentials.held().get(credentials.STORE)
    return (
        args.store
        or held
        or credentials.gather(os.environ, [credentials.STORE]).get(credentials.STORE)
        or config.store
        or recorded_store(spool.root)
    )


def node_name(args: argparse.Namespace, config: Config) -> str | None:
    """This node's name: ``--node``, ``$AGENTD_NODE``, the config's ``node``; None: the
    hostname (the store's default)."""
    name = args.node or os.environ.get(NODE_ENV) or config.node
    if name is not None and not NODE_NAME.fullmatch(name):
        raise UsageError(
            f"--node {quoted(name)} is not a name of letters, digits, '.', '_' and '-' "
            "(at most 63, starting with a letter or digit)."
        )
    return name


def check_named_spool(args: argparse.Namespace) -> None:
    """A command that reads a spool the operator named refuses one that does not exist:
    a typo in ``--spool`` must not look like an empty system (docs/design.md section 2)."""
    named = named_spool(args)
    if named is not None and not named[0].exists():
        path, how = named
        raise SpoolError(
            f"no spool at {path} (named by {how}); check the path, or create the spool "
            f"with `agentd --spool {path} start` (or `submit`)."
        )


def text_or_file(text: str | None, path: str | None, option: str, limit: int) -> str | None:
    """The value of ``--OPTION TEXT`` or the contents of ``--OPTION-file F`` (at most
    ``limit`` bytes: see ``PROMPT_FILE_LIMIT``)."""
    if path is None:
        return checked_text(text, f"--{option}")
    return read_text_input(Path(path), limit, f"--{option}-file")


def say_it_waits(spool: Spool, task_id: str) -> None:
    """Beside a new task's id (``submit``, ``fork``), on a spool where no daemon runs: say on
    stderr that the task waits ``queued`` until one starts, rather than nothing."""
    if spool.shared is None and running_pid(spool) is None:
        print(
            f"agentd: note: no daemon runs on {spool.root}; {task_id} waits queued until "
            "`agentd start`.",
            file=sys.stderr,
        )


def out(obj: Any) -> None:
    print(json.dumps(obj, indent=2, default=str))
