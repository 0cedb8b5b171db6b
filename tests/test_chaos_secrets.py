"""Secrets chaos in CI: the quick mode of ``tests/chaos/secrets.py`` (fault class 13: a
canary API key, given through the environment, a key file and a systemd credential, hunted
by a hostile ``run_command`` and by the harness in every process environment, spool file,
log, recorded tool result and model request).

About ten seconds (``python -m tests.chaos.secrets --full`` is the full campaign). The
figures are printed into the test output whether the test passes or not; every violation
must be 0. Run as root, it is the hard case: root reads every process's environment.
"""

from __future__ import annotations

import pytest

from tests.chaos.secrets import run
from tests.faults.report import format_figures, violations


@pytest.mark.timeout(180)
def test_secrets_campaign(capsys: pytest.CaptureFixture[str]) -> None:
    figures = run(quick=True)
    with capsys.disabled():
        print("\n" + format_figures(figures), flush=True)
    bad = violations(figures)
    assert not bad, "; ".join(f"{f.fault}/{f.name}: {f.value}" for f in bad)
