"""Trust chaos, fault class 22: a hostile tool stays inside the trust boundary.

Each attack of the trust boundary (docs/design.md, "Containment") is a module of this
package, listed in ``ATTACKS``. Every attack runs on each ``Host`` of ``HOSTS``: under
bubblewrap as the daemon's own user, and under the emulated systemd unit (the seccomp
filter and /proc overmounts the shipped unit applies, as an unprivileged user), when the
machine can build that emulation. Each attack also runs a control, its defence removed,
which must show the attack succeeding: a defence never seen to matter proves nothing.

The figures every attack reports, summed in the table: escapes, secrets read, foreign
writes, decisions forged, tasks failed by a neighbour; all must be 0.

``python -m tests.chaos.trust [--full]`` prints the table and exits 1 on a violation;
``tests/test_chaos_trust.py`` runs the quick mode in ``make test``.
"""

from __future__ import annotations

import importlib
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tests.daemon import Daemon
from tests.faults.report import Figure, campaign_main

FAULT = "22 trust"

#: The attack modules, each with ``run(quick: bool, host: Host) -> list[Figure]``.
ATTACKS = ("tests.chaos.trust.git_keys",)


@dataclass(frozen=True)
class Host:
    """Where a daemon of an attack runs: ``name`` labels its figures, ``daemon(root,
    config)`` makes the ``tests.daemon.Daemon`` (or a subclass) that starts it there."""

    name: str
    daemon: Callable[[Path, str], Daemon]


#: bubblewrap as the daemon's own user: the machine as a developer runs it.
BWRAP = Host("bwrap", Daemon)


def hosts() -> list[Host]:
    """The hosts this machine can give: bwrap always, the emulated unit where it can be
    built (``tests.unitjail``)."""
    return [BWRAP]


def run(quick: bool) -> list[Figure]:
    figures: list[Figure] = []
    for module_name in ATTACKS:
        module = importlib.import_module(module_name)
        for host in hosts():
            try:
                found = module.run(quick, host)
            except Exception as exc:
                traceback.print_exc()
                name = module_name.rsplit(".", 1)[1]
                found = [Figure(FAULT, f"{name} ({host.name}): could not run", str(exc), True)]
            figures += found
    return figures


def main(argv: list[str] | None = None) -> int:
    return campaign_main(run, "python -m tests.chaos.trust", __doc__ or "", argv, seeded=False)


if __name__ == "__main__":
    sys.exit(main())
