"""Clock chaos in CI: the quick mode of ``tests/chaos/clock.py`` (fault class 19: the wall
clock stepped an hour either way under a daemon and its workers, with real hangs among the
steps).

About 30 s. Needs libfaketime (Debian's ``libfaketime``; ``.ci/system-tools`` installs it). The
figures are printed into the test output whether the test passes or not; every violation
must be 0. ``AGENTD_CHAOS_SEED`` replays a campaign's random choices.
"""

from __future__ import annotations

import os

import pytest

from tests.chaos.clock import faketime_library, run
from tests.faults.report import format_figures, violations
from tests.support import missing_system_tool

SEED = int(os.environ["AGENTD_CHAOS_SEED"]) if os.environ.get("AGENTD_CHAOS_SEED") else None


@pytest.mark.timeout(240)
def test_clock_campaign(capsys: pytest.CaptureFixture[str]) -> None:
    if faketime_library() is None:
        missing_system_tool("libfaketime is not installed (sudo apt-get install -y libfaketime)")
    figures = run(quick=True, seed=SEED)
    with capsys.disabled():
        print("\n" + format_figures(figures), flush=True)
    bad = violations(figures)
    assert not bad, "; ".join(f"{f.fault}/{f.name}: {f.value}" for f in bad)
