"""The restart policy: ``decide(crashes, policy, rng)``, a pure function (docs/design.md section 7).

Jitter is drawn from the injected ``random.Random``, so every delay here is exact: the
expected value is computed from a twin generator with the same seed.
"""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from supervisor.policy import (
    JITTER,
    STORAGE_BACKOFF,
    Crash,
    GiveUp,
    Restart,
    decide,
    wait_for_storage,
)
from worker.config import RestartConfig

POLICY = RestartConfig(backoff_initial=1.0, backoff_max=60.0, crash_loop_limit=5, stop_grace=10)


def stalled(n: int, turn: int = 3) -> list[Crash]:
    """n crashes in a row without progress (on one turn unless the caller varies it)."""
    return [Crash(turn, progressed=False) for _ in range(n)]


def jitter_of(seed: int) -> float:
    return 1.0 + JITTER * (2 * random.Random(seed).random() - 1)


def test_no_crash_yet_starts_at_once() -> None:
    assert decide([], POLICY, random.Random(1)) == Restart(0.0)


@pytest.mark.parametrize("before", [[], stalled(3, turn=1), [Crash(1, True)]])
def test_a_crash_after_progress_restarts_immediately(before: list[Crash]) -> None:
    assert decide([*before, Crash(7, progressed=True)], POLICY, random.Random(0)) == Restart(0.0)


def test_a_crash_without_progress_waits_backoff_initial_with_jitter() -> None:
    move = decide(stalled(1), POLICY, random.Random(42))
    assert move == Restart(POLICY.backoff_initial * jitter_of(42))


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_repeated_crashes_back_off_exponentially(n: int) -> None:
    # distinct turns, so the crash-loop rule stays out of the way
    crashes = [Crash(turn, progressed=False) for turn in range(n)]
    move = decide(crashes, POLICY, random.Random(n))
    assert move == Restart(POLICY.backoff_initial * 2 ** (n - 1) * jitter_of(n))


def test_the_backoff_doubles_from_one_crash_to_the_next() -> None:
    rng_seed = 7
    delays = []
    for n in range(1, 6):
        crashes = [Crash(turn, progressed=False) for turn in range(n)]
        move = decide(crashes, POLICY, random.Random(rng_seed))
        assert isinstance(move, Restart)
        delays.append(move.delay)
    ratios = [b / a for a, b in itertools.pairwise(delays)]
    assert ratios == pytest.approx([2.0] * 4)  # same seed, same jitter: exactly doubling


def test_the_backoff_is_capped_at_backoff_max() -> None:
    policy = RestartConfig(backoff_initial=1.0, backoff_max=10.0, crash_loop_limit=100)
    for n in (5, 8, 20, 60):
        crashes = [Crash(turn, progressed=False) for turn in range(n)]
        for seed in range(50):
            move = decide(crashes, policy, random.Random(seed))
            assert isinstance(move, Restart)
            assert policy.backoff_max * (1 - JITTER) <= move.delay <= policy.backoff_max


def test_jitter_stays_within_bounds_and_uses_them() -> None:
    delays = []
    for seed in range(2000):
        move = decide(stalled(3), POLICY, random.Random(seed))
        assert isinstance(move, Restart)
        delays.append(move.delay)
    base = POLICY.backoff_initial * 4
    assert all(base * (1 - JITTER) <= d <= base * (1 + JITTER) for d in delays)
    # the spread is real: both ends of the band are reached, so a fleet does not restart
    # in lockstep
    assert min(delays) < base * (1 - 0.9 * JITTER)
    assert max(delays) > base * (1 + 0.9 * JITTER)


def test_the_same_seed_gives_the_same_delay() -> None:
    a = decide(stalled(2), POLICY, random.Random(99))
    b = decide(stalled(2), POLICY, random.Random(99))
    assert a == b
    assert decide(stalled(2), POLICY, random.Random(100)) != a


def test_the_default_generator_is_used_when_none_is_given() -> None:
    move = decide(stalled(1), POLICY)
    assert isinstance(move, Restart)
    low, high = POLICY.backoff_initial * (1 - JITTER), POLICY.backoff_initial * (1 + JITTER)
    assert low <= move.delay <= high


def test_crash_loop_after_crash_loop_limit_crashes_on_the_same_turn() -> None:
    limit = POLICY.crash_loop_limit
    below = [Crash(4, progressed=True) for _ in range(limit - 1)]
    assert isinstance(decide(below, POLICY, random.Random(0)), Restart)
    at_limit = [*below, Crash(4, progressed=True)]
    assert decide(at_limit, POLICY, random.Random(0)) == GiveUp("crash_loop")
    assert decide(stalled(limit, turn=4), POLICY, random.Random(0)) == GiveUp("crash_loop")
    assert decide(stalled(limit + 3, turn=4), POLICY, random.Random(0)) == GiveUp("crash_loop")


def test_the_crash_loop_count_resets_when_the_turn_changes() -> None:
    limit = POLICY.crash_loop_limit
    earlier = stalled(limit - 1, turn=4)
    # the same turn once more would be a loop; a new turn starts the count afresh
    assert decide([*earlier, Crash(4, False)], POLICY, random.Random(0)) == GiveUp("crash_loop")
    fresh = [*earlier, Crash(5, progressed=True)]
    assert decide(fresh, POLICY, random.Random(0)) == Restart(0.0)
    again = [*fresh, *[Crash(5, progressed=True) for _ in range(limit - 2)]]
    assert isinstance(decide(again, POLICY, random.Random(0)), Restart)  # limit - 1 on turn 5
    assert decide([*again, Crash(5, True)], POLICY, random.Random(0)) == GiveUp("crash_loop")
    # and a turn that went back (a rewind) is a different turn too
    assert isinstance(decide([*earlier, Crash(2, False)], POLICY, random.Random(0)), Restart)


def test_interleaved_turns_never_add_up_to_a_loop() -> None:
    crashes = [Crash(turn, progressed=False) for turn in [1, 2] * 10]
    assert isinstance(decide(crashes, POLICY, random.Random(0)), Restart)


def test_progress_resets_the_backoff() -> None:
    crashes = [*stalled(4, turn=1), Crash(2, progressed=True), Crash(2, progressed=False)]
    move = decide(crashes, POLICY, random.Random(5))
    assert move == Restart(POLICY.backoff_initial * jitter_of(5))  # back to the first step


def test_a_limit_of_one_gives_up_on_the_first_crash() -> None:
    policy = RestartConfig(crash_loop_limit=1)
    assert decide([Crash(0, True)], policy, random.Random(0)) == GiveUp("crash_loop")


def test_decide_does_not_touch_its_input() -> None:
    crashes = stalled(3)
    copy = list(crashes)
    decide(crashes, POLICY, random.Random(0))
    assert crashes == copy


crash_lists = st.lists(
    st.builds(Crash, st.integers(min_value=0, max_value=3), st.booleans()), max_size=30
)


@given(
    crashes=crash_lists,
    limit=st.integers(min_value=1, max_value=6),
    seed=st.integers(min_value=0, max_value=2**32),
    initial=st.floats(min_value=0.01, max_value=5.0),
    cap=st.floats(min_value=0.01, max_value=100.0),
)
def test_properties(
    crashes: list[Crash], limit: int, seed: int, initial: float, cap: float
) -> None:
    policy = RestartConfig(backoff_initial=initial, backoff_max=cap, crash_loop_limit=limit)
    move = decide(crashes, policy, random.Random(seed))
    if not crashes:
        assert move == Restart(0.0)
        return
    run = 0
    for crash in reversed(crashes):
        if crash.turn != crashes[-1].turn:
            break
        run += 1
    if run >= limit:
        assert move == GiveUp("crash_loop")
        return
    assert isinstance(move, Restart)
    assert 0.0 <= move.delay <= cap
    assert (move.delay == 0.0) == crashes[-1].progressed


# -- storage faults: a wait of their own ------------------------------------------------------


@pytest.mark.parametrize("waits", [1, 2, 3, 4, 5])
def test_a_storage_wait_starts_at_half_a_second_and_doubles(waits: int) -> None:
    move = wait_for_storage(waits, POLICY, random.Random(waits))
    assert move == Restart(STORAGE_BACKOFF * 2 ** (waits - 1) * jitter_of(waits))


def test_a_storage_wait_is_capped_at_backoff_max_and_never_gives_up() -> None:
    for waits in (20, 1000, 10**9):
        move = wait_for_storage(waits, POLICY, random.Random(0))
        assert isinstance(move, Restart)
        assert move.delay <= POLICY.backoff_max


@given(
    waits=st.integers(min_value=0, max_value=10**6),
    seed=st.integers(min_value=0, max_value=2**32),
    cap=st.floats(min_value=0.01, max_value=100.0),
)
def test_storage_wait_properties(waits: int, seed: int, cap: float) -> None:
    policy = RestartConfig(backoff_initial=1.0, backoff_max=cap, crash_loop_limit=1)
    move = wait_for_storage(waits, policy, random.Random(seed))
    assert isinstance(move, Restart)  # whatever the count, and a crash_loop_limit of 1
    assert 0.0 < move.delay <= cap
