"""Spool tampering in CI: the quick mode of ``tests/chaos/tampering.py`` (fault class 14:
run_command calls under the sandbox that write to their task's journal, records and
decisions, read the daemon's and the config's files, and signal the daemon and another
task's worker).

About 40 s on two busy cores. The figures are printed into the test output whether the
test passes or not; every violation must be 0. Without a working bwrap the class reports
"could not run" as a violation, so this test fails rather than pretend (CI installs
bubblewrap).
"""

from __future__ import annotations

import pytest

from tests.chaos.tampering import run
from tests.faults.report import format_figures, violations


@pytest.mark.timeout(240)
def test_tampering_campaign(capsys: pytest.CaptureFixture[str]) -> None:
    figures = run(quick=True)
    with capsys.disabled():
        print("\n" + format_figures(figures), flush=True)
    bad = violations(figures)
    assert not bad, "; ".join(f"{f.fault}/{f.name}: {f.value}" for f in bad)
