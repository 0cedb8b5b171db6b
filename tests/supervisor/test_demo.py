"""`agentd demo` as a user runs it: it passes, says what to try next, and `--keep`
leaves a spool on which those commands work."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import pytest

from supervisor.demo import LEASE, cluster_next_commands, run_cluster_demo, wait_for
from supervisor.pgcluster import HOW_TO_GET, find_binaries
from tests.postgres import server_binaries
from tests.supervisor.test_cli import AGENTD, run_agentd


def test_demo_keep_leaves_its_spool_and_the_next_commands_work() -> None:
    done = run_agentd("demo", "--keep", timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    match = re.search(r"demo passed in [\d.]+ s; spool kept in (\S+)\n", done.stdout)
    assert match, done.stdout
    spool = Path(match[1])
    try:
        assert (spool / "tasks" / "demo" / "journal").is_file()
        tail = done.stdout.split("try next:\n", 1)[1]
        commands = [line.strip() for line in tail.splitlines() if line.startswith("  ") and
                    not line.startswith("      ")]  # fmt: skip
        assert len(commands) == 3, tail
        for command in commands:
            argv = shlex.split(command)
            assert Path(argv[0]).name == "agentd" and f"--spool {spool}" in command
            ran = subprocess.run(
                [str(AGENTD), *argv[1:]], capture_output=True, text=True, timeout=60, check=False
            )
            assert ran.returncode == 0, (command, ran.stderr)
            if argv[3] == "fork":  # no daemon runs there: the fork says that it waits
                assert "demo-b waits queued until `agentd start`" in ran.stderr, ran.stderr
                assert "waits queued until" in tail, tail
    finally:
        shutil.rmtree(spool.parent, ignore_errors=True)


def test_a_demo_step_waits_as_long_as_what_it_waits_for_moves_on_and_says_so() -> None:
    # Regression: on a loaded machine `demo --keep` gave up "waiting for the restart" at a
    # fixed 60 s while the task was on its way. A step now gives up only once what it
    # waits for has stopped moving for the whole timeout, and says when it takes long.
    clock = time.monotonic()
    told: list[str] = []

    def slow() -> object:  # a step that moves every 0.1 s and is done after 0.6 s
        elapsed = time.monotonic() - clock
        return True if elapsed > 0.6 else f"turn {int(elapsed * 10)}"

    with mock.patch("supervisor.demo.SLOW", 0.2):
        wait_for("the restart", slow, timeout=0.3, say=told.append)
    assert len(told) == 1 and "still waiting for the restart" in told[0], told
    assert "load average" in told[0]
    with pytest.raises(RuntimeError, match=r"nothing moved on for 0.3 s \(last seen: backoff\); "):
        wait_for("the restart", lambda: "backoff", timeout=0.3)


def test_demo_cluster_shows_node_b_taking_over_from_a_killed_node_a() -> None:
    """Two nodes on a real (throwaway) PostgreSQL: the story names the kill, b's claim
    within the lease and a bit, and the checks that nothing ran twice."""
    server_binaries()
    done = run_agentd("demo", "--cluster", timeout=240)
    story = done.stdout + done.stderr
    assert done.returncode == 0, story
    assert "2. node a claimed it (epoch 1); node b started" in story
    assert re.search(r"3\. at turn \d+, in its model call: kill -9 of node a's whole tree", story)
    took = re.search(r"4\. node b claimed it ([\d.]+) s after the kill \(epoch (\d+)\)", story)
    assert took, story
    assert float(took[1]) <= LEASE + 10 and int(took[2]) > 1, story
    assert re.search(r"5\. task done \(end_turn\) after \d+ turns", story), story
    checks = re.findall(r"^  \[(ok|FAIL)\] (.+)$", story, re.MULTILINE)
    assert len(checks) == 6 and all(ok == "ok" for ok, _ in checks), story
    assert "demo passed" in story


def test_demo_cluster_without_the_server_binaries_says_how_to_get_them_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def nowhere() -> Path:
        return find_binaries(path=str(tmp_path), fallbacks=[tmp_path])

    assert run_cluster_demo(binaries=nowhere) == 1
    said = capsys.readouterr()
    assert said.out == ""
    assert said.err == f"agentd demo --cluster: {HOW_TO_GET}\n"


def test_demo_cluster_refuses_keep_in_one_line() -> None:
    done = run_agentd("demo", "--cluster", "--keep")
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "keeps nothing" in done.stderr


def test_demo_cluster_try_next_lines_work_from_another_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lines are printed where `make demo-cluster` ran (the repository's root) and
    typed wherever the user is next: each program is named so that it runs from there."""
    server_binaries()
    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    lines = [command for command, _ in cluster_next_commands()]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENTD_")}
    up = subprocess.run(
        shlex.split(lines[0]),
        cwd=elsewhere, capture_output=True, text=True, timeout=120, env=env, check=False,
    )  # fmt: skip
    assert up.returncode == 0, (lines[0], up.stderr)
    folder, url = up.stdout.split()
    try:
        for line in lines[1:]:
            argv = shlex.split(line.replace("AGENTD_STORE=URL ", ""))
            assert Path(argv[0]).name == "agentd"
            ran = subprocess.run(
                [argv[0], "--version"], cwd=elsewhere, capture_output=True, text=True,
                timeout=60, env={**env, "AGENTD_STORE": url}, check=False,
            )  # fmt: skip
            assert ran.returncode == 0, (line, ran.stderr)
    finally:
        subprocess.run(
            [sys.executable, "-m", "supervisor.pgcluster", "down", folder],
            capture_output=True, timeout=120, check=False,
        )  # fmt: skip
