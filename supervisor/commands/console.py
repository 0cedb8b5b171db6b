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
    url = console_url(config, spool)
    secret = tokens.LoginTickets(spool).issue()
    print(f"{url}?token={secret}")
    minutes = round(tokens.LOGIN_TTL / 60)
    print(f"agentd: a one-time login link: open it within {minutes} minutes", file=sys.stderr)
    return 0


def console_url(config: Config, spool: Spool) -> str:
    """The URL the running daemon serves its console on; each case where there is none is
    said as it is: no daemon, no ``[console] listen``, a listen not yet reloaded, or an
    address the daemon could not serve (its ``console_failed``)."""
    listen = config.console.listen
    pid = running_pid(spool)
    if pid is None:
        if not listen:
            raise AgentdError(
                f"the console is off: set [console] listen, then `agentd start` "
                f"(agentd is not running on {spool.root})"
            )
        raise AgentdError(
            f"agentd is not running on {spool.root}: `agentd start` serves the console on {listen}"
        )
    info = supervisor_info(spool) or {}
    url = info.get("console")
    if isinstance(url, str) and url:
        return url
    served = info.get("console_listen")
    error = info.get("console_error")
    if served and error:
        raise AgentdError(
            f"the console could not serve on {served}: {error} (the daemon's log says "
            f"console_failed); free the address or change [console] listen, then "
            f"`agentd reload`"
        )
    if listen and listen != served:
        raise AgentdError(
            f"the running daemon (pid {pid}) has not read [console] listen = {listen} "
            f"yet: `agentd reload`"
        )
    raise AgentdError("the console is off: set [console] listen and `agentd reload`")
