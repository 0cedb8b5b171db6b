"""Restart policy: a pure function from a task's crash history to the next move.

``decide(crashes, policy, rng)`` never looks at a clock or a process; the daemon records
each crash (the turn it happened on and whether the worker made progress since it was
started) and asks. The rules (DESIGN.md section 7):

* a crash that followed progress restarts at once: the task was working, the fault may
  well be transient (an OOM kill, a node reboot);
* repeated crashes without progress back off exponentially from ``backoff_initial``,
  capped at ``backoff_max``, with +-20% jitter so a fleet does not restart in lockstep;
* the same turn crashing ``crash_loop_limit`` times gives up with ``crash_loop``.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from worker.config import RestartConfig

JITTER = 0.2


@dataclass(frozen=True)
class Crash:
    turn: int
    progressed: bool


@dataclass(frozen=True)
class Restart:
    delay: float


@dataclass(frozen=True)
class GiveUp:
    reason: str


def decide(
    crashes: Sequence[Crash], policy: RestartConfig, rng: random.Random | None = None
) -> Restart | GiveUp:
    if not crashes:
        return Restart(0.0)
    last = crashes[-1]
    same_turn = 0
    for crash in reversed(crashes):
        if crash.turn != last.turn:
            break
        same_turn += 1
    if same_turn >= policy.crash_loop_limit:
        return GiveUp("crash_loop")
    if last.progressed:
        return Restart(0.0)
    stalled = 0
    for crash in reversed(crashes):
        if crash.progressed:
            break
        stalled += 1
    base = min(policy.backoff_max, policy.backoff_initial * 2 ** (stalled - 1))
    jitter = 1.0 + JITTER * (2 * (rng or random.Random()).random() - 1)  # noqa: S311  (jitter, not crypto)
    return Restart(min(policy.backoff_max, base * jitter))
