"""What an operator does to a task: ``agentd cancel``, ``retry``, ``budget``; its held calls
(``dangling``, ``approve-dangling``); its history changed (``rewind``, ``fork``). Each works
with or without a running daemon: with one, the change is written durably and its inbox
rung; without one, the command takes the supervisor lock and applies it itself."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from supervisor.actions import EVERY_CALL, approve, cancel, retry, unsafe_rerun
from supervisor.commands.context import out, text_or_file
from supervisor.commands.parsing import Commands, json_flag, task_arg
from supervisor.control import Fenced
from supervisor.operator import Operator
from supervisor.overview import dangling_rows
from supervisor.status import STAGE_BEFORE
from supervisor.submit import RESULT_FILE_LIMIT, checked_text
from worker.config import Config
from worker.errors import UsageError
from worker.protocol import DecisionAction
from worker.spool import Spool


def add_parser(commands: Commands) -> None:
    p = commands.add("dangling", cmd_dangling, "list held dangling calls")
    task_arg(p, optional=True)
    json_flag(p, "the held calls")
    p = commands.add("approve-dangling", cmd_approve, "decide a held call (default: re-run it)")
    task_arg(p)
    p.add_argument("call_id", nargs="?", metavar="CALL_ID", help="the held call (or --all)")
    p.add_argument("--all", action="store_true", help="decide every held call of the task")
    p.add_argument(
        "--attempt",
        type=int,
        metavar="N",
        help="the attempt of the call this decision answers (refused if it was held again)",
    )
    p.add_argument("--rerun", action="store_true", help="run it (an unsafe call: again)")
    p.add_argument("--skip", action="store_true", help="do not run it; the model gets an error")
    p.add_argument("--reason", metavar="TEXT", help="with --skip: why, for the model")
    p.add_argument("--result", metavar="TEXT", help="do not run it; record this verified outcome")
    p.add_argument("--result-file", metavar="FILE", help="as --result, read from FILE")
    p = commands.add("cancel", cmd_cancel, "stop a task for good")
    task_arg(p)
    p = commands.add("retry", cmd_retry, "give a failed task a fresh restart budget")
    task_arg(p)
    p = commands.add(
        "budget", cmd_budget, "set or remove a task's budget; a task held on it resumes"
    )
    task_arg(p)
    p.add_argument("--usd", metavar="X", help="the most it may spend, in US dollars (or none)")
    p.add_argument("--tokens", metavar="N", help="the most tokens it may spend (or none)")
    p = commands.add("rewind", cmd_rewind, "put a task back to the scene after a turn")
    task_arg(p)
    p.add_argument("--to", type=int, required=True, metavar="TURN", help="the turn to go back to")
    p.add_argument("--restore-workspace", action="store_true", help="also restore files (git)")
    p.add_argument("--yes", action="store_true", help="rewind past calls it cannot undo")
    p = commands.add("fork", cmd_fork, "a new task starting from the scene after a turn")
    task_arg(p)
    p.add_argument("--at", type=int, required=True, metavar="TURN", help="the turn to start from")
    p.add_argument("--name", metavar="ID", help="the new task's id (default: generated)")
    p.add_argument("--prompt", metavar="TEXT", help="an extra user message for the fork")


def cmd_dangling(args: argparse.Namespace, config: Config, spool: Spool) -> int:
    rows = dangling_rows(spool, args.task)
    if args.json:
        out(rows)
        return 0
    if not rows:
        print("no held calls")
    for r in rows:
        what = "waits for approval" if r["stage"] == STAGE_BEFORE else f"started {r['started_at']}"
        print(
            f"{r['task']}  {r['call_id']}  {r['tool']} ({r['effect']})  attempt {r['attempt']}  "
            f"{what}\n    input: {json.dumps(r['input'])[:300]}\n    key:   {r['idempotency_key']}"
            f"\n    decide: agentd approve-dangling {r['task']} {r['call_id']} --attempt "
            f"{r['attempt']} (--rerun | --skip --reason TEXT | --result TEXT)"
        )
    return 0


def cmd_approve(args: argparse.Namespace, config: Config, spool: Spool) -> int:
    if (args.call_id is None) == (not args.all):
        raise UsageError("give either a CALL_ID or --all.")
    if args.result is not None and args.result_file is not None:
        raise UsageError("give --result or --result-file, not both.")
    result = text_or_file(args.result, args.result_file, "result", RESULT_FILE_LIMIT)
    if sum((args.rerun, args.skip, result is not None)) > 1:
        what = "--skip and --result" if not args.rerun else "--rerun, --skip and --result"
        raise UsageError(f"{what} are different decisions; give one.")
    action = (
        DecisionAction.SKIP
        if args.skip
        else DecisionAction.RESULT
        if result is not None
        else DecisionAction.RERUN
    )
    explicit = args.rerun or args.skip or result is not None
    terminal = sys.stdin is not None and sys.stdin.isatty()
    shown = [
        row for row in dangling_rows(spool, args.task) if args.all or row["call_id"] == args.call_id
    ]
    risky = [row for row in shown if not explicit and unsafe_rerun(row)]
    if risky and not terminal:
        row = risky[0]
        raise UsageError(
            f"call {row['call_id']} of task {args.task} is an unsafe {row['tool']} call whose "
            "outcome is unknown: re-running it may repeat its side effect; say so with "
            "--rerun, or decide --skip --reason TEXT or --result TEXT."
        )
    if terminal and shown and (args.attempt is None or risky):
        shown = [row for row in shown if _confirmed(row, action)]
        if not shown:
            print(f"{args.task}: nothing decided; the calls stay held.", file=sys.stderr)
            return 1
        given = args.attempt
        targets = [(row["call_id"], row["attempt"] if given is None else given) for row in shown]
    elif args.all:
        targets = [(EVERY_CALL, None)]  # (each call's attempt as `approve` lists it)
    else:  # the attempt given, else the one read here: never one held after it
        read = shown[0]["attempt"] if shown else None
        targets = [(args.call_id, args.attempt if args.attempt is not None else read)]
    for call_id, attempt in targets:
        decided = approve(
            spool,
            args.task,
            call_id,
            action=action,
            reason=args.reason,
            result=result,
            operator=Operator.here(),
            attempt=attempt,
        )
        for decided_id, decided_attempt in decided:
            print(f"{args.task} {decided_id} attempt {decided_attempt}: {action}")
    return 0


def _confirmed(row: dict[str, Any], action: str) -> bool:
    """Show a held call at the terminal (its tool, input, when it started and what is
    known of it) and ask whether to carry out ``action`` on it."""
    if row["stage"] == STAGE_BEFORE:
        known = "it has not run: it waits for approval before it runs"
    elif unsafe_rerun(row):
        known = "its outcome is unknown: it may or may not have taken effect"
    else:
        known = f"its outcome is unknown; a {row['effect']} call is safe to run again"
    shown = json.dumps(row["input"], ensure_ascii=False)
    print(
        f"{row['task']} {row['call_id']}: {row['tool']} ({row['effect']}), attempt "
        f"{row['attempt']}, started {row['started_at']}\n    input: {shown[:2000]}"
        f"\n    input_sha256: {row['input_sha256']}\n    {known}",
        file=sys.stderr,
    )
    verb = {"rerun": "run it again" if row["stage"] != STAGE_BEFORE else "run it"}.get(
        action, f"decide {action}"
    )
    print(f"{verb}? [y/N] ", end="", file=sys.stderr, flush=True)
    answer = sys.stdin.readline().strip().lower()
    return answer in ("y", "yes")


def cmd_cancel(args: argparse.Namespace, config: Config, spool: Spool) -> int:
    done = cancel(spool, args.task, config.restart.stop_grace + 5, operator=Operator.here())
    if isinstance(done, Fenced):  # (its node stopped renewing the lease: frozen, cut off)
        running = f"; its running call {done.call} may still complete until then"
        print(f"agentd: {args.task} cancelled; {done.told()}{running if done.call else ''}")
        return 0
    print(f"{args.task}: cancelled" if done else f"{args.task}: cancel requested")
    return 0


def cmd_retry(args: argparse.Namespace, config: Config, spool: Spool) -> int:
    handed = retry(spool, args.task, operator=Operator.here())
    print(f"{args.task}: handed to the daemon" if handed else f"{args.task}: queued for retry")
    return 0


def cmd_budget(args: argparse.Namespace, config: Config, spool: Spool) -> int:
    from supervisor.budgets import KEEP, change_budget, parse_tokens, parse_usd  # noqa: PLC0415  (only this command needs it)

    change = change_budget(
        spool,
        config,
        args.task,
        usd=KEEP if args.usd is None else parse_usd(args.usd),
        tokens=KEEP if args.tokens is None else parse_tokens(args.tokens),
        operator=Operator.here(),
    )
    after = change.after
    limits = [
        f"${after.usd:.2f}" if after.usd is not None else "no USD limit",
        f"{after.tokens} tokens" if after.tokens is not None else "no token limit",
    ]
    spent = f"${change.cost_usd:.6f}" if change.cost_usd is not None else "an unknown cost"
    print(f"{change.task}: budget {', '.join(limits)}; spent {spent}, {change.tokens} tokens")
    if change.resumed:
        print(f"{change.task}: resumed")
    return 0


def cmd_rewind(args: argparse.Namespace, config: Config, spool: Spool) -> int:
    from supervisor.history import rewind  # noqa: PLC0415  (only this command needs it: the CLI starts fast)

    report = rewind(
        spool,
        config,
        args.task,
        args.to,
        restore_workspace=args.restore_workspace,
        yes=args.yes,
        operator=Operator.here(),
    )
    for call in report.irreversible:
        print(
            f"not undone: turn {call['turn']} {call['tool']} ({call['effect']}) {call['call_id']}"
        )
    for call in report.cut_off:
        cut = f"cut off: turn {call['turn']} {call['tool']} ({call['effect']}) {call['call_id']}"
        if report.fenced is not None:  # (its node stopped renewing the lease: frozen, cut off)
            print(
                f"{cut}: {report.fenced.told()}; it may still complete until then, and its "
                "outcome is unknown"
            )
            continue
        print(
            f"{cut} was still running after restart.stop_grace ({config.restart.stop_grace:g} "
            "s) and was killed; its outcome is unknown"
        )
    print(f"{report.task}: rewound to turn {report.to}; later turns kept in the history")
    print(f"workspace: {report.workspace}")
    return 0


def cmd_fork(args: argparse.Namespace, config: Config, spool: Spool) -> int:
    from supervisor.history import fork  # noqa: PLC0415  (only this command needs it: the CLI starts fast)

    prompt = checked_text(args.prompt, "--prompt")
    report = fork(
        spool, config, args.task, args.at, name=args.name, prompt=prompt, operator=Operator.here()
    )
    print(report.task)
    print(f"forked from {report.parent} at turn {report.at}; workspace: {report.workspace}",
          file=sys.stderr)  # fmt: skip
    return 0
