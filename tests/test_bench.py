"""``python -m bench --quick`` is the CI smoke run of every benchmark: it must run to the
end and print a row for each. It prints figures and asserts no timing: this test checks
only that each benchmark ran, never what it measured."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.__main__ import discover

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(960)  # (a hang guard: about 4 minutes idle, twice that on a loaded machine)
def test_quick_bench_runs_every_benchmark() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AGENTD_", "ANTHROPIC_"))}
    done = subprocess.run(
        [sys.executable, "-m", "bench", "--quick"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    report = f"stdout:\n{done.stdout[-6000:]}\nstderr:\n{done.stderr[-4000:]}"
    assert done.returncode == 0, report
    for name in discover():
        assert f"[{name}]" in done.stdout, f"no rows from {name}\n{report}"
    assert "bench: quick mode" in done.stdout, report
