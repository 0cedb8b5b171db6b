"""kill -9 chaos campaign as benchmark rows (the campaign is ``tests/chaos/kill9.py``).

Quick mode: 2 trials with 1-2 kills each (a smoke run). Full mode (``make bench``): 500
trials with 1-3 kills each. Every violation figure has the target 0 and completion 100%.

The campaign runs through its own command line (``python -m tests.chaos.kill9 --json``),
as a process of its own: the benchmarks import agentd's packages, never the test suite.
Its table goes to this output as it is printed; the figures are its last line.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

from bench.report import Row

NAME = "chaos_kill9"
REPO = Path(__file__).resolve().parent.parent


def campaign(
    trials: int, max_kills: int, seed: int, progress: bool
) -> tuple[dict[str, float], bool]:
    """Run the campaign; its figures, and whether it passed every check (exit 0)."""
    argv = [sys.executable, "-m", "tests.chaos.kill9", "--trials", str(trials)]
    argv += ["--max-kills", str(max_kills), "--seed", str(seed), "--json"]
    done = subprocess.run(
        argv + (["--progress"] if progress else []),
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        check=False,
    )
    if done.returncode not in (0, 1) or not done.stdout.strip():
        raise RuntimeError(f"the kill -9 campaign exited {done.returncode}")
    table, _, last = done.stdout.rstrip().rpartition("\n")
    print(table, flush=True)
    return json.loads(last), done.returncode == 0


def run(quick: bool) -> list[Row]:
    seed = random.SystemRandom().randrange(2**32)
    figures, ok = campaign(2 if quick else 500, 2 if quick else 3, seed, progress=not quick)
    kills = (
        figures["kills_random_instant"]
        + figures["kills_after_effect"]
        + figures["kills_before_effect"]
    )

    def zero(figure: str, key: str) -> Row:
        value = float(figures[key])
        return Row(NAME, figure, "", value, target="0", met=value == 0, compare=False)

    return [
        Row(
            NAME,
            f"trials / worker kills (seed {seed})",
            "",
            float(figures["trials"]),
            compare=False,
            note=(
                f"{kills} kills: {figures['kills_random_instant']} at random instants, "
                f"{figures['kills_after_effect']} right after a side effect, "
                f"{figures['kills_before_effect']} right before one"
            ),
        ),
        zero("recorded turns lost", "recorded_turns_lost"),
        zero("recorded tool results lost", "recorded_results_lost"),
        zero("unsafe effects repeated", "unsafe_effects_repeated"),
        zero("keyed effects repeated", "keyed_effects_repeated"),
        zero("transcripts rejected by the API server", "transcripts_rejected"),
        Row(
            NAME,
            "tasks completed (after decisions)",
            "%",
            figures["tasks_completed_pct"],
            target="100%",
            met=figures["tasks_completed_pct"] == 100.0 and ok,
            compare=False,
        ),
        Row(NAME, "holds decided", "", float(figures["holds_decided"]), compare=False),
        Row(NAME, "campaign wall time", "s", figures["wall_seconds"], compare=False),
    ]
