"""The command line described as data, and what is rendered from it: shell completion
for bash, zsh and fish (``agentd completion SHELL``) and the man page
(``python -m supervisor.manpage man > agentd.1``, ``make man``).

Everything comes from the argparse parser of ``supervisor.cli`` (handed in: this module
imports nothing of agentd's, so the CLI and its renderings have no import circle), walked
once by ``describe``: a new option appears in the completion scripts and the man page without
being written down twice. How an option's value completes follows from the parser too:
its ``choices`` when it has some, folders for a ``DIR`` metavar, files for ``FILE``, the
spool's task ids for ``TASK`` and a task's held calls for ``CALL_ID`` (asked of agentd
itself, ``agentd [--spool DIR] [--config FILE] __complete tasks|calls TASK``: the
``--spool`` and ``--config`` typed on the line are passed on), nothing for free text
(``TEXT``, ``ID``...).
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

Kind = Literal["flag", "dir", "file", "choice", "task", "call", "text"]
#: The metavars whose values are ids agentd lists (``agentd __complete``).
IDS: dict[str, Kind] = {"TASK": "task", "CALL_ID": "call"}
#: The global options a completion passes on to ``agentd __complete``.
PASSED_ON = ("--spool", "--config")


@dataclass(frozen=True)
class Argument:
    """An option (``flags`` set) or a positional (``flags`` empty) of one command."""

    flags: tuple[str, ...]
    metavar: str
    help: str
    kind: Kind
    choices: tuple[str, ...] = ()
    optional: bool = True
    repeats: bool = False  # a positional given any number of times (``status A B C``)

    @property
    def takes_value(self) -> bool:
        return self.kind != "flag"


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    usage: str
    options: tuple[Argument, ...]
    positionals: tuple[Argument, ...]


@dataclass(frozen=True)
class CommandLine:
    prog: str
    description: str
    options: tuple[Argument, ...]  # the global ones, before the command
    commands: tuple[Command, ...]


def describe(parser: argparse.ArgumentParser) -> CommandLine:
    """``parser`` and its subcommands as plain data."""
    commands: list[Command] = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                options, positionals = _arguments(sub)
                usage = " ".join(sub.format_usage().removeprefix("usage:").split())
                commands.append(Command(name, sub.description or "", usage, options, positionals))
    options, _ = _arguments(parser)
    return CommandLine(parser.prog, parser.description or "", options, tuple(commands))


def _arguments(
    parser: argparse.ArgumentParser,
) -> tuple[tuple[Argument, ...], tuple[Argument, ...]]:
    options: list[Argument] = []
    positionals: list[Argument] = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            continue
        choices = tuple(str(c) for c in action.choices) if action.choices else ()
        metavar = str(action.metavar or action.dest.upper())
        kind: Kind
        if action.nargs == 0:
            kind = "flag"
        elif choices:
            kind = "choice"
        elif metavar in ("DIR", "FILE", "PATH"):
            kind = "dir" if metavar == "DIR" else "file"
        elif metavar in IDS:
            kind = IDS[metavar]
        else:
            kind = "text"
        help_text = "" if action.help in (None, argparse.SUPPRESS) else str(action.help)
        argument = Argument(
            tuple(action.option_strings),
            metavar,
            help_text,
            kind,
            choices,
            optional=not action.required if action.option_strings else action.nargs in ("?", "*"),
            repeats=not action.option_strings and action.nargs in ("*", "+"),
        )
        (options if action.option_strings else positionals).append(argument)
    return tuple(options), tuple(positionals)


# -- bash ----------------------------------------------------------------------------------


def bash(cli: CommandLine) -> str:
    """A bash completion function: commands, each command's options, and values (choices,
    files, folders) for the options and positionals that take them."""
    fn = f"_{cli.prog}"
    scopes = [("", cli.options, ())] + [(c.name, c.options, c.positionals) for c in cli.commands]
    takes_value = [
        f'"{scope} {flag}"' for scope, opts, _ in scopes for o in opts if o.takes_value
        for flag in o.flags
    ]  # fmt: skip
    by_action: dict[str, list[str]] = {}  # one case per way of completing a value
    for scope, options, _ in scopes:
        for option in options:
            if option.takes_value:
                patterns = by_action.setdefault(_bash_values(option), [])
                patterns += [f'"{scope} {flag}"' for flag in option.flags]
    value_cases = [f"        {'|'.join(p)}) {a}; return ;;" for a, p in by_action.items()]
    flag_cases = [
        f'        "{scope}") words="{" ".join(f for o in opts for f in o.flags)}" ;;'
        for scope, opts, _ in scopes
    ]
    positional_cases = [
        f'        "{scope} {i}") {_bash_values(p)}; return ;;'
        for scope, _, positionals in scopes
        for i, p in enumerate(positionals)
        if p.kind != "text" and not p.repeats
    ] + [  # (after the others: a pattern that takes any count)
        f'        "{scope} "*) {_bash_values(p)}; return ;;'
        for scope, _, positionals in scopes
        for p in positionals
        if p.kind != "text" and p.repeats
    ]
    passed_on = "|".join(f'" {flag}"' for flag in PASSED_ON)
    commands = " ".join(c.name for c in cli.commands)
    return f"""\
# bash completion for {cli.prog}; generated from its argument parser.
# Load it with: source <({cli.prog} completion bash)
{fn}() {{
    local cur=${{COMP_WORDS[COMP_CWORD]}} prev=${{COMP_WORDS[COMP_CWORD-1]}}
    local cmd="" npos=0 i w words="" ctx=() pos=()
    COMPREPLY=()
    for ((i = 1; i < COMP_CWORD; i++)); do
        w=${{COMP_WORDS[i]}}
        case "$cmd $w" in
            {passed_on}) ctx+=("$w" "${{COMP_WORDS[i+1]/#\\~/$HOME}}"); i=$((i + 1)) ;;
            {"|".join(takes_value)}) i=$((i + 1)) ;;
            *" -"*) ;;
            " "*) cmd=$w ;;
            *) npos=$((npos + 1)); pos+=("$w") ;;
        esac
    done
    case "$cmd $prev" in
{chr(10).join(value_cases)}
    esac
    if [[ $cur == -* ]]; then
        case "$cmd" in
{chr(10).join(flag_cases)}
        esac
    elif [[ -z $cmd ]]; then
        words="{commands}"
    else
        case "$cmd $npos" in
{chr(10).join(positional_cases)}
        esac
    fi
    mapfile -t COMPREPLY < <(compgen -W "$words" -- "$cur")
}}
complete -F {fn} {cli.prog}
"""


def _bash_values(argument: Argument) -> str:
    if argument.kind in ("task", "call"):  # (the ids agentd lists, on the spool typed)
        asked = "tasks" if argument.kind == "task" else 'calls "${pos[0]}"'
        ids = f'$("${{COMP_WORDS[0]}}" "${{ctx[@]}}" __complete {asked} 2>/dev/null)'
        return f'mapfile -t COMPREPLY < <(compgen -W "{ids}" -- "$cur")'
    if argument.kind == "choice":
        return f'mapfile -t COMPREPLY < <(compgen -W "{" ".join(argument.choices)}" -- "$cur")'
    if argument.kind in ("dir", "file"):
        what = "-d" if argument.kind == "dir" else "-f"
        return (
            f'compopt -o filenames 2>/dev/null; mapfile -t COMPREPLY < <(compgen {what} -- "$cur")'
        )
    return ":"  # free text: nothing to offer


# -- zsh -----------------------------------------------------------------------------------


def zsh(cli: CommandLine) -> str:
    """A zsh completion function for ``compinit`` (``#compdef``), also usable with
    ``source <(agentd completion zsh)`` once compinit has run."""
    fn = f"_{cli.prog}"
    passed_on = "\n".join(
        f"        [[ -n ${{opt_args[{flag}]}} ]] && _{cli.prog}_ctx+=({flag} ${{opt_args[{flag}]}})"
        for flag in PASSED_ON
    )
    described = "\n".join(f"        {_zsh_quote(f'{c.name}:{c.help}')}" for c in cli.commands)
    cases = "\n".join(
        f"        {c.name}) _arguments {_zsh_specs(c.options, c.positionals)} ;;"
        for c in cli.commands
    )
    return f"""\
#compdef {cli.prog}
# zsh completion for {cli.prog}; generated from its argument parser.
{fn}() {{
    local curcontext="$curcontext" state line
    typeset -A opt_args
    _arguments -C {_zsh_specs(cli.options, ())} \\
        '1:command:->command' '*::argument:->argument'
    case $state in
    command)
        local -a commands
        commands=(
{described}
        )
        _describe -t commands '{cli.prog} command' commands ;;
    argument)
        local -a _{cli.prog}_ctx  # (the spool and config typed: where the ids are)
{passed_on}
        case $line[1] in
{cases}
        esac ;;
    esac
}}
{fn}_ids() {{
    local -a ids
    ids=(${{(f)"$({cli.prog} $_{cli.prog}_ctx __complete "$@" 2>/dev/null)"}})
    compadd -a ids
}}
{fn}_tasks() {{ {fn}_ids tasks }}
{fn}_calls() {{ {fn}_ids calls "$line[1]" }}
if [[ $zsh_eval_context[-1] == loadautofunc ]]; then
    {fn} "$@"
else
    compdef {fn} {cli.prog}
fi
"""


def _zsh_specs(options: Iterable[Argument], positionals: Iterable[Argument]) -> str:
    specs: list[str] = []
    for option in options:
        text = _zsh_escape(option.help)
        for flag in option.flags:
            if option.takes_value:
                value = f":{_zsh_escape(option.metavar)}:{_zsh_action(option)}"
                specs.append(
                    _zsh_quote(f"{flag}{'=' if flag.startswith('--') else '+'}[{text}]{value}")
                )
            else:
                specs.append(_zsh_quote(f"{flag}[{text}]"))
    for i, positional in enumerate(positionals, 1):
        colon = "::" if positional.optional else ":"
        where = "*" if positional.repeats else str(i)
        message = _zsh_escape(f"{positional.metavar}: {positional.help}")
        specs.append(_zsh_quote(f"{where}{colon}{message}:{_zsh_action(positional)}"))
    return " ".join(specs)


def _zsh_action(argument: Argument) -> str:
    if argument.kind == "choice":
        return "(" + " ".join(argument.choices) + ")"
    ids = {"task": "_agentd_tasks", "call": "_agentd_calls"}
    return {"dir": "_files -/", "file": "_files", **ids}.get(argument.kind, " ")


def _zsh_escape(text: str) -> str:
    return re.sub(r"([\[\]:\\])", r"\\\1", text)


def _zsh_quote(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"


# -- fish ----------------------------------------------------------------------------------


def fish(cli: CommandLine) -> str:
    """``complete`` lines for fish: commands while none is given, then its options."""
    prog = cli.prog
    lines = [
        f"# fish completion for {prog}; generated from its argument parser.",
        f"# Load it with: {prog} completion fish | source",
        f"complete -c {prog} -f",
        _fish_ids(prog, [f for o in cli.options if o.takes_value for f in o.flags]),
    ]
    no_command = "__fish_use_subcommand"
    lines += [
        f"complete -c {prog} -n {no_command} -a {c.name} -d {_fish_quote(c.help)}"
        for c in cli.commands
    ]
    lines += [_fish_option(prog, no_command, o) for o in cli.options]
    for command in cli.commands:
        seen = _fish_quote(f"__fish_seen_subcommand_from {command.name}")
        lines += [_fish_option(prog, seen, o) for o in command.options]
        for i, positional in enumerate(command.positionals):
            if positional.kind in ("task", "call"):
                where = "" if positional.repeats else f"; and __{prog}_npos {i}"
                when = _fish_quote(f"__fish_seen_subcommand_from {command.name}{where}")
                asked = "tasks" if positional.kind == "task" else "calls"
                lines.append(
                    f"complete -c {prog} -n {when} -a '(__{prog}_ids {asked})' "
                    f"-d {_fish_quote(positional.help)}"
                )
            elif positional.kind == "choice":
                values = _fish_quote(" ".join(positional.choices))
                lines.append(
                    f"complete -c {prog} -n {seen} -a {values} -d {_fish_quote(positional.help)}"
                )
            elif positional.kind in ("file", "dir"):
                lines.append(f"complete -c {prog} -n {seen} -F")
    return "\n".join(lines) + "\n"


def _fish_ids(prog: str, valued: Sequence[str]) -> str:
    """The functions the ids complete through: ``__PROG_scan`` reads the line (the spool
    and config given, the positionals after the command), ``__PROG_ids`` asks agentd,
    ``__PROG_npos N`` is true while N positionals are given."""
    return f"""\
function __{prog}_scan
    set -g __{prog}_ctx
    set -g __{prog}_pos
    set -l cmd
    set -l words (commandline -opc)
    set -l i 2
    while test $i -le (count $words)
        set -l w $words[$i]
        if test -z "$cmd"
            if contains -- $w {" ".join(PASSED_ON)}
                set i (math $i + 1)
                set -a __{prog}_ctx $w $words[$i]
            else if contains -- $w {" ".join(f for f in valued if f not in PASSED_ON)}
                set i (math $i + 1)
            else if not string match -q -- '-*' $w
                set cmd $w
            end
        else if not string match -q -- '-*' $w
            set -a __{prog}_pos $w
        end
        set i (math $i + 1)
    end
end
function __{prog}_ids
    command -q {prog}; or return  # (not on PATH: nothing to ask)
    __{prog}_scan
    if test "$argv[1]" = calls
        {prog} $__{prog}_ctx __complete calls $__{prog}_pos[1] 2>/dev/null
    else
        {prog} $__{prog}_ctx __complete tasks 2>/dev/null
    end
end
function __{prog}_npos
    __{prog}_scan
    test (count $__{prog}_pos) -eq $argv[1]
end"""


def _fish_option(prog: str, condition: str, option: Argument) -> str:
    names = []
    for flag in option.flags:
        names.append(f"-l {flag[2:]}" if flag.startswith("--") else f"-s {flag[1:]}")
    value = {
        "flag": "",
        "file": " -r -F",
        "dir": " -x -a '(__fish_complete_directories)'",
        "choice": f" -x -a {_fish_quote(' '.join(option.choices))}",
        "task": f" -x -a '(__{prog}_ids tasks)'",
        "call": f" -x -a '(__{prog}_ids calls)'",
        "text": " -x",
    }[option.kind]
    return (
        f"complete -c {prog} -n {condition} {' '.join(names)}{value} -d {_fish_quote(option.help)}"
    )


def _fish_quote(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


SHELLS = {"bash": bash, "zsh": zsh, "fish": fish}


def completion(parser: argparse.ArgumentParser, shell: str) -> str:
    return SHELLS[shell](describe(parser))


# -- the man page --------------------------------------------------------------------------

_EXIT_STATUS = (
    ("0", "success"),
    ("1", "operational error (a spool that does not exist, a daemon that did not start, ...)"),
    ("2", "usage error"),
    ("3", "no such task or call, or the task is not in a state that allows it"),
    ("78", "configuration error (systemd: RestartPreventExitStatus=78)"),
)
_ENVIRONMENT = (
    ("AGENTD_SPOOL", "the spool, when --spool is not given"),
    ("AGENTD_CONFIG", "the config file, when --config is not given"),
    ("STATE_DIRECTORY", "set by systemd; the spool when none is named"),
    ("XDG_CONFIG_HOME", "config discovery looks in $XDG_CONFIG_HOME/agentd/ first"),
    ("XDG_STATE_HOME", "the default spool is $XDG_STATE_HOME/agentd"),
    ("ANTHROPIC_API_KEY", "the API key workers use; never written to the spool or the logs"),
    ("NO_COLOR", "no colour in the output"),
)
_FILES = (
    ("$XDG_CONFIG_HOME/agentd/agentd.toml", "the user's config (~/.config/agentd/agentd.toml)"),
    ("/etc/agentd/agentd.toml", "the machine's config, read when the user has none"),
    ("$XDG_STATE_HOME/agentd", "the default spool (~/.local/state/agentd)"),
)


def man(cli: CommandLine, version: str) -> str:
    """The man page, section 1, in roff (``man -l agentd.1`` shows it)."""
    out = [
        f'.TH {cli.prog.upper()} 1 "" "{cli.prog} {version}" "User Commands"',
        ".nh",  # no hyphenation: option names must stay whole
        ".ad l",
        ".SH NAME",
        f"{cli.prog} \\- {_roff(cli.description[:1].lower() + cli.description[1:].rstrip('.'))}",
        ".SH SYNOPSIS",
        f".B {cli.prog}",
        _roff(" ".join(_synopsis(o) for o in cli.options if o.flags[0] != "-h")),
        ".I COMMAND",
        "[\\fIARGUMENTS\\fR]",
        ".SH DESCRIPTION",
        _roff(f"{cli.description} Run `{cli.prog} COMMAND --help` for one command's options."),
        ".SH OPTIONS",
    ]
    out += _items(cli.options)
    out.append(".SH COMMANDS")
    for command in cli.commands:
        out += [f".SS {command.name}", _roff(command.help), ".PP", f".B {_roff(command.usage)}"]
        out += _items(command.positionals + tuple(o for o in command.options if o.flags[0] != "-h"))
    for title, rows in (
        ("EXIT STATUS", _EXIT_STATUS),
        ("ENVIRONMENT", _ENVIRONMENT),
        ("FILES", _FILES),
    ):
        out.append(f".SH {title}")
        for term, text in rows:
            out += [".TP", f"\\fB{_roff(term)}\\fR", _roff(text)]
    return "\n".join(out) + "\n"


def _synopsis(option: Argument) -> str:
    return f"[{option.flags[-1]}{f' {option.metavar}' if option.takes_value else ''}]"


def _items(arguments: Sequence[Argument]) -> list[str]:
    out: list[str] = []
    for argument in arguments:
        if argument.flags:
            term = ", ".join(f"\\fB{_roff(f)}\\fR" for f in argument.flags)
            if argument.takes_value:
                term += f" \\fI{_roff(argument.metavar)}\\fR"
        else:
            term = f"\\fI{_roff(argument.metavar)}\\fR"
        help_text = argument.help
        if (
            argument.choices
            and argument.kind == "choice"
            and argument.metavar not in argument.choices
        ):
            help_text += f" ({', '.join(argument.choices)})"
        out += [".TP", term, _roff(help_text)]
    return out


def _roff(text: str) -> str:
    """Text safe in roff: backslashes and dashes escaped, no line starting a request."""
    text = text.replace("\\", "\\e").replace("-", "\\-")
    return "\\&" + text if text.startswith((".", "'")) else text
