"""Compaction chaos in CI: the quick mode of ``tests/chaos/compaction.py`` (fault class 20:
``kill -9`` of real workers on the real SDK in the summary call, right after the summary
arrived, after its record and at random instants of long tasks that compact every few
turns, then the proof: 300 steps through a window of about 30).

About 30 s. The figures are printed into the test output whether the test passes or not;
every violation must be 0. ``AGENTD_CHAOS_SEED`` replays a campaign's random choices.
"""

from __future__ import annotations

import os

import pytest

from tests.chaos.compaction import run
from tests.faults.report import format_figures, violations

SEED = int(os.environ["AGENTD_CHAOS_SEED"]) if os.environ.get("AGENTD_CHAOS_SEED") else None


@pytest.mark.timeout(300)
def test_compaction_campaign(capsys: pytest.CaptureFixture[str]) -> None:
    figures = run(quick=True, seed=SEED)
    with capsys.disabled():
        print("\n" + format_figures(figures), flush=True)
    bad = violations(figures)
    assert not bad, "; ".join(f"{f.fault}/{f.name}: {f.value}" for f in bad)
    by_name = {
        (f.fault.split(":")[0], f.name): int(f.value)
        for f in figures
        if isinstance(f.value, int | float)
    }
    assert by_name[("20 compaction", "kills")] >= 6, "the campaign killed too few workers"
    assert by_name[("20 compaction", "compactions recorded")] >= 4
    assert by_name[("proof", "compactions made")] >= 8
