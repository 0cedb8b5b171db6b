"""``python -m tests.faults [--full] [--only NAME]``: run the campaign, print one table.

Exits 1 when any figure is a violation (or a module could not run), 0 otherwise.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
import traceback

from tests.faults.report import Figure, print_figures, violations

MODULES = ("crash_points", "io_errors", "torn", "fuzz", "security")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.faults", description=__doc__)
    parser.add_argument("--full", action="store_true", help="the full campaign (make chaos)")
    parser.add_argument(
        "--only", action="append", choices=MODULES, metavar="NAME", help=", ".join(MODULES)
    )
    args = parser.parse_args(argv)
    figures: list[Figure] = []
    start = time.monotonic()
    for name in args.only or MODULES:
        module = importlib.import_module(f"tests.faults.{name}")
        print(f"running {name} ({'full' if args.full else 'quick'}) ...", file=sys.stderr)
        try:
            figures += module.run(quick=not args.full)
        except Exception as exc:
            traceback.print_exc()
            figures.append(Figure(name, "could not run", f"{type(exc).__name__}: {exc}", True))
    figures.append(Figure("campaign", "runtime s", round(time.monotonic() - start, 1)))
    print_figures(figures)
    return 1 if violations(figures) else 0


if __name__ == "__main__":
    sys.exit(main())
