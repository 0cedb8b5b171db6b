"""Signals chaos in CI: the quick mode of ``tests/chaos/signals.py`` (fault class 17: HUP,
USR1, USR2 and PIPE at random moments to a daemon running tasks, with good and bad config
edits between HUPs).

About 10 s. The figures are printed into the test output whether the test passes or not;
every violation must be 0. ``AGENTD_CHAOS_SEED`` replays a campaign's random choices.
"""

from __future__ import annotations

import os

import pytest

from tests.chaos.signals import run
from tests.faults.report import format_figures, violations

SEED = int(os.environ["AGENTD_CHAOS_SEED"]) if os.environ.get("AGENTD_CHAOS_SEED") else None


@pytest.mark.timeout(180)
def test_signals_campaign(capsys: pytest.CaptureFixture[str]) -> None:
    figures = run(quick=True, seed=SEED)
    with capsys.disabled():
        print("\n" + format_figures(figures), flush=True)
    bad = violations(figures)
    assert not bad, "; ".join(f"{f.fault}/{f.name}: {f.value}" for f in bad)
