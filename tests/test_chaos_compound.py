"""Compound failures in CI: the quick mode of ``tests/chaos/compound.py`` (fault class 5).

A kill -9 during recovery (the worker resuming a task a first kill left), while a decision
is applied, during ``agentd approve-dangling``, ``rewind`` and ``fork``; the state after the
double recovery must equal the state after a single one. ``python -m tests.chaos.compound
--full`` visits every kill point. The figures are printed whether the test passes or not;
every violation must be 0. The kills are injected with strace: without it the test fails
(it does not skip), saying to install it.
"""

from __future__ import annotations

import os
import shutil

import pytest

from tests.chaos.compound import run
from tests.faults.common import STRACE_MISSING
from tests.faults.report import format_figures, violations
from tests.support import missing_system_tool

SEED = int(os.environ["AGENTD_CHAOS_SEED"]) if os.environ.get("AGENTD_CHAOS_SEED") else None


@pytest.mark.timeout(600)
def test_compound_failures(capsys: pytest.CaptureFixture[str]) -> None:
    if shutil.which("strace") is None:
        missing_system_tool(STRACE_MISSING)
    figures = run(quick=True, seed=SEED)
    with capsys.disabled():
        print("\n" + format_figures(figures), flush=True)
    bad = violations(figures)
    assert not bad, "; ".join(f"{f.name}: {f.value}" for f in bad)
