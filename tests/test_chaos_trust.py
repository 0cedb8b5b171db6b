"""The trust boundary in CI: the quick mode of ``tests/chaos/trust`` (fault class 22: each
attack of issue 20 on every host the machine can give, bwrap and the emulated unit, each
with its control).

The figures are printed into the test output whether the test passes or not; every
violation must be 0.
"""

from __future__ import annotations

import pytest

from tests.chaos.trust import run
from tests.faults.report import format_figures, violations


@pytest.mark.timeout(600)
def test_trust_campaign(capsys: pytest.CaptureFixture[str]) -> None:
    figures = run(quick=True)
    with capsys.disabled():
        print("\n" + format_figures(figures), flush=True)
    bad = violations(figures)
    assert not bad, "; ".join(f"{f.fault}/{f.name}: {f.value}" for f in bad)
