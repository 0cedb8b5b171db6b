"""Retrying a model call: capped exponential backoff with jitter, retryable faults only.

The agent loop calls ``call_with_retries`` for every model turn. Only
``RetryableModelError`` is retried; any other error, including a plain ``ModelError``,
goes straight to the caller. Nothing is recorded between attempts, so the usage of a
failed attempt is never counted: the reply that comes back is the one successful call.
Attempts are unlimited by default; the supervisor's progress deadline bounds how long a
call may take altogether.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

from worker.errors import RetryableModelError
from worker.models.base import Model, ModelReply, ModelRequest

OnRetry = Callable[[RetryableModelError, int, float], None]
"""``on_retry(error, attempt, delay)``: attempt ``attempt`` (1-based) failed; sleeping ``delay``."""


class ThrottledError(RetryableModelError):
    """A retryable fault where the server said when to come back (a ``retry-after`` header)."""

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


def backoff_delay(
    attempt: int,
    *,
    initial: float,
    maximum: float,
    retry_after: float | None = None,
    rng: random.Random | None = None,
) -> float:
    """The pause after failed attempt ``attempt`` (1-based), in seconds.

    Equal jitter: half of the capped exponential step is fixed, the other half random, so
    workers that failed together do not retry together. A server's ``retry-after`` raises
    the pause to at least that long; ``maximum`` caps everything.
    """
    step = min(maximum, initial * 2.0 ** min(attempt - 1, 62))
    delay = step / 2 + (rng or random).uniform(0.0, step / 2)
    if retry_after is not None:
        delay = max(delay, retry_after)
    return min(delay, maximum)


def call_with_retries(
    model: Model,
    request: ModelRequest,
    *,
    turn_index: int,
    attempts: int | None = None,
    backoff_initial: float = 0.5,
    backoff_max: float = 30.0,
    sleep: Callable[[float], None] = time.sleep,
    on_retry: OnRetry | None = None,
    rng: random.Random | None = None,
) -> ModelReply:
    """``model.complete(request)``, retried on ``RetryableModelError``.

    ``attempts`` caps the number of calls (None: no cap); when the last one fails, its
    ``RetryableModelError`` is raised. ``on_retry`` is told about each failure before the
    pause (for logging and the heartbeat phase); ``sleep`` and ``rng`` are injectable.
    """
    if attempts is not None and attempts < 1:
        raise ValueError(f"attempts must be at least 1 or None, not {attempts}")
    if backoff_initial < 0 or backoff_max < backoff_initial:
        raise ValueError(
            f"need 0 <= backoff_initial <= backoff_max, got {backoff_initial} and {backoff_max}"
        )
    attempt = 0
    while True:
        attempt += 1
        try:
            return model.complete(request, turn_index=turn_index)
        except RetryableModelError as error:
            if attempts is not None and attempt >= attempts:
                raise
            retry_after = error.retry_after if isinstance(error, ThrottledError) else None
            delay = backoff_delay(
                attempt,
                initial=backoff_initial,
                maximum=backoff_max,
                retry_after=retry_after,
                rng=rng,
            )
            if on_retry is not None:
                on_retry(error, attempt, delay)
            sleep(delay)
