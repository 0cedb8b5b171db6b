"""A call's result in hand is not lost to the database (invariant 8): the connection is
cut right as the result's write reaches the server (``SeverableProxy.sever_at_reply``),
and the worker waits, reads back what was written and writes the result once the
database is back. The unsafe call ran once and the task ends done, never held. Only the
fence bounds the wait: a lease taken over meanwhile stops the worker with nothing
written, and the new owner finds the call dangling (invariant 2)."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.postgres import SeverableProxy
from tests.store.test_loop_on_store import SCRIPT
from tests.store.test_postgres import _reachable
from tests.support import poll_for, reply, text, tool_use
from worker.config import Config
from worker.lease import LeaseKeeper
from worker.loop import AgentLoop, Outcome
from worker.models.scripted import ScriptedModel
from worker.protocol import ExitCode
from worker.spool import TaskSpec
from worker.state import fold
from worker.store.postgres import PostgresStore
from worker.tools.registry import ToolRegistry


@pytest.fixture
def proxy(postgres_url: str) -> Iterator[SeverableProxy]:
    with SeverableProxy.in_front_of(postgres_url) as cut:
        yield cut


def cut_after(tools: ToolRegistry, name: str, cut: Callable[[], None]) -> ToolRegistry:
    """``tools`` whose ``name`` cuts the link (``cut``) as it returns, before the worker
    writes its result."""
    tool = tools.get(name)
    assert tool is not None

    def run_then_cut(*args: Any, **kwargs: Any) -> str:
        answer = tool.func(*args, **kwargs)
        cut()
        return answer

    others = [t for t in tools if t.name != name]
    return ToolRegistry([*others, dataclasses.replace(tool, func=run_then_cut)])


def leased_loop(
    store: PostgresStore, workspace: Path, cut: Callable[[], None]
) -> tuple[AgentLoop, LeaseKeeper]:
    (owner,) = store.claim(1)
    lease = LeaseKeeper(store, owner, store.lease, on_lost=lambda exc: None)
    loop = AgentLoop(
        store,
        store.load_spec("t1"),
        Config(),
        ScriptedModel(SCRIPT),
        cut_after(ToolRegistry.standard(), "append_file", cut),
        workspace=workspace,
        owner=owner,
        fence=lease.check,
        result_wait=lease.waiting,
    )
    return loop, lease


def restore_once_cut(
    proxy: SeverableProxy, cut: Callable[[], bool], before: Callable[[], object] = lambda: None
) -> threading.Thread:
    """On a thread: once the cut came, wait a second (the worker meets the database away
    and retries), run ``before``, then let the database be reached again."""

    def run() -> None:
        poll_for(cut, what="the cut at the result's write")
        threading.Event().wait(1.0)
        before()
        proxy.restore()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_a_result_whose_write_was_cut_is_written_once_the_database_is_back(
    postgres_schema: str, proxy: SeverableProxy, tmp_path: Path
) -> None:
    store = PostgresStore(proxy.url_for(postgres_schema), node="a", lease=30.0, migrate=True)
    try:
        store.create(TaskSpec(id="t1", prompt="Write a file."), {"state": "queued"})
        workspace = tmp_path / "workspace"
        workspace.mkdir()
        loop, _ = leased_loop(store, workspace, proxy.sever_at_reply)
        restore_once_cut(proxy, lambda: proxy.severed_at_reply == 1)
        outcome = loop.run()
        loop.close()
        assert outcome == Outcome("done", "end_turn", ExitCode.DONE)
        assert proxy.severed_at_reply == 1
        assert (workspace / "a.txt").read_text() == "hi!"  # the unsafe call ran once
        records = store.replay("t1")
        kinds = [r["k"] for r in records]
        assert "hold" not in kinds and kinds.count("result") == 2 and kinds[-1] == "end"
        assert fold("Write a file.", records).dangling() == []
        events = [e["event"] for e in store.read_events("t1")[0]]
        assert "result_written" in events
    finally:
        store.close()


def test_a_lease_taken_over_meanwhile_stops_the_worker_with_nothing_written(
    postgres_schema: str, proxy: SeverableProxy, tmp_path: Path
) -> None:
    """The fence, not a clock, bounds the wait: another node took the task while the
    database was away from this one, so the result cannot be written under this epoch.
    The worker stops (``lease_lost``); the call is the new owner's to hold. (The link is
    cut before the result's write leaves: it never reached the server.)"""
    store = PostgresStore(proxy.url_for(postgres_schema), node="a", lease=1.0, migrate=True)
    other = PostgresStore(postgres_schema, node="b", lease=30.0)
    try:
        store.create(TaskSpec(id="t1", prompt="Write a file."), {"state": "queued"})
        workspace = tmp_path / "workspace"
        workspace.mkdir()
        severed = threading.Event()

        def sever() -> None:
            proxy.sever()
            severed.set()

        loop, _ = leased_loop(store, workspace, sever)
        restorer = restore_once_cut(
            proxy,
            severed.is_set,
            before=lambda: poll_for(lambda: bool(other.claim(1)), what="b's claim"),
        )
        outcome = loop.run()
        restorer.join()
        loop.close()
        assert (outcome.state, outcome.exit_code, outcome.fenced) == (
            "stopped",
            ExitCode.STOPPED,
            True,
        )
        last = other.replay("t1")[-1]  # the new owner's to settle: held, as unsafe
        assert (last["k"], last["tool"], last["effect"]) == ("intent", "append_file", "unsafe")
        assert (workspace / "a.txt").read_text() == "hi!"  # and it ran once
        poll_for(lambda: _reachable(store), what="the store to reconnect")
    finally:
        store.close()
        other.close()


def test_a_fault_met_as_a_command_is_wrapped_is_a_wait_never_the_command_s_result(
    postgres_schema: str, proxy: SeverableProxy, tmp_path: Path
) -> None:
    """The link is cut right as run_command is to start (its intent recorded). The
    sandbox hides every other task's workspace, whose list is read from the store before
    the intent, not as the command is wrapped: so the command runs, once, and its result
    waits for the database. (Read as it was wrapped, the fault was recorded as the
    command's failed result, and the task went on though the command never ran.)"""
    store = PostgresStore(proxy.url_for(postgres_schema), node="a", lease=30.0, migrate=True)
    try:
        store.create(TaskSpec(id="t1", prompt="Run it."), {"state": "queued"})
        other = TaskSpec(id="t2", prompt="Another.", workspace=str(tmp_path / "other"))
        store.create(other, {"state": "queued"})  # (a workspace the sandbox hides)
        workspace = tmp_path / "workspace"
        workspace.mkdir()
        (owner,) = store.claim(1)
        assert owner.task_id == "t1"
        lease = LeaseKeeper(store, owner, store.lease, on_lost=lambda exc: None)
        severed = threading.Event()

        def fence() -> None:  # right before the tool runs, once
            lease.check()
            if not severed.is_set():
                proxy.sever()
                severed.set()

        script = [
            reply(tool_use("run_command", "c1", command="echo ran >> ran.txt")),
            reply(text("Done.")),
        ]
        loop = AgentLoop(
            store,
            store.load_spec("t1"),
            Config(),
            ScriptedModel(script),
            ToolRegistry.standard(),
            workspace=workspace,
            owner=owner,
            fence=fence,
            result_wait=lease.waiting,
        )
        assert loop.sandbox.verdict() == "bwrap"  # (CI runs it: bwrap is in .ci/system-tools)
        restore_once_cut(proxy, severed.is_set)
        outcome = loop.run()
        loop.close()
        assert outcome == Outcome("done", "end_turn", ExitCode.DONE)
        assert (workspace / "ran.txt").read_text() == "ran\n"  # the command ran, once
        (result,) = [r for r in store.replay("t1") if r["k"] == "result"]
        assert not result["is_error"] and result["content"].startswith("exit code 0"), result
    finally:
        store.close()
