"""`agentd demo` as a user runs it: it passes, says what to try next, and `--keep`
leaves a spool on which those commands work."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from supervisor.demo import run_cluster_demo
from supervisor.pgcluster import HOW_TO_GET, find_binaries
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
    finally:
        shutil.rmtree(spool.parent, ignore_errors=True)


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
