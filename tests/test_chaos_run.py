"""Class 24 in CI: the quick ``agentd run`` campaign (``tests/chaos/run.py``), 10 trials
(``AGENTD_CHAOS_TRIALS`` overrides; ``AGENTD_CHAOS_SEED`` replays one): a task carried to
its end by ``agentd run --resume`` after kill -9s of the run and self-kills of its workers.
The figures are printed whether the test passes or not; every violation count must be 0
and every task must complete."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.chaos.run import campaign

TRIALS = int(os.environ.get("AGENTD_CHAOS_TRIALS", "10"))
SEED = int(os.environ["AGENTD_CHAOS_SEED"]) if os.environ.get("AGENTD_CHAOS_SEED") else None


@pytest.mark.timeout(max(600, 15 * TRIALS))
def test_run_campaign(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = campaign(TRIALS, seed=SEED, root=tmp_path / "run")
    with capsys.disabled():
        print("\n" + report.table(), flush=True)
    assert len(report.trials) == TRIALS
    assert report.total("kills") >= TRIALS
    for figure in report.VIOLATIONS:
        assert report.total(figure) == 0, f"{figure}: {report.total(figure)}"
    assert report.completion == 100.0
    assert report.failures == []
    assert report.ok
