"""Every fault class in CI: the quick mode of each campaign of ``tests.chaos.CAMPAIGN``, one
test per class (``test_campaign[<class>-<name>]``), the way ``python -m tests.chaos`` runs
them (``--full`` is ``make chaos``).

Each campaign's figures are printed into the test output whether it passes or not; every
violation must be 0. Some classes add checks that the campaign did run (``RAN``). A class
whose faults need a system tool (strace, libfaketime, the PostgreSQL server binaries) fails
without it, saying what to install (it does not skip; ``.ci/system-tools`` lists them).
``AGENTD_CHAOS_SEED`` replays a campaign's random choices.

Classes 1 (kill9) and 24 (run) have tests of their own: they run a trial count of their own
(``AGENTD_CHAOS_TRIALS``) and judge the campaign's report, not its table.
"""

from __future__ import annotations

import importlib
import inspect
import os
import shutil
from collections.abc import Callable

import pytest

from tests.chaos import CAMPAIGN
from tests.chaos.clock import faketime_library
from tests.faults.common import STRACE_MISSING
from tests.faults.report import Figure, format_figures, violations
from tests.postgres import server_binaries
from tests.support import missing_system_tool

pytestmark = pytest.mark.process

SEED = int(os.environ["AGENTD_CHAOS_SEED"]) if os.environ.get("AGENTD_CHAOS_SEED") else None
#: Classes with a test of their own.
OWN_TEST = {"kill9", "run"}
#: How long each class's quick mode may take, in seconds (on two busy cores).
TIMEOUT = {
    "crash_points": 900,
    "io_errors": 900,
    "torn": 900,
    "compound": 600,
    "supervision": 300,
    "api_faults": 600,
    "fuzz": 900,
    "security": 900,
    "escape": 180,
    "secrets": 180,
    "tampering": 240,
    "powerloss": 600,
    "storage": 300,
    "signals": 180,
    "operator": 240,
    "clock": 240,
    "compaction": 300,
    "nodes": 480,
    "trust": 600,
    "mcp": 900,
    "approvals": 240,
    "conversations": 300,
}


def _strace() -> None:
    if shutil.which("strace") is None:
        missing_system_tool(STRACE_MISSING)


def _faketime() -> None:
    if faketime_library() is None:
        missing_system_tool("libfaketime is not installed (sudo apt-get install -y libfaketime)")


def _postgres_binaries() -> None:
    server_binaries()  # (a server of its own, which it restarts)


#: What a class's faults need on the machine, checked before it runs.
NEEDS: dict[str, Callable[[], None]] = {
    "crash_points": _strace,
    "io_errors": _strace,
    "compound": _strace,
    "powerloss": _strace,
    "clock": _faketime,
    "nodes": _postgres_binaries,
}


def _compaction_ran(figures: list[Figure]) -> None:
    by_name = {
        (f.fault.split(":")[0], f.name): int(f.value)
        for f in figures
        if isinstance(f.value, int | float)
    }
    assert by_name[("20 compaction", "kills")] >= 6, "the campaign killed too few workers"
    assert by_name[("20 compaction", "compactions recorded")] >= 4
    assert by_name[("proof", "compactions made")] >= 8


def _mcp_ran(figures: list[Figure]) -> None:
    shown = {f.name: f.value for f in figures if isinstance(f.value, int)}
    assert shown["tasks"] == 4
    assert shown["kill -9 of a worker in a call"] >= 4
    assert shown["kills of a server in a call"] >= 2
    assert shown["waits for a server at the first start"] >= 1
    assert shown["control: daemons seen while their worker ran"] > 0
    assert shown["control: the attack's reads of its own workspace"] == 2


def _operator_ran(figures: list[Figure]) -> None:
    counted = {f.name: f.value for f in figures}
    # the 11 refused commands of each of its 2 tasks, less a trial whose tool ended before
    # its commands (void, on a loaded machine: not judged either way)
    void_name = "trials void (the tool ended before the commands)"
    given = int(counted["refused commands given while a tool ran"])
    void = int(counted[void_name])
    assert given == 11 * (2 - void) and void < 2, (given, void)


def _powerloss_ran(figures: list[Figure]) -> None:
    resumed = next(f for f in figures if f.name == "variants resumed")
    assert isinstance(resumed.value, int) and resumed.value > 0


def _approvals_ran(figures: list[Figure]) -> None:
    shown = {f.name: f.value for f in figures}
    for name in (
        "kills -9 of a worker",
        "kills -9 of the daemon",
        "decisions accepted through the API",
        "stale decisions sent (alone or two at once)",
        "decisions expired unused (the call held again)",
        "asked calls skipped on ask_timeout",
    ):
        value = shown[name]
        assert isinstance(value, int) and value > 0, (name, value)
    assert shown["tasks completed"] == shown["tasks"], shown
    assert shown["asked calls (decided / skipped / approved and cut off)"] == "1 / 1 / 1"


def _trust_ran(figures: list[Figure]) -> None:
    assert figures, "the trust class ran no attack"


#: Checks that a class's campaign did run (beyond its violations being 0).
RAN: dict[str, Callable[[list[Figure]], None]] = {
    "approvals": _approvals_ran,
    "compaction": _compaction_ran,
    "mcp": _mcp_ran,
    "operator": _operator_ran,
    "powerloss": _powerloss_ran,
    "trust": _trust_ran,
}


def _classes() -> list[object]:
    params: list[object] = []
    for classes, module in CAMPAIGN:
        name = module.rsplit(".", 1)[1]
        if name in OWN_TEST:
            continue
        timeout = pytest.mark.timeout(TIMEOUT[name])
        params.append(pytest.param(module, id=f"{classes.replace(' ', '-')}-{name}", marks=timeout))
    return params


@pytest.mark.parametrize("module_name", _classes())
def test_campaign(module_name: str, capsys: pytest.CaptureFixture[str]) -> None:
    name = module_name.rsplit(".", 1)[1]
    if name in NEEDS:
        NEEDS[name]()
    run = importlib.import_module(module_name).run
    seeded = "seed" in inspect.signature(run).parameters
    figures: list[Figure] = run(quick=True, seed=SEED) if seeded else run(quick=True)
    with capsys.disabled():
        print("\n" + format_figures(figures), flush=True)
    not_run = [f for f in figures if f.name.startswith("NOT RUN")]
    if name == "storage" and not_run:  # mounting a tmpfs needs root: mount's reason
        pytest.skip(f"{not_run[0].name}: {not_run[0].value}")
    bad = violations(figures)
    assert not bad, "; ".join(f"{f.fault}/{f.name}: {f.value}" for f in bad)
    if name in RAN:
        RAN[name](figures)
