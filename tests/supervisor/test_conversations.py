"""``agentd continue`` (docs/design.md section 19): a done task goes on in the same
journal with a new instruction; its turns, spend and events go on; anything but a done
task is refused with what to do instead. Real processes: ``agentd run``, a daemon."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.daemon import Daemon, config_text
from tests.support import journal_records, poll_for, reply, text, tool_use, worker_env
from worker.spool import Spool, TaskDir

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


def said_records(task: TaskDir) -> list[dict[str, Any]]:
    return [r for r in journal_records(task) if r["k"] == "user" and "message" in r]


def worker_pid(daemon: Daemon, name: str) -> int:
    row = daemon.wait_row(name, lambda r: r["pid"], what="its worker")
    pid: int = row["pid"]
    return pid


def test_say_to_a_running_task_joins_once_across_kills_after_it_and_after_its_model_call(
    tmp_path: Path,
) -> None:
    daemon = Daemon(tmp_path, config_text())
    daemon.start()
    try:
        script = [
            reply(text("Waiting."), tool_use("stall", seconds=3)),  # idempotent: re-run
            reply(text("Noted the message."), delay=2.0),
        ]
        daemon.submit(script, name="s1")
        task = daemon.task("s1")
        row = daemon.wait_row("s1", lambda r: r["phase"] == "tool:stall", what="the tool call")
        first = row["pid"]
        code, out, err = daemon.cli("say", "s1", "Also mind the tests.")
        assert code == 0 and "message 1 added" in out, err
        os.kill(first, signal.SIGKILL)  # right after the message was accepted
        poll_for(lambda: said_records(task), 60, what="the message in the journal")
        # ... and right after the model call that carried it began (turn 2 not recorded)
        second = worker_pid(daemon, "s1")
        assert second != first
        os.kill(second, signal.SIGKILL)
        daemon.wait_state("s1", "done", "failed")
    finally:
        daemon.stop()
    said = said_records(task)
    assert len(said) == 1 and said[0]["message"] == 1 and said[0]["via"] == "cli"
    records = journal_records(task)
    at = records.index(said[0])
    # after the first turn's tool result, before the second turn
    kinds = [r["k"] for r in records[:at]]
    assert kinds.count("turn") == 1 and kinds[-1] == "result"
    assert [r["k"] for r in records[at + 1 :]].count("turn") == 1
    lines = [
        json.loads(x) for x in agentd(daemon.spool.root, "show", "s1", "--json").stdout.splitlines()
    ]
    texts = [line.get("text") for line in lines]
    assert texts.count("Also mind the tests.") == 1
    assert texts.index("Also mind the tests.") < texts.index("Noted the message.")
    message = next(line for line in lines if line.get("text") == "Also mind the tests.")
    assert message["by"] and message["via"] == "cli" and message["message"] == 1
    shown = agentd(daemon.spool.root, "show", "s1").stdout
    assert "user (by " in shown and "Also mind the tests." in shown


def test_say_to_a_held_task_waits_for_the_decision_and_a_rewind_before_it_drops_it(
    tmp_path: Path,
) -> None:
    daemon = Daemon(tmp_path, config_text())
    daemon.start()
    try:
        charge = "if [ -e charged ]; then echo again; else touch charged; exec sleep 30; fi"
        script = [
            reply(text("Charging."), tool_use("run_command", command=charge, timeout=60)),
            reply(text("Charged, and read your note.")),
            reply(text("Done again.")),
        ]
        daemon.submit(script, name="h1")
        task = daemon.task("h1")
        charged = task.path / "workspace" / "charged"
        row = daemon.wait_row("h1", lambda r: r["phase"] == "tool:run_command" and charged.exists())
        os.kill(row["pid"], signal.SIGKILL)
        row = daemon.wait_state("h1", "held")
        code, _, err = daemon.cli("say", "h1", "Use the sandbox account.")
        assert code == 0, err
        assert said_records(task) == []  # it waits with the task
        (call,) = row["dangling"]
        code, _, err = daemon.cli(
            "approve-dangling", "h1", call["call_id"], "--result", "charged once"
        )
        assert code == 0, err
        daemon.wait_state("h1", "done", "failed")
        records = journal_records(task)
        (said,) = said_records(task)
        at = records.index(said)
        assert records[at - 1]["k"] == "result"  # joined after the decided result
        # a rewind to before it takes it off the live branch; it is not taken again
        code, _, err = daemon.cli("rewind", "h1", "--to", "0", "--yes")
        assert code == 0, err
        daemon.wait_state("h1", "done", "failed")
    finally:
        daemon.stop()
    texts = [
        json.loads(x).get("text")
        for x in agentd(daemon.spool.root, "show", "h1", "--json").stdout.splitlines()
    ]
    assert "Use the sandbox account." not in texts
    assert len(said_records(task)) == 1  # in the history, once


def test_say_is_refused_for_an_ended_task(tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    path = script(tmp_path, "One.")
    assert (
        agentd(spool, "run", "--name", "d", "--prompt", "x", "--script", str(path)).returncode == 0
    )
    refused = agentd(spool, "say", "d", "more")
    assert refused.returncode == 3 and "agentd continue d" in refused.stderr
    assert agentd(spool, "say", "d").returncode == 2
    assert agentd(spool, "say", "nope", "hi").returncode == 3


def test_say_to_a_task_whose_context_is_compacted_is_taken_once(tmp_path: Path) -> None:
    from tests.worker.test_compaction import compacting_script

    context = (
        "[model]\nmax_tokens = 50\n[context]\nwindow = 200\ncompact_at = 0.5\nkeep_turns = 1\n"
    )
    daemon = Daemon(tmp_path, config_text(extra=context))
    daemon.start()
    try:
        responses = compacting_script()["responses"]
        responses[0] = {**responses[0], "delay": 2.0}
        daemon.submit(responses, name="long")
        task = daemon.task("long")
        worker_pid(daemon, "long")
        code, _, err = daemon.cli("say", "long", "Name the files in order.")
        assert code == 0, err
        daemon.wait_state("long", "done", "failed")
    finally:
        daemon.stop()
    records = journal_records(task)
    (said,) = said_records(task)
    at = records.index(said)
    assert [r for r in records[at:] if r["k"] == "compaction"]  # compacted after it joined
    assert status(daemon.spool.root, "long")["state"] == "done"


def test_run_resume_with_a_prompt_continues_a_done_task_in_the_foreground(tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    path = script(tmp_path, "One.", "Two.", "Three.")
    assert (
        agentd(spool, "run", "--name", "r2", "--prompt", "First.", "--script", str(path)).returncode
        == 0
    )
    resumed = agentd(spool, "run", "--resume", "r2", "--prompt", "And then?")
    assert resumed.returncode == 0, resumed.stderr
    assert "Two." in resumed.stdout
    row = status(spool, "r2")
    assert row["state"] == "done" and row["turn"] == 2
    users = [r for r in journal_records(Spool(spool).task("r2")) if r["k"] == "user"]
    assert users[-1]["via"] == "run" and users[-1]["content"][0]["text"] == "And then?"
    # a task that is not done takes no new instruction here: exit 3, nothing written
    assert (
        agentd(spool, "submit", "--name", "q", "--prompt", "x", "--script", str(path)).returncode
        == 0
    )
    refused = agentd(spool, "run", "--resume", "q", "--prompt", "more")
    assert refused.returncode == 3 and "agentd say q" in refused.stderr
