"""A tool cannot starve its neighbours: a worker the machine refuses to start (fork
fails with EAGAIN) waits in ``backoff`` for the resources to come back, and never ends
``failed`` (the fork refused for real, by a pids cgroup the daemon runs in); where
cgroups v2 can be delegated, each task's tools run in a bounded cgroup of their own, and
the status header says which of the two holds (``cgroups: delegated`` or ``none: WHY``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from supervisor.cgroups import CGROUP_FS, delegate, own_cgroup
from supervisor.coordination import supervisor_info
from tests.daemon import Daemon, config_text
from tests.pids import PidsCgroup, PidsRefused, confine, pids_cgroup
from tests.supervisor.test_daemon import steps
from tests.support import make_spool, poll_for, reply, scripted_task, text, tool_use, worker_env
from worker.protocol import ExitCode

pytestmark = pytest.mark.usefixtures("subreaper")


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
    daemon = confine(Daemon(tmp_path / "d", config_text()), cgroup)
    try:
        daemon.start()
        cgroup.limit(cgroup.current())  # from now on every fork in the daemon's tree fails
        task_id = daemon.submit(steps(2), name="starved")
        row = daemon.wait_row(task_id, lambda r: r["state"] != "queued", what="a verdict")
        assert row["state"] == "backoff", row
        assert row["reason"].startswith("resources: cannot start a worker: [Errno 11]"), row
        waited = poll_for(lambda: daemon.events(task_id, "resource_wait"), 10.0, what="the event")
        assert waited[0]["level"] == "warning"
        cgroup.limit(None)  # the flood is over
        row = daemon.wait_state(task_id, "done", "failed", timeout=30)
        assert row["state"] == "done", row
    finally:
        daemon.cleanup()


def test_without_delegated_cgroups_the_status_header_says_why(tmp_path: Path) -> None:
    daemon = Daemon(tmp_path / "d", config_text())
    try:
        daemon.start()
        code, out, _ = daemon.cli("status")
        assert code == 0
        header = out.splitlines()[0]
        verdict = supervisor_info(daemon.spool)["cgroups"]  # type: ignore[index]
        assert header.endswith(f"; cgroups: {verdict}")
        code, out, _ = daemon.cli("status", "--json")
        assert json.loads(out)["supervisor"]["cgroups"] == verdict
        if not (CGROUP_FS / "cgroup.controllers").is_file():  # this machine: cgroup v1
            assert verdict == f"none: {CGROUP_FS} is not a cgroup v2 (unified) hierarchy"
    finally:
        daemon.cleanup()


def test_a_folder_that_is_no_cgroup2_is_said_so(tmp_path: Path) -> None:
    found = delegate(tmp_path)
    assert found.own is None
    assert found.verdict == f"none: {tmp_path} is not a cgroup v2 (unified) hierarchy"
    assert found.prepare("t1", 512, 2**31) == {}  # nothing made, nothing to join


def delegation_refused() -> str | None:
    """Why this test process's cgroup cannot be delegated to a daemon it starts (the
    checks of ``delegate``, made without moving anything), or None."""
    if not (CGROUP_FS / "cgroup.controllers").is_file():
        return f"{CGROUP_FS} is not a cgroup v2 hierarchy"
    found = own_cgroup(Path("/proc/self/cgroup").read_text())
    if found in (None, "/"):
        return "this process has no cgroup v2 of its own"
    own = CGROUP_FS / found.lstrip("/")
    available = (own / "cgroup.controllers").read_text().split()
    if not {"pids", "memory"} <= set(available) or not os.access(own, os.W_OK):
        return f"its cgroup {found} does not delegate pids and memory"
    return None


@pytest.mark.skipif(
    delegation_refused() is not None, reason=f"cgroups v2 not delegated: {delegation_refused()}"
)
def test_a_tasks_tools_run_in_its_own_bounded_cgroup(tmp_path: Path) -> None:
    extra = 'max_processes = 40\nmax_memory = "512M"\n'  # (in the [tools] table)
    daemon = Daemon(tmp_path / "d", config_text(extra=extra))
    try:
        daemon.start()
        assert supervisor_info(daemon.spool)["cgroups"] == "delegated"  # type: ignore[index]
        where = "$(sed -n 's/^0:://p' /proc/self/cgroup)"
        command = (
            f"echo {where} > cgroup.txt; cat /sys/fs/cgroup{where}/pids.max"
            f" /sys/fs/cgroup{where}/memory.max > limits.txt;"
            " for i in $(seq 100); do sleep 5 & done 2> flood.txt; wait"
        )
        script = [
            reply(tool_use("run_command", command=command, timeout=30)),
            reply(text("done")),
        ]
        task_id = daemon.submit(script, name="bounded")
        row = daemon.wait_state(task_id, "done", "failed", timeout=60)
        assert row["state"] == "done", row
        workspace = daemon.task(task_id).path / "workspace"
        assert (workspace / "cgroup.txt").read_text().strip().endswith(f"/tasks/{task_id}")
        assert (workspace / "limits.txt").read_text().split() == ["40", str(512 * 2**20)]
        assert "fork" in (workspace / "flood.txt").read_text()  # 100 sleeps were refused
    finally:
        daemon.cleanup()


def test_a_worker_that_gets_no_thread_stops_for_resources(
    tmp_path: Path, cgroup: PidsCgroup
) -> None:
    # started by the daemon's rules (its output on worker.log), in a cgroup with no room
    # for one more thread: its output copy and its heartbeat cannot start
    spool = make_spool(tmp_path)
    task = scripted_task(spool, steps(2), name="threadless")
    argv = [sys.executable, "-m", "worker", str(task.path)]
    with open(task.output, "ab") as out:
        proc = subprocess.Popen(
            cgroup.wrap(["/bin/sh", "-c", 'read go && exec "$@"', "sh", *argv]),
            env=worker_env(),
            stdin=subprocess.PIPE,
            stdout=out,
            stderr=out,
        )
    assert proc.stdin is not None
    poll_for(lambda: cgroup.current() >= 1, 10.0, what="the worker's shell")
    cgroup.limit(cgroup.current())
    proc.stdin.write(b"\n")
    proc.stdin.close()
    assert proc.wait(timeout=60) == ExitCode.RESOURCES
    assert "stopped: no thread to be had" in task.output.read_text()
    last_words = json.loads(task.exit.read_text())
    assert last_words["code"] == ExitCode.RESOURCES
