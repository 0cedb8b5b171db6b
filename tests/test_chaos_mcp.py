"""Class 23 in CI: the quick MCP campaign (``tests/chaos/mcp.py``): each trial once, the
worker and the servers killed inside calls of every effect class, a hung server, one that
fails to start, daemonizing servers and the filesystem attack. The figures are printed
whether the test passes or not; every violation count must be 0."""

from __future__ import annotations

import pytest

from tests.chaos.mcp import run


@pytest.mark.timeout(900)
def test_mcp_campaign(capsys: pytest.CaptureFixture[str]) -> None:
    from tests.faults.report import format_figures

    figures = run(quick=True)
    with capsys.disabled():
        print("\n" + format_figures(figures), flush=True)
    shown = {f.name: f.value for f in figures if isinstance(f.value, int)}
    assert shown["tasks"] == 4
    assert shown["kill -9 of a worker in a call"] >= 4
    assert shown["kills of a server in a call"] >= 2
    assert shown["waits for a server at the first start"] >= 1
    assert shown["control: daemons seen while their worker ran"] > 0
    assert shown["control: the attack's reads of its own workspace"] == 2
    assert [f for f in figures if f.violation] == []
