"""``agentd tools [TASK] [--json]``, ``agentd config check`` with MCP servers, ``--tools``
globs, and a config with servers where the ``mcp`` SDK is missing (docs/design.md section
11). Run as the installed ``agentd``, in processes of their own."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from tests.mcp.servers import FAULT_SERVER, fault_server, time_server, write_config
from tests.support import finish, make_spool, reply, scripted_task, start_worker, text, tool_use
from worker.config import load_config

AGENTD = Path(sys.executable).with_name("agentd")

BLOCK_MCP = """\
import sys


class _NoMcp:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ("mcp", "mcp_types"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, _NoMcp())
"""


def agentd(
    tmp_path: Path, *args: str, site: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("AGENTD_")}
    environ.update(env or {})
    if site is not None:
        environ["PYTHONPATH"] = str(site)
    return subprocess.run(
        [str(AGENTD), "--spool", str(tmp_path / "spool"), *args],
        check=False,
        capture_output=True,
        text=True,
        env=environ,
        cwd=tmp_path,
        timeout=120,
    )


SERVERS: dict[str, dict[str, Any]] = {
    "f": {"command": fault_server(), "trust": True, "effects": {"echo": "keyed"}},
    "time": {"command": time_server()},
}


def test_tools_lists_every_tool_with_its_effect_and_where_it_came_from(tmp_path: Path) -> None:
    config = write_config(
        tmp_path / "agentd.toml", SERVERS, tools={"policy": {"mcp__f__count": "rerun"}}
    )
    done = agentd(tmp_path, "--config", str(config), "tools", "--json")
    assert done.returncode == 0, done.stderr
    rows = {row["name"]: row for row in json.loads(done.stdout)}
    assert set(rows["read_file"]) == {"name", "source", "server", "tool", "effect", "effect_from"}
    assert rows["read_file"] == {
        "name": "read_file",
        "source": "builtin",
        "server": None,
        "tool": "read_file",
        "effect": "read_only",
        "effect_from": "declared",
    }
    assert rows["mcp__f__echo"]["effect"] == "keyed"
    assert rows["mcp__f__echo"]["effect_from"] == "effects"
    assert (rows["mcp__f__settle"]["effect"], rows["mcp__f__settle"]["effect_from"]) == (
        "idempotent",
        "annotation",
    )
    assert (rows["mcp__f__count"]["effect"], rows["mcp__f__count"]["effect_from"]) == (
        "idempotent",
        "policy",
    )
    time_row = rows["mcp__time__get_current_time"]
    assert (time_row["source"], time_row["server"], time_row["tool"]) == (
        "mcp",
        "time",
        "get_current_time",
    )
    assert (time_row["effect"], time_row["effect_from"]) == ("unsafe", "default")  # untrusted
    table = agentd(tmp_path, "--config", str(config), "tools")
    assert table.returncode == 0 and "mcp__time__convert_time" in table.stdout


def test_tools_of_a_task_is_its_recorded_list(tmp_path: Path) -> None:
    config_path = write_config(tmp_path / "agentd.toml", SERVERS)
    spool = make_spool(tmp_path)
    task = scripted_task(
        spool,
        [reply(tool_use("mcp__f__echo", "c1", text="hi")), reply(text("Done."))],
        config=load_config(config_path),
        tools=["list_dir", "mcp__f__e*"],
    )
    code, err = finish(start_worker(task, args=["--config", str(config_path)]), 90)
    assert code == 0, err
    write_config(config_path, {"time": SERVERS["time"]})  # the server gone from the config
    done = agentd(tmp_path, "--config", str(config_path), "tools", task.id, "--json")
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)
    assert [r["name"] for r in rows] == ["list_dir", "mcp__f__echo", "mcp__f__env"]
    assert rows[1]["effect"] == "keyed"  # as recorded, whatever the config says now
    missing = agentd(tmp_path, "--config", str(config_path), "tools", "nope")
    assert missing.returncode == 3 and missing.stderr.count("\n") == 1


def test_config_check_starts_each_server_once(tmp_path: Path) -> None:
    config = write_config(tmp_path / "agentd.toml", SERVERS)
    done = agentd(tmp_path, "config", "check", str(config))
    assert done.returncode == 0, done.stderr
    assert "mcp servers f (18 tools), time (2 tools)" in done.stdout


def test_a_server_that_cannot_start_is_marked_and_the_rest_still_listed(tmp_path: Path) -> None:
    # Regression: one server that could not start here (the README's `mcp-server-git
    # --repository .` outside a repository) made `tools` and `config check` exit 78 with
    # nothing listed, not even the built-in tools.
    servers = {"bad": {"command": fault_server("--fail-start")}, "time": SERVERS["time"]}
    config = write_config(tmp_path / "agentd.toml", servers)
    said = f"agentd: {config}: mcp.servers.bad: cannot start:"
    done = agentd(tmp_path, "config", "check", str(config))
    assert done.returncode == 1, done
    assert "mcp servers bad (could not start here), time (2 tools)" in done.stdout
    assert done.stdout.startswith(f"{config}: 1 mcp server(s) could not start here (")
    assert done.stderr.count("\n") == 1 and done.stderr.startswith(said), done.stderr
    assert "refusing to start" in done.stderr  # the server's last words
    assert f"which starts in {tmp_path} here" in done.stderr
    for args in (("tools",), ("tools", "--json")):
        done = agentd(tmp_path, "--config", str(config), *args)
        assert done.returncode == 1, done
        assert done.stderr.count("\n") == 1 and done.stderr.startswith(said), done.stderr
        assert "read_file" in done.stdout and "mcp__time__convert_time" in done.stdout
    rows = {r["name"] for r in json.loads(done.stdout)}
    assert "run_command" in rows and not any(n.startswith("mcp__bad__") for n in rows)
    table = agentd(tmp_path, "--config", str(config), "tools").stdout.splitlines()
    assert table[-1].split() == ["mcp__bad__*", "mcp", "bad", "-", "-", "could", "not", "start",
                                 "here"]  # fmt: skip


def test_config_check_says_why_a_server_in_a_home_folder_cannot_be_shown_whole(
    tmp_path: Path,
) -> None:
    """A server at ``~/bin/server`` that imports from ``~/lib``: its installation would be
    the home folder itself, which the sandbox never shows whole; only the file is shown,
    it cannot find its module, and the error says why, in one line."""
    home = Path(tempfile.mkdtemp(prefix="agentd-home-", dir="/var/tmp"))  # (not /tmp: own)
    try:
        (home / "bin").mkdir()
        (home / "lib").mkdir()
        (home / "lib" / "helper.py").write_text("NAME = 'helper'\n")
        server = home / "bin" / "server"
        server.write_text(
            f"#!{sys.executable}\nimport sys\nsys.path.insert(0, {str(home / 'lib')!r})\n"
            f"import helper\nexec(open({str(FAULT_SERVER)!r}).read())\n"
        )
        server.chmod(0o755)
        config = write_config(tmp_path / "agentd.toml", {"mine": {"command": [str(server)]}})
        done = agentd(tmp_path, "config", "check", str(config), env={"HOME": str(home)})
        assert done.returncode == 1, done.stderr  # (marked, the rest listed: exit 1)
        assert done.stderr.count("\n") == 1 and "mine (could not start here)" in done.stdout
        assert "No module named 'helper'" in done.stderr  # the server's last words
        assert f"{server} lies in {home}, which the sandbox never shows whole" in done.stderr
        # the control: the same server started bare finds its module
        bare = write_config(
            tmp_path / "bare.toml",
            {"mine": {"command": [str(server)]}},
            tools={"sandbox": "off"},
        )
        done = agentd(tmp_path, "config", "check", str(bare), env={"HOME": str(home)})
        assert done.returncode == 0, done.stderr
    finally:
        shutil.rmtree(home, ignore_errors=True)


def test_config_check_refuses_effects_for_a_tool_the_server_does_not_list(tmp_path: Path) -> None:
    servers = {"f": {"command": fault_server(), "effects": {"ecco": "read_only"}}}
    done = agentd(tmp_path, "config", "check", str(write_config(tmp_path / "agentd.toml", servers)))
    assert done.returncode == 78
    assert "mcp.servers.f.effects names 'ecco', which the server does not list" in done.stderr


def test_submit_takes_globs_and_refuses_what_names_nothing(tmp_path: Path) -> None:
    config = str(write_config(tmp_path / "agentd.toml", SERVERS))
    ok = agentd(
        tmp_path, "--config", config, "submit", "--prompt", "hi", "--tools", "read_*,mcp__f__*"
    )
    assert ok.returncode == 0, ok.stderr
    bad = agentd(tmp_path, "--config", config, "submit", "--prompt", "hi", "--tools", "mcp__g__*")
    assert bad.returncode == 2 and "unknown tool(s) mcp__g__*" in bad.stderr


def test_servers_without_the_sdk_is_a_config_error_naming_the_extra(tmp_path: Path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCK_MCP)
    config = str(write_config(tmp_path / "agentd.toml", SERVERS))
    for args in (
        ["config", "check", config],
        ["--config", config, "start"],
        ["--config", config, "status"],
    ):
        done = agentd(tmp_path, *args, site=site)
        assert done.returncode == 78, done
        assert done.stderr.count("\n") == 1
        assert "pip install 'agentd[mcp]'" in done.stderr
    plain = write_config(tmp_path / "plain.toml", {})
    assert agentd(tmp_path, "config", "check", str(plain), site=site).returncode == 0
