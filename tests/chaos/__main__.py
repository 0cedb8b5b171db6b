"""``python -m tests.chaos [--full] [--only NAME ...]``: every fault class, one table.

The whole campaign of docs/design.md's invariants, class by class (the numbers are the fault
classes of docs/results/reliability.md): each module's ``run(quick)`` gives its
figures, and they are printed together, violations marked. ``make chaos`` runs the full
mode (about an hour on 2 cores); ``make test`` runs the quick mode of each module through
``tests/test_campaigns.py`` (classes 1 and 24 through tests of their own). Exits 1 when
any figure is a violation or a module could not run.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
import traceback

from tests.chaos import CAMPAIGN
from tests.faults.report import Figure, print_figures, violations

NAMES = tuple(module.rsplit(".", 1)[1] for _, module in CAMPAIGN)


def labelled(classes: str, figure: Figure) -> Figure:
    """``figure`` with its fault class in front (unless the module named it already)."""
    if figure.fault[:1].isdigit():
        return figure
    return Figure(f"{classes} {figure.fault}", figure.name, figure.value, figure.violation)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.chaos", description=__doc__)
    parser.add_argument("--full", action="store_true", help="the full campaign (make chaos)")
    parser.add_argument("--only", nargs="+", choices=NAMES, metavar="NAME", help=", ".join(NAMES))
    args = parser.parse_args(argv)
    figures: list[Figure] = []
    started = time.monotonic()
    for classes, module_name in CAMPAIGN:
        name = module_name.rsplit(".", 1)[1]
        if args.only and name not in args.only:
            continue
        mode = "full" if args.full else "quick"
        print(f"chaos: class {classes}: {name} ({mode}) ...", flush=True)
        t0 = time.monotonic()
        try:
            found = importlib.import_module(module_name).run(quick=not args.full)
        except Exception as exc:
            traceback.print_exc()
            found = [Figure(name, "could not run", f"{type(exc).__name__}: {exc}", True)]
        figures += [labelled(classes, f) for f in found]
        print(f"chaos: {name} took {time.monotonic() - t0:.0f} s", flush=True)
    figures.append(Figure("campaign", "runtime s", round(time.monotonic() - started, 1)))
    print(flush=True)
    print_figures(figures)
    return 1 if violations(figures) else 0


if __name__ == "__main__":
    sys.exit(main())
