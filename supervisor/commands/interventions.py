"""What an operator does to a task: ``agentd cancel``, ``retry``, ``budget``; its held calls
(``dangling``, ``approve-dangling``); its history changed (``rewind``, ``fork``). Each works
with or without a running daemon: with one, the change is written durably and its inbox
rung; without one, the command takes the supervisor lock and applies it itself."""

from __future__ import annotations

import argparse
import json
import sys

from supervisor.actions import EVERY_CALL, approve, cancel, retry, script_past_its_end
from supervisor.commands.context import out, say_it_waits, text_or_file
from supervisor.commands.parsing import Commands, json_flag, task_arg
from supervisor.control import Fenced
from supervisor.operator import Operator
from supervisor.overview import dangling_rows
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
        print(
            f"{r['task']}  {r['call_id']}  {r['tool']} ({r['effect']})  started {r['started_at']}"
            f"\n    input: {json.dumps(r['input'])[:300]}\n    key:   {r['idempotency_key']}"
            f"\n    decide: agentd approve-dangling {r['task']} {r['call_id']} "
            "[--skip --reason TEXT | --result TEXT]"
        )
    return 0


def cmd_approve(args: argparse.Namespace, config: Config, spool: Spool) -> int:
    if (args.call_id is None) == (not args.all):
        raise UsageError("give either a CALL_ID or --all.")
    if args.result is not None and args.result_file is not None:
        raise UsageError("give --result or --result-file, not both.")
    result = text_or_file(args.result, args.result_file, "result", RESULT_FILE_LIMIT)
    if args.skip and result is not None:
        raise UsageError("--skip and --result are different decisions; give one.")
    action = (
        DecisionAction.SKIP
        if args.skip
        else DecisionAction.RESULT
        if result is not None
        else DecisionAction.RERUN
    )
    decided = approve(
        spool,
        args.task,
        args.call_id or EVERY_CALL,
        action=action,
        reason=args.reason,
        result=result,
        operator=Operator.here(),
    )
    for call_id in decided:
        print(f"{args.task} {call_id}: {action}")
    return 0


def cmd_cancel(args: argparse.Namespace, config: Config, spool: Spool) -> int:
    grace = config.restart.stop_grace
    done = cancel(spool, args.task, grace + 5, operator=Operator.here(), grace=grace)
    if isinstance(done, Fenced):  # (its node stopped renewing the lease: frozen, cut off)
        running = f"; its running call {done.call} may still complete until then"
        print(f"agentd: {args.task} cancelled; {done.told()}{running if done.call else ''}")
        return 0
    print(f"{args.task}: cancelled" if done else f"{args.task}: cancel requested")
    return 0


def cmd_retry(args: argparse.Namespace, config: Config, spool: Spool) -> int:
    handed = retry(spool, args.task, operator=Operator.here())
    print(f"{args.task}: handed to the daemon" if handed else f"{args.task}: queued for retry")
    if past := script_past_its_end(spool, args.task):
        print(f"agentd: warning: {past}; until then it fails again the same way.", file=sys.stderr)
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
    say_it_waits(spool, report.task)
    return 0
