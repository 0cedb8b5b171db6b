"""Fixtures shared by the whole suite."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from supervisor.logging import reset as reset_logging
from worker import credentials


@pytest.fixture(autouse=True)
def _reset_logging() -> Iterator[None]:
    """Every test starts and ends with structlog's defaults (logging is global state)."""
    reset_logging()
    yield
    reset_logging()


@pytest.fixture(autouse=True)
def _reset_credentials() -> Iterator[None]:
    """Every test starts and ends holding no secret (the holder is process-wide)."""
    credentials.hold(credentials.Credentials())
    yield
    credentials.hold(credentials.Credentials())
