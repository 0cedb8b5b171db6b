"""Trust chaos, fault class 22: a hostile tool stays inside the trust boundary.

Each attack of the trust boundary (docs/design.md, "Containment") is a module of this
package, listed in ``ATTACKS``. Every attack runs on each ``Host``: under bubblewrap as
the daemon's own user, and under the emulated systemd unit (the seccomp filters and
/proc overmounts the shipped unit applies, as its unprivileged user), when the machine
can build that emulation (the figure ``hosts every attack ran on`` says so). Each attack
also runs a control, its defence removed, which must show the attack succeeding: a
defence never seen to matter proves nothing.

The figures every attack reports, summed in the table: escapes, secrets read, foreign
writes, decisions forged, tasks failed by a neighbour; all must be 0.

``python -m tests.chaos.trust [--full]`` prints the table and exits 1 on a violation;
``tests/test_campaigns.py`` runs the quick mode in ``make test``.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import shutil
import sys
import tempfile
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from tests import unitdaemon
from tests.daemon import Daemon
from tests.faults.report import Figure, campaign_main

FAULT = "22 trust"

#: The attack modules, each with ``run(quick: bool, host: Host) -> list[Figure]``.
ATTACKS: tuple[str, ...] = (
    "tests.chaos.trust.unit_sandbox",
    "tests.chaos.trust.store_secrets",
    "tests.chaos.trust.workspaces",
    "tests.chaos.trust.later_task",
    "tests.chaos.trust.fork_flood",
    "tests.chaos.trust.output_flood",
    "tests.chaos.trust.swap_race",
    "tests.chaos.trust.git_keys",
)


@dataclass(frozen=True)
class Host:
    """Where a daemon of an attack runs: ``name`` labels its figures, ``daemon(root,
    config)`` makes the ``tests.daemon.Daemon`` (or a subclass) that starts it there."""

    name: str
    daemon: Callable[[Path, str], Daemon]


#: bubblewrap as the daemon's own user: the machine as a developer runs it.
BWRAP = Host("bwrap", Daemon)
#: The shipped unit, emulated (``tests.unitjail``): its seccomp filters, its /proc and its
#: unprivileged user. ``tests.unitdaemon.UnitDaemon``: what a test gives that daemon
#: lives under its ``root``, and what the test writes for it goes inside ``as_user()``
#: (a tree made by a child process, ``give()``); any other program to run where that
#: daemon runs goes through ``here()``.
UNIT = Host("unit", unitdaemon.UnitDaemon)


@contextlib.contextmanager
def outside_tmp(name: str) -> Iterator[Path]:
    """A fresh folder for an attack outside the host's /tmp (which the sandbox replaces
    with its own, so nothing there would need hiding), removed afterwards."""
    root = Path(tempfile.mkdtemp(prefix=f"agentd-trust-{name}-", dir="/var/tmp"))
    try:
        root.chmod(0o755)  # (an unprivileged daemon of an emulated unit walks through it)
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def hosts() -> tuple[list[Host], Figure]:
    """The hosts this machine can give: bwrap always, the emulated unit where it can be
    built (``tests.unitjail``: root, libseccomp, systemd-analyze, bwrap); and the figure
    that says which ran (a violation in CI, which can build the unit, when it did not)."""
    if (why := unitdaemon.why_not()) is not None:
        print(f"trust: no emulated unit host here: {why}", file=sys.stderr, flush=True)
        said = f"bwrap only (no emulated unit: {why})"
        return [BWRAP], Figure(FAULT, "hosts every attack ran on", said, bool(os.environ.get("CI")))
    return [BWRAP, UNIT], Figure(FAULT, "hosts every attack ran on", "bwrap, unit")


def run(quick: bool) -> list[Figure]:
    """Every attack of ``ATTACKS`` on every host."""
    figures: list[Figure] = []
    where, said = hosts()
    for module_name in ATTACKS:
        module = importlib.import_module(module_name)
        name = module_name.rsplit(".", 1)[1]
        for host in where:
            try:
                found = module.run(quick, host)
            except Exception as exc:
                traceback.print_exc()
                found = [Figure(FAULT, f"{name} ({host.name}): could not run", str(exc), True)]
            figures += found
    return [*figures, said]


def main(argv: list[str] | None = None) -> int:
    return campaign_main(run, "python -m tests.chaos.trust", __doc__ or "", argv, seeded=False)


if __name__ == "__main__":
    sys.exit(main())
