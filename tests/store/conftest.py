"""The backends the conformance suite runs on: add a store to ``BACKENDS`` and every
test of ``tests/store/`` runs on it unchanged. A test that only means something for one
backend (bytes on disk, a torn tail) says so with ``@pytest.mark.backend("files")``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from worker.store.base import TaskStore
from worker.store.files import FileStore
from worker.store.memory import MemoryStore
from worker.store.memshared import MemoryCluster
from worker.store.postgres import PostgresStore
from worker.testing.store_conformance import new_task

__all__ = ["BACKENDS", "new_task"]


def _postgres(request: pytest.FixtureRequest, folder: Path) -> TaskStore:
    """A store in an empty schema of the test's own on a real server (skipped off CI
    when there is none: tests/postgres.py), its connections closed after the test."""
    store = PostgresStore(request.getfixturevalue("postgres_schema"), node="test", migrate=True)
    request.addfinalizer(store.close)
    return store


#: name -> how to make an empty store of that backend for a test, in its own folder
BACKENDS: dict[str, Callable[[pytest.FixtureRequest, Path], TaskStore]] = {
    "files": lambda request, folder: FileStore(folder / "spool"),
    "memory": lambda request, folder: MemoryStore(),
    "memshared": lambda request, folder: MemoryCluster().store("test"),
    "postgres": _postgres,
}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "backend(*names): run this store test on the named backends only"
    )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Every test that uses ``store`` runs once per backend (its marked ones only)."""
    if "backend_name" in metafunc.fixturenames:
        marker = metafunc.definition.get_closest_marker("backend")
        names = marker.args if marker else sorted(BACKENDS)
        # the PostgreSQL backend needs a server: a process test (tests/processes.py)
        marks = {"postgres": [pytest.mark.process]}
        metafunc.parametrize(
            "backend_name", [pytest.param(name, marks=marks.get(name, [])) for name in names]
        )


@pytest.fixture
def store(backend_name: str, request: pytest.FixtureRequest, tmp_path: Path) -> TaskStore:
    return BACKENDS[backend_name](request, tmp_path)
