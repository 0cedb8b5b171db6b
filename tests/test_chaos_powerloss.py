"""Power loss in CI: the quick mode of ``tests/chaos/powerloss.py`` (fault class 15).

A real worker's journal writes and fdatasyncs are traced with strace; at every instant some
written bytes are not yet durable, the task is killed there, and every journal a power loss
may leave (the synced bytes kept, each later 4 KiB page kept, zeroed or dropped) is resumed
by a real worker. No synced record may be lost and no task may fail for losing only
unsynced bytes. The figures are printed whether the test passes or not; every violation
must be 0. Without strace the test fails (it does not skip), saying to install it.
"""

from __future__ import annotations

import shutil

import pytest

from tests.chaos.powerloss import run
from tests.faults.common import STRACE_MISSING
from tests.faults.report import format_figures, violations
from tests.support import missing_system_tool


@pytest.mark.timeout(600)
def test_power_loss_is_a_torn_tail(capsys: pytest.CaptureFixture[str]) -> None:
    if shutil.which("strace") is None:
        missing_system_tool(STRACE_MISSING)
    figures = run(quick=True)
    with capsys.disabled():
        print("\n" + format_figures(figures), flush=True)
    bad = violations(figures)
    assert not bad, "; ".join(f"{f.name}: {f.value}" for f in bad)
    resumed = next(f for f in figures if f.name == "variants resumed")
    assert isinstance(resumed.value, int) and resumed.value > 0
