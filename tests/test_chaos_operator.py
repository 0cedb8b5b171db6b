"""Operator chaos in CI: the quick mode of ``tests/chaos/operator.py`` (fault class 18:
refused commands while a tool runs, accepted rewinds at a safe point, ``cancel`` racing
``approve-dangling`` and ``rewind`` with the daemon up and down).

About 20 s. The figures are printed into the test output whether the test passes or not;
every violation must be 0. ``AGENTD_CHAOS_SEED`` replays a campaign's random choices.
"""

from __future__ import annotations

import os

import pytest

from tests.chaos.operator import run
from tests.faults.report import format_figures, violations

VOID = "trials void (the tool ended before the commands)"
SEED = int(os.environ["AGENTD_CHAOS_SEED"]) if os.environ.get("AGENTD_CHAOS_SEED") else None


@pytest.mark.timeout(240)
def test_operator_campaign(capsys: pytest.CaptureFixture[str]) -> None:
    figures = run(quick=True, seed=SEED)
    with capsys.disabled():
        print("\n" + format_figures(figures), flush=True)
    bad = violations(figures)
    assert not bad, "; ".join(f"{f.fault}/{f.name}: {f.value}" for f in bad)
    counted = {f.name: f.value for f in figures}
    # the campaign ran: the 11 refused commands of each of its 2 tasks, less a trial whose
    # tool ended before its commands (void, on a loaded machine: not judged either way)
    given, void = int(counted["refused commands given while a tool ran"]), int(counted[VOID])
    assert given == 11 * (2 - void) and void < 2, (given, void)
