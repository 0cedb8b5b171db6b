"""kill -9 chaos campaign as benchmark rows (the campaign is ``tests/chaos/kill9.py``).

Quick mode: 2 trials with 1-2 kills each (a smoke run). Full mode (``make bench``): 500
trials with 1-3 kills each. Every violation figure has the target 0 and completion 100%.
"""

from __future__ import annotations

from bench.report import Row

NAME = "chaos_kill9"


def run(quick: bool) -> list[Row]:
    from tests.chaos.kill9 import Options, run_campaign

    options = Options(trials=2, max_kills=2) if quick else Options(trials=500, max_kills=3)
    options.progress = not quick
    report = run_campaign(options)
    print(report.table(), flush=True)
    figures = report.figures()
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
            f"trials / worker kills (seed {options.seed})",
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
            met=figures["tasks_completed_pct"] == 100.0 and report.ok,
            compare=False,
        ),
        Row(NAME, "holds decided", "", float(figures["holds_decided"]), compare=False),
        Row(NAME, "campaign wall time", "s", figures["wall_seconds"], compare=False),
    ]
