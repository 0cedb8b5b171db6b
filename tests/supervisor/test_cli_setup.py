"""What an operator meets first (docs/design.md section 2): where the config is found and
written, what `config check` reports, a named spool that does not exist, and errors that
say what to do. Real files, the real `agentd` script as a process where it matters.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from supervisor import cli
from supervisor.coordination import running_pid
from tests.support import (
    REPO,
    make_spool,
    poll_for,
    reply,
    scripted_task,
    text,
    tool_use,
    worker_env,
)
from worker import paths
from worker.config import load_config
from worker.spool import Spool

AGENTD = Path(sys.executable).with_name("agentd")


@pytest.fixture
def xdg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``$XDG_CONFIG_HOME`` of this test (the suite's fixture already isolates it)."""
    home = tmp_path / "xdg"
    monkeypatch.setenv("XDG_CONFIG_HOME", str(home))
    for name in ("AGENTD_SPOOL", "AGENTD_CONFIG", "STATE_DIRECTORY"):
        monkeypatch.delenv(name, raising=False)
    return home


@pytest.fixture
def system_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``/etc/agentd/agentd.toml``, moved where a test may write it."""
    path = tmp_path / "etc" / "agentd" / "agentd.toml"
    monkeypatch.setattr(paths, "SYSTEM_CONFIG", path)
    return path


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    capsys.readouterr()
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def agentd(*args: str, env: dict[str, str], cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(AGENTD), *args],
        cwd=cwd,
        env=worker_env(env),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def one_line(err: str, *words: str) -> None:
    assert err.startswith("agentd: ") and err.count("\n") == 1, err
    assert "Traceback" not in err and "Errno" not in err, err
    for word in words:
        assert word in err, (word, err)


# -- discovery -----------------------------------------------------------------------------


def test_discovery_order_named_then_xdg_then_system_then_defaults(
    xdg: Path, system_config: Path, tmp_path: Path
) -> None:
    user = xdg / "agentd" / "agentd.toml"
    named = tmp_path / "named.toml"
    for path, workers in ((user, 3), (system_config, 4), (named, 5)):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"max_workers = {workers}\n")
    env = {"XDG_CONFIG_HOME": str(xdg)}

    assert load_config(named, environ=env).max_workers == 5
    assert load_config(environ={**env, "AGENTD_CONFIG": str(named)}).source == named
    assert load_config(environ=env).source == user
    user.unlink()
    assert load_config(environ=env).source == system_config
    system_config.unlink()
    assert load_config(environ=env).source is None
    # without XDG_CONFIG_HOME (or with a relative one, which the XDG spec ignores): ~/.config
    home = {"HOME": str(tmp_path / "home"), "XDG_CONFIG_HOME": "relative/dir"}
    assert paths.user_config_path(home) == tmp_path / "home/.config/agentd/agentd.toml"


def test_init_writes_where_discovery_reads(
    xdg: Path, system_config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    user = xdg / "agentd" / "agentd.toml"
    assert run(["init"], capsys) == (0, f"wrote {user}\n", "")
    code, out, err = run(["config", "check"], capsys)
    assert (code, err) == (0, "") and out.startswith(f"{user}: ok"), out

    assert run(["init", "--system"], capsys) == (0, f"wrote {system_config}\n", "")
    user.unlink()
    assert run(["config", "check"], capsys)[1].startswith(f"{system_config}: ok")


def test_init_on_an_existing_file_exits_1_and_keeps_it(
    xdg: Path, system_config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for args, path in (
        (["init"], xdg / "agentd" / "agentd.toml"),
        (["init", "--system"], system_config),
    ):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("# mine\n")
        code, out, err = run(args, capsys)
        assert (code, out) == (1, "")
        one_line(err, str(path), "exists", "--force")
        assert path.read_text() == "# mine\n"
    code, _, err = run(["init", "somewhere.toml", "--system"], capsys)
    assert code == 2 and "not both" in err


def test_the_daemon_and_its_workers_read_the_discovered_config(tmp_path: Path) -> None:
    """Only the XDG file names the user tool module: a task that calls its tool finishes
    only if the worker, a process of its own, read that same file."""
    xdg = tmp_path / "xdg"
    (xdg / "agentd").mkdir(parents=True)
    (xdg / "agentd" / "agentd.toml").write_text(
        '[tools]\nmodules = ["tests.tools_fixture"]\n[heartbeat]\ninterval = 0.2\n'
    )
    spool = tmp_path / "spool"
    env = {"XDG_CONFIG_HOME": str(xdg)}
    script = tmp_path / "script.json"
    script.write_text(
        json.dumps({"responses": [reply(tool_use("shout", text="hi")), reply(text("Done."))]})
    )
    done = agentd("--spool", str(spool), "submit", "--prompt", "x", "--name", "t1",
                  "--tools", "shout", "--script", str(script), env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert agentd("--spool", str(spool), "start", "--detach", env=env).returncode == 0
    try:

        def ended() -> dict[str, object] | None:
            doc = json.loads(
                agentd("--spool", str(spool), "status", "t1", "--json", env=env).stdout
            )
            row: dict[str, object] = doc["tasks"][0]
            return row if row["state"] in ("done", "failed") else None

        row = poll_for(ended, 30, interval=0.2, what="the task to end")
        assert (row["state"], row["reason"]) == ("done", "end_turn"), row
    finally:
        agentd("--spool", str(spool), "stop", env=env)
    assert running_pid(Spool(spool)) is None


# -- config check --------------------------------------------------------------------------


def test_config_check_file_names_the_file_and_imports_every_module(
    xdg: Path, system_config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = tmp_path / "good.toml"
    good.write_text('[tools]\nmodules = ["tests.tools_fixture"]\n')
    code, out, err = run(["config", "check", str(good)], capsys)
    assert (code, err) == (0, "")
    assert out.startswith(f"{good}: ok") and "tests.tools_fixture" in out

    # a module that exists but fails as it is imported: only an import finds that
    broken = tmp_path / "pkg_broken_tools.py"
    broken.write_text("raise RuntimeError('half-written module')\n")
    sys.path.insert(0, str(tmp_path))
    try:
        bad = tmp_path / "bad.toml"
        bad.write_text('[tools]\nmodules = ["tests.tools_fixture", "pkg_broken_tools"]\n')
        code, out, err = run(["config", "check", str(bad)], capsys)
        assert (code, out) == (78, "")
        one_line(err, str(bad), "tools.modules[1]", "pkg_broken_tools", "half-written module")
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("pkg_broken_tools", None)

    code, out, err = run(["config", "check"], capsys)
    assert code == 0 and out.startswith("built-in defaults: ok")
    assert str(xdg / "agentd" / "agentd.toml") in out and str(system_config) in out


def test_a_missing_tool_module_fails_config_check_and_start_with_78(tmp_path: Path) -> None:
    xdg = tmp_path / "xdg"
    (xdg / "agentd").mkdir(parents=True)
    config = xdg / "agentd" / "agentd.toml"
    config.write_text('[tools]\nmodules = ["nonexistent_mod"]\n')
    env = {"XDG_CONFIG_HOME": str(xdg)}
    spool = str(tmp_path / "spool")
    for args in (
        ["config", "check"],
        ["--spool", spool, "start"],
        ["--spool", spool, "start", "--detach"],
    ):
        done = agentd(*args, env=env)
        assert (done.returncode, done.stdout) == (78, ""), (args, done)
        one_line(done.stderr, str(config), "nonexistent_mod", "tools.modules[0]")
    assert running_pid(Spool(Path(spool))) is None


# -- a named spool that does not exist -----------------------------------------------------

READERS = [
    ["status"],
    ["status", "t1"],
    ["logs", "t1"],
    ["history", "t1"],
    ["dangling"],
    ["approve-dangling", "t1", "--all"],
    ["rewind", "t1", "--to", "1"],
    ["fork", "t1", "--at", "1"],
    ["cancel", "t1"],
    ["retry", "t1"],
    ["stop"],
]


@pytest.mark.parametrize("args", READERS, ids=" ".join)
def test_a_named_spool_that_does_not_exist_is_one_line_and_exit_1(
    tmp_path: Path, args: list[str], xdg: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    missing = tmp_path / "nonexistent" / "x"
    code, out, err = run(["--spool", str(missing), *args], capsys)
    assert (code, out) == (1, "")
    one_line(err, f"no spool at {missing}", "--spool", "start")
    monkeypatch.setenv("AGENTD_SPOOL", str(missing))
    code, out, err = run(args, capsys)
    assert (code, out) == (1, "")
    one_line(err, str(missing), "$AGENTD_SPOOL")
    assert not (tmp_path / "nonexistent").exists()


def test_the_installed_command_refuses_a_mistyped_spool_but_submit_creates_one(
    tmp_path: Path,
) -> None:
    typo = tmp_path / "spoool"
    done = agentd("--spool", str(typo), "status", env={})
    assert (done.returncode, done.stdout) == (1, "")
    one_line(done.stderr, str(typo))
    done = agentd("--spool", str(typo), "submit", "--prompt", "x", "--name", "t1", env={})
    assert (done.returncode, done.stdout) == (0, "t1\n"), done.stderr
    done = agentd("--spool", str(typo), "status", env={})
    assert done.returncode == 0 and "t1" in done.stdout


# -- errors that say what to do ------------------------------------------------------------


def test_a_script_with_a_json_error_names_the_file_and_the_place(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], xdg: Path
) -> None:
    script = tmp_path / "script.json"
    # the second comma of line 2, column 49 as an editor counts, is the mistake
    script.write_text('{"responses": [\n  {"content": [{"type": "text", "text": "hi"}]},,\n]}\n')
    code, out, err = run(["--spool", str(tmp_path / "s"), "submit", "--prompt", "x",
                          "--script", str(script)], capsys)  # fmt: skip
    assert (code, out) == (2, "")
    one_line(err, str(script), "line 2, column 49", "not valid JSON", '{"responses": [...]}')


@pytest.mark.parametrize("option", ["--script", "--prompt-file"])
def test_a_missing_input_file_is_one_line(
    tmp_path: Path, option: str, capsys: pytest.CaptureFixture[str], xdg: Path
) -> None:
    missing = tmp_path / "nope.txt"
    argv = ["--spool", str(tmp_path / "s"), "submit", option, str(missing)]
    if option == "--script":
        argv += ["--prompt", "x"]
    code, out, err = run(argv, capsys)
    assert (code, out) == (2, "")
    one_line(err, option, str(missing), "no such file", "check the path")


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Path]:
    spool = tmp_path / "spool"
    done = agentd("--spool", str(spool), "start", "--detach", env={})
    assert done.returncode == 0, done.stderr
    yield spool
    agentd("--spool", str(spool), "stop", env={})


def test_a_second_start_says_to_stop_the_first_either_way(daemon: Path) -> None:
    pid = running_pid(Spool(daemon))
    for args in (["start"], ["start", "--detach"]):
        done = agentd("--spool", str(daemon), *args, env={})
        assert (done.returncode, done.stdout) == (1, ""), done
        one_line(done.stderr, f"already running on {daemon} (pid {pid})", "agentd stop")
    assert running_pid(Spool(daemon)) == pid
    assert os.path.exists(daemon / "supervisor.lock")


#: What `agentd status --json` reads a spool without: each is a writer's, or one other
#: command's, and costs its start-up (docs/design.md section 3; bench/status.py times it).
NOT_FOR_STATUS = (
    "orjson",  # writes JSON (worker.store.durable.dump_json); status only reads
    "ctypes",  # renameat2 and prctl: a move, a process holding secrets
    "subprocess",  # git and the sandbox probe
    "tempfile",  # a submit's staging folder
    "hashlib",  # OpenSSL, for long MCP tool names and span ids
    "tomli_w",  # `agentd init` writes TOML; loading a config only reads it
    "difflib",  # a misspelt config key's hint
    "worker.vcs",  # a submit with --workspace
    "supervisor.views",  # the table; --json prints none
)


def test_a_command_imports_no_more_than_it_needs(tmp_path: Path) -> None:
    """Every `agentd status` pays for what the CLI imports before it reads a task: not the
    SDK, not PostgreSQL's driver, not asyncio (the daemon's, about 20 ms of start-up), not
    OpenTelemetry (the daemon's exporter's alone, with traces on); `status --json` not what
    only writers and other commands use either (``NOT_FOR_STATUS``)."""
    spool = make_spool(tmp_path)  # a task to show: the table's code is read too
    scripted_task(spool, [reply(text("hi"))])
    for shown, unwanted in (
        (
            ["status", "--json"],
            {"anthropic", "psycopg", "asyncio", "opentelemetry", *NOT_FOR_STATUS},
        ),
        (["status"], {"anthropic", "psycopg", "asyncio", "opentelemetry"}),
    ):
        code = (
            "import sys\n"
            "from supervisor.cli import main\n"
            f"main(['--spool', {str(spool.root)!r}, *{shown!r}])\n"
            f"heavy = set({sorted(unwanted)!r}) & set(sys.modules)\n"
            "assert not heavy, f'imported: {sorted(heavy)}'\n"
        )
        done = subprocess.run(
            [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=False
        )
        assert done.returncode == 0, (shown, done.stderr)
