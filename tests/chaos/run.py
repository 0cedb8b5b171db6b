"""Class 24, ``agentd run``: the kill -9 campaign (``tests.chaos.kill9``) driven through
``agentd run --resume`` instead of bare workers.

Each trial's task is carried to its end by one ``agentd run --resume TASK`` after another
(no daemon), without a terminal: a hold ends a run with exit 3, and the campaign decides
the held calls like a careful operator (``kill9.decide_held``) before the next run. The
kills are of two kinds: a kill -9 of ``agentd run`` itself at a random instant (its worker
must die with it, and the next run finds the task resumable), and a tool that SIGKILLs its
own worker right before or after its side effect, which ``agentd run`` restarts by itself
under ``[restart]`` (each such call kills only once per run:
``effect_tools.SELF_KILL_ONCE_ENV``). The checks are kill9's: nothing recorded is lost, no
unsafe or keyed effect happens twice, every transcript is valid, every task ends done.

``python -m tests.chaos.run --trials N`` prints the figures and exits 1 on any violation;
``tests/test_chaos_run.py`` runs the quick mode in CI.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tests.chaos.kill9 import Options, Report, run_campaign
from tests.faults.report import Figure

QUICK_TRIALS = 20
FULL_TRIALS = 200


def campaign(trials: int, *, seed: int | None = None, root: Path | None = None) -> Report:
    return run_campaign(Options(trials=trials, seed=seed, root=root, via_run=True))


def run(quick: bool) -> list[Figure]:
    """The campaign as chaos figures: 20 trials quick, 200 full."""
    report = campaign(QUICK_TRIALS if quick else FULL_TRIALS)
    print(report.table(), file=sys.stderr, flush=True)
    return report.as_figures()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.chaos.run", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--trials", type=int, default=QUICK_TRIALS)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--root", type=Path, default=None, help="work folder (kept)")
    args = parser.parse_args(argv)
    report = campaign(args.trials, seed=args.seed, root=args.root)
    print(report.table())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
