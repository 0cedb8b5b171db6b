"""Help that helps: every option has a help line, and the completion scripts and the man
page rendered from the parser (``supervisor/clidoc.py``) load in the real shells and in
``man``."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from supervisor import cli, clidoc
from supervisor.commands.parsing import Commands, Parser
from tests.supervisor.test_cli import AGENTD, agentd, held, spool  # noqa: F401  (fixtures)
from tests.support import REPO
from worker.spool import Spool

PARSER = cli.build_parser()
CLI = clidoc.describe(PARSER)


#: ``status``'s options that select among many tasks (docs/design.md section 20).
STATUS_SELECTION = ("--state", "--text", "--sort", "--limit", "--after")


def _parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    found = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found += _parsers(sub)
    return found


def test_every_option_and_positional_has_a_help_line() -> None:
    empty = [
        f"{p.prog}: {'/'.join(a.option_strings) or a.dest}"
        for p in _parsers(PARSER)
        for a in p._actions
        if not isinstance(a, argparse._SubParsersAction) and not (a.help or "").strip()
    ]
    assert empty == []
    assert all(c.help for c in CLI.commands)


def test_the_commands_are_listed_in_one_order_whatever_group_declares_them() -> None:
    """The groups of ``supervisor.commands`` declare their commands; the parser lists them
    as ``cli.LISTED`` says (help, man page, completion), and refuses a command declared and
    not listed, or listed and not declared."""
    (subcommands,) = [a for a in PARSER._actions if isinstance(a, argparse._SubParsersAction)]
    assert list(subcommands.choices) == list(cli.LISTED) == [c.name for c in CLI.commands]
    assert cli.LISTED.index("start") == 0 and cli.LISTED.index("completion") == 28
    commands = Commands()
    commands.add("stop", cli.cmd_completion, "a command")
    commands.add("demo", cli.cmd_completion, "another")
    for listed in (["stop"], ["stop", "demo", "start"], ["stop", "stop"]):
        with pytest.raises(ValueError, match="not those declared"):
            commands.attach(Parser(prog="agentd"), listed)
    parser = Parser(prog="agentd")
    commands.attach(parser, ["demo", "stop"])
    assert parser.parse_args(["stop"]).handler is cli.cmd_completion
    listing = parser.format_help()
    assert 0 < listing.index("    demo  ") < listing.index("    stop  ")  # (as listed)


def parses(shell: str, script: Path) -> None:
    """``SHELL -n SCRIPT``: the shell reads the script without a syntax error."""
    done = subprocess.run([shell, "-n", str(script)], capture_output=True, text=True, check=False)
    assert (done.returncode, done.stderr) == (0, ""), done


def completion(shell: str) -> str:
    done = subprocess.run(
        [str(AGENTD), "completion", shell], capture_output=True, text=True, timeout=30, check=True
    )
    assert done.stderr == ""
    return done.stdout


# -- bash ----------------------------------------------------------------------------------

BASH_CALL = r"""
source "$1"; shift
COMP_WORDS=("$@"); COMP_CWORD=$(( ${#COMP_WORDS[@]} - 1 ))
_agentd
printf '%s\n' "${COMPREPLY[@]}"
"""


def bash_complete(script: Path, *words: str, cwd: Path = REPO) -> list[str]:
    """COMPREPLY of the loaded function for a command line whose last word is being typed."""
    done = subprocess.run(
        ["bash", "--norc", "--noprofile", "-c", BASH_CALL, "bash", str(script), "agentd", *words],
        capture_output=True, text=True, timeout=30, check=False, cwd=cwd,
    )  # fmt: skip
    assert (done.returncode, done.stderr) == (0, ""), done
    return [line for line in done.stdout.splitlines() if line]


@pytest.fixture(scope="module")
def bash_script(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("bash") / "agentd.bash"
    path.write_text(completion("bash"))
    return path


def test_the_bash_script_parses(bash_script: Path) -> None:
    parses("bash", bash_script)


def test_bash_completes_commands_options_and_values(bash_script: Path, tmp_path: Path) -> None:
    commands = [c.name for c in CLI.commands]
    assert bash_complete(bash_script, "") == commands
    assert bash_complete(bash_script, "st") == ["start", "stop", "status", "store"]
    assert bash_complete(bash_script, "--spool", "/tmp", "sta") == ["start", "status"]
    assert set(bash_complete(bash_script, "status", "--")) == {
        "--help",
        "--json",
        "--watch",
        "--interval",
        *STATUS_SELECTION,
    }
    assert bash_complete(bash_script, "completion", "") == ["bash", "zsh", "fish"]
    assert bash_complete(bash_script, "--log-format", "") == ["json", "console"]
    assert bash_complete(bash_script, "config", "") == ["check"]
    # a value is not taken for the command, and files complete where a file goes
    (tmp_path / "script.json").write_text("{}")
    (tmp_path / "folder").mkdir()
    got = bash_complete(bash_script, "submit", "--name", "x", "--script", "scr", cwd=tmp_path)
    assert got == ["script.json"]
    assert bash_complete(bash_script, "--spool", "", cwd=tmp_path) == ["folder"]
    assert bash_complete(bash_script, "submit", "--prompt", "", cwd=tmp_path) == []


# -- task ids and call ids, asked of agentd -------------------------------------------------

#: The shells run the agentd under test by the name a user types.
ON_PATH = {**os.environ, "PATH": f"{AGENTD.parent}{os.pathsep}{os.environ.get('PATH', '')}"}


@pytest.fixture
def two_tasks(request: pytest.FixtureRequest) -> tuple[Spool, str, str]:
    """A spool with a held task (``test_cli``'s ``held``: its call's id) and another."""
    task, call_id = request.getfixturevalue("held")
    home = task.spool
    done = subprocess.run(
        [str(AGENTD), "--spool", str(home.root), "submit", "--prompt", "p", "--name", "other"],
        capture_output=True, text=True, timeout=30, check=True,
    )  # fmt: skip
    assert done.stdout.strip() == "other" and task.id == "held-task"
    return home, task.id, call_id


def test_bash_completes_task_ids_and_call_ids(
    bash_script: Path, two_tasks: tuple[Spool, str, str]
) -> None:
    home, task, call_id = two_tasks
    on = ["--spool", str(home.root)]

    def ids(*words: str) -> list[str]:
        done = subprocess.run(
            ["bash", "--norc", "--noprofile", "-c", BASH_CALL, "bash", str(bash_script),
             "agentd", *on, *words],
            capture_output=True, text=True, timeout=30, check=False, env=ON_PATH,
        )  # fmt: skip
        assert (done.returncode, done.stderr) == (0, ""), done
        return done.stdout.split()

    assert ids("logs", "") == [task, "other"]
    assert ids("cancel", "o") == ["other"]
    assert ids("status", task, "") == [task, "other"]  # any number of tasks
    assert ids("run", "--resume", "h") == [task]
    assert ids("approve-dangling", task, "") == [call_id]
    assert ids("approve-dangling", "other", "") == []  # no held call: nothing
    assert ids("history", task, "") == []  # one task: nothing after it


def test_agentd_complete_is_silent_where_there_is_nothing_to_list(tmp_path: Path) -> None:
    for words in (["tasks"], ["calls", "nope"], ["what"]):
        done = subprocess.run(
            [str(AGENTD), "--spool", str(tmp_path / "none"), "__complete", *words],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
        assert (done.returncode, done.stdout, done.stderr) == (0, "", "")
    assert "__complete" not in PARSER.format_help()  # no command of a person's


@pytest.mark.skipif(shutil.which("zsh") is None, reason="zsh is not installed")
def test_zsh_completes_task_ids_and_call_ids(
    tmp_path: Path, two_tasks: tuple[Spool, str, str]
) -> None:
    script = tmp_path / "_agentd"
    script.write_text(completion("zsh"))
    home, task, call_id = two_tasks
    offered = (  # compadd, as the completion system calls it, printing what it is given
        f"autoload -Uz compinit && compinit -u -D -d {tmp_path}/zcd; source {script}; "
        'compadd() {{ print -l -- "${{(@P)2}}" }}; '
        f"_agentd_ctx=(--spool {home.root}); line=({{}}); {{}}"
    )
    for line, call, expected in (
        ("", "_agentd_tasks", [task, "other"]),
        (task, "_agentd_calls", [call_id]),
    ):
        done = subprocess.run(
            ["zsh", "-fc", offered.format(line, call)],
            capture_output=True, text=True, timeout=30, check=False, env=ON_PATH,
        )  # fmt: skip
        assert (done.returncode, done.stderr) == (0, ""), done
        assert done.stdout.split() == expected
    # the spec of each TASK and CALL_ID names those functions
    assert "'1:TASK\\: the task id:_agentd_tasks'" in script.read_text()
    assert ":_agentd_calls'" in script.read_text()


@pytest.mark.skipif(shutil.which("fish") is None, reason="fish is not installed")
def test_fish_completes_task_ids_and_call_ids(
    tmp_path: Path, two_tasks: tuple[Spool, str, str]
) -> None:
    def ids(line: str) -> list[str]:
        done = subprocess.run(
            ["fish", "--no-config", "-c",
             f"source {script}; complete -C 'agentd --spool {home.root} {line}'"],
            capture_output=True, text=True, timeout=30, check=False,
            env={**ON_PATH, "HOME": str(tmp_path)},
        )  # fmt: skip
        assert (done.returncode, done.stderr) == (0, ""), done
        return sorted(row.split("\t")[0] for row in done.stdout.splitlines())

    home, task, call_id = two_tasks
    script = tmp_path / "agentd.fish"
    script.write_text(completion("fish"))
    assert ids("logs ") == sorted([task, "other"])
    assert ids("status queued-one ") == sorted([task, "other"])
    assert ids("run --resume ") == sorted([task, "other"])
    assert ids(f"approve-dangling {task} ") == [call_id]
    assert ids("approve-dangling ") == sorted([task, "other"])


# -- zsh and fish, where installed ---------------------------------------------------------


@pytest.mark.skipif(shutil.which("zsh") is None, reason="zsh is not installed")
def test_the_zsh_script_parses_and_registers(tmp_path: Path) -> None:
    script = tmp_path / "_agentd"
    script.write_text(completion("zsh"))
    parses("zsh", script)
    done = subprocess.run(
        ["zsh", "-fc", f'autoload -Uz compinit && compinit -u -D -d {tmp_path}/zcd; '
                       f'source {script} && print -r -- $_comps[agentd]'],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert (done.returncode, done.stdout, done.stderr) == (0, "_agentd\n", "")


@pytest.mark.skipif(shutil.which("fish") is None, reason="fish is not installed")
def test_fish_completes_commands_options_and_values(tmp_path: Path) -> None:
    script = tmp_path / "agentd.fish"
    script.write_text(completion("fish"))
    parses("fish", script)

    def complete(line: str) -> list[str]:
        done = subprocess.run(
            ["fish", "--no-config", "-c", f"source {script}; complete -C '{line}'"],
            capture_output=True, text=True, timeout=30, check=False,
            env={**os.environ, "HOME": str(tmp_path)},
        )  # fmt: skip
        assert (done.returncode, done.stderr) == (0, ""), done
        return [row.split("\t")[0] for row in done.stdout.splitlines()]

    assert set(complete("agentd st")) == {"start", "stop", "status", "store"}
    assert set(complete("agentd status --")) == {
        "--help",
        "--json",
        "--watch",
        "--interval",
        *STATUS_SELECTION,
    }
    assert set(complete("agentd completion ")) == {"bash", "zsh", "fish"}
    assert set(complete("agentd --log-format ")) == {"json", "console"}


# -- the man page --------------------------------------------------------------------------


@pytest.mark.skipif(
    shutil.which("man") is None, reason="man is not installed (apt-get install man-db)"
)
def test_the_man_page_renders_every_command_and_option(tmp_path: Path) -> None:
    page = tmp_path / "agentd.1"
    done = subprocess.run(
        [sys.executable, "-m", "supervisor.manpage", "man"],
        capture_output=True, text=True, timeout=30, check=True, cwd=REPO,
    )  # fmt: skip
    page.write_text(done.stdout)
    shown = subprocess.run(
        ["man", "-l", str(page)],
        capture_output=True, text=True, timeout=30, check=False,
        env={**os.environ, "MANWIDTH": "100", "MANPAGER": "cat", "PAGER": "cat"},
    )  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    assert shown.stderr == ""
    text = shown.stdout
    assert text.startswith("AGENTD(1)")
    for section in ("NAME", "SYNOPSIS", "OPTIONS", "COMMANDS", "EXIT STATUS", "ENVIRONMENT"):
        assert f"\n{section}\n" in text, section
    for command in CLI.commands:
        assert f"\n   {command.name}\n" in text, command.name
        for option in command.options:
            assert option.flags[-1] in text, (command.name, option.flags)
    assert "78" in text and "/etc/agentd/agentd.toml" in text
