"""A tool never outlives its worker's lease, even on a frozen node (docs/design.md section
10): two real nodes on PostgreSQL, node a runs an unsafe ``sleep 4; echo charged >>
ledger.txt``, and its whole process tree is stopped (SIGSTOP) for longer than the lease.
Node b takes the task over and holds the dangling call; the operator approves a re-run,
which charges once. Node a's worker was killed by the kernel at its lease's end while
stopped (``worker.killtimer``), its sandbox with it, so the thaw charges nothing more."""

from __future__ import annotations

import contextlib
import json
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from tests.chaos.trees import freeze_tree, thaw
from tests.daemon import subreaper
from tests.supervisor.test_cluster import LEASE, Node
from tests.supervisor.test_cluster_faults import CONFIG
from tests.support import poll_for, reply, text, tool_use

CHARGE = "sleep 4; echo charged >> ledger.txt"


def test_a_frozen_node_s_tool_dies_at_its_lease_and_charges_nothing_after_the_thaw(
    tmp_path: Path, postgres_schema: str
) -> None:
    workspace = tmp_path / "shared-workspace"  # (a shared mount: both nodes see it)
    workspace.mkdir()
    ledger = workspace / "ledger.txt"
    made = [Node(tmp_path, name, postgres_schema, CONFIG) for name in ("a", "b")]
    with subreaper():
        frozen: list[psutil.Process] = []
        try:
            a, b = made
            a.start()  # alone at first: the task is a's
            script = tmp_path / "charge.json"
            responses = [reply(tool_use("run_command", "c1", command=CHARGE)), reply(text("ok"))]
            script.write_text(json.dumps({"responses": responses}))
            done = a.agentd(
                "submit", "--name", "t1", "--prompt", "go", "--script", str(script),
                "--workspace", str(workspace),
            )  # fmt: skip
            assert done.returncode == 0, done.stderr
            poll_for(lambda: a.row("t1")["phase"] == "tool:run_command", 30, what="t1's call")
            b.start()
            assert a.daemon.proc is not None
            frozen = freeze_tree(a.daemon.proc.pid)
            stopped_at = time.monotonic()
            tools = [p for p in frozen if _is_tool(p)]
            assert tools, [p.pid for p in frozen]
            # dead while their parents are stopped: zombies, none to reap them until the thaw
            killed = _within(lambda: all(map(_dead, tools)), LEASE * 5)
            died_after = time.monotonic() - stopped_at
            if killed:
                print(
                    f"frozen tool killed {died_after:.2f} s after the freeze "
                    f"(lease {LEASE:g} s; the kill comes 0.9 of it after the last renewal)"
                )
            poll_for(lambda: b.row("t1")["state"] == "held", LEASE * 10, what="t1 held on b")
            held = b.row("t1")
            assert [d["call_id"] for d in held["dangling"]] == ["c1"]
            # the hold names the frozen owner and when its lease ended
            assert re.search(
                r"it was running on node a \(epoch \d+\), whose lease ended at "
                r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z without a renewal",
                held["reason"],
            ), held["reason"]
            approved = b.agentd("approve-dangling", "t1", "c1", "--rerun")
            assert approved.returncode == 0, approved.stderr
            poll_for(lambda: b.row("t1")["state"] == "done", 40, what="t1 done after the re-run")
            assert ledger.read_text().split() == ["charged"]
            thaw(frozen)
            time.sleep(6.0)  # longer than the frozen call had left to run
            assert ledger.read_text().split() == ["charged"]  # charged once, never twice
            assert killed, f"the frozen tool was alive {died_after:.1f} s after the freeze"
            assert a.daemon.proc.poll() is None  # node a serves on
        finally:
            thaw(frozen)
            for node in made:
                node.daemon.cleanup()


def _within(predicate: Callable[[], bool], timeout: float) -> bool:
    """Whether ``predicate`` comes true within ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)
    return True


def _dead(proc: psutil.Process) -> bool:
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _is_tool(proc: psutil.Process) -> bool:
    """A process of the call: bwrap, or the command's shell or its sleep."""
    try:
        cmdline = proc.cmdline()
    except psutil.Error:
        return False
    return bool(cmdline) and (
        "bwrap" in cmdline[0] or any("charged" in part for part in cmdline) or cmdline[0] == "sleep"
    )


@dataclass
class Frozen:
    """Nodes a and b, and node a's tree frozen mid-charge (``frozen_mid_charge``)."""

    a: Node
    b: Node
    frozen: list[psutil.Process]
    ledger: Path


@contextlib.contextmanager
def frozen_mid_charge(tmp_path: Path, url: str, before: list[dict[str, Any]]) -> Iterator[Frozen]:
    """Nodes a and b, a task t1 whose unsafe CHARGE (call c9) runs on node a after the
    calls ``before``, and node a's whole tree frozen mid-call (SIGSTOP); thawed and
    cleaned up after the block."""
    workspace = tmp_path / "shared-workspace"  # (a shared mount: both nodes see it)
    workspace.mkdir()
    a, b = (Node(tmp_path, name, url, CONFIG) for name in ("a", "b"))
    frozen: list[psutil.Process] = []
    with subreaper():
        try:
            a.start()
            script = tmp_path / "charge.json"
            charge = reply(tool_use("run_command", "c9", command=CHARGE))
            script.write_text(json.dumps({"responses": [*before, charge, reply(text("ok"))]}))
            done = a.agentd(
                "submit", "--name", "t1", "--prompt", "go", "--script", str(script),
                "--workspace", str(workspace),
            )  # fmt: skip
            assert done.returncode == 0, done.stderr
            turn = len(before) + 1
            poll_for(
                lambda: (row := a.row("t1"))["phase"] == "tool:run_command" and row["turn"] == turn,
                30,
                what="t1's charge running on a",
            )
            b.start()
            assert a.daemon.proc is not None
            frozen = freeze_tree(a.daemon.proc.pid)
            yield Frozen(a, b, frozen, workspace / "ledger.txt")
        finally:
            thaw(frozen)
            for node in (a, b):
                node.daemon.cleanup()


def test_a_cancel_of_a_task_on_a_frozen_node_is_made_at_once_and_says_what_may_still_run(
    tmp_path: Path, postgres_schema: str
) -> None:
    with frozen_mid_charge(tmp_path, postgres_schema, []) as it:
        done = it.b.agentd("cancel", "t1")
        assert done.returncode == 0, done.stderr
        said = re.fullmatch(
            r"agentd: t1 cancelled; node a has not renewed its lease \(ends in "
            r"(\d+\.\d) s\); its running call c9 may still complete until then\n",
            done.stdout,
        )
        assert said is not None, done.stdout
        assert float(said.group(1)) <= LEASE
        assert it.b.row("t1")["state"] == "cancelled"  # made, while node a is still frozen
        assert all(p.status() == psutil.STATUS_STOPPED for p in it.frozen if not _dead(p))
        time.sleep(LEASE)  # past the lease: the kernel killed the frozen worker
        thaw(it.frozen)
        time.sleep(6.0)  # longer than the frozen call had left to run
        assert not it.ledger.exists()  # nothing charged after the cancel
        row = it.b.row("t1")
        assert (row["state"], row["node"]) == ("cancelled", None)  # and it stays so
        assert it.a.daemon.proc is not None and it.a.daemon.proc.poll() is None


def test_a_rewind_of_a_task_on_a_frozen_node_says_its_call_may_still_complete(
    tmp_path: Path, postgres_schema: str
) -> None:
    first = reply(tool_use("run_command", "c1", command="echo one >> log.txt"))
    with frozen_mid_charge(tmp_path, postgres_schema, [first]) as it:
        done = it.b.agentd("rewind", "t1", "--to", "1", "--yes")
        assert done.returncode == 0, done.stderr
        assert re.search(
            r"^cut off: turn 2 run_command \(unsafe\) c9: node a has not renewed its lease "
            r"\(ends in \d+\.\d s\); it may still complete until then, and its outcome "
            r"is unknown$",
            done.stdout,
            re.MULTILINE,
        ), done.stdout
        assert "t1: rewound to turn 1" in done.stdout
        row = poll_for(
            lambda: (r := it.b.row("t1"))["state"] == "done" and r, 60, what="t1 done on b"
        )
        assert row["reason"] == "end_turn"
        charged = it.ledger.read_text() if it.ledger.exists() else ""
        time.sleep(LEASE)
        thaw(it.frozen)
        time.sleep(6.0)  # longer than the frozen call had left to run
        assert (it.ledger.read_text() if it.ledger.exists() else "") == charged  # none after
        assert it.a.daemon.proc is not None and it.a.daemon.proc.poll() is None
