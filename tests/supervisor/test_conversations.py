"""``agentd continue`` (docs/design.md section 19): a done task goes on in the same
journal with a new instruction; its turns, spend and events go on; anything but a done
task is refused with what to do instead. Real processes: ``agentd run``, a daemon."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.daemon import Daemon, config_text
from tests.support import journal_records, poll_for, reply, text, worker_env
from worker.spool import Spool

pytestmark = pytest.mark.process

REPO = Path(__file__).resolve().parents[2]


def agentd(spool: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "supervisor", "--spool", str(spool), *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=worker_env({"AGENTD_CONFIG": "", "LOGNAME": "ops"}),
        timeout=120,
        check=False,
    )


def status(spool: Path, task: str) -> dict[str, Any]:
    done = agentd(spool, "status", task, "--json")
    assert done.returncode == 0, done.stderr
    rows: list[dict[str, Any]] = json.loads(done.stdout)["tasks"]
    return rows[0]


def script(tmp_path: Path, *texts: str) -> Path:
    path = tmp_path / "script.json"
    path.write_text(json.dumps({"responses": [reply(text(t)) for t in texts]}))
    return path


def test_a_done_task_continues_in_the_same_journal_with_and_without_a_daemon(
    tmp_path: Path,
) -> None:
    spool = tmp_path / "spool"
    path = script(tmp_path, "One.", "Two.", "Three.")
    made = agentd(spool, "submit", "--name", "c1", "--prompt", "First.", "--script", str(path))
    assert made.returncode == 0, made.stderr
    daemon = Daemon(tmp_path / "d", config_text())
    daemon.spool = Spool(spool)
    task = Spool(spool).task("c1")
    daemon.start()
    try:
        poll_for(lambda: status(spool, "c1")["state"] == "done", 60, what="c1 done")
        said = agentd(spool, "continue", "c1", "--prompt", "And a second thing.")
        assert said.returncode == 0, said.stderr
        assert "continued after turn 1" in said.stdout
        row = poll_for(
            lambda: (r := status(spool, "c1"))["turn"] == 2 and r["state"] == "done" and r,
            60,
            what="c1 done after its second turn",
        )
        assert row["restarts"] == 0
    finally:
        daemon.stop()
    users = [r for r in journal_records(task) if r["k"] == "user"]
    assert users[-1]["content"] == [{"type": "text", "text": "And a second thing."}]
    assert users[-1]["via"] == "cli" and users[-1]["by"]
    # no daemon: the task waits queued with the message in its journal, until a start
    assert agentd(spool, "continue", "c1", "--prompt", "A third.").returncode == 0
    assert status(spool, "c1")["state"] == "queued"
    daemon.start()
    try:
        poll_for(lambda: status(spool, "c1")["turn"] == 3, 60, what="turn 3")
        poll_for(lambda: status(spool, "c1")["state"] == "done", 60, what="c1 done")
    finally:
        daemon.stop()
    shown = [json.loads(line) for line in agentd(spool, "show", "c1", "--json").stdout.splitlines()]
    texts = [line.get("text") for line in shown]
    order = ["One.", "And a second thing.", "Two.", "A third.", "Three."]
    assert [texts.index(t) for t in order] == sorted(texts.index(t) for t in order)
    events = [json.loads(line) for line in task.events.read_text().splitlines()]
    assert [e["turn"] for e in events if e["event"] == "task_continued"] == [1, 2]


def test_a_task_of_agentd_run_continues_in_the_foreground(tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    path = script(tmp_path, "One.", "Two.")
    run = agentd(spool, "run", "--name", "r1", "--prompt", "First.", "--script", str(path))
    assert run.returncode == 0, run.stderr
    said = agentd(spool, "continue", "r1", "--prompt", "More.")
    assert said.returncode == 0 and "agentd run --resume r1" in said.stderr
    resumed = agentd(spool, "run", "--resume", "r1")
    assert resumed.returncode == 0, resumed.stderr
    assert "Two." in resumed.stdout
    row = status(spool, "r1")
    assert row["state"] == "done" and row["turn"] == 2


def test_only_a_done_task_is_continued_and_a_refusal_changes_nothing(tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    path = script(tmp_path, "One.")
    assert (
        agentd(spool, "submit", "--name", "q", "--prompt", "x", "--script", str(path)).returncode
        == 0
    )
    assert (
        agentd(spool, "submit", "--name", "c", "--prompt", "x", "--script", str(path)).returncode
        == 0
    )
    assert agentd(spool, "cancel", "c").returncode == 0
    agentd(spool, "run", "--name", "f", "--prompt", "x", "--script", str(tmp_path / "none.json"))
    (tmp_path / "none.json").write_text(json.dumps({"responses": []}))
    agentd(spool, "run", "--name", "f2", "--prompt", "x", "--script", str(tmp_path / "none.json"))
    cases = {
        "q": "is queued, not done",
        "c": "was cancelled",
        "f2": "agentd retry f2",
        "nope": "no task 'nope'",
    }
    for name, words in cases.items():
        before = [p.read_bytes() for p in sorted((spool / "tasks").rglob("journal"))]
        refused = agentd(spool, "continue", name, "--prompt", "more")
        assert refused.returncode == 3 and words in refused.stderr, (name, refused.stderr)
        assert [p.read_bytes() for p in sorted((spool / "tasks").rglob("journal"))] == before
    assert agentd(spool, "continue", "q").returncode == 2
    assert agentd(spool, "continue", "q", "--prompt", " ").returncode == 2
