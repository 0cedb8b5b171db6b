"""The daemon probes run_command's sandbox once at start, and never fails in silence.

Under ``required`` (and under ``auto`` with a store configured) a sandbox that cannot
run stops ``agentd start`` with exit 78 and one line; under ``auto`` the daemon starts,
says ``sandbox_unavailable`` (a warning), sets ``agentd_sandbox_available`` to 0 and shows
``supervisor.sandbox`` in ``status --json`` and in the status header. The broken sandbox
here is a real one: a PATH without bwrap (``tests/unitjail.py`` makes the other, a unit
whose seccomp filter leaves bwrap no namespaces).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.daemon import Daemon
from tests.supervisor.test_metrics import Scraper, free_port
from worker.config import default_config_text, load_config
from worker.tools.sandbox import SandboxMode, probe

BWRAP_WORKS = probe("bwrap", True).problem is None
needs_bwrap = pytest.mark.skipif(
    not BWRAP_WORKS and not os.environ.get("CI"), reason="bwrap does not work here"
)

pytestmark = pytest.mark.usefixtures("subreaper")


def no_bwrap_path(tmp_path: Path) -> dict[str, str]:
    """A PATH with the shell but no bwrap on it."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "sh").symlink_to("/bin/sh")
    return {"PATH": str(bin_dir)}


def assert_one_line_78(done: subprocess.CompletedProcess[str], *words: str) -> None:
    assert done.returncode == 78, done
    line = done.stderr
    assert line.startswith("agentd: ") and line.count("\n") == 1, f"not one line: {line!r}"
    for word in words:
        assert word in line, (word, line)


def test_required_and_no_sandbox_refuses_the_start_with_exit_78(tmp_path: Path) -> None:
    daemon = Daemon(tmp_path, '[tools]\nsandbox = "required"\n')
    try:
        done = daemon.run_cli("start", env=no_bwrap_path(tmp_path))
        assert_one_line_78(done, "tools.sandbox", "bwrap not found", "install bubblewrap")
        assert not (daemon.spool.root / "supervisor.json").exists()
    finally:
        daemon.cleanup()


def test_auto_and_no_sandbox_starts_and_says_so_everywhere(tmp_path: Path) -> None:
    port = free_port()
    daemon = Daemon(tmp_path, f'[metrics]\nlisten = "127.0.0.1:{port}"\n')
    try:
        daemon.start(no_bwrap_path(tmp_path))
        (warning,) = [e for e in daemon.log_events() if e.get("event") == "sandbox_unavailable"]
        assert warning["level"] == "warning" and "bwrap not found" in warning["why"]
        code, out, _ = daemon.cli("status", "--json")
        assert code == 0
        assert json.loads(out)["supervisor"]["sandbox"].startswith("bare: bwrap not found")
        code, out, _ = daemon.cli("status")
        assert "run_command sandbox: bare: bwrap not found" in out.splitlines()[0]
        assert Scraper(daemon, port).value("agentd_sandbox_available") == 0
    finally:
        daemon.cleanup()


@needs_bwrap
def test_a_working_sandbox_shows_bwrap_and_the_gauge_is_1(tmp_path: Path) -> None:
    port = free_port()
    daemon = Daemon(tmp_path, f'[metrics]\nlisten = "127.0.0.1:{port}"\n')
    try:
        daemon.start()
        assert not [e for e in daemon.log_events() if e.get("event") == "sandbox_unavailable"]
        _, out, _ = daemon.cli("status", "--json")
        assert json.loads(out)["supervisor"]["sandbox"] == "bwrap"
        assert Scraper(daemon, port).value("agentd_sandbox_available") == 1
        daemon.stop()
        _, out, _ = daemon.cli("status", "--json")
        assert json.loads(out)["supervisor"]["sandbox"] is None  # no daemon: no probe
    finally:
        daemon.cleanup()


def test_with_a_store_auto_is_required(tmp_path: Path, postgres_schema: str) -> None:
    daemon = Daemon(tmp_path, "")  # sandbox = "auto", the default
    try:
        env = {**no_bwrap_path(tmp_path), "AGENTD_STORE": postgres_schema, "AGENTD_NODE": "n1"}
        done = daemon.run_cli("start", env=env)
        assert_one_line_78(done, "a store is configured", "bwrap not found")
    finally:
        daemon.cleanup()


def test_init_system_writes_sandbox_required(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from supervisor import cli
    from worker import paths

    path = tmp_path / "etc" / "agentd" / "agentd.toml"
    monkeypatch.setattr(paths, "SYSTEM_CONFIG", path)
    assert cli.main(["init", "--system"]) == 0
    assert capsys.readouterr().out == f"wrote {path}\n"
    assert load_config(path).tools.sandbox is SandboxMode.REQUIRED
    # the rest is the default file, key for key
    system, default = path.read_text(), default_config_text()
    assert system != default
    user = tmp_path / "user.toml"
    user.write_text(default)
    assert load_config(path).tools.network == load_config(user).tools.network
    assert load_config(user).tools.sandbox is SandboxMode.AUTO
