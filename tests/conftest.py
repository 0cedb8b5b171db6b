"""Fixtures shared by the whole suite."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from supervisor.logging import reset as reset_logging
from tests import postgres
from tests.daemon import subreaper
from tests.processes import is_process_test
from tests.support import make_spool
from worker import credentials, paths
from worker.spool import Spool


@pytest.fixture(autouse=True)
def _reset_logging() -> Iterator[None]:
    """Every test starts and ends with structlog's defaults (logging is global state)."""
    reset_logging()
    yield
    reset_logging()


@pytest.fixture(autouse=True)
def _no_discovered_config(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No test reads the config of the person or machine running it: config discovery
    (``$XDG_CONFIG_HOME``, then ``SYSTEM_CONFIG``) finds two empty places unless the
    test puts a file there. Processes the test starts inherit ``XDG_CONFIG_HOME``."""
    empty = tmp_path_factory.mktemp("no-config")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(empty / "xdg"))
    monkeypatch.setattr(paths, "SYSTEM_CONFIG", empty / "etc" / "agentd.toml")


@pytest.fixture(autouse=True)
def _not_under_journald(monkeypatch: pytest.MonkeyPatch) -> None:
    """No test logs as a service of systemd's (priority prefixes, ``<6>``) unless it sets
    ``JOURNAL_STREAM`` itself, whatever the environment the suite runs in."""
    monkeypatch.delenv("JOURNAL_STREAM", raising=False)
    monkeypatch.delenv("NO_COLOR", raising=False)


@pytest.fixture(autouse=True)
def _reset_credentials() -> Iterator[None]:
    """Every test starts and ends holding no secret (the holder is process-wide)."""
    credentials.hold(credentials.Credentials())
    yield
    credentials.hold(credentials.Credentials())


@pytest.fixture(autouse=True)
def _leaks_are_the_tests_own() -> Iterator[None]:
    """With ``AGENTD_TEST_LEAKS=1``, garbage is collected as each test ends, so that a file
    it (or the code it drives) left open is reported against that test (an unclosed file's
    ``ResourceWarning`` is an error here) rather than against whichever later test the
    collector happens to run in. Off by default: a collection a test costs time."""
    yield
    if os.environ.get("AGENTD_TEST_LEAKS"):
        gc.collect()


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """A real PostgreSQL for the whole run: ``$AGENTD_TEST_POSTGRES`` or a throwaway server;
    skipped off CI when neither can be had (tests/postgres.py)."""
    yield from postgres.server_url()


@pytest.fixture
def postgres_schema(postgres_url: str) -> Iterator[str]:
    """The URL of an empty schema of the test's own (its search_path), dropped after."""
    with postgres.fresh_schema(postgres_url) as url:
        yield url


@pytest.fixture
def spool(tmp_path: Path) -> Spool:
    """An empty spool of the test's own (0700, its folders made)."""
    return make_spool(tmp_path)


@pytest.fixture(scope="module", name="subreaper")
def _subreaper() -> Iterator[None]:
    """The test process is a child subreaper for the whole module: workers orphaned by a
    killed daemon are reparented to it and reaped (tests/daemon.py). A module that starts
    daemons says ``pytestmark = pytest.mark.usefixtures("subreaper")``."""
    with subreaper():
        yield


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test that starts a real process ``process`` (tests/processes.py), so that
    ``pytest -m "not process"`` runs the unit tests alone."""
    for item in items:
        if is_process_test(item):
            item.add_marker(pytest.mark.process)
