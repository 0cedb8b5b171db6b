"""``agentd logs`` and ``agentd status`` as a person meets them: real CLI processes against
a real daemon (``tests.daemon.Daemon``), and ``status --watch`` on a real terminal (tmux).

Every wait is a deadline poll; every process a test starts is ended in teardown.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import pytest

from supervisor.record import TaskRecord
from supervisor.views import END_GRACE, human_cost, human_count, log_line, render_status
from tests.daemon import Daemon
from tests.support import REPO, Terminal, poll_for, reply, text, tool_use, worker_env

CONFIG = (
    "max_workers = 4\n"
    "[heartbeat]\ninterval = 0.2\ntimeout = 5.0\n"
    "[restart]\nbackoff_initial = 0.1\nbackoff_max = 0.4\n"
)

pytestmark = pytest.mark.usefixtures("subreaper")
TURNS = 20
LONG_FLOAT = re.compile(r"\d\.\d{4,}")
LONG_REASON = "the operator stopped this task because " + "it kept asking for more " * 8


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    daemon = Daemon(tmp_path_factory.mktemp("logs"), CONFIG)
    try:
        daemon.start()
        yield daemon
    finally:
        daemon.cleanup()


def twenty_turns(delay: float = 0.0) -> list[dict[str, Any]]:
    """19 turns that each write a file and read a missing one, then an answer: 20 turns."""
    responses = [
        reply(
            text(f"Step {i}."),
            tool_use("write_file", path=f"step{i}.txt", content=f"step {i}"),
            tool_use("read_file", path="missing.txt"),
            delay=delay,
        )
        for i in range(1, TURNS)
    ]
    return [*responses, reply(text("All done."), delay=delay)]


@pytest.fixture(scope="module")
def finished(daemon: Daemon) -> str:
    """A 20-turn task, done."""
    task_id = daemon.submit(twenty_turns(), name="twenty")
    daemon.wait_state(task_id, "done", timeout=60)
    return task_id


def lines(done: subprocess.CompletedProcess[str]) -> list[str]:
    assert (done.returncode, done.stderr) == (0, ""), done
    return done.stdout.splitlines()


# -- logs -------------------------------------------------------------------------------


def test_logs_prints_a_line_per_turn_with_its_tools_outcomes_and_tokens(
    daemon: Daemon, finished: str
) -> None:
    out = lines(daemon.run_cli("logs", finished))
    turns = [line for line in out if " turn turn=" in line]
    assert len(turns) == TURNS, out
    for n, line in enumerate(turns, start=1):
        assert f" turn turn={n} " in line and "input_tokens=" in line and "output_tokens=" in line
        if n < TURNS:
            assert "tools=write_file:ran,read_file:" in line, line
            assert "stop_reason=tool_use" in line, line
        else:
            assert "tools=" not in line and "stop_reason=end_turn" in line, line
    names = [line.split()[2] for line in out]
    assert names.index("task_submitted") < names.index("turn") < names.index("task_done")
    assert names[-1] == "task_done", out[-3:]
    assert "reason=end_turn" in out[-1]
    stamps = [line.split()[0] for line in out]
    assert stamps == sorted(stamps), "the lines are in time order"


def test_logs_has_no_python_reprs_and_no_long_floats(daemon: Daemon, finished: str) -> None:
    text_out = daemon.run_cli("logs", finished).stdout
    assert "None" not in text_out and "True" not in text_out and "{'" not in text_out
    assert not LONG_FLOAT.search(text_out), LONG_FLOAT.search(text_out)
    # the worker's exit: a null exit code is left out, not shown as code=None
    exited = [line for line in text_out.splitlines() if " worker_exited " in line]
    assert exited and all("code=" in line for line in exited), exited


def test_logs_n_prints_exactly_the_last_n_lines(daemon: Daemon, finished: str) -> None:
    everything = lines(daemon.run_cli("logs", finished))
    assert len(everything) > TURNS
    assert lines(daemon.run_cli("logs", finished, "-n", "3")) == everything[-3:]
    assert lines(daemon.run_cli("logs", finished, "--lines", "1")) == everything[-1:]
    assert lines(daemon.run_cli("logs", finished, "-n", "0")) == []
    assert daemon.run_cli("logs", finished, "-n", "-1").returncode == 2


def test_logs_json_is_one_object_a_line_with_the_events_as_stored(
    daemon: Daemon, finished: str
) -> None:
    out = lines(daemon.run_cli("logs", finished, "--json"))
    parsed = [json.loads(line) for line in out]
    assert all(isinstance(p, dict) and "event" in p for p in parsed)
    assert [p for p in parsed if p["event"] != "turn"] == daemon.events(finished)
    turns = [p for p in parsed if p["event"] == "turn"]
    assert [t["turn"] for t in turns] == list(range(1, TURNS + 1))
    assert [c["tool"] for c in turns[0]["tool_calls"]] == ["write_file", "read_file"]
    assert turns[0]["tool_calls"][0]["outcome"] == "ran"
    assert lines(daemon.run_cli("logs", finished, "--json", "-n", "2")) == out[-2:]


def test_a_tool_call_that_returned_an_error_shows_as_error(daemon: Daemon) -> None:
    responses = [
        reply(tool_use("read_file", path="no-such-file"), tool_use("list_dir", path=".")),
        reply(text("Done.")),
    ]
    task_id = daemon.submit(responses, name="erred")
    daemon.wait_state(task_id, "done")
    (line,) = [line for line in lines(daemon.run_cli("logs", task_id)) if " turn turn=1 " in line]
    assert "tools=read_file:error,list_dir:ran" in line, line
    turn = next(
        json.loads(line)
        for line in lines(daemon.run_cli("logs", task_id, "--json"))
        if json.loads(line)["event"] == "turn"
    )
    calls = [(c["tool"], c["outcome"], c["is_error"]) for c in turn["tool_calls"]]
    assert calls == [("read_file", "ran", True), ("list_dir", "ran", False)]
    (row,) = [line for line in lines(daemon.run_cli("history", task_id)) if "read_file" in line]
    assert "read_file(read_only: error), list_dir(read_only: ran)" in row, row
    (first, _) = json.loads(daemon.run_cli("history", task_id, "--json").stdout)
    history = [(c["tool"], c["outcome"], c["is_error"]) for c in first["tool_calls"]]
    assert history == calls


def follow(daemon: Daemon, task_id: str) -> subprocess.Popen[str]:
    """``agentd logs TASK --follow`` as its own process, its output captured."""
    return subprocess.Popen(
        daemon.command("logs", task_id, "--follow"),
        cwd=REPO,
        env=worker_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_logs_follow_returns_by_itself_when_the_task_ends(daemon: Daemon) -> None:
    task_id = daemon.submit(twenty_turns(delay=0.1)[-6:], name="followed")
    with follow(daemon, task_id) as proc:
        try:
            daemon.wait_state(task_id, "running", "done", timeout=30)
            assert proc.poll() is None or daemon.row(task_id)["state"] == "done"
            out, err = proc.communicate(timeout=30)
        finally:
            proc.kill()
    assert (proc.returncode, err) == (0, "")
    names = [line.split()[2] for line in out.splitlines()]
    assert names.count("turn") == 6 and names[-1] == "task_done", out


#: An unsafe call killed mid-way the first time (so the task holds), quick when re-run.
CHARGE = "if [ -e charged ]; then echo second run; else touch charged; exec sleep 30; fi"


def test_logs_follow_keeps_going_while_held_and_ends_after_the_decision(daemon: Daemon) -> None:
    task_id = daemon.submit(
        [
            reply(text("Charging."), tool_use("run_command", command=CHARGE, timeout=60)),
            reply(text("Charged.")),
        ],
        name="charge",
    )
    charged = daemon.task(task_id).path / "workspace" / "charged"
    row = daemon.wait_row(
        task_id,
        lambda r: r["phase"] == "tool:run_command" and charged.exists(),
        what="the charge to be under way",
    )
    os.kill(row["pid"], signal.SIGKILL)
    assert daemon.wait_state(task_id, "held", "done", "failed")["state"] == "held"
    with follow(daemon, task_id) as proc:
        try:
            with pytest.raises(subprocess.TimeoutExpired):
                proc.wait(timeout=END_GRACE + 1)  # held is not an end state
            decided = daemon.run_cli("approve-dangling", task_id, "--all", "--rerun")
            assert decided.returncode == 0, decided
            out, err = proc.communicate(timeout=30)
        finally:
            proc.kill()
    assert (proc.returncode, err) == (0, "")
    out_lines = out.splitlines()
    names = [line.split()[2] for line in out_lines]
    assert names.index("dangling_held") < names.index("dangling_decided") < len(names) - 1
    assert names[-1] == "task_done", out
    first_turn = next(line for line in out_lines if " turn turn=1 " in line)
    assert "tools=run_command:rerun" in first_turn, first_turn


def test_logs_follow_of_a_finished_task_returns_at_once(daemon: Daemon, finished: str) -> None:
    start = time.monotonic()
    out = lines(daemon.run_cli("logs", finished, "-f", "-n", "1"))
    assert len(out) == 1 and " task_done " in out[0]
    assert time.monotonic() - start < 10


# -- status -----------------------------------------------------------------------------


def status_env(**extra: str) -> dict[str, str]:
    env = worker_env(extra)
    if "COLUMNS" not in extra:
        env.pop("COLUMNS", None)
    env.pop("LINES", None)
    return env


def run_status(daemon: Daemon, *args: str, **env: str) -> list[str]:
    done = subprocess.run(
        daemon.command("status", *args),
        cwd=REPO,
        env=status_env(**env),
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    return lines(done)


@pytest.fixture(scope="module")
def long_reason(daemon: Daemon) -> str:
    """A cancelled task whose reason is far wider than any terminal."""
    task_id = daemon.submit([reply(text("Hello."))], name="wordy")
    daemon.wait_state(task_id, "done", timeout=30)
    task = daemon.task(task_id)
    record = TaskRecord.load(task)
    record.reason = LONG_REASON
    record.save(task)
    return task_id


def test_status_has_age_tokens_cost_and_context_columns(daemon: Daemon, finished: str) -> None:
    out = run_status(daemon)
    header = out[1].split()
    assert header[:5] == ["TASK", "STATE", "AGE", "TURN", "TOKENS"] and header[-1] == "REASON"
    row = next(line.split() for line in out if line.startswith(finished + " "))
    doc = json.loads(daemon.run_cli("status", finished, "--json").stdout)["tasks"][0]
    spent = doc["usage"]["input_tokens"] + doc["usage"]["output_tokens"]
    assert row[1] == "done" and re.fullmatch(r"\d+(s|m\d+s)", row[2]), row
    assert row[3] == str(TURNS) and row[4] == human_count(spent), row
    assert header[5] == "COST" and row[5] == f"${doc['cost_usd']:.2f}", row
    assert header[6] == "CONTEXT" and row[6] == str(doc["tokens_used"]), row


def test_status_json_adds_tokens_used_and_created_at(daemon: Daemon, finished: str) -> None:
    doc = json.loads(daemon.run_cli("status", finished, "--json").stdout)["tasks"][0]
    last = json.loads(daemon.run_cli("history", finished, "--json").stdout)[-1]
    assert doc["tokens_used"] == last["input_tokens"] + last["output_tokens"]
    assert doc["created_at"] == daemon.task(finished).load_spec().created_at


def test_status_cuts_the_reason_at_the_width_columns_gives(
    daemon: Daemon, long_reason: str
) -> None:
    cut = run_status(daemon, COLUMNS="70")
    row = next(line for line in cut if line.startswith(long_reason + " "))
    assert len(row) == 70 and row.endswith("…"), row
    assert all(len(line) <= 70 for line in cut[1:])
    # not a terminal and no COLUMNS: nothing is cut
    whole = run_status(daemon)
    row = next(line for line in whole if line.startswith(long_reason + " "))
    assert row.endswith(LONG_REASON.strip()) and "…" not in row


def test_status_watch_without_a_terminal_prints_snapshots_and_no_escapes(
    daemon: Daemon, finished: str
) -> None:
    got = bytearray()
    with subprocess.Popen(
        daemon.command("status", "--watch", "--interval", "0.2"),
        cwd=REPO,
        env=status_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    ) as proc:
        assert proc.stdout is not None
        stdout = proc.stdout
        os.set_blocking(stdout.fileno(), False)

        def three_snapshots() -> bool:
            got.extend(stdout.read() or b"")
            return got.count(b"\n\nagentd ") >= 2

        try:
            poll_for(three_snapshots, 20, interval=0.05, what="three snapshots")
        finally:
            proc.kill()
    assert b"\x1b" not in got
    snapshots = got.decode().split("\n\n")
    assert all(s.startswith("agentd running") and "TASK" in s for s in snapshots[:3])


def test_status_interval_needs_watch(daemon: Daemon) -> None:
    for args in (["--interval", "1"], ["--watch", "--interval", "0"]):
        done = daemon.run_cli("status", *args)
        assert done.returncode == 2 and "--interval" in done.stderr, done


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_status_watch_redraws_in_place_on_a_terminal(daemon: Daemon, long_reason: str) -> None:
    command = " ".join(daemon.command("status", "--watch", "--interval", "0.3"))
    terminal = Terminal(command, status_env())
    try:
        screens: list[str] = []

        def redrawn() -> bool:
            screens.append(terminal.screen())
            return len(screens) > 10 and "REASON" in screens[-1]

        poll_for(redrawn, 20, interval=0.1, what="a few redraws")
    finally:
        terminal.close()
    screen = screens[-1].splitlines()
    assert screen[0].startswith("agentd running"), screens[-1]
    assert sum("REASON" in line for line in screen) == 1, "each redraw replaces the last"
    row = next(line for line in screen if line.startswith(long_reason + " "))
    assert len(row) == 120 and row.endswith("…"), row


# -- the text form ----------------------------------------------------------------------


def test_a_log_line_quotes_spaces_rounds_floats_and_leaves_out_nulls() -> None:
    event = {
        "event": "restart_scheduled",
        "timestamp": "2026-12-01T09:00:00.000Z",
        "level": "warning",
        "task": "t1",
        "reason": "prompt is too long",
        "delay": 0.4667203114903304,
        "code": None,
        "last_exit": {"code": None, "signal": "SIGKILL"},
        "pids": [12, 13],
        "retried": True,
        "why": 'say "hi"',
    }
    assert log_line(event) == (
        '2026-12-01T09:00:00.000Z warning restart_scheduled reason="prompt is too long" '
        'delay=0.467 last_exit.signal=SIGKILL pids=12,13 retried=true why="say \\"hi\\""'
    )


def test_the_context_column_is_tokens_used_and_a_dash_before_the_first_turn() -> None:
    row: dict[str, Any] = {
        "state": "running",
        "created_at": None,
        "usage": {"input_tokens": 90_000, "output_tokens": 2_000},
        "restarts": 0,
        "pid": 7,
        "heartbeat_age": 0.4,
        "phase": "model",
        "reason": None,
        "dangling": [],
    }
    doc = {
        "supervisor": {"running": True, "pid": 1, "spool": "/spool"},
        "tasks": [
            {**row, "id": "long", "turn": 40, "tokens_used": 41_230},
            {**row, "id": "new", "turn": 0, "tokens_used": None, "usage": {}},
        ],
    }
    lines = render_status(doc, now=0.0).splitlines()
    assert lines[1].split()[4:7] == ["TOKENS", "COST", "CONTEXT"]
    # no cost_usd (a model without a price) is a dash, as is no context yet
    assert [line.split()[4:7] for line in lines[2:]] == [["92.0k", "-", "41.2k"], ["0", "-", "-"]]


def test_the_cost_column_shows_dollars_and_the_usd_budget() -> None:
    assert human_cost(1.35, 1.0) == "$1.35/1.00"
    assert human_cost(2.25, None) == "$2.25"
    assert human_cost(0.000123, None) == "$0.0001"
    assert human_cost(0, 5) == "$0.00/5.00"
    assert human_cost(None, 5) == "-/5.00"
