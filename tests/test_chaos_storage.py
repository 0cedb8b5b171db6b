"""Storage chaos in CI: the quick mode of ``tests/chaos/storage.py`` (fault class 16: a real
daemon and 20 tasks on a tmpfs spool that fills up, then goes read-only).

About 20 s. Mounting needs root: where the tmpfs mount is refused the test is skipped with
mount's reason (the campaign's table says so in its row). The figures are printed into the
test output whether the test passes or not; every violation must be 0.
"""

from __future__ import annotations

import pytest

from tests.chaos.storage import run
from tests.faults.report import format_figures, violations


@pytest.mark.timeout(300)
def test_storage_campaign(capsys: pytest.CaptureFixture[str]) -> None:
    figures = run(quick=True)
    with capsys.disabled():
        print("\n" + format_figures(figures), flush=True)
    not_run = [f for f in figures if f.name.startswith("NOT RUN")]
    if not_run:
        pytest.skip(f"{not_run[0].name}: {not_run[0].value}")
    bad = violations(figures)
    assert not bad, "; ".join(f"{f.fault}/{f.name}: {f.value}" for f in bad)
