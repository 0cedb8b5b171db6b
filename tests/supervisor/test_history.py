"""History, rewind and fork: checkpoints as time travel (issue: rewind and fork)."""

from __future__ import annotations

import json
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from supervisor.cli import main
from supervisor.history import fork, history_rows, rewind
from supervisor.record import TaskRecord
from supervisor.status import held_calls, load_state, status_row
from supervisor.stores import store_of
from tests.support import (
    REPO,
    assert_paired,
    charge_crashing_once,
    git,
    journal_records,
    of_kind,
    reply,
    run_to_end,
    scripted_task,
    text,
    tool_use,
    worker_env,
)
from worker.config import Config
from worker.errors import StateConflictError, UsageError
from worker.events import read_events
from worker.lock import TaskLock
from worker.models.messages_api import MessagesAPIModel
from worker.protocol import TaskStatus
from worker.spool import Spool, TaskDir
from worker.store.files import FileStore
from worker.testing.journals import long_journal
from worker.testing.messages_api import MessagesAPIServer, Reply

CONFIG = Config()


def six_turns() -> list[dict[str, Any]]:
    return [
        reply(text("one"), tool_use("write_file", path="a.txt", content="one")),
        reply(
            tool_use("write_file", path="a.txt", content="two"),
            tool_use("write_file", path="b.txt", content="bee"),
        ),
        reply(tool_use("append_file", path="log.txt", content="x\n")),
        reply(tool_use("outbox_send", to="ops", body="hello")),
        reply(tool_use("read_file", path="a.txt")),
        reply(text("Done.")),
    ]


def read_events_named(task: TaskDir, name: str) -> list[dict[str, Any]]:
    return [e for e in read_events(task.events) if e.get("event") == name]


def _without_keys(messages: list[dict[str, Any]]) -> str:
    return re.sub(r"agentd-[0-9a-f]{32}", "KEY", json.dumps(messages))


def live_keys(task: TaskDir) -> dict[str, str | None]:
    state = load_state(task)
    return {c.call_id: c.key for c in state.calls.values()}


# -- rewind -----------------------------------------------------------------------------


def test_rewind_then_resume_replays_the_same_path(spool: Spool) -> None:
    task = scripted_task(spool, six_turns(), name="r1")
    assert run_to_end(task) == "done"
    before = load_state(task)
    with pytest.raises(UsageError, match="--yes"):
        rewind(spool, CONFIG, task.id, 2)
    assert load_state(task).turn == 6  # refused: nothing changed
    report = rewind(spool, CONFIG, task.id, 2, yes=True)
    assert {c["tool"] for c in report.irreversible} == {"append_file", "outbox_send"}
    assert (report.from_turn, report.to, report.cut_off) == (6, 2, [])
    (event,) = read_events_named(task, "task_rewound")
    assert (event["from_turn"], event["to"], event["cut_off"]) == (6, 2, [])
    scene = load_state(task)
    assert scene.turn == 2
    assert scene.messages == before.messages[:5]  # prompt, (assistant, results) x 2
    assert scene.usage_total == before.usage_total  # money spent is not rewound
    assert TaskRecord.load(task).state == "queued"
    assert run_to_end(task) == "done"
    after = load_state(task)
    assert after.turn == 6
    # the same path, except the keyed call's new branch has a new idempotency key
    assert _without_keys(after.messages) == _without_keys(before.messages)
    assert json.dumps(after.messages) != json.dumps(before.messages)
    assert after.usage_total.input_tokens > before.usage_total.input_tokens
    assert after.usage == before.usage
    rows = history_rows(task)
    assert [r["turn"] for r in rows] == [1, 2, 3, 4, 5, 6, 3, 4, 5, 6]
    assert [r["rewound"] for r in rows] == [False] * 2 + [True] * 4 + [False] * 4
    # new calls on the new branch got new idempotency keys
    old_keys = {r["call_id"]: r for r in of_kind(journal_records(task), "intent")}
    assert len({r["key"] for r in old_keys.values()}) == len(old_keys)


def test_rewound_transcript_is_accepted_by_the_messages_api(spool: Spool) -> None:
    script = six_turns()
    task = scripted_task(spool, script, name="r2")
    assert run_to_end(task) == "done"
    rewind(spool, CONFIG, task.id, 3, yes=True)

    def by_turn(request: dict[str, Any]) -> Reply:
        k = sum(1 for m in request["messages"] if m["role"] == "assistant")
        return Reply(script[k]["content"])

    with MessagesAPIServer(responder=by_turn) as server:
        model = MessagesAPIModel(api_key=server.api_key, base_url=server.base_url)
        assert run_to_end(task, model=model) == "done"
        assert server.rejected == []
        assert len(server.requests) == 3  # turns 4, 5 and 6
    assert_paired(load_state(task).messages)


def test_rewind_bad_input_changes_nothing(spool: Spool, capsys: pytest.CaptureFixture[str]) -> None:
    task = scripted_task(spool, six_turns(), name="r3")
    assert run_to_end(task) == "done"
    size = task.journal.stat().st_size
    assert main(["--spool", str(spool.root), "rewind", "r3", "--to", "9", "--yes"]) == 2
    assert main(["--spool", str(spool.root), "rewind", "r3", "--to", "-1", "--yes"]) == 2
    assert main(["--spool", str(spool.root), "rewind", "nope", "--to", "1"]) == 3
    assert main(["--spool", str(spool.root), "rewind", "../x", "--to", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 4 and all(line.startswith("agentd: ") for line in err)
    assert task.journal.stat().st_size == size


def test_rewind_of_a_running_task_that_cannot_be_stopped(spool: Spool) -> None:
    task = scripted_task(spool, six_turns(), name="r4")
    assert run_to_end(task) == "done"
    size = task.journal.stat().st_size
    with TaskLock(task.lock).acquire(), pytest.raises(StateConflictError, match="running"):
        rewind(spool, CONFIG, task.id, 1, yes=True)  # no daemon to stop the lock holder
    assert task.journal.stat().st_size == size


def test_rewind_of_a_held_task_makes_its_held_calls_moot(spool: Spool) -> None:
    tools = charge_crashing_once()
    script = [
        reply(tool_use("write_file", path="a.txt", content="one")),
        reply(tool_use("charge", amount=5)),
        reply(text("Done.")),
    ]
    task = scripted_task(spool, script, name="r5")
    with pytest.raises(KeyboardInterrupt):
        run_to_end(task, tools=tools)
    assert run_to_end(task, tools=tools) == "held"
    assert len(held_calls(task)) == 1
    rewind(spool, CONFIG, task.id, 1, yes=True)
    assert held_calls(task) == []
    assert run_to_end(task, tools=tools) == "done"
    assert_paired(load_state(task).messages)


# -- fork -------------------------------------------------------------------------------


def test_fork_runs_both_branches_with_keys_kept_before_and_new_after(spool: Spool) -> None:
    parent = scripted_task(spool, six_turns(), name="p1")
    assert run_to_end(parent) == "done"
    report = fork(spool, CONFIG, "p1", 3, name="f1", prompt="Try another way.")
    child = spool.task(report.task)
    assert child.load_spec().forked_from == {"task": "p1", "turn": 3}
    assert status_row(child)["forked_from"] == {"task": "p1", "turn": 3}
    scene = load_state(child)
    assert scene.turn == 3 and scene.messages[-1]["role"] == "user"
    assert scene.messages[-1]["content"][-1] == {"type": "text", "text": "Try another way."}
    assert run_to_end(child) == "done"
    assert run_to_end(parent) == "done"  # untouched and still whole
    parent_keys, child_keys = live_keys(parent), live_keys(child)
    before = {
        cid
        for cid, _ in list(parent_keys.items())
        if cid.startswith(("toolu_s00000", "toolu_s00001", "toolu_s00002"))
    }
    for cid in before:
        assert child_keys[cid] == parent_keys[cid]
    after = set(child_keys) - before
    assert after and all(child_keys[c] != parent_keys.get(c) for c in after)
    assert_paired(load_state(child).messages)
    rows = history_rows(child)
    assert [r["inherited"] for r in rows] == [True] * 3 + [False] * 3


def test_fork_of_a_fork_and_name_clash(spool: Spool) -> None:
    parent = scripted_task(spool, six_turns(), name="p2")
    assert run_to_end(parent) == "done"
    fork(spool, CONFIG, "p2", 4, name="f2")
    assert run_to_end(spool.task("f2")) == "done"
    fork(spool, CONFIG, "f2", 5, name="f3", prompt="Again.")
    grandchild = spool.task("f3")
    assert load_state(grandchild).turn == 5
    assert run_to_end(grandchild) == "done"
    with pytest.raises(StateConflictError, match="already exists"):
        fork(spool, CONFIG, "p2", 1, name="f2")
    with pytest.raises(UsageError, match="fork point"):
        fork(spool, CONFIG, "f3", 2, name="f4")
    assert not spool.task("f4").path.exists()


# -- version control ----------------------------------------------------------------------


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    path = tmp_path / "repo"
    path.mkdir()
    git(path, "init", "-q")
    (path / "a.txt").write_text("committed")
    (path / "keep.txt").write_text("kept")
    git(path, "add", ".")
    git(path, "commit", "-qm", "init")
    return path


def test_rewind_restores_files_exactly_without_touching_branch_or_index(
    spool: Spool, repo: Path
) -> None:
    task = scripted_task(spool, six_turns(), name="g1", workspace=repo)
    assert run_to_end(task) == "done"
    head, index = git(repo, "rev-parse", "HEAD"), (repo / ".git" / "index").read_bytes()
    assert (repo / "a.txt").read_text() == "two" and (repo / "b.txt").exists()
    rows = history_rows(task)
    assert all(r["vcs"] for r in rows)
    report = rewind(spool, CONFIG, task.id, 1, yes=True, restore_workspace=True)
    assert "restored" in report.workspace
    assert (repo / "a.txt").read_text() == "one"  # an uncommitted change, as after turn 1
    assert not (repo / "b.txt").exists() and not (repo / "log.txt").exists()
    assert not (repo / "outbox").exists()
    assert (repo / "keep.txt").read_text() == "kept"
    assert git(repo, "rev-parse", "HEAD") == head
    assert (repo / ".git" / "index").read_bytes() == index
    assert git(repo, "diff", "--cached") == ""


def test_fork_gets_its_own_worktree_at_the_turn(spool: Spool, repo: Path) -> None:
    task = scripted_task(spool, six_turns(), name="g2", workspace=repo)
    assert run_to_end(task) == "done"
    report = fork(spool, CONFIG, "g2", 2, name="g3")
    assert "own work tree" in report.workspace
    ws = Path(spool.task("g3").load_spec().workspace or "")
    assert (ws / "a.txt").read_text() == "two" and (ws / "b.txt").read_text() == "bee"
    assert not (ws / "log.txt").exists()
    assert (repo / "log.txt").exists()  # the parent's files are untouched


def test_without_git_rewind_and_fork_say_files_were_not_restored(spool: Spool) -> None:
    task = scripted_task(spool, six_turns(), name="n1")
    assert run_to_end(task) == "done"
    assert "not restored" in fork(spool, CONFIG, "n1", 2, name="n2").workspace
    assert "not restored" in rewind(spool, CONFIG, "n1", 2, yes=True).workspace
    with pytest.raises(StateConflictError, match="no workspace snapshot"):
        rewind(spool, CONFIG, "n1", 1, yes=True, restore_workspace=True)


# -- crash safety -------------------------------------------------------------------------


def _scene(task: TaskDir) -> tuple[int, str]:
    state = load_state(task)
    return state.turn, _without_keys(state.messages)


@pytest.mark.parametrize("command", ["rewind", "fork"])
def test_kill_during_rewind_or_fork_leaves_old_or_new_never_a_mix(
    spool: Spool, command: str
) -> None:
    rng = random.Random(7)
    task = scripted_task(spool, six_turns(), name="k1")
    assert run_to_end(task) == "done"
    old = _scene(task)
    cli = [sys.executable, "-m", "supervisor", "--spool", str(spool.root)]
    outcomes = {"old": 0, "new": 0}
    for trial in range(12):
        args = (
            ["rewind", "k1", "--to", "2", "--yes"]
            if command == "rewind"
            else ["fork", "k1", "--at", "2", "--name", f"k-{trial}"]
        )
        proc = subprocess.Popen(
            [*cli, *args], cwd=REPO, env=worker_env(), stderr=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        time.sleep(rng.uniform(0.05, 0.6))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if command == "rewind":
            scene = _scene(task)
            assert scene[0] in (old[0], 2)
            outcomes["new" if scene[0] == 2 else "old"] += 1
            if scene[0] == 2:
                assert run_to_end(task) == "done"  # back to the old scene for the next trial
                assert _scene(task) == old
        else:
            child = spool.task(f"k-{trial}")
            if child.exists():
                outcomes["new"] += 1
                assert load_state(child).turn == 2
                assert_paired(load_state(child).messages)
            else:
                outcomes["old"] += 1
    print(f"\n{command}: kill -9 at random instants, 12 trials: {outcomes}")


def test_a_rewind_killed_after_its_record_leaves_the_task_queued_not_done(
    spool: Spool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by tests/chaos/compound.py: a kill between the journal's rewind record and the
    task record left a rewound task recorded `done`, which the daemon never resumes."""
    task = scripted_task(spool, six_turns(), name="k2")
    assert run_to_end(task) == "done"
    TaskRecord(state=TaskStatus.DONE, reason="end_turn").save(task)  # as the daemon leaves it

    def killed(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt  # the process dies right after the rewind record

    monkeypatch.setattr(FileStore, "put_snapshot", killed)  # the snapshot write that follows
    with pytest.raises(KeyboardInterrupt):
        rewind(spool, CONFIG, "k2", 2, yes=True)
    assert load_state(task).turn == 2  # the new scene...
    assert TaskRecord.load(task).state == "queued"  # ...on a task the daemon resumes


# -- scale ------------------------------------------------------------------------------


def test_rewind_and_fork_of_a_1000_turn_task(
    spool: Spool, capsys: pytest.CaptureFixture[str]
) -> None:
    task = scripted_task(spool, [reply(text("x"))], name="big")
    long_journal(store_of(task), task.id, 1000)
    started = time.perf_counter()
    rewind(spool, CONFIG, "big", 500, yes=True)
    rewind_s = time.perf_counter() - started
    started = time.perf_counter()
    fork(spool, CONFIG, "big", 400, name="big-fork")
    fork_s = time.perf_counter() - started
    assert load_state(task).turn == 500
    assert load_state(spool.task("big-fork")).turn == 400
    with capsys.disabled():
        print(f"\n1,000-turn task: rewind {rewind_s * 1000:.0f} ms, fork {fork_s * 1000:.0f} ms")
