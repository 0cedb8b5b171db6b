"""Hooks (``supervisor.hooks``) on a real asyncio loop, with real processes: what a hook
is given, how a failure or a hang is reported, and that the loop never waits on one.
The end-to-end cases, on a real daemon, are in ``test_events.py``."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from supervisor.hooks import HookRunner, check_commands
from tests.support import REPO
from worker.config import HooksConfig
from worker.errors import ConfigError

EVENT = {"event": "dangling_held", "task": "t1", "reason": "held", "node": "n1"}


def run_hooks(
    commands: list[list[str]], *, timeout: float = 5.0, within: float = 10.0
) -> tuple[list[tuple[str, str, str]], float, int]:
    """Start each command as a hook and run the loop until all have ended: the failures
    reported, the longest gap between two loop ticks (seconds), and the ticks counted."""
    reports: list[tuple[str, str, str]] = []

    async def main() -> tuple[float, int]:
        runner = HookRunner(
            {"PATH": "/usr/bin:/bin"},
            lambda *report: reports.append(report),
            timeout=timeout,
        )
        for command in commands:
            runner.run("on_held", command, EVENT)
        gap, ticks, last = 0.0, 0, time.monotonic()
        deadline = last + within
        while runner.pids():
            assert time.monotonic() < deadline, "the hooks did not end"
            await asyncio.sleep(0.01)
            now = time.monotonic()
            gap, ticks, last = max(gap, now - last), ticks + 1, now
        return gap, ticks

    gap, ticks = asyncio.run(main())
    return reports, gap, ticks


def test_a_hook_gets_the_event_on_stdin_and_its_name_and_task_in_its_environment(
    tmp_path: Path,
) -> None:
    out = tmp_path / "out.json"
    script = (
        "import json, os, sys; json.dump({'stdin': json.load(sys.stdin), "
        "'env': dict(os.environ)}, open(sys.argv[1], 'w'))"
    )
    reports, _, _ = run_hooks([[sys.executable, "-c", script, str(out)]])

    assert reports == []
    seen = json.loads(out.read_text())
    assert seen["stdin"] == EVENT
    assert seen["env"]["AGENTD_EVENT"] == "dangling_held"
    assert seen["env"]["AGENTD_TASK"] == "t1"
    assert seen["env"]["PATH"] == "/usr/bin:/bin"  # the environment it was given, no more


def test_a_failing_hook_is_reported_with_its_code_and_last_stderr_line() -> None:
    reports, _, _ = run_hooks(
        [["sh", "-c", "echo first >&2; echo 'no route to host' >&2; exit 3"], ["true"]]
    )
    assert reports == [("t1", "on_held", "exit 3: no route to host")]


def test_a_hook_that_cannot_start_is_reported_not_raised(tmp_path: Path) -> None:
    reports, _, _ = run_hooks([[str(tmp_path / "missing")]])
    ((task, hook, why),) = reports
    assert (task, hook) == ("t1", "on_held")
    assert why.startswith(f"cannot start {tmp_path / 'missing'}: ")


def test_a_hook_past_its_limit_is_killed_with_its_group_and_the_loop_never_waits(
    tmp_path: Path,
) -> None:
    pidfile = tmp_path / "child.pid"
    hang = f"sleep 60 & echo $! > {pidfile}; wait"
    started = time.monotonic()
    reports, gap, ticks = run_hooks([["sh", "-c", hang]], timeout=0.5)
    took = time.monotonic() - started

    assert reports == [("t1", "on_held", "killed after 0.5 s")]
    assert 0.5 <= took < 3.0
    assert gap < 0.3 and ticks > 20  # the loop went on turning while the hook hung
    child = int(pidfile.read_text())
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == "zombie"


def test_config_check_names_a_hook_command_that_does_not_exist(tmp_path: Path) -> None:
    check_commands(HooksConfig(on_done=("true",), on_held=(sys.executable, "-V")), "f.toml")
    with pytest.raises(ConfigError, match=r"f.toml: hooks.on_failed: no-such-pager-x "):
        check_commands(HooksConfig(on_failed=("no-such-pager-x",)), "f.toml")
    with pytest.raises(ConfigError, match="is not an executable file"):
        check_commands(HooksConfig(on_held=(str(tmp_path / "pager"),)), "f.toml")


def test_a_hook_that_writes_hundreds_of_megabytes_of_stderr_leaves_the_daemon_small() -> None:
    """Only the end of a hook's stderr is read back: 200 MB of it must not reach the
    daemon's memory (its peak resident size, measured in a process of its own)."""
    flood = (
        "import os; chunk = b'x' * (1 << 20); "
        "[os.write(2, chunk) for _ in range(200)]; os.write(2, b'\\nthe last words\\n'); "
        "raise SystemExit(1)"
    )
    probe = (
        "import sys, json\n"
        "from tests.supervisor.test_hooks import run_hooks\n"
        f"reports, _, _ = run_hooks([[sys.executable, '-c', {flood!r}]], timeout=120, within=150)\n"
        # VmHWM, not getrusage's ru_maxrss: Linux carries the latter over an execve, so a
        # probe forked from a large test process would report that process's peak
        "peak = next(int(line.split()[1]) * 1024 for line in open('/proc/self/status')\n"
        "            if line.startswith('VmHWM:'))\n"
        "print(json.dumps({'reports': reports, 'peak': peak}))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=200,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["reports"] == [["t1", "on_held", "exit 1: the last words"]]
    assert result["peak"] < 100 * 1024 * 1024  # the interpreter and the loop: some 20-40 MB
