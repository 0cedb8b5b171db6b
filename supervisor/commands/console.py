"""``agentd console``: the console's URL with a one-time login; or the long-lived API tokens
(``--token``, ``--list-tokens``, ``--revoke ID``)."""

from __future__ import annotations

import argparse
import sys

from supervisor.commands.parsing import Commands
from supervisor.coordination import running_pid, supervisor_info
from supervisor.operator import Operator
from worker.config import Config
from worker.errors import AgentdError, UsageError
from worker.spool import Spool


def add_parser(commands: Commands) -> None:
    p = commands.add("console", cmd_console, "the console's URL with a one-time login; API tokens")
    p.add_argument("--token", action="store_true", help="mint a long-lived API token")
    p.add_argument("--list-tokens", action="store_true", help="list the API tokens kept")
    p.add_argument("--revoke", metavar="ID", help="revoke the API token ID")


def cmd_console(args: argparse.Namespace, config: Config, spool: Spool) -> int:
    """``agentd console``: the console's URL with a one-time login; or API tokens."""
    from supervisor.console import tokens  # noqa: PLC0415  (only this command needs it: the CLI starts fast)

    if sum([args.token, args.list_tokens, args.revoke is not None]) > 1:
        raise UsageError("give one of --token, --list-tokens and --revoke ID, or none.")
    store = tokens.token_store(spool)
    if args.token:
        token, secret = tokens.mint(store, Operator.here().by)
        print(secret)
        print(
            f"agentd: API token {token.id} for {token.by}, shown this once: send it as "
            f"`Authorization: Bearer TOKEN`; `agentd console --revoke {token.id}` ends it",
            file=sys.stderr,
        )
        return 0
    if args.list_tokens:
        kept = tokens.listed(store)
        if not kept:
            print("no API tokens; `agentd console --token` mints one")
        for token in kept:
            print(f"{token.id}  {token.by:<16}  minted {token.created_at}")
        return 0
    if args.revoke is not None:
        tokens.revoke(store, args.revoke)
        print(f"{args.revoke}: revoked")
        return 0
    pid = running_pid(spool)
    url = (supervisor_info(spool) or {}).get("console") if pid is not None else None
    if not isinstance(url, str) or not url:
        where = "" if pid is not None else f" (agentd is not running on {spool.root})"
        raise AgentdError(f"the console is off: set [console] listen and reload{where}")
    secret = tokens.LoginTickets(spool).issue()
    print(f"{url}?token={secret}")
    minutes = round(tokens.LOGIN_TTL / 60)
    print(f"agentd: a one-time login link: open it within {minutes} minutes", file=sys.stderr)
    return 0
