"""Approvals (docs/guides/tools.md), against a real daemon and the real CLI: calls that
wait for approval before they run, decisions bound to the attempt the operator saw and
used once across a kill -9, an unsafe re-run said explicitly, and decisions that expire."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from supervisor.status import load_state
from tests.daemon import Daemon, config_text, parse_time
from tests.support import journal_records, of_kind, poll_for, reply, text, tool_use
from worker.canonical import input_sha256

#: An unsafe command that adds a line to the workspace's ledger each time it runs, then
#: waits (so that a test can kill the worker while it runs).
CHARGE = "echo charged >> ledger; exec sleep 60"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    root = tmp_path_factory.mktemp("approvals")
    hook = root / "held-hook"
    extra = f'[hooks]\non_held = ["sh", "-c", "cat >> {hook}"]\n'
    daemon = Daemon(root, config_text(tools='ask = ["crash"]\n', extra=extra))
    try:
        daemon.start()
        yield daemon
    finally:
        daemon.cleanup()


def submit(daemon: Daemon, name: str, blocks: list[dict[str, Any]], *options: str) -> Path:
    """``agentd submit`` of a scripted task whose first reply makes ``blocks``; its workspace."""
    script = daemon.root / f"{name}.json"
    script.write_text(json.dumps({"responses": [reply(*blocks), reply(text("Done."))]}))
    done = daemon.run_cli(
        "submit", "--name", name, "--prompt", "go", "--script", str(script), *options
    )
    assert done.returncode == 0, done.stderr
    return daemon.task(name).path / "workspace"


def held_rows(daemon: Daemon, name: str) -> list[dict[str, Any]]:
    done = daemon.run_cli("dangling", name, "--json")
    assert done.returncode == 0, done.stderr
    rows: list[dict[str, Any]] = json.loads(done.stdout)
    return rows


def result_of(daemon: Daemon, name: str, call_id: str) -> dict[str, Any]:
    call = load_state(daemon.task(name)).calls[call_id]
    assert call.result is not None
    return dict(call.result)


def test_a_call_asked_before_it_runs_waits_and_runs_once_approved(daemon: Daemon) -> None:
    command = {"command": "echo charged >> ledger", "timeout": 30}
    call = tool_use("run_command", "toolu_ask1", **command)
    workspace = submit(daemon, "ask-run", [call], "--ask", "run_command")
    row = daemon.wait_state("ask-run", "held")
    assert row["reason"] == "approval: run_command"
    assert not (workspace / "ledger").exists()  # it never ran
    spec = json.loads(daemon.task("ask-run").spec.read_text())
    assert spec["ask"] == ["run_command"]
    (asked,) = daemon.events("ask-run", "approval_requested")
    assert (asked["level"], asked["call_id"], asked["attempt"]) == ("warning", "toolu_ask1", 1)
    (intent,) = of_kind(journal_records(daemon.task("ask-run")), "intent")
    assert intent["asked"] is True
    (held,) = held_rows(daemon, "ask-run")
    assert (held["stage"], held["attempt"], held["effect"]) == ("before", 1, "unsafe")
    assert held["input_sha256"] == input_sha256(command)
    hook = daemon.root / "held-hook"
    poll_for(lambda: hook.exists() and "ask-run" in hook.read_text(), 30, what="on_held")
    # a decision for an attempt that is not the held one is refused, and names the held one
    stale = daemon.run_cli("approve-dangling", "ask-run", "toolu_ask1", "--attempt", "2", "--rerun")
    assert stale.returncode == 3, stale
    assert "attempt 1" in stale.stderr and "agentd dangling ask-run" in stale.stderr
    assert len(stale.stderr.strip().splitlines()) == 1
    done = daemon.run_cli("approve-dangling", "ask-run", "toolu_ask1", "--attempt", "1", "--rerun")
    assert (done.returncode, done.stdout) == (0, "ask-run toolu_ask1 attempt 1: rerun\n"), done
    daemon.wait_state("ask-run", "done")
    assert (workspace / "ledger").read_text() == "charged\n"  # run once, for the first time
    result = result_of(daemon, "ask-run", "toolu_ask1")
    assert result["outcome"] == "ran" and not result["is_error"]


def test_an_asked_call_refused_tells_the_model_it_was_not_approved(daemon: Daemon) -> None:
    workspace = submit(daemon, "ask-skip", [tool_use("crash", "toolu_ask2")])  # ([tools] ask)
    assert daemon.wait_state("ask-skip", "held")["reason"] == "approval: crash"
    (held,) = held_rows(daemon, "ask-skip")
    assert (held["stage"], held["effect"]) == ("before", "idempotent")
    done = daemon.run_cli(
        "approve-dangling", "ask-skip", "--all", "--skip", "--reason", "not today"
    )
    assert (done.returncode, done.stdout) == (0, "ask-skip toolu_ask2 attempt 1: skip\n"), done
    daemon.wait_state("ask-skip", "done")
    result = result_of(daemon, "ask-skip", "toolu_ask2")
    assert result["content"] == "not executed: this call was not approved (not today)"
    assert result["outcome"] == "skipped" and "crash" not in result["content"]
    assert daemon.row("ask-skip")["restarts"] == 0 and workspace.exists()


def test_a_rerun_cut_off_is_a_new_attempt_never_run_again_on_the_old_decision(
    daemon: Daemon,
) -> None:
    workspace = submit(
        daemon,
        "ask-kill",
        [tool_use("run_command", "toolu_k", command=CHARGE, timeout=90)],
        "--ask",
        "run_command",
    )
    daemon.wait_state("ask-kill", "held")
    ledger = workspace / "ledger"
    done = daemon.run_cli("approve-dangling", "ask-kill", "toolu_k", "--rerun")
    assert (done.returncode, done.stdout) == (0, "ask-kill toolu_k attempt 1: rerun\n"), done
    row = daemon.wait_row(
        "ask-kill",
        lambda r: r["phase"] == "tool:run_command" and ledger.exists(),
        what="the approved call to run",
    )
    os.kill(row["pid"], signal.SIGKILL)  # cut off while it runs, on the decision
    row = daemon.wait_row("ask-kill", lambda r: r["state"] == "held" and r["pid"] is None)
    assert row["reason"].startswith("dangling run_command call toolu_k")
    (held,) = held_rows(daemon, "ask-kill")
    assert (held["stage"], held["attempt"]) == ("unknown", 2)
    assert ledger.read_text() == "charged\n"  # not run again on the old decision
    # the old attempt's decision again: refused, and so is a bare re-run with no terminal
    stale = daemon.run_cli("approve-dangling", "ask-kill", "toolu_k", "--attempt", "1", "--rerun")
    assert stale.returncode == 3 and "attempt 2" in stale.stderr, stale
    bare = daemon.run_cli("approve-dangling", "ask-kill", "toolu_k")
    assert bare.returncode == 2 and "--rerun" in bare.stderr, bare
    assert len(bare.stderr.strip().splitlines()) == 1
    assert not list(daemon.task("ask-kill").decisions.glob("*.2.json"))
    done = daemon.run_cli(
        "approve-dangling", "ask-kill", "toolu_k", "--attempt", "2", "--result", "charged once"
    )
    assert (done.returncode, done.stdout) == (0, "ask-kill toolu_k attempt 2: result\n"), done
    daemon.wait_state("ask-kill", "done")
    assert ledger.read_text() == "charged\n"
    decisions = of_kind(journal_records(daemon.task("ask-kill")), "decision")
    assert [(d["attempt"], d["action"]) for d in decisions] == [(1, "rerun"), (2, "result")]


def test_an_unsafe_call_of_unknown_outcome_is_rerun_only_when_said(daemon: Daemon) -> None:
    submit(daemon, "unsafe-bare", [tool_use("run_command", "toolu_u", command=CHARGE, timeout=90)])
    ledger = daemon.task("unsafe-bare").path / "workspace" / "ledger"
    row = daemon.wait_row(
        "unsafe-bare",
        lambda r: r["phase"] == "tool:run_command" and ledger.exists(),
        what="the charge",
    )
    os.kill(row["pid"], signal.SIGKILL)
    daemon.wait_state("unsafe-bare", "held")
    for args in (["toolu_u"], ["--all"]):
        bare = daemon.run_cli("approve-dangling", "unsafe-bare", *args)
        assert bare.returncode == 2, bare
        assert "unsafe run_command call whose outcome is unknown" in bare.stderr
    assert not daemon.task("unsafe-bare").decisions.exists() or not list(
        daemon.task("unsafe-bare").decisions.iterdir()
    )
    done = daemon.run_cli("approve-dangling", "unsafe-bare", "--all", "--skip")
    assert (done.returncode, done.stdout) == (0, "unsafe-bare toolu_u attempt 1: skip\n"), done
    daemon.wait_state("unsafe-bare", "done")
    assert ledger.read_text() == "charged\n"


@pytest.fixture
def timed(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Daemon]:
    """A daemon with the ``[approvals]`` keys its test gives (``request.param``)."""
    daemon = Daemon(tmp_path, config_text(extra=f"[approvals]\n{request.param}\n"))
    try:
        daemon.start()
        yield daemon
    finally:
        daemon.cleanup()


@pytest.mark.parametrize("timed", ['ask_timeout = "2s"'], indirect=True)
def test_an_asked_call_not_answered_in_time_is_skipped(timed: Daemon) -> None:
    command = {"command": "echo charged >> ledger", "timeout": 30}
    workspace = submit(
        timed, "ask-late", [tool_use("run_command", "toolu_l", **command)], "--ask", "run_command"
    )
    row = timed.wait_state("ask-late", "done", "failed", timeout=60)
    assert row["state"] == "done", row
    result = result_of(timed, "ask-late", "toolu_l")
    assert result["content"] == "not executed: this call was not approved (no approval within 2s)"
    assert result["outcome"] == "skipped" and not (workspace / "ledger").exists()
    decided = timed.events("ask-late", "dangling_decided")  # (made, then applied)
    assert decided and all(e["action"] == "skip" and "by" not in e for e in decided)
    (asked,) = timed.events("ask-late", "approval_requested")
    (decision,) = of_kind(journal_records(timed.task("ask-late")), "decision")
    waited = parse_time(decision["at"]) - parse_time(asked["timestamp"])
    assert waited >= 2.0, waited


@pytest.mark.parametrize("timed", ['expire_after = "1h"'], indirect=True)
def test_a_decision_no_worker_used_before_it_expired_is_void(timed: Daemon) -> None:
    command = {"command": "echo charged >> ledger", "timeout": 30}
    workspace = submit(
        timed, "ask-old", [tool_use("run_command", "toolu_o", **command)], "--ask", "run_command"
    )
    timed.wait_state("ask-old", "held")
    timed.stop()
    try:
        done = timed.run_cli("approve-dangling", "ask-old", "toolu_o", "--rerun")
        assert done.returncode == 0, done
        # the decision was made two hours ago, and no worker used it since
        (made,) = timed.task("ask-old").decisions.iterdir()
        decision = json.loads(made.read_text())
        decision["decided_at"] = "2000-01-01T00:00:00.000Z"
        made.write_text(json.dumps(decision))
    finally:
        timed.start()
    row = timed.wait_row("ask-old", lambda r: r["state"] == "held" and r["pid"] is None)
    assert row["reason"] == "approval: run_command"
    (expired,) = timed.events("ask-old", "approval_expired")
    assert (expired["level"], expired["attempt"]) == ("warning", 2)
    (held,) = held_rows(timed, "ask-old")
    assert (held["stage"], held["attempt"]) == ("before", 2)
    assert not (workspace / "ledger").exists()
    assert of_kind(journal_records(timed.task("ask-old")), "decision") == []
    done = timed.run_cli("approve-dangling", "ask-old", "toolu_o", "--attempt", "2", "--rerun")
    assert done.returncode == 0, done
    timed.wait_state("ask-old", "done")
    assert (workspace / "ledger").read_text() == "charged\n"
