"""Restart policy: a pure function from a task's crash history to the next move.

``decide(crashes, policy, rng)`` never looks at a clock or a process; the daemon records
each crash (the turn it happened on and whether the worker made progress since it was
started) and asks. The rules (docs/design.md section 7):

* a crash that followed progress restarts at once: the task was working, the fault may
  well be transient (an OOM kill, a node reboot);
* repeated crashes without progress back off exponentially from ``backoff_initial``,
  capped at ``backoff_max``, with +-20% jitter so a fleet does not restart in lockstep;
* the same turn crashing ``crash_loop_limit`` times gives up with ``crash_loop``.

A storage fault (the worker's exit 7: a full, failing or read-only disk) is no crash and
has a decision of its own, ``wait_for_storage(waits, policy, rng)``: it is never recorded
in the crash history, so it can neither make a crash loop nor spend the restart budget.
The task waits in ``backoff`` and is retried ``STORAGE_BACKOFF`` seconds after the first
fault of a run, doubling to ``backoff_max``, with the same jitter: a disk that fills is
polled closely at first and gently later, and it is never given up on (the daemon also
retries at once when its own writes succeed again).

A worker that cannot be started for want of resources (``fork`` refused with EAGAIN or
ENOMEM: a process flood, the memory full) is the same kind of wait, on the same
schedule: ``wait_for_resources``. Another task's tools may have used them up; the task
that could not start is none the worse for it, and must not end ``failed``.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from worker.config import RestartConfig

JITTER = 0.2
STORAGE_BACKOFF = 0.5  # seconds before the first retry after a storage fault


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
    return _backoff(policy.backoff_initial, stalled, policy, rng)


def wait_for_storage(
    waits: int, policy: RestartConfig, rng: random.Random | None = None
) -> Restart:
    """The delay before retrying a task whose worker met a storage fault ``waits`` times
    in a row (the first fault of a run is 1): never a GiveUp, whatever the count."""
    return _backoff(STORAGE_BACKOFF, max(1, waits), policy, rng)


def wait_for_resources(
    waits: int, policy: RestartConfig, rng: random.Random | None = None
) -> Restart:
    """The delay before retrying a start refused for want of resources ``waits`` times in
    a row: never a GiveUp."""
    return wait_for_storage(waits, policy, rng)


def _backoff(
    initial: float, attempt: int, policy: RestartConfig, rng: random.Random | None
) -> Restart:
    """``initial`` doubled for each ``attempt`` after the first, capped at ``backoff_max``,
    with +-``JITTER``."""
    base = min(policy.backoff_max, initial * 2 ** min(attempt - 1, 64))
    jitter = 1.0 + JITTER * (2 * (rng or random.Random()).random() - 1)  # noqa: S311  (jitter, not crypto)
    return Restart(min(policy.backoff_max, base * jitter))
