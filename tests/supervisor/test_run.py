"""``agentd run``: one task in the foreground, on real processes and real signals
(docs/design.md section 16).

Each test runs ``agentd run`` as its own process on a scripted task whose tools
(``tests.run_tools``) append their effects to the workspace's ``ledger``, interrupts it
the way a person does (SIGINT, a second one, kill -9, SIGHUP), resumes it, and reads the
ledger: every effect exactly once. The prompt for a held call is answered on a real
terminal (tmux). Every wait is a deadline poll; every process is ended in teardown.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from supervisor.record import TaskRecord
from supervisor.status import read_heartbeat
from tests.daemon import Daemon, subreaper
from tests.support import (
    REPO,
    Terminal,
    journal_records,
    of_kind,
    poll_for,
    reply,
    text,
    tool_use,
    worker_env,
)
from worker.store.files import FileStore

CONFIG = (
    "max_workers = 2\n"
    "[heartbeat]\ninterval = 0.2\ntimeout = 5.0\n"
    "[restart]\nbackoff_initial = 0.05\nbackoff_max = 0.2\ncrash_loop_limit = 3\n"
    "stop_grace = 5.0\n"
    '[tools]\nmodules = ["tests.run_tools", "tests.crash_tools"]\n'
)


class Foreground(Daemon):
    """A spool and a config for ``agentd run`` (and, for the tests that need one, a
    daemon on the same spool), with the runs started on them."""

    def __init__(self, root: Path) -> None:
        super().__init__(root, CONFIG)
        self.runs = 0

    def script(self, responses: list[dict[str, Any]]) -> Path:
        path = self.root / f"script-{uuid.uuid4().hex[:8]}.json"
        path.write_text(json.dumps({"responses": responses}))
        return path

    def start_run(self, *args: str) -> tuple[subprocess.Popen[bytes], Path, Path]:
        """``agentd run ARGS`` in its own session, without a terminal; its output files."""
        self.runs += 1
        out, err = self.root / f"run{self.runs}.out", self.root / f"run{self.runs}.err"
        with open(out, "wb") as stdout, open(err, "wb") as stderr:
            proc = subprocess.Popen(
                self.command("run", *args),
                cwd=REPO,
                env=worker_env(),
                stdin=subprocess.DEVNULL,
                stdout=stdout,
                stderr=stderr,
                start_new_session=True,
            )
        self.procs.append(proc)
        return proc, out, err

    def run(self, *args: str, timeout: float = 60.0) -> tuple[int, str, str]:
        """``agentd run ARGS`` to its end: (exit code, stdout, stderr)."""
        proc, out, err = self.start_run(*args)
        code = proc.wait(timeout=timeout)
        return code, out.read_text(), err.read_text()

    def new(self, name: str, responses: list[dict[str, Any]], *args: str) -> list[str]:
        """The arguments of a new run of ``responses`` as task ``name``."""
        script = str(self.script(responses))
        return ["--name", name, "--prompt", "Do the task.", "--script", script, *args]

    def ledger(self, task_id: str) -> list[str]:
        path = self.task(task_id).path / "workspace" / "ledger"
        return path.read_text().splitlines() if path.exists() else []

    def phase(self, task_id: str) -> str:
        return str((read_heartbeat(self.task(task_id)) or {}).get("phase", ""))

    def results(self, task_id: str) -> int:
        return len(of_kind(journal_records(self.task(task_id)), "result"))


@pytest.fixture
def fg(tmp_path: Path) -> Iterator[Foreground]:
    with subreaper():
        here = Foreground(tmp_path / "run")
        try:
            yield here
        finally:
            here.cleanup()


def interrupt(proc: subprocess.Popen[bytes], err: Path, sig: int = signal.SIGINT) -> None:
    """Ctrl-C (``sig``) to ``agentd run``, once it has said it heard it."""
    proc.send_signal(sig)
    poll_for(lambda: "next safe point" in err.read_text(), 20, what="the stop to be said")


def two_charges(delay: float = 0.0) -> list[dict[str, Any]]:
    return [
        reply(text("First charge."), tool_use("slow_charge", seconds=0, tag="a")),
        reply(text("Second charge."), tool_use("slow_charge", seconds=0, tag="b"), delay=delay),
        reply(text("Both charged.")),
    ]


# -- to the end -----------------------------------------------------------------------


def test_a_run_streams_what_show_prints_and_ends_done(fg: Foreground) -> None:
    code, out, err = fg.run(*fg.new("plain", two_charges()))
    assert code == 0, err
    shown = fg.cli("show", "plain")
    assert shown[0] == 0 and out == shown[1]
    assert "Both charged." in out and "← slow_charge (unsafe, ran)" in out
    assert err.splitlines()[-1] == "agentd: task plain done: end_turn"
    assert fg.ledger("plain") == ["slow_charge a", "slow_charge b"]
    record = TaskRecord.load(fg.task("plain"))
    assert record.state == "done" and record.foreground
    assert FileStore(fg.spool.root).load_spec("plain").foreground
    assert [e["reason"] for e in fg.events("plain", "task_done")] == ["end_turn"]


def test_run_is_refused_on_a_shared_store_in_one_line(fg: Foreground) -> None:
    code, _, err = fg.cli("--store", "postgresql://127.0.0.1:1/none", "run", "--prompt", "x")
    assert code == 2
    assert err == (
        "agentd: agentd run works on a spool's own files, not on a shared store; "
        "`agentd submit` the task and let a node run it.\n"
    )


def test_run_json_prints_the_lines_of_show_json(fg: Foreground) -> None:
    code, out, err = fg.run(*fg.new("lines", two_charges(), "--json"))
    assert code == 0, err
    shown = fg.cli("show", "lines", "--json")
    assert out == shown[1]
    kinds = [json.loads(line)["kind"] for line in out.splitlines()]
    assert kinds == ["text", *["text", "tool_use", "tool_result"] * 2, "text"]


def test_a_failed_task_exits_1_with_its_reason(fg: Foreground) -> None:
    code, _, err = fg.run(*fg.new("short", [reply(tool_use("slow_read", seconds=0, tag="a"))]))
    assert code == 1
    assert "task short failed:" in err and "script" in err.splitlines()[-1]
    assert TaskRecord.load(fg.task("short")).state == "failed"


def test_a_crashing_worker_is_restarted_until_the_crash_loop_fails_it(fg: Foreground) -> None:
    code, _, err = fg.run(*fg.new("crashy", [reply(tool_use("crash")), reply(text("Done."))]))
    assert code == 1, err
    assert "crash_loop" in err.splitlines()[-1]
    assert err.count("the worker crashed") == 2
    record = TaskRecord.load(fg.task("crashy"))
    assert record.state == "failed" and record.reason == "crash_loop" and record.restarts == 2
    assert record.last_exit == {"code": None, "signal": "SIGKILL"}


def test_a_stopped_worker_dies_of_its_dead_man_and_the_run_resumes_it(fg: Foreground) -> None:
    """SIGSTOP freezes the worker mid model call: its kernel timer kills it a heartbeat
    timeout after its last beat, the run says it hung and restarts it, and the task ends."""
    responses = [reply(text("Thinking."), delay=2.0), reply(text("Done."))]
    proc, _, err = fg.start_run(*fg.new("frozen", responses))
    poll_for(lambda: fg.phase("frozen") == "model", 30, what="the model call")
    pid = TaskRecord.load(fg.task("frozen")).pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    assert proc.wait(timeout=60) == 0, err.read_text()
    said = err.read_text()
    assert f"the worker (pid {pid}) stopped beating; the kernel killed it" in said
    hung = [e for e in fg.events("frozen", "worker_hung") if e["pid"] == pid]
    assert len(hung) == 1 and hung[0]["deadman"] == 5.0 and hung[0]["age"] >= 5.0
    assert TaskRecord.load(fg.task("frozen")).state == "done"


# -- interruptions --------------------------------------------------------------------


def test_ctrl_c_at_a_model_call_stops_at_once_and_resume_charges_each_once(
    fg: Foreground,
) -> None:
    proc, _, err = fg.start_run(*fg.new("model", two_charges(delay=2.0)))
    poll_for(lambda: fg.results("model") == 1 and fg.phase("model") == "model", 30)
    interrupt(proc, err)
    assert proc.wait(timeout=30) == 130
    assert err.read_text().splitlines()[-1].endswith("run --resume model")
    assert TaskRecord.load(fg.task("model")).state == "queued"
    assert fg.ledger("model") == ["slow_charge a"]
    code, out, err_text = fg.run("--resume", "model")
    assert code == 0, err_text
    assert "Both charged." in out and "First charge." not in out  # what is new only
    assert fg.ledger("model") == ["slow_charge a", "slow_charge b"]


@pytest.mark.parametrize("tool", ["slow_read", "slow_set", "slow_send", "slow_charge"])
def test_ctrl_c_at_a_tool_call_waits_for_its_result(fg: Foreground, tool: str) -> None:
    responses = [reply(tool_use(tool, seconds=1.5, tag="a")), reply(text("Done."))]
    proc, _, err = fg.start_run(*fg.new("tool", responses))
    poll_for(lambda: fg.phase("tool") == f"tool:{tool}", 30)
    interrupt(proc, err)
    assert proc.wait(timeout=30) == 130
    assert fg.results("tool") == 1, "the call ran to its recorded result"
    assert fg.ledger("tool") == [f"{tool} a"]
    code, _, err_text = fg.run("--resume", "tool")
    assert code == 0, err_text
    assert fg.ledger("tool") == [f"{tool} a"], "exactly once"


def test_sighup_is_taken_as_ctrl_c(fg: Foreground) -> None:
    proc, _, _ = fg.start_run(*fg.new("hup", two_charges(delay=2.0)))
    poll_for(lambda: fg.results("hup") == 1 and fg.phase("hup") == "model", 30)
    proc.send_signal(signal.SIGHUP)
    assert proc.wait(timeout=30) == 130
    assert fg.run("--resume", "hup")[0] == 0
    assert fg.ledger("hup") == ["slow_charge a", "slow_charge b"]


def test_a_second_ctrl_c_cuts_the_call_off_and_the_pipe_gets_the_hint(fg: Foreground) -> None:
    responses = [reply(tool_use("slow_charge", seconds=60, tag="a")), reply(text("Done."))]
    proc, _, err = fg.start_run(*fg.new("twice", responses))
    poll_for(lambda: fg.phase("twice") == "tool:slow_charge", 30)
    interrupt(proc, err)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) == 130
    assert fg.ledger("twice") == []
    code, _, said = fg.run("--resume", "twice")
    assert code == 3, said
    assert "held" in said and "agentd approve-dangling twice" in said
    assert TaskRecord.load(fg.task("twice")).state == "held"
    assert fg.cli("approve-dangling", "twice", "--all", "--skip", "--reason", "not charged")[0] == 0
    code, out, said = fg.run("--resume", "twice")
    assert code == 0, said
    assert "skipped" in out and fg.ledger("twice") == []
    (decision,) = [r for r in journal_records(fg.task("twice")) if r["k"] == "decision"]
    assert decision["via"] == "cli" and decision["by"] and decision["reason"] == "not charged"


def test_kill_9_of_run_takes_its_worker_and_resume_charges_each_once(fg: Foreground) -> None:
    proc, _, _ = fg.start_run(*fg.new("nine", two_charges(delay=2.0)))
    poll_for(lambda: fg.results("nine") == 1 and fg.phase("nine") == "model", 30)
    pid = int((read_heartbeat(fg.task("nine")) or {})["pid"])
    proc.kill()
    proc.wait(timeout=10)
    store = FileStore(fg.spool.root)
    poll_for(lambda: not store.owned("nine"), 10, what="the worker to die with its run")
    assert not os.path.exists(f"/proc/{pid}") or _zombie(pid)
    row = fg.row("nine")
    assert row["state"] == "queued" and "agentd run --resume nine" in row["reason"], row
    code, _, err = fg.run("--resume", "nine")
    assert code == 0, err
    assert fg.ledger("nine") == ["slow_charge a", "slow_charge b"]


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] == "Z"
    except OSError:
        return True


def test_a_cancel_stops_the_running_worker_and_run_exits_3(fg: Foreground) -> None:
    responses = [reply(tool_use("slow_charge", seconds=60, tag="a")), reply(text("Done."))]
    proc, _, err = fg.start_run(*fg.new("stopme", responses))
    poll_for(lambda: fg.phase("stopme") == "tool:slow_charge", 30)
    assert fg.cli("cancel", "stopme")[0] == 0
    assert proc.wait(timeout=30) == 3
    assert err.read_text().splitlines()[-1] == "agentd: task stopme was cancelled"
    assert TaskRecord.load(fg.task("stopme")).state == "cancelled"
    assert fg.ledger("stopme") == []


def test_a_retry_of_a_task_its_run_is_running_is_refused_and_changes_nothing(
    fg: Foreground,
) -> None:
    responses = [reply(tool_use("slow_charge", seconds=60, tag="a")), reply(text("Done."))]
    proc, _, _ = fg.start_run(*fg.new("busyrun", responses))
    poll_for(lambda: fg.phase("busyrun") == "tool:slow_charge", 30)
    code, _, said = fg.cli("retry", "busyrun")
    assert code == 3 and "busyrun is running" in said, said
    assert TaskRecord.load(fg.task("busyrun")).foreground
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)


# -- resume ---------------------------------------------------------------------------


def test_resume_refuses_submit_options_and_ends_done_and_cancelled_tasks(
    fg: Foreground,
) -> None:
    assert fg.run(*fg.new("once", two_charges()))[0] == 0
    code, _, err = fg.run("--resume", "once", "--model", "x")
    assert code == 2 and "--model cannot go with --resume" in err
    code, out, _ = fg.run("--resume", "once")
    assert code == 0 and out.strip() == "once: done already (end_turn)"
    assert fg.run("--resume", "nosuch")[0] == 3
    script = str(fg.script(two_charges()))
    assert fg.cli("submit", "--name", "gone", "--prompt", "x", "--script", script)[0] == 0
    assert fg.cli("cancel", "gone")[0] == 0
    code, _, err = fg.run("--resume", "gone")
    assert code == 3 and "cancelled" in err


def test_resume_of_a_failed_task_retries_it(fg: Foreground) -> None:
    responses = [reply(tool_use("crash", unless="fixed")), reply(text("Done."))]
    assert fg.run(*fg.new("again", responses))[0] == 1
    (fg.task("again").path / "workspace" / "fixed").touch()
    code, _, err = fg.run("--resume", "again")
    assert code == 0, err
    assert TaskRecord.load(fg.task("again")).retries == 1


# -- a daemon on the same spool -------------------------------------------------------


def test_a_daemon_leaves_a_foreground_task_until_retry_hands_it_over(fg: Foreground) -> None:
    proc, _, err = fg.start_run(*fg.new("mine", two_charges(delay=2.0)))
    poll_for(lambda: fg.results("mine") == 1 and fg.phase("mine") == "model", 30)
    interrupt(proc, err)
    assert proc.wait(timeout=30) == 130
    fg.start()
    code, _, said = fg.run(*fg.new("beside", two_charges(delay=0.3)))  # a new one, beside it
    assert code == 0, said
    assert len(fg.events("beside", "worker_spawned")) == 1
    assert not fg.events("beside", "worker_adopted")
    fg.submit([reply(text("Done."))], "theirs")
    fg.wait_state("theirs", "done")
    assert TaskRecord.load(fg.task("mine")).state == "queued"
    assert len(fg.events("mine", "worker_spawned")) == 1, "the run's worker only"
    code, _, said = fg.run("--resume", "theirs")
    assert code == 0 and "done already" in _ + said
    fg.submit([reply(text("Slowly."), delay=30)], "busy")
    fg.wait_state("busy", "running")
    code, _, said = fg.run("--resume", "busy")
    assert code == 3 and "running" in said, said
    assert fg.cli("retry", "mine") == (0, "mine: handed to the daemon\n", "")
    fg.wait_state("mine", "done")
    assert not TaskRecord.load(fg.task("mine")).foreground
    assert fg.ledger("mine") == ["slow_charge a", "slow_charge b"]


# -- a real terminal ------------------------------------------------------------------


needs_tmux = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")


def held_at_a_charge(fg: Foreground, name: str) -> None:
    """A task held on an unsafe charge cut off by a second Ctrl-C."""
    responses = [reply(tool_use("slow_charge", seconds=60, tag="a")), reply(text("Done."))]
    proc, _, err = fg.start_run(*fg.new(name, responses))
    poll_for(lambda: fg.phase(name) == "tool:slow_charge", 30)
    interrupt(proc, err)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) == 130


def on_a_terminal(fg: Foreground, *args: str, verb: str = "run") -> tuple[Terminal, Path]:
    """``agentd run ARGS`` (or another ``verb``) on a real terminal; the file its exit
    code is written to."""
    status = fg.root / f"status-{uuid.uuid4().hex[:8]}"
    command = shlex.join(fg.command(verb, *args))
    env = worker_env({"NO_COLOR": "1"})
    terminal = Terminal(f"{command}; echo $? > {status}; sleep 60", env, width=150, height=40)
    return terminal, status


@needs_tmux
def test_a_held_call_is_answered_at_the_prompt_on_a_terminal(fg: Foreground) -> None:
    held_at_a_charge(fg, "asked")
    terminal, status = on_a_terminal(fg, "--resume", "asked")
    try:
        poll_for(lambda: "record its result [x]?" in terminal.screen(), 30, what="the prompt")
        terminal.keys("s", "Enter")
        poll_for(lambda: "why" in terminal.screen(), 10, what="the question for a reason")
        terminal.keys("the card was not charged", "Enter")
        poll_for(status.exists, 30, what="the run to end")
        shown = terminal.screen()
    finally:
        terminal.close()
    assert status.read_text().strip() == "0", shown
    assert "skipped (by" in shown and "via run" in shown, shown
    decisions = [r for r in journal_records(fg.task("asked")) if r["k"] == "decision"]
    assert decisions[0]["action"] == "skip" and decisions[0]["via"] == "run"
    assert decisions[0]["reason"] == "the card was not charged" and decisions[0]["by"]
    assert fg.ledger("asked") == []


@needs_tmux
def test_ctrl_c_at_the_prompt_leaves_the_task_held(fg: Foreground) -> None:
    held_at_a_charge(fg, "unasked")
    terminal, status = on_a_terminal(fg, "--resume", "unasked")
    try:
        poll_for(lambda: "record its result [x]?" in terminal.screen(), 30, what="the prompt")
        terminal.keys("C-c")
        poll_for(status.exists, 30, what="the run to end")
        shown = terminal.screen()
    finally:
        terminal.close()
    assert status.read_text().strip() == "130", shown
    assert "run --resume unasked" in shown
    assert TaskRecord.load(fg.task("unasked")).state == "held"
    assert not fg.task("unasked").decisions.exists() or not any(
        fg.task("unasked").decisions.iterdir()
    )


def paid_turns() -> list[dict[str, Any]]:
    """Three turns of $0.45 on the Sonnet 4 family ($3 in, $15 out per million)."""
    usage = {"input_tokens": 100_000, "output_tokens": 10_000}
    turns = [reply(text(f"step {n}"), tool_use("list_dir"), usage=usage) for n in (1, 2)]
    return [*turns, reply(text("Done."), usage=usage)]


def test_a_budget_hold_without_a_terminal_exits_3_with_the_budget_line(fg: Foreground) -> None:
    args = fg.new("spent", paid_turns(), "--model", "claude-sonnet-4-6", "--budget-usd", "0.5")
    code, out, err = fg.run(*args)
    assert code == 3, err
    assert "‖ held: budget: $0.90 of $0.50" in out  # the hold, as `agentd show` renders it
    assert "agentd budget spent --usd X" in err and "run --resume spent" in err
    assert TaskRecord.load(fg.task("spent")).state == "held"
    code, _, err = fg.run("--resume", "spent", "--budget-usd", "3")
    assert code == 2 and "--budget-usd" in err  # submit's options go with a new task only


@needs_tmux
def test_a_budget_hold_asks_for_a_new_budget_at_the_prompt(fg: Foreground) -> None:
    args = fg.new("asked-budget", paid_turns(), "--model", "claude-sonnet-4-6")
    code, _, err = fg.run(*args, "--budget-usd", "0.5")
    assert code == 3, err
    terminal, status = on_a_terminal(fg, "--resume", "asked-budget")
    try:
        poll_for(lambda: "new budget in US dollars" in terminal.screen(), 30, what="the prompt")
        terminal.keys("0.75", "Enter")
        poll_for(lambda: "in tokens" in terminal.screen(), 10, what="the tokens question")
        terminal.keys("Enter")
        poll_for(lambda: "below the $0.90 spent" in terminal.screen(), 10, what="the refusal")
        poll_for(lambda: terminal.screen().count("in US dollars") >= 2, 10, what="asked again")
        terminal.keys("2", "Enter")
        poll_for(lambda: terminal.screen().count("in tokens") >= 2, 10, what="tokens again")
        terminal.keys("Enter")
        poll_for(status.exists, 30, what="the run to end")
        shown = terminal.screen()
    finally:
        terminal.close()
    assert status.read_text().strip() == "0", shown
    (changed,) = [e for e in fg.events("asked-budget") if e["event"] == "budget_changed"]
    assert changed["via"] == "run" and changed["budget"] == {"usd": 2.0, "tokens": None}
    assert fg.row("asked-budget")["cost_usd"] == 1.35


# -- the demo -------------------------------------------------------------------------


def test_the_demo_kills_a_run_partway_and_resume_charges_each_invoice_once(
    tmp_path: Path,
) -> None:
    agentd = Path(sys.executable).parent / "agentd"
    if not agentd.exists():
        pytest.skip("no agentd console script beside this interpreter")
    done = subprocess.run(
        ["sh", str(REPO / "examples" / "run-demo.sh")],
        cwd=REPO,
        env=worker_env({"AGENTD": str(agentd), "TMPDIR": str(tmp_path)}),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "$ kill -9" in done.stdout and "$ agentd run --resume invoices" in done.stdout
    assert done.stdout.rstrip().endswith("every invoice charged exactly once")
    assert done.stdout.count("charged 10 EUR\n") >= 6


def answer(terminal: Terminal, question: str, *keys: str) -> str:
    """Wait for ``question`` on ``terminal``, then type ``keys``; the screen it was asked on."""
    poll_for(lambda: question in terminal.screen(), 30, what=question)
    shown = terminal.screen()
    if keys:
        terminal.keys(*keys)
    return shown


@needs_tmux
def test_a_call_asked_before_it_runs_is_put_to_the_person_and_runs_once_approved(
    fg: Foreground,
) -> None:
    # docs/guides/tools.md: `run --ask` holds the call before it runs, and the prompt
    # says so (not "its outcome is unknown")
    responses = [reply(tool_use("slow_charge", seconds=0, tag="a")), reply(text("Done."))]
    terminal, status = on_a_terminal(fg, *fg.new("approved", responses, "--ask", "slow_*"))
    try:
        shown = answer(terminal, "run it [r], refuse it [s]")
        assert "it has not run: it waits for your approval" in shown, shown
        assert fg.ledger("approved") == []
        terminal.keys("r", "Enter")
        poll_for(status.exists, 30, what="the run to end")
        shown = terminal.screen()
    finally:
        terminal.close()
    assert status.read_text().strip() == "0", shown
    assert fg.ledger("approved") == ["slow_charge a"]
    (decision,) = of_kind(journal_records(fg.task("approved")), "decision")
    assert (decision["action"], decision["attempt"], decision["via"]) == ("rerun", 1, "run")


@needs_tmux
def test_approve_dangling_on_a_terminal_shows_the_call_and_asks(fg: Foreground) -> None:
    # docs/guides/tools.md: a bare decision on an unsafe call of unknown outcome, or
    # one without --attempt, shows the call (tool, input, start, what is known) and asks
    held_at_a_charge(fg, "shown")
    assert fg.run("--resume", "shown")[0] == 3  # (no terminal: held, for approve-dangling)
    (row,) = json.loads(fg.cli("dangling", "shown", "--json")[1])
    for said, code in (("n", "1"), ("y", "0")):
        terminal, status = on_a_terminal(fg, "shown", row["call_id"], verb="approve-dangling")
        try:
            shown = answer(terminal, "run it again? [y/N]", said, "Enter")
            assert "slow_charge (unsafe), attempt 1, started" in shown, shown
            assert '"tag": "a"' in shown and "its outcome is unknown" in shown, shown
            poll_for(status.exists, 30, what="the command to end")
            shown = terminal.screen()
        finally:
            terminal.close()
        assert status.read_text().strip() == code, shown
        decisions = list(fg.task("shown").decisions.glob("*.json"))
        assert len(decisions) == int(code == "0"), shown
    assert "shown " + row["call_id"] + " attempt 1: rerun" in shown
    assert json.loads(decisions[0].read_text())["attempt"] == 1
