"""The store conformance suite (``worker.testing.store_conformance``), run on every
backend of ``conftest.BACKENDS``: a test of one backend's own bytes is marked
``@pytest.mark.backend(...)`` and lives beside it (``test_files.py``)."""

from __future__ import annotations

from worker.testing.store_conformance import *  # noqa: F403  (the suite's tests)
