"""Messages API faults in CI: the quick mode of ``tests/chaos/api_faults.py`` (fault class 8).

Real workers under the real daemon, on the real SDK against the local Messages API server,
which serves 429, 500, 529, dropped connections, cut streams, streams without
``message_stop``, malformed tool JSON and error events at random turns, sometimes two or
three in a row, sometimes followed by a SIGKILL of the worker; one worker is frozen as a
complete reply is served, for the daemon's hang verdict to kill. No turn may be recorded
twice, no usage counted twice or from a failed response, no complete reply left uncounted
unless the worker it was served to was killed (by us or by the daemon) before asking
again, no transcript rejected, and every task must complete with each side effect once.
The figures are printed whether the test passes or not; every violation must be 0.
"""

from __future__ import annotations

import os

import pytest

from tests.chaos.api_faults import run
from tests.faults.report import format_figures, violations

SEED = int(os.environ["AGENTD_CHAOS_SEED"]) if os.environ.get("AGENTD_CHAOS_SEED") else None


@pytest.mark.timeout(600)
def test_api_fault_campaign(capsys: pytest.CaptureFixture[str]) -> None:
    figures = run(quick=True, seed=SEED)
    with capsys.disabled():
        print("\n" + format_figures(figures), flush=True)
    bad = violations(figures)
    assert not bad, "; ".join(f"{f.name}: {f.value}" for f in bad)
