"""call_with_retries: what is retried, how long it waits, when it gives up."""

from __future__ import annotations

import random

import pytest

from worker.errors import ModelError, RetryableModelError
from worker.models.base import ModelReply, ModelRequest, Usage
from worker.models.retry import ThrottledError, backoff_delay, call_with_retries

REQUEST = ModelRequest(model="m", max_tokens=10, messages=[{"role": "user", "content": "hi"}])
REPLY = ModelReply(
    content=[{"type": "text", "text": "ok"}], stop_reason="end_turn", usage=Usage(3, 4)
)


class FlakyModel:
    """Raises the given errors in order, then answers REPLY."""

    def __init__(self, *errors: Exception) -> None:
        self.errors = list(errors)
        self.calls: list[int] = []

    def complete(self, request: ModelRequest, *, turn_index: int) -> ModelReply:
        assert request is REQUEST
        self.calls.append(turn_index)
        if self.errors:
            raise self.errors.pop(0)
        return REPLY

    def close(self) -> None:
        pass


def test_success_needs_no_sleep() -> None:
    sleeps: list[float] = []
    model = FlakyModel()
    assert call_with_retries(model, REQUEST, turn_index=4, sleep=sleeps.append) is REPLY
    assert model.calls == [4]
    assert sleeps == []


def test_retryable_errors_are_retried_with_capped_exponential_backoff() -> None:
    model = FlakyModel(*(RetryableModelError(f"boom {n}") for n in range(10)))
    sleeps: list[float] = []
    seen: list[tuple[str, int, float]] = []
    reply = call_with_retries(
        model,
        REQUEST,
        turn_index=2,
        backoff_initial=0.5,
        backoff_max=8.0,
        sleep=sleeps.append,
        on_retry=lambda error, attempt, delay: seen.append((str(error), attempt, delay)),
        rng=random.Random(7),
    )
    assert reply is REPLY
    assert model.calls == [2] * 11
    assert [s[1] for s in seen] == list(range(1, 11))
    assert [s[2] for s in seen] == sleeps
    assert seen[0][0] == "boom 0"
    steps = [min(8.0, 0.5 * 2**n) for n in range(10)]
    for delay, step in zip(sleeps, steps, strict=True):
        assert step / 2 <= delay <= step
    assert max(sleeps) <= 8.0


def test_unlimited_attempts_by_default() -> None:
    model = FlakyModel(*(RetryableModelError("again") for _ in range(200)))
    sleeps: list[float] = []
    assert call_with_retries(model, REQUEST, turn_index=0, sleep=sleeps.append) is REPLY
    assert len(model.calls) == 201
    assert len(sleeps) == 200
    assert all(0 < s <= 30.0 for s in sleeps)


def test_attempts_cap_raises_the_last_error() -> None:
    model = FlakyModel(*(RetryableModelError(f"fail {n}") for n in range(5)))
    sleeps: list[float] = []
    with pytest.raises(RetryableModelError, match="fail 2"):
        call_with_retries(model, REQUEST, turn_index=0, attempts=3, sleep=sleeps.append)
    assert len(model.calls) == 3
    assert len(sleeps) == 2


def test_final_model_error_is_not_retried() -> None:
    model = FlakyModel(ModelError("bad key"), RetryableModelError("never reached"))
    sleeps: list[float] = []
    with pytest.raises(ModelError, match="bad key") as info:
        call_with_retries(model, REQUEST, turn_index=0, sleep=sleeps.append)
    assert not isinstance(info.value, RetryableModelError)
    assert len(model.calls) == 1
    assert sleeps == []


def test_other_exceptions_propagate_untouched() -> None:
    model = FlakyModel(KeyError("bug"))
    with pytest.raises(KeyError):
        call_with_retries(model, REQUEST, turn_index=0, sleep=lambda _: None)
    assert len(model.calls) == 1


def test_retry_after_is_a_floor_capped_by_backoff_max() -> None:
    sleeps: list[float] = []
    model = FlakyModel(ThrottledError("429", retry_after=5.0), ThrottledError("429", 99.0))
    call_with_retries(
        model, REQUEST, turn_index=0, backoff_initial=0.1, backoff_max=20.0, sleep=sleeps.append
    )
    assert sleeps == [5.0, 20.0]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"attempts": 0}, "attempts"),
        ({"backoff_initial": -1.0}, "backoff_initial"),
        ({"backoff_initial": 5.0, "backoff_max": 1.0}, "backoff_max"),
    ],
)
def test_bad_arguments_are_refused(kwargs: dict[str, float], message: str) -> None:
    model = FlakyModel()
    with pytest.raises(ValueError, match=message):
        call_with_retries(model, REQUEST, turn_index=0, **kwargs)  # type: ignore[arg-type]
    assert model.calls == []


def test_backoff_delay_is_jittered_and_bounded() -> None:
    delays = {backoff_delay(3, initial=1.0, maximum=30.0, rng=random.Random(n)) for n in range(20)}
    assert len(delays) > 10  # jitter: workers that failed together spread out
    assert all(2.0 <= d <= 4.0 for d in delays)
    assert backoff_delay(10_000, initial=1.0, maximum=30.0) <= 30.0  # no overflow on long runs
    assert backoff_delay(1, initial=0.0, maximum=30.0) == 0.0
