"""The backends the conformance suite runs on: add a store to ``BACKENDS`` and every
test of ``tests/store/`` runs on it unchanged. A test that only means something for one
backend (bytes on disk, a torn tail) says so with ``@pytest.mark.backend("files")``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from worker.spool import TaskSpec
from worker.store.base import TaskStore
from worker.store.files import FileStore
from worker.store.memory import MemoryStore

#: name -> how to make an empty store of that backend in a test's own folder
BACKENDS: dict[str, Callable[[Path], TaskStore]] = {
    "files": lambda folder: FileStore(folder / "spool"),
    "memory": lambda folder: MemoryStore(),
}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "backend(*names): run this store test on the named backends only"
    )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Every test that uses ``store`` runs once per backend (its marked ones only)."""
    if "backend_name" in metafunc.fixturenames:
        marker = metafunc.definition.get_closest_marker("backend")
        metafunc.parametrize("backend_name", marker.args if marker else sorted(BACKENDS))


@pytest.fixture
def store(backend_name: str, tmp_path: Path) -> TaskStore:
    return BACKENDS[backend_name](tmp_path)


def new_task(store: TaskStore, task_id: str = "t1", prompt: str = "Do the thing.") -> str:
    """A task in ``store`` with a queued record; its id."""
    store.create(TaskSpec(id=task_id, prompt=prompt), {"state": "queued"})
    return task_id
