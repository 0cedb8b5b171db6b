"""The operator command line (docs/design.md section 2): exit codes, one-line errors, the JSON
documents, and what works while no daemon runs.

Most cases call ``supervisor.cli.main([...])`` in this process; a few run the installed
``agentd`` as a process, the way an operator does.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from supervisor import cli
from supervisor.record import TaskRecord
from supervisor.status import held_calls, load_state, status_row
from supervisor.submit import PROMPT_FILE_LIMIT, RESULT_FILE_LIMIT, SCRIPT_FILE_LIMIT
from tests.support import DANGLING_FIELDS, REPO, make_loop, reply, scripted_task, text, tool_use
from worker.config import Config
from worker.protocol import TaskStatus
from worker.spool import Spool, TaskDir
from worker.tools.registry import Effect, ToolContext, ToolRegistry, tool

AGENTD = Path(sys.executable).with_name("agentd")

#: The field names of `agentd status --json` (docs/design.md section 3); more may be added.
SUPERVISOR_FIELDS = {
    "running",
    "pid",
    "started_at",
    "version",
    "spool",
    "node",
    "sandbox",
    "cgroups",
}
TASK_FIELDS = {
    "id",
    "state",
    "pid",
    "turn",
    "restarts",
    "last_exit",
    "heartbeat_age",
    "phase",
    "usage",
    "dangling",
    "reason",
    "workspace",
    "updated_at",
}


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("AGENTD_SPOOL", "AGENTD_CONFIG", "STATE_DIRECTORY"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def spool(tmp_path: Path) -> Spool:
    return Spool(tmp_path / "spool")


class Run:
    """``agentd --spool SPOOL ARGS`` in this process."""

    def __init__(self, spool: Spool, capsys: pytest.CaptureFixture[str]) -> None:
        self.spool = spool
        self.capsys = capsys

    def __call__(self, *args: str, spool: bool = True) -> tuple[int, str, str]:
        self.capsys.readouterr()
        argv = ["--spool", str(self.spool.root), *args] if spool else list(args)
        code = cli.main(argv)
        out, err = self.capsys.readouterr()
        return code, out, err


@pytest.fixture
def agentd(spool: Spool, capsys: pytest.CaptureFixture[str]) -> Run:
    return Run(spool, capsys)


def assert_error(result: tuple[int, str, str], code: int, *words: str) -> str:
    """An expected error: the exit code, nothing on stdout, one line on stderr that says
    what is wrong (``words``), and no traceback."""
    got, out, err = result
    assert got == code, result
    assert out == "", result
    assert err.startswith("agentd: "), result
    assert err.endswith("\n") and err.count("\n") == 1, f"not one line: {err!r}"
    assert "Traceback" not in err
    for word in words:
        assert word in err, (word, err)
    return err


def tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")) if root.exists() else []


def submit(agentd: Run, *args: str) -> str:
    code, out, err = agentd("submit", "--prompt", "Do the thing.", *args)
    assert (code, err) == (0, ""), err
    return out.strip()


def set_state(task: TaskDir, state: str, reason: str | None = None) -> None:
    """What the daemon records when a worker ends (no daemon runs in these tests)."""
    record = TaskRecord.load(task)
    record.state, record.reason = TaskStatus(state), reason
    record.save(task)


# -- usage errors: exit 2 -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["status", "--bogus"], ["unrecognized arguments: --bogus"]),
        (["--bogus", "status"], ["--bogus"]),
        ([], ["command"]),
        (["frobnicate"], ["frobnicate"]),
        (["submit", "--prompt", "x", "--max-turns", "abc"], ["--max-turns", "abc"]),
        (["submit", "--prompt", "x", "--max-turns", "0"], ["--max-turns"]),
        (["submit", "--prompt", "x", "--max-turns", "-3"], ["--max-turns"]),
        (["submit", "--prompt", "x", "--prompt-file", "p.txt"], ["exactly one"]),
        (["submit"], ["exactly one"]),
        (["submit", "--prompt", "   "], ["empty"]),
        (["submit", "--prompt-file", "/nonexistent/prompt.txt"], ["--prompt-file"]),
        (["submit", "--prompt", "x", "--tools", "read_file,teleport"], ["teleport"]),
        (["submit", "--prompt", "x", "--script", "/nonexistent/script.json"], ["script"]),
        (["submit", "--prompt", "x", "--model", "scripted"], ["--script"]),
        (["status", "--json", "--watch", "extra", "more"], ["unrecognized"]),
        (["rewind", "t1"], ["--to"]),
    ],
)
def test_usage_errors_exit_2_with_one_line(
    agentd: Run, spool: Spool, args: list[str], words: list[str]
) -> None:
    assert_error(agentd(*args), 2, *words)
    assert tree(spool.root / "tasks") == []


BAD_IDS = ["..", ".", "a/b", "A", "x" * 65, "a\0b", "", "-a", "a b", "../escape", "é"]


@pytest.mark.parametrize("bad", BAD_IDS, ids=repr)
def test_bad_task_ids_are_refused_before_touching_the_filesystem(
    agentd: Run, spool: Spool, tmp_path: Path, bad: str
) -> None:
    spool.ensure()
    before = tree(tmp_path)
    assert_error(agentd("submit", "--prompt", "x", f"--name={bad}"), 2, "invalid task id")
    commands = ["cancel", "logs", "retry", "history"] + (["status", "dangling"] if bad else [])
    for command in commands:
        assert_error(agentd(command, "--", bad), 2, "invalid task id")
    assert tree(tmp_path) == before  # not even a task folder was made


def test_long_values_are_cut_in_error_lines(agentd: Run, spool: Spool, tmp_path: Path) -> None:
    spool.ensure()
    long = "n" * 5000
    err = assert_error(
        agentd("--store", "postgresql://agentd@127.0.0.1:9/agentd", "--node", long, "status"),
        2,
        f"--node {'n' * 80!r}... (5000 characters) is not a name",
    )
    assert len(err) < 300, err
    err = assert_error(
        agentd("status", "--", "!" * 5000), 2, "invalid task id", "(5000 characters)"
    )
    assert len(err) < 300, err
    err = assert_error(agentd("--config", str(tmp_path / ("d" * 3000)), "status"), 78)
    assert len(err) <= cli.ERROR_LINE_LIMIT + len("agentd: \n") and "characters in all" in err


@pytest.mark.parametrize("command", ["status", "dangling"])
def test_an_empty_task_id_is_refused_by_status_and_dangling(agentd: Run, command: str) -> None:
    submit(agentd, "--name", "t1")
    assert_error(agentd(command, ""), 2, "invalid task id")


def test_the_longest_allowed_id_is_accepted(agentd: Run) -> None:
    name = "a" + "b" * 63
    assert submit(agentd, "--name", name) == name


def test_a_bad_call_id_is_a_usage_error(agentd: Run, spool: Spool) -> None:
    task_id = submit(agentd, "--name", "t1")
    for bad in ("a/b", "..", "x" * 129, "a b"):
        assert_error(agentd("approve-dangling", task_id, bad), 2, "invalid call id")
    assert not spool.task(task_id).decisions.exists()


# -- no such task, wrong state: exit 3 ----------------------------------------------------


@pytest.mark.parametrize(
    "command",
    [
        ["status", "nope"],
        ["logs", "nope"],
        ["cancel", "nope"],
        ["retry", "nope"],
        ["dangling", "nope"],
        ["history", "nope"],
        ["approve-dangling", "nope", "toolu_1"],
        ["approve-dangling", "nope", "--all"],
    ],
)
def test_an_unknown_task_exits_3(agentd: Run, command: list[str]) -> None:
    submit(agentd, "--name", "other")
    assert_error(agentd(*command), 3, "no task 'nope'", "agentd status")


def test_retry_of_a_task_that_did_not_fail_exits_3(agentd: Run, spool: Spool) -> None:
    task_id = submit(agentd, "--name", "fine")
    for state in ("queued", "done", "cancelled", "held"):
        set_state(spool.task(task_id), state)
        words = ["was cancelled"] if state == "cancelled" else [f"is {state}", "only a failed"]
        err = assert_error(agentd("retry", task_id), 3, *words)
        assert TaskRecord.load(spool.task(task_id)).state == state, err


def test_retry_of_a_failed_task_queues_it_with_a_fresh_budget(agentd: Run, spool: Spool) -> None:
    task = spool.task(submit(agentd, "--name", "broken"))
    record = TaskRecord.load(task)
    record.state, record.reason, record.crashes = TaskStatus.FAILED, "crash_loop", [{"turn": 2}] * 5
    record.save(task)
    code, out, err = agentd("retry", task.id)
    assert (code, err) == (0, "")
    assert out == f"{task.id}: queued for retry\n"
    record = TaskRecord.load(task)
    assert (record.state, record.reason, record.crashes) == ("queued", None, [])


def test_cancel_of_a_finished_task_exits_3_and_changes_nothing(agentd: Run, spool: Spool) -> None:
    task = spool.task(submit(agentd, "--name", "finished"))
    for state in ("done", "failed", "cancelled"):
        set_state(task, state, reason="end_turn")
        before = task.state.read_bytes()
        assert_error(agentd("cancel", task.id), 3, f"already {state}")
        assert task.state.read_bytes() == before


def test_cancel_with_the_daemon_down_cancels_at_once(agentd: Run, spool: Spool) -> None:
    task_id = submit(agentd, "--name", "unwanted")
    code, out, err = agentd("cancel", task_id)
    assert (code, out, err) == (0, f"{task_id}: cancelled\n", "")
    row = status_row(spool.task(task_id))
    assert (row["state"], row["reason"]) == ("cancelled", "cancelled by operator")
    assert_error(agentd("cancel", task_id), 3, "already cancelled")


def test_submitting_a_name_twice_exits_3(agentd: Run) -> None:
    submit(agentd, "--name", "twin")
    assert_error(agentd("submit", "--prompt", "x", "--name", "twin"), 3, "already exists")


@pytest.mark.parametrize(
    ("where", "words"),
    [
        ("{spool}", ("is the spool",)),
        ("{spool}/tasks", ("is in the spool",)),
        ("{spool}/tasks/victim/workspace", ("is in the spool",)),  # another task's
        ("{spool}/tasks/victim", ("is in the spool",)),
        ("{spool}/../link", ("is the spool",)),  # a symlink to it
        ("{spool}/..", ("holds the spool",)),
    ],
)
def test_a_workspace_that_would_expose_the_spool_exits_2(
    agentd: Run, spool: Spool, where: str, words: tuple[str, ...]
) -> None:
    submit(agentd, "--name", "victim")
    (spool.root.parent / "link").symlink_to(spool.root)
    workspace = where.format(spool=spool.root)
    before = tree(spool.root)
    err = assert_error(
        agentd("submit", "--prompt", "x", "--name", "t2", "--workspace", workspace), 2, *words
    )
    assert str(spool.root) in err and "such as" in err  # names the spool, offers a folder
    assert tree(spool.root) == before  # nothing written
    # the task's own default workspace, named, is its own (the one a shared store names)
    own = spool.task("t3").path / "workspace"
    assert submit(agentd, "--name", "t3", "--workspace", str(own)) == "t3"


def test_submit_workspace_dot_in_the_home_of_the_default_spool_exits_2(tmp_path: Path) -> None:
    """The README's first example run where it must not be: the home folder, which holds
    the default spool (~/.local/state/agentd)."""
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AGENTD_", "XDG_"))}
    env.pop("STATE_DIRECTORY", None)

    def submit_in_home(workspace: str) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", "supervisor", "submit", "--prompt", "x"]
        return subprocess.run(
            [*argv, "--workspace", workspace],
            cwd=home,
            env={**env, "HOME": str(home), "PYTHONPATH": str(REPO)},
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    done = submit_in_home(".")
    spool = home / ".local" / "state" / "agentd"
    assert done.returncode == 2, done
    assert done.stderr.count("\n") == 1 and f"holds the spool {spool}" in done.stderr
    assert f"such as {home}/work" in done.stderr
    assert not (spool / "tasks").exists() or not list((spool / "tasks").iterdir())
    (home / "work").mkdir()
    assert submit_in_home("work").returncode == 0


# -- configuration errors: exit 78 --------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("max_workers = 0\n", "max_workers"),
        ('max_workers = "many"\n', "max_workers"),
        ("[heartbeat]\ninterval = 5.0\ntimeout = 1.0\n", "heartbeat.timeout"),
        ("[heartbeat]\ninterval = -1\n", "heartbeat.interval"),
        ("[restart]\nbackof_max = 3\n", "backof_max"),
        ("[deadlines]\ntool_call = true\n", "deadlines.tool_call"),
        ('[tools.policy]\nrun_command = "sometimes"\n', "run_command"),
        ("[tools]\nmodules = [3]\n", "tools.modules"),
        ("max_workers = \n", "not valid TOML"),
        ("colour = 'blue'\n", "colour"),
    ],
)
def test_a_bad_config_file_exits_78_naming_the_key(
    agentd: Run, tmp_path: Path, text: str, key: str
) -> None:
    config = tmp_path / "agentd.toml"
    config.write_text(text)
    for command in (["config", "check"], ["status"], ["submit", "--prompt", "x"]):
        assert_error(agentd("--config", str(config), *command), 78, key, str(config))
    assert tree(tmp_path / "spool") == []


def test_a_missing_config_file_exits_78(agentd: Run, tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    assert_error(agentd("--config", str(missing), "config", "check"), 78, str(missing), "init")


def test_init_then_config_check(agentd: Run, tmp_path: Path) -> None:
    path = tmp_path / "etc" / "agentd.toml"
    code, out, err = agentd("init", str(path))
    assert (code, out, err) == (0, f"wrote {path}\n", "")
    assert "max_workers" in path.read_text()
    code, out, err = agentd("--config", str(path), "config", "check")
    assert (code, err) == (0, "")
    assert out.startswith(f"{path}: ok")
    # a second init does not overwrite what an operator may have edited
    path.write_text(path.read_text() + "\n# mine\n")
    assert_error(agentd("init", str(path)), 1, "exists", "--force")
    assert path.read_text().endswith("# mine\n")
    assert agentd("init", str(path), "--force")[0] == 0
    assert not path.read_text().endswith("# mine\n")


def test_config_check_without_a_file_reports_the_defaults(agentd: Run) -> None:
    code, out, err = agentd("config", "check")
    assert (code, err) == (0, "")
    assert out.startswith("built-in defaults: ok")


# -- the daemon is down ---------------------------------------------------------------------


def test_submit_works_with_the_daemon_down(agentd: Run, spool: Spool, tmp_path: Path) -> None:
    script = tmp_path / "script.json"
    script.write_text(json.dumps({"responses": [reply(text("Hi."))]}))
    task_id = submit(agentd, "--script", str(script), "--max-turns", "5")
    assert task_id.startswith("t-")  # a generated id
    task = spool.task(task_id)
    assert task.exists() and task.script.read_bytes() == script.read_bytes()
    code, out, err = agentd("status")
    assert (code, err) == (0, "")
    assert out.splitlines()[0] == (
        f"agentd is not running on {spool.root} (tasks wait until `agentd start`)"
    )
    assert task_id in out and "queued" in out
    code, out, _ = agentd("status", "--json")
    doc = json.loads(out)
    assert doc["supervisor"]["running"] is False
    assert doc["supervisor"]["pid"] is None
    (row,) = doc["tasks"]
    assert (row["id"], row["state"], row["turn"], row["pid"]) == (task_id, "queued", 0, None)
    # the spool is private, whatever the umask
    assert spool.root.stat().st_mode & 0o777 == 0o700
    assert task.spec.stat().st_mode & 0o777 == 0o600


def test_status_json_has_the_documented_field_names(agentd: Run, spool: Spool) -> None:
    submit(agentd, "--name", "t1")
    submit(agentd, "--name", "t2", "--workspace", str(spool.root.parent / "ws"))
    code, out, err = agentd("status", "--json")
    assert (code, err) == (0, "")
    doc = json.loads(out)
    assert set(doc) == {"supervisor", "tasks"}
    assert set(doc["supervisor"]) == SUPERVISOR_FIELDS
    assert doc["supervisor"]["spool"] == str(spool.root)
    assert isinstance(doc["supervisor"]["version"], str)
    assert [t["id"] for t in doc["tasks"]] == ["t1", "t2"]
    for row in doc["tasks"]:
        assert set(row) >= TASK_FIELDS, TASK_FIELDS - set(row)
        assert set(row["usage"]) == {"input_tokens", "output_tokens"}
        assert row["dangling"] == [] and row["last_exit"] is None
        assert row["updated_at"].endswith("Z")
    assert doc["tasks"][0]["workspace"] == str(spool.task("t1").path / "workspace")
    assert doc["tasks"][1]["workspace"] == str(spool.root.parent / "ws")
    code, out, _ = agentd("status", "t2", "--json")
    assert [t["id"] for t in json.loads(out)["tasks"]] == ["t2"]


def test_status_of_an_empty_spool(agentd: Run, spool: Spool) -> None:
    spool.ensure()
    before = tree(spool.root)
    code, out, err = agentd("status")
    assert (code, err) == (0, "")
    assert "no tasks" in out
    assert json.loads(agentd("status", "--json")[1])["tasks"] == []
    assert tree(spool.root) == before  # looking does not create anything


def test_stop_with_the_daemon_down_is_not_an_error(agentd: Run, spool: Spool) -> None:
    spool.ensure()
    assert agentd("stop") == (0, f"agentd is not running on {spool.root}\n", "")


# -- held calls without a daemon ------------------------------------------------------------


class WorkerDied(BaseException):
    """Stands for kill -9 in the middle of a tool call (the intent is recorded)."""


@tool(name="run_command", effect=Effect.UNSAFE)
def dying_run_command(ctx: ToolContext, command: str, timeout: float = 60.0) -> str:
    """run_command whose worker dies while it runs."""
    raise WorkerDied


@pytest.fixture
def held(spool: Spool, agentd: Run) -> Iterator[tuple[TaskDir, str]]:
    """A task held on a dangling run_command, recorded as the daemon records it."""
    task = scripted_task(
        spool,
        [
            reply(tool_use("run_command", command="charge --card 4242", timeout=30)),
            reply(text("Charged.")),
        ],
        name="held-task",
    )
    dying = ToolRegistry.standard()
    dying.add(dying_run_command)
    loop = make_loop(task, tools=dying)
    with pytest.raises(WorkerDied):
        loop.run()
    loop.close()
    loop = make_loop(task)
    outcome = loop.run()
    loop.close()
    assert outcome.state == "held"
    set_state(task, "held", outcome.reason)
    (call_id,) = load_state(task).calls
    yield task, call_id


def test_dangling_json_lists_held_calls_with_the_documented_fields(
    agentd: Run, held: tuple[TaskDir, str]
) -> None:
    task, call_id = held
    submit(agentd, "--name", "not-held")
    code, out, err = agentd("dangling", "--json")
    assert (code, err) == (0, "")
    (row,) = json.loads(out)
    assert set(row) >= DANGLING_FIELDS
    assert row["task"] == task.id and row["call_id"] == call_id
    assert row["tool"] == "run_command" and row["effect"] == "unsafe"
    assert row["input"] == {"command": "charge --card 4242", "timeout": 30}
    assert row["idempotency_key"].startswith("agentd-")
    assert (row["stage"], row["attempt"]) == ("unknown", 1)
    canonical = b'{"command":"charge --card 4242","timeout":30}'  # RFC 8785
    assert row["input_sha256"] == hashlib.sha256(canonical).hexdigest()
    assert row["started_at"].endswith("Z")
    assert json.loads(agentd("dangling", task.id, "--json")[1]) == [row]
    assert json.loads(agentd("dangling", "not-held", "--json")[1]) == []
    code, out, _ = agentd("dangling")
    assert f"agentd approve-dangling {task.id} {call_id}" in out
    status: dict[str, Any] = json.loads(agentd("status", task.id, "--json")[1])["tasks"][0]
    assert status["state"] == "held" and [d["call_id"] for d in status["dangling"]] == [call_id]


def test_approve_dangling_with_the_daemon_down_is_durable_and_queues_the_task(
    agentd: Run, held: tuple[TaskDir, str], tmp_path: Path
) -> None:
    task, call_id = held
    journal = task.journal.read_bytes()
    code, out, err = agentd("approve-dangling", task.id, call_id, "--skip", "--reason", "no")
    assert (code, out, err) == (0, f"{task.id} {call_id} attempt 1: skip\n", "")
    (decision_file,) = task.decisions.iterdir()
    decision = json.loads(decision_file.read_text())
    assert (decision["call_id"], decision["action"], decision["reason"]) == (call_id, "skip", "no")
    assert TaskRecord.load(task).state == "queued"  # resumes at the next start
    assert task.journal.read_bytes() == journal  # the worker applies it, not the CLI
    # the call is decided: a second decision is refused and changes nothing
    err = assert_error(agentd("approve-dangling", task.id, call_id), 3, call_id)
    assert "already decided" in err or "no held call" in err
    assert json.loads(decision_file.read_text()) == decision


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ([], ["CALL_ID or --all"]),
        (["CALL", "--all"], ["CALL_ID or --all"]),
        (["CALL", "--skip", "--result", "x"], ["--skip"]),
        (["CALL", "--result", "x", "--result-file", "f"], ["--result-file"]),
        (["CALL", "--reason", "why"], ["--reason"]),
        (["CALL", "--result-file", "/nonexistent/result.txt"], ["--result-file"]),
    ],
)
def test_approve_dangling_usage_errors_exit_2_and_decide_nothing(
    agentd: Run, held: tuple[TaskDir, str], extra: list[str], words: list[str]
) -> None:
    task, call_id = held
    args = [call_id if a == "CALL" else a for a in extra]
    assert_error(agentd("approve-dangling", task.id, *args), 2, *words)
    assert not task.decisions.exists() or list(task.decisions.iterdir()) == []
    assert TaskRecord.load(task).state == "held"


def test_approve_dangling_of_a_call_that_is_not_held_exits_3(
    agentd: Run, held: tuple[TaskDir, str]
) -> None:
    task, _ = held
    assert_error(agentd("approve-dangling", task.id, "toolu_other"), 3, "no held call")
    other = submit(agentd, "--name", "calm")
    assert_error(agentd("approve-dangling", other, "--all"), 3, "no held calls")


def test_a_cancel_with_the_daemon_down_is_final(
    agentd: Run, held: tuple[TaskDir, str], spool: Spool
) -> None:
    task, call_id = held
    code, out, err = agentd("cancel", task.id)
    assert (code, out, err) == (0, f"{task.id}: cancelled\n", "")
    assert task.cancellation.exists()  # durable at once, for every later command
    journal, record = task.journal.read_bytes(), task.state.read_bytes()
    for args in (
        ["approve-dangling", task.id, "--all"],
        ["approve-dangling", task.id, call_id, "--skip"],
        ["rewind", task.id, "--to", "0", "--yes"],
        ["retry", task.id],
    ):
        assert_error(agentd(*args), 3, "was cancelled")
    assert_error(agentd("cancel", task.id), 3, "already cancelled")
    assert task.journal.read_bytes() == journal and task.state.read_bytes() == record
    assert not task.decisions.exists() or list(task.decisions.iterdir()) == []
    # even a decision file that reached the folder anyway is never carried out
    row = held_calls(task)[0]
    task.decisions.mkdir(mode=0o700, exist_ok=True)
    decision = {"call_id": call_id, "attempt": row["attempt"], "action": "rerun"}
    task.decision_file(row["idempotency_key"], row["attempt"]).write_text(json.dumps(decision))
    loop = make_loop(task)
    assert loop.run().state == "held"
    loop.close()
    state = load_state(task)
    assert state.calls[call_id].attempt == row["attempt"] and state.calls[call_id].result is None


def test_a_decided_call_wins_over_a_later_cancel(agentd: Run, held: tuple[TaskDir, str]) -> None:
    task, call_id = held
    assert agentd("approve-dangling", task.id, call_id, "--skip")[0] == 0
    record = task.state.read_bytes()
    assert_error(agentd("cancel", task.id), 3, "already decided", call_id)
    assert not task.cancellation.exists() and task.state.read_bytes() == record


@pytest.mark.parametrize(
    ("option", "limit"),
    [
        ("--prompt-file", PROMPT_FILE_LIMIT),
        ("--script", SCRIPT_FILE_LIMIT),
        ("--result-file", RESULT_FILE_LIMIT),
    ],
)
def test_every_file_the_cli_reads_has_a_size_cap(
    agentd: Run, held: tuple[TaskDir, str], tmp_path: Path, option: str, limit: int
) -> None:
    task, call_id = held
    big = tmp_path / "big"
    big.write_bytes(b"x" * (limit + 1))
    missing = str(tmp_path / "missing.txt")
    if option == "--result-file":
        command = ["approve-dangling", task.id, call_id, "--result-file"]
    else:
        command = ["submit", "--name", "capped", "--prompt", "x", option]
        if option == "--prompt-file":
            command.remove("--prompt")
            command.remove("x")
    assert_error(agentd(*command, str(big)), 2, option, str(big), "larger than")
    assert_error(agentd(*command, "/dev/zero"), 2, option, "a character device, not a regular")
    err = assert_error(agentd(*command, missing), 2, option, missing, "no such file")
    assert "Errno" not in err
    assert not task.decisions.exists() and not agentd.spool.task("capped").exists()
    if option == "--prompt-file":  # a file of exactly the cap is taken
        big.write_bytes(b"y" * limit)
        assert agentd(*command, str(big))[0] == 0


def test_a_config_file_over_its_cap_exits_78_in_one_line(agentd: Run, tmp_path: Path) -> None:
    big = tmp_path / "big.toml"
    big.write_text("# " + "x" * 1024 * 1024 + "\n")
    assert_error(agentd("--config", str(big), "status"), 78, str(big), "larger than")
    assert_error(agentd("--config", "/dev/zero", "status"), 78, "not a regular file")


# -- OS-level failures: one line, never a traceback -------------------------------------------


def test_status_on_a_spool_that_is_a_file_is_a_one_line_error(agentd: Run, tmp_path: Path) -> None:
    spool_file = tmp_path / "not-a-folder"
    spool_file.write_text("")
    assert_error(agentd("--spool", str(spool_file), "status", spool=False), 1, str(spool_file))


def test_submit_to_a_spool_that_cannot_be_made_is_a_one_line_error(
    agentd: Run, tmp_path: Path
) -> None:
    spool_file = tmp_path / "not-a-folder"
    spool_file.write_text("")
    args = ["--spool", str(spool_file / "spool"), "submit", "--prompt", "x"]
    assert_error(agentd(*args, spool=False), 1, str(spool_file))


def test_init_onto_a_folder_is_a_one_line_error(agentd: Run, tmp_path: Path) -> None:
    assert_error(agentd("init", str(tmp_path), "--force"), 1, str(tmp_path))


# -- as a process -----------------------------------------------------------------------------


def run_agentd(
    *args: str, env: dict[str, str] | None = None, timeout: float = 30
) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("AGENTD_")}
    base.pop("STATE_DIRECTORY", None)
    return subprocess.run(
        [str(AGENTD), *args],
        cwd=REPO,
        env={**base, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_the_installed_command_exit_codes_and_one_line_errors(tmp_path: Path) -> None:
    spool = str(tmp_path / "spool")
    bad_config = tmp_path / "bad.toml"
    bad_config.write_text("[restart]\ncrash_loop_limit = 0\n")
    cases = [
        (["--spool", spool, "status", "--bogus"], 2, "--bogus"),
        (["--spool", spool, "submit", "--prompt", "x", "--name", "a/b"], 2, "invalid task id"),
        (["--spool", spool, "status", "nope"], 1, f"no spool at {spool} (named by --spool)"),
        (["--spool", spool, "--config", str(bad_config), "status"], 78, "crash_loop_limit"),
    ]
    for args, code, words in cases:
        done = run_agentd(*args)
        assert done.returncode == code, (args, done)
        assert done.stdout == ""
        assert done.stderr.count("\n") == 1 and words in done.stderr, done.stderr
        assert "Traceback" not in done.stderr
    assert not Path(spool).exists()
    Spool(Path(spool)).ensure()
    done = run_agentd("--spool", spool, "status", "nope")
    assert (done.returncode, done.stdout) == (3, "") and "no task 'nope'" in done.stderr


def test_the_installed_command_submits_and_reports_with_the_daemon_down(tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    env = {"AGENTD_SPOOL": str(spool)}  # the environment names the spool
    done = run_agentd("submit", "--prompt", "Summarize.", "--name", "report", env=env)
    assert (done.returncode, done.stdout, done.stderr) == (0, "report\n", "")
    done = run_agentd("status", "--json", env=env)
    doc = json.loads(done.stdout)
    assert doc["supervisor"]["running"] is False and doc["supervisor"]["spool"] == str(spool)
    assert [(t["id"], t["state"]) for t in doc["tasks"]] == [("report", "queued")]
    assert run_agentd("--version").stdout.startswith("agentd ")


def test_the_spool_comes_from_the_config_when_not_given(tmp_path: Path, capsys: Any) -> None:
    config = tmp_path / "agentd.toml"
    config.write_text(f'spool = "{tmp_path / "from-config"}"\n')
    assert cli.main(["--config", str(config), "submit", "--prompt", "x", "--name", "c1"]) == 0
    assert Spool(tmp_path / "from-config").task("c1").exists()
    assert Config().spool is None


def test_a_command_reads_no_secret_but_the_store_url(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Only the daemon reads the API key; a command looks for the store's URL alone, so
    a key file it could not read is no reason for `status` to fail."""
    monkeypatch.setenv("ANTHROPIC_API_KEY_FILE", str(tmp_path / "missing"))
    monkeypatch.delenv("AGENTD_STORE", raising=False)
    assert cli.main(["--spool", str(tmp_path / "spool"), "submit", "--prompt", "hi"]) == 0
    task_id = capsys.readouterr().out.strip()
    assert cli.main(["--spool", str(tmp_path / "spool"), "status", "--json"]) == 0
    assert [t["id"] for t in json.loads(capsys.readouterr().out)["tasks"]] == [task_id]
