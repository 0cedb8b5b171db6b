"""Setting agentd up: ``agentd init`` (a commented default config), ``agentd config check``
(the file read, its tools, hooks, sandbox, console and MCP servers tried), ``agentd tools``
(every tool a task can get, and where its effect class came from)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from supervisor.commands.context import out, resolve_spool
from supervisor.commands.parsing import Commands, json_flag
from supervisor.submit import existing_task
from worker import paths
from worker.config import Config, load_config
from worker.errors import AgentdError, ConfigError, UsageError
from worker.spool import Spool
from worker.tools.sandbox import Sandbox


def add_parser(commands: Commands) -> None:
    p = commands.add(
        "tools",
        cmd_tools,
        "every tool a task can get, with its effect class and where that came from",
        reads_spool=False,
    )
    p.add_argument(
        "task",
        nargs="?",
        metavar="TASK",
        help="the list recorded for this task (default: every tool; each MCP server started once)",
    )
    json_flag(p, "the tools")
    p = commands.add(
        "init", cmd_init, "write a commented default config", reads_spool=False, reads_config=False
    )
    p.add_argument(
        "path",
        nargs="?",
        metavar="PATH",
        help="where (default: $XDG_CONFIG_HOME/agentd/agentd.toml)",
    )
    p.add_argument("--system", action="store_true", help="write /etc/agentd/agentd.toml")
    p.add_argument("--force", action="store_true", help="overwrite an existing file")
    p = commands.add(
        "config",
        cmd_config_check,
        "validate the configuration",
        reads_spool=False,
        uses_store=False,
    )
    p.add_argument(
        "action", choices=("check",), metavar="check", help="validate and report the file read"
    )
    p.add_argument(
        "file", nargs="?", metavar="FILE", help="the file to check (default: the one found)"
    )


def cmd_init(args: argparse.Namespace, config: Config, spool: Spool) -> int:
    from worker import config as config_module  # noqa: PLC0415  (only this command needs it: the CLI starts fast)

    if args.path is not None and args.system:
        raise UsageError("give a PATH or --system, not both.")
    if args.path is not None:
        path = Path(args.path)
    elif args.system:
        path = paths.SYSTEM_CONFIG
    else:
        path = paths.user_config_path()
    if path.exists() and not args.force:
        raise AgentdError(f"{path} exists; edit it, or give --force to overwrite it.")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(config_module.default_config_text(system=args.system))
    print(f"wrote {path}")
    return 0


def cmd_config_check(args: argparse.Namespace, config: Config, spool: Spool) -> int:
    from supervisor import hooks  # noqa: PLC0415  (only this command needs it: the CLI starts fast)
    from worker.tools.registry import ToolRegistry  # noqa: PLC0415  (only this command needs it: the CLI starts fast)

    if args.file is not None:
        config = load_config(Path(args.file))
        spool = resolve_spool(args, config)
    ToolRegistry.standard(config.tools.modules, source=config.source)  # imports each module
    source = config.source or "built-in defaults"
    hooks.check_commands(config.hooks, source)
    sandbox = Sandbox(config.tools.sandbox, config.tools.network).verdict()
    if sandbox.startswith("refused"):
        raise ConfigError(
            f'{source}: tools.sandbox is "required" but on this machine {sandbox[9:]}; '
            'install bubblewrap, or set tools.sandbox = "auto" to run commands bare.'
        )
    facts = [
        f"spool {spool.root}",
        f"max_workers {config.max_workers}",
        f"run_command sandbox: {sandbox}",
    ]
    if config.tools.modules:
        facts.append(f"tool modules {', '.join(config.tools.modules)}")
    if config.console.listen:
        facts.append(f"console on {config.console.listen}{_console_tls(config)}")
    failed: dict[str, str] = {}
    if config.mcp.servers:  # each started once and listed: one that cannot be is told
        from supervisor.toollist import NOT_STARTED, list_servers  # noqa: PLC0415  (only with servers)

        listed = list_servers(config, spool)
        failed = listed.failed
        counts = {name: f"{len(tools)} tools" for name, tools in listed.listings.items()}
        shown = [f"{name} ({counts.get(name, NOT_STARTED)})" for name in config.mcp.servers]
        facts.append("mcp servers " + ", ".join(shown))
    if set_hooks := [name for name, command in vars(config.hooks).items() if command]:
        facts.append(f"hooks {', '.join(set_hooks)}")
    if config.source is None:
        looked = f"{paths.user_config_path()} or {paths.SYSTEM_CONFIG}"
        facts.insert(0, f"no file at {looked}")
    verdict = "ok" if not failed else f"{len(failed)} mcp server(s) could not start here"
    print(f"{source}: {verdict} ({'; '.join(facts)})")
    return servers_failed(failed)


def servers_failed(failed: dict[str, str]) -> int:
    """Say on stderr, a line each, which servers could not start or list (``toollist.
    Listed.failed``); the exit code: 1 when any could not, else 0."""
    for why in failed.values():
        print(f"agentd: {why}", file=sys.stderr)
    return 1 if failed else 0


def _console_tls(config: Config) -> str:
    """`` over TLS`` when the console's certificate and key load (as its process loads
    them); a ConfigError in one line when they do not."""
    if not config.console.tls:
        return ""
    from supervisor.console.server import tls_context  # noqa: PLC0415  (ssl: only this check needs it)

    try:
        tls_context(config.console)
    except ConfigError as exc:
        raise ConfigError(f"{config.source}: {exc}.") from None
    return " over TLS"


def cmd_tools(args: argparse.Namespace, config: Config, spool: Spool) -> int:
    from supervisor import toollist  # noqa: PLC0415  (only this command needs it: the CLI starts fast)

    failed: dict[str, str] = {}
    if args.task is not None:
        rows = toollist.task_tools(existing_task(spool, args.task), config)
    else:
        rows, failed = toollist.every_tool(config, spool)
    if args.json:
        out(rows)
    else:
        print(toollist.table(rows, failed), flush=True)
    return servers_failed(failed)
