"""Months of tasks (docs/design.md section 20): ``agentd prune``, ``agentd archive`` and
``agentd restore``. Each works with or without a running daemon: a removed task's folder
is gone in one step, and the daemon, rung, lets go of it."""

from __future__ import annotations

import argparse
from datetime import UTC, datetime
from pathlib import Path

from supervisor.commands.parsing import Commands
from supervisor.coordination import ring
from supervisor.operator import Operator
from supervisor.stores import store_for
from supervisor.submit import existing_task
from worker.config import Config, parse_period
from worker.errors import UsageError
from worker.events import Event, record_event
from worker.spool import Spool


def add_parser(commands: Commands) -> None:
    p = commands.add(
        "prune", cmd_prune, "remove ended tasks (named, by age and state, or by [retention])"
    )
    p.add_argument("tasks", nargs="*", metavar="TASK", help="ended tasks to remove")
    p.add_argument(
        "--older-than", metavar="PERIOD", help='ended longer ago than this ("7d", "12h", seconds)'
    )
    p.add_argument("--state", metavar="STATES", help="only these end states: done,failed,cancelled")
    p.add_argument(
        "--dry-run", action="store_true", help="print what would be removed, remove nothing"
    )
    p = commands.add("archive", cmd_archive, "write ended tasks whole into a .tar.gz archive")
    p.add_argument("tasks", nargs="+", metavar="TASK", help="ended tasks to archive")
    p.add_argument("--to", required=True, metavar="FILE", help="the archive to write (.tar.gz)")
    p = commands.add("restore", cmd_restore, "bring the tasks of an archive back into the spool")
    p.add_argument("archive", metavar="FILE", help="an archive `agentd archive` wrote")


def _files_only(spool: Spool, verb: str) -> None:
    if spool.shared is not None:
        raise UsageError(
            f"agentd {verb} works on a spool's files; a shared store's tasks are kept until "
            "it is supported there."
        )


def cmd_prune(args: argparse.Namespace, config: Config, spool: Spool) -> int:
    from supervisor import retention  # noqa: PLC0415  (tarfile, hashlib: these commands alone)

    _files_only(spool, "prune")
    older = None
    if args.older_than is not None:
        older = parse_period(args.older_than)
        if older is None:
            raise UsageError(
                f'--older-than takes a period such as "7d", "12h" or seconds, got '
                f"{args.older_than!r}."
            )
    selection = retention.PruneRequest(
        names=tuple(args.tasks), older_than=older, states=retention.checked_states(args.state)
    )
    if not args.dry_run:
        for task_id in retention.finish_removals(spool):
            print(f"removed {task_id} (a removal cut off before, finished)")
    now = datetime.now(UTC)
    archive_to = config.retention.archive_to
    chosen = list(retention.candidates(spool, selection, config.retention, now))
    for task, why in chosen:
        if args.dry_run:
            print(f"would remove {task.id} ({why})")
            continue
        archive = retention.remove(spool, task.id, archive_to=archive_to)
        ring(spool, task.id)
        kept = f"; archived to {archive}" if archive is not None else ""
        print(f"removed {task.id} ({why}{kept})")
    verb = "would remove" if args.dry_run else "removed"
    print(f"{verb} {len(chosen)} task{'s' if len(chosen) != 1 else ''}")
    return 0


def cmd_archive(args: argparse.Namespace, config: Config, spool: Spool) -> int:
    from supervisor import retention  # noqa: PLC0415  (tarfile, hashlib: these commands alone)

    _files_only(spool, "archive")
    tasks = [existing_task(spool, name) for name in dict.fromkeys(args.tasks)]
    dest = Path(args.to)
    manifest = retention.write_archive(spool, tasks, dest)
    who = Operator.here().fields()
    for entry in manifest["tasks"]:
        record_event(
            store_for(spool),
            entry["id"],
            Event.TASK_ARCHIVED,
            task=entry["id"],
            archive=str(dest.absolute()),
            **who,
        )
        print(f"archived {entry['id']} ({entry['state']}, {len(entry['files'])} files)")
    print(f"wrote {dest.absolute()}; `agentd prune {' '.join(args.tasks)}` removes them now")
    return 0


def cmd_restore(args: argparse.Namespace, config: Config, spool: Spool) -> int:
    from supervisor import retention  # noqa: PLC0415  (tarfile, hashlib: these commands alone)

    _files_only(spool, "restore")
    who = Operator.here().fields()
    archive = Path(args.archive)
    for task_id in retention.restore(spool, archive):
        record_event(
            store_for(spool),
            task_id,
            Event.TASK_RESTORED,
            task=task_id,
            archive=str(archive.absolute()),
            **who,
        )
        ring(spool, task_id)
        print(f"restored {task_id}")
    return 0
