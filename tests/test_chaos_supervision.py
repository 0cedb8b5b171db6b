"""Supervision chaos in CI: the quick mode of ``tests/chaos/supervision.py`` (fault classes
6, 7 and 9: kill -9 of the daemon under load, hangs and stalls against their limits, load
with kill -9 of workers and the daemon's memory).

About a minute on two busy cores (``python -m tests.chaos.supervision --full`` is the full
campaign). The figures are printed into the test output whether the test passes or not;
every violation must be 0. ``AGENTD_CHAOS_SEED`` replays a campaign's random choices.
"""

from __future__ import annotations

import os

import pytest

from tests.chaos.supervision import run
from tests.faults.report import format_figures, violations

SEED = int(os.environ["AGENTD_CHAOS_SEED"]) if os.environ.get("AGENTD_CHAOS_SEED") else None


@pytest.mark.timeout(300)
def test_supervision_campaign(capsys: pytest.CaptureFixture[str]) -> None:
    figures = run(quick=True, seed=SEED)
    with capsys.disabled():
        print("\n" + format_figures(figures), flush=True)
    bad = violations(figures)
    assert not bad, "; ".join(f"{f.fault}/{f.name}: {f.value}" for f in bad)
