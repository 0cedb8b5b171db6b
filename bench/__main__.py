"""``python -m bench [--quick|--full] [--only NAME ...]``: run agentd's benchmarks.

Every module of this package with a ``run(quick: bool) -> list[Row]`` function is a
benchmark (``bench/report.py`` has ``Row``). Quick mode is the CI smoke run
(``tests/test_bench.py``): small sizes, no peer is installed, no timing asserted; it aims
at well under 60 s on an idle 2-core machine. Full mode uses the sizes the targets are stated
at and installs missing peers from ``bench/requirements.txt``. All rows are printed as one
table at the end; the exit code is 1 when a benchmark failed to run, 0 otherwise (a
missed target is a finding, not a failure).
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
import time
import traceback
from collections.abc import Callable
from types import ModuleType

import bench
from bench.report import Row, print_table

Runner = Callable[[bool], list[Row]]


def discover() -> dict[str, Runner]:
    """Benchmark name -> its ``run``, for every module of ``bench`` that has one."""
    found: dict[str, Runner] = {}
    for info in sorted(pkgutil.iter_modules(bench.__path__), key=lambda i: i.name):
        if info.name.startswith("_") or info.name == "report":
            continue
        module: ModuleType = importlib.import_module(f"bench.{info.name}")
        run = getattr(module, "run", None)
        if callable(run):
            found[info.name] = run
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="CI smoke sizes (the default)")
    mode.add_argument("--full", action="store_true", help="the sizes the targets are stated at")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run only these benchmarks")
    args = parser.parse_args(argv)
    quick = not args.full

    benches = discover()
    if args.only:
        unknown = sorted(set(args.only) - set(benches))
        if unknown:
            parser.error(f"unknown benchmark(s) {', '.join(unknown)}; have {', '.join(benches)}")
        benches = {name: benches[name] for name in args.only}

    started = time.monotonic()
    rows: list[Row] = []
    failed: list[str] = []
    for name, run in benches.items():
        t0 = time.monotonic()
        try:
            rows.extend(run(quick))
        except Exception:
            traceback.print_exc()
            failed.append(name)
        print(f"bench: {name} took {time.monotonic() - t0:.1f} s", flush=True)
    print(flush=True)
    if rows:
        print_table(rows)
    mode_name = "quick" if quick else "full"
    print(f"\nbench: {mode_name} mode, {time.monotonic() - started:.1f} s", flush=True)
    if failed:
        print(f"bench: failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
