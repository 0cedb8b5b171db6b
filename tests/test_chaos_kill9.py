"""kill -9 chaos in CI: the quick mode of ``tests/chaos/kill9.py``.

40 trials in ``make test`` (the chaos table's quick mode runs 100, ``make chaos`` 500;
``AGENTD_CHAOS_TRIALS`` overrides; ``AGENTD_CHAOS_SEED`` replays a campaign's
random choices) of a real worker process on the real SDK against the local Messages API
server, each killed with SIGKILL once or twice, at random instants or by its own tools right
before or after a side effect. The figures are printed into the test output whether the test
passes or not; every violation count must be 0 and every task must complete.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.chaos.kill9 import Options, run_campaign

TRIALS = int(os.environ.get("AGENTD_CHAOS_TRIALS", "40"))
SEED = int(os.environ["AGENTD_CHAOS_SEED"]) if os.environ.get("AGENTD_CHAOS_SEED") else None


@pytest.mark.timeout(max(600, 12 * TRIALS))
def test_kill9_campaign(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = run_campaign(Options(trials=TRIALS, seed=SEED, root=tmp_path / "kill9"))
    with capsys.disabled():
        print("\n" + report.table(), flush=True)
    assert len(report.trials) == TRIALS
    assert report.total("kills") >= TRIALS, "the campaign killed fewer workers than it ran trials"
    for figure in report.VIOLATIONS:
        assert report.total(figure) == 0, f"{figure}: {report.total(figure)}"
    assert report.completion == 100.0
    assert report.failures == []
    assert report.ok
