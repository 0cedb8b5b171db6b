"""A tool cannot starve its neighbours: a worker the machine refuses to start (fork
fails with EAGAIN) waits in ``backoff`` for the resources to come back, and never ends
``failed``; the fork refused for real, by a pids cgroup the daemon runs in."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.daemon import subreaper
from tests.pids import DaemonIn, PidsCgroup, PidsRefused, pids_cgroup
from tests.supervisor.test_daemon import config_text, steps


@pytest.fixture(scope="module", autouse=True)
def _subreaper() -> Iterator[None]:
    with subreaper():
        yield


@pytest.fixture
def cgroup(request: pytest.FixtureRequest) -> Iterator[PidsCgroup]:
    try:
        made = pids_cgroup(request.node.name[:40])
        found = made.__enter__()
    except PidsRefused as exc:  # root on the machines this runs on: it must be there
        pytest.fail(f"this test needs a pids cgroup: {exc}")
    try:
        yield found
    finally:
        made.__exit__(None, None, None)


def test_a_refused_fork_is_a_wait_not_a_failure(tmp_path: Path, cgroup: PidsCgroup) -> None:
    daemon = DaemonIn(tmp_path / "d", config_text(), cgroup)
    try:
        daemon.start()
        cgroup.limit(cgroup.current())  # from now on every fork in the daemon's tree fails
        task_id = daemon.submit(steps(2), name="starved")
        row = daemon.wait_row(task_id, lambda r: r["state"] != "queued", what="a verdict")
        assert row["state"] == "backoff", row
        assert row["reason"].startswith("resources: cannot start a worker: [Errno 11]"), row
        waited = daemon.events(task_id, "resource_wait")
        assert len(waited) == 1 and waited[0]["level"] == "warning"
        cgroup.limit(None)  # the flood is over
        row = daemon.wait_state(task_id, "done", "failed", timeout=30)
        assert row["state"] == "done", row
    finally:
        daemon.cleanup()
