"""A spool written by release 0.1.0 resumes on this release (byte compatibility of the spool,
docs/design.md): ``tests/fixtures/spool-0.1.0``, made by that release's real CLI
and scripted model (``tests/fixtures/make_spool.py`` says how, and what each task is).

Only the public contract is read here (the CLI's ``status``, ``history`` and
``approve-dangling``, the workspaces, the journal's bytes), so the test holds across any
rework of how the spool is read and written.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.daemon import Daemon

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "spool-0.1.0"

CONFIG = (
    "max_workers = 8\n"
    "[heartbeat]\ninterval = 0.2\ntimeout = 5.0\n"
    "[restart]\nbackoff_initial = 0.1\nbackoff_max = 0.5\n"
)

pytestmark = pytest.mark.usefixtures("subreaper")


def copy_spool(target: Path) -> None:
    """The fixture as a spool: git keeps no modes, so the 0700/0600 every spool has is put
    back (docs/design.md: every file 0600, every folder 0700)."""
    shutil.copytree(FIXTURE, target, symlinks=True)
    os.chmod(target, 0o700)
    for folder, dirs, files in os.walk(target):
        for name in dirs:
            os.chmod(Path(folder) / name, 0o700)
        for name in files:
            os.chmod(Path(folder) / name, 0o600)


def history(daemon: Daemon, task_id: str) -> list[tuple[Any, ...]]:
    """Each turn of ``agentd history --json``, as (turn, rewound, inherited, calls), a call
    as (tool, outcome)."""
    code, out, err = daemon.cli("history", task_id, "--json")
    assert code == 0, err
    return [
        (
            row["turn"],
            row["rewound"],
            row["inherited"],
            [(c["tool"], c["outcome"]) for c in row["tool_calls"]],
        )
        for row in json.loads(out)
        if row["kind"] == "turn"
    ]


def workspace(daemon: Daemon, task_id: str) -> dict[str, str]:
    folder = daemon.task(task_id).path / "workspace"
    return {p.name: p.read_text() for p in sorted(folder.iterdir())}


def test_a_spool_of_release_0_1_0_resumes(tmp_path: Path) -> None:
    daemon = Daemon(tmp_path, CONFIG)
    copy_spool(daemon.spool.root)
    journals = {t.id: t.journal.read_bytes() for t in daemon.spool.tasks()}
    assert sorted(journals) == ["approve", "forked", "origin", "rewound", "skip"]
    try:
        daemon.start()
        for name in ("rewound", "forked"):
            row = daemon.wait_state(name, "done", "failed", timeout=30)
            assert (row["state"], row["reason"]) == ("done", "end_turn"), row
        for name in ("approve", "skip"):
            row = daemon.wait_state(name, "held", "done", "failed", timeout=30)
            assert row["state"] == "held", row
            assert [d["tool"] for d in row["dangling"]] == ["run_command"], row
        assert daemon.cli("approve-dangling", "approve", "--all", "--rerun")[0] == 0
        assert daemon.cli("approve-dangling", "skip", "--all", "--skip")[0] == 0
        for name in ("approve", "skip"):
            row = daemon.wait_state(name, "done", "failed", timeout=30)
            assert (row["state"], row["reason"]) == ("done", "end_turn"), row
        assert daemon.row("origin")["state"] == "done"
    finally:
        daemon.cleanup()

    # what the earlier release wrote is kept byte for byte; the new records follow it
    for task_id, before in journals.items():
        after = daemon.task(task_id).journal.read_bytes()
        assert after[: len(before)] == before, task_id
        assert len(after) > len(before) or task_id == "origin", task_id

    four = [
        (1, [("write_file", "ran")]),
        (2, [("append_file", "ran")]),
        (3, [("write_file", "ran")]),
        (4, []),
    ]
    assert history(daemon, "origin") == [(t, False, False, c) for t, c in four]
    rewound = [(t, t > 2, False, c) for t, c in four] + [(t, False, False, c) for t, c in four[2:]]
    assert history(daemon, "rewound") == rewound
    assert history(daemon, "forked") == [(t, False, t <= 2, c) for t, c in four]

    charge = [(1, [("write_file", "ran")]), (2, [("run_command", "rerun")]), (3, [])]
    assert history(daemon, "approve") == [(t, False, False, c) for t, c in charge]
    skipped = [*charge[:1], (2, [("run_command", "skipped")]), charge[2]]
    assert history(daemon, "skip") == [(t, False, False, c) for t, c in skipped]

    # the workspaces: the approved charge ran again, the skipped one did not; the rewound
    # turns' files stay as they were (no --restore-workspace), the fork has its own copy
    assert workspace(daemon, "approve") == {"plan.txt": "plan", "runs.txt": "run\nagain\n"}
    assert workspace(daemon, "skip") == {"plan.txt": "plan", "runs.txt": "run\n"}
    for task_id in ("origin", "rewound", "forked"):
        assert workspace(daemon, task_id) == {"a.txt": "three", "log.txt": "two\n"}, task_id
