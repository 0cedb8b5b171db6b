"""The cluster conformance suite (``worker.testing.shared_conformance``), run on both
``SharedStore`` backends: the in-memory cluster always, PostgreSQL on a real server
(a schema of the test's own; ``tests/postgres.py`` says when it skips, never in CI)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from worker.store.base import SharedStore
from worker.store.memshared import MemoryCluster
from worker.testing.shared_conformance import *  # noqa: F403  (the suite's tests)
from worker.testing.shared_conformance import SharedBackend


def _memory(request: pytest.FixtureRequest) -> SharedBackend:
    clusters: list[MemoryCluster] = []

    def make(node: str, lease: float, clock: Callable[[], float]) -> SharedStore:
        if not clusters:
            clusters.append(MemoryCluster(clock=clock))
        return clusters[0].store(node, lease=lease)

    return make


def _postgres(request: pytest.FixtureRequest) -> SharedBackend:
    from worker.store.postgres import PostgresStore

    url = request.getfixturevalue("postgres_schema")
    made: list[PostgresStore] = []

    def make(node: str, lease: float, clock: Callable[[], float]) -> SharedStore:
        store = PostgresStore(url, node=node, lease=lease, migrate=not made, clock=clock)
        made.append(store)
        return store

    return make


@pytest.fixture(params=["memory", pytest.param("postgres", marks=pytest.mark.process)])
def shared_backend(request: pytest.FixtureRequest) -> SharedBackend:
    return {"memory": _memory, "postgres": _postgres}[request.param](request)
