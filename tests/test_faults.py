"""The fault-injection and security campaign in CI: the quick mode of each module of
``tests/faults`` (``python -m tests.faults --full`` is the full campaign, for ``make chaos``).

Each module's figures are printed into the test output whether it passes or not; every
violation must be 0. The crash-point and I/O-error campaigns inject their faults with
strace: without it they fail (they do not skip), saying to install it.
"""

from __future__ import annotations

import importlib
import shutil

import pytest

from tests.faults.common import STRACE_MISSING
from tests.faults.report import format_figures, violations
from tests.support import missing_system_tool

NEEDS_STRACE = {"crash_points", "io_errors"}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", ["crash_points", "io_errors", "torn", "fuzz", "security"])
def test_fault_campaign(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    if name in NEEDS_STRACE and shutil.which("strace") is None:
        missing_system_tool(STRACE_MISSING)
    figures = importlib.import_module(f"tests.faults.{name}").run(quick=True)
    with capsys.disabled():
        print("\n" + format_figures(figures), flush=True)
    bad = violations(figures)
    assert not bad, "; ".join(f"{f.name}: {f.value}" for f in bad)
