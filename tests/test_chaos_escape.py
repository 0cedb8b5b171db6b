"""Escape chaos in CI: the quick mode of ``tests/chaos/escape.py`` (fault class 12).

A background loop left by ``run_command`` in each way a tool can leave its worker's reach
(``setsid``, double fork, ``nohup``, SIGTERM ignored), across each way its worker ends
(task end, kill -9, ``agentd cancel``, ``agentd stop``), on a real daemon: about 10 s.
The figures are printed into the test output whether the test passes or not; every
violation must be 0 (no loop process alive one second after its end).
"""

from __future__ import annotations

import os

import pytest

from tests.chaos.escape import run
from tests.faults.report import format_figures, violations

SEED = int(os.environ["AGENTD_CHAOS_SEED"]) if os.environ.get("AGENTD_CHAOS_SEED") else None


@pytest.mark.timeout(180)
def test_escape_campaign(capsys: pytest.CaptureFixture[str]) -> None:
    figures = run(quick=True, seed=SEED)
    with capsys.disabled():
        print("\n" + format_figures(figures), flush=True)
    bad = violations(figures)
    assert not bad, "; ".join(f"{f.fault}/{f.name}: {f.value}" for f in bad)
